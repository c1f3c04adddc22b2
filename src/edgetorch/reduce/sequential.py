"""Pruning and low-rank transforms of ``nn.Sequential`` networks: MLPs (the paper) and plain CNNs.

The network is read as the paper's chain ``x_l = Phi_l(W_l x_{l-1} + b_l)`` (eq. 1-2). Its weight
layers are the ``nn.Linear`` and ``nn.Conv2d`` (``groups=1``) children. Between two of them only
modules that act on each *unit* separately may sit, so deleting unit j of ``x_l`` means deleting
output j of ``W_l`` and input j of ``W_{l+1}``:

* elementwise activations and dropout (units are neurons or channels);
* per-channel modules: ``BatchNorm1d/2d`` (its entries are deleted with the channel), pooling,
  ``Dropout2d``;
* one ``Flatten`` from convolutions to Linear layers. The Linear's units are then the channels,
  each feeding ``H x W`` of its inputs (the *group*), so a pruned channel takes its whole group.

A ``Flatten`` may precede the first weight layer (the paper's MLP on images: the pixels are the
units); anything may follow the last one (outputs are never pruned). The result is a new module
with physically smaller weights.

Pruning statistics (:mod:`.statistics`, shared with the graph and transformer paths) treat every
output position of a convolution (and every position of a
flattened group) as a sample of the unit vector, so ``C_{l-1}`` (eq. 8) is the channel covariance.
A Linear keeps one weight per position, so its bias absorbs each deleted input's *per-position*
mean; a convolution shares its weights, so only the channel mean can move into its bias. That is
exact away from the border and an approximation where zero padding enters the kernel.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .curves import correlated_order, power_order
from .factored import Svd, factor_layer, svd_of
from .macs import hooked_eval
from .statistics import VECTORS_PER_UNIT, Moments, accumulate_inputs, kept_inputs, weight_by_units

ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid,
               nn.Hardtanh, nn.Softplus, nn.Identity, nn.Dropout)
PER_CHANNEL = (nn.BatchNorm1d, nn.BatchNorm2d, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d,
               nn.AdaptiveMaxPool2d, nn.Dropout2d)
WEIGHT_LAYERS = (nn.Linear, nn.Conv2d)


class KeepFeatures(nn.Module):
    """Selects the kept input units ``x.index_select(dim, index)`` of a network whose input was pruned.

    Args:
        index: the kept positions, increasing.
        dim: the unit dimension (-1 for features, 1 for image channels).
    """

    def __init__(self, index: torch.Tensor, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("index", torch.as_tensor(index, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(self.dim, self.index)


@dataclass(frozen=True)
class WeightLayer:
    """One weight layer of a supported network, in units (neurons or channels).

    Attributes:
        index: its position in the ``nn.Sequential``.
        units_in, units_out: ``M_{l-1}`` and ``M_l`` (features, or channels of a convolution and
            of a Linear after a Flatten).
        group: inputs per input unit of a Linear (``H W`` after a Flatten of convolution
            channels, else 1).
        kernel: kernel area of a convolution (1 for a Linear).
        positions: output positions per sample (``H_out W_out`` of a convolution, 1 for a Linear).
        between: positions of the per-channel modules with parameters (batch norm) that act on
            this layer's outputs before the next weight layer; they shrink with its outputs.
    """

    index: int
    units_in: int
    units_out: int
    group: int
    kernel: int
    positions: int
    between: tuple[int, ...]

    @property
    def scale(self) -> int:
        """Multiplications per (input unit, output unit) pair: ``s_l`` of the pruning problem."""
        return self.group * self.kernel * self.positions

    @property
    def matrix(self) -> tuple[int, int]:
        """``(m_in, m_out)`` of the weight as a matrix (a convolution's is ``C_in k_h k_w x C_out``)."""
        return self.units_in * self.group * self.kernel, self.units_out


def check_chain(model: nn.Module) -> list[int]:
    if not isinstance(model, nn.Sequential) or type(model).forward is not nn.Sequential.forward:
        raise TypeError(
            f"expected an nn.Sequential chain, got {type(model).__name__}, whose forward is its own code: "
            "residual additions, concatenations or branches make it no chain; reduce_model() prunes such a network "
            "by channel groups and factors its layers one by one (low-rank)")
    children = list(model)
    weights = [i for i, m in enumerate(children) if isinstance(m, WEIGHT_LAYERS)]
    if not weights:
        raise TypeError("the model has no nn.Linear or nn.Conv2d layer to reduce")
    flattened = grouped = False  # grouped: between a convolution's Flatten and the next Linear
    last_weight: nn.Module | None = None
    for i, module in enumerate(children[: weights[-1]]):
        if isinstance(module, nn.Conv2d) and (module.groups != 1 or flattened):
            raise TypeError(f"module {i} (Conv2d) is grouped or follows the Flatten; only plain "
                            "convolutions before the Linear layers are supported")
        if isinstance(module, WEIGHT_LAYERS) or isinstance(module, ELEMENTWISE):
            grouped = grouped and not isinstance(module, nn.Linear)
            last_weight = module if isinstance(module, WEIGHT_LAYERS) else last_weight
            continue
        if isinstance(module, nn.Flatten) and not flattened and not isinstance(last_weight, nn.Linear):
            flattened = True
            grouped = last_weight is not None
            continue
        # There a channel spans many features: a per-feature module (BatchNorm1d) cannot shrink with it.
        if isinstance(module, PER_CHANNEL) and weights[0] < i and not grouped:
            continue
        accepted = ", ".join(t.__name__ for t in (*ELEMENTWISE, *PER_CHANNEL))
        raise TypeError(
            f"module {i} ({type(module).__name__}) sits between weight layers but does not act on "
            f"each unit separately; accepted there: {accepted}, and one Flatten (before the first "
            "weight layer or from convolutions to Linear layers)"
        )
    return weights


@torch.no_grad()
def weight_layers(model: nn.Module, example: torch.Tensor | None = None) -> list[WeightLayer]:
    """The weight layers of a supported network, with the sizes the cost model needs.

    Args:
        model: an ``nn.Sequential`` (see the module docstring for what it may hold).
        example: a batch of inputs; needed only when the network has convolutions (their output
            positions depend on the image size).

    Returns:
        One :class:`WeightLayer` per Linear / Conv2d, in order.

    Raises:
        TypeError: an unsupported architecture (the message names the module and what is accepted).
        ValueError: a convolutional network without ``example``.
    """
    indices = check_chain(model)
    children = list(model)
    shapes: dict[int, tuple[torch.Size, torch.Size]] = {}
    if any(isinstance(children[i], nn.Conv2d) for i in indices):
        if not isinstance(example, torch.Tensor) or example.ndim < 2 or len(example) == 0:
            raise ValueError("a convolutional network needs example inputs [N, C, H, W] to size its layers")
        handles = [children[i].register_forward_hook(
            lambda m, inp, out, i=i: shapes.__setitem__(i, (inp[0].shape, out.shape))) for i in indices]
        with hooked_eval(model, handles):
            model(example[:1])
    layers, previous_channels = [], None
    for n, i in enumerate(indices):
        module = children[i]
        end = indices[n + 1] if n + 1 < len(indices) else i + 1
        between = tuple(j for j in range(i + 1, end) if isinstance(children[j], (nn.BatchNorm1d, nn.BatchNorm2d)))
        if isinstance(module, nn.Conv2d):
            out_shape = shapes[i][1]
            kernel = module.kernel_size[0] * module.kernel_size[1]
            layers.append(WeightLayer(i, module.in_channels, module.out_channels, 1, kernel,
                                      out_shape[-1] * out_shape[-2], between))
            previous_channels = module.out_channels
        else:
            group = 1
            if previous_channels is not None:  # a Linear fed by flattened convolution channels
                if module.in_features % previous_channels:
                    raise TypeError(f"module {i} (Linear) takes {module.in_features} inputs, not a multiple "
                                    f"of the {previous_channels} channels before the Flatten")
                group = module.in_features // previous_channels
            layers.append(WeightLayer(i, module.in_features // group, module.out_features, group, 1, 1, between))
            previous_channels = None
    return layers


def widths_of(layers: list[WeightLayer]) -> list[int]:
    """``[M_0, ..., M_L]`` of a network's :func:`weight_layers`, in units (the pruning chain)."""
    return [layers[0].units_in] + [layer.units_out for layer in layers]


def _units(layer: WeightLayer, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A layer input as ``[samples, units, positions]`` (positions: spatial or flattened group)."""
    if isinstance(module, nn.Conv2d):
        return x.reshape(x.shape[0], x.shape[1], -1)
    return x.reshape(-1, layer.units_in, layer.group)


@dataclass(frozen=True)
class InputStatistics:
    """Unit means and covariance of each weight layer's input over the calibration samples (eq. 8-9).

    Attributes:
        layers: the :func:`weight_layers` the statistics belong to.
        means: per layer ``[M_{l-1}, group]``: each input's mean (per position of a flattened
            group; a convolution's are channel means, ``group = 1``).
        covariances: per layer ``C_{l-1}``, ``[M_{l-1}, M_{l-1}]``, centred on ``means`` and shrunk
            towards its diagonal (:class:`Moments`).
        samples: calibration samples N.
        shrinkage: per layer, the shrinkage intensity lambda applied to its covariance.
    """

    layers: list[WeightLayer]
    means: list[np.ndarray]
    covariances: list[np.ndarray]
    samples: int
    shrinkage: list[float]


@torch.no_grad()
def input_statistics(model: nn.Module, calibration: torch.Tensor, batch_size: int = 256,
                     vectors_per_unit: int | None = VECTORS_PER_UNIT, seed: int = 0,
                     shrink: bool = True, layers: list[WeightLayer] | None = None) -> InputStatistics:
    """Run the calibration samples through ``model`` and accumulate eq. 8-9 per layer input.

    Args:
        model: a supported network.
        calibration: N unlabeled inputs in the model's input shape (N >= 2).
        batch_size: samples per forward pass.
        vectors_per_unit: cap on a convolution's input vectors per channel (positions are
            subsampled at random); ``None`` keeps every position (:class:`Moments`).
        seed: seeds the subsampling.
        shrink: shrink each covariance towards its diagonal (``False``: the sample covariance).
        layers: ``model``'s :func:`weight_layers` where the caller has them (sizing a convolutional
            network runs it once more).

    Returns:
        Per layer l = 1..L, the means and ``C_{l-1}`` (float64, 1/N normalisation as eq. 8, shrunk
        towards its diagonal).

    Example:
        >>> stats = input_statistics(model, images[:1000])
        >>> [c.shape for c in stats.covariances]
    """
    if not isinstance(calibration, torch.Tensor) or calibration.ndim < 2 or len(calibration) < 2:
        raise ValueError("calibration must be a tensor of at least 2 samples [N, ...]")
    layers = layers if layers is not None else weight_layers(model, calibration)
    moments = [Moments(isinstance(model[layer.index], nn.Conv2d), len(calibration), vectors_per_unit, seed + p, shrink)
               for p, layer in enumerate(layers)]

    accumulate_inputs(model, calibration, batch_size,
                      {model[layer.index]: (lambda x, p=p: moments[p].add(_units(layers[p], model[layers[p].index], x)))
                       for p, layer in enumerate(layers)})
    finished = [m.finish() for m in moments]
    return InputStatistics(layers, [m for m, _, _ in finished], [c for _, c, _ in finished], len(calibration),
                           [s for _, _, s in finished])


def prune_orders(stats: InputStatistics, correlated: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer input: the unit order and J curve (naive eq. 14 or correlation-aware)."""
    choose = correlated_order if correlated else power_order
    return [choose(c) for c in stats.covariances]


def _shrunk_weight(module: nn.Module, layer: WeightLayer, rows: np.ndarray, cols: np.ndarray,
                   stats: InputStatistics, position: int, refit: bool) -> tuple[np.ndarray, np.ndarray]:
    weight = weight_by_units(module, layer.units_in)[rows]
    bias = (module.bias.detach().double().numpy() if module.bias is not None
            else np.zeros(layer.units_out))[rows]
    mean = stats.means[position]
    if len(cols) == layer.units_in:
        return weight, bias
    return kept_inputs(weight, bias, stats.covariances[position], mean, cols, refit)


def _rebuilt(module: nn.Module, weight: np.ndarray, bias: np.ndarray, has_bias: bool) -> nn.Module:
    outputs, units = weight.shape[:2]
    if isinstance(module, nn.Conv2d):
        new: nn.Module = nn.Conv2d(units, outputs, module.kernel_size, module.stride, module.padding,
                                   module.dilation, bias=has_bias, padding_mode=module.padding_mode,
                                   dtype=module.weight.dtype)
    else:
        new = nn.Linear(units * weight.shape[2], outputs, bias=has_bias, dtype=module.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight)).reshape(new.weight.shape))
        if has_bias:
            new.bias.copy_(torch.from_numpy(bias))
    return new


def _shrink_norm(norm: nn.Module, keep: np.ndarray) -> nn.Module:
    new = copy.deepcopy(norm)
    index = torch.from_numpy(keep)
    for name in ("weight", "bias", "running_mean", "running_var"):
        tensor = getattr(norm, name)
        if tensor is not None:
            kept = tensor.detach().index_select(0, index).clone()
            if isinstance(tensor, nn.Parameter):
                setattr(new, name, nn.Parameter(kept, requires_grad=tensor.requires_grad))
            else:
                setattr(new, name, kept)
    new.num_features = len(keep)
    return new


def pruned(model: nn.Module, kept: list[int], orders: list[tuple[np.ndarray, np.ndarray]],
           stats: InputStatistics, refit: bool = False) -> nn.Module:
    """A copy of ``model`` keeping ``kept[l]`` input units of each weight layer.

    Args:
        model: a supported network.
        kept: ``[M~_0, ..., M~_{L-1}]``.
        orders: per layer input, the unit order (most important first) and its curve.
        stats: the calibration statistics the orders came from.
        refit: refit each layer by least squares on its kept inputs (correlation-aware pruning);
            otherwise delete the inputs as the paper does, moving their means into the bias.

    Returns:
        The smaller network (weight layers and batch norms shrunk; a :class:`KeepFeatures`
        selects the kept inputs when input units were pruned).
    """
    layers = stats.layers
    out = copy.deepcopy(model)
    keeps = [np.sort(order[:k]) for (order, _), k in zip(orders, kept)]
    for l, layer in enumerate(layers):
        module = model[layer.index]
        rows = keeps[l + 1] if l + 1 < len(layers) else np.arange(layer.units_out)
        cols = keeps[l]
        weight, bias = _shrunk_weight(module, layer, rows, cols, stats, l, refit)
        has_bias = module.bias is not None or len(cols) < layer.units_in
        out[layer.index] = _rebuilt(module, weight, bias, has_bias)
        for j in layer.between:
            out[j] = _shrink_norm(model[j], rows)
    first = layers[0]
    if len(keeps[0]) < first.units_in:
        dim = 1 if isinstance(model[first.index], nn.Conv2d) else -1
        out.insert(first.index, KeepFeatures(torch.from_numpy(keeps[0]), dim))
    return out


def layer_svds(model: nn.Module) -> list[Svd]:
    """:func:`svd_of` every weight layer of a chain: eq. 13's curves and the factorised layers both
    read it, so it is computed once per reduction."""
    return [svd_of(model[i]) for i in check_chain(model)]


def factorised(model: nn.Module, ranks: list[int], svds: list[Svd]) -> nn.Module:
    """A copy of the chain ``model`` with each weight layer at rank ``k_l`` (:func:`factor_layer`).

    ``svds`` is :func:`layer_svds` of ``model``.
    """
    out = copy.deepcopy(model)
    for i, k, svd in zip(check_chain(model), ranks, svds):
        out[i] = factor_layer(out[i], k, svd)
    return out
