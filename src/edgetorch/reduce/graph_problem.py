"""Eq. 15 on a channel graph: one kept count ``k_g`` per coupled channel group, any network.

The chain problem (:mod:`edgetorch.reduce.problem`) has one variable per neuron layer and a cost
that couples neighbours. In a residual, depthwise or concatenating network the variables are the
channel groups of :mod:`edgetorch.reduce.graph` and a layer's cost couples its input groups with
its output group (``CostTerm``), so the cost is a quadratic polynomial

    ``cost(k) = c + sum_g a_g k_g + sum_g q_g k_g^2 + sum_{g<h} w_gh k_g k_h``  (all coefficients >= 0)

over a graph that need not be a chain. ``J(k) = sum_g J_g(k_g)`` stays separable. A
:class:`GraphProblem` offers the same interface as :class:`~edgetorch.reduce.problem.Problem`
(``layers``, ``upper``, ``errors``, ``cost``, ``objective``, ``feasible``, ``budget``, ``total``), so
the PSO and uniform baselines run on it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .graph import ChannelGraph
from .problem import budget_for


@dataclass(frozen=True)
class Polynomial:
    """``cost(k) = constant + sum_g linear[g] k_g + sum_g square[g] k_g^2 + sum pairs[(g, h)] k_g k_h``."""

    constant: int
    linear: np.ndarray
    square: np.ndarray
    pairs: dict[tuple[int, int], int]


def cost_polynomial(graph: ChannelGraph) -> Polynomial:
    """Expand the graph's cost terms into :class:`Polynomial` coefficients (exact integers)."""
    n = len(graph.groups)
    constant, linear, square, pairs = 0, np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), {}
    for t in graph.terms:
        if t.depthwise:
            linear[t.output] += t.scale
        elif t.output is None:
            constant += t.scale * t.fixed_in * t.fixed_out
            for g in t.inputs:
                linear[g] += t.scale * t.fixed_out
        else:
            linear[t.output] += t.scale * t.fixed_in
            for g in t.inputs:
                if g == t.output:
                    square[g] += t.scale
                else:
                    key = (min(g, t.output), max(g, t.output))
                    pairs[key] = pairs.get(key, 0) + t.scale
    return Polynomial(constant, linear, square, pairs)


@dataclass(frozen=True)
class GraphProblem:
    """A validated allocation problem on a channel graph (see the module docstring).

    Attributes:
        graph: the groups and cost terms.
        errors: per group, ``J_g(v)`` for ``v = 0..M_g``; entry 0 is inf.
        alpha: requested minimum total reduction factor.
        budget: the most multiplications a feasible choice may cost.
    """

    graph: ChannelGraph
    errors: tuple[np.ndarray, ...]
    alpha: float
    budget: int
    cost_model: str = field(default="graph", init=False)

    @property
    def layers(self) -> int:
        """Number of variables (groups); named as the chain problem's, which the baselines read."""
        return len(self.errors)

    @cached_property
    def upper(self) -> tuple[int, ...]:
        """``M_g`` per group."""
        return self.graph.sizes

    @property
    def widths(self) -> tuple[int, ...]:
        """``(M_1, ..., M_G, 1)``: the group sizes closed like a chain's widths (whose last entry is never
        pruned), so the uniform baseline keeps the same fraction of every group."""
        return (*self.graph.sizes, 1)

    @cached_property
    def total(self) -> int:
        """Multiplications of the full network."""
        return self.graph.cost()

    @cached_property
    def polynomial(self) -> Polynomial:
        """The cost as a :class:`Polynomial` (what the exact solver eliminates)."""
        return cost_polynomial(self.graph)

    @cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pairs = self.polynomial.pairs
        return (np.array([a for a, _ in pairs], dtype=np.int64), np.array([b for _, b in pairs], dtype=np.int64),
                np.array(list(pairs.values()), dtype=np.int64))

    def cost(self, theta: Sequence[int]) -> int:
        """Multiplications with ``theta[g]`` channels kept per group (the polynomial, in exact int64)."""
        k = np.asarray(theta, dtype=np.int64)
        poly, (a, b, w) = self.polynomial, self._arrays
        return int(poly.constant + poly.linear @ k + poly.square @ (k * k) + (w * k[a] * k[b]).sum())

    def raise_costs(self, theta: Sequence[int]) -> list[int]:
        """Added multiplications of raising each ``theta[g]`` by one (the polynomial's forward differences)."""
        k = np.asarray(theta, dtype=np.int64)
        poly, (a, b, w) = self.polynomial, self._arrays
        extra = poly.linear + poly.square * (2 * k + 1)
        np.add.at(extra, a, w * k[b])
        np.add.at(extra, b, w * k[a])
        return extra.tolist()

    def relaxed_cost(self, points: np.ndarray) -> np.ndarray:
        """The same polynomial at real-valued points ``[P, G]`` (the PSO's relaxation)."""
        total = np.zeros(len(points))
        for t in self.graph.terms:
            out = np.full(len(points), float(t.fixed_out)) if t.output is None else points[:, t.output]
            if t.depthwise:
                total += t.scale * out
            else:
                total += t.scale * (t.fixed_in + points[:, list(t.inputs)].sum(axis=1)) * out
        return total

    def objective(self, theta: Sequence[int]) -> float:
        """``J(theta) = sum_g J_g(theta_g)``."""
        return float(sum(e[int(v)] for e, v in zip(self.errors, theta)))

    def feasible(self, theta: Sequence[int]) -> bool:
        """Whether ``theta`` is in range and meets the budget."""
        in_range = all(1 <= int(v) <= u for v, u in zip(theta, self.upper))
        return in_range and self.cost(theta) <= self.budget


def make_graph_problem(graph: ChannelGraph, errors: Sequence[Sequence[float]], alpha: float) -> GraphProblem:
    """Validate per-group curves and alpha, and build the problem.

    Args:
        graph: the model's :class:`~edgetorch.reduce.graph.ChannelGraph`.
        errors: per group, ``J_g(v)`` for ``v = 0..M_g`` (index 0 ignored).
        alpha: minimum total reduction factor in [0, 1).

    Returns:
        The :class:`GraphProblem`.

    Raises:
        ValueError: wrong number or length of curves, NaN/negative errors, alpha outside [0, 1)
            or beyond what one channel per group reaches.
    """
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha < 1.0):
        raise ValueError(f"alpha must be a number in [0, 1), got {alpha!r}")
    if len(errors) != len(graph.groups):
        raise ValueError(f"expected {len(graph.groups)} error curves (one per channel group), got {len(errors)}")
    curves = []
    for group, curve in zip(graph.groups, errors):
        values = np.array(curve, dtype=np.float64)
        if values.shape != (group.size + 1,):
            raise ValueError(f"the curve of group {group.index} ({group.root}) must hold J(v) for v = 0..{group.size}, "
                             f"got shape {values.shape}")
        if not np.all(np.isfinite(values[1:])) or np.any(values[1:] < 0):
            raise ValueError(f"the curve of group {group.index} ({group.root}) must be finite and >= 0")
        values[0] = np.inf
        curves.append(values)
    total = graph.cost()
    if total == 0:
        raise ValueError("the network has no multiplications in its weight layers to reduce")
    budget = budget_for(float(alpha), total)
    cheapest = graph.cost([1] * len(graph.groups))
    if cheapest > budget:
        raise ValueError(f"alpha={alpha} is infeasible: even one channel per group keeps {cheapest:,} of {total:,} "
                         f"multiplications (largest reachable alpha {1 - cheapest / total:.6f}; the layers "
                         "outside every group are the floor)")
    return GraphProblem(graph, tuple(curves), float(alpha), budget)
