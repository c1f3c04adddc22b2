"""Choose one storage form per block: the least fidelity cost whose predicted peak fits a budget.

The peak model, from the ledger steps of :mod:`.costs`: the saved bytes at the end of the forward
are what lies before the first block plus each block's stored bytes after its predecessor's form
(a boundary tensor is held once, by whoever saves it first, so the previous block's form changes
what a block adds), and backward frees them as it goes, last block first; a recomputed block's
rerun stores its own tensors again when backward reaches it, by which time every later block's
tensors are freed. So, with held(k) = outside + the stored bytes of blocks 1..k in their forms,

    predicted = base + max(held(last block), max over recomputed blocks k of held(k) + rerun(k))

where stored(block) is the block's bytes after its predecessor's form, and ``base`` is everything
else the caller counts (held memory, gradients, optimizer state; 0 predicts the ledger's saved
bytes alone). For a chain of blocks that share only boundary tensors, held(last block) is what a
step's ledger holds at the forward's end, to the byte; the rerun term is a bound (what lies after
the blocks, the head and the loss, is counted as held through backward). Measured on MiniLM at 256
tokens, batch 8, a plan that reran three layers was predicted at 1,538 MiB and peaked at 1,310
when each rerun was counted on top of the whole forward, as an earlier version did. The fidelity
cost is summed per block after its predecessor's form (see :mod:`.costs` for what it does not
capture).

Choosing a form per block to minimise the summed fidelity cost under that bound (among equals,
the least extra step time where steps were timed, then the least machinery: :func:`tie_break`) is a
multiple-choice knapsack whose item weights depend on the previous choice. It is solved exactly
by dynamic programming over (bytes so far, previous block's form), bytes rounded up to a stated
granularity (so a plan it accepts is predicted to fit in exact bytes too; it can miss a plan that
fits only within the rounding, at most one granule per block). A recomputed block's rerun is a
transient weight: the option is open only from states whose bytes so far leave room for it.
Carrying the previous form costs ``len(forms)`` times the independent knapsack.

A bound on the step time (``max_seconds``, where steps were timed) is a second constraint. It is
met by Lagrangian relaxation: the knapsack minimises fidelity + lambda * extra time, and lambda
walks the lower convex hull of (time, fidelity) between the most faithful plan and the fastest
(each new lambda is the slope between the two plans that bracket the bound; Eisner and Severance's
method). The plan returned meets the bound whenever some plan that fits the bytes meets it (the
fastest one is a hull point), and no plan that fits is both as fast and more faithful; a plan that
is not a vertex of the hull (inside it, or on an edge between two vertices), between the bound and
the vertex below it, can be missed. Times are compared in
whole microseconds, so the hull's ends are exact (the fastest plan is the most faithful of the
fastest).

Example:
    >>> plan = plan_blocks(measure_block_costs(model.train(), (x, y)), 200 * 2**20)  # doctest: +SKIP
    >>> for row in plan.rows: print(row.block, row.form, row.stored_bytes, row.why)  # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .blocks import PerBlock, Recompute
from .costs import BlockCosts, Form, FormCost
from .policies import Dense

#: Bytes are rounded to 1/STEPS of the room the blocks have, unless a granularity is given:
#: fine enough that rounding moves the plan by under 0.1% of the budget for 8-20 blocks.
STEPS = 16384


@dataclass(frozen=True)
class BlockChoice:
    """One row of a plan's table.

    Attributes:
        block: the block.
        form: the chosen form's spec.
        stored_bytes: what it stores in that form (a recomputed block: its input).
        rerun_bytes: what a recomputed block's rerun stores in backward (0 otherwise).
        fidelity: its fidelity cost (:class:`~edgetorch.activations.costs.FormCost`).
        seconds: its share of the form's extra step time over dense (None: not timed).
        why: why this form, in words.
    """

    block: str
    form: str
    stored_bytes: int
    rerun_bytes: int
    fidelity: float
    seconds: float | None
    why: str


@dataclass(frozen=True)
class BlockPlan:
    """What :func:`plan_blocks` chose.

    Attributes:
        policy: the plan as a policy: train under it with ``TrainingPolicy(plan.policy)``.
        rows: one :class:`BlockChoice` per block, in module order.
        fits: whether the predicted peak fits the budget (and the predicted step time the bound,
            where one was given); if not, ``policy`` is the plan of least predicted peak.
        predicted_bytes: the predicted peak (see the module docstring).
        budget_bytes: the budget.
        fidelity: the plan's summed fidelity cost.
        granularity: bytes were rounded up to multiples of this.
        reason: one sentence on the choice.
        predicted_seconds: the dense step's time plus each block's extra time in its form
            (None where steps were not timed).
    """

    policy: PerBlock
    rows: tuple[BlockChoice, ...]
    fits: bool
    predicted_bytes: int
    budget_bytes: int
    fidelity: float
    granularity: int
    reason: str
    predicted_seconds: float | None = None


def choose(options: Sequence[Sequence[Sequence[tuple[int, float, int, int]]]], capacity: int) -> list[int] | None:
    """The exact multiple-choice knapsack along a chain: one option per group, each option's
    weight, cost, penalty and transient weight depending on the option chosen in the group before;
    total weight <= ``capacity``, and at each group the weight so far (this option's included) plus
    the option's transient weight <= ``capacity`` too; least total cost; among those the least
    total penalty, then the lightest, then the earlier options.

    Args:
        options: ``options[i][p][j]``: group ``i``'s option ``j`` after option ``p`` of group
            ``i - 1``, as ``(weight, cost, penalty, transient)`` with non-negative integers but
            the cost (a plan's penalty: the forms' extra machinery, see :func:`penalty`; the
            transient weight: a recomputed block's rerun, which needs room on top of what the
            blocks up to it hold, not on top of the later ones, whose tensors backward has freed
            by then). The first group has one row, ``options[0][0]``; each later group one row
            per option of the group before.
        capacity: the most total weight.

    Returns:
        The chosen option's index per group, or None if no choice fits.

    Example:
        >>> second = [[(2, 0.0, 1, 0), (1, 0.0, 0, 0)], [(1, 0.0, 1, 0), (1, 0.0, 0, 0)]]
        >>> choose([[[(3, 0.0, 0, 0), (1, 1.0, 0, 0)]], second], 3)
        [1, 1]
    """
    if capacity < 0:
        return None
    # cost[p][w], extra[p][w]: the least (cost, penalty) of the groups so far at total weight
    # exactly w with option p last, compared in that order; the first group starts from one state.
    cost, extra = np.full((1, capacity + 1), np.inf), np.zeros((1, capacity + 1), dtype=np.int64)
    cost[0, 0] = 0.0
    picks = []  # per group after the first: [option j, weight w] -> the option before
    for i, group in enumerate(options):
        width = len(group[0])
        new_cost, new_extra = np.full((width, capacity + 1), np.inf), np.zeros((width, capacity + 1), dtype=np.int64)
        pick = np.full((width, capacity + 1), -1, dtype=np.int64)
        for p, row in enumerate(group):
            for j, (weight, value, pen, transient) in enumerate(row):
                # from weight w so far: w + weight + transient <= capacity
                sources = capacity + 1 - weight - transient
                if sources <= 0:
                    continue
                c, e = cost[p, :sources] + value, extra[p, :sources] + pen
                window = slice(weight, weight + sources)
                window_cost, window_extra = new_cost[j, window], new_extra[j, window]
                better = (c < window_cost) | ((c == window_cost) & (e < window_extra) & np.isfinite(c))
                window_cost[better], window_extra[better] = c[better], e[better]
                pick[j, window][better] = p
        cost, extra = new_cost, new_extra
        picks.append(pick)
    if not np.isfinite(cost).any():
        return None
    # least cost, then penalty, then weight, then the earlier option
    j, w = np.unravel_index(np.lexsort((np.arange(cost.size), np.tile(np.arange(capacity + 1), len(cost)),
                                        extra.ravel(), cost.ravel()))[0], cost.shape)
    j, w = int(j), int(w)
    chosen = []
    for group, pick in zip(reversed(options), reversed(picks)):
        p = int(pick[j, w])
        chosen.append(j)
        w -= group[p][j][0]
        j = p
    return chosen[::-1]


def penalty(form: object) -> int:
    """The extra machinery of a form: 0 for ``Dense()`` (nothing encoded, though inside a plan its
    tensors still pass through the engine, which records and deduplicates them), 1 for a form
    that encodes, 2 for recomputation (a second forward of the block)."""
    if isinstance(form, Recompute):
        return 2
    return 0 if isinstance(form, Dense) else 1


def tie_break(form: object, seconds: float | None) -> int:
    """What decides between options of equal fidelity cost, as a non-negative int (smaller first):
    the measured extra step time (``seconds``) in microseconds where steps were timed, then
    :func:`penalty` (which alone decides where they were not, or where the times are equal)."""
    machinery = penalty(form)
    return machinery if seconds is None else round(seconds * 1e6) * 3 + machinery


def plan_blocks(costs: BlockCosts, budget_bytes: int, *, base_bytes: int = 0,
                granularity: int | None = None, max_seconds: float | None = None) -> BlockPlan:
    """One form per block: the least summed fidelity cost whose predicted peak fits ``budget_bytes``.

    Args:
        costs: what :func:`~edgetorch.activations.costs.measure_block_costs` measured.
        budget_bytes: the budget for the predicted peak.
        base_bytes: what the prediction adds to the saved bytes (held memory, parameters'
            gradients, optimizer state), as the caller measured or computed it.
        granularity: bytes per DP step (each block's bytes are rounded up to a multiple); default
            the room the blocks have / ``STEPS``. 1 is exact in bytes (and slow for large budgets).
        max_seconds: the longest predicted step (:attr:`BlockPlan.predicted_seconds`: dense's step
            plus each block's extra time in its form); None for no bound. Needs timed costs. Met
            by Lagrangian relaxation (see the module docstring).

    Returns:
        A :class:`BlockPlan`; ``fits`` is False where no plan fits (then it holds the plan of
        least predicted peak).

    Raises:
        ValueError: a budget, base or granularity that is not a positive (non-negative) int, or
            a ``max_seconds`` that is not a positive number or comes with untimed costs.

    Example:
        >>> plan = plan_blocks(costs, 200 * 2**20, max_seconds=1.1 * costs.dense_seconds)  # doctest: +SKIP
    """
    for name, value, least in (("budget_bytes", budget_bytes, 1), ("base_bytes", base_bytes, 0),
                               ("granularity", 1 if granularity is None else granularity, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    timed = costs.dense_seconds is not None and costs.seconds is not None
    if max_seconds is not None:
        if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) or not max_seconds > 0:
            raise ValueError(f"max_seconds must be a number > 0 (or None: no bound), got {max_seconds!r}")
        if not timed:
            raise ValueError("max_seconds needs timed costs: measure them with time_rounds >= 1")
    fixed = base_bytes + costs.outside_bytes
    room = budget_bytes - fixed

    def tie(c: FormCost) -> int:
        return tie_break(c.form, costs.seconds_of(c.block, c.form))

    def micros(c: FormCost) -> int:  # the block's extra step time, in whole microseconds
        return round(costs.seconds_of(c.block, c.form) * 1e6) if timed else 0

    step = granularity or max(1, math.ceil(room / STEPS))
    # groups[i][p]: block i's options after option p of block i - 1 (the first block: one row)
    groups = [[costs.options(block, after) for after in ((None,) if i == 0 else costs.forms)]
              for i, block in enumerate(costs.blocks)]

    def solve(value: Callable[[FormCost], float]) -> list[int] | None:
        """The picks of least summed ``value`` (then tie-break, then forward bytes) that fit the bytes."""
        # a negative byte count (a block whose exact copies replace more than it adds) is rounded
        # up to 0: the prediction stays exact, the knapsack errs towards fitting
        return choose([[[(math.ceil(max(c.stored_bytes, 0) / step), value(c), tie(c), math.ceil(c.rerun_bytes / step))
                         for c in row] for row in g] for g in groups], room // step)

    picked = solve(lambda c: c.fidelity)
    too_slow = None  # the fastest plan's step, where even it breaks the time bound
    if picked is not None and max_seconds is not None:
        # the blocks' extra time, in whole microseconds (1e-6 of one absorbs the subtraction's rounding)
        bound = math.floor((max_seconds - costs.dense_seconds) * 1e6 + 1e-6)
        picked, extra = _within_time(solve, picked, groups, bound, micros)
        too_slow = None if extra is None else costs.dense_seconds + extra
    fits = picked is not None
    picked = picked if fits else _smallest(groups, step)
    chosen = _along(groups, picked)
    predicted = _predicted(chosen, fixed)
    rows = tuple(BlockChoice(c.block, c.form.spec(), c.stored_bytes, c.rerun_bytes, c.fidelity,
                             costs.seconds_of(c.block, c.form), _why(c, g[picked[i - 1] if i else 0], fits, tie, timed))
                 for i, (c, g) in enumerate(zip(chosen, groups)))
    fidelity = sum(c.fidelity for c in chosen)
    seconds = costs.dense_seconds + sum(costs.seconds_of(c.block, c.form) for c in chosen) if timed else None
    mib = 2**20
    if fits:
        step_time = (f"; a step predicted at {seconds * 1e3:,.1f} ms against dense's {costs.dense_seconds * 1e3:,.1f}"
                     if timed else "")
        bounded = f" and {max_seconds * 1e3:,.1f} ms a step" if max_seconds is not None else ""
        reason = (f"least summed fidelity cost ({fidelity:.3g}) of the plans predicted to fit {budget_bytes / mib:,.1f} "
                  f"MiB{bounded}: predicted {predicted / mib:,.1f} MiB ({fixed / mib:,.1f} outside the blocks){step_time}")
    elif too_slow is not None:
        reason = (f"no plan that fits {budget_bytes / mib:,.1f} MiB is fast enough: the fastest is predicted at "
                  f"{too_slow * 1e3:,.1f} ms a step against the bound of {max_seconds * 1e3:,.1f} ms; raise the "
                  "bound or the budget")
    else:
        reason = (f"no plan fits {budget_bytes / mib:,.1f} MiB: the least predicted peak is {predicted / mib:,.1f} MiB "
                  f"({fixed / mib:,.1f} outside the blocks); raise the budget, offer smaller forms or a smaller batch")
    return BlockPlan(PerBlock(tuple((c.block, c.form) for c in chosen), costs.default), rows, fits, predicted,
                     budget_bytes, fidelity, step, reason, seconds)


#: The most knapsacks the time bound's search solves after its two ends; the hull of 8-20 blocks'
#: plans has far fewer vertices between a bound and the most faithful plan (a guard, not a tuning).
HULL_ROUNDS = 64


def _within_time(solve: Callable[[Callable[[FormCost], float]], list[int] | None], faithful: list[int],
                 groups: Sequence[Sequence[Sequence[FormCost]]], bound: int,
                 micros: Callable[[FormCost], int]) -> tuple[list[int] | None, float | None]:
    """The most faithful plan on the hull within ``bound`` extra microseconds (see the module
    docstring), from ``faithful`` (the most faithful plan that fits): ``(picks, None)``, or
    ``(None, the fastest plan's step time in seconds less dense's)`` where no plan is fast enough."""
    def point(picked: list[int]) -> tuple[int, float]:
        chosen = _along(groups, picked)
        return sum(micros(c) for c in chosen), sum(c.fidelity for c in chosen)

    slow = point(faithful)
    if slow[0] <= bound:
        return faithful, None
    # The fastest plan, the most faithful of those: times are whole microseconds, so a fidelity
    # sum scaled below 1 orders plans of equal time without reordering different times.
    scale = 1.0 / (1.0 + sum(max(c.fidelity for row in g for c in row) for g in groups))
    fastest = solve(lambda c: micros(c) + c.fidelity * scale)
    fast = point(fastest)
    if fast[0] > bound:
        return None, fast[0] / 1e6
    for _ in range(HULL_ROUNDS):
        weight = (fast[1] - slow[1]) / (slow[0] - fast[0])  # fidelity per microsecond, the bracket's slope
        middle = solve(lambda c: c.fidelity + weight * micros(c))
        found = point(middle)
        line = slow[1] + weight * slow[0]
        if found[1] + weight * found[0] >= line - 1e-12 * max(1.0, abs(line)) or found in (slow, fast):
            break  # no hull point below the bracket's chord: the fast end is the answer
        if found[0] <= bound:
            fastest, fast = middle, found
        else:
            slow = found
    return fastest, None


def _along(groups: Sequence[Sequence[Sequence[FormCost]]], picked: Sequence[int]) -> list[FormCost]:
    """The costs of the picked options, each after the option picked before it."""
    return [g[picked[i - 1] if i else 0][j] for i, (g, j) in enumerate(zip(groups, picked))]


def _smallest(groups: Sequence[Sequence[Sequence[FormCost]]], granularity: int) -> list[int]:
    """The plan of least predicted peak (to a granule per block; ``granularity``, or coarser where
    the blocks' bytes need it), then least fidelity cost: what a plan that fits nothing falls back
    to. Found by bisecting the knapsack's capacity: it fits a capacity exactly when the least peak
    does."""
    most = sum(max(max(c.stored_bytes, 0) + c.rerun_bytes for row in g for c in row) for g in groups)
    step = max(granularity, math.ceil(most / STEPS))
    options = [[[(math.ceil(max(c.stored_bytes, 0) / step), c.fidelity, 0, math.ceil(c.rerun_bytes / step))
                 for c in row] for row in g] for g in groups]
    # every plan fits ``high``: each block's bytes round up once, and the one rerun counted once more
    high = -(-most // step) + len(groups) + 1
    least = bisect.bisect_left(range(high + 1), True, key=lambda capacity: choose(options, capacity) is not None)
    return choose(options, least)


def assess(costs: BlockCosts, forms: Sequence[Form]) -> tuple[int, float]:
    """The plan giving block ``i`` of ``costs.blocks`` the form ``forms[i]``: its saved bytes as the
    peak model predicts them (``base`` 0) and its summed fidelity cost, as :func:`plan_blocks` counts both.

    Raises:
        ValueError: not one form per block.
        KeyError: a form that was not measured.
    """
    if len(forms) != len(costs.blocks):
        raise ValueError(f"give one form per block ({len(costs.blocks)}), got {len(forms)}")
    chosen = [costs.cost(b, f, forms[i - 1] if i else None) for i, (b, f) in enumerate(zip(costs.blocks, forms))]
    return _predicted(chosen, costs.outside_bytes), sum(c.fidelity for c in chosen)


def _predicted(chosen: Sequence[FormCost], fixed: int) -> int:
    """The peak model (see the module docstring): the forward's saved bytes, or a rerun on top of
    what the blocks up to its own hold, whichever is more."""
    held, peak = 0, 0
    for c in chosen:
        held += c.stored_bytes
        peak = max(peak, held + c.rerun_bytes)
    return fixed + max(peak, held)


def _why(chosen: FormCost, options: Sequence[FormCost], fits: bool, tie: Callable[[FormCost], int],
         timed: bool) -> str:
    if not fits:
        return "its smallest form (nothing fits)"
    best = min(options, key=lambda c: (c.fidelity, tie(c), c.stored_bytes))
    if chosen is best:
        return ("least fidelity cost of its forms, the fastest of those" if timed
                else "least fidelity cost of its forms, with the least machinery")
    saved = (best.stored_bytes - chosen.stored_bytes) / 1024
    if chosen.fidelity == best.fidelity:
        return f"as exact as {best.form.spec()}, and stores {saved:,.0f} KiB less: the budget needs the bytes"
    return (f"stores {saved:,.0f} KiB less than {best.form.spec()} for {chosen.fidelity - best.fidelity:.3g} more "
            "fidelity cost: the budget needs the bytes")
