"""reduce.allocation: every allocation feasible; "optimal" equals brute force on random small instances."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetorch.reduce import solve_allocation
from edgetorch.reduce.problem import full_cost, lowrank_cost, make_problem, prune_cost


def brute_force(errors, widths, alpha, method, **layout):
    problem = make_problem(errors, widths, alpha, method, **layout)
    best = min(
        (problem.objective(t), t)
        for t in itertools.product(*(range(1, u + 1) for u in problem.upper))
        if problem.feasible(t)
    )
    return best[0], problem


@st.composite
def instances(draw, method):
    layers = draw(st.integers(1, 3))
    widths = draw(st.lists(st.integers(1, 6), min_size=layers + 1, max_size=layers + 1))
    uppers = widths[:-1] if method == "prune" else [min(a, b) for a, b in zip(widths[:-1], widths[1:])]
    # Arbitrary non-negative curves (not convex, not monotone): the solver may assume nothing.
    value = st.floats(0, 10, allow_nan=False) | st.sampled_from([0.0, 1.0])
    errors = [[0.0] + draw(st.lists(value, min_size=u, max_size=u)) for u in uppers]
    cheapest = (prune_cost if method == "prune" else lowrank_cost)(widths, [1] * layers)
    top = 1 - cheapest / full_cost(widths)
    alpha = draw(st.floats(0, max(0.0, top), allow_nan=False))
    return errors, widths, min(alpha, 0.999)


@st.composite
def layered_instances(draw, method):
    """Convolution-style instances: per-layer cost scales, and (low-rank) shapes that need not chain."""
    layers = draw(st.integers(1, 3))
    scales = draw(st.lists(st.integers(1, 9), min_size=layers, max_size=layers))
    value = st.floats(0, 10, allow_nan=False) | st.sampled_from([0.0, 1.0])
    if method == "prune":
        widths = draw(st.lists(st.integers(1, 5), min_size=layers + 1, max_size=layers + 1))
        layout = {"scales": scales}
        uppers, args = widths[:-1], widths
    else:
        shapes = draw(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 5)), min_size=layers, max_size=layers))
        layout = {"scales": scales, "shapes": shapes}
        uppers, args = [min(a, b) for a, b in shapes], None
    errors = [[0.0] + draw(st.lists(value, min_size=u, max_size=u)) for u in uppers]
    alpha = draw(st.floats(0, 0.999, allow_nan=False))
    try:
        make_problem(errors, args, alpha, method, **layout)
    except ValueError:  # infeasible alpha: the smallest feasible one is 0
        alpha = 0.0
    return errors, args, alpha, layout


@pytest.mark.parametrize("method", ["prune", "lowrank"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_exact_matches_brute_force_and_heuristics_are_feasible(method, data):
    errors, widths, alpha = data.draw(instances(method))
    best, problem = brute_force(errors, widths, alpha, method)
    exact = solve_allocation(errors, widths, alpha, method, "optimal")
    assert exact.proven_gap == 0.0
    assert problem.feasible(exact.theta)
    assert exact.objective <= best + 1e-9 * max(1.0, best)
    assert exact.alpha >= alpha - 1e-12
    for allocation in ("uniform", "pso"):
        other = solve_allocation(errors, widths, alpha, method, allocation)
        assert problem.feasible(other.theta)
        assert exact.objective <= other.objective + 1e-9 * max(1.0, other.objective)


@pytest.mark.parametrize("method", ["prune", "lowrank"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_exact_matches_brute_force_with_scales_and_shapes(method, data):
    errors, widths, alpha, layout = data.draw(layered_instances(method))
    best, problem = brute_force(errors, widths, alpha, method, **layout)
    exact = solve_allocation(errors, widths, alpha, method, "optimal", **layout)
    assert exact.proven_gap == 0.0 and problem.feasible(exact.theta)
    assert exact.objective <= best + 1e-9 * max(1.0, best)
    assert exact.total == problem.total == sum(s * a * b for s, (a, b) in zip(problem.scales, problem.shapes))
    for allocation in ("uniform", "pso"):
        other = solve_allocation(errors, widths, alpha, method, allocation, **layout)
        assert problem.feasible(other.theta)
        assert exact.objective <= other.objective + 1e-9 * max(1.0, other.objective)


def test_scaled_costs_follow_the_formulas():
    # Pruning: s_l M~_{l-1} M~_l summed along the chain; low-rank: s_l (m_in + m_out) k or dense.
    prune = make_problem([[0, 1, 0, 0], [0, 1, 0]], [3, 2, 4], 0.0, "prune", scales=[5, 7])
    assert prune.total == 5 * 3 * 2 + 7 * 2 * 4 and prune.cost([2, 1]) == 5 * 2 * 1 + 7 * 1 * 4
    lowrank = make_problem([[0, 1, 0, 0], [0, 1, 0]], None, 0.0, "lowrank", shapes=[(27, 3), (3, 2)], scales=[16, 1])
    assert lowrank.cost([1, 2]) == 16 * (27 + 3) * 1 + 3 * 2
    with pytest.raises(ValueError, match="exactly one of widths"):
        make_problem([[0, 1]], [1, 1], 0.0, "lowrank", shapes=[(1, 1)])
    with pytest.raises(ValueError, match="shapes are for low-rank"):
        make_problem([[0, 1]], None, 0.0, "prune", shapes=[(1, 1)])
    with pytest.raises(ValueError, match="scales must be"):
        make_problem([[0, 1, 0, 0], [0, 1, 0]], [3, 2, 4], 0.0, "prune", scales=[5, 0])


def eq14_curve(powers):
    # J(m) = sum of the powers dropped / sum of the powers kept, powers sorted decreasing (eq. 14).
    s = np.sort(np.asarray(powers, dtype=float))[::-1]
    kept = np.cumsum(s)
    return [np.inf] + list((kept[-1] - kept) / kept)


def test_paper_fig1_toy_problem_by_enumeration():
    # Fig. 1: L = 2, M_0 = 10, M_1 = M_2 = 5, alpha_tot = 0.5 (pruning); J from eq. 14.
    rng = np.random.default_rng(1)
    errors = [eq14_curve(rng.gamma(1.0, size=10)), eq14_curve(rng.gamma(1.0, size=5))]
    widths = [10, 5, 5]
    best, problem = brute_force(errors, widths, 0.5, "prune")
    theta = solve_allocation(errors, widths, 0.5, "prune", "optimal").theta
    assert problem.feasible(theta) and problem.objective(theta) == pytest.approx(best, rel=1e-12)
    assert problem.cost(theta) <= 37  # 75 multiplications in full, at most half kept
    pso = solve_allocation(errors, widths, 0.5, "prune", "pso")
    assert pso.objective >= problem.objective(theta)


def test_alpha_zero_keeps_everything():
    widths = [6, 5, 4, 3]
    prune = [[0] + [1.0 / v for v in range(1, w + 1)] for w in widths[:-1]]
    assert solve_allocation(prune, widths, 0.0, "prune").theta == [6, 5, 4]
    ranks = [[0] + [1.0 / v for v in range(1, min(a, b) + 1)] for a, b in zip(widths[:-1], widths[1:])]
    assert solve_allocation(ranks, widths, 0.0, "lowrank").theta == [5, 4, 3]
    assert solve_allocation(prune, widths, 0.0, "prune", "uniform").theta == [6, 5, 4]


def test_pso_is_seeded():
    widths = [30, 20, 10, 5]
    rng = np.random.default_rng(0)
    errors = [eq14_curve(rng.gamma(1.0, size=w)) for w in widths[:-1]]
    runs = [solve_allocation(errors, widths, 0.6, "prune", "pso", seed=s).theta for s in (3, 3)]
    assert runs[0] == runs[1]


def test_paper_network_exact_is_fast_and_proven():
    widths = [784, 2500, 2000, 1500, 1000, 500, 10]
    rng = np.random.default_rng(0)
    prune = [eq14_curve(rng.gamma(0.5, size=w)) for w in widths[:-1]]
    # Fast in CPU time, which a busy machine does not inflate as it does wall time (result.seconds);
    # the time limit is far past it, so the proof does not depend on the machine's speed either.
    cpu = time.process_time()
    result = solve_allocation(prune, widths, 0.7, "prune", "optimal", time_limit=600)
    cpu = time.process_time() - cpu
    assert result.proven_gap == 0.0 and result.alpha >= 0.7 and cpu < 20
    pso = solve_allocation(prune, widths, 0.7, "prune", "pso")
    assert result.objective <= pso.objective


def test_uniform_lowrank_keeps_the_last_layer_dense_as_the_paper_does():
    # Sec. 4: alpha_L = 0 and one share for the other layers, sized so the total meets the budget.
    widths, alpha = [64, 40, 30, 20, 10], 0.6
    flat = [[0] + [1.0 / v for v in range(1, min(a, b) + 1)] for a, b in zip(widths[:-1], widths[1:])]
    uniform = solve_allocation(flat, widths, alpha, "lowrank", "uniform")
    problem = make_problem(flat, widths, alpha, "lowrank")
    assert uniform.theta[-1] == 10 and problem.feasible(uniform.theta)
    pairs = list(zip(widths[:-1], widths[1:]))
    share = (problem.budget - 20 * 10) / sum(a * b for a, b in pairs[:-1])  # 1 - alpha'
    for (a, b), k in zip(pairs[:-1], uniform.theta):
        assert (a + b) * k <= share * a * b < (a + b) * (k + 1)  # the largest rank within the share
    # The optimal allocation stays free: where the last layer's curve is flat it is factored.
    cheap_last = flat[:-1] + [[0.0] * 11]
    assert solve_allocation(cheap_last, widths, alpha, "lowrank", "optimal").theta[-1] < 10
    # A last layer too big to stay dense within the budget: every layer gets 1 - alpha of its own.
    squeezed = solve_allocation([[0, 1, 0], [0, 1, 0]], [2, 2, 50], 0.4, "lowrank", "uniform")
    assert squeezed.theta[-1] < 2 and squeezed.cost <= 0.6 * (4 + 100)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"method": "svd"}, "unknown method"),
        ({"allocation": "greedy"}, "unknown allocation"),
        ({"alpha": 1.0}, "alpha must be"),
        ({"alpha": -0.1}, "alpha must be"),
        ({"alpha": 0.99}, "infeasible"),
        ({"widths": [4, 0, 2]}, "widths must be"),
        ({"errors": [[0, 1, 2, 3, 4]]}, "expected 2 error curves"),
        ({"errors": [[0, 1, 2], [0, 1, 2]]}, "must hold J_1"),
        ({"errors": [[0, 1, np.nan, 0, 0], [0, 1, 0]]}, "finite and >= 0"),
        ({"errors": [[0, 1, -1, 0, 0], [0, 1, 0]]}, "finite and >= 0"),
    ],
)
def test_bad_input_is_rejected_clearly(kwargs, fragment):
    args = {"errors": [[0, 3, 2, 1, 0], [0, 1, 0]], "widths": [4, 2, 2], "alpha": 0.2,
            "method": "prune", "allocation": "optimal", **kwargs}
    with pytest.raises(ValueError, match=fragment):
        solve_allocation(args["errors"], args["widths"], args["alpha"], args["method"], args["allocation"]).theta
