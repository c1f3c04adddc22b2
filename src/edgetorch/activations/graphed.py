"""A host-free training step: forward under a policy, backward and the optimizer step in one CUDA graph.

On a GPU driven by a weak host (a Jetson board) the Python that launches a step's kernels sets
its pace, not the kernels. :func:`capture_step` records one whole step, the forward inside
:func:`~edgetorch.compress_activations`, the loss, backward and ``optimizer.step()``, as one
``torch.cuda.CUDAGraph``, following PyTorch's "whole network capture" recipe (warm-up steps on a
side stream, gradients set to None before capture, optimizer state and gradients then held by
the graph's private memory pool). A :class:`CapturedStep` then replays it: two copies into the
static inputs and one graph launch, with no per-op Python and no host sync.

What can be captured is what launches the same kernels on the same shapes every step without
reading anything back to the host: plain PyTorch (``policy=None``), ``Dense()`` (no ledger),
``BackRazor`` and ``Quantized`` (non-stochastic) where their CUDA paths do not sync. A policy
whose step depends on the host is refused with :class:`CaptureError` before any capture is tried:
bitmap (its values are sized from earlier steps' counts, which the host checks: a replay would
skip the check) by name, and any other host sync by running the last warm-up step under
``torch.cuda.set_sync_debug_mode("error")``, phase by phase.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import EdgetorchError
from .policies import Policy
from .step import TrainingPolicy, storing

CAPTURABLE = "plain PyTorch (policy=None), Dense() without a ledger, BackRazor and Quantized(stochastic=False)"


class CaptureError(EdgetorchError, RuntimeError):
    """A step could not be captured as a CUDA graph (it syncs with the host, or capture failed)."""


class CapturedStep:
    """One captured training step; call it with a batch to run the step again.

    Built by :func:`capture_step`. Each call copies ``x`` and ``y`` into the static input
    tensors (same shape and dtype as the batch it was captured with; checked before anything
    runs) and replays the graph: forward, loss, backward and optimizer step, with no host work
    beyond one graph launch. Returns the static loss tensor, overwritten by the next call
    (``.item()`` it or ``.clone()`` it to keep it; reading it syncs).

    Attributes:
        graph: the ``torch.cuda.CUDAGraph``.
        x, y: the static inputs the graph reads.
        loss: the static loss tensor the graph writes.
        policy: the policy the forward ran under (None: plain PyTorch).
        pool_bytes: CUDA memory the graph's private pool reserved during capture (activations at
            their peak layout, gradients, the loss, the codecs' workspaces); held while the
            step lives. None where not measured.
        peak_bytes: the CUDA allocator's peak during capture above what was allocated before it:
            the step's own peak (gradients included, as they are allocated in the step), the
            same measure as ``torch.cuda.max_memory_allocated`` around an eager step. The pool
            reserves more (its blocks are sized and split as the allocator's segments are).
            None where not measured.
    """

    def __init__(self, graph, x: torch.Tensor, y: torch.Tensor, loss: torch.Tensor,
                 policy: Policy | None = None, pool_bytes: int | None = None, peak_bytes: int | None = None):
        self.graph, self.x, self.y, self.loss = graph, x, y, loss
        self.policy, self.pool_bytes, self.peak_bytes = policy, pool_bytes, peak_bytes

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _check_like("x", x, self.x)
        _check_like("y", y, self.y)
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        self.graph.replay()
        return self.loss

    def __repr__(self) -> str:
        what = "plain" if self.policy is None else self.policy.spec()
        return f"CapturedStep({what}, x={tuple(self.x.shape)}, y={tuple(self.y.shape)})"


def capture_step(
    model: nn.Module,
    policy: Policy | None,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    *,
    warmup: int = 3,
) -> CapturedStep:
    """Capture one training step of ``model`` under ``policy`` as a CUDA graph.

    The step is ``optimizer.step()`` after ``loss_fn(model(x), y).backward()``, the forward and
    the loss inside ``compress_activations(model, policy)``. First ``warmup`` ordinary steps run
    on ``(x, y)`` on a side stream, as in PyTorch's recipe (they compile the codecs' kernels, let
    cuDNN pick its algorithms and create the optimizer's state), so **the parameters and the
    optimizer state advance by ``warmup`` real steps on this batch**. The last warm-up step runs
    under ``torch.cuda.set_sync_debug_mode("error")``: a host sync in it is reported as a
    :class:`CaptureError` naming the part of the step (the policy's forward, the loss, backward or
    the optimizer) instead of a failed capture. Then the gradients are set to None and the step is
    captured; from then on gradients and the loss live in the graph's memory pool, overwritten by
    each replay.

    Do not call ``optimizer.zero_grad()`` between replays: the graph overwrites its gradients
    each step (setting them to None only hides them from you). What stays fixed in the graph: the
    batch's shape and dtype (a smaller last batch needs its own captured step, or
    ``drop_last=True``), the model's parameters and buffers as tensors (do not replace them;
    in-place updates are seen), the learning rate if it is a Python float (use a tensor ``lr`` to
    change it, e.g. ``SGD(params, lr=torch.tensor(0.1, device="cuda"))``), and any random draws
    made on the host, which is why ``Quantized(stochastic=True)`` is refused.

    Args:
        model: a module whose parameters are all on one CUDA device, in the mode to train in.
        policy: an edgetorch policy, or None for plain PyTorch (the baseline to compare a
            captured compressed step with). Capturable: ``BackRazor``, ``Quantized`` and ``Dense()``
            (no ledger is attached); bitmap is refused (its sizes are checked on the host).
        optimizer: the optimizer over ``model``'s parameters; Adam, AdamW and the others that
            have a ``capturable`` flag must be built with ``capturable=True``.
        x, y: a batch: its shape and dtype are the captured step's. Copied; the caller keeps them.
        loss_fn: ``loss_fn(model(x), y)`` -> a scalar loss tensor; must not sync with the host.
        warmup: ordinary steps run before capture (at least 1; PyTorch's recipe uses 3). The last
            is checked for host syncs, so with 1 a sync that only a first step makes (a kernel
            autotuned on first use) is refused too.

    Returns:
        A :class:`CapturedStep`; ``step(x, y)`` runs one training step and returns the loss tensor.

    Raises:
        TypeError: ``model``, ``policy`` or ``optimizer`` of the wrong type.
        ValueError: no CUDA model, ``x``/``y`` not tensors, an optimizer with ``capturable=False``,
            a stochastic policy, ``warmup < 1``.
        CaptureError: the step syncs with the host, or the capture failed.

    Example:
        >>> model = torchvision.models.resnet18().cuda()
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> step = edgetorch.capture_step(model, edgetorch.BackRazor(0.9), opt, x0, y0)
        >>> for x, y in loader:  # same batch shape as x0, y0; on the GPU
        ...     loss = step(x, y)  # one graph launch: forward, backward, optimizer step
    """
    device = _check_arguments(model, policy, optimizer, x, y, warmup)
    static_x = x.detach().to(device).clone()
    static_y = y.detach().to(device).clone()
    name = "plain PyTorch (policy=None)" if policy is None else f"policy {policy.spec()!r}"

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(warmup):
            _step(model, policy, optimizer, static_x, static_y, loss_fn, check=name if i == warmup - 1 else None)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)

    optimizer.zero_grad(set_to_none=True)  # backward then allocates the gradients from the graph's pool
    graph = torch.cuda.CUDAGraph()
    torch.cuda.empty_cache()  # what the pool reserves is then what memory_reserved gains
    reserved = torch.cuda.memory_reserved(device)
    allocated = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    stream = torch.cuda.current_stream(device)
    try:
        with torch.cuda.graph(graph):
            loss = _step(model, policy, optimizer, static_x, static_y, loss_fn, zero_grad=False)
    except Exception as e:
        # torch.cuda.graph's exit raises from capture_end on an invalidated capture before it
        # restores the stream: put the caller's stream back.
        torch.cuda.set_stream(stream)
        raise CaptureError(
            f"capturing the training step under {name} failed: {type(e).__name__}: {e}. Capturable: "
            f"{CAPTURABLE}. A capture that CUDA invalidated (an operation not permitted while "
            "capturing) can leave this process's CUDA state unreliable: restart it before trusting "
            "further GPU results."
        ) from e
    pool = torch.cuda.memory_reserved(device) - reserved
    peak = torch.cuda.max_memory_allocated(device) - allocated
    # detached: the static loss must not keep the captured step's autograd graph alive
    return CapturedStep(graph, static_x, static_y, loss.detach(), policy, pool, peak)


def _check_arguments(model, policy, optimizer, x, y, warmup) -> torch.device:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be an edgetorch Policy or None (plain PyTorch), got {policy!r}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise ValueError(f"x and y must be tensors (one batch), got {type(x).__name__} and {type(y).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1 (steps that compile kernels and create the "
                         f"optimizer's state before capture), got {warmup!r}")
    if policy is not None and policy.sized_by_count:
        raise CaptureError(
            f"{policy.spec()!r} sizes each bitmap from the counts of earlier steps and checks them on the host "
            "(edgetorch.activations.capacity): a replayed graph would skip the check and silently lose the "
            f"values of a tensor that kept more than its slots. Capturable: {CAPTURABLE}. Train this one "
            "eagerly under compress_activations."
        )
    if getattr(policy, "stochastic", False):
        raise ValueError(
            f"{policy.spec()!r} draws its rounding seeds on the host each step: a captured step would "
            "replay the seeds drawn at capture on every step. Use stochastic=False, or run it eagerly."
        )
    uncapturable = [i for i, g in enumerate(optimizer.param_groups) if g.get("capturable") is False]
    if uncapturable:
        raise ValueError(
            f"{type(optimizer).__name__} has capturable=False (param groups {uncapturable}): its step "
            f"keeps its step count on the host, which a CUDA graph cannot replay. Build it with "
            f"{type(optimizer).__name__}(..., capturable=True)."
        )
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if not devices or any(d.type != "cuda" for d in devices) or len(devices) > 1:
        where = ", ".join(sorted(map(str, devices))) or "no parameters"
        raise ValueError(
            f"capture_step needs a model on one CUDA device (a CUDA graph replays GPU work), got {where}; "
            "move it with model.cuda(), or train eagerly under compress_activations on other devices."
        )
    return next(iter(devices))


def _step(model, policy, optimizer, x, y, loss_fn, *, check: str | None = None, zero_grad: bool = True):
    """One training step; with ``check`` (the step's name) a host sync raises a CaptureError."""
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)
    # The forward under the policy as every training step runs it (edgetorch.activations.step)
    with storing(model, TrainingPolicy(policy)) if policy is not None else contextlib.nullcontext():
        with _no_sync(check, f"the forward under {check}"):
            out = model(x)
        with _no_sync(check, f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!r}"):
            loss = loss_fn(out, y)
    with _no_sync(check, f"backward under {check}"):
        loss.backward()
    with _no_sync(check, f"{type(optimizer).__name__}.step()"):
        optimizer.step()
    return loss


@contextlib.contextmanager
def _no_sync(check: str | None, part: str):
    if check is None:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        raise CaptureError(
            f"{part} syncs with the host (it read a value back from the GPU: {e}), so the step cannot "
            f"be captured as a CUDA graph. Capturable: {CAPTURABLE}. Train this one eagerly under "
            "compress_activations."
        ) from e
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _check_like(name: str, given, static: torch.Tensor) -> None:
    if not isinstance(given, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(given).__name__}")
    if given.shape != static.shape or given.dtype != static.dtype:
        raise ValueError(
            f"{name} has shape {tuple(given.shape)} and dtype {given.dtype}, but the step was captured with "
            f"{tuple(static.shape)} and {static.dtype}: a CUDA graph replays fixed shapes. Capture another "
            "step for this shape (e.g. for a smaller last batch) or drop it (DataLoader(drop_last=True))."
        )
