"""Memory accounting: the saved-tensor ledger (formulas) and measured process memory (the OS); the
timing and counting harness the benchmarks share (wall time, interleaved rounds, host syncs, kernels).

``gradient_fidelity`` (how far a policy moves gradients, the other number a policy is chosen by)
runs a training step under a policy, so it lives a layer above, in
:mod:`edgetorch.activations.fidelity` (``edgetorch.gradient_fidelity``); asking this module for it
says so.
"""

from typing import Any

from .counters import (AllocatorPeak, CallCount, KernelProfile, allocator_peak, count_calls, count_host_syncs,
                       kernel_profile)
from .ledger import SavedRecord, SavedTensorLedger, Totals, model_memory, tensor_bytes
from .machine import machine_description
from .process import peak_rss_bytes, process_peak_rss_bytes, reset_peak_rss, rss_bytes, run_fresh, uss_bytes
from .timing import (CallCost, Ratios, event_time, interleave, interleave_rounds, per_call, ratios, rotation,
                     synchronize, wall_time, within)

__all__ = [
    "AllocatorPeak",
    "CallCost",
    "CallCount",
    "KernelProfile",
    "Ratios",
    "SavedRecord",
    "SavedTensorLedger",
    "Totals",
    "allocator_peak",
    "count_calls",
    "count_host_syncs",
    "event_time",
    "interleave",
    "interleave_rounds",
    "kernel_profile",
    "machine_description",
    "model_memory",
    "peak_rss_bytes",
    "per_call",
    "process_peak_rss_bytes",
    "ratios",
    "reset_peak_rss",
    "rotation",
    "rss_bytes",
    "run_fresh",
    "synchronize",
    "tensor_bytes",
    "uss_bytes",
    "wall_time",
    "within",
]


def __getattr__(name: str) -> Any:
    if name in ("GradientFidelity", "gradient_fidelity"):  # its home until the layers were enforced
        raise AttributeError(f"edgetorch.measure.{name} moved: use edgetorch.{name} (defined in "
                             "edgetorch.activations.fidelity; it runs a step under a policy, a layer above measure)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
