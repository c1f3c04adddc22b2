"""Reducing one ``nn.Sequential`` chain at many budgets from what is measured on it once.

A chain's reduction (:mod:`.sequential`) runs the calibration samples through the network (eq.
8-9), orders each layer's input units (eq. 14, or pivoted Cholesky for prune-ls) and takes each
layer's SVD (eq. 13) before it solves an allocation. None of that depends on the budget, and it is
most of the time: on the paper's 2500-2000-1500-1000-500 MLP about a minute of statistics from
5,000 images and most of a minute of SVDs on two cores, against seconds for a solver. A
:class:`ChainReducer` computes each piece once, when first needed, and builds any number of reduced
networks from it (a sweep over alpha, methods and allocations); :func:`~edgetorch.reduce.reduce_model`
reduces a chain as one such reduction.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

import numpy as np
import torch
from torch import nn

from .._checks import check_choice
from .allocation import Allocation, solve_allocation
from .factored import Svd, lowrank_curves
from .nested import nesting
from .problem import METHODS, budget_for, layer_lowrank_cost, prune_cost
from .reduction import LayerFactor, Reduction
from .sequential import (InputStatistics, WeightLayer, check_chain, factorised, input_statistics, layer_svds,
                         prune_orders, pruned, weight_layers, widths_of)


def is_chain(model: nn.Module) -> bool:
    """Whether ``model`` is an ``nn.Sequential`` chain the layer-by-layer path takes (:mod:`.sequential`);
    :func:`~edgetorch.reduce.api.reduction_path` sends any other network elsewhere."""
    if not isinstance(model, nn.Sequential):
        return False
    try:
        check_chain(model)
    except TypeError:
        return False
    return True


class ChainReducer:
    """A chain's reduced networks at any budget, method and allocation, from statistics measured once.

    The calibration statistics and prune orders (pruning) and the SVDs (low-rank) are computed on
    first use and kept, so a second reduction costs only its solver and the building of the
    network; each reduction equals :func:`~edgetorch.reduce.reduce_model`'s with the same arguments.

    Args:
        model: an ``nn.Sequential`` chain (:mod:`.sequential`: MLPs and plain CNNs), or nested
            ``nn.Sequential`` containers that compute one (:mod:`.nested`: the reduced network keeps
            them). It is read, never modified; what is measured on it is kept, so a model changed
            afterwards needs a new reducer.
        calibration: unlabeled input samples ``[N, ...]``: needed for pruning; low-rank of a
            convolutional chain reads only their shape (its output positions).

    Attributes:
        layers: the chain's weight layers (:func:`~edgetorch.reduce.sequential.weight_layers`).
        calibration: the calibration samples given.

    Raises:
        TypeError: ``model`` is no such chain (the message names the module and the reason).
        ValueError: a convolutional chain without ``calibration``.

    Example:
        >>> reducer = ChainReducer(model, images[:1000])
        >>> sweep = {alpha: reducer.reduce(alpha, "prune-ls") for alpha in (0.3, 0.5, 0.7)}
        >>> sweep[0.5].allocation.theta == reduce_model(model, 0.5, "prune-ls", calibration=images[:1000]).allocation.theta
        True
    """

    def __init__(self, model: nn.Module, calibration: torch.Tensor | None = None) -> None:
        nested = nesting(model)
        self._nesting = nested if nested is not None and is_chain(nested.flat) else None
        self._flat = self._nesting.flat if self._nesting is not None else model
        self.calibration = calibration
        try:
            self.layers: list[WeightLayer] = weight_layers(self._flat, calibration)
        except ValueError as exc:  # a convolutional network needs an input size even for low-rank
            raise ValueError(f"{exc}: pass calibration= (for low-rank only its shape is used)") from None
        self._orders: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    @property
    def widths(self) -> list[int]:
        """``[M_0, ..., M_L]``: the chain's unit widths, input first (the pruning problem's)."""
        return widths_of(self.layers)

    @cached_property
    def statistics(self) -> InputStatistics:
        """Each weight layer's input means and covariance over the calibration samples (eq. 8-9).

        Raises:
            ValueError: no calibration samples, or fewer than 2.
        """
        if self.calibration is None:
            raise ValueError("pruning needs calibration samples (unlabeled inputs): pass calibration=")
        return input_statistics(self._flat, self.calibration, layers=self.layers)

    @cached_property
    def svds(self) -> list[Svd]:
        """Each weight layer's SVD (float64), which low-rank's curves and factored layers both read."""
        return layer_svds(self._flat)

    def _prune_orders(self, method: str) -> list[tuple[np.ndarray, np.ndarray]]:
        if method not in self._orders:
            self._orders[method] = prune_orders(self.statistics, correlated=method == "prune-ls")
        return self._orders[method]

    def curves(self, method: str) -> list[np.ndarray]:
        """The error curves the allocation of ``method`` is solved on.

        Args:
            method: one of :data:`METHODS`.

        Returns:
            Per weight layer, ``J_l`` over kept inputs (pruning, eq. 14 or its correlation-aware
            form) or over ranks (low-rank, eq. 13).

        Raises:
            ValueError: an unknown method, or pruning without calibration samples.
        """
        check_choice("method", method, METHODS)
        if method == "lowrank":
            return lowrank_curves(self.svds)
        return [curve for _, curve in self._prune_orders(method)]

    def allocate(self, alpha: float, method: str, allocation: str = "optimal", *, seed: int = 0,
                 time_limit: float = 60.0, prune_input: bool = False) -> Allocation:
        """The per-layer kept inputs or ranks for ``alpha`` (:func:`~edgetorch.reduce.solve_allocation`
        on this chain's curves and costs).

        Args:
            alpha, method, allocation, seed, prune_input: as :func:`~edgetorch.reduce.reduce_model`.
            time_limit: the optimal allocation's time limit in seconds.

        Returns:
            The :class:`~edgetorch.reduce.Allocation`.

        Raises:
            ValueError: an unknown method or allocation, an alpha no allocation reaches, pruning
                without calibration samples.
        """
        curves = self.curves(method)
        if method == "lowrank":
            return solve_allocation(curves, None, alpha, method, allocation, seed=seed, time_limit=time_limit,
                                    shapes=[layer.matrix for layer in self.layers],
                                    scales=[layer.positions for layer in self.layers])
        return _prune_allocation(curves, self.widths, [layer.scale for layer in self.layers], alpha, method,
                                 allocation, seed, time_limit, prune_input)

    def build(self, chosen: Allocation) -> nn.Module:
        """The reduced network of an allocation.

        Args:
            chosen: an allocation of this chain, from :meth:`allocate`.

        Returns:
            A new module in eval mode (the input model's nested containers kept).
        """
        if chosen.method == "lowrank":
            reduced = factorised(self._flat, chosen.theta, self.svds)
        else:
            reduced = pruned(self._flat, chosen.theta, self._prune_orders(chosen.method), self.statistics,
                             refit=chosen.method == "prune-ls")
        return (self._nesting.nest(reduced) if self._nesting is not None else reduced).eval()

    def factors(self, chosen: Allocation) -> list[LayerFactor]:
        """Each weight layer's kept inputs or rank, MACs, ``alpha_l`` and ``J_l`` under an allocation.

        Args:
            chosen: an allocation of this chain, from :meth:`allocate`.

        Returns:
            One :class:`~edgetorch.reduce.LayerFactor` per weight layer, named as in the input model.
        """
        theta, curves, rows = chosen.theta, self.curves(chosen.method), []
        kept = theta + [self.layers[-1].units_out]
        lowrank = chosen.method == "lowrank"  # "prune" and "prune-ls" share the pruning layout
        for l, layer in enumerate(self.layers):
            if lowrank:
                macs, value = layer.positions * layer_lowrank_cost(*layer.matrix, theta[l]), theta[l]
            else:
                macs, value = layer.scale * kept[l] * kept[l + 1], kept[l]
            name = self._nesting.names[layer.index] if self._nesting is not None else str(layer.index)
            rows.append(LayerFactor(
                l + 1, layer.units_in, layer.units_out, None if lowrank else value, value if lowrank else None, macs,
                1 - macs / (layer.scale * layer.units_in * layer.units_out), float(curves[l][value]), name,
            ))
        return rows

    def reduce(self, alpha: float, method: str = "prune", allocation: str = "optimal", *, seed: int = 0,
               time_limit: float = 60.0, prune_input: bool = False) -> Reduction:
        """Reduce the chain so that at least ``alpha`` of its multiplications are saved.

        Args:
            alpha, method, allocation, seed, prune_input: as :func:`~edgetorch.reduce.reduce_model`.
            time_limit: the optimal allocation's time limit in seconds.

        Returns:
            The :class:`~edgetorch.reduce.Reduction` (``layers`` named as in the input model).

        Raises:
            ValueError: as :meth:`allocate`.
        """
        chosen = self.allocate(alpha, method, allocation, seed=seed, time_limit=time_limit, prune_input=prune_input)
        return Reduction(self.build(chosen), method, chosen, self.factors(chosen))


def _prune_allocation(curves: list, widths: list[int], scales: list[int], alpha: float, method: str,
                      allocation: str, seed: int, time_limit: float, prune_input: bool) -> Allocation:
    """The pruning allocation of a chain; the network's input is kept whole unless ``prune_input``.

    The paper's choice includes ``M~_0`` (eq. 5-7), so a pruned network reads only the kept input
    features, through a :class:`~edgetorch.reduce.sequential.KeepFeatures` gather. On the zoo MLP
    (Fashion-MNIST, ``bench/reduce_input_selection.py``) keeping every input instead and spending
    the same budget on the hidden layers was as accurate (-0.07 to +0.23 points at alpha 0.5 and
    0.7, prune and prune-ls) and faster: 0.71-0.80 of the full network's time at batch 1 against
    0.83-0.94, 0.48-0.67 against 0.54-0.70 at batch 64. So the input is kept unless the caller
    asks, or the budget cannot be met with it (then it is pruned as the paper does). Folding the
    gather into the first layer as zero columns (no gather) costs that layer's full width in MACs:
    0.60-0.65 of the full network's MACs at alpha 0.5, over the budget.
    """
    if not prune_input:
        # M~_0 = M_0 fixed is the same chain problem with a one-unit input weighing s_1 M_0:
        # layer 1 then costs (s_1 M_0) x 1 x M~_1, and its error is J_1(M_0).
        fixed_widths, fixed_scales = [1, *widths[1:]], [scales[0] * widths[0], *scales[1:]]
        cheapest = prune_cost(fixed_widths, [1] * len(curves), fixed_scales)
        if cheapest <= budget_for(alpha, prune_cost(widths, widths[:-1], scales)):
            kept = solve_allocation([curves[0][[0, -1]], *curves[1:]], fixed_widths, alpha, method, allocation,
                                    seed=seed, time_limit=time_limit, scales=fixed_scales)
            return dataclasses.replace(kept, theta=[widths[0], *kept.theta[1:]])
    return solve_allocation(curves, widths, alpha, method, allocation, seed=seed, time_limit=time_limit,
                            scales=scales)
