"""One training step under a policy spec: the step the memory planner measures and
``edgetorch finetune`` runs, so what is predicted is what runs.

A spec is a policy (:func:`~edgetorch.activations.specs.parse_policy`) with an optional
``+checkpoint`` suffix: ``dense``, ``bitmap+checkpoint``, ``backrazor:sparsity=0.9+checkpoint``.
The suffix checkpoints every stage of the model (:func:`~edgetorch.activations.checkpoint.checkpoint_stages`)
and stores both the stage inputs and the recomputed segments under the policy.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..measure import SavedTensorLedger
from ..measure.timing import interleave, wall_time
from .blocks import PerBlock, recomputing
from .checkpoint import checkpoint_stages
from .engine import compress_activations
from .policies import Dense, Policy
from .specs import parse_policy

CHECKPOINT_SUFFIX = "+checkpoint"


@dataclass(frozen=True)
class TrainingPolicy:
    """How a training step stores what backward needs.

    Attributes:
        policy: the storage policy of every saved tensor.
        checkpoint: also checkpoint the model's stages (recompute them in backward).
    """

    policy: Policy
    checkpoint: bool = False

    def __post_init__(self) -> None:
        if self.checkpoint and isinstance(self.policy, PerBlock):
            raise ValueError("a PerBlock plan recomputes the blocks it names itself, with Recompute(policy); "
                             "+checkpoint recomputes every stage and does not combine with it: give the blocks "
                             "to recompute Recompute(...) in the plan instead")

    def spec(self) -> str:
        """The string :func:`parse_training_policy` turns back into this."""
        return self.policy.spec() + (CHECKPOINT_SUFFIX if self.checkpoint else "")


def parse_training_policy(spec: str) -> TrainingPolicy:
    """``POLICY`` or ``POLICY+checkpoint`` (POLICY as :func:`edgetorch.parse_policy` takes it).

    Raises:
        ValueError: a malformed policy (the message lists what is accepted).

    Example:
        >>> parse_training_policy("bitmap+checkpoint").checkpoint
        True
    """
    text = spec.strip()
    checkpoint = text.endswith(CHECKPOINT_SUFFIX)
    return TrainingPolicy(parse_policy(text.removesuffix(CHECKPOINT_SUFFIX) if checkpoint else text), checkpoint)


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, how: TrainingPolicy,
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     ledger: SavedTensorLedger | None = None) -> torch.Tensor:
    """Forward under ``how``, then backward; returns the (detached) loss.

    Args:
        model: the model, in the mode it trains in.
        x, y: the batch.
        how: the training policy.
        loss_fn: ``loss_fn(outputs, labels)``.
        ledger: optional ledger of what the forward (and any recomputation) saved.
    """
    with storing(model, how, ledger):
        loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach()


def step_seconds(model: nn.Module, steps: Mapping[str, tuple[torch.Tensor, torch.Tensor, TrainingPolicy]],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], rounds: int) -> dict[str, float]:
    """Each step's seconds on the wall clock: the least of ``rounds`` interleaved forward and
    backward passes (the order rotated per round, so none always runs first), after one untimed pass
    each (a configuration's first step watches its ops; later ones replay them). Gradients are
    dropped before each pass, outside the timed span, so none adds into another's; the model is
    left as it was (:class:`restored`).

    Args:
        model: the model, in the mode it trains in.
        steps: name -> (x, y, training policy).
        loss_fn: ``loss_fn(outputs, labels)``.
        rounds: timed passes per step.

    Returns:
        name -> the least of its timed passes, in seconds.

    Example:
        >>> step_seconds(model, {"dense": (x, y, TrainingPolicy(Dense()))}, F.cross_entropy, 3)  # doctest: +SKIP
        {'dense': 0.0123}
    """
    calls = {name: functools.partial(forward_backward, model, x, y, how, loss_fn) for name, (x, y, how) in steps.items()}
    device = next(iter(steps.values()))[0].device

    def timed(call: Callable[[], object]) -> float:
        for p in model.parameters():
            p.grad = None
        return wall_time(call, device)

    with restored(model):
        for call in calls.values():
            timed(call)
        times = interleave(calls, rounds, rotate=True, measure=timed)
    return {name: min(t) for name, t in times.items()}


@contextlib.contextmanager
def storing(model: nn.Module, how: TrainingPolicy, ledger: SavedTensorLedger | None = None) -> Iterator[None]:
    """Run the forward inside this block and it saves for backward as ``how`` says.

    Example:
        >>> with storing(model, parse_training_policy("bitmap+checkpoint")):  # doctest: +SKIP
        ...     loss = F.cross_entropy(model(x), y)
        >>> loss.backward()  # doctest: +SKIP
    """
    # Stages and recomputed blocks are swapped in before the engine starts, so it sees (and names)
    # the wrappers.
    stages = checkpoint_stages(model, how.policy, ledger) if how.checkpoint else contextlib.nullcontext()
    blocks = recomputing(model, how.policy, ledger) if isinstance(how.policy, PerBlock) else contextlib.nullcontext()
    # Dense with nothing to record stores every tensor as PyTorch does: run plain PyTorch, not
    # the engine's hooks, on every step of a dense run.
    plain = isinstance(how.policy, Dense) and ledger is None
    engine = contextlib.nullcontext() if plain else compress_activations(model, how.policy, ledger=ledger)
    with stages, blocks, engine:
        yield


def step_ledger(model: nn.Module, x: torch.Tensor, y: torch.Tensor, how: TrainingPolicy | str,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy) -> SavedTensorLedger:
    """What one training step of ``model`` under ``how`` saves for backward, run on a copy.

    The model itself, its batch-norm statistics and its gradients are left as they are.

    Example:
        >>> step_ledger(model, x, y, "backrazor:sparsity=0.9").total().stored_bytes  # doctest: +SKIP
    """
    how = parse_training_policy(how) if isinstance(how, str) else how
    ledger = SavedTensorLedger()
    forward_backward(copy.deepcopy(model), x, y, how, loss_fn, ledger)
    return ledger


class restored:
    """Leave the model as it was after the block: buffers (batch-norm statistics), gradients, the
    RNG streams (what the planner and the fidelity and cost measurements run steps inside).

    Example:
        >>> with restored(model):  # doctest: +SKIP
        ...     forward_backward(model, x, y, TrainingPolicy(Bitmap()), F.cross_entropy)
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self) -> None:
        self._buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        self._grads = {p: p.grad for p in self.model.parameters()}
        # The CUDA stream of the model's device too: dropout on a GPU draws from it.
        devices = {p.device for p in self.model.parameters() if p.device.type == "cuda"}
        self._rng = torch.random.fork_rng(devices=sorted(devices, key=str))
        self._rng.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._rng.__exit__(*exc)
        with torch.no_grad():
            for name, b in self.model.named_buffers():
                b.copy_(self._buffers[name])
        for p, grad in self._grads.items():
            p.grad = grad

