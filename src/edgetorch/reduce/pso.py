"""The paper's solver: relax to a continuous problem, run a particle swarm, project to integers.

The paper used the pyswarm package. edgetorch runs its own ~30-line global-best PSO on numpy
instead: it takes an explicit seed (pyswarms draws from numpy's global RNG), and the constraint is
handled here explicitly -- a penalty during the swarm and a projection to a feasible integer point
afterwards -- rather than trusting a library that may return an infeasible point with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .problem import Problem, layer_lowrank_cost


@dataclass(frozen=True)
class PSOConfig:
    """Swarm settings (standard global-best PSO with inertia).

    Attributes:
        particles: swarm size.
        iterations: velocity updates.
        inertia: velocity carried over per step.
        cognitive: pull towards each particle's own best.
        social: pull towards the swarm's best.
        seed: seeds the swarm; same seed, same answer.
    """

    particles: int = 64
    iterations: int = 300
    inertia: float = 0.7
    cognitive: float = 1.5
    social: float = 1.5
    seed: int = 0


def _interp(curves: tuple[np.ndarray, ...], points: np.ndarray) -> np.ndarray:
    # Linear interpolation of each layer's curve at the integer grid (Sec. 3.4), summed over layers.
    total = np.zeros(points.shape[0])
    for l, curve in enumerate(curves):
        grid = np.arange(len(curve))
        total += np.interp(points[:, l], grid[1:], curve[1:])
    return total


def _relaxed_cost(problem: Problem, points: np.ndarray) -> np.ndarray:
    # Pruning: eq. 7's bilinear cost evaluated at real-valued widths. Low-rank: each layer's
    # integer cost curve (factored, then dense at full rank) interpolated like J. A channel-graph
    # problem (graph_problem.py) evaluates its own polynomial.
    if hasattr(problem, "relaxed_cost"):
        return problem.relaxed_cost(points)
    if problem.cost_model == "prune":
        kept = np.concatenate([points, np.full((len(points), 1), float(problem.widths[-1]))], axis=1)
        return np.sum(np.asarray(problem.scales, dtype=np.float64) * kept[:, :-1] * kept[:, 1:], axis=1)
    return _interp(_lowrank_cost_curves(problem), points)


def _lowrank_cost_curves(problem: Problem) -> tuple[np.ndarray, ...]:
    return tuple(
        np.array([np.inf] + [s * layer_lowrank_cost(a, b, k) for k in range(1, u + 1)], dtype=np.float64)
        for (a, b), s, u in zip(problem.shapes, problem.scales, problem.upper)
    )


def project(problem: Problem, point: np.ndarray) -> list[int]:
    """Nearest integer point, then repaired until feasible.

    Rounds each coordinate; while over budget, lowers by one the coordinate that saves the most
    multiplications per unit of added error (a greedy walk towards the feasible region).
    """
    theta = [int(v) for v in np.clip(np.rint(point), 1, problem.upper)]
    while problem.cost(theta) > problem.budget:
        best, best_score = -1, -np.inf
        for l in range(problem.layers):
            if theta[l] <= 1:
                continue
            lowered = theta.copy()
            lowered[l] -= 1
            saved = problem.cost(theta) - problem.cost(lowered)
            added = problem.errors[l][lowered[l]] - problem.errors[l][theta[l]]
            score = saved / (max(added, 0.0) + 1e-12)
            if saved > 0 and score > best_score:
                best, best_score = l, score
        if best < 0:  # no single step saves anything: lower the largest coordinate
            best = int(np.argmax(theta))
        theta[best] -= 1
    return theta


def solve_pso(problem: Problem, config: PSOConfig = PSOConfig()) -> list[int]:
    """Minimise the relaxed J with a penalty for exceeding the budget; project the best point.

    Args:
        problem: the validated problem.
        config: swarm settings and seed.

    Returns:
        A feasible integer choice (not necessarily optimal).
    """
    rng = np.random.default_rng(config.seed)
    lo = np.ones(problem.layers)
    hi = np.asarray(problem.upper, dtype=np.float64)
    finite = [c[1:] for c in problem.errors]
    penalty = 10.0 * (sum(float(c.max()) for c in finite) + 1.0)

    def fitness(points: np.ndarray) -> np.ndarray:
        over = np.maximum(0.0, _relaxed_cost(problem, points) - problem.budget) / problem.total
        return _interp(problem.errors, points) + penalty * (over + (over > 0))

    pos = lo + rng.random((config.particles, problem.layers)) * (hi - lo)
    vel = (rng.random(pos.shape) - 0.5) * (hi - lo) * 0.1
    best_pos, best_val = pos.copy(), fitness(pos)
    glob = best_pos[np.argmin(best_val)].copy()
    for _ in range(config.iterations):
        r1, r2 = rng.random(pos.shape), rng.random(pos.shape)
        vel = (config.inertia * vel + config.cognitive * r1 * (best_pos - pos)
               + config.social * r2 * (glob - pos))
        pos = np.clip(pos + vel, lo, hi)
        val = fitness(pos)
        better = val < best_val
        best_pos[better], best_val[better] = pos[better], val[better]
        glob = best_pos[np.argmin(best_val)].copy()
    return project(problem, glob)
