"""Per-layer error curves J_l (eq. 13, 14) and the neuron orders they belong to."""

from __future__ import annotations

import numpy as np
from scipy.linalg import lapack


def tail_over_head(energies: np.ndarray) -> np.ndarray:
    """``J(v) = sum_{i > v} e_i / sum_{i <= v} e_i`` for ``v = 0..n`` (``e`` sorted decreasing).

    Index 0 is ``inf`` (keeping nothing is never a choice). Where nothing is lost the error is 0,
    also when what is kept has zero energy (an all-zero input: nothing to lose).

    Args:
        energies: non-negative values in decreasing order (powers or squared singular values).

    Returns:
        ``n + 1`` float64 values.
    """
    energies = np.clip(np.asarray(energies, dtype=np.float64), 0.0, None)
    kept = np.cumsum(energies)
    lost = kept[-1] - kept
    lost[lost < 1e-12 * max(kept[-1], 1e-300)] = 0.0  # cancellation noise, not lost energy
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(lost == 0.0, 0.0, lost / kept)
    return np.concatenate([[np.inf], ratio])


def singular_value_curve(sigma: np.ndarray) -> np.ndarray:
    """Eq. 13: error of keeping the top-k of a weight's singular values ``sigma`` (decreasing), k = 0..len."""
    return tail_over_head(np.asarray(sigma, dtype=np.float64) ** 2)


def power_order(cov: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Naive pruning (Sec. 2.2): neurons by decreasing power (diagonal of C), and eq. 14's curve.

    Args:
        cov: the input covariance ``C_{l-1}`` (eq. 8).

    Returns:
        ``(order, curve)``: neuron indices, most powerful first, and J for 0..n kept.
    """
    power = np.clip(np.diag(cov), 0.0, None)
    order = np.argsort(-power, kind="stable")
    return order, tail_over_head(power[order])


def correlated_order(cov: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Correlation-aware pruning: greedy selection by pivoted Cholesky of C, and its error curve.

    Each step keeps the neuron with the largest variance *not explained linearly* by those already
    kept (the paper's suggested improvement, Sec. 4: a neuron highly correlated with kept ones can
    go even if its power is high). After keeping the first ``v``, the variance left over in the
    whole layer input is the trace of the Schur complement, ``sum_{k >= v} ||L[:, k]||^2``, so
    ``J(v)`` is that over the explained rest: eq. 14 with conditional variances. For a diagonal C
    it is exactly eq. 14.

    Args:
        cov: the input covariance ``C_{l-1}``.

    Returns:
        ``(order, curve)`` as in :func:`power_order`.
    """
    cov = np.asarray(cov, dtype=np.float64)
    n = len(cov)
    factor, piv, rank, info = lapack.dpstrf(cov, lower=1, tol=-1.0)
    if info < 0:
        raise ValueError(f"pivoted Cholesky rejected the covariance (LAPACK info {info})")
    lower = np.tril(factor)
    lower[:, rank:] = 0.0  # beyond the numerical rank nothing is left to explain
    order = piv[:n] - 1  # LAPACK pivots are 1-based
    column_energy = np.sum(lower**2, axis=0)
    return order, tail_over_head(column_energy)
