"""The paper's machinery per channel group: pruning any CNN (residual, depthwise, concatenating, SE).

:mod:`edgetorch.reduce.graph` finds the groups of channels that must go together; this module

1. measures, on calibration samples, the covariance of every consumer's input (eq. 8-9, each
   output position a sample, as for the chain's convolutions);
2. gives each group an error curve ``J_g`` (eq. 12-14 generalised). A group read by ``n_g``
   consumer layers counts as those ``n_g`` layers (eq. 12 sums one ``J_l`` per weight layer):
   ``J_g(v) = n_g * tail(v) / head(v)`` over the group's channel energies, where each consumer's
   covariance restricted to the group is normalised by its trace before they are summed, so that
   a consumer with large activations does not outvote the others. With one consumer this is
   exactly eq. 14 (``"prune"``) or the correlation-aware curve of ``prune-ls``; a depthwise
   consumer contributes only its diagonal, since it cannot recover a dropped channel from the
   others (its output channel is dropped with its input);
3. allocates kept channels per group under the MAC budget (``optimal`` / ``pso`` / ``uniform``,
   :func:`edgetorch.reduce.allocation.solve_graph_allocation`);
4. keeps the ``k_g`` first channels of each group's order and rewrites every dense consumer on
   its kept inputs (the dropped channels' means move into its bias, or, for ``prune-ls``, a
   least-squares refit over all of the consumer's kept inputs), then lets Torch-Pruning delete the
   channels from every coupled module. The result is the same model class with smaller
   ``Conv2d`` / ``BatchNorm2d`` / ``Linear`` modules; its MACs are checked against the cost model.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .allocation import Allocation, solve_graph_allocation
from .curves import correlated_order, power_order
from .graph import ChannelGraph, CostTerm, channel_graph
from .graph_problem import make_graph_problem
from .macs import count_macs
from .statistics import VECTORS_PER_UNIT, Moments, accumulate_inputs, kept_inputs, weight_by_units


@dataclass(frozen=True)
class GroupFactor:
    """One channel group of a grouped reduction.

    Attributes:
        group: index in the graph.
        root: the layer whose output channels number the group.
        channels: ``M_g``.
        kept: ``k_g``.
        consumers: layers that read the group (``n_g``).
        error: ``J_g(k_g)``.
    """

    group: int
    root: str
    channels: int
    kept: int
    consumers: int
    error: float


@dataclass(frozen=True)
class GroupStatistics:
    """Means and covariances of every consumer's input, over the calibration samples.

    Attributes:
        inputs: per consumer layer name, ``(means [units, positions or 1], covariance [units, units])``;
            the covariance is shrunk towards its diagonal (:class:`~edgetorch.reduce.statistics.Moments`).
        samples: calibration samples N.
        vectors: per consumer, the input vectors its covariance comes from (samples x positions kept).
        shrinkage: per consumer, the shrinkage intensity lambda applied to its covariance.
    """

    inputs: dict[str, tuple[np.ndarray, np.ndarray]]
    samples: int
    vectors: dict[str, int]
    shrinkage: dict[str, float]


def _as_units(term: CostTerm, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(module, nn.Conv2d):
        return x.reshape(x.shape[0], x.shape[1], -1)
    return x.reshape(-1, term.units_in, term.taps)


@torch.no_grad()
def group_statistics(model: nn.Module, graph: ChannelGraph, calibration: torch.Tensor, batch_size: int = 64,
                     vectors_per_unit: int | None = VECTORS_PER_UNIT, seed: int = 0,
                     shrink: bool = True) -> GroupStatistics:
    """Run the calibration samples through ``model`` and accumulate each consumer's input moments.

    Args:
        model: the model ``graph`` was found on.
        graph: its :class:`~edgetorch.reduce.graph.ChannelGraph`.
        calibration: N >= 2 unlabeled inputs.
        batch_size: samples per forward pass.
        vectors_per_unit: cap on a convolution's input vectors per channel (random positions,
            seeded); ``None`` keeps every position.
        seed: seeds the choice of positions.
        shrink: shrink each covariance towards its diagonal (``False``: the sample covariance).

    Returns:
        The :class:`GroupStatistics`.

    Example:
        >>> graph, _ = channel_graph(model, x[:1])
        >>> stats = group_statistics(model, graph, x)
    """
    names = {c.module for g in graph.groups for c in g.consumers}
    terms = {t.module: t for t in graph.terms if t.module in names}
    modules = dict(model.named_modules())
    moments = {name: Moments(isinstance(modules[name], nn.Conv2d), len(calibration), vectors_per_unit, seed + i, shrink)
               for i, name in enumerate(terms)}
    accumulate_inputs(model, calibration, batch_size,
                      {modules[name]: (lambda x, name=name: moments[name].add(_as_units(terms[name], modules[name], x)))
                       for name in terms})
    finished = {name: m.finish() for name, m in moments.items()}
    return GroupStatistics({name: (mean, cov) for name, (mean, cov, _) in finished.items()}, len(calibration),
                           {name: m.vectors for name, m in moments.items()},
                           {name: s for name, (_, _, s) in finished.items()})


def group_orders(graph: ChannelGraph, stats: GroupStatistics, correlated: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per group: the channel order (most important first) and ``J_g`` for 0..M_g kept (module docstring)."""
    result = []
    for group in graph.groups:
        combined = np.zeros((group.size, group.size))
        for consumer in group.consumers:
            cov = stats.inputs[consumer.module][1][np.ix_(consumer.units, consumer.units)]
            scale = float(np.trace(cov))
            if scale <= 0:  # a consumer that only ever sees constants loses nothing
                continue
            combined += (cov if (correlated and consumer.dense) else np.diag(np.diag(cov))) / scale
        order, curve = (correlated_order if correlated else power_order)(combined)
        result.append((order, curve * max(1, len(group.consumers))))
    return result


@torch.no_grad()
def _rewrite_consumers(model: nn.Module, graph: ChannelGraph, keeps: list[np.ndarray], stats: GroupStatistics,
                       refit: bool) -> None:
    # Each dense consumer computes its weights on its kept inputs while it still has all of them;
    # Torch-Pruning then deletes the dropped input columns (and never reads them again).
    modules = dict(model.named_modules())
    where = {(c.module, g.index): c.units for g in graph.groups for c in g.consumers}
    for term in graph.terms:
        if term.depthwise or not term.inputs:
            continue
        dropped = np.concatenate([np.setdiff1d(where[term.module, g], where[term.module, g][keeps[g]])
                                  for g in term.inputs])
        if len(dropped) == 0:
            continue
        module = modules[term.module]
        keep = np.setdiff1d(np.arange(term.units_in), dropped)
        weight = weight_by_units(module, term.units_in)
        bias = module.bias.detach().double().numpy() if module.bias is not None else np.zeros(weight.shape[0])
        mean, cov = stats.inputs[term.module]
        new_weight, new_bias = kept_inputs(weight, bias, cov, mean, keep, refit)
        weight[:, keep] = new_weight
        module.weight.copy_(torch.from_numpy(weight).reshape(module.weight.shape))
        if module.bias is not None:
            module.bias.copy_(torch.from_numpy(new_bias))
        elif np.any(new_bias != 0):  # the moved means need a bias the layer did not have
            module.bias = nn.Parameter(torch.from_numpy(new_bias).to(module.weight.dtype))


def prune_groups(model: nn.Module, graph: ChannelGraph, dependency, kept: list[int],
                 orders: list[tuple[np.ndarray, np.ndarray]], stats: GroupStatistics, refit: bool) -> nn.Module:
    """Prune ``model`` in place to ``kept[g]`` channels per group (the first of each group's order).

    Args:
        model: the model ``graph`` and ``dependency`` were built on (modified in place).
        graph, dependency: from :func:`~edgetorch.reduce.graph.channel_graph`.
        kept: channels to keep per group.
        orders: per group, the channel order and curve (:func:`group_orders`).
        stats: the calibration statistics the orders came from.
        refit: least-squares refit of the consumers (``prune-ls``) instead of moving means into biases.

    Returns:
        ``model``.
    """
    keeps = [np.sort(order[:k]) for (order, _), k in zip(orders, kept)]
    _rewrite_consumers(model, graph, keeps, stats, refit)
    modules = dict(model.named_modules())
    others = _other_shapes(model)
    for group, keep in zip(graph.groups, keeps):
        if len(keep) == group.size:
            continue
        root = modules[group.root]
        drop = np.setdiff1d(np.arange(group.size), keep).tolist()
        pruner = dependency.get_pruner_of_module(root)
        dependency.get_pruning_group(root, pruner.prune_out_channels, drop).prune()
    for name, shapes in _other_shapes(model).items():
        if shapes != others[name]:
            raise TypeError(f"layer {name!r} ({type(modules[name]).__name__}) was resized with a channel group "
                            f"({others[name]} -> {shapes}); grouped reduction counts and refits only Conv2d, Linear "
                            "and BatchNorm channels, so a network with this layer between them is not supported")
    return model


def _other_shapes(model: nn.Module) -> dict[str, list[tuple[int, ...]]]:
    # Parameters and buffers of layers that are neither weight layers nor batch norms: Torch-Pruning
    # may resize them with a group (a LayerNorm over the last axis taken for channels), which the
    # cost model and the refit know nothing about.
    skip = (nn.Conv2d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d)
    return {name: [tuple(t.shape) for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
            for name, m in model.named_modules() if not isinstance(m, skip)}


@dataclass(frozen=True)
class GroupedReduction:
    """What :func:`reduce_grouped` found and built.

    Attributes:
        model: the smaller model (eval mode).
        method: ``"prune"`` or ``"prune-ls"``.
        allocation: the solver's record (``theta`` = kept channels per group).
        groups: one :class:`GroupFactor` per channel group.
        graph: the groups and cost terms of the full model.
        seconds: wall-clock seconds per stage: ``graph`` (tracing), ``statistics`` (calibration
            passes), ``curves``, ``solver``, ``prune`` (refit and Torch-Pruning) and ``check``
            (counting the reduced model's MACs).
    """

    model: nn.Module
    method: str
    allocation: Allocation
    groups: list[GroupFactor]
    graph: ChannelGraph
    seconds: dict[str, float] = field(default_factory=dict)


def reduce_grouped(model: nn.Module, alpha: float, method: str = "prune", allocation: str = "optimal",
                   calibration: torch.Tensor | None = None, seed: int = 0, time_limit: float = 60.0,
                   vectors_per_unit: int | None = VECTORS_PER_UNIT) -> GroupedReduction:
    """Prune the channel groups of any CNN so that at least ``alpha`` of its multiplications are saved.

    Args:
        model: a trained CNN (residual, depthwise, concatenating, squeeze-excitation ...); not modified.
        alpha: total reduction factor in [0, 1).
        method: ``"prune"`` (naive: channel power, means into biases) or ``"prune-ls"``
            (correlation-aware order, least-squares refit of each consumer).
        allocation: ``"optimal"``, ``"pso"`` or ``"uniform"``.
        calibration: N >= 2 unlabeled inputs ``[N, C, H, W]``.
        seed: PSO seed, and the seed of the calibration positions kept.
        time_limit: seconds for the exact solver's search.
        vectors_per_unit: cap on each convolution's calibration vectors, per input channel (random
            output positions, seeded by ``seed``; see :class:`~edgetorch.reduce.statistics.Moments`);
            ``None`` uses every position.

    Returns:
        The :class:`GroupedReduction`.

    Raises:
        ValueError: bad method/allocation/alpha, no calibration data.
        TypeError: a layer the grouped path cannot handle (named, with the reason).
        ImportError: Torch-Pruning is missing (``pip install 'edgetorch[reduce]'``).

    Example:
        >>> result = reduce_grouped(torchvision.models.resnet18(num_classes=10).eval(), 0.5, calibration=x)
        >>> count_macs(result.model, x[:1]) <= result.allocation.total * 0.5
        True
    """
    if method not in ("prune", "prune-ls"):
        raise ValueError(f"method {method!r} is not available for a network that is not an nn.Sequential chain; "
                         "accepted there: prune, prune-ls (low-rank factoring of grouped networks is not built yet)")
    if not isinstance(calibration, torch.Tensor) or calibration.ndim < 2 or len(calibration) < 2:
        raise ValueError(f"method {method!r} needs calibration samples: a tensor of at least 2 unlabeled inputs")
    seconds, clock = {}, time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        seconds[stage], clock = time.perf_counter() - clock, time.perf_counter()

    reduced = copy.deepcopy(model).eval()
    graph, dependency = channel_graph(reduced, calibration[:1])
    lap("graph")
    stats = group_statistics(reduced, graph, calibration, vectors_per_unit=vectors_per_unit, seed=seed)
    lap("statistics")
    orders = group_orders(graph, stats, correlated=method == "prune-ls")
    lap("curves")
    problem = make_graph_problem(graph, [curve for _, curve in orders], alpha)
    chosen = solve_graph_allocation(problem, method, allocation, seed=seed, time_limit=time_limit)
    lap("solver")
    prune_groups(reduced, graph, dependency, chosen.theta, orders, stats, refit=method == "prune-ls")
    lap("prune")
    macs = count_macs(reduced, calibration[:1])
    lap("check")
    if macs != chosen.cost:  # the cost model and the pruned modules disagree: never ship that silently
        raise RuntimeError(f"the reduced model costs {macs:,} multiplications but the allocation counted "
                           f"{chosen.cost:,}: a layer was pruned differently from its channel group (please report)")
    factors = [GroupFactor(g.index, g.root, g.size, k, len(g.consumers), float(curve[k]))
               for g, k, (_, curve) in zip(graph.groups, chosen.theta, orders)]
    return GroupedReduction(reduced.eval(), method, chosen, factors, graph, seconds)
