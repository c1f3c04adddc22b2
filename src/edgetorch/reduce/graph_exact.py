"""The exact allocation on a channel graph: Lagrangian bucket elimination + branch and bound.

This generalises :mod:`edgetorch.reduce.exact` from a chain to any interaction graph of groups
(two groups interact when one layer reads one and writes the other). For a multiplier ``lam``,
``L(k) = J(k) + lam (cost(k) - B)`` is a lower bound of J on the feasible set, and ``min L`` is a
min-sum problem over the graph: eliminate the groups one at a time (bucket elimination, in a
greedy order that keeps the message tables small). A group whose bucket holds only its own curve
and bilinear cost terms is eliminated by the lower convex hull (the chain solver's trick), so a
ResNet's inner groups cost ``O(n^2 log n)``, not ``O(n^3)``.

1. Maximise the dual over ``lam`` (lagrangian.py's ``dual``: a bracket from the uniform/PSO seed's
   marginal rate, then one-dimensional cutting planes, about 8 eliminations on resnet50); feasible
   minimisers greedily filled, the last one over budget lowered and filled, and the uniform and
   PSO allocations give the incumbent.
2. Branch and bound in reverse elimination order: with the messages, the bound of a partial choice
   is the exact ``min L`` over its completions, so every feasible point with a lower J than the
   incumbent (by more than the tolerance) is visited; the final incumbent is optimal.

What "exact" means here: never worse than the uniform and PSO allocations (same seed; they seed
the incumbent), and proven optimal for the integer program (eq. 15 on groups) up to
:data:`TOLERANCE` x max(1, J) (reported as ``proven_gap``) whenever (a) the elimination order
keeps every table within :data:`TABLE_LIMIT` entries (ResNets, MobileNets, EfficientNets, VGG, SqueezeNet: tree width
2-3) and (b) the search ends within the time limit; otherwise the best point found is returned
with its proven gap, or with ``proven_gap = None`` when no bound could be computed (a DenseNet,
where every layer reads every earlier one's channels).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .lagrangian import REL_TOL, ExactResult, dual, feasible_tops, fill, last_argmin, min_over_lines, out_of_time
from .graph_problem import GraphProblem
from .pso import PSOConfig, solve_pso
from .uniform import uniform_prune

TABLE_LIMIT = 4_000_000  # entries of one elimination table (32 MB of float64)
HULL_COST = 1_000  # one hull built in Python counts as this many table entries
# J is a sum of normalised error ratios (0.01 to 10 in practice): proving the last 1e-6 of it took
# 355,000 search nodes (22 s) on squeezenet1_0 at alpha 0.3, against 1 node at 1e-4. The chain
# solver's 1e-9 would make such plateaus of near-equal choices the whole cost of a reduction.
TOLERANCE = 1e-6


@dataclass(frozen=True)
class _Step:
    """Eliminating one group: its bilinear terms with later groups, incoming messages, its message's scope."""

    var: int
    bilinear: tuple[tuple[int, float], ...]  # (neighbour, w)
    incoming: tuple[int, ...]  # steps whose message lands here
    scope: tuple[int, ...]  # the message's variables (eliminated later)


class _Graph:
    """Bucket elimination of the Lagrangian on a :class:`GraphProblem`."""

    def __init__(self, problem: GraphProblem, plan: list[_Step], tops: list[int]) -> None:
        poly = problem.polynomial
        self.problem, self.plan, self.constant = problem, plan, poly.constant
        self.values = [np.arange(1, t + 1, dtype=np.float64) for t in tops]
        self.J = [problem.errors[g][1 : t + 1] for g, t in enumerate(tops)]
        self.unary_cost = [poly.linear[g] * v + poly.square[g] * v * v for g, v in enumerate(self.values)]
        self.position = {step.var: i for i, step in enumerate(plan)}
        self.lam, self.messages = None, []

    def _axes(self, scope: tuple[int, ...], target: tuple[int, ...]) -> list[int]:
        return [target.index(v) for v in scope]

    def _expand(self, table: np.ndarray, scope: tuple[int, ...], target: tuple[int, ...]) -> np.ndarray:
        # Reorder a table's axes into target order, with length-1 axes for the variables it lacks.
        axes = self._axes(scope, target)
        permuted = np.transpose(table, np.argsort(axes)) if table.ndim > 1 else table
        shape = [1] * len(target)
        for a in sorted(axes):
            shape[a] = len(self.values[target[a]])
        return permuted.reshape(shape)

    def tables(self, lam: float) -> None:
        """Every step's message at ``lam`` (kept for backtracking and the bounds).

        A bucket is ``g(x, A) + x t(B)``: ``A`` are the variables its incoming messages (and their
        bilinear terms with x) depend on, ``B`` the rest of the scope, reached only through
        bilinear cost terms, so ``t(B) = lam sum_n w_n k_n``. For each value of ``A`` the minimum
        over x is a minimum over lines (slopes x, intercepts g), answered for every ``t`` by one
        lower convex hull: a ResNet-50 downsampling block's inner group with 1,024 and 2,048-wide
        streams around it costs 1,024 hulls, not a 512 x 1,024 x 2,048 table.
        """
        if self.lam == lam:
            return
        messages = []
        for step in self.plan:
            x = step.var
            inner, outer = _split(step, self.plan)
            target = (x, *inner)
            g = self._expand(self.J[x] + lam * self.unary_cost[x], (x,), target)
            slope_at = np.zeros([len(self.values[n]) for n in outer])
            for n, w in step.bilinear:
                if n in inner:
                    g = g + lam * w * self._expand(self.values[x], (x,), target) * self._expand(
                        self.values[n], (n,), target)
                else:
                    grid = self.values[n].reshape([-1 if v == n else 1 for v in outer])
                    slope_at = slope_at + lam * w * grid
            for i in step.incoming:
                g = g + self._expand(messages[i], self.plan[i].scope, target)
            rows = g.reshape(len(self.values[x]), -1)
            if not outer:
                table = rows.min(axis=0)
            else:
                table = (min_over_lines(rows[:, 0], self.values[x], slope_at.ravel())[None] if rows.shape[1] == 1
                         else _min_over_line_sets(rows, self.values[x], slope_at.ravel()))
            shape = [len(self.values[v]) for v in (*inner, *outer)]
            order = [(*inner, *outer).index(v) for v in step.scope]
            messages.append(np.transpose(table.reshape(shape), order) if shape else table.reshape(()))
        self.lam, self.messages = lam, messages

    def bucket(self, x: int, assign: dict[int, int]) -> np.ndarray:
        """The bucket of group ``x`` as a function of its value, given the later groups' values."""
        step = self.plan[self.position[x]]
        f = self.J[x] + self.lam * self.unary_cost[x]
        for n, w in step.bilinear:
            f = f + self.lam * w * self.values[x] * self.values[n][assign[n]]
        for i in step.incoming:
            scope = self.plan[i].scope
            index = tuple(slice(None) if v == x else assign[v] for v in scope)
            f = f + self.messages[i][index]
        return f

    def message(self, x: int, assign: dict[int, int]) -> float:
        i = self.position[x]
        return float(self.messages[i][tuple(assign[v] for v in self.plan[i].scope)])

    def minimiser(self, lam: float) -> list[int]:
        """A minimiser of the Lagrangian (backtracking in reverse elimination order)."""
        self.tables(lam)
        assign: dict[int, int] = {}
        for step in reversed(self.plan):
            assign[step.var] = last_argmin(self.bucket(step.var, assign))
        return [assign[g] + 1 for g in range(len(self.values))]


def _min_over_line_sets(intercepts: np.ndarray, slopes: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``lagrangian.min_over_lines`` for ``m`` sets of lines sharing their slopes: ``[n, m]`` -> ``[m, len(at)]``.

    Why a second implementation: the chain solver's hull is a Python loop over one set's points,
    and called once per set it was 90% of resnet50's solve (1,000 sets per multiplier). Here the
    lower convex hulls of all sets are built together, one numpy step per point (monotone chain,
    vectorised over the sets), and the queries are answered by counting, per set, the hull edges
    steeper than ``-t`` (a cumulative count over the sorted queries instead of a search per set).
    """
    n, m = intercepts.shape
    sets = np.arange(m)
    stack = np.zeros((n, m), dtype=np.int64)  # hull vertices per set, bottom first
    size = np.zeros(m, dtype=np.int64)
    last_x, last_y, prev_x, prev_y = (np.zeros(m) for _ in range(4))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # unused stack slots give garbage, masked
        for i in range(n):
            x, y = slopes[i], intercepts[i]
            # Pop while the last vertex lies on or above the segment from the one before it to point i.
            pop = (size >= 2) & ((last_y - prev_y) * (x - prev_x) >= (y - prev_y) * (last_x - prev_x))
            while pop.any():
                c = np.flatnonzero(pop)
                size[c] -= 1
                last_x[c], last_y[c] = prev_x[c], prev_y[c]
                below = stack[np.maximum(size[c] - 2, 0), c]
                prev_x[c], prev_y[c] = slopes[below], intercepts[below, c]
                pop[c] = (size[c] >= 2) & (
                    (last_y[c] - prev_y[c]) * (x - prev_x[c]) >= (y[c] - prev_y[c]) * (last_x[c] - prev_x[c]))
            stack[size, sets] = i
            prev_x, prev_y, last_x, last_y = last_x, last_y, np.full(m, x), y.copy()
            size += 1
        lower, upper = stack[:-1], stack[1:]
        edge = np.arange(n - 1)[:, None] < (size - 1)
        edges = (intercepts[upper, sets] - intercepts[lower, sets]) / (slopes[upper] - slopes[lower])
    # Vertex of query t in set c = number of c's edges with slope < -t (edge slopes increase).
    at = np.asarray(at, dtype=np.float64).ravel()
    ascending = bool(np.all(at[1:] >= at[:-1]))  # one outer variable: no sort needed
    order = np.arange(len(at))[::-1] if ascending else np.argsort(-at, kind="stable")
    queries = -at[order]
    first = np.searchsorted(queries, edges[edge], side="right")  # the first sorted query above the edge
    counts = np.bincount(np.broadcast_to(sets, edge.shape)[edge] * (len(at) + 1) + first, minlength=m * (len(at) + 1))
    vertex = np.take_along_axis(stack.T.copy(), np.cumsum(counts.reshape(m, -1), axis=1)[:, :-1], axis=1)
    ordered = np.take_along_axis(intercepts.T.copy(), vertex, axis=1) - slopes[vertex] * queries
    if ascending:
        return ordered[:, ::-1]
    out = np.empty((m, len(at)))
    out[:, order] = ordered
    return out


def _split(step: _Step, plan: list[_Step]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A step's scope split into the variables of its incoming messages and the rest (see ``tables``)."""
    through = {v for i in step.incoming for v in plan[i].scope} - {step.var}
    return tuple(v for v in step.scope if v in through), tuple(v for v in step.scope if v not in through)


def _marginal_rate(problem: GraphProblem, theta: list[int]) -> float:
    """The median over groups of ``J_g``'s drop per added multiplication at ``theta`` (where it drops):
    at the optimum every group not at a bound trades at the multiplier, so near a good allocation
    this lands within a few 4x steps of it (the generic start, J's range per multiplication, was
    five orders of magnitude high on resnet50)."""
    k = np.asarray(theta)
    raise_by = np.asarray(problem.raise_costs(theta), dtype=np.float64)
    drops = np.array([e[v] - e[v + 1] if v < len(e) - 1 else 0.0 for e, v in zip(problem.errors, k)])
    rates = drops[drops > 0] / np.maximum(raise_by[drops > 0], 1.0)
    return float(np.median(rates)) if len(rates) else 0.0


def elimination_plan(problem: GraphProblem, tops: list[int], limit: int = TABLE_LIMIT) -> list[_Step] | None:
    """A greedy elimination order (smallest table first), or ``None`` if some table would exceed ``limit``."""
    poly = problem.polynomial
    neighbours: dict[int, dict[int, float]] = {g: {} for g in range(problem.layers)}
    for (a, b), w in poly.pairs.items():
        neighbours[a][b] = float(w)
        neighbours[b][a] = float(w)
    links: dict[int, set[int]] = {g: set(neighbours[g]) for g in neighbours}  # bilinear terms and messages
    pending: list[tuple[int, tuple[int, ...]]] = []  # (step, scope) of messages not yet delivered
    remaining, plan = set(neighbours), []

    def size(g: int) -> float:
        # The message table, or the work of its hulls (one per value of the incoming messages'
        # variables, each over x's values): whichever is larger. A message lands in the bucket of
        # the first of its variables to be eliminated.
        table = float(np.prod([tops[n] for n in links[g]], dtype=np.float64))
        through = {v for _, scope in pending if g in scope for v in scope} - {g}
        hulls = float(np.prod([tops[n] for n in through], dtype=np.float64))
        return max(table, hulls * tops[g], hulls * HULL_COST)

    while remaining:
        x = min(remaining, key=lambda g: (size(g), len(links[g]), g))
        if size(x) > limit:
            return None
        scope = tuple(sorted(links[x]))
        incoming = tuple(i for i, sc in pending if x in sc)
        pending = [(i, sc) for i, sc in pending if x not in sc]
        plan.append(_Step(x, tuple((n, w) for n, w in neighbours[x].items() if n in remaining), incoming, scope))
        pending.append((len(plan) - 1, scope))
        remaining.discard(x)
        for n in scope:
            links[n] |= set(scope) - {n}
            links[n].discard(x)
    return plan


def solve_graph_exact(problem: GraphProblem, time_limit: float = 60.0, seed: int = 0,
                      tolerance: float = TOLERANCE) -> ExactResult:
    """Solve eq. 15 on a channel graph to proven optimality where the graph allows (module docstring).

    Args:
        problem: the validated problem.
        time_limit: seconds the branch and bound may run before returning its incumbent.
        seed: seed of the PSO allocation that seeds the incumbent.
        tolerance: a point must beat the incumbent by more than ``tolerance * max(1, J)`` to be
            searched for (:data:`TOLERANCE`).

    Returns:
        The choice, its proven gap (at most ``tolerance * max(1, J)`` when the search finished;
        ``nan`` when no bound was available), wall time and nodes visited.
    """
    start = time.perf_counter()
    tops = feasible_tops(problem)  # cost grows with every k_g: larger values never fit
    plan = elimination_plan(problem, tops)
    # The baselines seed the incumbent, so the answer is never worse than either (same PSO seed).
    best_seed = min((uniform_prune(problem), solve_pso(problem, PSOConfig(seed=seed))), key=problem.objective)
    if plan is None:  # too entangled for exact tables: the better baseline, raised greedily
        return ExactResult(fill(problem, best_seed), float("nan"), time.perf_counter() - start, 0)
    graph = _Graph(problem, plan, tops)
    unconstrained = graph.minimiser(0.0)
    if problem.cost(unconstrained) <= problem.budget:
        return ExactResult(unconstrained, 0.0, time.perf_counter() - start, 0)
    # Each multiplier costs a full elimination: the dual needs to be only well inside the
    # tolerance the enumeration proves to (a tenth of it), and the multiplier to 1e-4.
    slack = 0.1 * tolerance * max(1.0, problem.objective(best_seed))
    lam, lower_bound, incumbent = dual(graph, precision=1e-4, slack=slack, guess=_marginal_rate(problem, best_seed))
    if problem.objective(best_seed) < problem.objective(incumbent):
        incumbent = best_seed
    graph.tables(lam)
    state = {"best": incumbent, "ub": problem.objective(incumbent), "visited": 0, "stopped": False}
    deadline = start + time_limit
    offset = lam * (graph.constant - problem.budget)
    reverse = [step.var for step in reversed(plan)]
    constants = sum(float(graph.messages[i]) for i, step in enumerate(plan) if not step.scope)

    def improves(bound):
        return bound < state["ub"] - tolerance * max(1.0, abs(state["ub"]))

    assign: dict[int, int] = {}

    def descend(depth: int, acc: float) -> None:
        if out_of_time(state, deadline):
            return
        x = reverse[depth]
        here = graph.bucket(x, assign)
        base = acc - graph.message(x, assign)
        bounds = base + here + offset
        candidates = np.flatnonzero(improves(bounds))
        for i in candidates[np.argsort(bounds[candidates], kind="stable")]:
            if not improves(bounds[i]):
                break
            assign[x] = int(i)
            if depth == len(reverse) - 1:
                theta = [assign[g] + 1 for g in range(problem.layers)]
                if problem.cost(theta) <= problem.budget and improves(problem.objective(theta)):
                    state["best"], state["ub"] = theta, problem.objective(theta)
            else:
                descend(depth + 1, base + float(here[i]))
            if state["stopped"]:
                break
        assign.pop(x, None)

    descend(0, constants)
    gap = max(0.0, state["ub"] - lower_bound)
    if not state["stopped"]:  # every point better by more than the tolerance was ruled out
        gap = min(gap, tolerance * max(1.0, abs(state["ub"]))) if tolerance > REL_TOL else 0.0
    return ExactResult(state["best"], gap, time.perf_counter() - start, state["visited"])
