"""Pruning and low-rank transforms of ``nn.Sequential`` MLPs (Linear + elementwise activations).

The network is read as the paper's chain ``x_l = Phi_l(W_l x_{l-1} + b_l)`` (eq. 1-2): its
``nn.Linear`` modules are the L weight layers, every other module must act elementwise (so
deleting neuron j of ``x_l`` means deleting row j of ``W_l`` and column j of ``W_{l+1}``). A
``Flatten`` may precede the first Linear; anything may follow the last one (outputs are never
pruned). The result is a new module with physically smaller weights.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .curves import correlated_order, power_order, singular_value_curve

ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid,
               nn.Hardtanh, nn.Softplus, nn.Identity, nn.Dropout)


class KeepFeatures(nn.Module):
    """Selects the kept input neurons ``x_0[..., index]`` of a network whose input was pruned.

    Args:
        index: the kept feature positions, increasing.
    """

    def __init__(self, index: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("index", torch.as_tensor(index, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(-1, self.index)


def linear_indices(model: nn.Module) -> list[int]:
    """Positions of the weight layers in a supported ``nn.Sequential`` MLP.

    Args:
        model: the network.

    Returns:
        Indices of its ``nn.Linear`` children, in order.

    Raises:
        TypeError: not an ``nn.Sequential``, no Linear, or a module between Linears that is not
            elementwise (the message names it and lists what is accepted).
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"expected an nn.Sequential MLP, got {type(model).__name__}")
    children = list(model)
    linears = [i for i, m in enumerate(children) if isinstance(m, nn.Linear)]
    if not linears:
        raise TypeError("the model has no nn.Linear layer to reduce")
    for i, module in enumerate(children[: linears[-1]]):
        allowed = ELEMENTWISE + ((nn.Flatten,) if i < linears[0] else ())
        if not isinstance(module, (nn.Linear, *allowed)):
            accepted = ", ".join(t.__name__ for t in ELEMENTWISE)
            raise TypeError(
                f"module {i} ({type(module).__name__}) sits between weight layers but is not "
                f"elementwise; accepted there: {accepted} (and Flatten before the first Linear)"
            )
    return linears


def widths_of(model: nn.Module) -> list[int]:
    """``[M_0, ..., M_L]`` of a supported MLP."""
    layers = [model[i] for i in linear_indices(model)]
    return [layers[0].in_features] + [layer.out_features for layer in layers]


@dataclass(frozen=True)
class InputStatistics:
    """Mean and covariance of each weight layer's input over the calibration samples (eq. 8-9)."""

    means: list[np.ndarray]
    covariances: list[np.ndarray]
    samples: int


@torch.no_grad()
def input_statistics(model: nn.Module, calibration: torch.Tensor, batch_size: int = 256) -> InputStatistics:
    """Run the calibration samples through ``model`` and accumulate eq. 8-9 per layer input.

    Args:
        model: a supported MLP.
        calibration: N unlabeled inputs in the model's input shape (N >= 2).
        batch_size: samples per forward pass.

    Returns:
        Per layer l = 1..L, ``mu_{l-1}`` and ``C_{l-1}`` (float64, 1/N normalisation as eq. 8).
    """
    if not isinstance(calibration, torch.Tensor) or calibration.ndim < 2 or len(calibration) < 2:
        raise ValueError("calibration must be a tensor of at least 2 samples [N, ...]")
    indices = linear_indices(model)
    sums = [None] * len(indices)
    outer = [None] * len(indices)

    def hook(position: int):
        def record(_module, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            s, o = x.sum(0), x.T @ x
            sums[position] = s if sums[position] is None else sums[position] + s
            outer[position] = o if outer[position] is None else outer[position] + o
        return record

    handles = [model[i].register_forward_pre_hook(hook(p)) for p, i in enumerate(indices)]
    was_training = model.training
    model.eval()
    try:
        for batch in calibration.split(batch_size):
            model(batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    n = len(calibration)
    means = [(s / n).numpy() for s in sums]
    covs = [(o / n).numpy() - np.outer(m, m) for o, m in zip(outer, means)]
    return InputStatistics(means, [(c + c.T) / 2 for c in covs], n)


def prune_orders(stats: InputStatistics, correlated: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer input: the neuron order and J curve (naive eq. 14 or correlation-aware)."""
    choose = correlated_order if correlated else power_order
    return [choose(c) for c in stats.covariances]


def _refit(weight: np.ndarray, bias: np.ndarray, cov: np.ndarray, mean: np.ndarray,
           keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Least squares on the calibration data, in closed form: the best linear estimate of the
    # whole input from the kept part is x ~ mu + C[:, S] C[S, S]^+ (x_S - mu_S), so the layer
    # W x + b becomes W R x_S + b + W (mu - R mu_S) with R = C[:, S] C[S, S]^+.
    # C[S, S] is symmetric PSD, so its pseudo-inverse comes from an eigendecomposition: the same
    # minimum-norm solution and cutoff (|eigenvalue| = singular value <= 1e-10 x the largest is
    # dropped) as SVD-based np.linalg.lstsq, which took about 2 minutes per reduction of a
    # 2,500-wide network on 2 cores (eigh: about 7x less).
    values, vectors = np.linalg.eigh(cov[np.ix_(keep, keep)])
    kept = np.abs(values) > 1e-10 * np.abs(values).max(initial=0.0)
    vectors = vectors[:, kept]
    mapping = ((vectors / values[kept]) @ (vectors.T @ cov[keep, :])).T
    return weight @ mapping, bias + weight @ (mean - mapping @ mean[keep])


def pruned(model: nn.Module, kept: list[int], orders: list[tuple[np.ndarray, np.ndarray]],
           stats: InputStatistics, refit: bool = False) -> nn.Module:
    """A copy of ``model`` keeping ``kept[l]`` input neurons of each weight layer.

    Args:
        model: a supported MLP.
        kept: ``[M~_0, ..., M~_{L-1}]``.
        orders: per layer input, the neuron order (most important first) and its curve.
        stats: the calibration statistics the orders came from.
        refit: refit each layer by least squares on its kept inputs (correlation-aware pruning);
            otherwise delete the columns as the paper does, moving their means into the bias.

    Returns:
        The smaller network (Linear sizes shrunk; a :class:`KeepFeatures` selects the kept
        inputs when input neurons were pruned).
    """
    indices = linear_indices(model)
    means = stats.means
    out = copy.deepcopy(model)
    keeps = [np.sort(order[:k]) for (order, _), k in zip(orders, kept)]
    for l, i in enumerate(indices):
        layer = model[i]
        rows = keeps[l + 1] if l + 1 < len(indices) else np.arange(layer.out_features)
        weight = layer.weight.detach().double().numpy()[rows]
        bias = (layer.bias.detach().double().numpy() if layer.bias is not None
                else np.zeros(layer.out_features))[rows]
        cols = keeps[l]
        if len(cols) == layer.in_features:
            pass
        elif refit:
            weight, bias = _refit(weight, bias, stats.covariances[l], stats.means[l], cols)
        else:
            # Eq. 8 measures power around the mean, so a deleted neuron is replaced by its mean:
            # its constant contribution moves into the bias (a zero-variance neuron costs nothing).
            dropped = np.setdiff1d(np.arange(layer.in_features), cols)
            bias = bias + weight[:, dropped] @ means[l][dropped]
            weight = weight[:, cols]
        has_bias = layer.bias is not None or len(cols) < layer.in_features
        new = nn.Linear(len(cols), len(rows), bias=has_bias, dtype=layer.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(torch.from_numpy(weight))
            if has_bias:
                new.bias.copy_(torch.from_numpy(bias))
        out[i] = new
    if len(keeps[0]) < model[indices[0]].in_features:
        out.insert(indices[0], KeepFeatures(torch.from_numpy(keeps[0])))
    return out


Svd = tuple[np.ndarray, np.ndarray, np.ndarray]


def layer_svds(model: nn.Module) -> list[Svd]:
    """``(U, S, V^T)`` in float64 of every weight layer: eq. 13's curves and the factorised layers
    both read it, so it is computed once per reduction (numpy's LAPACK: torch's first SVD call
    costs seconds of set-up)."""
    return [np.linalg.svd(model[i].weight.detach().double().numpy(), full_matrices=False)
            for i in linear_indices(model)]


def lowrank_curves(svds: list[Svd]) -> list[np.ndarray]:
    """Eq. 13's curve for every weight layer, from :func:`layer_svds` (no data needed)."""
    return [singular_value_curve(s) for _, s, _ in svds]


def factorised(model: nn.Module, ranks: list[int], svds: list[Svd]) -> nn.Module:
    """A copy of ``model`` with each Linear at rank ``k_l`` (SVD, Sec. 2.3).

    A layer at full rank ``K_l`` is kept dense; otherwise it becomes
    ``Sequential(Linear(M_{l-1}, k, bias=False), Linear(k, M_l))`` with weights ``V_k^T`` and
    ``U_k S_k``, i.e. the best rank-k approximation in Frobenius norm. ``svds`` is
    :func:`layer_svds` of ``model``.
    """
    out = copy.deepcopy(model)
    for i, k, svd in zip(linear_indices(model), ranks, svds):
        layer = model[i]
        if k >= min(layer.in_features, layer.out_features):
            continue
        u, s, vt = (torch.from_numpy(a) for a in svd)
        first = nn.Linear(layer.in_features, k, bias=False, dtype=layer.weight.dtype)
        second = nn.Linear(k, layer.out_features, bias=layer.bias is not None, dtype=layer.weight.dtype)
        with torch.no_grad():
            first.weight.copy_(vt[:k])
            second.weight.copy_(u[:, :k] * s[:k])
            if layer.bias is not None:
                second.bias.copy_(layer.bias)
        out[i] = nn.Sequential(first, second)
    return out
