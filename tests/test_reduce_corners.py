"""reduce in the corners (issue 13, item 5): nested containers, low-rank for any network, and
``load(save(...))`` for every kind of reduced model."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from edgetorch.reduce import count_macs, load, reduce_model, save
from edgetorch.reduce.api import ReductionPath, reduction_path
from edgetorch.reduce.factored import Factored
from edgetorch.reduce.sequential import KeepFeatures
from edgetorch.zoo import SmallResNet, redraw_batchnorm


def nested_copy(flat: nn.Sequential) -> nn.Sequential:
    """The zoo MLP's chain (Flatten, Linear, ReLU, Linear, ReLU, Linear, ReLU, Linear) in named,
    nested containers: the same module objects, so the same function."""
    return nn.Sequential(OrderedDict(
        inputs=flat[0],
        body=nn.Sequential(nn.Sequential(flat[1], flat[2]), nn.Sequential(flat[3], flat[4], flat[5], flat[6])),
        head=flat[7],
    ))


@pytest.mark.parametrize("method", ["prune", "prune-ls", "lowrank"])
def test_a_nested_chain_reduces_as_its_flat_chain_and_keeps_its_containers(tmp_path, mlp_and_data, method):
    flat, x = mlp_and_data
    nested = nested_copy(flat)
    prune_input = method == "prune"  # the paper's input pruning: a gather that must find its slot
    expected = reduce_model(flat, 0.85, method, calibration=x, prune_input=prune_input)
    got = reduce_model(nested, 0.85, method, calibration=x, prune_input=prune_input)
    assert torch.equal(got.model(x), expected.model(x))  # the same layers, allocation and refits
    assert got.allocation.theta == expected.allocation.theta
    assert [f.name for f in got.layers] == ["body.0.0", "body.1.0", "body.1.2", "head"]
    assert [f.name for f in expected.layers] == ["1", "3", "5", "7"]
    # The containers and their names survive; each reduced layer sits where its original did.
    assert [name for name, _ in got.model.named_children()] == ["inputs", "body", "head"]
    first = got.model.body[0][0]
    if method == "lowrank":
        assert isinstance(first, (Factored, nn.Linear))
    elif prune_input:  # input pixels pruned: the selection shares the first layer's slot
        assert isinstance(first[0], KeepFeatures) and first[1].in_features == got.layers[0].kept_inputs < 64
    else:
        assert isinstance(first, nn.Linear) and first.in_features == 64
    json_path = save(got.model, tmp_path / "nested.safetensors")
    loaded, _ = load(json_path)
    assert torch.equal(loaded(x), got.model(x))
    assert loaded.state_dict().keys() == got.model.state_dict().keys()


@pytest.mark.parametrize("method", ["prune", "prune-ls", "lowrank"])
def test_each_kind_of_network_takes_its_path(mlp_and_data, method):
    flat, _ = mlp_and_data
    assert reduction_path(flat, method) is ReductionPath.CHAIN
    assert reduction_path(nested_copy(flat), method) is ReductionPath.NESTED_CHAIN
    other = ReductionPath.LOWRANK_LAYERS if method == "lowrank" else ReductionPath.CHANNEL_GROUPS
    assert reduction_path(SmallResNet(), method) is other
    # A Sequential that is no chain (a norm between layers) is read as any other network.
    assert reduction_path(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)), method) is other


def test_a_sequential_with_its_own_forward_is_no_chain():
    class Skip(nn.Sequential):
        def forward(self, x):
            return x + super().forward(x)

    with pytest.raises(TypeError, match="forward is its own code: residual additions"):
        from edgetorch.reduce.sequential import weight_layers

        weight_layers(Skip(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    # Low-rank does not need a chain: the skip connection is kept and both layers may be factored.
    model, x = Skip(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval(), torch.randn(8, 16)
    assert torch.equal(reduce_model(model, 0.0, "lowrank", calibration=x).model(x), model(x))
    small = reduce_model(model, 0.5, "lowrank", calibration=x).model
    assert type(small) is Skip and count_macs(small, x) <= 0.5 * count_macs(model, x)


@pytest.fixture(scope="module")
def resnet_and_data():
    torch.manual_seed(0)
    model = redraw_batchnorm(SmallResNet(widths=(8, 16, 32)))  # trained-looking batch norms
    return model, torch.rand(16, 1, 28, 28)


@pytest.mark.parametrize("allocation", ["optimal", "uniform", "pso"])
def test_lowrank_factors_a_residual_network_layer_by_layer(tmp_path, resnet_and_data, allocation):
    model, x = resnet_and_data
    assert torch.equal(reduce_model(model, 0.0, "lowrank", allocation, calibration=x).model(x), model(x))
    result = reduce_model(model, 0.5, "lowrank", allocation, calibration=x)
    full, macs = count_macs(model, x[:1]), count_macs(result.model, x[:1])
    assert macs == result.allocation.cost == sum(f.macs for f in result.layers) and 1 - macs / full >= 0.5
    assert result.allocation.total == full and type(result.model) is SmallResNet
    names = dict(result.model.named_modules())
    for f in result.layers:  # each factored layer is a thin layer + a 1x1 (or Linear) in its own place
        dense = f.rank >= min(f.out_features, dict(model.named_modules())[f.name].weight[0].numel())
        assert isinstance(names[f.name], Factored) != dense
    if allocation == "uniform":  # the paper's uniform baseline keeps the last layer dense
        assert result.layers[-1].name == "classifier" and isinstance(result.model.classifier, nn.Linear)
    json_path = save(result.model, tmp_path / "small.safetensors", {"alpha": 0.5})
    loaded, record = load(json_path)
    assert record["alpha"] == 0.5 and record["factored"]
    assert torch.equal(loaded(x), result.model(x))


def test_lowrank_counts_what_it_cannot_factor_against_the_budget():
    # A depthwise convolution's matrix is block-diagonal: it stays, and its MACs stay in the total.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=16),
                          nn.ReLU(), nn.Conv2d(16, 24, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 5))
    x = torch.rand(4, 3, 8, 8)
    result = reduce_model(model, 0.4, "lowrank", calibration=x)
    assert [f.name for f in result.layers] == ["0", "4", "7"]
    macs = count_macs(result.model, x[:1])
    assert macs == result.allocation.cost and 1 - macs / count_macs(model, x[:1]) >= 0.4
    assert isinstance(result.model[2], nn.Conv2d) and result.model[2].groups == 16


@pytest.mark.slow  # 30-80 s on 2 busy cores: 21 SVDs up to 512 x 4608 (9 s) and the exact solver (10 s) per reduction
def test_lowrank_on_torchvision_resnet18(tmp_path):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.rand(2, 3, 32, 32)
    assert torch.equal(reduce_model(model, 0.0, "lowrank", "uniform", calibration=x).model(x), model(x))
    for allocation in ("optimal", "uniform"):
        result = reduce_model(model, 0.5, "lowrank", allocation, calibration=x)
        assert 1 - count_macs(result.model, x[:1]) / count_macs(model, x[:1]) >= 0.5
        loaded, record = load(save(result.model, tmp_path / f"{allocation}.safetensors"))
        assert record["source"]["spec"] == "torchvision:resnet18"
        assert torch.equal(loaded(x), result.model(x))
    assert isinstance(result.model.fc, nn.Linear)  # uniform: the classifier stays dense


@pytest.mark.parametrize("method", ["prune", "lowrank"])
def test_load_takes_what_save_returns_for_a_chain(tmp_path, cnn_and_data, method):
    model, x = cnn_and_data
    small = reduce_model(model, 0.5, method, calibration=x).model
    json_path = save(small, tmp_path / "small.safetensors", {"method": method})
    assert json_path.suffix == ".json"
    for path in (json_path, tmp_path / "small.safetensors"):
        loaded, record = load(path)
        assert record["method"] == method and torch.equal(loaded(x), small(x))


@pytest.mark.parametrize(("factored", "fragment"), [
    ({"features.1.conv1": 10**6}, "rank from 1 to below its full rank"),
    ({"features.1.bn1": 2}, "needs a Linear or groups=1 Conv2d there"),
    ([1, 2], "'factored' must map layer names to ranks"),
])
def test_a_tampered_factored_record_is_refused(tmp_path, resnet_and_data, factored, fragment):
    import json

    from edgetorch.zoo import CheckpointError

    model, x = resnet_and_data
    json_path = save(reduce_model(model, 0.5, "lowrank", "uniform", calibration=x).model, tmp_path / "small.safetensors")
    record = json.loads(json_path.read_text())
    json_path.write_text(json.dumps({**record, "factored": factored}))
    with pytest.raises(CheckpointError, match=fragment):
        load(json_path)


def tiny_chain():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).eval()


@pytest.mark.parametrize("method", ["prune", "prune-ls"])
def test_pruning_keeps_the_input_whole_and_is_optimal_among_such_choices(method):
    import itertools

    from edgetorch.reduce.problem import make_problem
    from edgetorch.reduce.sequential import input_statistics, prune_orders

    model, x = tiny_chain(), torch.randn(300, 6) * torch.tensor([3.0, 1, 1, 0.1, 0.1, 0.1])
    result = reduce_model(model, 0.5, method, calibration=x)
    assert result.allocation.theta[0] == 6 and not any(isinstance(m, KeepFeatures) for m in result.model)
    curves = [c for _, c in prune_orders(input_statistics(model, x), correlated=method == "prune-ls")]
    problem = make_problem(curves, [6, 5, 4, 3], 0.5, "prune")
    best = min(problem.objective(t) for t in itertools.product([6], range(1, 6), range(1, 5)) if problem.feasible(t))
    assert result.allocation.objective == pytest.approx(best, rel=1e-12, abs=1e-12)
    assert result.allocation.cost == problem.cost(result.allocation.theta) == count_macs(result.model, x[:1])
    # The paper's problem prunes the input too: never worse in J, at the price of a gather.
    free = reduce_model(model, 0.5, method, calibration=x, prune_input=True)
    assert free.allocation.objective <= result.allocation.objective
    # A budget no choice with every input meets: the input is pruned as the paper does.
    full = count_macs(model, x[:1])  # 6*5 + 5*4 + 4*3 = 62; with 6 inputs kept at least 6 + 1 + 3 = 10
    squeezed = reduce_model(model, 1 - 9 / full, method, calibration=x)
    assert squeezed.allocation.theta[0] < 6 and isinstance(squeezed.model[0], KeepFeatures)
