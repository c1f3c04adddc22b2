"""The exact allocation when the cost is additive over groups: a separable knapsack, solved by dynamic programming.

Transformer groups (:mod:`edgetorch.reduce.transformer`) do not interact: ``cost(k) = c + sum_g s_g k_g``
and ``J(k) = sum_g J_g(k_g)``. The channel-graph solver's Lagrangian branch and bound proves such a
problem only slowly (MiniLM-L6's 12 groups of 12 heads / 1536 units hit its 60 s limit with gaps of
1e-4 to 2e-3 of J, because near-equal choices form wide plateaus), while an exact dynamic program is
immediate:

1. Groups with the same unit cost ``s`` (every block's heads; every block's MLP) form a class. Within
   a class only the total ``n = sum k_g`` costs anything, so ``best_c(n) = min sum J_g(k_g)`` over
   ``sum k_g = n`` is a resource-allocation DP over ``n`` (``O(sizes x total)`` per group).
2. Classes are combined over their exact integer costs ``s_c n_c``, keeping only the Pareto front
   (lower cost, lower J); the answer is the front's least J within the budget.

Everything is exact: costs are Python integers, J values are summed in float64 as
:meth:`GraphProblem.objective` sums them.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .graph_problem import GraphProblem


def _class_table(curves: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    # best[n - G]: least J with n units in total over the class's G groups (each keeps 1..size);
    # choice[g][n - lo_g]: the units group g keeps in that optimum, for backtracking.
    best = np.zeros(1)  # zero groups, zero units
    choices = []
    for curve in curves:
        size = len(curve) - 1
        new = np.full(len(best) + size - 1, np.inf)
        pick = np.zeros(len(new), dtype=np.int64)
        for k in range(1, size + 1):
            candidate = best + curve[k]
            window = new[k - 1: k - 1 + len(best)]
            better = candidate < window
            window[better] = candidate[better]
            pick[k - 1: k - 1 + len(best)][better] = k
        best = new
        choices.append(pick)
    return best, choices


def _pareto(costs: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats in both cost and J, by increasing cost."""
    order = np.lexsort((values, costs))
    running = np.minimum.accumulate(values[order])
    keep = np.concatenate([[True], values[order][1:] < running[:-1]])
    return order[keep]


def solve_separable(problem: GraphProblem) -> list[int]:
    """The exact optimum of eq. 15 for a problem whose cost terms each read one group and write none.

    Args:
        problem: a :class:`GraphProblem` built from uncoupled terms (``scale x k_g`` per group, plus
            constants), e.g. :func:`edgetorch.reduce.transformer.cost_graph`.

    Returns:
        Kept units per group, feasible and of least ``J`` (ties: the cheaper).

    Raises:
        ValueError: a term couples groups (use the channel-graph solver).

    Example:
        >>> theta = solve_separable(problem)
        >>> problem.feasible(theta)
        True
    """
    poly = problem.polynomial
    if poly.pairs or np.any(poly.square):
        raise ValueError("the knapsack solver takes uncoupled groups only (no cost term reads two groups)")
    members: dict[int, list[int]] = defaultdict(list)
    for g, scale in enumerate(poly.linear.tolist()):
        members[scale].append(g)
    front_cost, front_value = np.array([poly.constant], dtype=np.int64), np.zeros(1)
    trail = []  # per class: its groups, their choice tables, and per front point (parent point, class units)
    for scale, groups in members.items():
        best, choices = _class_table([problem.errors[g] for g in groups])
        parents = np.repeat(np.arange(len(front_cost)), len(best))
        units = np.tile(np.arange(len(best)) + len(groups), len(front_cost))  # each group keeps >= 1 unit
        costs = front_cost[parents] + scale * units
        values = front_value[parents] + best[units - len(groups)]
        within = np.flatnonzero((costs <= problem.budget) & np.isfinite(values))
        kept = within[_pareto(costs[within], values[within])]
        front_cost, front_value = costs[kept], values[kept]
        trail.append((groups, choices, parents[kept], units[kept]))
    point = int(np.argmin(front_value))  # the front is within the budget and by increasing cost: ties go cheap
    theta = [0] * problem.layers
    for groups, choices, parents, units in reversed(trail):
        n = int(units[point])
        for j in range(len(groups) - 1, -1, -1):  # after j + 1 groups, table index = units - (j + 1)
            theta[groups[j]] = int(choices[j][n - (j + 1)])
            n -= theta[groups[j]]
        point = int(parents[point])
    return theta
