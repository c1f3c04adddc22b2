"""One training step per policy, each in a fresh process: ledger bytes and measured memory side by side.

Run as ``python -m edgetorch.activations.profile`` with a JSON request on stdin (what
:func:`profile_policies` does for each policy); it prints one JSON result line.

Measured numbers: a warm-up step first (so gradients, optimizer state, kernel compilation and
allocator pools exist, as in a real training loop), then the peak-RSS counter is reset and one
more step is measured. ``peak_memory_bytes`` is that step's process peak RSS (CPU) or the CUDA
allocator's peak. ``step_peak_increase_bytes`` and ``forward_increase_bytes`` subtract what was
held before the step, in the same unit as the peak: resident memory on the CPU, the CUDA
allocator's allocated bytes on a GPU (host RSS says nothing about GPU memory).

With ``fidelity`` set, the worker then compares the policy's gradients with plain PyTorch's on
the same batch (:func:`~edgetorch.activations.fidelity.gradient_fidelity`), after the measured
step, so the measurement does not include it.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.nn import functional as F

from ..measure import SavedTensorLedger, machine_description, model_memory, run_fresh
from ..measure.process import held_bytes, peak_bytes, peak_kind, reset_peak, rss_bytes, uss_bytes
from .batchnorm import freeze_batchnorm
from .fidelity import gradient_fidelity
from .step import parse_training_policy, storing


@dataclass(frozen=True)
class ProfileRequest:
    """What to profile: a model spec, an input size, one policy spec (``POLICY`` or
    ``POLICY+checkpoint``), a device."""

    model: str
    batch: int
    resolution: int
    policy: str = "dense"
    channels: int | None = None  # None: the first conv's in_channels, else 1
    num_classes: int = 10
    device: str = "cpu"
    seed: int = 0
    freeze_batchnorm: bool = False  # the Back Razor paper's choice: BN statistics and affine frozen
    fidelity: bool = False  # also compare the gradients with plain PyTorch's (gradient_fidelity)


def profile_policies(
    model: str,
    batch: int,
    resolution: int,
    policies: list[str],
    *,
    channels: int | None = None,
    num_classes: int = 10,
    device: str = "cpu",
    freeze_batchnorm: bool = False,
    fidelity: bool = False,
    on_result: Callable[[dict], None] | None = None,
) -> dict:
    """Profile one training step of ``model`` under each policy, each in a fresh process.

    Args:
        model: ``torchvision:NAME``, ``zoo:NAME`` or ``pkg.module:factory``.
        batch: batch size; resolution: input height = width.
        policies: policy specs, e.g. ``["dense", "bitmap", "bitmap:threshold=0.01"]``, each with an
            optional ``+checkpoint`` (checkpoint the model's stages, as ``edgetorch finetune`` does).
        channels: input channels (None: inferred from the model's first convolution).
        num_classes: classifier outputs for builders that take it.
        device: ``cpu`` or ``cuda``.
        freeze_batchnorm: freeze every batch norm first (:func:`edgetorch.freeze_batchnorm`), for
            every policy alike.
        fidelity: also compare each policy's gradients with plain PyTorch's on the same batch
            (:func:`edgetorch.gradient_fidelity`); each result then has a ``fidelity`` record.
        on_result: called with each policy's result as it arrives (progress display).

    Returns:
        ``{"model", "batch", "resolution", "device", "machine", "results": [...]}``, one result
        per policy with ``activation_bytes`` (ledger, stored), ``dense_activation_bytes``
        (ledger, plain PyTorch) and ``peak_memory_bytes`` (measured), among others.
    """
    if batch < 1 or resolution < 1:
        raise ValueError(f"batch and resolution must be >= 1, got batch={batch}, resolution={resolution}")
    for spec in policies:
        parse_training_policy(spec)  # fail before starting any worker
    results = []
    for spec in policies:
        request = ProfileRequest(model, batch, resolution, spec, channels, num_classes, device,
                                 freeze_batchnorm=freeze_batchnorm, fidelity=fidelity)
        result = run_fresh("edgetorch.activations.profile", asdict(request))
        results.append(result)
        if on_result is not None:
            on_result(result)
    return {
        "model": model,
        "batch": batch,
        "resolution": resolution,
        "device": device,
        "freeze_batchnorm": freeze_batchnorm,
        "machine": machine_description(),
        "results": results,
    }


def profile_one(request: ProfileRequest) -> dict:
    """Run the warm-up and the measured step in this process (call it in a fresh one)."""
    from ..zoo import build_model, input_channels, redraw_zero_weights

    torch.manual_seed(request.seed)
    device = torch.device(request.device)
    how = parse_training_policy(request.policy)
    model = build_model(request.model, num_classes=request.num_classes).to(device).train()
    if request.fidelity:  # a zero-initialised head would block every gradient the comparison reads
        redraw_zero_weights(model)
    if request.freeze_batchnorm:
        freeze_batchnorm(model)
    channels = request.channels or input_channels(model)
    x = torch.randn(request.batch, channels, request.resolution, request.resolution, device=device)
    y = torch.randint(0, request.num_classes, (request.batch,), device=device)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)

    def train_step(ledger: SavedTensorLedger | None) -> dict:
        with storing(model, how, ledger):
            loss = F.cross_entropy(model(x), y)
        measured = {"held_after_forward_bytes": held_bytes(device), "rss_after_forward_bytes": rss_bytes(),
                    "uss_after_forward_bytes": uss_bytes()}
        loss.backward()
        optimizer.step()
        measured.update(model_memory(model, optimizer))
        # Gradients are freed between steps, so the resident memory measured before the next
        # step holds parameters and optimizer state only; the step's increase then covers
        # saved activations plus gradients as backward creates them.
        optimizer.zero_grad(set_to_none=True)
        return measured

    train_step(None)
    ledger = SavedTensorLedger()
    gc.collect()  # garbage from before (reference cycles of the caller's) must not be freed mid-step
    rss_before, before = rss_bytes(), held_bytes(device)
    reset_peak(device)
    start = time.perf_counter()
    measured = train_step(ledger)
    peak = peak_bytes(device)  # synchronises a GPU first
    seconds = time.perf_counter() - start
    total = ledger.total()
    result = {
        "policy": how.spec(),
        "activation_bytes": total.stored_bytes,
        "dense_activation_bytes": total.dense_bytes,
        "peak_live_activation_bytes": ledger.peak_live_bytes,
        "sparsity": total.sparsity,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind(device),
        "rss_before_step_bytes": rss_before,
        "step_peak_increase_bytes": peak - before,
        # Memory added by the forward and still held when it ends: the measured counterpart of
        # the ledger's saved bytes (plus the logits and allocator slack).
        "forward_increase_bytes": measured["held_after_forward_bytes"] - before,
        **measured,
        "step_seconds": seconds,
        "by_op": {k: v.to_dict() for k, v in ledger.by_op().items()},
        "by_form": {k: v.to_dict() for k, v in ledger.by_form().items()},
        "by_module_type": {k: v.to_dict() for k, v in ledger.by_module_type().items()},
    }
    if request.fidelity:
        result["fidelity"] = gradient_fidelity(model, (x, y), how).to_dict()
    return result


if __name__ == "__main__":
    request = ProfileRequest(**json.loads(sys.stdin.read()))
    print(json.dumps(profile_one(request)))
