"""The true optimum of the integer program (eq. 15): Lagrangian bound + exhaustive enumeration.

For a multiplier ``lam >= 0`` the Lagrangian ``L(theta) = J(theta) + lam (cost(theta) - B)`` is a
lower bound of ``J`` on every feasible point. Both cost models are chains: low-rank costs are
per-layer (a multiple-choice knapsack), pruning adds one product ``M~_{l-1} M~_l`` per pair of
neighbours (eq. 7). So ``min L`` is a dynamic programme along the layers; the product term makes
each step a minimum over lines ``F(u) + lam u v``, which the lower convex hull of ``F`` answers
for all ``v`` at once in ``O(n log n)``.

1. Maximise the concave dual ``g(lam) = min L`` by bisection on its subgradient
   ``cost(theta_lam) - B``; the feasible minimisers met on the way, greedily filled up to the
   budget, give an incumbent.
2. Enumerate, depth first from the last layer, every partial choice whose best completion (the
   DP tables) keeps ``L`` below the incumbent's ``J``. Any feasible point better than the
   incumbent has ``L <= J <`` incumbent, so none is skipped: the final incumbent is optimal.
   A greedy or purely Lagrangian answer is optimal only at breakpoints of the trade-off curve;
   this step is what closes the gap in between.

"Better" means lower by more than 1e-9 relative (plateaus of exactly equal J, e.g. zero-variance
input pixels, would otherwise be enumerated in full). If the time limit stops step 2, the
incumbent is returned with the proven gap ``J - g(lam*)``.
"""

from __future__ import annotations

import time

import numpy as np

from .lagrangian import REL_TOL, ExactResult, dual, feasible_tops, last_argmin, min_over_lines, out_of_time
from .problem import Problem, layer_lowrank_cost


class _Chain:
    """Per-layer tables of one problem: values 1..top_l, their J and linear cost coefficients."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.coupled = problem.cost_model == "prune"
        self.values = [np.arange(1, t + 1, dtype=np.float64) for t in self._tops()]
        self.J = [problem.errors[l][1 : len(v) + 1] for l, v in enumerate(self.values)]
        self.scales = [float(s) for s in problem.scales]
        if self.coupled:  # pairwise products are handled by the DP; only s_L M~_{L-1} M_L is unary
            self.unary_cost = [np.zeros(len(v)) for v in self.values]
            self.unary_cost[-1] = self.values[-1] * problem.widths[-1] * self.scales[-1]
        else:
            self.unary_cost = [np.array([s * layer_lowrank_cost(a, b, int(k)) for k in v], dtype=np.float64)
                               for (a, b), s, v in zip(problem.shapes, self.scales, self.values)]

    def _tops(self) -> list[int]:
        # Pruning cost grows with every width, so values above what fits with every other layer
        # at 1 can never be feasible: drop them. Low-rank cost is not monotone (a factored layer
        # just below full rank costs more than the dense one), so it keeps every value.
        return feasible_tops(self.problem) if self.coupled else list(self.problem.upper)

    def tables(self, lam: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Unary terms ``U_l`` and prefix DP ``F_l(v) = U_l(v) + min_u F_{l-1}(u) + lam s_{l-1} u v``."""
        unary = [j + lam * c for j, c in zip(self.J, self.unary_cost)]
        prefix = [unary[0]]
        for l in range(1, len(unary)):
            if self.coupled:
                best = min_over_lines(prefix[-1], self.values[l - 1], lam * self.scales[l - 1] * self.values[l])
            else:
                best = np.full(len(unary[l]), prefix[-1].min())
            prefix.append(unary[l] + best)
        return unary, prefix

    def minimiser(self, lam: float) -> list[int]:
        """A minimiser of the Lagrangian (backtracking the DP)."""
        unary, prefix = self.tables(lam)
        theta = [last_argmin(prefix[-1]) + 1]
        for l in range(len(prefix) - 2, -1, -1):
            pair = lam * self.scales[l] * self.values[l] * theta[0] if self.coupled else 0.0
            theta.insert(0, last_argmin(prefix[l] + pair) + 1)
        return theta


def solve_exact(problem: Problem, time_limit: float = 60.0) -> ExactResult:
    """Solve eq. 15 to proven optimality (or to the time limit, reporting the gap).

    Args:
        problem: the validated problem.
        time_limit: seconds the enumeration may run before returning its incumbent.

    Returns:
        The choice, its proven optimality gap, the wall time and the enumeration size.
    """
    start = time.perf_counter()
    chain = _Chain(problem)
    unconstrained = chain.minimiser(0.0)  # the minimum of J alone: optimal if it fits
    if problem.cost(unconstrained) <= problem.budget:
        return ExactResult(unconstrained, 0.0, time.perf_counter() - start, 0)
    lam, lower_bound, incumbent = dual(chain)
    unary, prefix = chain.tables(lam)
    state = {"best": incumbent, "ub": problem.objective(incumbent), "visited": 0, "stopped": False}
    deadline = start + time_limit
    offset = -lam * problem.budget

    def improves(bound: np.ndarray | float) -> np.ndarray | bool:
        return bound < state["ub"] - REL_TOL * max(1.0, abs(state["ub"]))

    def descend(layer: int, suffix: float, tail: list[int]) -> None:
        if out_of_time(state, deadline):
            return
        pair = lam * chain.scales[layer] * chain.values[layer] * tail[0] if (chain.coupled and tail) else 0.0
        bounds = prefix[layer] + pair + suffix
        candidates = np.flatnonzero(improves(bounds))
        for i in candidates[np.argsort(bounds[candidates], kind="stable")]:
            if not improves(bounds[i]):
                break  # sorted: nothing after this can improve either
            theta = [int(i) + 1] + tail
            if layer == 0:
                if problem.cost(theta) <= problem.budget and improves(problem.objective(theta)):
                    state["best"], state["ub"] = theta, problem.objective(theta)
                continue
            here = unary[layer][i] + (pair[i] if isinstance(pair, np.ndarray) else 0.0)
            descend(layer - 1, suffix + here, theta)

    descend(problem.layers - 1, offset, [])
    gap = max(0.0, state["ub"] - lower_bound) if state["stopped"] else 0.0
    return ExactResult(state["best"], gap, time.perf_counter() - start, state["visited"])
