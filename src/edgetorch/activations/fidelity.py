"""Gradient fidelity: how far a policy moves one training step's gradients from plain PyTorch's.

A policy is chosen by two numbers: the memory it saves (:class:`~edgetorch.SavedTensorLedger`)
and how far its gradients move. :func:`gradient_fidelity` gives the second: the cosine
similarity and relative L2 error of every parameter's gradient, and of the input gradient,
against plain PyTorch on the same batch, parameters, batch-norm statistics and random numbers.

It lives here, in ``activations``, because it runs a training step under a policy
(:func:`~edgetorch.activations.step.forward_backward`), and ``measure`` sits below
``activations`` in the layer order: ``edgetorch.gradient_fidelity`` is this function
(``edgetorch.measure.gradient_fidelity``, its first name, now says where it moved).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .policies import Dense, Policy
from .step import TrainingPolicy, forward_backward, parse_training_policy, restored

# A reference parameter gradient whose norm is at most this fraction of the largest one is
# rounding noise around a gradient that is zero in exact arithmetic (a convolution's bias before
# a training batch norm, which cancels it in the forward): its cosine says nothing about the policy.
# The one definition of a degenerate reference gradient (the per-block costs read the same flag).
# Not higher: at random init, mobilenet_v2's batch-norm weights have real gradients at 3e-5 to
# 1e-3 of the largest (26 of them at batch 4, 64 px).
NEGLIGIBLE = 1e-5


@dataclass(frozen=True)
class GradientComparison:
    """One gradient under a policy against plain PyTorch's (the reference).

    Attributes:
        name: the parameter's name in ``model.named_parameters()``, or ``"input"``.
        cosine: ``<g, g_ref> / (||g|| ||g_ref||)``, computed in float64. 1.0 where the two are
            bit-identical (up to the sign of zero), both zero included; 0.0 where exactly one
            of them is zero; NaN where a gradient holds NaN.
        relative_error: ``||g - g_ref|| / ||g_ref||``. 0.0 where the two are identical (so
            0/0 is 0); ``math.inf`` where the reference is exactly zero and ``g`` is not.
        norm: ``||g||``.
        reference_norm: ``||g_ref||``.
        negligible: ``reference_norm`` is at most ``negligible`` (default ``NEGLIGIBLE``, 1e-5)
            times the largest reference parameter gradient norm: rounding noise around a gradient that is zero in
            exact arithmetic (a bias before a training batch norm, which the batch norm cancels,
            so no value of it changes the loss). Listed, but left out of the summaries.
    """

    name: str
    cosine: float
    relative_error: float
    norm: float
    reference_norm: float
    negligible: bool = False

    def to_dict(self) -> dict:
        """A JSON-ready dict; a non-finite number (an infinite relative error) is ``None``."""
        return {k: _finite_or_none(v) for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class GradientFidelity:
    """What :func:`gradient_fidelity` found.

    Attributes:
        policy: the training policy's spec (``"backrazor:sparsity=0.9"``).
        parameters: one row per parameter that requires a gradient, in ``named_parameters()``
            order (a parameter that got no gradient counts as a zero one).
        input: the gradient with respect to the inputs, or None where there is none.
        no_input_gradient: why ``input`` is None (integer inputs such as token ids); else None.
        loss, reference_loss: the step's loss under the policy and under plain PyTorch. A
            policy changes only what backward reads, so the two are equal unless random ops saw
            different numbers (see :func:`gradient_fidelity`).
    """

    policy: str
    parameters: tuple[GradientComparison, ...]
    input: GradientComparison | None
    no_input_gradient: str | None
    loss: float
    reference_loss: float

    def _worst(self) -> GradientComparison | None:
        counted = [r for r in self.parameters if not r.negligible and r.relative_error != 0]
        # NaN sorts first: a NaN gradient is the worst there is, not one min() may pass over.
        return min(counted, key=lambda r: (not math.isnan(r.cosine), r.cosine), default=None)

    @property
    def worst_cosine(self) -> float:
        """The smallest cosine over the parameters that are not negligible (NaN if one is NaN;
        1.0 if none moved)."""
        worst = self._worst()
        return 1.0 if worst is None else worst.cosine

    @property
    def worst_parameter(self) -> str | None:
        """The name of the parameter with :attr:`worst_cosine`, or None if no counted gradient moved."""
        worst = self._worst()
        return None if worst is None else worst.name

    @property
    def mean_squared_relative_error(self) -> float:
        """The mean squared relative error over the parameters that are not negligible (inf if one
        is NaN; 0.0 if none is counted): the fidelity cost per-block plans minimise
        (:mod:`~edgetorch.activations.costs`), comparable across whole plans."""
        counted = [r.relative_error for r in self.parameters if not r.negligible]
        if any(math.isnan(e) for e in counted):
            return math.inf
        return sum(e * e for e in counted) / len(counted) if counted else 0.0

    @property
    def max_relative_error(self) -> float:
        """The largest relative error over the parameters that are not negligible (NaN if one is
        NaN; 0.0 if none is counted)."""
        errors = [r.relative_error for r in self.parameters if not r.negligible]
        return max(errors, key=lambda e: (math.isnan(e), e), default=0.0)

    def to_dict(self) -> dict:
        """Everything as JSON-ready values, the summaries included; non-finite numbers are ``None``.

        Example:
            >>> json.dumps(gradient_fidelity(model, (x, y), "bitmap").to_dict())  # doctest: +SKIP
        """
        return {
            "policy": self.policy,
            "worst_cosine": _finite_or_none(self.worst_cosine),
            "worst_parameter": self.worst_parameter,
            "max_relative_error": _finite_or_none(self.max_relative_error),
            "input": None if self.input is None else self.input.to_dict(),
            "no_input_gradient": self.no_input_gradient,
            "loss": _finite_or_none(self.loss),
            "reference_loss": _finite_or_none(self.reference_loss),
            "parameters": [r.to_dict() for r in self.parameters],
        }


def gradient_fidelity(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    policy: Policy | TrainingPolicy | str,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    negligible: float = NEGLIGIBLE,
) -> GradientFidelity:
    """Compare one step's gradients under ``policy`` with plain PyTorch's on the same batch.

    Both steps start from the model as it is: the same parameters, the same buffers (batch-norm
    running statistics are put back after each step) and the same random numbers (each step
    runs under :func:`torch.random.fork_rng` from the caller's RNG state, CUDA included, so
    dropout draws the same masks). The model's gradients, buffers and the caller's RNG state are
    as they were when this returns. The model is used in the mode it is in: call
    ``model.train()`` (or freeze batch norm) first, as the training run will.

    A policy that draws random numbers itself during the forward (``quantized:stochastic=true``)
    moves the stream that random ops after it read: in a model with dropout the two steps then
    see different masks, the losses differ, and a warning says so.

    Args:
        model: the model, on the device of ``batch``.
        batch: ``(inputs, targets)``. Floating-point inputs are compared by their gradient too;
            integer inputs (token ids) have none (:attr:`GradientFidelity.no_input_gradient`).
        policy: a :class:`~edgetorch.Policy`, a :class:`~edgetorch.activations.TrainingPolicy`,
            or a spec string as :func:`~edgetorch.activations.parse_training_policy` takes it
            (``"bitmap"``, ``"backrazor:sparsity=0.9"``, ``"dense+checkpoint"``).
        loss_fn: ``loss_fn(outputs, targets)`` returning a scalar; default cross-entropy.
        negligible: a parameter whose reference gradient norm is at most this fraction of the
            largest is flagged :attr:`GradientComparison.negligible` and left out of the summaries.

    Returns:
        A :class:`GradientFidelity`: a row per parameter and one for the input, with
        ``worst_cosine``, ``max_relative_error`` and ``to_dict()``.

    Raises:
        ValueError: a malformed policy spec (the message lists what is accepted), a batch
            that is not ``(inputs, targets)``, or ``negligible`` outside [0, 1).
        TypeError: a model, policy or inputs of another type.

    Example:
        >>> fid = edgetorch.gradient_fidelity(model.train(), (x, y), "backrazor:sparsity=0.9")
        >>> fid.input.cosine, fid.worst_cosine, fid.worst_parameter  # doctest: +SKIP
        (1.0, 0.93, 'layer4.1.conv2.weight')
    """
    return gradient_fidelities(model, batch, [policy], loss_fn=loss_fn, negligible=negligible)[0]


def gradient_fidelities(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    policies: Sequence[Policy | TrainingPolicy | str],
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    negligible: float = NEGLIGIBLE,
) -> list[GradientFidelity]:
    """:func:`gradient_fidelity` of each of ``policies``, against one plain PyTorch step.

    The reference step runs once for all of them (a per-block cost table compares dozens of
    plans with the same reference). Arguments, state handling and errors as
    :func:`gradient_fidelity`'s.

    Returns:
        One :class:`GradientFidelity` per policy, in order.

    Example:
        >>> rows = gradient_fidelities(model.train(), (x, y), ["quantized:bits=8", "quantized:bits=4"])  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    hows = [_training_policy(policy) for policy in policies]
    if isinstance(negligible, bool) or not isinstance(negligible, (int, float)) or not 0 <= negligible < 1:
        raise ValueError(f"negligible must be a fraction in [0, 1) of the largest reference gradient norm, "
                         f"got {negligible!r}")
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        got = f"{len(batch)} items" if isinstance(batch, (tuple, list)) else f"a {type(batch).__name__}"
        raise ValueError(f"batch must be a pair (inputs, targets), got {got}")
    x, y = batch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"inputs must be a torch.Tensor, got {type(x).__name__}")
    loss_fn = loss_fn or F.cross_entropy
    tensors = [*model.parameters(), *model.buffers(), x, *([y] if isinstance(y, torch.Tensor) else [])]
    cuda = sorted({t.device.index for t in tensors if t.is_cuda})

    reference = _step(model, x, y, TrainingPolicy(Dense()), loss_fn, cuda)
    norms = {name: math.sqrt(_squared_norm(g)) for name, g in reference[1].items()}
    floor = negligible * max(norms.values(), default=0.0)
    quiet = {name for name, norm in norms.items() if norm <= floor}
    if 2 * len(quiet) > len(norms):
        warnings.warn(f"{len(quiet)} of {len(norms)} parameter gradients are zero or negligible in plain PyTorch on "
                      "this batch, so the comparison says little about the model: a zero-initialised layer "
                      "(torchvision's ViT head, at random init) blocks every gradient behind it. Compare on a trained "
                      "model, or draw such a layer at random first", stacklevel=3)
    return [_against(reference, _step(model, x, y, how, loss_fn, cuda, reference[1]), how, x, quiet) for how in hows]


def _against(reference: tuple, under: tuple, how: TrainingPolicy, x: torch.Tensor, quiet: set[str]) -> GradientFidelity:
    """One policy's step (``under``, its parameters' comparisons made as it ran) and the reference
    step, as :func:`_step` returns them; ``quiet``: the parameters whose reference gradient is negligible."""
    if under[0] != reference[0] and not (math.isnan(under[0]) and math.isnan(reference[0])):
        warnings.warn(f"the forward under {how.spec()} gave loss {under[0]!r}, plain PyTorch {reference[0]!r}: "
                      "random ops saw different numbers (a policy that draws random numbers itself, such as "
                      "quantized:stochastic=true, moves dropout's stream), and the gradients compared include "
                      "that difference", stacklevel=4)
    rows = [dataclasses.replace(under[1][name], negligible=name in quiet) for name in reference[1]]
    floating = x.is_floating_point()
    return GradientFidelity(
        policy=how.spec(),
        parameters=tuple(rows),
        input=_compare("input", under[2], reference[2]) if floating else None,
        no_input_gradient=None if floating else f"inputs are {x.dtype} (token ids, say): they have no gradient",
        loss=under[0],
        reference_loss=reference[0],
    )


def _training_policy(policy: Policy | TrainingPolicy | str) -> TrainingPolicy:
    if isinstance(policy, str):
        return parse_training_policy(policy)
    if isinstance(policy, Policy):
        return TrainingPolicy(policy)
    if isinstance(policy, TrainingPolicy):
        return policy
    raise TypeError(f"policy must be an edgetorch Policy (BackRazor(0.9), ...), a TrainingPolicy or a spec string "
                    f"such as 'bitmap' or 'backrazor:sparsity=0.9+checkpoint'; got {policy!r}")


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, how: TrainingPolicy,
          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], cuda: list[int],
          reference: dict[str, torch.Tensor] | None = None) -> tuple[float, dict, torch.Tensor | None]:
    """One forward and backward from the model's current state: (loss, by parameter name its
    gradient, or with ``reference`` its :class:`GradientComparison` against it, input gradient).
    Buffers, gradients and RNG streams are put back afterwards.

    With ``reference``, each gradient is compared as it is accumulated (a post-accumulate-grad
    hook) and dropped there, so the step never holds a second set of gradients beside the
    reference's: per-block costs compare dozens of steps, and holding both took MiniLM's cost
    measurement to 1,192 MiB under a budget its training kept."""
    with torch.random.fork_rng(devices=cuda), restored(model):
        for p in model.parameters():
            p.grad = None  # the caller's gradients are put back by restored, never added to
        x = x.detach().requires_grad_() if x.is_floating_point() else x
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        compared: dict[str, GradientComparison] = {}

        def compare(name: str, p: torch.Tensor) -> None:
            compared[name] = _compare(name, _dense_grad(p), reference[name])
            p.grad = None

        handles = ([] if reference is None else
                   [p.register_post_accumulate_grad_hook(functools.partial(compare, name)) for name, p in named])
        try:
            loss = forward_backward(model, x, y, how, loss_fn)
        finally:
            for handle in handles:
                handle.remove()
        if reference is None:
            grads = {name: _dense_grad(p) for name, p in named}
        else:  # a parameter that got no gradient: compared as a zero one
            grads = {name: compared[name] if name in compared else _compare(name, _dense_grad(p), reference[name])
                     for name, p in named}
        return loss.item(), grads, _dense_grad(x) if x.is_floating_point() else None


def _dense_grad(t: torch.Tensor) -> torch.Tensor:
    """``t.grad`` as a strided tensor; no gradient counts as a zero one."""
    if t.grad is None:
        return torch.zeros_like(t)
    return t.grad.to_dense() if t.grad.layout != torch.strided else t.grad


COMPARE_CHUNK = 1 << 20  # elements compared in float64 at a time


def _squared_norm(t: torch.Tensor) -> float:
    """|t|^2 in float64, a chunk at a time (as :func:`_compare`), read back once."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for chunk in t.detach().flatten().split(COMPARE_CHUNK):
        total += chunk.double().square().sum()
    return total.item()


def _compare(name: str, g: torch.Tensor, reference: torch.Tensor) -> GradientComparison:
    """Cosine and relative error in float64, a chunk at a time: whole float64 copies of one large
    gradient (MiniLM's 11.7M-entry embedding: 94 MB each, three at once) took a per-block plan's
    cost measurement 350 MiB over a budget the training itself kept."""
    g, reference = g.detach().flatten(), reference.detach().flatten()
    sums = torch.zeros(4, dtype=torch.float64, device=g.device)  # |g|^2, |r|^2, <g, r>, |g - r|^2
    for start in range(0, g.numel(), COMPARE_CHUNK):
        a, b = g[start : start + COMPARE_CHUNK].double(), reference[start : start + COMPARE_CHUNK].double()
        sums += torch.stack([a.dot(a), b.dot(b), a.dot(b), (a - b).square().sum()])
    gg, rr, gr, dd = sums.tolist()
    norm, reference_norm = math.sqrt(gg), math.sqrt(rr)
    if torch.equal(g, reference):  # == on floats: equal up to the sign of zero
        return GradientComparison(name, 1.0, 0.0, norm, reference_norm)
    if norm == 0 or reference_norm == 0:  # exactly one of them is zero (both: equal, above)
        cosine = 0.0
    else:  # rounding can take a float64 cosine a hair past +-1
        cosine = max(-1.0, min(1.0, gr / (norm * reference_norm)))
    return GradientComparison(name, cosine, math.sqrt(dd) / reference_norm if reference_norm else math.inf,
                              norm, reference_norm)


def _finite_or_none(v: object) -> object:
    return None if isinstance(v, float) and not math.isfinite(v) else v
