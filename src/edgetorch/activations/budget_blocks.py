"""The per-block plan inside :func:`~edgetorch.activations.budget.plan_memory`: one form per block, fitted to
the process budget and checked by running it once.

The costs (:mod:`.costs`) are measured once at a calibration batch; stored bytes are per sample,
so they are scaled to each batch. The rest of the step is taken from the dense line the planner
measured: at a batch ``b``

    predicted = dense's predicted peak(b) - dense's saved bytes(b) + the plan's saved bytes(b)

(the plan's saved bytes as :mod:`.blockplan` predicts them), plus, where the whole-model choice is
one of the forms and was run at its batch, what this model missed for the plan of every block in
that form, per sample (``budget._anchor``: a codec's working memory, which the ledger does not
count). From the requested batch down, the
first batch where a plan is predicted to fit is run once; if its measured peak does not fit, the
plan is solved again for a limit lowered by that run's prediction error, and where that gives the
same plan or none, the next batch is tried (up to ``VERIFY_ATTEMPTS`` runs in all).

Time is bounded the same way (:class:`TimeBound`): the solver keeps a plan's predicted step within
a multiple of the whole-model choice's, and where the choice can be timed beside it, the plan that
fits the budget is timed against it at once; a plan measured slower than the bound allows is
solved again with the time bound lowered by that measurement's error (measured on CPU before this
check: predicted plans took 1.12x to 1.30x the choice's step time on resnet18, deit_tiny and
mobilenet_v2, where the costs' small timed steps put them within 1.1x).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .blockplan import BlockPlan, plan_blocks
from .costs import BlockCosts
from .step import TrainingPolicy


@dataclass(frozen=True)
class BlockFit:
    """The per-block plan :func:`~edgetorch.activations.budget.plan_memory` found (``per_block=True``).

    Attributes:
        plan: the plan (its table, its policy, its prediction of the saved bytes alone).
        batch: the batch it was fitted at.
        predicted_peak_bytes: the run's predicted peak at that batch.
        measured_peak_bytes: the peak one step under the plan reached at that batch; None if the
            plan was not run (nothing was predicted to fit).
        fits: the measured peak, with the margin, is within the budget, and the measured step time
            within the time bound where it was timed.
        slowdown: the plan's step time per sample over the whole-model choice's, measured beside it
            (:attr:`TimeBound.measure`); None where not timed.
        refused: the plans run before this one and refused, in the order run: each measured over
            the budget (``slowdown`` None) or slower than the time bound allows.
    """

    plan: BlockPlan
    batch: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None
    fits: bool
    slowdown: float | None = None
    refused: tuple[BlockFit, ...] = ()


@dataclass(frozen=True)
class TimeBound:
    """How long a per-block plan's step may take: at most ``slowdown`` times the whole-model choice's.

    Attributes:
        slowdown: the most a plan's step time per sample may be over the choice's (1.1: 10% more).
        choice_ratio: the choice's step time over dense's, as the costs' timed steps predict it; the
            solver keeps a plan's predicted step within ``slowdown * choice_ratio`` times dense's.
        measure: a plan's step time per sample over the choice's, measured in interleaved steps
            beside it (a batch, the plan's policy -> the ratio); None: the prediction alone bounds it.
    """

    slowdown: float
    choice_ratio: float
    measure: Callable[[int, TrainingPolicy], float] | None = None


def scaled(costs: BlockCosts, factor: float) -> BlockCosts:
    """``costs`` at another batch, ``factor`` times the one measured: every byte count times
    ``factor`` (bytes are per sample), and every time too (an estimate: small batches take more
    than their share of a step's time)."""
    return dataclasses.replace(
        costs, outside_bytes=round(costs.outside_bytes * factor),
        dense_seconds=None if costs.dense_seconds is None else costs.dense_seconds * factor,
        seconds=None if costs.seconds is None else {key: t * factor for key, t in costs.seconds.items()},
        costs=tuple(dataclasses.replace(c, stored_bytes=round(c.stored_bytes * factor),
                                        rerun_bytes=round(c.rerun_bytes * factor)) for c in costs.costs))


def fit_blocks(costs: BlockCosts, calibration_batch: int, batches: Sequence[int], budget_bytes: int, margin: float,
               rest: Callable[[int], int], run: Callable[[int, TrainingPolicy], int],
               attempts: int, time_bound: TimeBound | None = None) -> BlockFit | None:
    """The per-block plan of least fidelity cost at the largest batch where one fits (see the module docstring).

    Args:
        costs: measured at ``calibration_batch``.
        calibration_batch: the batch ``costs`` were measured at.
        batches: the batches to try, largest first.
        budget_bytes: the budget; with ``margin``, what a measured peak must fit.
        margin: the headroom, as in :func:`~edgetorch.activations.budget.plan_memory`.
        rest: the predicted peak at a batch, less dense's saved bytes there (plus any anchor).
        run: one step at a batch under a training policy: its measured peak.
        attempts: the most plans run.
        time_bound: the step time allowed (see :class:`TimeBound`); None for no bound.

    Returns:
        A :class:`BlockFit` (``fits`` False if the last plan run did not fit the budget, or was
        timed slower than the bound allows; the plans refused before it in ``refused``), or None
        where no plan is predicted to fit at any batch.
    """
    run_plans: list[BlockFit] = []  # every plan run, as measured
    last = None
    ceiling = int(budget_bytes / (1 + margin))  # what a measured peak must stay within
    correction = 1.0  # the time bound's, from plans timed slower than predicted; kept for smaller batches
    for batch in batches:
        at = scaled(costs, batch / calibration_batch)
        base, limit = rest(batch), ceiling
        bound = (None if time_bound is None or at.dense_seconds is None
                 else time_bound.slowdown * time_bound.choice_ratio * at.dense_seconds * correction)
        while attempts > 0:
            plan = plan_blocks(at, limit, base_bytes=max(0, base), max_seconds=bound)
            if not plan.fits or (last is not None and last.batch == batch and last.plan.policy == plan.policy):
                break  # nothing smaller at this batch: the next batch
            attempts -= 1
            measured = run(batch, TrainingPolicy(plan.policy))
            fits = measured * (1 + margin) <= budget_bytes
            last = BlockFit(plan, batch, plan.predicted_bytes, measured, fits)
            if fits and bound is not None and time_bound.measure is not None and plan.predicted_seconds:
                slowdown = time_bound.measure(batch, TrainingPolicy(plan.policy))
                last = dataclasses.replace(last, slowdown=slowdown, fits=slowdown <= time_bound.slowdown)
            run_plans.append(last)
            if last.fits:
                break
            if fits:  # within the budget, timed too slow
                # Its time erred by slowdown / time_bound.slowdown over what the bound allows: a plan
                # predicted that much faster than this one measures within the bound if it errs alike.
                # Below this plan's prediction, so another plan (or none: the next batch).
                tighter = plan.predicted_seconds * time_bound.slowdown / last.slowdown
                correction *= tighter / bound
                bound = tighter
                continue
            # The step measured its prediction's error above the prediction; a plan predicted at
            # most that much below the ceiling measures within it if it errs by as much. That is
            # below this plan's prediction (measured > ceiling >= predicted), so a smaller plan,
            # and it keeps the slack this plan left under the ceiling (both in peak bytes, the
            # units of the ceiling: the budget's margin is not applied to the error).
            limit = min(limit, ceiling - (measured - plan.predicted_bytes) - 1)
            if limit < 1:
                break  # the step errs by more than the whole ceiling: no plan at this batch can fit
        if last is not None and last.fits:
            break
    return None if last is None else dataclasses.replace(last, refused=tuple(run_plans[:-1]))
