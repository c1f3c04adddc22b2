"""The one evaluation: top-1 accuracy of a classifier on a dataset, on the model's device."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset


@torch.no_grad()
def evaluate_accuracy(model: nn.Module, data: Dataset, batch_size: int = 512) -> float:
    """Top-1 accuracy of ``model`` on ``data`` (eval mode during, previous mode restored).

    Args:
        model: a classifier returning logits.
        data: ``(image, label)`` samples: a ``TensorDataset`` (sliced directly) or any dataset
            (read through a ``DataLoader``); batches are moved to the model's device.
        batch_size: inference batch size.

    Returns:
        Fraction of correct predictions in [0, 1].
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    batches = (zip(*(t.split(batch_size) for t in data.tensors)) if isinstance(data, TensorDataset)
               else DataLoader(data, batch_size=batch_size))
    correct = total = 0
    try:
        with torch.no_grad():
            for x, y in batches:
                correct += int((model(x.to(device)).argmax(1) == y.to(device)).sum())
                total += len(y)
    finally:
        model.train(was_training)
    return correct / max(total, 1)
