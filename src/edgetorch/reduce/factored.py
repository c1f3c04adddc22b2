"""Low-rank factoring of one weight layer (Sec. 2.3 of the paper): its SVD, eq. 13's error curve,
and the :class:`Factored` pair (``V_k^T`` then ``U_k S_k``) that replaces it at rank ``k``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .curves import singular_value_curve

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
