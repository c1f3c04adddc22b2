"""Back Razor: forward exact, input gradients exact where no batch norm trains, exact per-sample
top-k in the pruned copies, and bytes = n/8 + kept values."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import edgetorch as et
from edgetorch.codecs.mask import pack_mask
from edgetorch.codecs.topk import kept_per_row, pack_topk


def run(model, x, y, policy, ledger=None):
    """One step; returns output, input gradient, parameter gradients."""
    x = x.clone().requires_grad_(True)
    with et.compress_activations(model, policy, ledger=ledger):
        out = model(x)
    F.cross_entropy(out.flatten(1) if out.dim() > 2 else out, y).backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def compare(model, x, y, policy=None, ledger=None):
    torch.manual_seed(0)
    plain = run(copy.deepcopy(model), x, y, et.Dense())
    torch.manual_seed(0)
    razor = run(copy.deepcopy(model), x, y, policy or et.BackRazor(0.9), ledger)
    return plain, razor


class SmallCNN(nn.Module):
    """Conv/ReLU/max-pool/ReLU6/leaky-ReLU/avg-pool/Linear: every mask and shape rule, no BN."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 16, 3)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.relu6(self.c2(x))
        x = F.leaky_relu(self.c3(x), 0.1)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


CNN_INPUT = (torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))


@pytest.mark.parametrize("policy", [et.BackRazor(0.9), et.BackRazor(0.99), et.BackRazor(0.5, value_dtype=torch.float16)])
def test_forward_and_input_gradient_are_exact_without_batch_norm(policy):
    (o0, dx0, g0), (o1, dx1, g1) = compare(SmallCNN(), *CNN_INPUT, policy)
    assert torch.equal(o0, o1)
    assert torch.equal(dx0, dx1)
    # Weight gradients are approximations, but computed from the pruned copies, not garbage.
    assert F.cosine_similarity(g0["c2.weight"].flatten(), g1["c2.weight"].flatten(), dim=0) > 0.3


def test_saved_forms_per_op_and_exact_bytes():
    ledger = et.SavedTensorLedger()
    compare(SmallCNN(), *CNN_INPUT, et.BackRazor(0.9), ledger)
    forms = {(r.op, r.form) for r in ledger.records if r.storage != "external"}
    assert ("convolution", "prune") in forms and ("relu", "mask(0,inf)") in forms
    assert ("hardtanh", "mask(0,6)") in forms and ("leaky_relu", "mask(0,inf)") in forms
    assert ("max_pool2d_with_indices", "shape") in forms
    for r in ledger.records:
        if r.form == "prune" and r.dense_bytes:
            n, rows = r.numel, r.shape[0]
            kept = rows * kept_per_row(n // rows, 0.9)
            assert r.nnz <= kept  # fewer only where a sample had fewer non-zeros
            assert r.stored_bytes == math.ceil(n / 8) + 4 * r.nnz
        if r.form.startswith("mask") and r.dense_bytes:
            assert r.stored_bytes == math.ceil(r.numel / 8)
        if r.form == "shape":
            assert r.stored_bytes == 0


def test_linear_weight_gradient_is_computed_from_the_per_sample_top_k_input():
    class Net(nn.Module):  # the Linear must see an activation: the caller's input is never pruned
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(256, 8)

        def forward(self, x):
            return self.lin(x * 2.0)

    torch.manual_seed(0)
    net, x = Net(), torch.randn(6, 256)
    with et.compress_activations(net, et.BackRazor(0.9)):
        out = net(x)
    out.sum().backward()
    pruned = pack_topk(x * 2.0, 0.9).unpack()
    assert torch.allclose(net.lin.weight.grad, torch.ones(6, 8).T @ pruned, atol=1e-5)
    assert not torch.allclose(net.lin.weight.grad, torch.ones(6, 8).T @ (x * 2.0), atol=1e-2)


def test_frozen_batch_norm_stores_nothing_and_keeps_input_gradients_exact():
    model = et.freeze_batchnorm(torchvision.models.resnet18(num_classes=4))
    model.train()  # must not unfreeze: running statistics stay as they are
    before = model.bn1.running_mean.clone()
    model(torch.randn(2, 3, 32, 32))
    assert torch.equal(before, model.bn1.running_mean) and not model.bn1.weight.requires_grad
    ledger = et.SavedTensorLedger()
    (o0, dx0, _), (o1, dx1, _) = compare(model, torch.randn(2, 3, 32, 32), torch.tensor([0, 3]), et.BackRazor(0.9), ledger)
    assert torch.equal(o0, o1) and torch.equal(dx0, dx1)
    bn = [r for r in ledger.records if r.op == "native_batch_norm" and r.dense_bytes]
    assert bn and all(r.form == "shape" and r.stored_bytes == 0 for r in bn)


def test_trained_batch_norm_keeps_its_input_exactly():
    ledger = et.SavedTensorLedger()
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten())
    (o0, dx0, _), (o1, dx1, _) = compare(model, torch.randn(2, 3, 16, 16), torch.tensor([0, 1]), et.BackRazor(0.9), ledger)
    bn = [r for r in ledger.records if r.op == "native_batch_norm" and r.dense_bytes]
    assert bn and all(r.form == "exact" for r in bn)
    # Its input is exact, so input gradients stay exact through a trained batch norm as well.
    assert torch.equal(o0, o1) and torch.equal(dx0, dx1)


def test_resnet18_with_trained_batch_norm_keeps_forward_and_input_gradient_exact():
    model = torchvision.models.resnet18(num_classes=4).train()
    (o0, dx0, _), (o1, dx1, _) = compare(model, torch.randn(2, 3, 32, 32), torch.tensor([0, 3]), et.BackRazor(0.9))
    assert torch.equal(o0, o1) and torch.equal(dx0, dx1)


def tiny_vit():
    vit = torchvision.models.VisionTransformer(32, 8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128, num_classes=5)
    nn.init.normal_(vit.heads.head.weight, std=0.1)  # torchvision zero-inits it: no gradient would reach the body
    return vit


def test_vision_transformer_exact_forward_and_input_gradient_and_scope_all_saves_more():
    torch.manual_seed(0)
    vit, x, y = tiny_vit(), torch.randn(2, 3, 32, 32), torch.tensor([1, 4])
    weights_only, everything = et.SavedTensorLedger(), et.SavedTensorLedger()
    (o0, dx0, _), (o1, dx1, _) = compare(vit, x, y, et.BackRazor(0.9), weights_only)
    assert dx0.abs().sum() > 0  # gradients reach the input at all
    assert torch.equal(o0, o1) and torch.equal(dx0, dx1)
    forms = {(r.op, r.form) for r in weights_only.records if r.dense_bytes}
    assert ("addmm", "prune") in forms or ("mm", "prune") in forms
    assert ("gelu", "exact") in forms and ("native_layer_norm", "exact") in forms
    (_, _, _), (o2, dx2, _) = compare(vit, x, y, et.BackRazor(0.9, scope="all"), everything)
    assert torch.equal(o0, o2) and not torch.equal(dx0, dx2)  # forward exact; input gradients approximate
    assert everything.total().stored_bytes < 0.6 * weights_only.total().stored_bytes


def test_timm_vit_forward_and_input_gradient_are_exact():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=5)
    (o0, dx0, _), (o1, dx1, _) = compare(model, torch.randn(2, 3, 32, 32), torch.tensor([0, 2]))
    assert dx0.abs().sum() > 0 and torch.equal(o0, o1) and torch.equal(dx0, dx1)


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def test_tensor_saved_by_a_custom_function_is_kept_exact_even_if_a_conv_reads_it_next():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = nn.Conv2d(4, 4, 3, padding=1), nn.Linear(4 * 8 * 8, 3)

        def forward(self, x):
            h = x * 1.0
            return self.head((Square.apply(h) + self.conv(h)).flatten(1))

    (o0, dx0, _), (o1, dx1, _) = compare(Net(), torch.randn(2, 4, 8, 8), torch.tensor([0, 2]))
    assert torch.equal(o0, o1) and torch.equal(dx0, dx1)


def test_retain_graph_allows_a_second_backward():
    model = SmallCNN()
    x = CNN_INPUT[0].clone().requires_grad_(True)
    with et.compress_activations(model, et.BackRazor(0.9)):
        loss = model(x).sum()
    first = torch.autograd.grad(loss, x, retain_graph=True)[0]
    assert torch.equal(first, torch.autograd.grad(loss, x)[0])


@pytest.mark.parametrize("spec", ["backrazor:sparsity=1.0", "backrazor:sparsity=-0.1", "backrazor:sparsity=abc",
                                  "backrazor:scope=most", "backrazor:k=3"])
def test_bad_policy_specs_are_clear_errors(spec):
    with pytest.raises(ValueError, match="sparsity|scope|accepted|not a number"):
        et.parse_policy(spec)


def test_policy_spec_round_trips():
    p = et.parse_policy("backrazor:sparsity=0.95,value_dtype=float16,scope=all")
    assert p == et.BackRazor(0.95, torch.float16, "all") and et.parse_policy(p.spec()) == p


# -- codecs ---------------------------------------------------------------------------------

rows_and_values = st.integers(1, 4).flatmap(
    lambda r: st.tuples(st.just(r), st.lists(st.sampled_from([0.0, 0.5, -0.5, 1.0, -2.0, 3.0, 0.25, -7.0]),
                                             min_size=r, max_size=r * 40).map(lambda v: v[: len(v) // r * r]))
).filter(lambda rv: len(rv[1]) > 0)


@settings(max_examples=200, deadline=None)
@given(rows_and_values, st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.97, 0.99]))
def test_top_k_keeps_exactly_the_quota_of_largest_non_zeros_per_row(rv, sparsity):
    rows, values = rv
    x = torch.tensor(values).view(rows, -1)
    p = pack_topk(x, sparsity)
    back = p.unpack()
    quota = kept_per_row(x.shape[1], sparsity)
    for r in range(rows):
        kept = back[r] != 0
        nonzero = int((x[r] != 0).sum())
        assert int(kept.sum()) == min(quota, nonzero)  # exact; natural zeros never stored
        assert torch.equal(back[r][kept], x[r][kept])  # kept values are exact
        if kept.any() and (~kept).any():  # every kept magnitude >= every dropped one
            assert x[r][kept].abs().min() >= x[r][~kept].abs().max()
    assert p.nbytes == math.ceil(x.numel() / 8) + 4 * p.nnz


def test_top_k_default_rows_are_samples_and_nan_counts_as_largest():
    x = torch.randn(3, 2, 5, 5)
    x[1, 0, 0, 0] = float("nan")
    back = pack_topk(x, 0.9).unpack().view(3, -1)
    assert all(int((row != 0).sum()) == kept_per_row(50, 0.9) for row in back)
    assert back[1, 0].isnan()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-10, 10, width=32), min_size=1, max_size=100),
       st.sampled_from([(0.0, math.inf, 1.0, 0.0), (0.0, 6.0, 3.0, 0.0), (0.0, math.inf, 1.0, -1.0)]))
def test_mask_keeps_the_predicate_backward_reads(values, interval):
    low, high, inside, outside = interval
    x = torch.tensor(values)
    m = pack_mask(x, low, high, inside=inside, outside=outside)
    back = m.unpack()
    assert torch.equal((back > low) & (back < high), (x > low) & (x < high))
    assert m.nbytes == math.ceil(x.numel() / 8)


def test_mask_golden_bytes():
    m = pack_mask(torch.tensor([1.0, 0.0, 7.0, 3.0, -1.0, 5.9, 6.0, 0.1, 2.0]), 0.0, 6.0, inside=3.0)
    assert m.bitmap.tolist() == [0b10101001, 0b00000001]


def test_top_k_golden_bytes():
    p = pack_topk(torch.tensor([[0.1, -3.0, 0.0, 2.0], [5.0, 5.0, 5.0, -1.0]]), 0.5)
    assert p.bitmap.tolist() == [0b00111010]
    assert p.values.tolist() == [-3.0, 2.0, 5.0, 5.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model", [SmallCNN, tiny_vit])
def test_cuda_forward_and_input_gradient_are_exact(model, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)  # same kernels in both runs
    torch.manual_seed(0)
    net = model().cuda()
    x = torch.randn(4, 3, 32, 32, device="cuda")
    y = torch.tensor([0, 1, 2, 3], device="cuda")
    ledger = et.SavedTensorLedger()
    (o0, dx0, _), (o1, dx1, _) = compare(net, x, y, et.BackRazor(0.9, value_dtype=torch.float16), ledger)
    assert torch.equal(o0, o1) and torch.equal(dx0, dx1)
    assert any(r.form == "prune" for r in ledger.records)


class FusedAttention(nn.Module):
    """Separate q/k/v projections (separate storages) into F.scaled_dot_product_attention, with
    sharply peaked scores: the case where a pruned q or k breaks the saved logsumexp."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.heads, self.out = heads, nn.Linear(width, 3)

    def forward(self, x):
        b, n, w = x.shape
        split = lambda t: t.view(b, n, self.heads, w // self.heads).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), scale=4.0)
        return self.out(y.transpose(1, 2).reshape(b, n, w).mean(1))


def test_fused_attention_keeps_q_k_and_logsumexp_exact_even_under_scope_all():
    torch.manual_seed(0)
    model, x, y = FusedAttention(), torch.randn(4, 64, 32), torch.tensor([0, 1, 2, 0])
    ledger = et.SavedTensorLedger()
    (_, _, g0), (_, _, g1) = compare(model, x, y, et.BackRazor(0.9, scope="all"), ledger)
    attention = [r for r in ledger.records if "attention" in r.op and r.dense_bytes]
    forms = sorted((len(r.shape), r.form) for r in attention)
    assert forms == [(3, "exact"), (4, "exact"), (4, "exact"), (4, "prune"), (4, "prune")]  # lse; q, k; v, out
    a = torch.cat([g0[k].flatten() for k in sorted(g0)])
    b = torch.cat([g1[k].flatten() for k in sorted(g0)])
    assert torch.isfinite(b).all() and (a - b).norm() < a.norm()  # approximate, not exploded
