"""Memory accounting: the saved-tensor ledger (formulas) and measured process memory (the OS).

``gradient_fidelity`` (how far a policy moves gradients, the other number a policy is chosen by)
is found here too, but it runs a training step under a policy, so it is defined in
:mod:`edgetorch.activations.fidelity`, a layer above, and imported only when first asked for.
"""

from typing import Any

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


def __getattr__(name: str) -> Any:
    # Imported on first use: importing measure (as activations does) must not import activations.
    if name in ("GradientFidelity", "gradient_fidelity"):
        from ..activations import fidelity

        return getattr(fidelity, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
