"""``reduce_model``: a trained network in, a physically smaller one out, at a total multiplication budget."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import torch
from torch import nn

from .._checks import check_choice
from .allocation import ALLOCATIONS, Allocation, solve_allocation
from .factored import lowrank_curves
from .grouped import GroupFactor, reduce_grouped
from .lowrank import reduce_lowrank
from .nested import nesting
from .problem import METHODS, budget_for, layer_lowrank_cost, prune_cost
from .sequential import (WeightLayer, check_chain, factorised, input_statistics, layer_svds, prune_orders, pruned,
                         weight_layers, widths_of)
from .transformer import reduce_transformer
from .transformer_blocks import is_transformer


@dataclass(frozen=True)
class LayerFactor:
    """One weight layer of the reduction.

    Attributes:
        layer: weight layer number l (1-based, as in the paper).
        in_features, out_features: ``M_{l-1}``, ``M_l`` of the full layer, in units (features,
            or channels of a convolution and of a Linear after a convolution's Flatten).
        kept_inputs: ``M~_{l-1}`` (pruning) -- ``None`` for low-rank.
        rank: ``k_l`` (low-rank; ``K_l`` means kept dense) -- ``None`` for pruning.
        macs: multiplications of the reduced layer per sample.
        alpha: the layer's reduction factor ``1 - macs / full macs`` (eq. 5, 6, 10).
        error: ``J_l`` at the chosen value.
        name: the layer's qualified name in the model (``"3"``, ``"classifier.1"``, ``"layer1.0.conv1"``).
    """

    layer: int
    in_features: int
    out_features: int
    kept_inputs: int | None
    rank: int | None
    macs: int
    alpha: float
    error: float
    name: str = ""


@dataclass(frozen=True)
class Reduction:
    """The reduced model with its allocation and per-layer factors.

    Attributes:
        model: the smaller model (eval mode).
        method: one of :data:`METHODS`.
        allocation: the solver's record.
        layers: one :class:`LayerFactor` per weight layer of a chain, or per factorable layer of any
            other network under low-rank (empty for a grouped reduction).
        groups: one :class:`~edgetorch.reduce.grouped.GroupFactor` per channel group of a network
            that is not a chain (empty for a chain), in the order of ``allocation.theta``.
    """

    model: nn.Module
    method: str
    allocation: Allocation
    layers: list[LayerFactor]
    groups: list[GroupFactor] = field(default_factory=list)


def is_chain(model: nn.Module) -> bool:
    """Whether ``model`` is an ``nn.Sequential`` chain the layer-by-layer path takes (:mod:`.sequential`);
    :func:`reduction_path` sends any other network elsewhere."""
    if not isinstance(model, nn.Sequential):
        return False
    try:
        check_chain(model)
    except TypeError:
        return False
    return True


def layer_factors(layers: list[WeightLayer], allocation: Allocation, curves) -> list[LayerFactor]:
    """Each weight layer's kept inputs or rank, MACs, ``alpha_l`` and ``J_l`` under ``allocation``.

    Args:
        layers: the network's :func:`~edgetorch.reduce.sequential.weight_layers`.
        allocation: the solver's result (its ``theta`` and ``method``).
        curves: the ``J_l`` curves the allocation was solved on.
    """
    theta, rows = allocation.theta, []
    kept = theta + [layers[-1].units_out]
    lowrank = allocation.method == "lowrank"  # "prune" and "prune-ls" share the pruning layout
    for l, layer in enumerate(layers):
        if lowrank:
            macs, value = layer.positions * layer_lowrank_cost(*layer.matrix, theta[l]), theta[l]
        else:
            macs, value = layer.scale * kept[l] * kept[l + 1], kept[l]
        rows.append(LayerFactor(
            l + 1, layer.units_in, layer.units_out, None if lowrank else value, value if lowrank else None, macs,
            1 - macs / (layer.scale * layer.units_in * layer.units_out), float(curves[l][value]), str(layer.index),
        ))
    return rows


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


@dataclass(frozen=True)
class _Request:
    """:func:`reduce_model`'s arguments past the model, validated; each path reads what it needs."""

    alpha: float
    method: str
    allocation: str
    calibration: torch.Tensor | None
    seed: int
    prune_input: bool


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

    The network goes down the path :func:`reduction_path` names for it.

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
    request = _Request(alpha, method, allocation, calibration, seed, prune_input)
    return _PATHS[reduction_path(model, method)](model, request)


def _chain(model: nn.Module, request: _Request) -> Reduction:
    method, allocation, seed = request.method, request.allocation, request.seed
    if method == "lowrank":
        try:
            layers = weight_layers(model, request.calibration)
        except ValueError as exc:  # a convolutional network needs an input size even for low-rank
            raise ValueError(f"{exc}: pass calibration= (for low-rank only its shape is used)") from None
        svds = layer_svds(model)
        curves = lowrank_curves(svds)
        chosen = solve_allocation(curves, None, request.alpha, method, allocation, seed=seed,
                                  shapes=[layer.matrix for layer in layers],
                                  scales=[layer.positions for layer in layers])
        reduced = factorised(model, chosen.theta, svds)
    else:
        stats = input_statistics(model, request.calibration)
        layers = stats.layers
        orders = prune_orders(stats, correlated=method == "prune-ls")
        curves = [curve for _, curve in orders]
        chosen = _prune_allocation(curves, widths_of(layers), [layer.scale for layer in layers], request.alpha,
                                   method, allocation, seed, request.prune_input)
        reduced = pruned(model, chosen.theta, orders, stats, refit=method == "prune-ls")
    return Reduction(reduced.eval(), method, chosen, layer_factors(layers, chosen, curves))


def _prune_allocation(curves: list, widths: list[int], scales: list[int], alpha: float, method: str,
                      allocation: str, seed: int, prune_input: bool) -> Allocation:
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
                                    seed=seed, scales=fixed_scales)
            return dataclasses.replace(kept, theta=[widths[0], *kept.theta[1:]])
    return solve_allocation(curves, widths, alpha, method, allocation, seed=seed, scales=scales)


def _nested_chain(model: nn.Module, request: _Request) -> Reduction:
    nested = nesting(model)
    flat = _chain(nested.flat, request)
    return dataclasses.replace(flat, model=nested.nest(flat.model).eval(),
                               layers=[dataclasses.replace(f, name=nested.names[int(f.name)]) for f in flat.layers])


def _transformer(model: nn.Module, request: _Request) -> Reduction:
    result = reduce_transformer(model, request.alpha, request.method, request.allocation, request.calibration,
                                request.seed)
    return Reduction(result.model, request.method, result.allocation, [], result.groups)


def _lowrank_layers(model: nn.Module, request: _Request) -> Reduction:
    calibration = request.calibration
    if not isinstance(calibration, torch.Tensor) or calibration.ndim < 2 or len(calibration) == 0:
        raise ValueError(f"low-rank on a {type(model).__name__}, which is not an nn.Sequential chain, needs example "
                         "inputs to count each layer's output positions: pass calibration= (only its shape is used)")
    result = reduce_lowrank(model, request.alpha, request.allocation, calibration, request.seed)
    rows = []
    for l, (layer, k) in enumerate(zip(result.layers, result.allocation.theta)):
        macs = layer.positions * layer_lowrank_cost(*layer.matrix, k)
        dense = layer.positions * layer.matrix[0] * layer.matrix[1]
        rows.append(LayerFactor(l + 1, *layer.units, None, k, macs, 1 - macs / dense, float(result.curves[l][k]),
                                layer.name))
    return Reduction(result.model, "lowrank", result.allocation, rows)


def _channel_groups(model: nn.Module, request: _Request) -> Reduction:
    try:
        grouped = reduce_grouped(model, request.alpha, request.method, request.allocation, request.calibration,
                                 request.seed)
    except (TypeError, RuntimeError) as exc:
        if isinstance(model, nn.Sequential):  # meant as a chain, perhaps: say why it is none as well
            nested = nesting(model)
            try:
                check_chain(nested.flat if nested is not None else model)
            except TypeError as chain:  # both readings failed: give both reasons
                raise TypeError(f"{chain}; nor can it be pruned by channel groups: {exc}") from exc
        raise
    return Reduction(grouped.model, request.method, grouped.allocation, [], grouped.groups)


# What each path runs (the rule that picks one is reduction_path's).
_PATHS = {
    ReductionPath.NESTED_CHAIN: _nested_chain,
    ReductionPath.CHAIN: _chain,
    ReductionPath.TRANSFORMER: _transformer,
    ReductionPath.LOWRANK_LAYERS: _lowrank_layers,
    ReductionPath.CHANNEL_GROUPS: _channel_groups,
}
