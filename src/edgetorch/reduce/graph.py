"""Coupled channel groups of any CNN, and the multiplication count as a function of the kept channels.

Which channels must be pruned together is found by Torch-Pruning's ``DependencyGraph``
(``pip install edgetorch[reduce]``), not by a tracer of our own. Why: it is a maintained library
made for exactly this (it traces the autograd graph of one forward pass and knows residual
additions, depthwise convolutions, ``torch.cat`` offsets, the flatten into a classifier, squeeze
excitation, batch norms and many more ops), and it prunes the coupled modules physically with the
right index bookkeeping. Tried on resnet18/50, mobilenet_v2, efficientnet_b0, densenet121,
squeezenet1_0, vgg11_bn and the zoo's SmallResNet / PlainCNN: every one traced (0.04 s to 1.5 s
at 32x32) into groups that prune to working models. A torch.fx tracer would have to re-learn
all of that (and fx cannot trace data-dependent control flow, which the autograd graph sees
through). What Torch-Pruning does not do, and edgetorch adds (``edgetorch.reduce.grouped``), is the
paper's part: per-group error curves, the budgeted allocation and the least-squares refit.

A *group* is a set of channels that are deleted together: the output channels of one or more
weight layers (several when a residual addition or a multiplication ties them), every per-channel
module on the way (batch norm, depthwise convolution) and the input channels of the layers that
read them (the *consumers*; a Linear after a Flatten reads each channel as ``H W`` inputs, a
consumer after a concatenation reads the group at an offset). The model's last weight layer keeps
its outputs, and the image channels are never a group.

Every weight layer's multiplications (``count_macs``'s count) are then
``s (f_in + sum_{g in inputs} k_g) (k_out or f_out)`` with ``k_g`` the kept channels of group g,
``f`` the channels that belong to no group and ``s`` = kernel area x output positions (x the
flatten taps of a Linear); a depthwise convolution costs ``s k_g``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

WEIGHT_TYPES = (nn.Conv2d, nn.Linear)
# Modules whose channels Torch-Pruning would have to follow but this path does not count or refit.
_REFUSED = {
    nn.Conv1d: "1-d convolution", nn.Conv3d: "3-d convolution", nn.ConvTranspose1d: "transposed convolution",
    nn.ConvTranspose2d: "transposed convolution", nn.ConvTranspose3d: "transposed convolution",
    nn.MultiheadAttention: "attention (heads are not channel groups yet)", nn.LSTM: "recurrent layer",
    nn.GRU: "recurrent layer", nn.RNN: "recurrent layer", nn.Embedding: "embedding",
}


def torch_pruning() -> Any:
    """Import Torch-Pruning, or say how to get it (it is an optional dependency)."""
    try:
        import torch_pruning as tp
    except ImportError as exc:
        raise ImportError(
            "reducing a network that is not an nn.Sequential chain needs Torch-Pruning to find its coupled "
            "channels: pip install 'edgetorch[reduce]' (or pip install 'torch-pruning>=1.6')"
        ) from exc
    return tp


@dataclass(frozen=True)
class Consumer:
    """A weight layer that reads a group's channels as inputs.

    Attributes:
        module: its qualified name in the model.
        units: for each channel of the group (in the group's order), the consumer's input unit that
            carries it (a channel; for a Linear after a Flatten the block of ``taps`` inputs).
        dense: the layer mixes its input units (``groups == 1``), so a least-squares refit of its
            weights can stand in for a dropped one; ``False`` for a depthwise convolution, which
            loses the channel's output with its input.
    """

    module: str
    units: np.ndarray
    dense: bool


@dataclass(frozen=True)
class ChannelGroup:
    """Channels pruned together (see the module docstring).

    Attributes:
        index: position in :attr:`ChannelGraph.groups`.
        size: channels ``M_g``.
        root: the weight layer whose output channels number the group (Torch-Pruning's root).
        producers: weight layers whose outputs are these channels (several after a residual sum).
        consumers: the layers reading them, with where each channel lands in their inputs.
    """

    index: int
    size: int
    root: str
    producers: tuple[str, ...]
    consumers: tuple[Consumer, ...]


@dataclass(frozen=True)
class CostTerm:
    """One weight layer's multiplications per sample, ``scale (fixed_in + sum k[inputs]) (k[output] or fixed_out)``.

    Attributes:
        module: qualified name.
        scale: multiplications per (input unit, output channel) pair: kernel area x output positions
            (a Linear: flatten taps x rows it is applied to).
        inputs: groups whose channels it reads (several after a concatenation).
        fixed_in: input units that belong to no group (image channels).
        output: the group of its output channels, or ``None`` when they are kept (the last layer).
        fixed_out: output channels when ``output`` is ``None``.
        depthwise: a depthwise convolution (input group = output group, cost ``scale k``).
        units_in: input units of the full layer.
        taps: inputs per unit (a Linear after a Flatten: ``H W``; else 1).
    """

    module: str
    scale: int
    inputs: tuple[int, ...]
    fixed_in: int
    output: int | None
    fixed_out: int
    depthwise: bool
    units_in: int
    taps: int

    def macs(self, kept: Sequence[int]) -> int:
        """Multiplications with ``kept[g]`` channels of every group g."""
        out = self.fixed_out if self.output is None else kept[self.output]
        if self.depthwise:
            return self.scale * out
        return self.scale * (self.fixed_in + sum(kept[g] for g in self.inputs)) * out


@dataclass(frozen=True)
class ChannelGraph:
    """The groups of a model and the cost terms of its weight layers.

    Attributes:
        groups: the prunable channel groups.
        terms: one per weight layer, in execution order.
        output_layer: the last weight layer (its outputs are never pruned).
    """

    groups: tuple[ChannelGroup, ...]
    terms: tuple[CostTerm, ...]
    output_layer: str

    @property
    def sizes(self) -> tuple[int, ...]:
        """``M_g`` per group."""
        return tuple(g.size for g in self.groups)

    def cost(self, kept: Sequence[int] | None = None) -> int:
        """Multiplications per sample with ``kept[g]`` channels per group (default: the full model)."""
        kept = self.sizes if kept is None else kept
        return sum(t.macs(kept) for t in self.terms)


def _name_of(model: nn.Module) -> dict[nn.Module, str]:
    return {m: n for n, m in model.named_modules()}


def _refuse_unsupported(model: nn.Module) -> None:
    for name, module in model.named_modules():
        for kind, what in _REFUSED.items():
            if type(module) is kind:
                raise TypeError(f"layer {name!r} ({type(module).__name__}): {what} is not supported by grouped "
                                "channel reduction; supported weight layers are Conv2d and Linear")
        if isinstance(module, nn.Conv2d) and module.groups > 1 and not (
                module.groups == module.in_channels == module.out_channels):
            raise TypeError(f"layer {name!r} (Conv2d, groups={module.groups}): a grouped convolution that is not "
                            "depthwise is not supported yet (its channels would have to be pruned group by group)")


@torch.no_grad()
def _shapes(model: nn.Module, example: torch.Tensor) -> tuple[dict[nn.Module, tuple], list[nn.Module]]:
    """Input/output shapes of every weight layer on one sample, and the order they ran in."""
    shapes: dict[nn.Module, tuple] = {}
    order: list[nn.Module] = []

    def record(module, inputs, output):
        if module in shapes:
            raise TypeError(f"layer {names[module]!r} runs twice per forward pass (a shared layer): its channels "
                            "cannot be pruned for one use only")
        shapes[module] = (tuple(inputs[0].shape), tuple(output.shape))
        order.append(module)

    names = _name_of(model)
    handles = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, WEIGHT_TYPES)]
    try:
        model(example[:1])
    finally:
        for h in handles:
            h.remove()
    return shapes, order


def _scale_and_taps(module: nn.Module, name: str, shape_in: tuple, shape_out: tuple, group_taps: int) -> tuple[int, int]:
    if isinstance(module, nn.Conv2d):
        kernel = module.kernel_size[0] * module.kernel_size[1]
        return kernel * shape_out[-1] * shape_out[-2], 1
    rows = int(np.prod(shape_out[:-1]))  # a Linear applied to [N, ..., F]: once per leading position
    return group_taps * rows, group_taps


def channel_graph(model: nn.Module, example: torch.Tensor) -> tuple[ChannelGraph, Any]:
    """Find the coupled channel groups of ``model`` and its cost terms.

    Args:
        model: any CNN built of Conv2d / Linear layers (torchvision, timm, the zoo), in eval mode.
        example: a batch of inputs (one sample is run).

    Returns:
        ``(graph, dependency_graph)``: the :class:`ChannelGraph`, and Torch-Pruning's
        ``DependencyGraph`` of ``model`` (which prunes it in place).

    Raises:
        ImportError: Torch-Pruning is not installed (the message says how).
        TypeError: a layer this path cannot handle (named, with the reason).

    Example:
        >>> graph, _ = channel_graph(torchvision.models.resnet18(num_classes=10).eval(), torch.rand(1, 3, 32, 32))
        >>> len(graph.groups), graph.output_layer
        (12, 'fc')
    """
    tp = torch_pruning()
    _refuse_unsupported(model)
    names = _name_of(model)
    shapes, order = _shapes(model, example)
    if not order:
        raise TypeError("the model has no nn.Conv2d or nn.Linear layer to reduce")
    last = order[-1]
    try:
        with torch.enable_grad():  # Torch-Pruning traces the autograd graph
            dependency = tp.DependencyGraph().build_dependency(model, example_inputs=example[:1])
    except Exception as exc:  # its tracer fails on some reshapes (shufflenet's channel shuffle)
        raise TypeError(f"Torch-Pruning could not trace which channels of this {type(model).__name__} are coupled "
                        f"({type(exc).__name__}: {exc}); channel shuffles and other channel reshapes are not "
                        "supported") from exc
    groups: list[ChannelGroup] = []
    out_group: dict[nn.Module, int] = {}
    in_groups: dict[nn.Module, list[tuple[int, int, int]]] = {m: [] for m in order}  # (group, channels, taps)
    for group in dependency.get_all_groups(ignored_layers=[last], root_module_types=WEIGHT_TYPES):
        root = group[0].dep.target.module
        size = len(group[0].idxs)
        index = len(groups)
        producers, consumers = [], []
        for item in group:
            module, handler = item.dep.target.module, item.dep.handler
            if not isinstance(module, WEIGHT_TYPES):
                continue
            if module not in shapes:
                raise TypeError(f"layer {names[module]!r} did not run in the forward pass but shares channels with "
                                f"{names[root]!r}; remove it or run it")
            if dependency.is_out_channel_pruning_fn(handler):
                producers.append(names[module])
                out_group[module] = index
                depthwise = isinstance(module, nn.Conv2d) and module.groups > 1
                if depthwise:  # its inputs are the same channels: a consumer that cannot refit
                    consumers.append(Consumer(names[module], np.arange(size), dense=False))
                    in_groups[module].append((index, size, 1))
                continue
            idxs, roots = np.asarray(item.idxs), np.asarray(item.root_idxs)
            if len(idxs) % size or len(np.unique(roots)) != size:
                raise TypeError(f"layer {names[module]!r} reads the channels of {names[root]!r} in a layout this "
                                "path cannot map (not a whole number of inputs per channel)")
            taps = len(idxs) // size
            units = np.empty(size, dtype=np.int64)
            order_in_root = np.argsort(roots, kind="stable")
            units[:] = idxs[order_in_root][::taps] // taps
            consumers.append(Consumer(names[module], units, dense=True))
            in_groups[module].append((index, size, taps))
        groups.append(ChannelGroup(index, size, names[root], tuple(producers), tuple(consumers)))
    terms = []
    for module in order:
        name = names[module]
        reads = in_groups[module]
        taps = {t for _, _, t in reads} or {1}
        if len(taps) > 1:
            raise TypeError(f"layer {name!r} reads groups with different flatten layouts {sorted(taps)}")
        (tap,) = taps
        width_in = module.in_channels if isinstance(module, nn.Conv2d) else module.in_features
        if width_in % tap:
            raise TypeError(f"layer {name!r}: {width_in} inputs are not whole blocks of {tap} per channel")
        units_in = width_in // tap
        scale, tap = _scale_and_taps(module, name, *shapes[module], tap)
        depthwise = isinstance(module, nn.Conv2d) and module.groups > 1
        inputs = tuple(g for g, _, _ in reads)
        fixed_in = units_in - sum(c for _, c, _ in reads)
        output = out_group.get(module)
        fixed_out = module.out_channels if isinstance(module, nn.Conv2d) else module.out_features
        if depthwise and output is None:
            raise TypeError(f"layer {name!r}: a depthwise convolution whose channels no group owns (the model's "
                            "last layer?) is not supported")
        terms.append(CostTerm(name, scale, inputs, fixed_in, output, fixed_out, depthwise, units_in, tap))
    return ChannelGraph(tuple(groups), tuple(terms), names[last]), dependency
