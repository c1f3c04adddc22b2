"""Memory accounting: the saved-tensor ledger (formulas) and measured process memory (the OS)."""

from .ledger import SavedRecord, SavedTensorLedger, Totals, model_memory, tensor_bytes
from .machine import machine_description
from .process import peak_rss_bytes, process_peak_rss_bytes, reset_peak_rss, rss_bytes, run_fresh, uss_bytes

__all__ = [
    "SavedRecord",
    "SavedTensorLedger",
    "Totals",
    "machine_description",
    "model_memory",
    "peak_rss_bytes",
    "process_peak_rss_bytes",
    "reset_peak_rss",
    "rss_bytes",
    "run_fresh",
    "tensor_bytes",
    "uss_bytes",
]
