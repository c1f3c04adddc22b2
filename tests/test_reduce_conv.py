"""reduce on convolutional networks: channel pruning through conv/BN/ReLU/pool, low-rank convolutions.

The alpha = 0 identity and the MAC budget are checked for the CNN with the MLP, in test_reduce_transforms.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edgetorch.reduce import KeepFeatures, count_macs, load, reduce_model, save
from edgetorch.reduce.curves import correlated_order, power_order
from edgetorch.reduce.sequential import input_statistics, pruned, weight_layers


def test_weight_layers_read_channels_groups_and_positions(cnn_and_data):
    model, x = cnn_and_data
    layers = weight_layers(model, x)
    assert [(w.units_in, w.units_out) for w in layers] == [(3, 8), (8, 12), (12, 10), (10, 16), (16, 5)]
    assert [w.scale for w in layers] == [9 * 64, 9 * 16, 1 * 4, 4, 1]  # kernel x positions; H x W after Flatten
    assert [w.between for w in layers] == [(1,), (5,), (), (), ()]
    # The dense cost model is what count_macs measures.
    assert sum(w.scale * w.units_in * w.units_out for w in layers) == count_macs(model, x[:1])


def test_lowrank_convolution_is_the_truncated_svd_of_its_matrix(cnn_and_data):
    model, x = cnn_and_data
    result = reduce_model(model, 0.5, "lowrank", calibration=x)
    conv, factored = model[4], result.model[4]
    k = result.layers[1].rank
    assert isinstance(factored, nn.Sequential) and factored[0].out_channels == k < 12
    assert factored[1].kernel_size == (1, 1)
    u, s, vt = torch.linalg.svd(conv.weight.double().reshape(12, -1), full_matrices=False)
    weight = ((u[:, :k] * s[:k]) @ vt[:k]).reshape(conv.weight.shape).float()
    h = torch.randn(4, 8, 6, 6)
    torch.testing.assert_close(factored(h), nn.functional.conv2d(h, weight, None, padding=1), rtol=1e-4, atol=1e-5)


def test_correlation_aware_pruning_removes_a_duplicated_channel_exactly(small_cnn):
    model = small_cnn(1)
    with torch.no_grad():  # channel 7 of the first block repeats channel 3 through conv, BN and ReLU
        model[0].weight[7], model[0].bias[7] = model[0].weight[3], model[0].bias[3]
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(model[1], name)[7] = getattr(model[1], name)[3]
    x = torch.rand(128, 3, 8, 8)
    stats = input_statistics(model, x, shrink=False)  # the sample covariance: exact recovery
    orders = [correlated_order(c) for c in stats.covariances]
    assert orders[1][1][7] == 0.0  # 7 of 8 channels explain everything
    kept = [3, 7, 12, 10, 16]
    refit = pruned(model, kept, orders, stats, refit=True)
    assert refit[4].in_channels == 7 and refit[1].num_features == 7
    torch.testing.assert_close(refit(x), model(x), rtol=1e-4, atol=1e-5)
    assert set(orders[1][0][7:]) <= {3, 7}  # the one dropped is one of the pair
    # The same channels without the refit: the dropped one's variance is lost.
    deleted = pruned(model, kept, orders, stats, refit=False)
    assert (deleted(x) - model(x)).abs().max() > 1e-3


def test_naive_pruning_moves_a_constant_channel_into_the_next_layer_bias(small_cnn):
    model = small_cnn(2)
    with torch.no_grad():  # channel 3 of the last conv is constant after its ReLU: a zero-variance unit
        model[8].weight[3] = 0.0
        model[8].bias[3] = 0.7
    x = torch.rand(64, 3, 8, 8)
    stats = input_statistics(model, x)
    orders = [power_order(c) for c in stats.covariances]
    assert stats.covariances[3][3, 3] < 1e-12 and stats.means[3][3].min() > 0.6  # per-position means
    # Other channels may be dead (zero variance) too: put channel 3 last so it is the one dropped.
    order, curve = orders[3]
    assert curve[9] == 0.0
    orders[3] = (np.array([c for c in order if c != 3] + [3]), curve)
    # Into a Linear after the Flatten the per-position mean moves exactly (no padding involved).
    small = pruned(model, [3, 8, 12, 9, 16], orders, stats)
    assert small[8].out_channels == 9 and small[11].in_features == 9 * 4
    torch.testing.assert_close(small(x), model(x), rtol=1e-5, atol=1e-5)


def test_pruned_input_channels_are_selected_on_dim_1_and_checkpoints_round_trip(tmp_path, cnn_and_data):
    model, x = cnn_and_data
    for method in ("prune", "lowrank"):
        small = reduce_model(model, 0.8, method, calibration=x).model
        path = tmp_path / f"{method}.safetensors"
        save(small, path, {"alpha": 0.8})
        loaded, record = load(path)
        assert torch.equal(loaded(x), small(x))
        assert any(entry["type"] == ("BatchNorm2d" if method == "prune" else "Factored")
                   for entry in record["modules"])
    # Pruning the image's channels needs an input selector on the channel axis.
    stats = input_statistics(model, x)
    orders = [power_order(c) for c in stats.covariances]
    fewer = pruned(model, [2, 8, 12, 10, 16], orders, stats)
    assert isinstance(fewer[0], KeepFeatures) and fewer[0].dim == 1 and fewer[1].in_channels == 2
    kept = sorted(orders[0][0][:2].tolist())
    torch.testing.assert_close(fewer(x), fewer[1:](x[:, kept]))
    save(fewer, tmp_path / "fewer.safetensors")
    assert torch.equal(load(tmp_path / "fewer.safetensors")[0](x), fewer(x))


def test_unsupported_convolutional_networks_are_rejected_clearly(cnn_and_data):
    model, x = cnn_and_data
    with pytest.raises(ValueError, match="pass calibration="):
        reduce_model(model, 0.5, "lowrank").model
    # Low-rank factors what it can (the 1x1 convolution); the grouped one keeps its 648 of 720 MACs.
    grouped = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.ReLU(), nn.Conv2d(4, 2, 1))
    with pytest.raises(ValueError, match="648 of them are in layers that cannot be factored .grouped"):
        reduce_model(grouped, 0.5, "lowrank", calibration=torch.rand(2, 4, 5, 5)).model
    assert count_macs(reduce_model(grouped, 0.02, "lowrank", calibration=torch.rand(2, 4, 5, 5)).model, torch.rand(1, 4, 5, 5)) == 702
    # Not a chain, but channel groups (edgetorch.reduce.grouped) prune it: a per-feature norm after
    # the Flatten loses each channel's block of features.
    per_feature = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.BatchNorm1d(4 * 36), nn.Linear(4 * 36, 2)).eval()
    x = torch.rand(8, 3, 8, 8)
    small = reduce_model(per_feature, 0.5, "prune", calibration=x).model
    assert count_macs(small, x[:1]) <= 0.5 * count_macs(per_feature, x[:1]) and small(x).shape == (8, 2)
    residual = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LayerNorm(6), nn.Conv2d(4, 2, 1))
    with pytest.raises(TypeError, match="does not act on each unit separately.*LayerNorm"):
        reduce_model(residual, 0.5, "prune", calibration=torch.rand(4, 3, 8, 8)).model


def test_count_macs_counts_transposed_convolutions_by_brute_force():
    """A transposed convolution's multiplications: every input value times every kernel weight of
    its group, counted here by running it on one-hot inputs and counting the non-zero products."""
    deconv = torch.nn.ConvTranspose2d(4, 6, kernel_size=3, stride=2, padding=1, groups=2, bias=False)
    x = torch.zeros(1, 4, 5, 5)
    # Each input element contributes (out/groups) * kernel products.
    per_input = (6 // 2) * 3 * 3
    assert count_macs(torch.nn.Sequential(deconv), x) == per_input * x.numel()
    with torch.no_grad():
        deconv.weight.fill_(1.0)
        one = torch.zeros_like(x)
        one[0, 0, 2, 2] = 1.0
        touched = int((deconv(one) != 0).sum())  # an interior input reaches every kernel tap
    assert touched == per_input
