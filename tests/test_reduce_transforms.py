"""reduce transforms: exact at alpha = 0, MACs at the budget, physically smaller, safe checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from edgetorch.reduce import (
    KeepFeatures,
    count_macs,
    load,
    reduce_model,
    save,
)
from edgetorch.reduce.curves import correlated_order, power_order
from edgetorch.reduce.sequential import input_statistics, pruned
from edgetorch.zoo import MLP, CheckpointError


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_count_macs_matches_the_formulas():
    mlp = MLP(image_size=8, hidden=(40, 30))
    assert count_macs(mlp, torch.zeros(5, 1, 8, 8)) == 64 * 40 + 40 * 30 + 30 * 10
    conv = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, groups=2, bias=True), nn.ReLU(),
                         nn.Conv2d(8, 6, 1, stride=2))
    # 8 x 6 x 6 outputs x (4/2 x 3 x 3) + 6 x 3 x 3 outputs x 8
    assert count_macs(conv, torch.zeros(2, 4, 6, 6)) == 8 * 36 * 18 + 6 * 9 * 8


NETWORKS = ["mlp_and_data", "cnn_and_data"]  # conftest.py


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("method", ["prune", "prune-ls", "lowrank"])
@pytest.mark.parametrize("allocation", ["optimal", "uniform"])
def test_alpha_zero_gives_identical_outputs(request, network, method, allocation):
    model, x = request.getfixturevalue(network)
    small = reduce_model(model, 0.0, method, allocation, calibration=x).model
    assert torch.equal(small(x), model(x))


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("method", ["prune", "prune-ls", "lowrank"])
@pytest.mark.parametrize("allocation", ["optimal", "uniform", "pso"])
@pytest.mark.parametrize("alpha", [0.3, 0.7, 0.8])
def test_macs_meet_the_budget_and_the_model_shrinks(request, network, method, allocation, alpha):
    model, x = request.getfixturevalue(network)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = reduce_model(model, alpha, method, allocation, calibration=x)
    full = count_macs(model, x[:1])
    macs = count_macs(result.model, x[:1])
    assert macs == result.allocation.cost == sum(layer.macs for layer in result.layers)
    assert 1 - macs / full >= alpha
    assert n_params(result.model) < n_params(model)
    assert result.model(x).shape == model(x).shape
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the input is untouched
    if method != "lowrank":  # batch norms shrank with the channels they follow
        for conv, norm in zip(result.model, list(result.model)[1:]):
            if isinstance(norm, nn.BatchNorm2d):
                assert norm.num_features == conv.out_channels == norm.running_mean.numel()


def test_lowrank_layer_is_the_truncated_svd(mlp_and_data):
    model, _ = mlp_and_data
    result = reduce_model(model, 0.6, "lowrank")
    layer, k = model[1], result.layers[0].rank
    factored = result.model[1]
    assert isinstance(factored, nn.Sequential) and factored[0].out_features == k
    u, s, vt = torch.linalg.svd(layer.weight.double())
    expected = (u[:, :k] * s[:k]) @ vt[:k]
    torch.testing.assert_close((factored[1].weight @ factored[0].weight).double(), expected,
                               rtol=1e-5, atol=1e-5)


def test_correlation_aware_order_reduces_to_eq14_for_uncorrelated_inputs():
    cov = np.diag([3.0, 0.5, 2.0, 0.0, 1.0])
    order_a, curve_a = power_order(cov)
    order_b, curve_b = correlated_order(cov)
    np.testing.assert_allclose(curve_a, curve_b)
    assert list(order_a[:4]) == list(order_b[:4]) == [0, 2, 4, 1]
    # A neuron that duplicates another explains nothing new: it is picked last, at zero error.
    dup = np.array([[2.0, 2.0, 0.0], [2.0, 2.0, 0.0], [0.0, 0.0, 1.0]])
    order, curve = correlated_order(dup)
    assert set(order[:2]) == {0, 2} or set(order[:2]) == {1, 2}
    assert curve[2] == 0.0 and power_order(dup)[1][2] > 0


def test_least_squares_refit_recovers_a_redundant_neuron_exactly():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 5), nn.Identity(), nn.Linear(5, 3)).eval()
    with torch.no_grad():  # hidden neuron 4 = 2 * neuron 0 - neuron 1: a linear combination
        model[0].weight[4] = 2 * model[0].weight[0] - model[0].weight[1]
        model[0].bias[4] = 2 * model[0].bias[0] - model[0].bias[1]
    x = torch.randn(300, 6)
    stats = input_statistics(model, x, shrink=False)  # the sample covariance: exact recovery
    orders = [correlated_order(c) for c in stats.covariances]
    naive = [power_order(c) for c in stats.covariances]
    refit = pruned(model, [6, 4], orders, stats, refit=True)
    plain = pruned(model, [6, 4], naive, stats, refit=False)
    torch.testing.assert_close(refit(x), model(x), rtol=1e-4, atol=1e-4)
    assert (plain(x) - model(x)).abs().max() > 1e-2


def test_refit_is_the_minimum_norm_least_squares_solution_on_a_singular_covariance():
    from edgetorch.reduce.statistics import _refit

    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 6))
    x = np.concatenate([x, x[:, :2] @ rng.standard_normal((2, 3))], axis=1)  # 9 inputs, rank 6
    x[:, 8] = 0.0  # and a dead neuron
    mean, cov = x.mean(0), np.cov(x.T, bias=True)
    weight, bias = rng.standard_normal((4, 9)), rng.standard_normal(4)
    keep = np.array([0, 1, 3, 6, 7, 8])  # 6 and 7 depend on 0 and 1: C[S, S] is singular
    reference = np.linalg.lstsq(cov[np.ix_(keep, keep)], cov[keep, :], rcond=1e-10)[0].T
    # _refit takes weights as [outputs, units, taps] and means as [units, positions]
    got_weight, got_bias = _refit(weight[:, :, None], bias, cov, mean[:, None], keep)
    np.testing.assert_allclose(got_weight[:, :, 0], weight @ reference, atol=1e-10)
    np.testing.assert_allclose(got_bias, bias + weight @ (mean - reference @ mean[keep]), atol=1e-10)


def test_naive_pruning_moves_a_constant_neuron_into_the_bias():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    with torch.no_grad():
        model[0].weight[2] = 0.0
        model[0].bias[2] = 1.5  # neuron 2 is always 1.5: zero variance, non-zero mean
    x = torch.randn(100, 3)
    stats = input_statistics(model, x)
    orders = [power_order(c) for c in stats.covariances]
    assert 2 not in orders[1][0][:3]
    small = pruned(model, [3, 3], orders, stats)
    torch.testing.assert_close(small(x), model(x))


@pytest.mark.parametrize("method", ["prune", "lowrank"])
def test_checkpoint_roundtrip_without_pickle(tmp_path, mlp_and_data, method):
    model, x = mlp_and_data
    small = reduce_model(model, 0.85, method, calibration=x, prune_input=True).model
    if method == "prune":
        assert any(isinstance(m, KeepFeatures) for m in small)
    json_path = save(small, tmp_path / "small.safetensors", {"alpha": 0.85})
    loaded, record = load(tmp_path / "small.safetensors")
    assert record["alpha"] == 0.85
    assert torch.equal(loaded(x), small(x))
    record["modules"][0] = {"type": "os.system", "args": {}}
    json_path.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="unknown module type"):
        load(tmp_path / "small.safetensors")


def test_bad_inputs_are_rejected(mlp_and_data):
    model, x = mlp_and_data
    with pytest.raises(ValueError, match="needs calibration"):
        reduce_model(model, 0.5, "prune").model
    with pytest.raises(ValueError, match="unknown method"):
        reduce_model(model, 0.5, "svd").model
    with pytest.raises(ValueError, match="unknown allocation"):
        reduce_model(model, 0.5, "lowrank", allocation="greedy").model
    with pytest.raises(TypeError, match="no nn.Linear or groups=1 nn.Conv2d layer: low-rank has nothing"):
        reduce_model(nn.Module(), 0.5, "lowrank", calibration=x).model
    with pytest.raises(ValueError, match="not an nn.Sequential chain, needs example inputs"):
        reduce_model(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)), 0.5, "lowrank").model
    with pytest.raises(ValueError, match="infeasible"):
        reduce_model(model, 0.999, "lowrank").model
