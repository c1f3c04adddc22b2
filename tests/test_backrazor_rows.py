"""Back Razor's ``rows``: one top-k per token (a row of a flattened ``[batch x tokens, features]``
matrix) or per sample (all of a sample's rows, as the paper's code selects), in batch-major
Linear inputs and in torch MultiheadAttention's token-major projections alike."""

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import edgetorch as et
from edgetorch.codecs.topk import pack_topk


class Tokens(nn.Module):
    """A Linear on (batch, tokens, features), fed an activation (the caller's input is never pruned)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 4)

    def forward(self, x):
        return self.lin(x * 2.0)


def weight_grad(net, x, policy):
    net = copy.deepcopy(net)
    with et.compress_activations(net, policy):
        out = net(x)
    out.sum().backward()
    return net.lin.weight.grad


@pytest.mark.parametrize("rows", ["token", "sample"])
def test_linear_on_tokens_keeps_the_top_k_of_each_token_or_of_each_sample(rows):
    torch.manual_seed(0)
    net, x = Tokens(), torch.randn(4, 20, 32)
    grad = weight_grad(net, x, et.BackRazor(0.75, rows=rows))
    a = x * 2.0
    # per token: each of the 80 rows of 32 keeps its 8 largest; per sample: each of the 4
    # samples keeps its 160 largest of 640, wherever they are among its tokens
    kept = pack_topk(a.reshape(80, 32) if rows == "token" else a.reshape(4, 640), 0.75).unpack()
    expected = torch.ones(80, 4).T @ kept.reshape(80, 32)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)
    other = "sample" if rows == "token" else "token"
    assert not torch.allclose(grad, weight_grad(net, x, et.BackRazor(0.75, rows=other)), atol=1e-3)


class Rows(et.BackRazor):
    """Back Razor that also records the matrices its top-k sees (as rows: the engine's call)."""

    def encode_region(self, t, rows, need, form):
        if form is et.activations.forms.PRUNE_FORM:
            self.seen.append(t.reshape(rows, -1).clone())
        return super().encode_region(t, rows, need, form)


def tiny_vit():
    vit = torchvision.models.VisionTransformer(32, 8, num_layers=1, num_heads=4, hidden_dim=64, mlp_dim=128, num_classes=5)
    nn.init.normal_(vit.heads.head.weight, std=0.1)
    return vit


def test_per_sample_rows_gather_each_sample_in_multihead_attention_and_in_the_mlp():
    torch.manual_seed(0)
    vit, x = tiny_vit(), torch.randn(3, 3, 32, 32)
    block = vit.encoder.layers[0]
    seen = {}
    block.ln_1.register_forward_hook(lambda m, i, o: seen.__setitem__("in_proj", o.detach()))
    block.ln_2.register_forward_hook(lambda m, i, o: seen.__setitem__("mlp", o.detach()))
    policy = Rows(0.9, rows="sample")
    object.__setattr__(policy, "seen", [])
    with et.compress_activations(vit, policy):
        out = vit(x)
    F.cross_entropy(out, torch.tensor([0, 1, 2])).backward()
    matrices = policy.seen
    assert all(m.shape[0] == 3 for m in matrices), [tuple(m.shape) for m in matrices]
    # MultiheadAttention projects a (tokens, batch, features) copy: its rows were gathered per sample
    assert any(torch.equal(m, seen["in_proj"].reshape(3, -1)) for m in matrices)
    assert any(torch.equal(m, seen["mlp"].reshape(3, -1)) for m in matrices)


def test_per_token_rows_inside_multihead_attention_are_token_major():
    torch.manual_seed(0)
    vit, x = tiny_vit(), torch.randn(3, 3, 32, 32)
    seen = {}
    vit.encoder.layers[0].ln_1.register_forward_hook(lambda m, i, o: seen.__setitem__("in_proj", o.detach()))
    policy = Rows(0.9, rows="token")
    object.__setattr__(policy, "seen", [])
    with et.compress_activations(vit, policy):
        vit(x).sum().backward()
    tokens = seen["in_proj"].transpose(0, 1).reshape(-1, 64)  # row t*3 + b is token t of sample b
    assert any(torch.equal(m, tokens) for m in policy.seen)


@pytest.mark.parametrize("scope", ["weights", "all"])
def test_per_sample_rows_keep_forward_and_decode_to_the_same_layout(scope):
    torch.manual_seed(0)
    vit, x, y = tiny_vit(), torch.randn(2, 3, 32, 32), torch.tensor([1, 4])

    def step(policy):
        model = copy.deepcopy(vit)
        xx = x.clone().requires_grad_(True)
        with et.compress_activations(model, policy):
            out = model(xx)
        F.cross_entropy(out, y).backward()
        return out.detach(), xx.grad, {n: p.grad for n, p in model.named_parameters()}

    dense, sample = step(et.Dense()), step(et.BackRazor(0.9, scope=scope, rows="sample"))
    assert torch.equal(dense[0], sample[0])
    if scope == "weights":
        assert torch.equal(dense[1], sample[1])
    # at sparsity 0 nothing is dropped: the regrouped copies decode to exactly the saved layout
    exact = step(et.BackRazor(0.0, scope=scope, rows="sample"))
    for name, g in dense[2].items():
        torch.testing.assert_close(exact[2][name], g, rtol=0, atol=0, msg=name)


def test_both_rows_keep_the_same_share_of_values():
    torch.manual_seed(0)
    vit, x = tiny_vit(), torch.randn(4, 3, 32, 32)
    stored = {}
    for rows in ("token", "sample"):
        ledger = et.SavedTensorLedger()
        with et.compress_activations(vit, et.BackRazor(0.9, rows=rows), ledger=ledger):
            vit(x).sum().backward()
        pruned = [r for r in ledger.records if r.form == "prune" and r.dense_bytes]
        assert pruned and ledger.live_bytes == 0  # every stored form released after backward
        stored[rows] = sum(r.nnz for r in pruned), sum(r.numel for r in pruned)
    # each keeps 10% of its values, up to rounding each quota to whole values: a token's row of
    # 64 features keeps 6 (9.4%), a sample's 17 x 64 keep 109 (10.0%)
    nnz, numel = stored["sample"]
    assert abs(nnz - 0.1 * numel) <= 0.001 * numel
    nnz, numel = stored["token"]
    assert abs(nnz - 0.1 * numel) <= 0.01 * numel


def test_rows_spec_round_trips_and_bad_rows_are_named():
    p = et.parse_policy("backrazor:sparsity=0.9,rows=sample")
    assert p == et.BackRazor(0.9, rows="sample") and et.parse_policy(p.spec()) == p
    with pytest.raises(ValueError, match="rows must be one of token, sample"):
        et.parse_policy("backrazor:rows=batch")


def test_one_sample_is_one_row_without_a_gathering_copy():
    torch.manual_seed(0)
    net, x = Tokens(), torch.randn(1, 80, 32)
    grad = weight_grad(net, x, et.BackRazor(0.75, rows="sample"))
    kept = pack_topk((x * 2.0).reshape(1, -1), 0.75).unpack()
    torch.testing.assert_close(grad, torch.ones(80, 4).T @ kept.reshape(80, 32), rtol=1e-5, atol=1e-5)
