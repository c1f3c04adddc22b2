"""What every reduction path measures and refits with: second moments of a layer's input units
(:class:`Moments`, with shrinkage when vectors are few), and the least-squares refit of the next
layer on the inputs a pruning keeps (:func:`kept_inputs`, the paper's eq. 8-9).

The chain path (:mod:`.sequential`), the channel-graph path (:mod:`.grouped`) and the transformer
path (:mod:`.transformer`) all use these, so a statistic means the same thing everywhere.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.linalg import lapack
from torch import nn

from .macs import hooked_eval

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


@torch.no_grad()
def accumulate_inputs(model: nn.Module, calibration: torch.Tensor, batch_size: int, readers: dict) -> None:
    """Run ``calibration`` through ``model`` in eval mode, batch by batch, handing each module in
    ``readers`` its input (``readers[module](x)``); the model's mode is restored afterwards."""
    handles = [m.register_forward_pre_hook(lambda m, inputs, read=read: read(inputs[0])) for m, read in readers.items()]
    with hooked_eval(model, handles):
        for batch in calibration.split(batch_size):
            model(batch)


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
