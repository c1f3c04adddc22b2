"""Multiplication counting as the paper does it (footnote 1: weights only; no bias, no activation)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


@contextmanager
def hooked_eval(model: nn.Module, handles: list[RemovableHandle]) -> Iterator[nn.Module]:
    """``model`` in eval mode while the hooks in ``handles`` stay registered; on exit the hooks are
    removed and the model's mode restored, even if the forward pass raised.

    Args:
        model: the network the hooks were registered on.
        handles: what ``register_forward_hook`` / ``register_forward_pre_hook`` returned.

    Example:
        >>> with hooked_eval(model, [layer.register_forward_hook(record)]):
        ...     model(x)
    """
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)


@torch.no_grad()
def count_macs(model: nn.Module, example: torch.Tensor) -> int:
    """Multiplications per sample of one forward pass through ``model``.

    Counts ``nn.Linear`` (``in * out`` per row it is applied to), ``nn.Conv1d/2d/3d``
    (output elements times ``in/groups * kernel volume``) and ``nn.ConvTranspose1d/2d/3d`` (input
    elements times ``out/groups * kernel volume``: each input value is scattered through the
    whole kernel, as BottleFit's downsampled decoders do); biases, normalisation and
    activations are not multiplications of weights and are left out, as in the paper.

    Args:
        model: any module.
        example: a batch of inputs; the count is divided by its first dimension.

    Returns:
        Multiplications per sample (``sum_l M_{l-1} M_l`` for a dense MLP).

    Example:
        >>> count_macs(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), torch.zeros(1, 4))
        18
    """
    if not isinstance(example, torch.Tensor) or example.ndim == 0 or len(example) == 0:
        raise ValueError("example must be a batch tensor with at least one sample")
    total = 0

    def linear(module: nn.Linear, inputs, output) -> None:
        nonlocal total
        total += module.in_features * output.numel()

    def conv(module: nn.modules.conv._ConvNd, inputs, output) -> None:
        nonlocal total
        per_output = module.in_channels // module.groups
        for k in module.kernel_size:
            per_output *= k
        total += per_output * output.numel()

    def transposed(module: nn.modules.conv._ConvTransposeNd, inputs, output) -> None:
        nonlocal total
        per_input = module.out_channels // module.groups
        for k in module.kernel_size:
            per_input *= k
        total += per_input * inputs[0].numel()

    handles = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_hook(linear))
        elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            handles.append(module.register_forward_hook(conv))
        elif isinstance(module, nn.modules.conv._ConvTransposeNd):
            handles.append(module.register_forward_hook(transposed))
    with hooked_eval(model, handles):
        model(example)
    return total // len(example)
