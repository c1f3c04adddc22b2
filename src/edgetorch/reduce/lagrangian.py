"""The Lagrangian machinery both exact allocations share: the chain's (:mod:`.exact`) and the
channel graph's (:mod:`.graph_exact`).

Each solver has its own way to minimise ``L(theta) = J(theta) + lam (cost(theta) - B)`` for one
multiplier (a DP along the chain, bucket elimination on the graph); given that minimiser, the rest
is the same: :func:`dual` searches the multiplier and keeps the best feasible point met,
:func:`fill` raises a point while the budget allows, :func:`min_over_lines` is the lower-convex-hull
step of both minimisations, and :func:`out_of_time` counts the branch-and-bound's nodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .graph_problem import GraphProblem
from .problem import Problem
from .pso import project

# Either exact solver's problem: both have ``upper``, ``layers``, ``errors``, ``budget``, ``total``,
# ``cost`` and ``objective``.
AnyProblem = Problem | GraphProblem

# "Better" for the chain's enumeration: lower by more than this, relative (module docstring of .exact).
REL_TOL = 1e-9


@dataclass(frozen=True)
class ExactResult:
    """What the exact solver found.

    Attributes:
        theta: the integer choice.
        proven_gap: ``J(theta)`` minus a proven lower bound on the optimum (0.0 when proven).
        seconds: wall time of the solve.
        visited: partial choices the enumeration expanded.
    """

    theta: list[int]
    proven_gap: float
    seconds: float
    visited: int


class Lagrangian(Protocol):
    """What :func:`dual` needs of a solver: its problem, its per-variable curves ``J`` (one array
    each), and a minimiser of ``L`` at a multiplier."""

    problem: AnyProblem
    J: list[np.ndarray]

    def minimiser(self, lam: float) -> list[int]: ...


def last_argmin(values: np.ndarray) -> int:
    """The index of ``values``' minimum, the last one among equals.

    Why the last: at alpha = 0 an error-free plateau (zero-variance neurons, full rank) then keeps
    the network whole rather than dropping neurons for free.
    """
    return len(values) - 1 - int(np.argmin(values[::-1]))


def min_over_lines(intercepts: np.ndarray, slopes: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``min_i intercepts[i] + slopes[i] * t`` for every ``t`` in ``at`` (slopes increasing).

    The minimum over lines at ``t`` is attained on the lower convex hull of the points
    ``(slopes[i], intercepts[i])``, at the vertex whose edge slopes bracket ``-t``.
    """
    hull: list[int] = []
    for i in range(len(slopes)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (intercepts[b] - intercepts[a]) * (slopes[i] - slopes[a]) >= (
                intercepts[i] - intercepts[a]
            ) * (slopes[b] - slopes[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    h = np.asarray(hull)
    edge_slopes = np.diff(intercepts[h]) / np.diff(slopes[h])
    vertex = h[np.searchsorted(edge_slopes, -at, side="left")]
    return intercepts[vertex] + slopes[vertex] * at


def _raise_costs(problem: AnyProblem, theta: list[int]) -> list[int]:
    # The added multiplications of raising each coordinate by one (a channel-graph problem knows
    # them in closed form; evaluating its cost once per coordinate and step dominated the solve).
    if hasattr(problem, "raise_costs"):
        return problem.raise_costs(theta)
    base, extras = problem.cost(theta), []
    for l in range(problem.layers):
        theta[l] += 1
        extras.append(problem.cost(theta) - base)
        theta[l] -= 1
    return extras


def feasible_tops(problem: AnyProblem) -> list[int]:
    """Per variable, the largest value that fits the budget with every other variable at 1 (a
    binary search on ``problem.cost``, which must grow with every variable: pruning's does).
    ``problem`` is a chain :class:`Problem` or a grouped one (``upper``, ``layers``, ``cost``, ``budget``)."""
    tops = []
    for l, top in enumerate(problem.upper):
        lo, hi = 1, top
        while lo < hi:
            mid = (lo + hi + 1) // 2
            probe = [1] * problem.layers
            probe[l] = mid
            lo, hi = (mid, hi) if problem.cost(probe) <= problem.budget else (lo, mid - 1)
        tops.append(lo)
    return tops


def out_of_time(state: dict, deadline: float) -> bool:
    """Count a branch-and-bound node in ``state``; True once the search must stop (it stopped
    before, or ``deadline`` has passed: the incumbent is then returned without proof)."""
    if state["stopped"]:
        return True
    state["visited"] += 1
    if time.perf_counter() > deadline:
        state["stopped"] = True
    return state["stopped"]


def fill(problem: AnyProblem, theta: list[int]) -> list[int]:
    """``theta`` raised one coordinate at a time while the budget allows and J drops (the best drop
    per added multiplication first; the first such coordinate among equals).

    One numpy step per raise: on resnet50 a fill takes thousands of raises.
    """
    theta = np.array(theta, dtype=np.int64)
    upper = np.asarray(problem.upper, dtype=np.int64)
    errors = np.full((problem.layers, int(upper.max()) + 2), np.inf)
    for l, curve in enumerate(problem.errors):
        errors[l, : len(curve)] = curve
    rows = np.arange(problem.layers)
    cost = problem.cost(theta.tolist())
    while True:
        extra = np.asarray(_raise_costs(problem, theta.tolist()), dtype=np.int64)
        gain = errors[rows, theta] - errors[rows, theta + 1]
        rate = gain / np.maximum(extra, 1)
        allowed = (theta < upper) & (cost + extra <= problem.budget) & (gain > 0) & (rate > 0)
        if not allowed.any():
            return theta.tolist()
        best = int(np.flatnonzero(allowed)[np.argmax(rate[allowed])])
        theta[best] += 1
        cost += int(extra[best])


def dual(solver: Lagrangian, precision: float = 1e-12, slack: float = 0.0,
         guess: float | None = None) -> tuple[float, float, list[int]]:
    """Best multiplier, its dual bound ``g(lam)``, and the best feasible point met (filled).

    ``g(lam) = min L`` is concave and piecewise linear with supergradient ``cost(theta_lam) - B``.
    First a bracket: from ``guess`` (default: J's range per multiplication, which overshoots)
    steps of 4x find a multiplier whose minimiser is over budget (``lo``) and one within it
    (``hi``). Then the tangents at both ends meet at the next multiplier tried (Kelley's cutting
    plane in one dimension), and their meeting point bounds ``max g`` from above. The search stops
    when that bound is within ``slack`` of the best ``g`` met, or the bracket is ``precision``
    narrow (relative); a coarser multiplier only loosens the
    bound the enumeration prunes with, never its correctness. Where the cut moves the same end of
    the bracket twice in a row, the bracket's geometric midpoint is tried instead, so the bracket
    keeps shrinking on both sides. On resnet50 (a guess from the uniform allocation's marginal
    rates) this takes about 8 minimisations where bisection to 1e-4 took 35.
    """
    problem = solver.problem
    budget = problem.budget

    def evaluate(lam: float) -> tuple[float, float, int, list[int]]:
        theta = solver.minimiser(lam)
        over = problem.cost(theta) - budget
        return lam, problem.objective(theta) + lam * over, over, theta

    start = guess if guess is not None and guess > 0 else float(sum(j.max() - j.min() for j in solver.J)) / problem.total
    met = [evaluate(max(1e-300, start))]
    step = 0.25 if met[0][2] <= 0 else 4.0  # feasible: step down until over budget, else up until within it
    # Down at most 4^12 (lam = 0 is over budget; where every lam > 0 fits, e.g. a plateau of J = 0
    # that lam = 0 breaks towards the full network, the bracket starts at 0).
    while (met[-1][2] <= 0) == (step < 1) and (step > 1 or len(met) <= 12):
        met.append(evaluate(met[-1][0] * step))
    over = [p for p in met if p[2] > 0]
    hi = min((p for p in met if p[2] <= 0), key=lambda p: p[0])
    lo = max(over, key=lambda p: p[0]) if over else evaluate(0.0)
    best = max(met, key=lambda p: p[1])
    incumbent = min((fill(problem, p[3]) for p in met if p[2] <= 0), key=problem.objective)
    moved = []
    for _ in range(60):
        if hi[2] == 0:  # a zero supergradient: hi maximises g
            break
        cut = (hi[1] - lo[1] + lo[2] * lo[0] - hi[2] * hi[0]) / (lo[2] - hi[2])
        top = lo[1] + lo[2] * (cut - lo[0])
        if top - best[1] <= slack or hi[0] - lo[0] <= precision * hi[0]:
            break
        if not lo[0] < cut < hi[0] or moved[-2:] in (["lo", "lo"], ["hi", "hi"]):
            cut = (lo[0] + hi[0]) / 2 if lo[0] == 0 else float(np.sqrt(lo[0] * hi[0]))
        point = evaluate(cut)
        best = max(best, point, key=lambda p: p[1])
        if point[2] <= 0:
            hi = point
            filled = fill(problem, point[3])
            if problem.objective(filled) < problem.objective(incumbent):
                incumbent = filled
        else:
            lo = point
        moved.append("hi" if point[2] <= 0 else "lo")
    if lo[0] > 0:  # the last minimiser over budget, lowered until it fits, then filled: often the better incumbent
        repaired = fill(problem, project(problem, np.asarray(lo[3], dtype=np.float64)))
        incumbent = min(incumbent, repaired, key=problem.objective)
    return best[0], best[1], incumbent
