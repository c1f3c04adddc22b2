"""``allocate``: choose per-layer reduction factors for a total multiplication budget."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._checks import check_choice
from .exact import solve_exact
from .graph_exact import solve_graph_exact
from .graph_problem import GraphProblem
from .lagrangian import ExactResult
from .problem import Problem, cost_model_of, make_problem
from .pso import PSOConfig, solve_pso
from .uniform import uniform_lowrank, uniform_prune

# What every ``allocation=`` of edgetorch.reduce (and ``edgetorch reduce --allocation``) takes.
ALLOCATIONS = ("optimal", "pso", "uniform")


@dataclass(frozen=True)
class Allocation:
    """An allocation and how it was found.

    Attributes:
        theta: kept input neurons per layer (pruning) or ranks per layer (low-rank).
        method: the reduction method the curves belong to, one of :data:`METHODS`.
        solver: which allocation found ``theta``, one of :data:`ALLOCATIONS`.
        objective: ``J(theta)`` (eq. 12).
        cost: multiplications of the reduced network.
        total: multiplications of the full network.
        seconds: wall time of the solver.
        proven_gap: for ``"optimal"``, J minus the proven lower bound (0.0 = proven optimal);
            ``None`` for the heuristics, which prove nothing.
    """

    theta: list[int]
    method: str
    solver: str
    objective: float
    cost: int
    total: int
    seconds: float
    proven_gap: float | None

    @property
    def alpha(self) -> float:
        """The achieved total reduction factor ``1 - cost / total`` (eq. 7 / 11)."""
        return 1.0 - self.cost / self.total


def solve_allocation(
    errors: Sequence[Sequence[float]],
    widths: Sequence[int] | None,
    alpha: float,
    method: str,
    allocation: str = "optimal",
    *,
    seed: int = 0,
    time_limit: float = 60.0,
    scales: Sequence[int] | None = None,
    shapes: Sequence[tuple[int, int]] | None = None,
) -> Allocation:
    """Per-layer kept neurons (pruning) or ranks (low-rank) minimising ``sum_l J_l`` (eq. 15).

    Args:
        errors: per weight layer l = 1..L, the curve ``J_l(v)`` for v = 0..M_{l-1} (pruning:
            kept input neurons) or v = 0..K_l, K_l = min(M_{l-1}, M_l) (low-rank: rank; full
            rank keeps the layer dense). Index 0 is never chosen.
        widths: ``[M_0, ..., M_L]``, input first.
        alpha: the minimum total reduction factor, in [0, 1).
        method: one of :data:`METHODS`; it picks the cost model: ``"prune"`` and ``"prune-ls"``
            count eq. 7, ``"lowrank"`` counts eq. 11.
        allocation: one of :data:`ALLOCATIONS`: ``"optimal"`` (the exact optimum of eq. 15),
            ``"pso"`` (the paper's particle swarm on the relaxation, projected to a feasible
            integer point) or ``"uniform"`` (the same factor everywhere).
        seed: PSO seed.
        time_limit: the optimal allocation's time limit in seconds (past it, the best choice
            found so far is returned with its proven gap).
        scales: per weight layer, multiplications per unit pair ``s_l`` (a convolution's kernel
            area x output positions when its units are channels); default all 1 (the paper's MLP).
        shapes: low-rank only, in place of ``widths``: per weight layer ``(m_in, m_out)`` of its
            weight matrix (a convolution's is ``(C_in k_h k_w, C_out)``), which need not chain.

    Returns:
        The :class:`Allocation`: ``theta``, the chosen ``[M~_0, ..., M~_{L-1}]`` or ``[k_1, ..., k_L]``
        meeting ``1 - cost/total >= alpha``, with its J, cost, solver, time and proven gap.

    Raises:
        ValueError: unknown method or allocation, wrong curve lengths, NaN/negative errors, bad
            widths/shapes/scales, or an alpha that even the smallest network misses.

    Example:
        >>> solve_allocation([[0, 3, 1, 0], [0, 5, 0]], [3, 2, 2], alpha=0.3, method="prune").theta
        [1, 2]
    """
    check_choice("allocation", allocation, ALLOCATIONS)
    problem = make_problem(errors, widths, alpha, cost_model_of(method), scales=scales, shapes=shapes)
    return _solve(problem, method, allocation, seed, lambda: solve_exact(problem, time_limit))


def solve_graph_allocation(
    problem: GraphProblem,
    method: str,
    allocation: str = "optimal",
    *,
    seed: int = 0,
    time_limit: float = 60.0,
) -> Allocation:
    """:func:`solve_allocation` for a channel graph (any CNN): one kept count per channel group.

    Args:
        problem: from :func:`edgetorch.reduce.graph_problem.make_graph_problem`.
        method: the reduction method the curves belong to (``"prune"`` or ``"prune-ls"``).
        allocation: one of :data:`ALLOCATIONS`; ``"optimal"`` is the exact solver of
            :mod:`edgetorch.reduce.graph_exact` (its ``proven_gap`` is ``None`` where the graph
            was too entangled for a bound, e.g. a DenseNet).
        seed: PSO seed.
        time_limit: the optimal allocation's time limit in seconds.

    Returns:
        The allocation record (``theta`` = kept channels per group).

    Example:
        >>> solve_graph_allocation(problem, "prune", "optimal").alpha >= problem.alpha
        True
    """
    check_choice("allocation", allocation, ALLOCATIONS)
    if cost_model_of(method) != "prune":
        raise ValueError(f"method {method!r} is not a channel pruning method; a channel graph takes prune or prune-ls")
    return _solve(problem, method, allocation, seed, lambda: solve_graph_exact(problem, time_limit, seed))


def _solve(problem: Problem | GraphProblem, method: str, allocation: str, seed: int,
           exact: Callable[[], ExactResult]) -> Allocation:
    # One allocation of a chain or a channel graph, timed, its answer checked; ``exact`` runs the
    # problem's own exact solver.
    start = time.perf_counter()
    gap = None
    if allocation == "uniform":
        theta = uniform_prune(problem) if cost_model_of(method) == "prune" else uniform_lowrank(problem)
    elif allocation == "pso":
        theta = solve_pso(problem, PSOConfig(seed=seed))
    else:
        result = exact()
        # NaN: the graph solver found no bound (a graph too entangled for its tables)
        theta, gap = result.theta, (None if math.isnan(result.proven_gap) else result.proven_gap)
    seconds = time.perf_counter() - start
    if not problem.feasible(theta):  # every solver must return a feasible point; never ship one that is not
        raise AssertionError(f"the {allocation} allocation returned an infeasible choice {theta}")
    return Allocation(theta, method, allocation, problem.objective(theta), problem.cost(theta),
                      problem.total, seconds, gap)

