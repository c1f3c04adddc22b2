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
from edgetorch.activations.blockplan import choose, penalty, plan_blocks
from edgetorch.activations.blocks import Recompute
from edgetorch.activations.costs import BlockCosts, FormCost, _error, measure_block_costs
from edgetorch.activations.fidelity import GradientComparison, GradientFidelity
from edgetorch.activations.step import TrainingPolicy, forward_backward

FORMS = (edgetorch.Dense(), edgetorch.Bitmap(), edgetorch.Quantized(8), edgetorch.Quantized(4), Recompute())


def _predicted(chosen, fixed):
    return fixed + sum(c.stored_bytes for c in chosen) + max((c.rerun_bytes for c in chosen), default=0)


@st.composite
def instances(draw):
    blocks = draw(st.integers(1, 4))
    forms = draw(st.permutations(FORMS))[: draw(st.integers(1, len(FORMS)))]  # any order: ties are not won by it
    costs = []
    for b in range(blocks):
        for form in forms:
            rerun = draw(st.integers(0, 40)) if isinstance(form, Recompute) else 0
            # few whole-number costs: every sum is exact, and ties (broken by penalty) are common
            costs.append(FormCost(f"b{b}", form, draw(st.integers(0, 50)), rerun, float(draw(st.integers(0, 4)))))
    outside = draw(st.integers(0, 20))
    return BlockCosts(tuple(f"b{b}" for b in range(blocks)), forms, tuple(costs), edgetorch.Bitmap(), outside), \
        draw(st.integers(1, 240))


@settings(max_examples=300, deadline=None)
@given(instances())
def test_the_solver_finds_brute_forces_optimum(instance):
    costs, budget = instance
    groups = [costs.options(b) for b in costs.blocks]
    fitting = [c for c in itertools.product(*groups) if _predicted(c, costs.outside_bytes) <= budget]
    plan = plan_blocks(costs, budget, granularity=1)
    assert plan.fits == bool(fitting)
    chosen = [costs.cost(block, form) for block, form in plan.policy.blocks]
    if not fitting:
        least = min(_predicted(c, costs.outside_bytes) for c in itertools.product(*groups))
        assert plan.predicted_bytes >= least and "no plan fits" in plan.reason
        return
    best = min((sum(o.fidelity for o in c), sum(penalty(o.form) for o in c)) for c in fitting)
    assert plan.predicted_bytes == _predicted(chosen, costs.outside_bytes) <= budget
    assert (plan.fidelity, sum(penalty(c.form) for c in chosen)) == best
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


def test_choose_breaks_ties_by_penalty_then_weight():
    assert choose([[(3, 0.0, 0), (1, 1.0, 0)], [(2, 0.0, 1), (1, 0.0, 0)]], 3) == [1, 1]
    assert choose([[(3, 0.0, 0), (1, 0.0, 0)]], 3) == [1]  # equal cost and penalty: the lighter
    assert choose([[(2, 0.0, 1), (2, 0.0, 0)], [(1, 0.0, 1), (1, 0.0, 0)]], 3) == [1, 1]  # equal weight: less penalty
    assert choose([[(4, 0.0, 0)]], 3) is None
    assert choose([[(0, 0.0, 0)]], -1) is None


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
    assert _error(fidelity) == pytest.approx((0.25 + 0.01) / 2)  # w and v: (0.5)^2 and (0.1)^2
    nan = GradientFidelity("x", (GradientComparison("w", math.nan, math.nan, 1.0, 1.0),), None, None, 0.0, 0.0)
    assert _error(nan) == math.inf


@pytest.fixture(scope="module")
def measured():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    before = [p.detach().clone() for p in model.parameters()] + [b.clone() for b in model.buffers()]
    costs = measure_block_costs(model, (x, y), FORMS + (edgetorch.BackRazor(0.9, exact="int8"),))
    after = [p.detach() for p in model.parameters()] + list(model.buffers())
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the model is as it was
    return model, (x, y), costs


def test_costs_rank_forms_as_their_exactness_says(measured):
    _, _, costs = measured
    assert len(costs.costs) == len(costs.blocks) * len(costs.forms) == 8 * 6
    for block in costs.blocks:
        by = {c.form: c for c in costs.options(block)}
        dense, bitmap, q8, q4, recompute, br = (by[f] for f in costs.forms)
        assert dense.fidelity == bitmap.fidelity == recompute.fidelity == 0.0  # bit-identical gradients
        assert 0 < q8.fidelity < q4.fidelity
        assert br.fidelity > 0
        assert q4.stored_bytes < q8.stored_bytes < dense.stored_bytes and bitmap.stored_bytes <= dense.stored_bytes
        assert recompute.stored_bytes < dense.stored_bytes and recompute.rerun_bytes == bitmap.stored_bytes
        assert dense.rerun_bytes == q8.rerun_bytes == 0


def test_a_plan_stores_no_more_than_it_predicts(measured):
    model, (x, y), costs = measured
    dense = costs.outside_bytes + sum(costs.cost(b, edgetorch.Dense()).stored_bytes for b in costs.blocks)
    least = costs.outside_bytes + sum(min(c.stored_bytes for c in costs.options(b)) for b in costs.blocks)
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
    assert not plan_blocks(costs, least - 1).fits
