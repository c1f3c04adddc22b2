"""gradient_fidelity: every gradient under a policy against plain PyTorch's on the same batch, the
model left as it was, and `edgetorch profile --fidelity`."""

import copy
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import edgetorch as et
from edgetorch.activations import GradientComparison, GradientFidelity, TrainingPolicy
from edgetorch.activations.fidelity import gradient_fidelities
from edgetorch.cli import app

from test_backrazor import CNN_INPUT, SmallCNN


def bn_dropout_cnn() -> nn.Module:
    """Conv (with bias) -> training BN -> ReLU -> dropout, twice, then a head: BN statistics
    that change in every step, random masks, and biases a batch norm cancels."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).train()


BN_BATCH = (torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3]))


def assert_exact(fid: GradientFidelity) -> None:
    for row in (*fid.parameters, fid.input):
        assert (row.cosine, row.relative_error) == (1.0, 0.0), row
    assert (fid.worst_cosine, fid.max_relative_error, fid.worst_parameter) == (1.0, 0.0, None)


@pytest.mark.parametrize("policy", ["dense", et.Bitmap(), TrainingPolicy(et.Bitmap())])
def test_exact_policies_give_cosine_one_and_error_zero(policy):
    fid = et.gradient_fidelity(bn_dropout_cnn(), BN_BATCH, policy)
    assert_exact(fid)  # the dropout masks are the same in both steps, or this would fail
    assert fid.loss == fid.reference_loss
    assert [r.name for r in fid.parameters] == [n for n, _ in bn_dropout_cnn().named_parameters()]


def test_several_policies_against_one_reference_step_equal_one_at_a_time():
    specs = ["quantized:bits=4", "bitmap", "backrazor:sparsity=0.9"]
    together = gradient_fidelities(bn_dropout_cnn(), BN_BATCH, specs)
    assert [f.policy for f in together] == specs
    for fid, spec in zip(together, specs):
        assert fid == et.gradient_fidelity(bn_dropout_cnn(), BN_BATCH, spec)
    assert together[0].worst_cosine < 1.0


def test_checkpointed_specs_compare_with_plain_pytorch():
    torch.manual_seed(0)
    model = et.build_model("zoo:cnn").train()
    batch = (torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3]))
    assert_exact(et.gradient_fidelity(model, batch, "bitmap+checkpoint"))
    assert et.gradient_fidelity(model, batch, "backrazor:sparsity=0.9+checkpoint").policy == \
        "backrazor:sparsity=0.9+checkpoint"


def test_backrazor_keeps_the_input_gradient_and_moves_only_pruned_weights():
    torch.manual_seed(0)
    fid = et.gradient_fidelity(SmallCNN().train(), CNN_INPUT, et.BackRazor(0.9))
    assert (fid.input.cosine, fid.input.relative_error) == (1.0, 0.0)  # no batch norm trains
    rows = {r.name: r for r in fid.parameters}
    # c2 and c3 read pruned copies of their inputs; c1 reads the model input (never encoded),
    # fc a tensor below min_bytes, and every bias only the exact output gradient.
    for name in ("c2.weight", "c3.weight"):
        assert 0.3 < rows[name].cosine < 1 and rows[name].relative_error > 0
    for name in ("c1.weight", "c1.bias", "c2.bias", "c3.bias", "fc.weight", "fc.bias"):
        assert (rows[name].cosine, rows[name].relative_error) == (1.0, 0.0), name
    assert fid.worst_cosine == min(rows[n].cosine for n in ("c2.weight", "c3.weight"))
    assert fid.worst_parameter in ("c2.weight", "c3.weight")
    assert fid.max_relative_error == max(r.relative_error for r in fid.parameters)


def test_a_large_threshold_moves_gradients():
    torch.manual_seed(0)
    fid = et.gradient_fidelity(SmallCNN().train(), CNN_INPUT, "bitmap:threshold=0.5")
    assert fid.worst_cosine < 1 and fid.max_relative_error > 0 and fid.input.cosine < 1


def test_biases_a_training_batch_norm_cancels_are_listed_but_not_counted():
    fid = et.gradient_fidelity(bn_dropout_cnn(), BN_BATCH, et.Quantized(bits=4))
    negligible = {r.name for r in fid.parameters if r.negligible}
    assert negligible == {"0.bias", "4.bias"}  # rounding noise around an exact zero
    counted = [r for r in fid.parameters if not r.negligible]
    assert fid.worst_cosine == min(r.cosine for r in counted) and 0.5 < fid.worst_cosine < 1


def test_one_threshold_says_which_reference_gradients_are_negligible():
    model = bn_dropout_cnn()
    largest = max(r.reference_norm for r in et.gradient_fidelity(model, BN_BATCH, "dense").parameters)
    strict = gradient_fidelities(model, BN_BATCH, [et.Quantized(bits=4)], negligible=0.0)[0]
    with pytest.warns(UserWarning, match="are zero or negligible"):  # most are, at half the largest
        loose = gradient_fidelities(model, BN_BATCH, [et.Quantized(bits=4)], negligible=0.5)[0]
    assert not any(r.negligible for r in strict.parameters)
    assert {r.name for r in loose.parameters if r.negligible} == {
        r.name for r in loose.parameters if r.reference_norm <= 0.5 * largest}
    with pytest.raises(ValueError, match=r"negligible must be a fraction in \[0, 1\)"):
        et.gradient_fidelity(model, BN_BATCH, "dense", negligible=1.0)


def test_a_zero_initialised_head_that_blocks_the_gradients_is_told_and_can_be_redrawn():
    import torchvision

    from edgetorch.zoo import redraw_zero_weights

    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(32, 8, num_layers=1, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=3)
    batch = (torch.randn(2, 3, 32, 32), torch.tensor([0, 2]))
    with pytest.warns(UserWarning, match=r"of \d+ parameter gradients are zero or negligible.*ViT head"):
        fid = et.gradient_fidelity(vit, batch, "backrazor:sparsity=0.9")
    assert sum(not r.negligible for r in fid.parameters) <= 2  # the head alone
    bias = vit.heads.head.bias.clone()
    redraw_zero_weights(vit)
    assert vit.heads.head.weight.any() and torch.equal(vit.heads.head.bias, bias)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fid = et.gradient_fidelity(vit, batch, "backrazor:sparsity=0.9")
    assert all(not r.negligible for r in fid.parameters) and fid.input.cosine == 1.0


def test_a_policy_that_draws_random_numbers_shifts_dropout_and_is_told():
    with pytest.warns(UserWarning, match="random ops saw different numbers"):
        fid = et.gradient_fidelity(bn_dropout_cnn(), BN_BATCH, "quantized:bits=8,stochastic=true")
    assert fid.loss != fid.reference_loss


def test_the_model_the_rng_and_existing_gradients_are_left_as_they_were():
    model = bn_dropout_cnn()
    model(BN_BATCH[0]).sum().backward()  # gradients the caller has accumulated
    state = copy.deepcopy(model.state_dict())
    grads = {n: p.grad for n, p in model.named_parameters()}
    grad_values = {n: g.clone() for n, g in grads.items()}
    rng = torch.get_rng_state()
    x = BN_BATCH[0].clone()
    for policy in ("dense", "backrazor:sparsity=0.9"):
        et.gradient_fidelity(model, (x, BN_BATCH[1]), policy)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # BN statistics too
    for n, p in model.named_parameters():
        assert p.grad is grads[n] and torch.equal(p.grad, grad_values[n])
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(x, BN_BATCH[0]) and not x.requires_grad


def test_integer_inputs_have_no_input_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 64), nn.Flatten(), nn.ReLU(), nn.Linear(16 * 64, 3))
    batch = (torch.randint(0, 50, (8, 16)), torch.randint(0, 3, (8,)))
    fid = et.gradient_fidelity(model, batch, "backrazor:sparsity=0.9")
    assert fid.input is None and "torch.int64" in fid.no_input_gradient
    assert fid.parameters[-2].name == "3.weight" and fid.parameters[-2].cosine < 1
    record = fid.to_dict()
    assert record["input"] is None and record["no_input_gradient"] == fid.no_input_gradient


def test_summaries_and_json_at_the_edges():
    rows = (GradientComparison("a", 0.9, 0.2, 1.0, 1.0), GradientComparison("b", 0.1, 5.0, 1e-9, 1e-9, True),
            GradientComparison("c", 0.0, math.inf, 2.0, 0.0))
    fid = GradientFidelity("x", rows, None, "inputs are torch.int64", 1.0, 1.0)
    assert (fid.worst_cosine, fid.worst_parameter, fid.max_relative_error) == (0.0, "c", math.inf)
    record = json.loads(json.dumps(fid.to_dict(), allow_nan=False))  # strict JSON: inf is null
    assert record["max_relative_error"] is None and record["parameters"][2]["relative_error"] is None
    rows = (*rows[:2], GradientComparison("d", math.nan, math.nan, math.nan, 1.0))
    nan = GradientFidelity("x", rows, None, "", 1.0, 1.0)
    assert math.isnan(nan.worst_cosine) and nan.worst_parameter == "d" and math.isnan(nan.max_relative_error)
    empty = GradientFidelity("x", (), None, "", 1.0, 1.0)
    assert (empty.worst_cosine, empty.worst_parameter, empty.max_relative_error) == (1.0, None, 0.0)


def test_bad_arguments_say_what_is_accepted():
    torch.manual_seed(0)
    model = SmallCNN()
    with pytest.raises(ValueError, match="unknown policy 'zip'; accepted: dense, bitmap"):
        et.gradient_fidelity(model, CNN_INPUT, "zip")
    with pytest.raises(ValueError, match="bad argument"):
        et.gradient_fidelity(model, CNN_INPUT, "backrazor:spars=0.9")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        et.gradient_fidelity("resnet18", CNN_INPUT, "dense")
    with pytest.raises(TypeError, match="spec string"):
        et.gradient_fidelity(model, CNN_INPUT, 0.9)
    with pytest.raises(ValueError, match=r"pair \(inputs, targets\), got 3 items"):
        et.gradient_fidelity(model, (*CNN_INPUT, None), "dense")
    with pytest.raises(TypeError, match="inputs must be a torch.Tensor"):
        et.gradient_fidelity(model, ([1.0], CNN_INPUT[1]), "dense")


def test_measure_says_where_it_moved_without_importing_activations():
    """measure sits below activations: it no longer resolves the name (an upward import), it says where it is."""
    code = ("import sys, edgetorch, edgetorch.measure as m; assert 'edgetorch.activations' not in sys.modules\n"
            "for name in ('gradient_fidelity', 'GradientFidelity'):\n"
            "    try:\n"
            "        getattr(m, name)\n"
            "    except AttributeError as err:\n"
            "        assert f'use edgetorch.{name}' in str(err), err\n"
            "    else:\n"
            "        raise SystemExit('no error')\n"
            "assert 'edgetorch.activations' not in sys.modules\n"
            "assert edgetorch.gradient_fidelity is edgetorch.activations.gradient_fidelity")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_profile_fidelity_adds_the_numbers_to_the_table_and_json(tmp_path):
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, [
        "profile", "--model", "zoo:cnn", "--batch-size", "8", "--size", "28",
        "--policy", "backrazor:sparsity=0.9", "--fidelity", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    (r,) = json.loads(out.read_text())["results"]
    f = r["fidelity"]
    assert f["policy"] == r["policy"] == "backrazor:sparsity=0.9"
    assert 0 < f["worst_cosine"] < 1 and f["max_relative_error"] > 0 and f["input"]["cosine"] == 1.0
    assert f["loss"] == f["reference_loss"] and f["worst_parameter"] in {p["name"] for p in f["parameters"]}
    assert "worst param" in result.output and f"{f['worst_cosine']:.4f}" in result.output


def test_comparing_a_large_gradient_holds_no_float64_copy_of_it():
    """A per-block plan's cost measurement compares every parameter's gradient in float64: whole
    copies of MiniLM's embedding gradient (11.7M entries) took that planning 350 MiB over a budget
    its training kept. 16M float32 entries each (64 MiB): chunked, the comparison adds megabytes,
    where three whole float64 copies would add 384 MiB."""
    from edgetorch.activations.fidelity import _compare
    from edgetorch.measure.process import peak_rss_bytes, reset_peak_rss, rss_bytes

    g = torch.randn(1 << 24)
    reference = g + 1e-3 * torch.randn(1 << 24)
    before = rss_bytes()
    if not reset_peak_rss():
        pytest.skip("the peak resident set cannot be reset here (Linux only)")
    row = _compare("w", g, reference)
    # a chunk's float64 temporaries are 8 MiB each; 64-74 MiB measured, by what the heap kept from
    # earlier tests in the process: a bound that tells chunks from whole copies (384 MiB)
    assert peak_rss_bytes() - before < 128 * 2**20
    expected = torch.nn.functional.cosine_similarity(g.double(), reference.double(), dim=0).item()
    assert row.cosine == pytest.approx(expected, abs=1e-12)
    assert row.relative_error == pytest.approx(((g.double() - reference.double()).norm() / reference.double().norm()).item(),
                                               rel=1e-9)


def test_a_step_under_a_policy_never_holds_a_second_set_of_gradients(monkeypatch):
    """Each gradient under the policy is compared as it is accumulated and dropped: while one is
    compared, the reference's gradients and at most one of the step's are alive. Before, the step
    kept all of them beside the reference's, a second copy of the model's gradients (MiniLM's
    per-block costs went over their budget on it; 288 MiB against 176 measured on eight 16 MiB
    layers). Counted here by weak references to every gradient the comparison reads, not by
    memory. A parameter that gets no gradient counts as a zero one."""
    import weakref

    import edgetorch.activations.fidelity as fidelity

    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.unused = bn_dropout_cnn(), nn.Linear(3, 3)  # unused: never called, no gradient

        def forward(self, x):
            return self.net(x)

    alive, counts = weakref.WeakSet(), []
    real_grad, real_compare = fidelity._dense_grad, fidelity._compare

    def dense_grad(t):
        g = real_grad(t)
        alive.add(g)
        return g

    def compare(name, g, reference):
        counts.append(len(alive))
        return real_compare(name, g, reference)

    monkeypatch.setattr(fidelity, "_dense_grad", dense_grad)
    monkeypatch.setattr(fidelity, "_compare", compare)
    model = WithUnused()
    parameters = len(list(model.parameters()))
    fid = et.gradient_fidelity(model, BN_BATCH, "quantized:bits=4")
    assert len(counts) == parameters + 1  # every parameter, and the input
    # the reference's gradients and its input gradient, and the one compared (the input's: two)
    assert max(counts) <= parameters + 1 + 2, counts
    rows = {r.name: r for r in fid.parameters}
    assert rows["unused.weight"].norm == 0 and rows["unused.weight"].reference_norm == 0
    assert all(p.grad is None for p in model.parameters())
