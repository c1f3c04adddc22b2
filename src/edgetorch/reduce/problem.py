"""The allocation problem of the paper (eq. 5-7, 10-15): validated inputs, costs and budgets.

Notation follows the paper: ``widths = [M_0, ..., M_L]`` are the neuron-layer widths, input first;
there are ``L`` weight layers. A *choice* ``theta`` has one integer per weight layer:

* pruning: ``theta[l-1] = M~_{l-1}``, the kept input neurons of layer ``l`` (1..M_{l-1}); the
  output width ``M_L`` is never pruned. Cost (eq. 7) ``sum_{l<L} M~_{l-1} M~_l + M~_{L-1} M_L``.
* low-rank: ``theta[l-1] = k_l`` in 1..K_l, ``K_l = min(M_{l-1}, M_l)``. A layer at ``k_l = K_l``
  stays dense (``M_{l-1} M_l`` multiplications, error ``J_l(K_l)``), otherwise it is factored into
  two thin layers costing ``(M_{l-1} + M_l) k_l`` (eq. 10-11).

``errors[l-1][v]`` is ``J_l(v)`` for ``v = 0..upper_l``; index 0 is never a valid choice and is
ignored. A choice is feasible when ``cost <= budget``, ``budget = floor((1 - alpha) * total)``,
which is the paper's ``alpha_tot(theta) >= alpha`` in exact integer arithmetic.

Beyond the paper (convolutional networks): each weight layer may carry an integer ``scale``
``s_l`` multiplying its cost, so a layer costs ``s_l M_{l-1} M_l`` dense. For a convolution whose
units are channels, ``s_l`` = kernel area x output positions; for a Linear after a Flatten of
``C x H x W``, the units are the ``C`` channels and ``s_l = H W``. Low-rank layers need not chain
(a convolution's matrix is ``C_out x C_in k_h k_w``), so they are given as per-layer ``shapes``
``(m_in, m_out)``; pruning derives its shapes from the chain of widths.

The problem knows only a *cost model*: ``"prune"`` (eq. 7) or ``"lowrank"`` (eq. 11). The public
``method=`` takes any of :data:`METHODS`; ``"prune-ls"`` is counted like ``"prune"``, since it
removes the same units and differs only in which it keeps and how it refits the next layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._checks import check_choice

METHODS = ("prune", "prune-ls", "lowrank")  # what every ``method=`` of edgetorch.reduce takes
COST_MODELS = ("prune", "lowrank")  # what a Problem counts multiplications with


def cost_model_of(method: str) -> str:
    """The cost model (one of :data:`COST_MODELS`) a reduction ``method`` is counted with.

    Raises:
        ValueError: ``method`` is not one of :data:`METHODS`.
    """
    check_choice("method", method, METHODS)
    return "lowrank" if method == "lowrank" else "prune"


@dataclass(frozen=True)
class Problem:
    """A validated allocation problem.

    Attributes:
        cost_model: ``"prune"`` or ``"lowrank"`` (:data:`COST_MODELS`).
        shapes: per weight layer ``(m_in, m_out)`` (pruning: ``(M_{l-1}, M_l)``, a chain).
        scales: per weight layer, the multiplications per unit pair ``s_l`` (1 for an MLP).
        errors: one float array per weight layer, ``errors[l][v] = J_{l+1}(v)``; entry 0 is inf.
        alpha: requested minimum total reduction factor.
        budget: the most multiplications a feasible choice may cost.
    """

    cost_model: str
    shapes: tuple[tuple[int, int], ...]
    scales: tuple[int, ...]
    errors: tuple[np.ndarray, ...]
    alpha: float
    budget: int

    @property
    def layers(self) -> int:
        """Number of weight layers ``L``."""
        return len(self.shapes)

    @property
    def widths(self) -> tuple[int, ...]:
        """``[M_0, ..., M_L]`` (a chain only for pruning)."""
        return (self.shapes[0][0], *(m_out for _, m_out in self.shapes))

    @property
    def total(self) -> int:
        """Multiplications of the full network, ``sum_l s_l M_{l-1} M_l``."""
        return sum(s * a * b for (a, b), s in zip(self.shapes, self.scales))

    @property
    def upper(self) -> tuple[int, ...]:
        """Largest valid choice per layer (``M_{l-1}`` for pruning, ``K_l`` for low-rank)."""
        return tuple(len(e) - 1 for e in self.errors)

    def cost(self, theta: Sequence[int]) -> int:
        """Multiplications of the reduced network for an integer choice (eq. 7 or 11)."""
        if self.cost_model == "prune":
            return prune_cost(self.widths, theta, self.scales)
        return sum(s * layer_lowrank_cost(a, b, int(k)) for (a, b), s, k in zip(self.shapes, self.scales, theta))

    def objective(self, theta: Sequence[int]) -> float:
        """``J(theta) = sum_l J_l(theta_l)`` (eq. 12)."""
        return float(sum(e[int(v)] for e, v in zip(self.errors, theta)))

    def feasible(self, theta: Sequence[int]) -> bool:
        """Whether ``theta`` is in range and meets the budget."""
        in_range = all(1 <= int(v) <= u for v, u in zip(theta, self.upper))
        return in_range and self.cost(theta) <= self.budget


def full_cost(widths: Sequence[int]) -> int:
    """Multiplications of the full fully connected network (footnote 1: weights only)."""
    return sum(a * b for a, b in zip(widths[:-1], widths[1:]))


def prune_cost(widths: Sequence[int], kept: Sequence[int], scales: Sequence[int] | None = None) -> int:
    """Eq. 7's numerator: ``sum_{l=1}^{L-1} s_l M~_{l-1} M~_l + s_L M~_{L-1} M_L`` (``s_l = 1`` by default)."""
    kept = [int(v) for v in kept] + [int(widths[-1])]
    scales = scales if scales is not None else [1] * (len(kept) - 1)
    return sum(s * a * b for s, a, b in zip(scales, kept[:-1], kept[1:]))


def layer_lowrank_cost(m_in: int, m_out: int, rank: int) -> int:
    """Multiplications of one layer at ``rank`` (dense at full rank, eq. 10 otherwise)."""
    return m_in * m_out if rank >= min(m_in, m_out) else (m_in + m_out) * rank


def lowrank_cost(widths: Sequence[int], ranks: Sequence[int]) -> int:
    """Eq. 11's numerator, with full-rank layers kept dense."""
    return sum(layer_lowrank_cost(a, b, int(k)) for a, b, k in zip(widths[:-1], widths[1:], ranks))


def budget_for(alpha: float, total: int) -> int:
    """Largest integer cost with ``1 - cost / total >= alpha``.

    A relative slack of 1e-12 absorbs the float rounding of ``(1 - alpha) * total`` (0.3 * 10
    is 2.9999999999999996), so alpha = 0.7 of 10 multiplications allows 3.
    """
    return math.floor((1.0 - alpha) * total * (1 + 1e-12))


def _positive_ints(name: str, values: Sequence[int], minimum: int, form: str) -> tuple[int, ...]:
    values = tuple(values)
    if len(values) < minimum or any(
        isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in values
    ):
        raise ValueError(f"{name} must be >= {minimum} positive ints {form}, got {values!r}")
    return tuple(int(v) for v in values)


def make_problem(
    errors: Sequence[Sequence[float]],
    widths: Sequence[int] | None,
    alpha: float,
    cost_model: str,
    *,
    scales: Sequence[int] | None = None,
    shapes: Sequence[tuple[int, int]] | None = None,
) -> Problem:
    """Validate the inputs of :func:`edgetorch.reduce.solve_allocation` and build the problem.

    Args:
        errors: per weight layer, ``J_l(v)`` for ``v = 0..upper_l`` (see the module docstring).
        widths: ``[M_0, ..., M_L]``, at least two positive ints; ``None`` when ``shapes`` is given.
        alpha: minimum total reduction factor in [0, 1).
        cost_model: ``"prune"`` or ``"lowrank"`` (:data:`COST_MODELS`; see :func:`cost_model_of`).
        scales: per weight layer, positive int multiplications per unit pair (default all 1).
        shapes: low-rank only, instead of ``widths``: per weight layer ``(m_in, m_out)``.

    Returns:
        The validated :class:`Problem`.

    Raises:
        ValueError: unknown cost model, bad widths/shapes/scales, alpha outside [0, 1), wrong number
            or length of error curves, NaN/inf/negative errors at valid indices, or an alpha no
            choice reaches.
    """
    check_choice("cost model", cost_model, COST_MODELS)
    if (widths is None) == (shapes is None):
        raise ValueError("give exactly one of widths (a chain [M_0, ..., M_L]) and shapes (low-rank only)")
    if shapes is not None:
        if cost_model != "lowrank":
            raise ValueError("per-layer shapes are for low-rank; pruning couples neighbours, give widths")
        pairs = [_positive_ints("each shape", pair, 2, "(m_in, m_out)") for pair in shapes]
        if not pairs or any(len(pair) != 2 for pair in pairs):
            raise ValueError(f"shapes must be a non-empty list of (m_in, m_out) pairs, got {shapes!r}")
        shape_list = tuple((a, b) for a, b in pairs)
    else:
        chain = _positive_ints("widths", widths, 2, "[M_0, ..., M_L]")
        shape_list = tuple(zip(chain[:-1], chain[1:]))
    layers = len(shape_list)
    scale_list = _positive_ints("scales", scales, layers, "(one per weight layer)") if scales is not None else (1,) * layers
    if len(scale_list) != layers:
        raise ValueError(f"expected {layers} scales (one per weight layer), got {len(scale_list)}")
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha < 1.0):
        raise ValueError(f"alpha must be a number in [0, 1), got {alpha!r}")
    if len(errors) != layers:
        raise ValueError(f"expected {layers} error curves (one per weight layer), got {len(errors)}")
    curves = []
    for l, curve in enumerate(errors, start=1):
        m_in, m_out = shape_list[l - 1]
        upper = m_in if cost_model == "prune" else min(m_in, m_out)
        values = np.asarray(curve, dtype=np.float64)
        if values.shape != (upper + 1,):
            what = "M_{l-1}" if cost_model == "prune" else "K_l = min(M_{l-1}, M_l)"
            raise ValueError(
                f"errors[{l - 1}] must hold J_{l}(v) for v = 0..{what} = {upper}, "
                f"i.e. {upper + 1} values, got shape {values.shape}"
            )
        valid = values[1:]
        if not np.all(np.isfinite(valid)) or np.any(valid < 0):
            raise ValueError(
                f"errors[{l - 1}] must be finite and >= 0 at indices 1..{upper} "
                f"(got NaN, inf or a negative value)"
            )
        values = values.copy()
        values[0] = np.inf  # choosing nothing is never allowed
        curves.append(values)
    problem = Problem(cost_model, shape_list, scale_list, tuple(curves), float(alpha), 0)
    total = problem.total
    budget = budget_for(float(alpha), total)
    cheapest = problem.cost([1] * layers)
    if cheapest > budget:
        best = 1 - cheapest / total
        where = f"widths {list(problem.widths)}" if shapes is None else f"shapes {list(shape_list)}"
        raise ValueError(
            f"alpha={alpha} is infeasible for {cost_model} on {where}: even one "
            f"neuron/rank per layer keeps {cheapest} of {total} multiplications "
            f"(largest reachable alpha {best:.6f})"
        )
    return dataclasses.replace(problem, budget=budget)
