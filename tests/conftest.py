"""Networks shared by the reduce tests: a small MLP and a small plain CNN with trained-looking batch norms."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from edgetorch.zoo import MLP


def _small_cnn(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 12, 3, padding=1, bias=False), nn.BatchNorm2d(12), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(12, 10, 1), nn.ReLU(),
        nn.Flatten(), nn.Linear(10 * 2 * 2, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 5),
    )
    with torch.no_grad():  # trained-looking batch norms: non-trivial statistics and affine
        for m in model:
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.eval()


@pytest.fixture()
def small_cnn() -> Callable[[int], nn.Sequential]:
    """The CNN builder, for tests that edit a fresh copy (seeded)."""
    return _small_cnn


@pytest.fixture(scope="module")
def cnn_and_data():
    return _small_cnn(), torch.rand(64, 3, 8, 8)


@pytest.fixture(scope="module")
def mlp_and_data():
    torch.manual_seed(0)
    model = MLP(image_size=8, hidden=(40, 30, 20)).eval()
    x = torch.rand(200, 1, 8, 8)
    return model, x
