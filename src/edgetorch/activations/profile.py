"""One training step per policy, each in a fresh process: ledger bytes and measured memory side by side.

Run as ``python -m edgetorch.activations.profile`` with a JSON request on stdin (what
:func:`profile_policies` does for each policy); it prints one JSON result line: the fields of a
:class:`PolicyProfile`, which the parent reads back into one (:class:`ProfileResult` holds them all;
``to_json()`` gives the record ``edgetorch profile --json`` writes).

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

import dataclasses
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.nn import functional as F

from ..measure import SavedTensorLedger, machine_description, model_memory, run_fresh
from ..measure.ledger import Totals
from ..measure.process import held_bytes, peak_bytes, peak_kind, reset_peak, rss_bytes, uss_bytes
from .batchnorm import freeze_batchnorm
from .fidelity import GradientComparison, GradientFidelity, gradient_fidelity
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


# The ledger's breakdowns of the measured step, each {name: Totals}.
BREAKDOWNS = ("by_op", "by_form", "by_module_type")


def _comparison(record: dict[str, Any] | None) -> GradientComparison | None:
    return None if record is None else GradientComparison(**record)


@dataclass(frozen=True)
class PolicyProfile:
    """One policy's measured training step (:func:`profile_one`), the ledger beside measured memory.

    Ledger bytes are exact tensor sizes; measured bytes are in the unit of ``peak_memory_kind``
    (see the module docstring): they are different quantities.

    Attributes:
        policy: the training policy's spec (``"bitmap+checkpoint"``).
        activation_bytes: bytes the saved tensors took as stored (ledger).
        dense_activation_bytes: the same tensors as plain PyTorch holds them (ledger).
        peak_live_activation_bytes: the most stored bytes alive at once (ledger).
        sparsity: fraction of the saved elements not stored as values.
        peak_memory_bytes: the measured step's peak (process RSS on a CPU, the CUDA allocator's).
        peak_memory_kind: ``"peak_rss"`` or ``"cuda_max_allocated"``.
        rss_before_step_bytes: resident memory just before the measured step.
        step_peak_increase_bytes: ``peak_memory_bytes`` over what was held before the step.
        forward_increase_bytes: memory the forward added and still held at its end: the measured
            counterpart of the ledger's saved bytes (plus the logits and allocator slack).
        held_after_forward_bytes, rss_after_forward_bytes, uss_after_forward_bytes: what was held,
            resident and unique to the process when the forward ended (USS None where the OS
            does not tell).
        parameter_bytes, buffer_bytes, gradient_bytes, optimizer_state_bytes: the rest of the
            step's memory (:func:`~edgetorch.measure.model_memory`).
        step_seconds: the measured step's wall-clock time.
        by_op, by_form, by_module_type: the ledger's totals by autograd op, storage form and
            module type.
        fidelity: the gradients against plain PyTorch's (``profile_policies(fidelity=True)``), else None.
    """

    policy: str
    activation_bytes: int
    dense_activation_bytes: int
    peak_live_activation_bytes: int
    sparsity: float
    peak_memory_bytes: int
    peak_memory_kind: str
    rss_before_step_bytes: int
    step_peak_increase_bytes: int
    forward_increase_bytes: int
    held_after_forward_bytes: int
    rss_after_forward_bytes: int
    uss_after_forward_bytes: int | None
    parameter_bytes: int
    buffer_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    step_seconds: float
    by_op: dict[str, Totals]
    by_form: dict[str, Totals]
    by_module_type: dict[str, Totals]
    fidelity: GradientFidelity | None = None

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> PolicyProfile:
        """The inverse of ``dataclasses.asdict(profile)``: how the profile worker's line is read back.

        The worker prints ``asdict``, not :meth:`to_json`, because JSON's NaN and Infinity then
        carry the fidelity's non-finite numbers, which :meth:`to_json` writes as null: the parent
        gets exactly what was measured.

        Args:
            record: ``dataclasses.asdict`` of a :class:`PolicyProfile`, through ``json`` or not.

        Returns:
            The :class:`PolicyProfile`, breakdowns as :class:`~edgetorch.measure.ledger.Totals`
            and fidelity as :class:`GradientFidelity`.
        """
        fidelity = record["fidelity"]
        if fidelity is not None:
            fidelity = GradientFidelity(**{**fidelity, "input": _comparison(fidelity["input"]),
                                           "parameters": tuple(map(_comparison, fidelity["parameters"]))})
        return cls(**{**record, **{key: {name: Totals(**t) for name, t in record[key].items()} for key in BREAKDOWNS},
                      "fidelity": fidelity})

    @property
    def stored_over_dense(self) -> float:
        """``activation_bytes / dense_activation_bytes`` (the denominator at least 1)."""
        return self.activation_bytes / max(self.dense_activation_bytes, 1)

    def to_json(self) -> dict[str, Any]:
        """The policy's record in ``edgetorch profile --json``: the fields in order, each breakdown's
        totals as :meth:`~edgetorch.measure.ledger.Totals.to_dict`, ``fidelity`` as
        :meth:`GradientFidelity.to_dict` (non-finite numbers as null) and only when measured."""
        record: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in BREAKDOWNS:
            record[key] = {name: totals.to_dict() for name, totals in record[key].items()}
        fidelity = record.pop("fidelity")
        if fidelity is not None:
            record["fidelity"] = fidelity.to_dict()
        return record


@dataclass(frozen=True)
class ProfileResult:
    """What :func:`profile_policies` returns.

    Attributes:
        model, batch, resolution, device, freeze_batchnorm: what was profiled.
        machine: :func:`~edgetorch.measure.machine_description` of the machine it ran on.
        results: one :class:`PolicyProfile` per policy, in the order asked.
    """

    model: str
    batch: int
    resolution: int
    device: str
    freeze_batchnorm: bool
    machine: dict[str, Any]
    results: list[PolicyProfile]

    def to_json(self) -> dict[str, Any]:
        """The record ``edgetorch profile --json`` writes: these fields in order, each result as
        :meth:`PolicyProfile.to_json`."""
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "results": [r.to_json() for r in self.results]}


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
    on_result: Callable[[PolicyProfile], None] | None = None,
) -> ProfileResult:
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
            (:func:`edgetorch.gradient_fidelity`); each result then has its ``fidelity``.
        on_result: called with each policy's result as it arrives (progress display).

    Returns:
        The :class:`ProfileResult`: one :class:`PolicyProfile` per policy, with
        ``activation_bytes`` (ledger, stored), ``dense_activation_bytes`` (ledger, plain
        PyTorch) and ``peak_memory_bytes`` (measured), among others; ``to_json()`` is the record
        ``edgetorch profile --json`` writes.

    Raises:
        ValueError: a batch or resolution below 1, or a malformed policy spec (before any worker starts).
        RuntimeError: a worker failed (the message carries its stderr).

    Example:
        >>> result = profile_policies("zoo:cnn", 8, 28, ["dense", "bitmap"])  # doctest: +SKIP
        >>> [(r.policy, r.stored_over_dense) for r in result.results]  # doctest: +SKIP
    """
    if batch < 1 or resolution < 1:
        raise ValueError(f"batch and resolution must be >= 1, got batch={batch}, resolution={resolution}")
    for spec in policies:
        parse_training_policy(spec)  # fail before starting any worker
    results = []
    for spec in policies:
        request = ProfileRequest(model, batch, resolution, spec, channels, num_classes, device,
                                 freeze_batchnorm=freeze_batchnorm, fidelity=fidelity)
        result = PolicyProfile.from_dict(run_fresh("edgetorch.activations.profile", asdict(request)))
        results.append(result)
        if on_result is not None:
            on_result(result)
    return ProfileResult(model, batch, resolution, device, freeze_batchnorm, machine_description(), results)


def profile_one(request: ProfileRequest) -> PolicyProfile:
    """Run the warm-up and the measured step in this process (call it in a fresh one).

    Args:
        request: what to profile.

    Returns:
        The :class:`PolicyProfile`.
    """
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
    return PolicyProfile(
        policy=how.spec(),
        activation_bytes=total.stored_bytes,
        dense_activation_bytes=total.dense_bytes,
        peak_live_activation_bytes=ledger.peak_live_bytes,
        sparsity=total.sparsity,
        peak_memory_bytes=peak,
        peak_memory_kind=peak_kind(device),
        rss_before_step_bytes=rss_before,
        step_peak_increase_bytes=peak - before,
        forward_increase_bytes=measured["held_after_forward_bytes"] - before,
        **measured,
        step_seconds=seconds,
        by_op=ledger.by_op(),
        by_form=ledger.by_form(),
        by_module_type=ledger.by_module_type(),
        fidelity=gradient_fidelity(model, (x, y), how) if request.fidelity else None,
    )


if __name__ == "__main__":
    request = ProfileRequest(**json.loads(sys.stdin.read()))
    print(json.dumps(asdict(profile_one(request))))  # read back by PolicyProfile.from_dict
