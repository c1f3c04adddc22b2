"""The paper's baseline: the same reduction everywhere, rounded down so the budget holds."""

from __future__ import annotations

import numpy as np

from .problem import Problem, layer_lowrank_cost


def uniform_prune(problem: Problem) -> list[int]:
    """Keep the same fraction ``r`` of every pruned neuron layer, the largest ``r`` that fits.

    Equal per-layer factors alpha_l (eq. 5-6) taken literally force an alternating pattern
    (the last hidden layer keeps 1 - alpha, the one before it everything, ...), which prunes
    half the layers not at all; a constant keep fraction per neuron layer is what "uniform
    pruning" means in practice, so that is the baseline here (``M~_l = max(1, floor(r M_l))``,
    ``r`` found by bisection on the exact integer cost).
    """
    widths = np.asarray(problem.widths[:-1])

    def kept(r: float) -> list[int]:
        return [int(v) for v in np.maximum(1, np.floor(r * widths + 1e-9))]

    if problem.cost(kept(1.0)) <= problem.budget:
        return kept(1.0)
    lo, hi = 0.0, 1.0  # kept(lo) is feasible (all ones: make_problem checked it)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if problem.cost(kept(mid)) <= problem.budget else (lo, mid)
    return kept(lo)


def uniform_lowrank(problem: Problem) -> list[int]:
    """Every layer gets at most ``(1 - alpha)`` of its own multiplications (eq. 10, alpha_l = alpha).

    Per layer, the largest rank whose cost fits that share (full rank = the dense layer); a layer
    too small for even rank 1 to fit keeps rank 1; if those floors push the total over the budget,
    every layer's share is lowered (by 1% steps) until the total fits.
    """
    share = 1.0 - problem.alpha
    while True:
        ranks = []
        for (m_in, m_out), top in zip(problem.shapes, problem.upper):  # s_l cancels within a layer
            allowed = share * m_in * m_out
            if layer_lowrank_cost(m_in, m_out, top) <= allowed:
                ranks.append(top)  # the dense layer fits its share
            else:  # the largest factored rank within the share, at least 1
                ranks.append(max(1, min(top - 1, int(allowed // (m_in + m_out)))))
        if problem.cost(ranks) <= problem.budget:
            return ranks
        share *= 0.99  # only reached when rank-1 floors pushed the total over the budget
