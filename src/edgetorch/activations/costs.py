"""What each storage form costs each block: bytes from the ledger of one step, fidelity measured once.

A block's costs depend on its neighbour. The tensor at a boundary (a block's input, the output
of the block before: ResNet's ReLU saves it, the next block's convolutions save it again) is
stored once per distinct form, by whoever saves it first; an exact copy serves every later op
and a later exact copy replaces an earlier mask. So the previous block's form decides both what
this block adds in bytes and whether its first ops read an exact copy of their input (Back
Razor@0.9 on resnet18's layer2.0 gives conv1.weight a relative error of 0.0 after an exact block,
0.80 after a Back Razor one). The costs are therefore kept per pair (previous block's form, this
block's form), and the solver carries the previous form in its state (:mod:`.blockplan`).

Bytes, exactly for a chain of blocks that share only their boundary tensors: one training step
per assignment of forms fills a :class:`~edgetorch.SavedTensorLedger`, and hooks mark the
ledger's stored bytes as each block starts and as the model's forward ends. What the ledger
gained from one block's start to the next block's start (new rows, less what its exact copies
made earlier rows give up) is that block's bytes after its predecessor's form. Steps with every
block in one form, and with two forms alternating (both ways round), give every block every
pair: ``len(forms) ** 2`` steps. Rows are attributed by when they were saved, not by the
module's name, so a recomputed block's rerun in backward (its rows named relative to the block,
``0.conv1``) is told from the forward by position: it starts when the block's forward starts a
second time, and what it saves is the block's ``rerun_bytes``. What the ledger holds outside
every block's window (the stem before the first block, the loss after the model) is
``outside_bytes``.

Fidelity: the mean, over the parameters, of the squared relative error of each gradient with
only this block compressed (:func:`~edgetorch.activations.fidelity.gradient_fidelities`, one
reference step for all; a lossless form costs 0 without a step, its gradients being plain
PyTorch's bit for bit, and so does every form of a block that stores nothing, such as a first
convolution whose input the caller holds). Squared errors of independent perturbations add, so
the solver sums them. Each lossy (block, form) is measured twice: after an exact previous block,
which lends the boundary exactly, and after the previous block at 8 bits (:data:`LENDS_NOTHING`:
it keeps a ReLU's output as a mask, so the block's ops read their own form), less what 8 bits
there cost alone. A previous form that keeps every tensor exact (:func:`lossless`) takes the first; any
other, a recomputed one included, the second. Not captured: a lossy previous form that lends the
boundary where 8 bits do not, or the other way round (the second is taken); and the next block
is exact in both measurements, so where a block's last op saves its output lossily (a GELU's
input, quantized), the next block's exact copy of it serves that op there, and the cost is low
for a plan whose next block is lossy (ResNet's and MobileNet's blocks end in a ReLU, whose mask
is lossless, or save no output). Parameters whose reference gradient is negligible are left out
(a bias before a training batch norm, or a depthwise convolution at 1x1 spatial size before
one: zero in exact arithmetic, the batch norm cancels it, so its relative error is rounding
noise over rounding noise and would rank every form by that noise).

Time, from timed steps (``time_rounds``): a whole training step with every block in one form,
for each form, against every block ``Dense()``, interleaved round by round, the least of each
(contention only adds time). A form's extra time over dense is shared among the blocks in
proportion to the bytes each saves under ``Dense()`` (what a codec reads), and a recomputed form's
in proportion to each block's forward time in the all-dense step (what its rerun computes; timed
by hooks at each block's start and end, the least of ``time_rounds`` steps): shared by bytes,
mobilenet_v2's plan of 12 recomputed blocks was predicted at 1.03x the 8-bit step's time and
measured 1.21x; by forward time, plans predicted within 1.1x measured 1.15x, 0.96x and 1.23x
(steps timed at the costs' batch, 2 in the planner, and scaled), and 0.97x, 1.30x and 0.93x
timed at the planner's second calibration batch (``time_batch``): recomputation's share is still
under-predicted (the 1.30x plan was predicted at 1.18x dense's step, measured 1.73x). An estimate,
not a measurement per block: the solver bounds a plan's step time by it and breaks ties with it,
and the plan's table shows it.

Example:
    >>> costs = measure_block_costs(model.train(), (x, y))  # doctest: +SKIP
    >>> costs.cost("layer4.1", Quantized(8), after=Dense()).fidelity  # doctest: +SKIP
    3.1e-05
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..measure import SavedTensorLedger
from .blocks import PerBlock, Recompute, find_blocks
from .fidelity import NEGLIGIBLE, gradient_fidelities
from .policies import BackRazor, Bitmap, Dense, Policy, Quantized
from .step import TrainingPolicy, forward_backward, restored, step_seconds, storing

#: The forms a block is offered by default: exact, lossless, 8 and 4 bits, Back Razor with its
#: exact forms exact or at 8 bits, and recomputation keeping a lossless bitmap.
DEFAULT_FORMS: tuple[Policy | Recompute, ...] = (
    Dense(), Bitmap(), Quantized(8), Quantized(4), BackRazor(0.9), BackRazor(0.9, exact="int8"),
    BackRazor(0.95, exact="int8"), Recompute(Bitmap()))

Form = Policy | Recompute
#: The previous block's form when a lossy form's cost is measured where no exact copy of the block's
#: input is lent: 8 bits keep a ReLU's output as a mask and the values of others at 8 bits, and
#: cost little alone (a recomputed previous block lends nothing either: its forward keeps only its
#: input, and the next block's first ops store the boundary in their own form).
LENDS_NOTHING = Quantized(8)


def lossless(form: Form) -> bool:
    """Whether ``form`` keeps every saved tensor exactly (``Dense()``, a ``Bitmap()`` with no
    threshold and full-precision values, or recomputation keeping one of those): its gradients
    are plain PyTorch's."""
    if isinstance(form, Recompute):
        return lossless(form.keep)
    return isinstance(form, Dense) or (isinstance(form, Bitmap) and form.threshold == 0 and form.value_dtype is None)


@dataclass(frozen=True)
class FormCost:
    """One block in one form, after the previous block in another.

    Attributes:
        block: the block's name (:func:`~edgetorch.activations.blocks.find_blocks`).
        form: the block's policy, or :class:`~edgetorch.activations.blocks.Recompute`.
        stored_bytes: what the block adds to the saved bytes in the forward, in exact bytes.
        rerun_bytes: what a recomputed block's rerun in backward stores; 0 for other forms.
        fidelity: the mean squared relative gradient error with only this block in this form
            (0 for a form whose gradients are bit-identical to plain PyTorch's).
        after: the previous block's form; None for the first block, or for a cost that holds
            whatever the previous block's form is.
    """

    block: str
    form: Form
    stored_bytes: int
    rerun_bytes: int
    fidelity: float
    after: Form | None = None


@dataclass(frozen=True)
class BlockCosts:
    """What :func:`measure_block_costs` measured.

    Attributes:
        blocks: the blocks, in the order the forward runs them.
        forms: the forms offered to each block.
        costs: one :class:`FormCost` per (block, form), and per previous form where it matters
            (``after``): costs with ``after`` None hold after any previous form.
        default: the policy of the tensors saved outside every block.
        outside_bytes: what those tensors hold (under ``default``).
        dense_seconds: a training step's time with every block ``Dense()`` (None: not timed).
        seconds: ``(block, form)`` -> the block's share of the form's extra step time over
            ``Dense()``, whatever the previous block's form (see the module docstring); None where
            steps were not timed (``time_rounds=0``), and then the solver breaks ties between
            equally faithful forms by their machinery (:func:`~edgetorch.activations.blockplan.penalty`).
    """

    blocks: tuple[str, ...]
    forms: tuple[Form, ...]
    costs: tuple[FormCost, ...]
    default: Policy
    outside_bytes: int
    dense_seconds: float | None = None
    seconds: Mapping[tuple[str, Form], float] | None = None

    def options(self, block: str, after: Form | None = None) -> list[FormCost]:
        """The costs of ``block``'s forms after the previous block in ``after``, in the order of
        :attr:`forms` (its costs that hold after any form, where it has those)."""
        return [self.cost(block, form, after) for form in self.forms]

    def cost(self, block: str, form: Form, after: Form | None = None) -> FormCost:
        """The cost of ``block`` in ``form`` after the previous block in ``after``.

        Raises:
            KeyError: a block, form or previous form that was not measured.
        """
        index = self._index()
        found = index.get((block, form, after), index.get((block, form, None)))
        if found is None:
            raise KeyError(f"no cost measured for block {block!r} in {form!r} after {after!r}; measured blocks: "
                           f"{list(self.blocks)}, forms: {[f.spec() for f in self.forms]}")
        return found

    def seconds_of(self, block: str, form: Form) -> float | None:
        """``block``'s extra step time in ``form`` (see :attr:`seconds`); None where not timed."""
        return None if self.seconds is None else self.seconds[(block, form)]

    def _index(self) -> dict[tuple, FormCost]:
        # Built on first use: the solver looks up every (block, previous form, form).
        if "_by_key" not in self.__dict__:
            object.__setattr__(self, "_by_key", {(c.block, c.form, c.after): c for c in self.costs})
        return self.__dict__["_by_key"]


def measure_block_costs(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                        forms: Sequence[Form] = DEFAULT_FORMS, *, blocks: Sequence[str] | None = None,
                        default: Policy = Bitmap(), negligible: float = NEGLIGIBLE,
                        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                        time_rounds: int = 3,
                        time_batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> BlockCosts:
    """Measure the bytes, the fidelity cost and the time of every block in every form after every form.

    Runs ``len(forms) ** 2`` ledger steps and, per block that stores anything, two gradient steps
    per lossy form and one at :data:`LENDS_NOTHING` (see the module docstring), plus one
    reference step, and ``time_rounds`` timed steps per form and of dense (and as many dense steps
    timed block by block), all on ``batch`` (the timed ones on ``time_batch`` where given). The
    model's weights, buffers, gradients and RNG state are as they were when this returns. Use it
    in the mode it trains in (``model.train()``, or batch norm frozen).

    Args:
        model: the model.
        batch: ``(inputs, targets)``: bytes scale with the batch (per sample), fidelity does not much.
        forms: the forms to offer each block (policies, or ``Recompute(policy)``).
        blocks: the block names, in the order the forward runs them, each run once per forward
            and none inside another; default :func:`~edgetorch.activations.blocks.find_blocks` with
            its stem (a ResNet's ``conv1``, ``bn1``, ``relu`` and ``maxpool`` are blocks too).
        default: the policy of tensors saved outside every block.
        negligible: leave out parameters whose reference gradient norm is at most this fraction
            of the largest (as :func:`~edgetorch.activations.fidelity.gradient_fidelity` does).
        loss_fn: ``loss_fn(outputs, targets)``; default cross-entropy.
        time_rounds: rounds of timed steps (the least of each form's is kept); 0 times nothing.
        time_batch: ``(inputs, targets)`` to time the steps on instead of ``batch``, their times scaled
            to ``batch``'s size: a small batch takes more than its share of a step's time, the more so
            under a codec (mobilenet_v2 at 128 px: the lossless bitmap's step 1.36x dense's at batch 2,
            1.03x at 16). Every form's step on it must fit in memory.

    Returns:
        A :class:`BlockCosts`.

    Raises:
        ValueError: no blocks, no forms, a form given twice, blocks that do not run once each in
            the order given, a ``negligible`` outside [0, 1), or a negative ``time_rounds``.

    Example:
        >>> costs = measure_block_costs(model.train(), (x, y), [Bitmap(), Quantized(8)])  # doctest: +SKIP
    """
    blocks = tuple(find_blocks(model, stem=True) if blocks is None else blocks)
    forms = tuple(forms)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no blocks (no nn.Sequential or nn.ModuleList of two or more "
                         "modules with parameters); name them with blocks=")
    if not forms or len(set(forms)) != len(forms):
        raise ValueError(f"give at least one form, each once; got {[f.spec() for f in forms]}")
    if isinstance(time_rounds, bool) or not isinstance(time_rounds, int) or time_rounds < 0:
        raise ValueError(f"time_rounds must be an int >= 0 (0: no timed steps), got {time_rounds!r}")
    if time_batch is not None and (time_batch[0].dim() < 1 or len(time_batch[0]) < 1):
        raise ValueError(f"time_batch needs inputs with a batch dimension, got shape {list(time_batch[0].shape)}")
    loss_fn = loss_fn or F.cross_entropy
    x, y = batch
    stored: dict[tuple[int, Form | None, Form], int] = {}  # (block index, previous form, form) -> bytes
    rerun: dict[tuple[int, Form], int] = {}
    outside = 0
    for assignment in _assignments(forms, len(blocks)):
        step = _measure_step(model, x, y, blocks, assignment, default, loss_fn)
        outside = max(outside, step.outside)  # the same in every step where only neighbours share
        for i, form in enumerate(assignment):
            stored.setdefault((i, assignment[i - 1] if i else None, form), step.stored[i])
            if i in step.rerun:
                rerun[(i, form)] = step.rerun[i]
    # a block that stores nothing after any form in any form (a first convolution, whose input is
    # the caller's) leaves every gradient exact: no fidelity steps for it
    storing = {key[0] for key, b in (*stored.items(), *rerun.items()) if b}
    silent = set(range(len(blocks))) - storing
    fidelity = _fidelities(model, (x, y), blocks, forms, loss_fn, negligible, silent)
    seconds, dense_seconds = None, None
    if time_rounds:
        tx, ty = batch if time_batch is None else time_batch
        per = len(x) / len(tx)  # the times, at batch's size (per sample alike)
        extra, dense_seconds = _extra_seconds(model, tx, ty, blocks, forms, default, loss_fn, time_rounds)
        extra, dense_seconds = {form: t * per for form, t in extra.items()}, dense_seconds * per
        # each block's bytes under Dense(): the all-dense ledger step already ran when Dense() is offered
        dense = ([stored[(i, Dense() if i else None, Dense())] for i in range(len(blocks))] if Dense() in forms
                 else _measure_step(model, x, y, blocks, (Dense(),) * len(blocks), default, loss_fn).stored)
        by_bytes = [max(b, 0) for b in dense]
        by_forward = _forward_seconds(model, tx, ty, blocks, default, loss_fn, time_rounds)
        seconds = {}
        for form in forms:
            weights = by_forward if isinstance(form, Recompute) else by_bytes
            seconds.update({(block, form): extra[form] * w / (sum(weights) or 1) for block, w in zip(blocks, weights)})
    costs = []
    for i, block in enumerate(blocks):
        for after in (None,) if i == 0 else forms:
            # a previous block that holds its output exactly lends it to this block's first ops
            lends = i == 0 or (not isinstance(after, Recompute) and lossless(after))
            costs.extend(FormCost(block, form, stored[(i, after, form)], rerun.get((i, form), 0),
                                  fidelity[(i, form, lends)], after) for form in forms)
    return BlockCosts(blocks, forms, tuple(costs), default, outside, dense_seconds, seconds)


def _extra_seconds(model: nn.Module, x: torch.Tensor, y: torch.Tensor, blocks: tuple[str, ...],
                   forms: tuple[Form, ...], default: Policy, loss_fn: Callable,
                   rounds: int) -> tuple[dict[Form, float], float]:
    """Each form's extra step time over every block ``Dense()`` (at least 0), and the dense step's
    time, each step timed by :func:`~edgetorch.activations.step.step_seconds` (``rounds`` rounds)."""
    configurations = [Dense(), *(form for form in forms if form != Dense())]
    steps = {str(k): (x, y, TrainingPolicy(PerBlock(tuple((b, form) for b in blocks), default)))
             for k, form in enumerate(configurations)}
    seconds = step_seconds(model, steps, loss_fn, rounds)
    least = [seconds[str(k)] for k in range(len(configurations))]
    extra = {form: max(0.0, t - least[0]) for form, t in zip(configurations, least)}
    return extra, least[0]


def _forward_seconds(model: nn.Module, x: torch.Tensor, y: torch.Tensor, blocks: tuple[str, ...], default: Policy,
                     loss_fn: Callable, rounds: int) -> list[float]:
    """Each block's forward time in a training step with every block ``Dense()``: the least of
    ``rounds`` steps, timed by hooks at the block's start and end (on a GPU the hooks synchronise,
    so these steps are not the timed ones)."""
    cuda = x.device.type == "cuda"
    least = [math.inf] * len(blocks)
    started: dict[int, float] = {}

    def start(index: int, *_) -> None:
        if cuda:
            torch.cuda.synchronize(x.device)
        started[index] = time.perf_counter()

    def stop(index: int, *_) -> None:
        if cuda:
            torch.cuda.synchronize(x.device)
        least[index] = min(least[index], time.perf_counter() - started.pop(index))

    modules = [model.get_submodule(b) for b in blocks]
    handles = [h for i, m in enumerate(modules) for h in (m.register_forward_pre_hook(functools.partial(start, i)),
                                                          m.register_forward_hook(functools.partial(stop, i)))]
    how = TrainingPolicy(PerBlock(tuple((b, Dense()) for b in blocks), default))
    try:
        for _ in range(rounds):
            with restored(model):
                forward_backward(model, x, y, how, loss_fn)
    finally:
        for handle in handles:
            handle.remove()
    return [0.0 if t == math.inf else t for t in least]


def _assignments(forms: tuple[Form, ...], n: int) -> list[tuple[Form, ...]]:
    """Forms per block such that every block after the first meets every (previous, own) pair
    once, and the first block every form: each form everywhere, then each two alternating, both
    ways round."""
    steps = [(form,) * n for form in forms]
    if n > 1:
        for a, p in enumerate(forms):
            for q in forms[a + 1:]:
                steps += [tuple((p, q)[i % 2] for i in range(n)), tuple((q, p)[i % 2] for i in range(n))]
    return steps


@dataclass(frozen=True)
class _Step:
    stored: list[int]  # per block, after its predecessor (see the module docstring)
    rerun: dict[int, int]  # per recomputed block: what its rerun saved
    outside: int  # what is saved before the first block


def _measure_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, blocks: tuple[str, ...],
                  assignment: tuple[Form, ...], default: Policy, loss_fn: Callable) -> _Step:
    """One ledger step under ``assignment``, its rows given to blocks (see the module docstring)."""
    ledger = SavedTensorLedger()
    starts: list[tuple[int, int]] = []  # (block index, ledger rows so far) each time a block's forward starts

    def mark(index: int, *_) -> None:
        starts.append((index, len(ledger.records)))

    handles = [model.get_submodule(b).register_forward_pre_hook(functools.partial(mark, i))
               for i, b in enumerate(blocks)]
    how = TrainingPolicy(PerBlock(tuple(zip(blocks, assignment)), default))
    try:
        with restored(model):
            if any(isinstance(form, Recompute) for form in assignment):  # reruns save in backward
                forward_backward(model, x, y, how, loss_fn, ledger)
                for p in model.parameters():
                    p.grad = None
            else:  # the forward saves all a step holds: no backward (a third of the time)
                with storing(model, how, ledger):
                    loss_fn(model(x), y)
    finally:
        for handle in handles:
            handle.remove()
    rows = ledger.records
    if [i for i, _ in starts[: len(blocks)]] != list(range(len(blocks))):
        raise ValueError(f"blocks must run one after another, each once per forward, in the order given "
                         f"({', '.join(blocks)}); their forwards started in the order "
                         f"{[blocks[i] for i, _ in starts[: len(blocks)]]}")
    # A block starting again runs in backward, to be recomputed: what is saved from then to the
    # next such start (or the step's end) is its rerun. The forward's rows all come first.
    reruns = starts[len(blocks):]
    again = [blocks[i] for i, _ in reruns if not isinstance(assignment[i], Recompute)]
    if again:
        raise ValueError(f"blocks must run once per forward; {', '.join(dict.fromkeys(again))} ran again (a module "
                         "used twice, such as one activation module shared by several layers, cannot be a block): "
                         "name blocks that run once with blocks=")
    ends = [at for _, at in reruns[1:]] + [len(rows)]
    rerun = {i: sum(r.stored_bytes for r in rows[at:end]) for (i, at), end in zip(reruns, ends)}
    forward = rows[: reruns[0][1] if reruns else len(rows)]
    # Owners by the saving module's name; a row saved outside every block belongs to the stem
    # before the first block's rows, else to the block saved after it (the last block after the last).
    names = {b: i for i, b in enumerate(blocks)}
    held, replaced = [0] * (len(blocks) + 1), [0] * (len(blocks) + 1)  # per block; [-1]: the stem
    waiting: list = []
    seen = False
    for row in forward:
        owner = _owner(row.module, names)
        if owner is None and seen:
            waiting.append(row)
            continue
        owner = -1 if owner is None else owner
        seen = seen or owner >= 0
        for r in (*waiting, row):
            held[owner] += r.stored_bytes
            replaced[owner] += r.replaced_bytes
        waiting = []
    for r in waiting:
        held[len(blocks) - 1] += r.stored_bytes
    # What a row held before a later exact copy replaced it is charged to its own block and taken
    # off the next one's (whose copy replaced it), so a block's bytes depend on its own form and
    # its predecessor's only; the sum is what the step held. The last block keeps its replaced
    # rows off: what replaced them is its own or the loss's.
    stored = [held[i] + (replaced[i] if i < len(blocks) - 1 else 0) - replaced[i - 1] for i in range(len(blocks))]
    return _Step(stored, rerun, held[-1] + replaced[-1])


def _owner(module: str, names: dict[str, int]) -> int | None:
    """The index of the innermost block ``module`` lies in, or None."""
    while module:
        if module in names:
            return names[module]
        module = module.rpartition(".")[0]
    return None


def _fidelities(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], blocks: tuple[str, ...],
                forms: tuple[Form, ...], loss_fn: Callable, negligible: float,
                silent: set[int]) -> dict[tuple[int, Form, bool], float]:
    """(block index, form, the previous block lends its output exactly) -> fidelity cost (see the
    module docstring): every form with only the block compressed, the rest exact (lending); a
    lossy form also after the previous block in :data:`LENDS_NOTHING`, less what that costs alone.
    No step runs for a lossless form (its gradients are plain PyTorch's, bit for bit: tested) or for
    the ``silent`` blocks, which store nothing: 0 for every key of theirs. After a silent block the
    two measurements are one: it holds no copy of the boundary in any form, so the block always
    stores its own."""
    zero = {(i, form, lends): 0.0 for i in range(len(blocks)) for form in forms for lends in (True, False)
            if i in silent or lossless(form)}
    keys = [(i, form, True) for i in range(len(blocks)) if i not in silent for form in forms if not lossless(form)]
    plans = {key: PerBlock(((blocks[key[0]], key[1]),), Dense()) for key in keys}
    for i in range(1, len(blocks)):
        if i in silent or i - 1 in silent:
            continue
        plans[(i - 1, LENDS_NOTHING, True)] = PerBlock(((blocks[i - 1], LENDS_NOTHING),), Dense())
        for form in forms:
            if not lossless(form):
                plans[(i, form, False)] = PerBlock(((blocks[i - 1], LENDS_NOTHING), (blocks[i], form)), Dense())
    fidelities = gradient_fidelities(model, batch, list(plans.values()), loss_fn=loss_fn, negligible=negligible)
    measured = {key: f.mean_squared_relative_error for key, f in zip(plans, fidelities)}
    costs = {key: measured[key] for key in keys}
    costs.update({(i, form, False): costs[(i, form, True)] for i, form, _ in keys if i - 1 in silent})
    for i, form, lends in plans:
        if not lends:  # squared errors of independent perturbations add: take the neighbour's off
            costs[(i, form, False)] = max(0.0, measured[(i, form, False)] - measured[(i - 1, LENDS_NOTHING, True)])
    return {**costs, **zero}
