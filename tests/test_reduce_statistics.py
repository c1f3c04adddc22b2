"""Calibration statistics for layer reduction (issue 13, items 4-5): shrinkage towards the diagonal
keeps J honest with few samples, and a seeded cap on a convolution's positions keeps them cheap.

The moments are checked against numpy and a brute-force Schaefer-Strimmer (2005, target D)
intensity; the small-calibration behaviour on an MLP trained here on digits (seconds), for the
chain path, and on resnet18 at 32 px, for the grouped path.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from edgetorch.data import load_dataset
from edgetorch.reduce import count_macs, reduce_model, sequential, statistics
from edgetorch.reduce.sequential import input_statistics
from edgetorch.reduce.statistics import Moments


def brute_force_shrinkage(x: np.ndarray) -> float:
    """Schaefer & Strimmer's target-D intensity, term by term from the paper's definitions."""
    n = len(x)
    y = x - x.mean(0)
    w = y[:, :, None] * y[:, None, :]
    s = n / (n - 1) * w.mean(0)
    variance = n / (n - 1) ** 3 * ((w - w.mean(0)) ** 2).sum(0)
    off = ~np.eye(x.shape[1], dtype=bool)
    return float(np.clip(variance[off].sum() / (s[off] ** 2).sum(), 0, 1))


def test_moments_are_numpy_covariance_shrunk_towards_the_diagonal():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 12)) @ rng.standard_normal((12, 12)) + 3.0
    moments = Moments(shared=False, samples=len(x))
    moments.add(torch.from_numpy(x)[:, :, None])
    mean, cov, shrinkage = moments.finish()
    expected = brute_force_shrinkage(x)
    assert 0.05 < shrinkage == pytest.approx(expected, rel=1e-10)
    sample = np.cov(x.T, bias=True)
    shrunk = (1 - expected) * sample + expected * np.diag(np.diag(sample))
    np.testing.assert_allclose(cov, shrunk, atol=1e-12)
    np.testing.assert_allclose(mean[:, 0], x.mean(0), atol=1e-12)
    # Without shrinkage, and in batches: the sample covariance exactly (it is shift invariant).
    plain = Moments(shared=False, samples=len(x), shrink=False)
    for part in np.array_split(x, 4):
        plain.add(torch.from_numpy(part)[:, :, None])
    np.testing.assert_allclose(plain.finish()[1], sample, atol=1e-12)


def test_many_samples_shrink_little():
    rng = np.random.default_rng(1)
    mixing = rng.standard_normal((8, 8))
    lambdas = []
    for n in (50, 5000):
        moments = Moments(shared=False, samples=n)
        moments.add(torch.from_numpy(rng.standard_normal((n, 8)) @ mixing)[:, :, None])
        lambdas.append(moments.finish()[2])
    assert lambdas[1] < 0.01 < lambdas[0]


def test_a_convolution_keeps_a_seeded_random_subset_of_positions():
    torch.manual_seed(0)
    x = torch.randn(64, 4, 1024, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5, 1.5])[:, None]
    capped, again, everything = (Moments(True, 64, 16), Moments(True, 64, 16), Moments(True, 64, None, shrink=False))
    for moments in (capped, again, everything):
        for batch in x.split(16):
            moments.add(batch)
    # max(16 x 4 channels, MIN_VECTORS = 8192) vectors: 128 positions of each sample.
    assert capped.vectors == 64 * 128 and everything.vectors == 64 * 1024
    assert np.array_equal(capped.finish()[1], again.finish()[1])
    other = Moments(True, 64, 16, seed=1)
    other.add(x)
    assert not np.array_equal(other.finish()[1], capped.finish()[1])
    np.testing.assert_allclose(np.diag(capped.finish()[1]), np.diag(everything.finish()[1]), rtol=0.05)
    np.testing.assert_allclose(everything.finish()[1], np.cov(x.transpose(1, 2).reshape(-1, 4).T.numpy(), bias=True),
                               atol=1e-10)


@pytest.fixture(scope="module")
def digits_mlp():
    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.Adam(model.parameters(), 1e-2)
    x, y = train.tensors
    for _ in range(100):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), x, test.tensors


def test_fewer_samples_than_units_keep_j_positive_the_budget_and_the_accuracy(digits_mlp, monkeypatch):
    # 20 samples for 64-wide layers: the sample covariance has rank 19, so without shrinkage J
    # reaches 0 at 19 kept units and the allocation over-prunes (issue 13's MLP: MAC ratio 0.023).
    model, x, (x_test, y_test) = digits_mlp
    full = count_macs(model, x[:1])

    def reduced(samples):
        result = reduce_model(model, 0.5, "prune-ls", "optimal", calibration=x[:samples])
        with torch.no_grad():
            accuracy = (result.model(x_test).argmax(1) == y_test).float().mean().item()
        return result, count_macs(result.model, x[:1]) / full, accuracy

    _, _, large = reduced(1000)
    small, ratio, accuracy = reduced(20)
    stats = input_statistics(model, x[:20])
    for curve, cov in zip((o[1] for o in sequential.prune_orders(stats, correlated=True)), stats.covariances):
        live = int(np.sum(np.diag(cov) > 0))  # dead units (zero variance) are free to drop
        assert np.all(curve[1:live] > 0)
    assert small.allocation.objective > 0 and 0.45 <= ratio <= 0.5
    monkeypatch.setattr(statistics, "diagonal_shrinkage", lambda *args: 0.0)  # the sample covariance
    plain, plain_ratio, plain_accuracy = reduced(20)
    assert plain.allocation.objective == 0 and plain_ratio < 0.3
    assert large - accuracy < large - plain_accuracy


def test_grouped_curves_stay_positive_where_consumers_see_fewer_vectors_than_channels():
    # At 32 px resnet18's layer4 runs at 1x1: 16 samples give 16 vectors for 512 channels.
    from edgetorch.reduce.graph import channel_graph
    from edgetorch.reduce.grouped import group_orders, group_statistics

    torch.manual_seed(0)
    model, x = torchvision.models.resnet18(num_classes=10).eval(), torch.rand(16, 3, 32, 32)
    graph, _ = channel_graph(model, x[:1])
    stats = group_statistics(model, graph, x)
    width = {t.module: t.units_in for t in graph.terms}
    short = [name for name, seen in stats.vectors.items() if seen <= width[name]]
    assert "fc" in short and all(stats.shrinkage[name] > 0 for name in short)
    for group, (_, curve) in zip(graph.groups, group_orders(graph, stats, correlated=True)):
        power = sum(np.diag(stats.inputs[c.module][1])[c.units] for c in group.consumers)
        live = int(np.sum(power > 0))  # channels dead on every sample (after a ReLU) are free to drop
        assert np.all(curve[1:live] > 0), group.root
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning is needed any more
        result = reduce_model(model, 0.5, "prune-ls", "uniform", calibration=x)
    assert result.allocation.objective > 0
