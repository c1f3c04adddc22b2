"""What each storage form costs each block: bytes from the ledger of one step, fidelity measured once.

For every form, one training step of the whole model with every block in that form fills a
:class:`~edgetorch.SavedTensorLedger`; its rows are summed per block by the name of the module that
saved them (codec sizes are exact, so these are exact bytes for that step). A tensor stored once
for several ops counts for the block whose op saved it first, so a block's bytes are additive
across blocks only up to the tensors at block boundaries.

The fidelity cost of a (block, form) is measured with only that block in the form and every
other tensor exact (:func:`~edgetorch.activations.fidelity.gradient_fidelities`, one reference
step for all): the mean, over the parameters, of the squared relative error of each gradient.
Squared errors of independent perturbations add, so the costs of several blocks are summed by
the solver (:mod:`.blockplan`). Parameters whose reference gradient is degenerate are left out:
those :func:`~edgetorch.activations.fidelity.gradient_fidelities` flags ``negligible`` (a bias
before a training batch norm, or a depthwise convolution at 1x1 spatial size before one, whose
gradient is zero in exact arithmetic: the batch norm cancels it, so its relative error is
rounding noise over rounding noise and would rank every form by that noise).

Example:
    >>> costs = measure_block_costs(model.train(), (x, y))  # doctest: +SKIP
    >>> costs.cost("layer4.1", Quantized(8)).fidelity  # doctest: +SKIP
    3.1e-05
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..measure import SavedTensorLedger
from .blocks import PerBlock, Recompute, find_blocks
from .fidelity import NEGLIGIBLE, GradientFidelity, gradient_fidelities
from .policies import BackRazor, Bitmap, Dense, Policy, Quantized
from .step import TrainingPolicy, forward_backward, restored

#: The forms a block is offered by default: exact, lossless, 8 and 4 bits, Back Razor with its
#: exact forms exact or at 8 bits, and recomputation keeping a lossless bitmap.
DEFAULT_FORMS: tuple[Policy | Recompute, ...] = (
    Dense(), Bitmap(), Quantized(8), Quantized(4), BackRazor(0.9), BackRazor(0.9, exact="int8"),
    BackRazor(0.95, exact="int8"), Recompute(Bitmap()))


@dataclass(frozen=True)
class FormCost:
    """One block in one form.

    Attributes:
        block: the block's name (:func:`~edgetorch.activations.blocks.find_blocks`).
        form: the block's policy, or :class:`~edgetorch.activations.blocks.Recompute`.
        stored_bytes: what the block holds for backward after the forward, in exact bytes.
        rerun_bytes: a recomputed block's rerun in backward stores this much at once (what the
            block holds in its kept form when not recomputed); 0 for other forms.
        fidelity: the mean squared relative gradient error with only this block in this form
            (0 for a form whose gradients are bit-identical to plain PyTorch's).

    Time is not yet a cost: no step time is measured per form, so the solver breaks ties between
    equally faithful forms by their machinery (:func:`~edgetorch.activations.blockplan.penalty`).
    """

    block: str
    form: Policy | Recompute
    stored_bytes: int
    rerun_bytes: int
    fidelity: float


@dataclass(frozen=True)
class BlockCosts:
    """What :func:`measure_block_costs` measured.

    Attributes:
        blocks: the blocks, in module order.
        forms: the forms offered to each block.
        costs: one :class:`FormCost` per (block, form), block by block, forms in order.
        default: the policy of the tensors saved outside every block.
        outside_bytes: what those tensors hold (under ``default``).
    """

    blocks: tuple[str, ...]
    forms: tuple[Policy | Recompute, ...]
    costs: tuple[FormCost, ...]
    default: Policy
    outside_bytes: int

    def options(self, block: str) -> list[FormCost]:
        """The costs of ``block``'s forms, in the order of :attr:`forms`."""
        return [c for c in self.costs if c.block == block]

    def cost(self, block: str, form: Policy | Recompute) -> FormCost:
        """The cost of ``block`` in ``form``.

        Raises:
            KeyError: a block or form that was not measured.
        """
        found = next((c for c in self.costs if c.block == block and c.form == form), None)
        if found is None:
            raise KeyError(f"no cost measured for block {block!r} in {form!r}; measured blocks: {list(self.blocks)}, "
                           f"forms: {[f.spec() for f in self.forms]}")
        return found


def measure_block_costs(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                        forms: Sequence[Policy | Recompute] = DEFAULT_FORMS, *, blocks: Sequence[str] | None = None,
                        default: Policy = Bitmap(), negligible: float = NEGLIGIBLE,
                        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> BlockCosts:
    """Measure the bytes and the fidelity cost of every block in every form.

    Runs ``len(forms) + 1`` ledger steps and ``len(blocks) * len(forms) + 1`` gradient steps on
    ``batch``. The model's weights, buffers, gradients and RNG state are as they were when this
    returns. Use it in the mode it trains in (``model.train()``, or batch norm frozen).

    Args:
        model: the model.
        batch: ``(inputs, targets)``: bytes scale with the batch (per sample), fidelity does not much.
        forms: the forms to offer each block (policies, or ``Recompute(policy)``).
        blocks: the block names; default :func:`~edgetorch.activations.blocks.find_blocks`.
        default: the policy of tensors saved outside every block.
        negligible: leave out parameters whose reference gradient norm is at most this fraction
            of the largest (as :func:`~edgetorch.activations.fidelity.gradient_fidelity` does).
        loss_fn: ``loss_fn(outputs, targets)``; default cross-entropy.

    Returns:
        A :class:`BlockCosts`.

    Raises:
        ValueError: no blocks, no forms, or a ``negligible`` outside [0, 1).

    Example:
        >>> costs = measure_block_costs(model.train(), (x, y), [Bitmap(), Quantized(8)])  # doctest: +SKIP
    """
    blocks = tuple(find_blocks(model) if blocks is None else blocks)
    forms = tuple(forms)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no blocks (no nn.Sequential or nn.ModuleList of two or more "
                         "modules with parameters); name them with blocks=")
    if not forms:
        raise ValueError("give at least one form")
    loss_fn = loss_fn or F.cross_entropy
    x, y = batch
    # One ledger step per form (and the default's, for what lies outside the blocks); a
    # recomputed block's rerun stores what the block stores in its kept form.
    kept = tuple(dict.fromkeys(f.keep for f in forms if isinstance(f, Recompute) and f.keep not in forms))
    outside, by_form = 0, {}
    for form in (default, *forms, *kept):
        ledger = SavedTensorLedger()
        with restored(model):
            forward_backward(model, x, y, TrainingPolicy(PerBlock(tuple((b, form) for b in blocks), default)),
                             loss_fn, ledger)
            for p in model.parameters():
                p.grad = None
        per_block = _bytes_by_block(ledger, blocks)
        by_form[form] = per_block
        if form is default:
            outside = per_block[None]
    plans = [PerBlock(((b, form),), Dense()) for b in blocks for form in forms]
    fidelities = gradient_fidelities(model, (x, y), plans, loss_fn=loss_fn, negligible=negligible)
    costs = []
    for plan, fidelity in zip(plans, fidelities):
        (block, form), = plan.blocks
        rerun = by_form[form.keep][block] if isinstance(form, Recompute) else 0
        costs.append(FormCost(block, form, by_form[form][block], rerun, _error(fidelity)))
    return BlockCosts(blocks, forms, tuple(costs), default, outside)


def _bytes_by_block(ledger: SavedTensorLedger, blocks: Sequence[str]) -> dict[str | None, int]:
    """The ledger's stored bytes per block (None: outside every block), by the saving module's name.

    A recomputed block's rerun is recorded by an engine on the block alone, with names relative to
    it that start with no block's: those rows (and the root's) count as outside, and are left out
    where they are not the forward's (``rerun`` is measured from the kept form's step instead).
    """
    ordered = sorted(blocks, key=len, reverse=True)  # a block inside another keeps its own rows
    totals: dict[str | None, int] = dict.fromkeys((*blocks, None), 0)
    for row in ledger.records:
        block = next((b for b in ordered if row.module == b or row.module.startswith(b + ".")), None)
        totals[block] += row.stored_bytes
    return totals


def _error(fidelity: GradientFidelity) -> float:
    """Mean squared relative error over the parameters whose reference gradient is not negligible."""
    counted = [r.relative_error for r in fidelity.parameters if not r.negligible]
    if any(math.isnan(e) for e in counted):
        return math.inf
    return sum(e * e for e in counted) / len(counted) if counted else 0.0
