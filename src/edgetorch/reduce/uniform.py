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
    """The paper's uniform low-rank baseline (Sec. 4, Fig. 3): the last layer dense, one factor elsewhere.

    The paper sets ``alpha_L = 0`` (the output layer's matrix is already of rank ``M_L``; factoring
    it costs the most accuracy) and one ``alpha'`` in layers ``1..L-1``. Its printed formula,
    ``alpha' = (alpha sum_l M_{l-1} M_l - M_{L-1} M_L) / sum_{l<L} M_{l-1} M_l``, misses the budget
    by exactly the output layer's multiplications; the share that meets it is used here:
    ``1 - alpha' = (budget - s_L M_{L-1} M_L) / sum_{l<L} s_l M_{l-1} M_l``. Only where the dense
    last layer leaves no room for rank 1 elsewhere (or the network has one layer) does every
    layer, the last included, get ``1 - alpha`` of its own multiplications (eq. 10, alpha_l = alpha).

    Per layer the rank is the largest whose cost fits its share (full rank = the dense layer),
    at least 1; if those floors push the total over the budget, the shares are lowered (by 1%
    steps) until the total fits. The optimal and PSO allocations are free to factor the last layer.
    """
    last = problem.layers - 1
    dense = [*([1] * last), problem.upper[last]]
    if problem.layers > 1 and problem.cost(dense) <= problem.budget:
        head, tail = problem.shapes[last], problem.scales[last]
        rest = problem.total - tail * head[0] * head[1]
        return _equal_share(problem, (problem.budget - tail * head[0] * head[1]) / rest, problem.upper[last])
    return _equal_share(problem, 1.0 - problem.alpha, None)


def _equal_share(problem: Problem, share: float, last_rank: int | None) -> list[int]:
    # Each layer (the last too when last_rank is None) gets at most ``share`` of its own
    # multiplications (s_l cancels within a layer).
    layers = problem.shapes if last_rank is None else problem.shapes[:-1]
    while True:
        ranks = []
        for (m_in, m_out), top in zip(layers, problem.upper):
            allowed = share * m_in * m_out
            if layer_lowrank_cost(m_in, m_out, top) <= allowed:
                ranks.append(top)  # the dense layer fits its share
            else:  # the largest factored rank within the share, at least 1
                ranks.append(max(1, min(top - 1, int(allowed // (m_in + m_out)))))
        ranks += [] if last_rank is None else [last_rank]
        if problem.cost(ranks) <= problem.budget:
            return ranks
        share *= 0.99  # only reached when rank-1 floors pushed the total over the budget
