"""ChainReducer: one chain measured once, reduced at many budgets, each reduction exactly reduce_model's."""

from __future__ import annotations

from collections import OrderedDict
from unittest import mock

import pytest
import torch
from torch import nn

from edgetorch.reduce import ChainReducer, count_macs, reduce_model, solve_allocation
from edgetorch.reduce import chain as chain_module
from edgetorch.reduce.factored import lowrank_curves
from edgetorch.reduce.sequential import input_statistics, layer_svds, prune_orders

SWEEP = [(alpha, method, allocation, prune_input)
         for alpha in (0.85, 0.4)  # the larger budget second: nothing of the first reduction may leak into it
         for method in ("prune-ls", "lowrank", "prune")
         for allocation in ("optimal", "uniform", "pso")
         for prune_input in (False, True)]


def same(got, expected, x: torch.Tensor) -> None:
    """Two reductions are the same: allocation, layer factors, and the network's outputs to the bit."""
    for field in ("theta", "method", "solver", "objective", "cost", "total", "proven_gap"):
        assert getattr(got.allocation, field) == getattr(expected.allocation, field), field
    assert got.method == expected.method and got.layers == expected.layers and got.groups == expected.groups
    assert repr(got.model) == repr(expected.model) and not got.model.training
    with torch.no_grad():
        assert torch.equal(got.model(x), expected.model(x))


def test_a_sweep_from_one_reducer_equals_a_reduce_model_call_per_point(mlp_and_data):
    model, x = mlp_and_data
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reducer = ChainReducer(model, x)
    for alpha, method, allocation, prune_input in SWEEP:
        got = reducer.reduce(alpha, method, allocation, seed=3, prune_input=prune_input)
        same(got, reduce_model(model, alpha, method, allocation, calibration=x, seed=3, prune_input=prune_input), x)
        assert count_macs(got.model, x[:1]) == got.allocation.cost
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the model is only read


def test_a_convolutional_chain_and_a_nested_one_reduce_as_reduce_model_does(cnn_and_data, mlp_and_data):
    cnn, images = cnn_and_data
    flat, x = mlp_and_data
    nested = nn.Sequential(OrderedDict(inputs=flat[0], body=nn.Sequential(*list(flat)[1:7]), head=flat[7]))
    for model, data in ((cnn, images), (nested, x)):
        reducer = ChainReducer(model, data)
        for method in ("prune", "prune-ls", "lowrank"):
            got = reducer.reduce(0.6, method, prune_input=method == "prune")
            same(got, reduce_model(model, 0.6, method, calibration=data, prune_input=method == "prune"), data)
    assert [f.name for f in got.layers] == ["body.0", "body.2", "body.4", "head"]


def test_the_allocation_is_solve_allocation_on_curves_measured_apart(mlp_and_data):
    model, x = mlp_and_data
    reducer = ChainReducer(model, x)
    stats = input_statistics(model, x)
    widths = [stats.layers[0].units_in] + [layer.units_out for layer in stats.layers]
    for method in ("prune", "prune-ls", "lowrank"):
        if method == "lowrank":
            curves = lowrank_curves(layer_svds(model))
        else:
            curves = [curve for _, curve in prune_orders(stats, correlated=method == "prune-ls")]
        for alpha in (0.3, 0.7):
            expected = solve_allocation(curves, widths, alpha, method, "optimal")
            got = reducer.allocate(alpha, method, prune_input=True)  # the paper's problem: M~_0 is free
            assert (got.theta, got.objective, got.cost) == (expected.theta, expected.objective, expected.cost)


def test_statistics_and_svds_are_measured_once_for_the_whole_sweep(mlp_and_data):
    model, x = mlp_and_data
    with mock.patch.object(chain_module, "input_statistics", wraps=input_statistics) as statistics, \
            mock.patch.object(chain_module, "layer_svds", wraps=layer_svds) as svds:
        reducer = ChainReducer(model, x)
        for alpha in (0.3, 0.5, 0.7):
            for method in ("prune", "prune-ls", "lowrank"):
                reducer.reduce(alpha, method)
    assert statistics.call_count == 1 and svds.call_count == 1


def test_what_a_chain_reducer_refuses(mlp_and_data, cnn_and_data):
    model, x = mlp_and_data
    with pytest.raises(ValueError, match="calibration"):
        ChainReducer(model).reduce(0.5, "prune")  # pruning needs data
    assert ChainReducer(model).reduce(0.5, "lowrank").allocation.alpha >= 0.5  # low-rank of an MLP needs none
    with pytest.raises(ValueError, match="pass calibration="):
        ChainReducer(cnn_and_data[0])  # a convolution's output positions need an input size
    with pytest.raises(ValueError, match="method"):
        ChainReducer(model, x).reduce(0.5, "svd")
    residual = type("Residual", (nn.Sequential,), {"forward": lambda self, t: t + self[0](t)})
    with pytest.raises(TypeError, match="nn.Sequential chain"):
        ChainReducer(residual(nn.Linear(4, 4)))  # its own forward: no chain
