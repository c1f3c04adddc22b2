"""Low-rank factoring of any network's layers, each on its own (Sec. 2.3, eq. 10-13).

Factoring a layer replaces ``W`` by ``A B`` and leaves its input and output as they were, so the
layers do not couple: no chain and no channel groups are needed (pruning needs them, since a
deleted unit leaves two layers). Every ``nn.Linear`` and ``groups=1`` ``nn.Conv2d`` is a candidate,
with eq. 13's curve from its own SVD; the allocation is the paper's problem with per-layer shapes
and scales (a knapsack over the layers' rank curves), solved by the same solvers. The last layer
to run comes last in the problem, so the uniform allocation keeps it dense, as the paper does.

Layers that cannot be factored this way (grouped and depthwise convolutions, whose matrices are
block-diagonal; 1-d/3-d and transposed convolutions) keep their multiplications, which count
against the budget: ``alpha`` is always of the whole network's MACs (:func:`count_macs`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .allocation import Allocation, solve_allocation
from .factored import factor_layer, lowrank_curves, svd_of
from .macs import count_macs, hooked_eval
from .problem import budget_for, layer_lowrank_cost


@dataclass(frozen=True)
class FactorableLayer:
    """One layer that low-rank may factor.

    Attributes:
        name: its qualified name in the model (the first, if it is registered under several).
        module: the layer.
        matrix: ``(m_in, m_out)`` of its weight as a matrix (a convolution's: ``C_in k_h k_w, C_out``).
        positions: times the matrix is applied per sample (output pixels of a convolution, leading
            positions of a Linear on ``[N, ..., F]``, summed over every call of a shared layer).
    """

    name: str
    module: nn.Module
    matrix: tuple[int, int]
    positions: int

    @property
    def units(self) -> tuple[int, int]:
        """``(inputs, outputs)`` in units: features or channels."""
        m = self.module
        return (m.in_channels, m.out_channels) if isinstance(m, nn.Conv2d) else (m.in_features, m.out_features)


def _factorable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (isinstance(module, nn.Conv2d) and module.groups == 1)


@torch.no_grad()
def factorable_layers(model: nn.Module, example: torch.Tensor) -> tuple[list[FactorableLayer], int]:
    """The layers of ``model`` that low-rank may factor, in the order they first run, and the
    multiplications per sample of everything else.

    Args:
        model: any module.
        example: a batch of inputs (one sample is run).

    Returns:
        ``(layers, fixed)``: the factorable layers and the MACs no factoring changes.

    Raises:
        TypeError: the model has (or runs) no Linear or ``groups=1`` Conv2d.
    """
    names = {}
    for name, module in model.named_modules():
        if _factorable(module):
            names.setdefault(module, name)
    if not names:
        raise TypeError(f"the {type(model).__name__} has no nn.Linear or groups=1 nn.Conv2d layer: low-rank has "
                        "nothing to factor")
    positions: dict[nn.Module, int] = {}

    def record(module: nn.Module, inputs, output: torch.Tensor) -> None:
        width = module.out_channels if isinstance(module, nn.Conv2d) else module.out_features
        positions[module] = positions.get(module, 0) + output.numel() // width

    with hooked_eval(model, [m.register_forward_hook(record) for m in names]):
        model(example[:1])
    layers = [FactorableLayer(names[m], m, (m.weight[0].numel(), m.weight.shape[0]), p) for m, p in positions.items()]
    if not layers:
        raise TypeError(f"the {type(model).__name__} runs none of its nn.Linear or groups=1 nn.Conv2d layers: "
                        "low-rank has nothing to factor")
    fixed = count_macs(model, example[:1]) - sum(layer.positions * a * b for layer in layers for a, b in [layer.matrix])
    return layers, fixed


@dataclass(frozen=True)
class LayerwiseLowRank:
    """A low-rank reduction of any network.

    Attributes:
        model: the reduced copy (eval mode), every factored layer a
            :class:`~edgetorch.reduce.factored.Factored` pair in its original place.
        allocation: the solver's record, its ``cost`` and ``total`` over the whole network.
        layers: the factorable layers, in the order of ``allocation.theta`` (ranks).
        curves: eq. 13's curve per layer.
    """

    model: nn.Module
    allocation: Allocation
    layers: list[FactorableLayer]
    curves: list[np.ndarray]


def reduce_lowrank(model: nn.Module, alpha: float, allocation: str, example: torch.Tensor,
                   seed: int = 0) -> LayerwiseLowRank:
    """Factor the Linear and Conv2d layers of any ``model`` so that ``alpha`` of its MACs are saved.

    Args:
        model: any module (it is not modified).
        alpha: total reduction factor in [0, 1), of the whole network's multiplications.
        allocation: one of :data:`~edgetorch.reduce.allocation.ALLOCATIONS`.
        example: input samples; only their shape is used (output positions).
        seed: PSO seed.

    Returns:
        The :class:`LayerwiseLowRank` reduction.

    Raises:
        ValueError: an alpha that even rank 1 everywhere does not reach (the message says how many
            multiplications no factoring can remove).

    Example:
        >>> net = torchvision.models.resnet18(num_classes=10)
        >>> result = reduce_lowrank(net, 0.5, "optimal", images[:1])
        >>> count_macs(result.model, images[:1]) <= 0.5 * count_macs(net, images[:1])
        True
    """
    layers, fixed = factorable_layers(model, example)
    total = fixed + sum(layer.positions * a * b for layer in layers for a, b in [layer.matrix])
    budget = budget_for(alpha, total)
    cheapest = fixed + sum(layer.positions * layer_lowrank_cost(*layer.matrix, 1) for layer in layers)
    if cheapest > budget:
        raise ValueError(f"alpha={alpha} is infeasible for low-rank on this {type(model).__name__}: even rank 1 in "
                         f"every layer keeps {cheapest} of {total} multiplications (largest reachable alpha "
                         f"{1 - cheapest / total:.6f}); {fixed} of them are in layers that cannot be factored "
                         "(grouped or depthwise convolutions, 1-d/3-d or transposed convolutions)")
    factorable_total = total - fixed
    # The factorable layers' share of the budget, as an alpha of their own MACs (make_problem
    # floors (1 - alpha') x total again, which gives back budget - fixed or one less).
    alpha_layers = max(0.0, 1.0 - (budget - fixed) / factorable_total)
    svds = [svd_of(layer.module) for layer in layers]
    curves = lowrank_curves(svds)
    chosen = solve_allocation(curves, None, alpha_layers, "lowrank", allocation, seed=seed,
                              shapes=[layer.matrix for layer in layers], scales=[layer.positions for layer in layers])
    chosen = dataclasses.replace(chosen, cost=chosen.cost + fixed, total=total)
    factored = {layer.module: factor_layer(layer.module, k, svd) for layer, k, svd in zip(layers, chosen.theta, svds)}
    # A copy of the model in which every use of a factored layer (a shared one too) is its pair.
    out = copy.deepcopy(model, memo={id(m): f for m, f in factored.items() if f is not m})
    return LayerwiseLowRank(out.eval(), chosen, layers, curves)
