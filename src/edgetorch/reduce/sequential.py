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

Pruning statistics treat every output position of a convolution (and every position of a
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
from scipy.linalg import lapack
from torch import nn

from .curves import correlated_order, power_order, singular_value_curve
from .macs import hooked_eval

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


def _check_chain(model: nn.Module) -> list[int]:
    if not isinstance(model, nn.Sequential) or type(model).forward is not nn.Sequential.forward:
        raise TypeError(
            f"expected an nn.Sequential chain, got {type(model).__name__}, whose forward is its own code: "
            "residual additions, concatenations or branches make it no chain; reduce() prunes such a network "
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
    indices = _check_chain(model)
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


# A convolution's statistics keep at most max(VECTORS_PER_UNIT x channels, MIN_VECTORS) input
# vectors by default (see Moments); below MIN_VECTORS a covariance costs little anyway.
VECTORS_PER_UNIT = 16
MIN_VECTORS = 8192


class Moments:
    """Running sums of one layer input seen as ``[samples, units, positions]``, for eq. 8-9.

    Every position (an output pixel of a convolution, a tap of a flattened group) is a sample of
    the unit vector, so the covariance is between units (channels); shared by the chain and the
    channel-graph paths (:mod:`edgetorch.reduce.grouped`).

    Two things keep the statistics fast and honest:

    * **A cap on a convolution's vectors.** A convolution sees ``N x H x W`` vectors, far more
      than a covariance of ``C`` channels needs, and each costs ``C^2`` multiplications. With
      ``vectors_per_unit`` set, every sample contributes only ``ceil(V / N)`` of its positions,
      drawn at random (seeded), ``V = max(vectors_per_unit x C, MIN_VECTORS)``: about V vectors
      in all. A Linear after a Flatten keeps every position (each has its own mean). On resnet18
      at 224 px (N = 128, ``docs/results/reduce_calibration_cap.md``) the default moved the total
      J at a fixed allocation by 15% (two uncapped calibration sets differ by 2%), and the
      allocation chosen from the capped curves was 0.7% worse on the uncapped ones.
    * **Shrinkage of the covariance towards its diagonal** (Schaefer & Strimmer 2005, target D,
      the Ledoit-Wolf intensity for a diagonal target): ``C_s = (1 - lambda) C + lambda diag(C)``
      with ``lambda = sum_{i != j} Var(c_ij) / sum_{i != j} c_ij^2`` estimated from the same
      vectors (clipped to [0, 1]). With fewer vectors than units the sample covariance is
      singular: a least-squares refit then "explains" every dropped unit and J reaches 0 early,
      which over-prunes silently (issue 13). The shrunk covariance is positive definite, so J
      stays positive, and the refit that reads it is a ridge regression, consistent with J.
      With many vectors ``lambda`` tends to 0 (the sample covariance); the diagonal (the naive
      method's powers) is never changed. ``shrink=False`` keeps the sample covariance (an exact
      linear dependence is then recovered exactly, given more vectors than units).

    Args:
        shared: the consumer shares its weights over the positions (a convolution): its mean is a
            channel mean and its positions may be subsampled.
        samples: calibration samples N that will be added (sets the positions kept per sample).
        vectors_per_unit: cap for a shared consumer (``None``: every position).
        seed: seeds the choice of positions.
        shrink: shrink the covariance towards its diagonal.

    Example:
        >>> moments = Moments(shared=True, samples=len(x))
        >>> moments.add(x.reshape(len(x), x.shape[1], -1))
        >>> mean, cov = moments.finish()
    """

    def __init__(self, shared: bool, samples: int, vectors_per_unit: int | None = VECTORS_PER_UNIT,
                 seed: int = 0, shrink: bool = True) -> None:
        if vectors_per_unit is not None and vectors_per_unit < 1:
            raise ValueError(f"vectors_per_unit must be a positive integer or None, got {vectors_per_unit}")
        self.shared, self.samples, self.vectors_per_unit, self.shrink = shared, samples, vectors_per_unit, shrink
        self.generator = torch.Generator().manual_seed(seed)
        # Everything is accumulated about a provisional centre (the first batch's mean), which
        # keeps E[x x^T] - m m^T free of cancellation; the fourth moments for lambda are taken
        # about it too (a relative error of about 1 / (the first batch's vectors) in lambda).
        self.centre: torch.Tensor | None = None
        self.sums = self.outer = None
        self.fourth = self.squares4 = 0.0  # sum_k ||y_k||^4, sum_k sum_i y_ki^4
        self.count = 0  # vectors for a shared consumer, samples otherwise

    def _subsampled(self, x: torch.Tensor) -> torch.Tensor:
        if not self.shared or self.vectors_per_unit is None:
            return x
        keep = -(-max(self.vectors_per_unit * x.shape[1], MIN_VECTORS) // max(self.samples, 1))
        if keep >= x.shape[2]:
            return x
        picks = torch.rand(x.shape[0], x.shape[2], generator=self.generator).argsort(1)[:, :keep]
        return x.gather(2, picks[:, None, :].expand(-1, x.shape[1], -1))

    def add(self, x: torch.Tensor) -> None:
        """Accumulate a batch ``[N, units, positions]`` (in float64)."""
        x = self._subsampled(x).double()
        if self.shared:  # each position is one more vector of the same channels
            x = x.transpose(1, 2).reshape(-1, x.shape[1], 1)
        if self.centre is None:
            self.centre = x.mean(0)
        y = x - self.centre
        flat = y.transpose(1, 2).reshape(-1, y.shape[1])  # one row per vector
        s, o = y.sum(0), flat.T @ flat  # a matrix product: torch.einsum took a slower path here
        squares = flat.square()
        self.fourth += float(squares.sum(1).square().sum())
        self.squares4 += float(squares.square().sum())
        self.sums = s if self.sums is None else self.sums + s
        self.outer = o if self.outer is None else self.outer + o
        self.count += x.shape[0]

    @property
    def vectors(self) -> int:
        """Unit vectors seen: samples x positions kept (what the covariance is estimated from)."""
        return 0 if self.sums is None else self.count * self.sums.shape[1]

    def finish(self) -> tuple[np.ndarray, np.ndarray, float]:
        """The statistics of everything added.

        Returns:
            ``(means, covariance, lambda)``: means ``[units, positions]`` (``[units, 1]`` for a
            shared consumer), the shrunk covariance ``[units, units]`` (1/N normalisation, eq. 8)
            and the shrinkage intensity used.
        """
        positions, n = self.sums.shape[1], self.vectors
        offset = self.sums / self.count  # mean - centre, [units, positions]
        mean = (self.centre + offset).numpy()
        cov = (self.outer / n - offset @ offset.T / positions).numpy()
        cov = (cov + cov.T) / 2
        shrinkage = diagonal_shrinkage(cov, n, self.fourth, self.squares4) if self.shrink else 0.0
        diagonal = np.diag(cov).copy()
        cov *= 1.0 - shrinkage
        np.fill_diagonal(cov, diagonal)
        return mean, cov, shrinkage


def diagonal_shrinkage(cov: np.ndarray, vectors: int, fourth: float, squares4: float) -> float:
    """Schaefer & Strimmer's (2005) intensity for shrinking a covariance towards its diagonal (target D).

    ``lambda = sum_{i != j} Var(s_ij) / sum_{i != j} s_ij^2`` with ``s = n/(n-1) cov`` and
    ``Var(s_ij) = n / (n-1)^3 sum_k (w_kij - mean_k w_kij)^2``, ``w_kij = y_ki y_kj`` for the
    centred vectors ``y_k``; the sum over ``i != j`` and k of ``w_kij^2`` is
    ``sum_k ||y_k||^4 - sum_k sum_i y_ki^4``, so two scalars carry the fourth moments.

    Args:
        cov: the covariance (1/n normalisation) of the ``vectors`` centred vectors.
        vectors: n.
        fourth, squares4: ``sum_k ||y_k||^4`` and ``sum_k sum_i y_ki^4``.

    Returns:
        lambda in [0, 1] (0 for a diagonal covariance or fewer than 2 vectors).

    Example:
        >>> y = x - x.mean(0)
        >>> diagonal_shrinkage(y.T @ y / len(y), len(y), ((y**2).sum(1)**2).sum(), (y**4).sum())
    """
    off = float(np.sum(cov**2) - np.sum(np.diag(cov) ** 2))
    if vectors < 2 or off <= 0.0:
        return 0.0
    n = float(vectors)
    variance = n / (n - 1) ** 3 * ((fourth - squares4) - n * off)
    return float(np.clip(variance / ((n / (n - 1)) ** 2 * off), 0.0, 1.0))


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
def accumulate_inputs(model: nn.Module, calibration: torch.Tensor, batch_size: int, readers: dict) -> None:
    """Run ``calibration`` through ``model`` in eval mode, batch by batch, handing each module in
    ``readers`` its input (``readers[module](x)``); the model's mode is restored afterwards."""
    handles = [m.register_forward_pre_hook(lambda m, inputs, read=read: read(inputs[0])) for m, read in readers.items()]
    with hooked_eval(model, handles):
        for batch in calibration.split(batch_size):
            model(batch)


@torch.no_grad()
def input_statistics(model: nn.Module, calibration: torch.Tensor, batch_size: int = 256,
                     vectors_per_unit: int | None = VECTORS_PER_UNIT, seed: int = 0,
                     shrink: bool = True) -> InputStatistics:
    """Run the calibration samples through ``model`` and accumulate eq. 8-9 per layer input.

    Args:
        model: a supported network.
        calibration: N unlabeled inputs in the model's input shape (N >= 2).
        batch_size: samples per forward pass.
        vectors_per_unit: cap on a convolution's input vectors per channel (positions are
            subsampled at random); ``None`` keeps every position (:class:`Moments`).
        seed: seeds the subsampling.
        shrink: shrink each covariance towards its diagonal (``False``: the sample covariance).

    Returns:
        Per layer l = 1..L, the means and ``C_{l-1}`` (float64, 1/N normalisation as eq. 8, shrunk
        towards its diagonal).

    Example:
        >>> stats = input_statistics(model, images[:1000])
        >>> [c.shape for c in stats.covariances]
    """
    if not isinstance(calibration, torch.Tensor) or calibration.ndim < 2 or len(calibration) < 2:
        raise ValueError("calibration must be a tensor of at least 2 samples [N, ...]")
    layers = weight_layers(model, calibration)
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


def weight_by_units(module: nn.Module, units_in: int) -> np.ndarray:
    """The weight as ``[outputs, input units, taps]`` (taps: kernel positions, or the inputs of one
    channel after a Flatten), in float64 for the refit."""
    weight = module.weight.detach().double().numpy()
    return weight.reshape(weight.shape[0], units_in, -1)


def _refit(weight: np.ndarray, bias: np.ndarray, cov: np.ndarray, mean: np.ndarray,
           keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Least squares on the calibration data, in closed form: the best linear estimate of every
    # unit from the kept ones is x ~ mu + R (x_S - mu_S) with R = C[:, S] C[S, S]^+, at each
    # position. So W x + b becomes (W R) x_S + b + W (mu - R mu_S), with W R taken over the unit
    # axis of the [outputs, units, taps] weight.
    mapping = _solve_psd(cov[np.ix_(keep, keep)], cov[keep, :]).T  # R: [units, |S|]
    residual = np.broadcast_to(mean - mapping @ mean[keep], weight.shape[1:])  # [units, taps]
    shift = np.tensordot(weight, residual, axes=([1, 2], [0, 1]))
    # (W R) over the unit axis as one matrix product [outputs x taps, units] @ [units, |S|]: numpy's
    # einsum here was a plain loop, and a matmul batched over outputs streams R once per output
    # (minutes each on resnet50 and vgg11_bn).
    outputs, units, taps = weight.shape
    rows = np.ascontiguousarray(weight.transpose(0, 2, 1)).reshape(outputs * taps, units)
    refit = (rows @ mapping).reshape(outputs, taps, len(keep)).transpose(0, 2, 1)
    return np.ascontiguousarray(refit), bias + shift


def _solve_psd(matrix: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """``matrix^+ rhs`` for a symmetric PSD ``matrix``: the minimum-norm least-squares solution.

    A unit without variance (dead on every sample) has a zero row and column: the pseudo-inverse
    gives it weight 0, and the others are solved without it. They are then solved by Cholesky on
    the correlation-scaled system ``(D^-1/2 M D^-1/2) (D^1/2 x) = D^-1/2 rhs``, which is several
    times faster than an eigendecomposition, when LAPACK's estimate of its 1-norm condition number
    (``pocon``, in practice within a factor of 10 of the truth) is below ``1e8 / n``: the units
    are then far from collinear, and the solution is the exact least-squares one. Otherwise the
    eigendecomposition decides, dropping eigenvalues at or below 1e-10 x the largest (the cutoff
    of SVD-based ``np.linalg.lstsq(rcond=1e-10)``, which took minutes on 2,500-wide layers).
    """
    diagonal = np.diag(matrix)
    live = np.flatnonzero(diagonal > 1e-10 * diagonal.max(initial=0.0))
    solution = np.zeros((len(matrix), rhs.shape[1]))
    if len(live) == 0:
        return solution
    scale = 1.0 / np.sqrt(diagonal[live])
    scaled = matrix[np.ix_(live, live)] * scale[:, None] * scale[None, :]
    factor, info = lapack.dpotrf(scaled, lower=1, clean=1)
    if info == 0:
        rcond, info = lapack.dpocon(factor, np.abs(scaled).sum(0).max(), uplo="L")
        if info == 0 and rcond > 1e-8 * len(live):
            solved, info = lapack.dpotrs(factor, rhs[live] * scale[:, None], lower=1)
            if info == 0:
                solution[live] = solved * scale[:, None]
                return solution
    values, vectors = np.linalg.eigh(matrix)
    kept = np.abs(values) > 1e-10 * np.abs(values).max(initial=0.0)
    vectors = vectors[:, kept]
    return (vectors / values[kept]) @ (vectors.T @ rhs)


def _shrunk_weight(module: nn.Module, layer: WeightLayer, rows: np.ndarray, cols: np.ndarray,
                   stats: InputStatistics, position: int, refit: bool) -> tuple[np.ndarray, np.ndarray]:
    weight = weight_by_units(module, layer.units_in)[rows]
    bias = (module.bias.detach().double().numpy() if module.bias is not None
            else np.zeros(layer.units_out))[rows]
    mean = stats.means[position]
    if len(cols) == layer.units_in:
        return weight, bias
    return kept_inputs(weight, bias, stats.covariances[position], mean, cols, refit)


def kept_inputs(weight: np.ndarray, bias: np.ndarray, cov: np.ndarray, mean: np.ndarray, keep: np.ndarray,
                refit: bool) -> tuple[np.ndarray, np.ndarray]:
    """A layer's weight and bias on its kept input units only.

    Args:
        weight: ``[outputs, units, taps]`` (taps: kernel positions or a flattened group).
        bias: ``[outputs]``.
        cov, mean: the input's unit covariance and means (:class:`Moments`).
        keep: kept units, increasing.
        refit: least-squares refit on the kept units (correlation-aware); otherwise the dropped
            units are deleted and their means move into the bias (the paper's naive pruning).

    Returns:
        ``(weight [outputs, len(keep), taps], bias)``.
    """
    if refit:
        return _refit(weight, bias, cov, mean, keep)
    # Eq. 8 measures power around the mean, so a deleted unit is replaced by its mean: its
    # constant contribution moves into the bias (a zero-variance unit costs nothing).
    dropped = np.setdiff1d(np.arange(weight.shape[1]), keep)
    shift = np.tensordot(weight[:, dropped], np.broadcast_to(mean[dropped], weight[:, dropped].shape[1:]),
                         axes=([1, 2], [0, 1]))
    return weight[:, keep], bias + shift


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


Svd = tuple[np.ndarray, np.ndarray, np.ndarray]


class Factored(nn.Sequential):
    """A weight layer at rank ``k``: the thin layer ``V_k^T`` then ``U_k S_k`` (Sec. 2.3).

    A plain ``nn.Sequential`` of the two layers in every respect (same forward, same state-dict
    keys); its own class marks it as one factored layer, so that a checkpoint records it as such
    wherever it sits in a network (:mod:`edgetorch.reduce.checkpoint`).
    """


def svd_of(layer: nn.Module) -> Svd:
    """``(U, S, V^T)`` in float64 of a Linear / Conv2d weight as a ``C_out x C_in k_h k_w`` matrix
    (numpy's LAPACK: torch's first SVD call costs seconds of set-up)."""
    weight = layer.weight.detach().double()
    return np.linalg.svd(weight.reshape(weight.shape[0], -1).numpy(), full_matrices=False)


def layer_svds(model: nn.Module) -> list[Svd]:
    """:func:`svd_of` every weight layer of a chain: eq. 13's curves and the factorised layers both
    read it, so it is computed once per reduction."""
    return [svd_of(model[i]) for i in _check_chain(model)]


def lowrank_curves(svds: list[Svd]) -> list[np.ndarray]:
    """Eq. 13's curve for every weight layer, from :func:`layer_svds` (no data needed)."""
    return [singular_value_curve(s) for _, s, _ in svds]


def factored_like(layer: nn.Module, k: int) -> Factored:
    """The (untrained) :class:`Factored` pair that replaces ``layer`` (a Linear or a ``groups=1``
    Conv2d) at rank ``k``: the thin layer keeps the convolution's kernel, stride, padding and
    dilation, the second is a 1x1 convolution (or a Linear) carrying the bias; built on the current
    default device."""
    outputs, inputs = layer.weight.shape[0], layer.weight[0].numel()
    dtype, has_bias = layer.weight.dtype, layer.bias is not None
    if isinstance(layer, nn.Conv2d):
        return Factored(nn.Conv2d(layer.in_channels, k, layer.kernel_size, layer.stride, layer.padding, layer.dilation,
                                  bias=False, padding_mode=layer.padding_mode, dtype=dtype),
                        nn.Conv2d(k, outputs, 1, bias=has_bias, dtype=dtype))
    return Factored(nn.Linear(inputs, k, bias=False, dtype=dtype), nn.Linear(k, outputs, bias=has_bias, dtype=dtype))


def factor_layer(layer: nn.Module, k: int, svd: Svd) -> nn.Module:
    """``layer`` (a Linear or a ``groups=1`` Conv2d) at rank ``k``, or ``layer`` itself at full rank.

    The pair of :func:`factored_like` with weights ``V_k^T`` and ``U_k S_k``: the best rank-k
    approximation in Frobenius norm, costing ``(M_{l-1} + M_l) k`` multiplications (a convolution:
    ``(C_in k_h k_w + C_out) k`` per output position).

    Args:
        layer: the dense layer.
        k: the rank, 1..min(outputs, inputs); at the full rank the dense layer is kept.
        svd: :func:`svd_of` ``layer``.

    Returns:
        A :class:`Factored` pair, or ``layer`` (not copied) at full rank.

    Example:
        >>> dense = nn.Linear(8, 6)
        >>> factor_layer(dense, 2, svd_of(dense))[0].out_features
        2
    """
    if k >= min(layer.weight.shape[0], layer.weight[0].numel()):
        return layer
    pair = factored_like(layer, k)
    u, s, vt = (torch.from_numpy(a) for a in svd)
    with torch.no_grad():
        pair[0].weight.copy_(vt[:k].reshape(pair[0].weight.shape))
        pair[1].weight.copy_((u[:, :k] * s[:k]).reshape(pair[1].weight.shape))
        if layer.bias is not None:
            pair[1].bias.copy_(layer.bias)
    return pair


def factorised(model: nn.Module, ranks: list[int], svds: list[Svd]) -> nn.Module:
    """A copy of the chain ``model`` with each weight layer at rank ``k_l`` (:func:`factor_layer`).

    ``svds`` is :func:`layer_svds` of ``model``.
    """
    out = copy.deepcopy(model)
    for i, k, svd in zip(_check_chain(model), ranks, svds):
        out[i] = factor_layer(out[i], k, svd)
    return out
