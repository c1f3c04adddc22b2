"""Fit a training run into a memory budget: measure a step per policy, predict every batch size, choose.

For each candidate policy the planner runs real training steps (forward, backward and the
optimizer's step at learning rate 0, so no weight moves; batch-norm statistics restored after)
at two small calibration batches, in this process, and reads the step's peak resident memory (CPU) or the CUDA
allocator's peak. A step's increase over what was held before it is close to linear in the
batch size (saved activations and their gradients are per sample; workspace is mostly per
sample too), so two points give each policy's line, and every batch size from the requested
one down is predicted from it. The line rises at least as fast as the step's saved bytes (the
ledger's, per sample): the peak is the larger of the activations' and the gradients', and two
small batches may see only the gradients'.

    predicted peak = held now (interpreter, torch, model, data)
                     + optimizer state (per trainable parameter: 1 copy for SGD with momentum, 2 for Adam)
                     + the policy's step increase at that batch (the line; it includes the
                       optimizer step's temporaries, e.g. the gradient copies of weight decay)
                     + the input batch itself

The prediction assumes the standard loop, where gradients are freed
(``optimizer.zero_grad(set_to_none=True)``) before each forward; a loop that keeps them until
after the forward holds one more copy of the trainable parameters at the peak.

Before measuring, glibc is told to give large allocations their own mappings and freed memory
back (:func:`edgetorch.measure.process.honest_malloc`), so RSS follows what is live and one
policy's freed memory cannot hide the next one's. The ledger of the larger calibration step is
kept beside each line, for the table.

The lines come from small batches, and what the lossless bitmap saves depends on how many
activations are zero, so a prediction is checked before it is trusted: the first candidate that
fits is run once at its own batch, and chosen only if that step's measured peak fits too;
otherwise the next one is tried (up to ``VERIFY_ATTEMPTS``).

The choice follows the least accuracy risk: exact policies (dense, lossless bitmap) first, then
8-bit and 4-bit quantized storage (every value kept, rounded), then the lowest Back Razor
sparsity (``exact="int8"`` after its lossless twin), then the largest batch; among equals, the least machinery
(no checkpointing before checkpointing, dense before an encoding policy), then the faster step.
The step times come from the small calibration batches, which are too noisy to rank dense
against the lossless bitmap on their own.

Example:
    >>> plan = plan_memory(model, (images, labels), "600MiB")  # doctest: +SKIP
    >>> plan.chosen.policy, plan.chosen.batch  # doctest: +SKIP
    ('bitmap', 32)
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .._checks import check_positive_int
from ..measure import SavedTensorLedger
from ..measure.process import (frozen_old_objects, held_bytes, honest_malloc, peak_bytes, peak_kind, release_freed,
                               reset_peak)
from .blocks import PerBlock, Recompute, find_blocks
from .blockplan import assess
from .budget_blocks import BlockFit, TimeBound, fit_blocks, scaled
from .checkpoint import find_stages
from .costs import BlockCosts, lossless, measure_block_costs
from .policies import BackRazor, Dense, Policy, Quantized
from .step import TrainingPolicy, forward_backward, parse_training_policy, restored, step_seconds

#: A per-block plan may be this much slower per sample than the whole-model choice it replaces.
MAX_SLOWDOWN = 1.1
VERIFY_ATTEMPTS = 6  # candidates run at their own batch before giving up (each costs one step)
TIME_ROUNDS = 3  # interleaved steps per side where a per-block plan is timed beside the whole-model choice
DEFAULT_POLICIES = ("dense", "bitmap", "dense+checkpoint", "bitmap+checkpoint", "quantized:bits=8",
                    "quantized:bits=4", "backrazor:sparsity=0.8", "backrazor:sparsity=0.9",
                    "backrazor:sparsity=0.9,exact=int8", "backrazor:sparsity=0.95", "backrazor:sparsity=0.97",
                    "backrazor:sparsity=0.9+checkpoint", "backrazor:sparsity=0.97+checkpoint")
OPTIMIZER_STATES = {"sgd": 1, "sgd-no-momentum": 0, "adam": 2, "adamw": 2}  # state tensors per parameter
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str | int) -> int:
    """``"600MiB"``, ``"1.5GiB"``, ``"800MB"`` or a byte count as an int.

    Raises:
        ValueError: not a positive size with one of the units B, KB, MB, GB, KiB, MiB, GiB.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in {"", *_UNITS}:
            raise ValueError(f"memory size {text!r} is not a number with a unit (B, KB, MB, GB, KiB, MiB, GiB), "
                             "e.g. 600MiB")
        value = int(float(match.group(1)) * _UNITS.get(unit, 1))
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner considered.

    Attributes:
        policy: the training policy spec (``parse_training_policy`` accepts it; a
            ``+checkpoint`` suffix means the model's stages are checkpointed).
        batch: batch size.
        predicted_peak_bytes: the run's predicted peak (resident memory, or CUDA allocated).
        fits: ``predicted_peak_bytes * (1 + margin) <= budget``.
        exact: the policy gives exact gradients (dense, lossless bitmap).
        sparsity: Back Razor's sparsity (0 for exact policies).
        step_time_ratio: the policy's measured step time per sample over dense's, at the larger
            calibration batch.
        saved_bytes: the ledger's stored activation bytes at that batch, scaled to ``batch``.
        measured_peak_bytes: for the candidates run once at their own batch before choosing
            (the chosen one, and any preferred one whose measurement did not fit), the peak
            that step reached; ``fits`` then follows it. None for the others.
        untrainable: the model raised a ValueError when run at this batch, which lies below every
            calibration batch (batch norm cannot train on one sample of a 1x1 feature map); such
            a candidate never fits.
    """

    policy: str
    batch: int
    predicted_peak_bytes: int
    fits: bool
    exact: bool
    sparsity: float
    step_time_ratio: float
    saved_bytes: int
    measured_peak_bytes: int | None = None
    untrainable: bool = False


@dataclass(frozen=True)
class MemoryPlan:
    """What :func:`plan_memory` measured, predicted and chose.

    Attributes:
        budget_bytes: the budget.
        candidates: every (policy, batch), in the order of preference.
        chosen: the first candidate that fits, or None.
        reason: one sentence on why it was chosen (or why nothing fits).
        held_bytes: memory held before training (measured) plus the optimizer's state (computed).
        calibration_batches: the two batch sizes each policy was measured at, by policy spec (the
            same one twice where a step one sample larger could break the budget: its line then runs
            through half that batch, or is the one step scaled through zero where the model cannot
            train on fewer samples).
        memory_kind: ``"peak_rss"`` or ``"cuda_max_allocated"``.
        blocks: with ``per_block=True``, the per-block plan fitted to the budget
            (:class:`~edgetorch.activations.budget_blocks.BlockFit`: its table, batch, predicted and
            measured peak), or None where none is predicted to fit or none was sought (an exact
            candidate fits at the requested batch); None without ``per_block``. Where it is used,
            ``chosen`` is its candidate. It is not used where its fidelity cost is above that of
            the plan of every block in the whole-model choice's form, at that choice's batch or a
            smaller one (``reason`` says so).
    """

    budget_bytes: int
    candidates: list[Candidate]
    chosen: Candidate | None
    reason: str
    held_bytes: int
    calibration_batches: dict[str, tuple[int, int]]
    memory_kind: str
    blocks: BlockFit | None = None


def plan_memory(model: nn.Module, example_batch: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                budget: str | int, *, policies: Sequence[str] = DEFAULT_POLICIES, optimizer: str = "sgd",
                weight_decay: float = 0.0, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                margin: float = 0.05, min_batch: int = 8, per_block: bool = False,
                max_slowdown: float | None = MAX_SLOWDOWN) -> MemoryPlan:
    """Measure one step per policy, predict the peak at every batch size, and choose.

    ``model`` must be set up as it will train: trainable parameters marked, batch norm frozen or
    not, on its device. Its weights, buffers (batch-norm statistics), gradients and RNG state are
    as they were when this returns. On a CPU with glibc, the malloc settings it makes stay for the
    rest of the process, so the training run that follows returns freed memory as it was measured.

    Args:
        model: the model to train.
        example_batch: ``(inputs, labels)`` at the requested batch size (labels default to
            class 0 when only inputs are given); the candidates are this batch size and its
            halvings down to ``min_batch``.
        budget: e.g. ``"600MiB"`` or a byte count: the most the process may hold (CPU: peak
            resident memory; CUDA: the allocator's peak).
        policies: candidate training policy specs (``POLICY`` or ``POLICY+checkpoint``); by
            default the exact ones, with and without checkpointing, 8- and 4-bit quantized, and
            Back Razor at 80-97% (``DEFAULT_POLICIES``).
        optimizer: ``"sgd"`` (momentum), ``"sgd-no-momentum"``, ``"adam"`` or ``"adamw"``: how
            much state per trainable parameter to add, and which step runs in calibration.
        weight_decay: as the run will use it (SGD's decay copies every gradient during the step).
        loss_fn: ``loss_fn(outputs, labels)``; default cross-entropy.
        margin: headroom a candidate must leave (0.05: predicted peak + 5% <= budget).
        min_batch: the smallest batch considered (capped at the requested one). Below about 8,
            batch-norm statistics and gradient noise put accuracy at more risk than a sparser
            Back Razor does, and the exact-first order would otherwise pick dense at batch 1.
        per_block: also fit a plan of one form per block (:mod:`.budget_blocks`; costs measured
            with :func:`~edgetorch.activations.costs.measure_block_costs`, solved exactly by
            :func:`~edgetorch.activations.blockplan.plan_blocks`, run once to check), returned as
            :attr:`MemoryPlan.blocks`. Where it fits and no exact candidate fits at its batch or a
            larger one, it is ``chosen`` (the first candidate: policy ``per-block(...)``), unless it
            is less faithful than every block in the whole-model choice's form would be. It is
            not sought where an exact candidate fits at the requested batch: no plan does better
            than exact gradients at the batch asked for, and its costs take ``len(forms) ** 2``
            ledger steps. Its prediction starts from dense's line, which is measured for it even
            where ``dense`` is not among ``policies`` (it is then not a candidate).
        max_slowdown: where a whole-model candidate fits, a per-block plan's step may take at most
            this many times its step time per sample (both against dense's, from the per-block
            costs' timed steps; the candidate's from its calibration steps where its policy is not
            one of the per-block forms), and the plan that fits is then timed beside the candidate
            (``TIME_ROUNDS`` interleaved steps each) and solved again faster where it measures
            slower than that; None for no bound.

    Returns:
        A :class:`MemoryPlan`.

    Raises:
        ValueError: a bad budget, policy, optimizer or batch.

    Example:
        >>> plan = plan_memory(torchvision.models.resnet18(), torch.rand(32, 3, 224, 224), "1GiB")  # doctest: +SKIP
    """
    budget_bytes = parse_bytes(budget)
    parsed = [parse_training_policy(spec) for spec in policies]
    if not find_stages(model):
        if policies is not DEFAULT_POLICIES and any(p.checkpoint for p in parsed):
            raise ValueError(f"{type(model).__name__} has no nn.Sequential of blocks to checkpoint; "
                             "drop the +checkpoint candidates")
        parsed = [p for p in parsed if not p.checkpoint]
    if not parsed:
        raise ValueError("give at least one policy")
    offered = {p.spec() for p in parsed}  # the candidates: dense's line alone may be added below
    if per_block and "dense" not in offered:
        parsed.append(TrainingPolicy(Dense()))  # the per-block prediction starts from the dense line
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")
    x, y = example_batch if isinstance(example_batch, (tuple, list)) else (example_batch, None)
    check_positive_int("min_batch", min_batch)
    if max_slowdown is not None and (isinstance(max_slowdown, bool) or not isinstance(max_slowdown, (int, float))
                                     or not max_slowdown > 0):
        raise ValueError(f"max_slowdown must be a number > 0 (1.1: at most 10% slower), or None; got {max_slowdown!r}")
    if x.dim() < 1 or x.shape[0] < 1:
        raise ValueError(f"example_batch needs a batch dimension, got inputs of shape {list(x.shape)}")
    requested = x.shape[0]
    y = torch.zeros(requested, dtype=torch.long, device=x.device) if y is None else y
    loss_fn = loss_fn or F.cross_entropy
    device = x.device
    floor = max(1, min(min_batch, requested))
    # Two small batches per policy, at least 2 where the request allows (batch norm cannot train
    # on one sample of a 1x1 feature map); the lines are extrapolated from them. The first is at
    # most the smallest candidate; the second is 1/4 of the request unless that step alone could
    # break the budget (see _second_batch; then less, or no second step): planning must not exceed
    # what it plans for.
    small = max(min(2, requested), min(requested // 8, floor))
    limit = budget_bytes / (1 + margin)

    def sample(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.arange(batch, device=device) % requested
        return x[index], y[index]

    if device.type != "cuda":
        honest_malloc()
    trainable = [p for p in model.parameters() if p.requires_grad]
    state_bytes = OPTIMIZER_STATES[optimizer] * sum(p.numel() * p.element_size() for p in trainable)
    # spec -> (slope, intercept, seconds per sample, saved bytes at c2, c1, c2)
    lines: dict[str, tuple[float, float, float, int, int, int]] = {}
    firsts: dict[str, tuple[int, int]] = {}  # spec -> (first calibration batch, its measured increase)
    with restored(model), _capped_at(device, budget_bytes), frozen_old_objects():  # cheap collections per step
        step = _zero_lr_optimizer(optimizer, trainable, weight_decay)
        _measure(model, *sample(small), TrainingPolicy(Dense()), loss_fn, None, None)  # warm-up: pools, first calls
        release_freed()
        held = held_bytes(device)
        if held + state_bytes >= limit:  # nothing can fit: say so now, not after measuring every policy
            return MemoryPlan(budget_bytes, [], None, _below_held(budget_bytes, held, state_bytes, margin),
                              held + state_bytes, {}, peak_kind(device))
        # One step creates the optimizer's state, so the measured steps hold it as training does
        # (it is added below from the parameter count, exactly).
        _measure(model, *sample(small), TrainingPolicy(Dense()), loss_fn, None, step)
        for policy in parsed:
            ledger = SavedTensorLedger()
            first_batch = small
            first, seconds = _measure(model, *sample(first_batch), policy, loss_fn, ledger, step)
            second_batch = _second_batch(first_batch, first, max(small + 1, requested // 4), limit - held - state_bytes)
            lower = None if second_batch is None else max(min(2, requested), second_batch // 2)
            if lower is not None and lower < first_batch:
                # Less than twice the first batch leaves the slope to noise (measured: 4 -> 5
                # samples gave resnet18's bitmap a third of its slope); move the first one down.
                first_batch = lower
                first, _ = _measure(model, *sample(first_batch), policy, loss_fn, None, step)
            if second_batch is None:
                # One sample more could break the budget (measured before this rule: MiniLM at
                # 256 tokens calibrated dense at batch 3 under a 1,265 MiB budget and the process
                # peaked at 1,275 MiB planning a run it then kept within): the line's other point
                # is a smaller batch. Where the model cannot train on one (batch norm on a 1x1
                # map), the line is the first step scaled through zero, which over-predicts every
                # larger batch (the intercept is not negative), so a candidate it predicts to fit does.
                second_batch, low = first_batch, None
                if first_batch > 1:
                    with contextlib.suppress(ValueError):
                        low, _ = _measure(model, *sample(first_batch // 2), policy, loss_fn, None, step)
                slope = first / first_batch if low is None else (first - low) / (first_batch - first_batch // 2)
                top = first
            else:
                ledger = SavedTensorLedger()
                top, seconds = _measure(model, *sample(second_batch), policy, loss_fn, ledger, step)
                slope = (top - first) / (second_batch - first_batch)
            # A step that recomputes nothing holds every tensor it saves when its forward ends, so
            # from the larger point on its increase grows at least as fast as the saved bytes. Two
            # small batches can give less: where the peak is the gradients' (a model of large weights
            # at a small batch), not the activations' (measured: MiniLM at 256 tokens, 8-bit, 21 MiB
            # a sample from batches 2 and 3, 28 saved, 37 from 4 to 8; the peak is the larger of two
            # lines, and a chord through small batches under-predicts it beyond them). A recomputing
            # step's ledger counts its reruns in backward too, which are not held at once.
            if not _recomputes(policy):
                slope = max(slope, ledger.total().stored_bytes / second_batch)
            lines[policy.spec()] = (slope, top - slope * second_batch, seconds / second_batch,
                                    ledger.total().stored_bytes, first_batch, second_batch)
            firsts[policy.spec()] = (first_batch, first)
        dense_seconds = lines.get("dense", next(iter(lines.values())))[2]
        sample_bytes = (x[0].numel() * x.element_size()) + y[:1].numel() * y.element_size()
        batches = sorted({b for k in range(requested.bit_length()) if (b := requested >> k) >= floor}, reverse=True)
        candidates = []

        def predict(slope: float, intercept: float, batch: int) -> tuple[int, bool]:
            peak = held + state_bytes + max(0.0, intercept + slope * batch) + batch * sample_bytes
            return int(peak), peak * (1 + margin) <= budget_bytes

        for policy in (p for p in parsed if p.spec() in offered):
            slope, intercept, seconds, saved, _, second_batch = lines[policy.spec()]
            for batch in batches:
                candidates.append(Candidate(policy.spec(), batch, *predict(slope, intercept, batch), _exact(policy),
                                            _sparsity(policy), seconds / dense_seconds,
                                            int(saved * batch / second_batch)))
        how = {policy.spec(): policy for policy in parsed if policy.spec() in offered}
        candidates.sort(key=lambda c: (not c.exact, _risk(how[c.policy]), -c.batch, how[c.policy].checkpoint,
                                       not isinstance(how[c.policy].policy, Dense), c.step_time_ratio))
        # The lines come from small batches, and what a bitmap saves depends on the data; so the
        # first candidate that fits is run once at its own batch before it is chosen (measured:
        # resnet18 at 112 px, bitmap at batch 32 predicted 945 MiB, trained at 1,026 MiB).
        chosen = None
        for _ in range(VERIFY_ATTEMPTS):
            index = next((i for i, c in enumerate(candidates) if c.fits and c.measured_peak_bytes is None), None)
            if index is None:
                break
            c = candidates[index]
            try:
                increase, _ = _measure(model, *sample(c.batch), parse_training_policy(c.policy), loss_fn, None, step)
            except torch.cuda.OutOfMemoryError:  # the allocator's cap is the budget (_capped_at)
                _forget_step(model)
                candidates[index] = dataclasses.replace(c, fits=False, measured_peak_bytes=budget_bytes)
                continue
            except ValueError:
                if c.batch >= firsts[c.policy][0]:  # a batch the calibration ran: not the batch's fault
                    raise
                # Below every calibration batch the model may not train at all (batch norm on one
                # sample of a 1x1 feature map): the candidate is out, whatever its line predicted.
                candidates[index] = dataclasses.replace(c, fits=False, untrainable=True)
                continue
            measured = held + state_bytes + increase + c.batch * sample_bytes
            candidates[index] = c = dataclasses.replace(c, measured_peak_bytes=int(measured),
                                                        fits=measured * (1 + margin) <= budget_bytes)
            if c.fits:
                chosen = c
                break
            # A third point, far from the first: refit this policy's line through the first
            # calibration step and this one, and predict its other batches again.
            first_batch, first = firsts[c.policy]
            if c.batch != first_batch:
                slope = (increase - first) / (c.batch - first_batch)
                intercept = increase - slope * c.batch
                candidates = [dataclasses.replace(o, **dict(zip(("predicted_peak_bytes", "fits"),
                                                                predict(slope, intercept, o.batch))))
                              if o.policy == c.policy and o.measured_peak_bytes is None else o for o in candidates]
        fit, skipped = None, ""
        exact_as_asked = chosen is not None and chosen.exact and chosen.batch == requested
        if per_block and find_blocks(model) and not exact_as_asked:
            slope, intercept, _, saved, _, dense_batch = lines["dense"]

            def rest(b: int) -> int:  # the step's predicted peak less what dense saves
                return predict(slope, intercept, b)[0] - int(saved * b / dense_batch)

            # Measuring the costs compares each step's gradients with plain PyTorch's, held beside
            # them: one copy of the trainable gradients more than training holds (measured before
            # this check: MiniLM at 64 tokens, 1,192 MiB under a 1,074 MiB budget its plan kept).
            # They take no optimizer step, so its state is dropped meanwhile (AdamW's is two such
            # copies: with it held, MiniLM with AdamW at batch 16 sought no plan at a budget of 1,371 MiB,
            # measuring needing 1,350 MiB before the headroom).
            reference = sum(p.numel() * p.element_size() for p in trainable)
            measuring = predict(slope, intercept, small)[0] - state_bytes + reference
            if measuring * (1 + margin) > budget_bytes:
                skipped = (f"; no per-block plan: measuring its costs would need {measuring / 2**20:,.0f} MiB (a "
                           "reference gradient beside each step's)")
            # Where the rest of the step alone breaks the budget at the smallest batch, no plan
            # fits: the costs (len(forms) ** 2 ledger steps) are not measured.
            elif rest(batches[-1]) * (1 + margin) > budget_bytes:
                skipped = (f"; no per-block plan: the step without the blocks' saved tensors is predicted at "
                           f"{rest(batches[-1]) / 2**20:,.0f} MiB at batch {batches[-1]} (dense's peak less what "
                           "it saves), no room with the headroom")
            else:
                def run(b: int, how: TrainingPolicy) -> int:  # a step's measured peak; the cap's on OOM
                    try:
                        increase = _measure(model, *sample(b), how, loss_fn, None, step)[0]
                        return held + state_bytes + increase + b * sample_bytes
                    except torch.cuda.OutOfMemoryError:
                        _forget_step(model)
                        return budget_bytes

                # Timed on the smallest second calibration batch: every form's step there is within
                # what one calibrated policy's step held, and nearer the batch trained at than small.
                timed = min(line[5] for line in lines.values())
                if step is not None:
                    step.state.clear()
                costs = measure_block_costs(model, sample(small), loss_fn=loss_fn, time_batch=sample(timed))
                if step is not None:  # the state again, held before the plan's steps are measured
                    _measure(model, *sample(small), TrainingPolicy(Dense()), loss_fn, None, step)
                per_sample = _anchor(chosen, costs, small, rest)

                def anchored(b: int) -> int:
                    return rest(b) + int(per_sample * b)

                def slowdown(b: int, how: TrainingPolicy) -> float:  # the plan's step beside the choice's
                    return _time_ratio(model, sample(b), how, sample(chosen.batch),
                                       parse_training_policy(chosen.policy), loss_fn)

                bound = (None if chosen is None or max_slowdown is None
                         else TimeBound(max_slowdown, _step_time_ratio(chosen, costs), slowdown))
                fit = fit_blocks(costs, small, batches, budget_bytes, margin, anchored, run, VERIFY_ATTEMPTS, bound)
                if fit is None:
                    within = "" if bound is None else (f" within {max_slowdown:g}x the step time of {chosen.policy} "
                                                       f"at batch {chosen.batch}")
                    skipped = f"; no per-block plan is predicted to fit{within}"
        del step  # its state goes with it
    less = (fit is not None and fit.fits and chosen is not None and chosen.batch >= fit.batch
            and _less_faithful(fit, chosen, costs))
    if fit is not None and not fit.fits and fit.slowdown is not None:
        skipped = (f"; the last per-block plan tried, at batch {fit.batch}, measured {fit.slowdown:.2f}x the step time "
                   f"of {chosen.policy} at batch {chosen.batch} per sample (at most {max_slowdown:g}x){_refused(fit)}")
    elif fit is not None and not fit.fits:
        skipped = (f"; the last per-block plan tried, predicted at {fit.predicted_peak_bytes / 2**20:,.0f} MiB at batch "
                   f"{fit.batch}, measured {fit.measured_peak_bytes / 2**20:,.0f} MiB when run{_refused(fit)}")
    elif less:
        skipped = (f"; the per-block plan that fits (fidelity cost {fit.plan.fidelity:.3g}) is less faithful than "
                   f"{chosen.policy} in every block")
    reason = _reason(chosen, candidates, budget_bytes, requested, margin) + skipped
    if fit is not None and fit.fits and not less and not (chosen is not None and chosen.exact and chosen.batch >= fit.batch):
        whole = "nothing whole-model fits" if chosen is None else f"the whole-model choice was {chosen.policy} at batch {chosen.batch}"
        chosen = _block_candidate(fit)
        candidates.insert(0, chosen)
        timed = "" if fit.slowdown is None else f"; its step measured {fit.slowdown:.2f}x that choice's per sample"
        timed += _refused(fit)
        reason = f"a plan of one form per block at batch {fit.batch}: {fit.plan.reason} ({whole}{timed})"
    return MemoryPlan(budget_bytes, candidates, chosen, reason, held + state_bytes,
                      {spec: line[4:] for spec, line in lines.items()}, peak_kind(device), fit)


def _refused(fit: BlockFit) -> str:
    """The per-block plans run and refused before ``fit``, as the reason says them."""
    if not fit.refused:
        return ""
    said = [f"at batch {r.batch}, " + (f"{r.slowdown:.2f}x the choice's step time" if r.slowdown is not None else
                                      f"{r.measured_peak_bytes / 2**20:,.0f} MiB (predicted "
                                      f"{r.predicted_peak_bytes / 2**20:,.0f})") for r in fit.refused]
    return f"; plans run and refused before it: {'; '.join(said)}"


def _block_candidate(fit: BlockFit) -> Candidate:
    """A fitted per-block plan as the candidate training runs with. Its step time against dense's
    comes from the cost measurement's own timed steps (the rows' extra over dense), not from the
    calibration lines, which timed other steps."""
    forms = [form for _, form in fit.plan.policy.blocks] + [fit.plan.policy.default]
    step, extra = fit.plan.predicted_seconds, sum(r.seconds or 0.0 for r in fit.plan.rows)
    return Candidate(fit.plan.policy.spec(), fit.batch, fit.predicted_peak_bytes, True, all(map(lossless, forms)),
                     max((float(f.sparsity) for f in forms if isinstance(f, BackRazor)), default=0.0),
                     float("nan") if step is None else step / (step - extra),
                     sum(r.stored_bytes + r.rerun_bytes for r in fit.plan.rows), fit.measured_peak_bytes)


def _time_ratio(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], how: TrainingPolicy,
                other_batch: tuple[torch.Tensor, torch.Tensor], other: TrainingPolicy, loss_fn: Callable) -> float:
    """A step's time per sample under ``how`` over one's under ``other``, each the least of
    ``TIME_ROUNDS`` interleaved passes (:func:`~edgetorch.activations.step.step_seconds`, as the
    block_plan bench times its rows, with fewer rounds)."""
    seconds = step_seconds(model, {"how": (*batch, how), "other": (*other_batch, other)}, loss_fn, TIME_ROUNDS)
    return (seconds["how"] / len(batch[0])) / (seconds["other"] / len(other_batch[0]))


def _step_time_ratio(candidate: Candidate, costs: BlockCosts) -> float:
    """A whole-model candidate's step time over dense's, from the per-block costs' own timed steps
    where they timed its policy in every block (so the bound and the plans it bounds come from the
    same steps), else from the candidate's calibration steps."""
    form = _as_form(candidate, costs)
    if form is None or not costs.dense_seconds:
        return candidate.step_time_ratio
    return 1 + sum(costs.seconds_of(block, form) for block in costs.blocks) / costs.dense_seconds


def _as_form(candidate: Candidate, costs: BlockCosts) -> Policy | None:
    """A whole-model candidate's policy where it is one of the per-block forms (not checkpointed):
    the candidate is then the plan of every block in that form, and the costs predict it."""
    how = parse_training_policy(candidate.policy)
    return None if how.checkpoint or how.policy not in costs.forms else how.policy


def _anchor(chosen: Candidate | None, costs: BlockCosts, calibration_batch: int, rest: Callable[[int], int]) -> float:
    """What the per-block prediction misses, per sample, where a measurement shows it: the
    whole-model choice, run at its batch, is the plan of every block in its form when its policy is
    one of the forms. The peak model counts what a step stores, not a codec's working memory (the
    dense copies it encodes from and decodes to); measured on MiniLM at 256 tokens, batch 8: a plan
    of six 8-bit blocks predicted at 1,158 MiB peaked at 1,280 in the planner's verification step (an
    earlier plan, predicted within the budget, at 1,369 MiB over a 1,321 MiB budget), 8-bit
    whole-model at 1,274. Never negative: an over-prediction is left as it is."""
    form = None if chosen is None or chosen.measured_peak_bytes is None else _as_form(chosen, costs)
    if form is None:
        return 0.0
    at = scaled(costs, chosen.batch / calibration_batch)
    predicted = rest(chosen.batch) + assess(at, [form] * len(costs.blocks))[0]
    return max(0.0, (chosen.measured_peak_bytes - predicted) / chosen.batch)


def _less_faithful(fit: BlockFit, chosen: Candidate, costs: BlockCosts) -> bool:
    """Whether the fitted plan's fidelity cost exceeds that of the plan of every block in the
    whole-model choice's form (where its policy is one of the forms). That plan is among the
    solver's options, but a limit lowered after a step measured over its prediction can leave it
    out, and the solver then returns the least cost of what is left: a plan of 4-bit blocks is no
    choice where 8 bits fit whole-model."""
    form = _as_form(chosen, costs)
    return form is not None and fit.plan.fidelity > assess(costs, [form] * len(costs.blocks))[1]


@contextlib.contextmanager
def _capped_at(device: torch.device, budget_bytes: int) -> Iterator[None]:
    """On a GPU, the budget as the caching allocator's limit while planning: a step that would
    break it (a prediction that erred by more than the margin) raises OutOfMemoryError, and counts
    as not fitting, instead of taking the process's peak above the budget. Measured on an H200
    before the cap: resnet18 at 224 px, a plan verified at batch 64 took the allocator to 1,250 MiB
    under a 1,112 MiB budget. The cap bounds reserved memory, which is at least what is allocated,
    so it is conservative: a step refused for fragmentation alone counts as not fitting (seen once
    there: bitmap+checkpoint, 1,176 MiB allocated uncapped, refused under 1,275). No such cap exists
    for resident memory on a CPU (an address-space limit counts what is mapped, not used)."""
    if device.type != "cuda":
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # older torch has none
    before = 1.0 if getter is None else getter(device)  # 1.0: the allocator's default
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


def _forget_step(model: nn.Module) -> None:
    """After a step the allocator refused: drop what it left (gradients so far, cached blocks)."""
    for p in model.parameters():
        p.grad = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _second_batch(first_batch: int, first_increase: int, wanted: int, room: float) -> int | None:
    """The second calibration batch: ``wanted``, or less where its step could exceed ``room``;
    None where even ``first_batch + 1`` could.

    The step's increase is ``intercept + slope * batch`` with a non-negative intercept, so
    scaling the first step's increase by ``batch / first_batch`` over-predicts it: a batch that
    fits under that scaling fits.
    """
    largest = int(room / (max(first_increase, 1) / first_batch))
    return None if largest <= first_batch else min(wanted, largest)


def _recomputes(how: TrainingPolicy) -> bool:
    """Whether a step under ``how`` saves tensors again in backward: checkpointed stages, or a
    per-block plan with a recomputed block."""
    return how.checkpoint or (isinstance(how.policy, PerBlock) and any(isinstance(form, Recompute)
                                                                       for _, form in how.policy.blocks))


def _exact(how: TrainingPolicy) -> bool:
    return lossless(how.policy)


def _sparsity(how: TrainingPolicy) -> float:
    return float(how.policy.sparsity) if isinstance(how.policy, BackRazor) else 0.0


def _risk(how: TrainingPolicy) -> tuple:
    """The order of lossy policies (see the module docstring): quantized by bits, most first; a
    lossy bitmap by threshold; Back Razor by sparsity, its lossless exact forms first."""
    policy = how.policy
    if isinstance(policy, Quantized):
        return (0, -policy.bits, False)
    if isinstance(policy, BackRazor):
        return (2, policy.sparsity, policy.exact is not None)
    return (1, getattr(policy, "threshold", 0.0), False)


def _below_held(budget: int, held: int, state_bytes: int, margin: float) -> str:
    shown = f"{budget / 2**20:,.0f} MiB" if budget >= 2**20 else f"{budget:,} byte{'' if budget == 1 else 's'}"
    return (f"nothing fits {shown} with {margin:.0%} headroom: before training this process already holds "
            f"{held / 2**20:,.0f} MiB (interpreter, torch, model, data), and the optimizer's state adds "
            f"{state_bytes / 2**20:,.1f} MiB; a budget is in bytes unless it carries a unit (e.g. 600MiB, 1GiB)")


def _reason(chosen: Candidate | None, candidates: list[Candidate], budget: int, requested: int, margin: float) -> str:
    mib = 2**20
    untried = [c for c in candidates if c.fits and c.measured_peak_bytes is None]
    if chosen is None and untried:
        return (f"no choice: {VERIFY_ATTEMPTS} candidates predicted to fit {budget / mib:,.0f} MiB measured above it "
                f"when run; the next, {untried[0].policy} at batch {untried[0].batch}, is predicted at "
                f"{untried[0].predicted_peak_bytes / mib:,.0f} MiB but not measured; raise the budget or give it as "
                "the only policy")
    if chosen is None:
        trainable = [c for c in candidates if not c.untrainable] or candidates
        least = min(trainable, key=lambda c: c.measured_peak_bytes or c.predicted_peak_bytes)
        what = "measurement" if least.measured_peak_bytes else "prediction"
        # Say the headroom: "the smallest is 1,172 MiB" under a 1,230 MiB budget reads as a bug.
        return (f"nothing fits {budget / mib:,.0f} MiB with {margin:.0%} headroom: the smallest {what} is "
                f"{least.policy} at batch {least.batch}, "
                f"{(least.measured_peak_bytes or least.predicted_peak_bytes) / mib:,.0f} MiB; raise "
                "the budget, train fewer parameters, use a smaller input size, or allow smaller batches (the command's "
                "--min-batch, plan_memory's min_batch)")
    why = "an exact policy" if chosen.exact else (
        f"no exact policy fits at any batch, and {chosen.policy} is the least lossy that does (8-bit, then 4-bit "
        "quantized, then Back Razor by sparsity)")
    batch = "the requested batch" if chosen.batch == requested else f"the largest batch that fits (requested {requested})"
    rejected = sum(c.measured_peak_bytes is not None and not c.fits for c in candidates)
    also = f" ({rejected} preferred candidate(s) predicted to fit did not when run)" if rejected else ""
    return (f"{chosen.policy} at batch {chosen.batch}: {why}, at {batch}; predicted peak "
            f"{chosen.predicted_peak_bytes / mib:,.0f} MiB, measured {chosen.measured_peak_bytes / mib:,.0f} MiB in "
            f"one step, of {budget / mib:,.0f} MiB{also}")


def _zero_lr_optimizer(name: str, params: list[nn.Parameter], weight_decay: float) -> torch.optim.Optimizer | None:
    """The run's optimizer at learning rate 0: its step allocates and computes what the real one
    does, and moves no weight (every update is scaled by the learning rate)."""
    if not params:
        return None
    if name in ("adam", "adamw"):
        return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=0.0, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=0.0, momentum=0.9 if name == "sgd" else 0.0, weight_decay=weight_decay)


def _measure(model: nn.Module, x: torch.Tensor, y: torch.Tensor, how: TrainingPolicy, loss_fn: Callable,
             ledger: SavedTensorLedger | None, optimizer: torch.optim.Optimizer | None) -> tuple[int, float]:
    """One forward, backward and (if given) optimizer step under ``how``: (peak increase over
    what was held, seconds)."""
    device = x.device
    release_freed()
    before = held_bytes(device)
    reset_peak(device)
    start = time.perf_counter()
    loss = forward_backward(model, x, y, how, loss_fn, ledger)
    if optimizer is not None:
        optimizer.step()
    peak = peak_bytes(device)  # synchronises a GPU first
    seconds = time.perf_counter() - start
    del loss
    for p in model.parameters():
        p.grad = None
    return peak - before, seconds
