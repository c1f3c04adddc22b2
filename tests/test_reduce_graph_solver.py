"""Property tests of the grouped exact allocation's parts: min over lines, the dual, the fill, and
the solver itself against brute force and against the PSO and uniform baselines."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetorch.reduce.allocation import solve_graph_allocation
from edgetorch.reduce.graph import ChannelGraph, ChannelGroup, CostTerm
from edgetorch.reduce.graph_exact import TOLERANCE, _Graph, _min_over_line_sets, elimination_plan
from edgetorch.reduce.graph_problem import GraphProblem, make_graph_problem
from edgetorch.reduce.lagrangian import dual, feasible_tops, fill, min_over_lines

floats = st.floats(-100, 100, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), st.integers(1, 40), st.integers(0, 2**32 - 1), st.booleans())
def test_min_over_line_sets_is_the_dense_minimum(n, m, q, seed, rounded):
    rng = np.random.default_rng(seed)
    intercepts = rng.normal(size=(n, m)) * rng.choice([1e-3, 1.0, 1e3]) + np.cumsum(rng.random((n, m)), axis=0)
    at = rng.normal(size=q) * rng.choice([1e-3, 1.0, 10.0])
    if rounded:  # ties between lines and repeated queries
        intercepts, at = np.round(intercepts), np.round(at)
    slopes = np.arange(1, n + 1, dtype=np.float64)
    dense = (intercepts[:, :, None] + slopes[:, None, None] * at[None, None, :]).min(axis=0)
    np.testing.assert_allclose(_min_over_line_sets(intercepts, slopes, at), dense, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(min_over_lines(intercepts[:, 0], slopes, at), dense[0], rtol=1e-12, atol=1e-9)


@st.composite
def graph_problems(draw) -> GraphProblem:
    """Random channel graphs: cycles, concatenations, depthwise and same-group terms, flat or zero curves."""
    count = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 4)) for _ in range(count)]
    groups = tuple(ChannelGroup(g, s, f"g{g}", (), ()) for g, s in enumerate(sizes))
    terms = []
    for t in range(draw(st.integers(1, 6))):
        out = draw(st.one_of(st.none(), st.integers(0, count - 1)))
        depthwise = out is not None and draw(st.booleans()) and draw(st.booleans())
        reads = () if depthwise else tuple(draw(st.sets(st.integers(0, count - 1), max_size=min(count, 3))))
        terms.append(CostTerm(f"l{t}", draw(st.integers(1, 4)), tuple(sorted(reads)), draw(st.integers(0, 2)), out,
                              draw(st.integers(1, 3)), depthwise, 1, 1))
    graph = ChannelGraph(groups, tuple(terms), "l0")
    scale = draw(st.sampled_from([0.0, 1.0, 5.0]))
    curves = [np.concatenate([[0.0], [draw(st.floats(0, 1)) * scale for _ in range(s)]]) for s in sizes]
    alpha = draw(st.floats(0, 0.9))
    try:
        return make_graph_problem(graph, curves, alpha)
    except ValueError:  # alpha beyond what one channel per group reaches
        return draw(st.nothing())


def _brute_force(problem: GraphProblem) -> float:
    return min(problem.objective(t) for t in itertools.product(*(range(1, u + 1) for u in problem.upper))
               if problem.feasible(t))


@settings(max_examples=15, deadline=None)  # each example runs the PSO twice; test_reduce_grouped has 150 more
@given(graph_problems())
def test_exact_matches_brute_force_and_beats_the_baselines(problem):
    best = _brute_force(problem)
    exact = solve_graph_allocation(problem, "prune", "optimal")
    assert problem.feasible(exact.theta)
    assert exact.proven_gap <= TOLERANCE * max(1.0, exact.objective)
    assert exact.objective <= best + TOLERANCE * max(1.0, best)
    for other in ("pso", "uniform"):
        worse = solve_graph_allocation(problem, "prune", other)
        assert exact.objective <= worse.objective + 1e-12


@settings(max_examples=60, deadline=None)
@given(graph_problems(), st.one_of(st.none(), st.floats(1e-6, 1e3)))
def test_the_dual_bounds_the_optimum_from_below_and_its_incumbent_fits(problem, guess):
    tops = feasible_tops(problem)
    graph = _Graph(problem, elimination_plan(problem, tops), tops)
    if problem.cost(graph.minimiser(0.0)) <= problem.budget:
        return  # the solver never asks for a multiplier then
    _, bound, incumbent = dual(graph, precision=1e-4, guess=guess)
    best = _brute_force(problem)
    assert bound <= best + 1e-9 * max(1.0, best)
    assert problem.feasible(incumbent) and problem.objective(incumbent) >= best - 1e-12


@settings(max_examples=60, deadline=None)
@given(graph_problems(), st.data())
def test_fill_raises_until_no_single_raise_fits_and_helps(problem, data):
    start = [data.draw(st.integers(1, u)) for u in problem.upper]
    if not problem.feasible(start):
        return
    filled = fill(problem, start)
    assert problem.feasible(filled) and all(f >= s for f, s in zip(filled, start))
    for g in range(problem.layers):
        raised = list(filled)
        raised[g] += 1
        if raised[g] <= problem.upper[g] and problem.cost(raised) <= problem.budget:
            assert problem.errors[g][raised[g]] >= problem.errors[g][filled[g]]


@pytest.mark.parametrize("seed", range(3))
def test_a_wide_ring_of_groups_matches_vectorised_brute_force(seed):
    # A residual-like cycle with 20-32 channels per group: its buckets minimise over many sets of
    # lines at once (_min_over_line_sets), with the optimum away from the ends. All ~10^6 choices
    # are enumerated with numpy.
    rng = np.random.default_rng(seed)
    sizes = [int(s) for s in rng.integers(20, 33, size=4)]
    groups = tuple(ChannelGroup(g, s, f"g{g}", (), ()) for g, s in enumerate(sizes))
    terms = (CostTerm("in", 9, (), 3, 0, 1, False, 3, 1),
             *(CostTerm(f"c{g}", int(rng.integers(1, 9)), (g,), 0, (g + 1) % 4, 1, False, sizes[g], 1)
               for g in range(4)),
             CostTerm("skip", 2, (0,), 0, 2, 1, False, sizes[0], 1),
             CostTerm("fc", 1, (3,), 0, None, 10, False, sizes[3], 1))
    curves = [np.concatenate([[0.0], np.sort(rng.random(s))[::-1] * np.linspace(1, 0, s) ** 2]) for s in sizes]
    problem = make_graph_problem(ChannelGraph(groups, terms, "fc"), curves, float(rng.uniform(0.3, 0.8)))
    k = np.meshgrid(*(np.arange(1, s + 1) for s in sizes), indexing="ij")
    poly = problem.polynomial
    cost = poly.constant + sum(poly.linear[g] * k[g] + poly.square[g] * k[g] ** 2 for g in range(4))
    cost = cost + sum(w * k[a] * k[b] for (a, b), w in poly.pairs.items())
    J = sum(curves[g][k[g]] for g in range(4))
    best = float(J[cost <= problem.budget].min())
    exact = solve_graph_allocation(problem, "prune", "optimal")
    assert exact.proven_gap <= TOLERANCE * max(1.0, exact.objective)
    assert best - 1e-12 <= exact.objective <= best + TOLERANCE * max(1.0, best)
    assert exact.objective <= solve_graph_allocation(problem, "prune", "pso").objective + 1e-12
