"""``reduce_model``: a trained network in, a physically smaller one out, at a total multiplication budget."""

from __future__ import annotations

import enum

import torch
from torch import nn

from .._checks import check_choice
from .allocation import ALLOCATIONS
from .chain import ChainReducer, is_chain
from .grouped import reduce_grouped
from .lowrank import reduce_lowrank
from .nested import nesting
from .problem import METHODS, layer_lowrank_cost
from .reduction import LayerFactor, Reduction
from .sequential import check_chain
from .transformer import reduce_transformer
from .transformer_blocks import is_transformer


class ReductionPath(enum.Enum):
    """The ways :func:`reduce_model` can reduce a network; :func:`reduction_path` picks one."""

    NESTED_CHAIN = "nested chain"  # nn.Sequential containers computing a chain: reduced as it, names kept
    CHAIN = "chain"  # an nn.Sequential chain, layer by layer (.sequential)
    TRANSFORMER = "transformer"  # attention heads and MLP units (.transformer), pruning only
    LOWRANK_LAYERS = "low-rank layers"  # low-rank of any other network: each layer factored on its own (.lowrank)
    CHANNEL_GROUPS = "channel groups"  # pruning of any other network by its coupled channels (.grouped)


def reduction_path(model: nn.Module, method: str) -> ReductionPath:
    """Which path :func:`reduce_model` takes for ``model`` under ``method``.

    The rules are tried in order and the first that holds decides: a chain (nested or not) is
    reduced layer by layer whatever the method; a transformer is pruned by heads and units; any
    other network is factored layer by layer under low-rank and pruned by channel groups otherwise.

    Args:
        model: the network to reduce.
        method: one of :data:`METHODS`.

    Returns:
        The :class:`ReductionPath`.

    Example:
        >>> reduction_path(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), "prune")
        <ReductionPath.CHAIN: 'chain'>
    """
    nested = nesting(model)
    if nested is not None and is_chain(nested.flat):
        return ReductionPath.NESTED_CHAIN
    if is_chain(model):
        return ReductionPath.CHAIN
    if method != "lowrank" and is_transformer(model):
        return ReductionPath.TRANSFORMER
    if method == "lowrank":  # factoring a layer needs no chain
        return ReductionPath.LOWRANK_LAYERS
    return ReductionPath.CHANNEL_GROUPS


def reduce_model(
    model: nn.Module,
    alpha: float,
    method: str = "prune",
    allocation: str = "optimal",
    calibration: torch.Tensor | None = None,
    seed: int = 0,
    prune_input: bool = False,
) -> Reduction:
    """Reduce a trained network so that at least ``alpha`` of its multiplications are saved.

    Args:
        model: an ``nn.Sequential`` of Linear layers and elementwise activations (a Flatten may
            come first), e.g. :class:`edgetorch.zoo.MLP`; or a plain CNN: ``Conv2d`` layers with
            batch norm, activations and pooling between them, one ``Flatten``, then Linear layers
            (see :mod:`edgetorch.reduce.sequential`); nested ``nn.Sequential`` containers that
            compute such a chain are reduced as it and keep their structure. Convolutions lose
            output channels (pruning) or become a thin convolution + 1x1 convolution (low-rank).
            Any other CNN (residual, depthwise, concatenating, squeeze-excitation: torchvision,
            timm, the zoo's SmallResNet) is pruned by channel groups (:mod:`edgetorch.reduce.grouped`,
            needs ``pip install 'edgetorch[reduce]'``), or factored layer by layer under low-rank
            (:mod:`edgetorch.reduce.lowrank`: every Linear and ``groups=1`` Conv2d on its own).
            A model with Hugging Face BERT-style layers or torchvision ViT encoder blocks loses
            attention heads and MLP hidden units (:mod:`edgetorch.reduce.transformer`; calibration
            is then token ids or images).
        alpha: total reduction factor in [0, 1) (eq. 7 / 11).
        method: one of :data:`METHODS`: ``"prune"`` (the paper's naive pruning: keep the
            highest-power neurons), ``"prune-ls"`` (correlation-aware: pivoted-Cholesky selection
            and least-squares refit of the next layer) or ``"lowrank"`` (SVD, no data needed).
        allocation: one of :data:`ALLOCATIONS`: ``"optimal"`` (exact solution of eq. 15),
            ``"pso"`` (the paper's solver) or ``"uniform"`` (the same factor in every layer; for
            low-rank the paper's baseline: the last layer dense, one factor for the others).
        calibration: unlabeled input samples ``[N, ...]`` (pruning; low-rank on a convolutional
            network or one that is not a chain reads only their shape, to count output positions).
        seed: PSO seed.
        prune_input: pruning a chain, also prune the network's input features (the paper's
            ``M~_0``, read through a :class:`~edgetorch.reduce.sequential.KeepFeatures` gather); by
            default the input is kept whole and pruned only when the budget cannot be met
            otherwise: on the zoo MLP that was as accurate and faster at batch 1 and 64
            (``bench/reduce_input_selection.py``).

    Returns:
        The :class:`Reduction`: ``model``, a new, smaller module in eval mode (the input model is
        not modified); the method; the :class:`Allocation` record (J, cost, solver time, proven
        gap); and one :class:`LayerFactor` per weight layer.

    Raises:
        ValueError: unknown method or allocation, missing calibration data, infeasible alpha.
        TypeError: an unsupported architecture (the message names the layer and the reason).
        ImportError: a network that is not a chain, without Torch-Pruning installed.

    The network goes down the path :func:`reduction_path` names for it. A chain reduced at
    several budgets, methods or allocations is faster through one
    :class:`~edgetorch.reduce.chain.ChainReducer`, which measures the network once.

    Example:
        >>> small = reduce_model(model, 0.5, "prune", calibration=images[:1000]).model
        >>> count_macs(small, images[:1]) <= 0.5 * count_macs(model, images[:1])
        True
        >>> result = reduce_model(model, 0.5, "lowrank")
        >>> result.allocation.alpha >= 0.5 and all(f.rank is not None for f in result.layers)
        True
    """
    # Checked before the calibration pass, which can take a minute on a large network.
    check_choice("method", method, METHODS)
    check_choice("allocation", allocation, ALLOCATIONS)
    if method != "lowrank" and calibration is None:
        raise ValueError(f"method {method!r} needs calibration samples (unlabeled inputs)")
    path = reduction_path(model, method)
    if path in (ReductionPath.NESTED_CHAIN, ReductionPath.CHAIN):  # ChainReducer reads the nesting itself
        return ChainReducer(model, calibration).reduce(alpha, method, allocation, seed=seed, prune_input=prune_input)
    if path is ReductionPath.TRANSFORMER:
        result = reduce_transformer(model, alpha, method, allocation, calibration, seed)
        return Reduction(result.model, method, result.allocation, [], result.groups)
    if path is ReductionPath.LOWRANK_LAYERS:
        return _lowrank_layers(model, alpha, allocation, calibration, seed)
    return _channel_groups(model, alpha, method, allocation, calibration, seed)  # ReductionPath.CHANNEL_GROUPS


def _lowrank_layers(model: nn.Module, alpha: float, allocation: str, calibration: torch.Tensor | None,
                    seed: int) -> Reduction:
    if not isinstance(calibration, torch.Tensor) or calibration.ndim < 2 or len(calibration) == 0:
        raise ValueError(f"low-rank on a {type(model).__name__}, which is not an nn.Sequential chain, needs example "
                         "inputs to count each layer's output positions: pass calibration= (only its shape is used)")
    result = reduce_lowrank(model, alpha, allocation, calibration, seed)
    rows = []
    for l, (layer, k) in enumerate(zip(result.layers, result.allocation.theta)):
        macs = layer.positions * layer_lowrank_cost(*layer.matrix, k)
        dense = layer.positions * layer.matrix[0] * layer.matrix[1]
        rows.append(LayerFactor(l + 1, *layer.units, None, k, macs, 1 - macs / dense, float(result.curves[l][k]),
                                layer.name))
    return Reduction(result.model, "lowrank", result.allocation, rows)


def _channel_groups(model: nn.Module, alpha: float, method: str, allocation: str, calibration: torch.Tensor,
                    seed: int) -> Reduction:
    try:
        grouped = reduce_grouped(model, alpha, method, allocation, calibration, seed)
    except (TypeError, RuntimeError) as exc:
        if isinstance(model, nn.Sequential):  # meant as a chain, perhaps: say why it is none as well
            nested = nesting(model)
            try:
                check_chain(nested.flat if nested is not None else model)
            except TypeError as chain:  # both readings failed: give both reasons
                raise TypeError(f"{chain}; nor can it be pruned by channel groups: {exc}") from exc
        raise
    return Reduction(grouped.model, method, grouped.allocation, [], grouped.groups)
