"""Per-block costs (edgetorch.activations.costs) and the exact per-block solver (edgetorch.activations.blockplan):
the solver against brute force on small random instances, the costs of a real model, and a plan that
predicts no less than the step it runs stores."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

import edgetorch
from edgetorch.activations.blockplan import assess, choose, penalty, plan_blocks, tie_break
from edgetorch.activations.blocks import PerBlock, Recompute
from edgetorch.activations.costs import BlockCosts, FormCost, measure_block_costs
from edgetorch.activations.fidelity import GradientComparison, GradientFidelity, gradient_fidelities
from edgetorch.activations.step import TrainingPolicy, forward_backward

FORMS = (edgetorch.Dense(), edgetorch.Bitmap(), edgetorch.Quantized(8), edgetorch.Quantized(4), Recompute())


def resnet18_first_half(num_classes: int) -> torch.nn.Module:
    """resnet18 up to layer2 (blocks layer1.0 to layer2.1; layer2.0 downsamples): its block types in 4
    blocks, not 8, and the stem's four layers (conv1 stores nothing: no fidelity steps), as the costs
    take fidelity steps per block and form (76 s of the suite with all 8 blocks)."""
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.layer3, model.layer4, model.fc = torch.nn.Identity(), torch.nn.Identity(), torch.nn.Linear(128, num_classes)
    return model


def _predicted(chosen, fixed):
    """The peak, by brute force over the moments of a step: the forward's end, and each block's
    rerun in backward, when the blocks after it have freed their tensors."""
    moments = [sum(c.stored_bytes for c in chosen)]
    moments += [sum(c.stored_bytes for c in chosen[: k + 1]) + chosen[k].rerun_bytes for k in range(len(chosen))]
    return fixed + max(moments)


def _along(costs, assignment):
    """Each block's cost in its form after the form of the block before (the pairwise model)."""
    return [costs.cost(b, f, assignment[i - 1] if i else None) for i, (b, f) in enumerate(zip(costs.blocks, assignment))]


@st.composite
def instances(draw):
    blocks = draw(st.integers(1, 4))
    forms = draw(st.permutations(FORMS))[: draw(st.integers(1, len(FORMS)))]  # any order: ties are not won by it
    timed = draw(st.booleans())  # steps timed: ties go to the faster form (few values: equal times too)
    costs = []
    for b in range(blocks):
        reruns = {form: draw(st.integers(0, 40)) if isinstance(form, Recompute) else 0 for form in forms}
        for after in (None,) if b == 0 else forms:  # a block's bytes and fidelity depend on its predecessor's form
            for form in forms:
                # few whole-number costs: every sum is exact, and ties (broken by penalty) are common
                costs.append(FormCost(f"b{b}", form, draw(st.integers(0, 50)), reruns[form],
                                      float(draw(st.integers(0, 4))), after))
    outside = draw(st.integers(0, 20))
    seconds = {(f"b{b}", form): draw(st.integers(0, 3)) * 1e-6 for b in range(blocks) for form in forms} if timed else None
    return BlockCosts(tuple(f"b{b}" for b in range(blocks)), forms, tuple(costs), edgetorch.Bitmap(), outside,
                      0.01 if timed else None, seconds), draw(st.integers(1, 240))


@settings(max_examples=300, deadline=None)
@given(instances())
def test_the_solver_finds_brute_forces_optimum(instance):
    costs, budget = instance
    plans = [_along(costs, a) for a in itertools.product(costs.forms, repeat=len(costs.blocks))]
    fitting = [c for c in plans if _predicted(c, costs.outside_bytes) <= budget]
    plan = plan_blocks(costs, budget, granularity=1)
    assert plan.fits == bool(fitting)
    chosen = _along(costs, [form for _, form in plan.policy.blocks])
    assert [r.stored_bytes for r in plan.rows] == [c.stored_bytes for c in chosen]
    assert assess(costs, [form for _, form in plan.policy.blocks]) == (_predicted(chosen, costs.outside_bytes),
                                                                       sum(c.fidelity for c in chosen))
    if not fitting:
        least = min(_predicted(c, costs.outside_bytes) for c in plans)  # the fallback: least peak, then fidelity
        assert plan.predicted_bytes == least and "no plan fits" in plan.reason
        assert plan.fidelity == min(sum(o.fidelity for o in c) for c in plans if _predicted(c, costs.outside_bytes) == least)
        return
    def tie(o):
        return tie_break(o.form, costs.seconds_of(o.block, o.form))

    best = min((sum(o.fidelity for o in c), sum(tie(o) for o in c)) for c in fitting)
    assert plan.predicted_bytes == _predicted(chosen, costs.outside_bytes) <= budget
    assert (plan.fidelity, sum(tie(c) for c in chosen)) == best
    if costs.dense_seconds is not None:
        assert plan.predicted_seconds == pytest.approx(costs.dense_seconds + sum(costs.seconds[(c.block, c.form)]
                                                                                 for c in chosen))
    else:
        assert plan.predicted_seconds is None
    assert [r.block for r in plan.rows] == list(costs.blocks)


@settings(max_examples=100, deadline=None)
@given(instances(), st.integers(2, 16))
def test_coarser_granularity_still_fits_in_exact_bytes(instance, granularity):
    costs, budget = instance
    plan = plan_blocks(costs, budget, granularity=granularity)
    exact = plan_blocks(costs, budget, granularity=1)
    if plan.fits:
        assert plan.predicted_bytes <= budget and plan.fidelity >= exact.fidelity
    assert plan.granularity == granularity


@settings(max_examples=300, deadline=None)
@given(instances(), st.integers(0, 12))
def test_a_time_bound_is_met_whenever_a_plan_meets_it_and_no_faster_plan_is_more_faithful(instance, micros):
    """The bound is met by Lagrangian relaxation (not exact): against brute force, a plan is found
    exactly when one meets both bounds, it meets them, and no plan that fits is both as fast and
    more faithful (the hull property)."""
    costs, budget = instance
    if costs.dense_seconds is None:
        with pytest.raises(ValueError, match="max_seconds needs timed costs"):
            plan_blocks(costs, budget, max_seconds=1.0)
        return
    bound = costs.dense_seconds + micros * 1e-6

    def seconds(chosen):
        return costs.dense_seconds + sum(costs.seconds[(c.block, c.form)] for c in chosen)

    plans = [_along(costs, a) for a in itertools.product(costs.forms, repeat=len(costs.blocks))]
    fitting = [c for c in plans if _predicted(c, costs.outside_bytes) <= budget]
    both = [c for c in fitting if seconds(c) <= bound + 1e-12]
    plan = plan_blocks(costs, budget, granularity=1, max_seconds=bound)
    assert plan.fits == bool(both)
    if not both:
        assert ("is fast enough" in plan.reason) == bool(fitting)
        return
    chosen = _along(costs, [form for _, form in plan.policy.blocks])
    assert plan.predicted_bytes <= budget and plan.predicted_seconds <= bound + 1e-12
    assert plan.predicted_seconds == pytest.approx(seconds(chosen))
    assert plan.fidelity >= min(sum(o.fidelity for o in c) for c in both)
    assert not [c for c in fitting if seconds(c) <= plan.predicted_seconds + 1e-12
                and sum(o.fidelity for o in c) < plan.fidelity]
    if min(seconds(c) for c in fitting if sum(o.fidelity for o in c) == min(
            sum(o.fidelity for o in f) for f in fitting)) <= bound + 1e-12:  # the bound binds nothing
        assert plan.policy == plan_blocks(costs, budget, granularity=1).policy


def test_a_time_bound_trades_fidelity_for_speed_along_the_hull():
    """Three forms: exact and slow, nearly exact and faster, lossy and fastest; block b loses more
    fidelity than block a in each lossy form. The bound picks the most faithful plan fast enough: no
    bound, the exact one; room for one exact block: b exact, a at 8 bits; none fast enough: none."""
    exact, near, lossy = edgetorch.Dense(), edgetorch.Quantized(8), edgetorch.Quantized(4)
    forms = (exact, near, lossy)
    cost = {("a", near): 1.0, ("a", lossy): 5.0, ("b", near): 3.0, ("b", lossy): 6.0}
    costs = BlockCosts(("a", "b"), forms, tuple(FormCost(b, f, 10, 0, cost.get((b, f), 0.0)) for b in "ab" for f in forms),
                       edgetorch.Bitmap(), 0, 0.010,
                       {(b, f): t for b in "ab" for f, t in ((exact, 3e-3), (near, 1e-3), (lossy, 0.0))})
    assert [r.form for r in plan_blocks(costs, 100).rows] == ["dense", "dense"]
    one = plan_blocks(costs, 100, max_seconds=0.014)  # 4 ms of extra time: b exact, a near (cost 1, not 3)
    assert [r.form for r in one.rows] == ["quantized", "dense"] and one.fidelity == 1.0
    assert one.predicted_seconds == pytest.approx(0.014) and "and 14.0 ms a step" in one.reason
    two = plan_blocks(costs, 100, max_seconds=0.0125)
    assert two.fits and [r.form for r in two.rows] == ["quantized"] * 2
    fastest = plan_blocks(costs, 100, max_seconds=0.010)
    assert fastest.fits and fastest.fidelity == 11.0
    slow = BlockCosts(costs.blocks, costs.forms, costs.costs, costs.default, 0, 0.010,
                      {key: t + 1e-3 for key, t in costs.seconds.items()})  # every form 1 ms slower
    none = plan_blocks(slow, 100, max_seconds=0.0115)
    assert not none.fits and "the fastest is predicted at 12.0 ms a step against the bound of 11.5 ms" in none.reason
    with pytest.raises(ValueError, match="max_seconds must be a number > 0"):
        plan_blocks(costs, 100, max_seconds=0)


def test_choose_breaks_ties_by_penalty_then_weight():
    def independent(*groups):  # every option the same whatever was chosen before it
        return [[list(g)] * (len(groups[i - 1]) if i else 1) for i, g in enumerate(groups)]

    assert choose(independent([(3, 0.0, 0, 0), (1, 1.0, 0, 0)], [(2, 0.0, 1, 0), (1, 0.0, 0, 0)]), 3) == [1, 1]
    assert choose(independent([(3, 0.0, 0, 0), (1, 0.0, 0, 0)]), 3) == [1]  # equal cost and penalty: the lighter
    assert choose(independent([(2, 0.0, 1, 0), (2, 0.0, 0, 0)], [(1, 0.0, 1, 0), (1, 0.0, 0, 0)]), 3) == [1, 1]
    assert choose(independent([(4, 0.0, 0, 0)]), 3) is None
    assert choose(independent([(0, 0.0, 0, 0)]), -1) is None


def test_choose_weighs_each_option_after_the_one_before_it():
    # the second group's option 0 is light only after the first group's option 1
    options = [[[(1, 0.0, 0, 0), (2, 1.0, 0, 0)]], [[(5, 0.0, 0, 0), (1, 3.0, 0, 0)], [(1, 0.0, 0, 0), (1, 3.0, 0, 0)]]]
    assert choose(options, 3) == [1, 0]  # cost 1: [0, 0] weighs 6, [0, 1] costs 3
    assert choose(options, 6) == [0, 0]


def test_a_transient_weight_needs_room_only_on_top_of_the_groups_up_to_its_own():
    # a rerun of 3 in the first group: on top of its 1 it fits 4, whatever the second group adds later
    first = [(1, 0.0, 0, 3), (2, 1.0, 0, 0)]
    second = [[(3, 0.0, 0, 0)], [(3, 0.0, 0, 0)]]
    assert choose([[first], second], 4) == [0, 0]  # peak max(1 + 3, 1 + 3) = 4
    assert choose([[first], second], 3) is None  # 1 + 3 > 3 and 2 + 3 > 3
    # in the last group it needs room on top of everything: 2 + 1 + 2 = 5
    last = [[(2, 0.0, 0, 0)]], [[(1, 0.0, 0, 2), (2, 1.0, 0, 0)]]
    assert choose(list(last), 4) == [0, 1] and choose(list(last), 5) == [0, 0]


def test_bad_arguments_say_what_is_accepted():
    costs = BlockCosts(("b",), (edgetorch.Dense(),), (FormCost("b", edgetorch.Dense(), 1, 0, 0.0),),
                       edgetorch.Dense(), 0)
    with pytest.raises(ValueError, match="budget_bytes must be an int >= 1"):
        plan_blocks(costs, 0)
    with pytest.raises(ValueError, match="granularity must be an int >= 1"):
        plan_blocks(costs, 10, granularity=0)
    with pytest.raises(KeyError, match="no cost measured for block 'c'"):
        costs.cost("c", edgetorch.Dense())


def test_negligible_reference_gradients_are_left_out_of_the_cost():
    rows = (GradientComparison("w", 0.9, 0.5, 1.0, 1.0), GradientComparison("b", 0.0, 1e3, 1.0, 1e-6, negligible=True),
            GradientComparison("v", 0.9, 0.1, 1.0, 1e-4))  # small but not flagged: counted, whatever its norm
    fidelity = GradientFidelity("x", rows, None, None, 0.0, 0.0)
    assert fidelity.mean_squared_relative_error == pytest.approx((0.25 + 0.01) / 2)  # w and v: (0.5)^2 and (0.1)^2
    nan = GradientFidelity("x", (GradientComparison("w", math.nan, math.nan, 1.0, 1.0),), None, None, 0.0, 0.0)
    assert nan.mean_squared_relative_error == math.inf


@pytest.fixture(scope="module")
def measured():
    torch.manual_seed(0)
    model = resnet18_first_half(10).train()
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    before = [p.detach().clone() for p in model.parameters()] + [b.clone() for b in model.buffers()]
    costs = measure_block_costs(model, (x, y), FORMS + (edgetorch.BackRazor(0.9, exact="int8"),))
    after = [p.detach() for p in model.parameters()] + list(model.buffers())
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the model is as it was
    return model, (x, y), costs


def test_costs_rank_forms_as_their_exactness_says(measured):
    _, _, costs = measured
    stem = ("conv1", "bn1", "relu", "maxpool")  # blocks of their own: a ResNet's stem saves as much as a stage
    assert costs.blocks == (*stem, "layer1.0", "layer1.1", "layer2.0", "layer2.1")
    assert len(costs.costs) == (1 + 7 * 6) * 6  # the first block per form, the others per (previous form, form)
    dense_form = edgetorch.Dense()
    by = {c.form: c for c in costs.options("conv1", None)}
    assert {c.stored_bytes for c in by.values()} == {0}  # it saves only the model's input, which the caller holds
    for i, block in enumerate(stem[1:], start=1):
        by = {c.form: c for c in costs.options(block, dense_form)}
        assert by[dense_form].stored_bytes > 0 and by[edgetorch.Quantized(8)].stored_bytes < by[dense_form].stored_bytes
        assert by[Recompute()].fidelity == by[edgetorch.Bitmap()].fidelity == 0.0  # not measured: lossless
    for i, block in enumerate(costs.blocks[len(stem):], start=len(stem)):
        by = {c.form: c for c in costs.options(block, None if i == 0 else dense_form)}
        dense, bitmap, q8, q4, recompute, br = (by[f] for f in costs.forms)
        assert dense.fidelity == bitmap.fidelity == recompute.fidelity == 0.0  # lossless: not measured
        assert 0 < q8.fidelity < q4.fidelity
        assert br.fidelity > 0
        assert q4.stored_bytes < q8.stored_bytes < dense.stored_bytes and bitmap.stored_bytes <= dense.stored_bytes
        assert recompute.stored_bytes < dense.stored_bytes and 0 < recompute.rerun_bytes <= bitmap.stored_bytes
        assert dense.rerun_bytes == q8.rerun_bytes == 0


def test_lossless_forms_cost_nothing_as_measured_too(measured):
    """The costs take a lossless form's fidelity cost as 0 without a step: measured here, in a stem
    layer (an in-place ReLU, recomputed) and a downsampling block, it is 0 to the bit."""
    model, batch, _ = measured
    plans = [PerBlock(((block, form),), edgetorch.Dense()) for block in ("relu", "layer2.0")
             for form in (edgetorch.Bitmap(), Recompute(), Recompute(edgetorch.Dense()))]
    assert [f.mean_squared_relative_error for f in gradient_fidelities(model, batch, plans)] == [0.0] * len(plans)


def test_a_block_after_one_that_stores_nothing_is_measured_once(measured):
    """conv1 stores nothing (its input is the caller's), so it holds no copy of the boundary in any
    form: bn1's cost is the same after every form of it, and measured once. Its premise, measured."""
    model, batch, costs = measured
    q4 = edgetorch.Quantized(4)
    assert len({costs.cost("bn1", q4, after).fidelity for after in costs.forms}) == 1
    alone, after_lossy = gradient_fidelities(model, batch, [PerBlock((("bn1", q4),), edgetorch.Dense()),
                                                            PerBlock((("conv1", edgetorch.Quantized(8)), ("bn1", q4)),
                                                                     edgetorch.Dense())])
    assert alone.mean_squared_relative_error == after_lossy.mean_squared_relative_error > 0


def test_a_block_after_a_lossy_block_reads_its_own_form_of_the_boundary(measured):
    # After an exact block, layer2.0's first convolution reads that block's exact copy of its
    # input; after a Back Razor block, which keeps only a ReLU mask of it, its own pruned copy.
    _, _, costs = measured
    br = edgetorch.BackRazor(0.9, exact="int8")
    after_exact, after_br = (costs.cost("layer2.0", br, after) for after in (edgetorch.Dense(), br))
    assert after_br.fidelity > 2 * after_exact.fidelity
    # and it stores that copy itself (the exact block's copy served it before)
    assert after_br.stored_bytes > after_exact.stored_bytes


def test_a_mixed_plans_ledger_holds_what_the_costs_predict_to_the_byte(measured):
    model, (x, y), costs = measured
    forms = costs.forms
    n = len(costs.blocks)
    for assignment in ([forms[(3 * i + 1) % len(forms)] for i in range(n)], [forms[i % 3 + 3] for i in range(n)],
                       [forms[(i * i) % len(forms)] for i in range(n)]):  # neighbours no measured step paired
        chosen = [costs.cost(b, f, assignment[i - 1] if i else None) for i, (b, f) in enumerate(zip(costs.blocks, assignment))]
        ledger = edgetorch.SavedTensorLedger()
        forward_backward(model, x, y, TrainingPolicy(PerBlock(tuple(zip(costs.blocks, assignment)), costs.default)),
                         F.cross_entropy, ledger)
        for p in model.parameters():
            p.grad = None
        # every forward row once, and every rerun once: what the model sums, with no tolerance
        assert ledger.total().stored_bytes == costs.outside_bytes + sum(c.stored_bytes + c.rerun_bytes for c in chosen)
        assert ledger.peak_live_bytes <= _predicted(chosen, costs.outside_bytes)


def test_the_summed_fidelity_of_two_lossy_neighbours_is_near_what_they_do_together(measured):
    model, batch, costs = measured
    br = edgetorch.BackRazor(0.9, exact="int8")
    together = gradient_fidelities(model, batch, [PerBlock((("layer1.1", br), ("layer2.0", br)), edgetorch.Dense())])[0]
    together = together.mean_squared_relative_error
    pairwise = costs.cost("layer1.1", br, edgetorch.Dense()).fidelity + costs.cost("layer2.0", br, br).fidelity
    independent = costs.cost("layer1.1", br, edgetorch.Dense()).fidelity + costs.cost("layer2.0", br, edgetorch.Dense()).fidelity
    assert abs(pairwise - together) < abs(independent - together) and 0.5 < pairwise / together < 2


def test_a_plan_stores_no_more_than_it_predicts(measured):
    model, (x, y), costs = measured
    dense = plan_blocks(costs, 2**40).predicted_bytes  # room for everything: every block dense
    least = plan_blocks(costs, 1).predicted_bytes  # nothing fits: the smallest plan
    fidelities = []
    for budget in (least + (dense - least) // 5, (least + dense) // 2, dense):
        plan = plan_blocks(costs, budget)
        assert plan.fits and plan.predicted_bytes <= budget
        ledger = edgetorch.SavedTensorLedger()
        forward_backward(model, x, y, TrainingPolicy(plan.policy), F.cross_entropy, ledger)
        for p in model.parameters():
            p.grad = None
        assert ledger.peak_live_bytes <= plan.predicted_bytes
        fidelities.append(plan.fidelity)
    assert fidelities[0] > 0 and fidelities[-1] == 0  # the tightest budget needs a lossy form; dense needs none


def test_reruns_are_told_from_the_forward_by_when_not_by_name():
    # A root Sequential names its blocks "0", "1", "2"; a rerun's engine names the rerun block's
    # modules "0", "0.0", ... as well: by name, every rerun would count as block "0"'s forward bytes.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.BatchNorm2d(3),
                                                      torch.nn.ReLU()) for _ in range(3))).train()
    x = torch.randn(2, 3, 8, 8)
    y = torch.tensor([1, 2])
    recompute = Recompute(edgetorch.Dense())

    def loss_fn(out, target):
        return F.cross_entropy(out.mean((2, 3)), target)

    costs = measure_block_costs(model, (x, y), (edgetorch.Dense(), recompute), blocks=("0", "1", "2"), loss_fn=loss_fn)
    assert costs.cost("0", recompute).stored_bytes == 0  # it keeps only its input, the model's input
    # Each rerun holds its block's tensors with the block's input held by the caller: for these
    # three equal blocks, what the first stores in the forward (its input is the model's).
    first = costs.cost("0", edgetorch.Dense()).stored_bytes
    assert [costs.cost(b, recompute, recompute if b != "0" else None).rerun_bytes for b in "012"] == [first] * 3
    ledger = edgetorch.SavedTensorLedger()
    forward_backward(model, x, y, TrainingPolicy(PerBlock(tuple((b, recompute) for b in "012"), costs.default)), loss_fn, ledger)
    assert ledger.total().stored_bytes == costs.outside_bytes + sum(
        c.stored_bytes + c.rerun_bytes for c in (costs.cost(b, recompute, recompute if b != "0" else None) for b in "012"))


def test_steps_are_timed_per_form_and_shared_among_blocks_by_their_dense_bytes(measured):
    _, _, costs = measured
    assert costs.dense_seconds > 0 and len(costs.seconds) == len(costs.blocks) * len(costs.forms)
    assert all(s >= 0 for s in costs.seconds.values())
    assert {costs.seconds_of(b, edgetorch.Dense()) for b in costs.blocks} == {0.0}  # the baseline: none, by construction
    plan = plan_blocks(costs, 10**12)
    assert plan.predicted_seconds >= costs.dense_seconds and "a step predicted at" in plan.reason
    assert all(r.seconds is not None for r in plan.rows)


def test_recomputations_extra_time_is_shared_by_forward_time_and_a_codecs_by_bytes(monkeypatch):
    """A recomputed block's rerun costs its forward, not its saved bytes: the extra time of
    recomputation is shared by each block's forward time in the dense step, a codec's by bytes.
    The forward times here come from a clock that ticks once per reading (no wall clock)."""
    import types

    import edgetorch.activations.costs as costs_module

    ticks = iter(range(10**6))
    monkeypatch.setattr(costs_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    monkeypatch.setattr(costs_module, "_extra_seconds", lambda *args: ({edgetorch.Dense(): 0.0, edgetorch.Bitmap(): 0.4,
                                                                         Recompute(): 0.8}, 1.0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 3))
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    forms = (edgetorch.Dense(), edgetorch.Bitmap(), Recompute())
    assert costs_module._forward_seconds(model, x, y, ("0", "2"), edgetorch.Bitmap(), F.cross_entropy, 2) == [1.0, 1.0]
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    monkeypatch.setattr(costs_module, "_forward_seconds", lambda *args: [3.0, 1.0])
    costs = measure_block_costs(model, (x, y), forms, blocks=("0", "2"))
    assert costs.seconds[("0", Recompute())] == pytest.approx(0.6) and costs.seconds[("2", Recompute())] == pytest.approx(0.2)
    dense = [costs.cost("0", forms[0]).stored_bytes, costs.cost("2", forms[0], forms[0]).stored_bytes]
    assert dense[0] != dense[1]  # 32 and 8 features: the bytes share differs from the forward's
    assert costs.seconds[("0", forms[1])] == pytest.approx(0.4 * dense[0] / sum(dense))


def test_steps_are_timed_on_the_time_batch_and_scaled_to_the_costs_batch(monkeypatch):
    """The planner measures bytes at batch 2 and times the steps on a larger batch (a small one takes
    more than its share of a step's time): the timed steps see only that batch, and their times come
    back at the costs' batch (times 2/8 here)."""
    import edgetorch.activations.costs as costs_module

    seen = []

    def extra_seconds(model, x, *args):
        seen.append(len(x))
        return {edgetorch.Dense(): 0.0, edgetorch.Bitmap(): 0.4}, 1.0

    monkeypatch.setattr(costs_module, "_extra_seconds", extra_seconds)
    monkeypatch.setattr(costs_module, "_forward_seconds", lambda model, x, *args: seen.append(len(x)) or [1.0, 1.0])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 3))
    x, y = torch.randn(8, 8), torch.tensor([0, 1, 2, 0] * 2)
    costs = measure_block_costs(model, (x[:2], y[:2]), (edgetorch.Dense(), edgetorch.Bitmap()), blocks=("0", "2"),
                                time_batch=(x, y))
    assert seen == [8, 8] and costs.dense_seconds == pytest.approx(0.25)
    assert sum(costs.seconds_of(b, edgetorch.Bitmap()) for b in ("0", "2")) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="time_batch needs inputs with a batch dimension"):
        measure_block_costs(model, (x, y), (edgetorch.Dense(),), blocks=("0", "2"), time_batch=(x[:0], y[:0]))


def test_untimed_costs_break_ties_by_machinery():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 3))
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    costs = measure_block_costs(model, (x, y), (edgetorch.Bitmap(), edgetorch.Dense()), blocks=("0", "2"),
                                time_rounds=0)
    assert costs.dense_seconds is None and costs.seconds is None and costs.seconds_of("0", edgetorch.Dense()) is None
    plan = plan_blocks(costs, 10**9)
    assert plan.predicted_seconds is None and [r.form for r in plan.rows] == ["dense", "dense"]
    with pytest.raises(ValueError, match="time_rounds must be an int >= 0"):
        measure_block_costs(model, (x, y), (edgetorch.Dense(),), blocks=("0", "2"), time_rounds=-1)


def test_a_faster_form_wins_a_tie_in_fidelity_whatever_its_machinery():
    fast, slow = Recompute(), edgetorch.Bitmap()  # recomputation measured faster here: time decides, not penalty
    costs = BlockCosts(("b",), (slow, fast), (FormCost("b", slow, 10, 0, 0.0), FormCost("b", fast, 10, 5, 0.0)),
                       edgetorch.Dense(), 0, 0.01, {("b", slow): 2e-3, ("b", fast): 1e-3})
    plan = plan_blocks(costs, 100, granularity=1)
    assert plan.rows[0].form == fast.spec() and plan.predicted_seconds == pytest.approx(0.011)
    assert plan.rows[0].why == "least fidelity cost of its forms, the fastest of those"
