"""Engine corners found on models outside the suite: layouts backward must see, packed copies
released before an op's backward allocates, autocast, torch.compile and the ledger's totals."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import edgetorch as et


def grads(model, x, y, policy=None, autocast=False):
    """Loss, input gradient and parameter gradients of one step (plain PyTorch when no policy)."""
    model = copy.deepcopy(model)
    x = x.clone().requires_grad_(True)
    ledger = et.SavedTensorLedger()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if policy is None:
            out = model(x)
        else:
            with et.compress_activations(model, policy, ledger=ledger):
                out = model(x)
        loss = F.cross_entropy(out.float(), y)
    loss.backward()
    return loss.detach(), x.grad, [p.grad for p in model.parameters() if p.grad is not None], ledger


def assert_identical(a, b):
    (la, xa, ga, _), (lb, xb, gb, _) = a, b
    assert torch.equal(la, lb)
    assert torch.equal(xa, xb)
    assert len(ga) == len(gb) and all(torch.equal(p, q) for p, q in zip(ga, gb))


class SliceOfChannelsLast(nn.Module):
    """A depthwise convolution on a channel slice of a channels-last tensor (timm edgenext's
    split): the slice's strides (C*H*W, 1, W*C, C) span far more memory than it holds."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 88, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 7, padding=3, groups=16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.stem(x).to(memory_format=torch.channels_last)
        part = h[:, :16]  # saved by the depthwise convolution as a sparse view of h
        return self.head(self.dw(part).mean((2, 3)))


@pytest.mark.parametrize("policy", [et.Dense(), et.Bitmap(), et.Bitmap(threshold=0.0)])
def test_a_strided_view_comes_back_with_its_own_strides(policy):
    torch.manual_seed(0)
    model, x, y = SliceOfChannelsLast(), torch.randn(2, 3, 24, 24), torch.tensor([0, 3])
    assert_identical(grads(model, x, y), grads(model, x, y, policy))

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(ctx.saved_tensors[0].stride())
            return g

    base = torch.relu(torch.randn(2, 88, 12, 12, requires_grad=True)).to(memory_format=torch.channels_last)
    part = base[:, :16]
    with et.compress_activations(nn.Identity(), policy):
        out = Probe.apply(part)
    out.sum().backward()
    assert seen == [part.stride()]


class FrozenNormOnPermuted(nn.Module):
    """xcit's pattern: a permuted (channels-last-strided) tensor through a depthwise conv, GELU and
    a frozen batch norm."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.bn = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.proj(x).permute(0, 2, 1).reshape(b, 16, 7, 7)
        h = self.bn(F.gelu(self.dw(h.contiguous(memory_format=torch.channels_last))))
        return self.head(h.mean((2, 3)))


def test_frozen_batch_norm_on_a_channels_last_input_keeps_input_gradients_exact():
    torch.manual_seed(0)
    model = et.freeze_batchnorm(FrozenNormOnPermuted())
    with torch.no_grad():  # non-trivial statistics, so a wrong path shows in the bits
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
        model.bn.weight.uniform_(0.5, 2)
    x, y = torch.randn(4, 49, 8), torch.tensor([0, 1, 2, 0])
    ledger_run = grads(model, x, y, et.BackRazor(0.9))
    plain = grads(model, x, y)
    assert torch.equal(plain[0], ledger_run[0]) and torch.equal(plain[1], ledger_run[1])
    assert any(r.op.endswith("batch_norm") and r.form == "shape" for r in ledger_run[3].records)


def test_a_packed_copy_is_released_when_backward_first_decodes_it():
    live_in_backward = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t * 2

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors  # the first decode of the entry both Spy nodes share
            live_in_backward.append(ledger.live_bytes)
            return g * 2 + 0 * t

    ledger = et.SavedTensorLedger()
    w = torch.randn(256, 256, requires_grad=True)
    with et.compress_activations(nn.Identity(), et.Bitmap(), ledger=ledger):
        h = torch.relu(w * 1.0) * 1.0  # relu saves its own output; h is another tensor
        out = (Spy.apply(h) + Spy.apply(h)).sum()  # two ops save h: one entry, two views
    (spy_row,) = [r for r in ledger.records if r.op != "relu" and r.storage == "stored"]
    before = ledger.live_bytes
    out.backward()
    # freed at the first of the two decodes, not the last: never packed and decoded at once
    assert live_in_backward == [before - spy_row.stored_bytes] * 2
    assert torch.equal(w.grad, 4 * (w > 0).float())


def test_retain_graph_after_release_and_double_backward_stay_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))
    x = torch.randn(32, 64)
    for policy in (et.Bitmap(), et.BackRazor(0.9)):
        with et.compress_activations(model, policy):
            out = model(x).sum()
        g1 = torch.autograd.grad(out, list(model.parameters()), retain_graph=True)
        g2 = torch.autograd.grad(out, list(model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    xg = x.clone().requires_grad_()
    plain = torch.autograd.grad(model(xg).sum(), xg, create_graph=True)[0].square().sum()
    (plain_gg,) = torch.autograd.grad(plain, xg)
    xg2 = x.clone().requires_grad_()
    with et.compress_activations(model, et.Bitmap(), keep=(xg2,)):
        out = model(xg2).sum()
    second = torch.autograd.grad(out, xg2, create_graph=True)[0].square().sum()
    (gg,) = torch.autograd.grad(second, xg2)
    assert torch.equal(gg, plain_gg)


def test_autocast_back_razor_prunes_what_feeds_weight_gradients():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(2, 3, 64, 64), torch.tensor([1, 7])
    fp32 = grads(model, x, y, et.BackRazor(0.9))[3]
    bf16 = grads(model, x, y, et.BackRazor(0.9), autocast=True)[3]
    pruned = lambda ledger: {r.module for r in ledger.records if r.op == "convolution" and r.form == "prune"}  # noqa: E731
    # every convolution prunes its saved input; under autocast the first one too, because it
    # saves a bf16 copy of the model's input rather than the input itself
    assert pruned(bf16) == pruned(fp32) | {"conv1"} and len(pruned(fp32)) == 19
    # autocast's bf16 weight copies are held as they are and counted (plain autocast holds them)
    casts = [r for r in bf16.records if r.op == "convolution" and r.form == "exact" and r.dense_bytes]
    assert casts and all(r.storage == "dense" and r.stored_bytes == r.dense_bytes for r in casts)
    activations = lambda ledger: sum(r.stored_bytes for r in ledger.records if r not in casts)  # noqa: E731
    assert activations(bf16) < 0.6 * activations(fp32)


def test_autocast_bitmap_is_bit_identical_and_still_saves():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(2, 3, 64, 64), torch.tensor([1, 7])
    run = grads(model, x, y, et.Bitmap(), autocast=True)
    assert_identical(grads(model, x, y, autocast=True), run)
    relu = [r for r in run[3].records if r.op == "relu_" and r.dense_bytes]
    assert relu and sum(r.stored_bytes for r in relu) < 0.8 * sum(r.dense_bytes for r in relu)


def test_ledger_counts_one_copy_when_an_exact_form_supersedes_a_pruned_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512))
    x = torch.randn(16, 64)
    ledger = et.SavedTensorLedger()
    with et.compress_activations(model, et.BackRazor(0.9, scope="all"), ledger=ledger):
        logp = F.log_softmax(model(x), dim=1)  # saved pruned for its own backward (scope=all)
        out = logp.pow(3).sum()  # pow saves the same tensor exactly
    out.backward()
    rows = [r for r in ledger.records if r.shape == (16, 512) and r.op in ("_log_softmax", "pow")]
    assert sorted(r.storage for r in rows) == ["dense", "superseded"]
    total = ledger.total()
    assert total.stored_bytes <= total.dense_bytes


@pytest.mark.parametrize("policy,ledger", [(et.Bitmap(), False), (et.Bitmap(), True), (et.BackRazor(0.9), False)])
def test_torch_compile_warning_says_what_really_happened(policy, ledger):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    ran = []

    def counting_compiler(gm, inputs):  # the AOT path inductor takes, with a run counter
        forward = make_boxed_func(gm.forward)

        def run(args):
            ran.append(1)
            return forward(args)

        run._boxed_call = True
        return run

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(32, 64)
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=counting_compiler))
    compiled(x).sum().backward()
    ran.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with et.compress_activations(compiled, policy, ledger=et.SavedTensorLedger() if ledger else None) as ctx:
            loss = compiled(x).sum()
    loss.backward()
    (message,) = [str(w.message) for w in caught if "compress_activations got" in str(w.message)]
    assert ctx.saved_count > 0, "this torch hides the saved tensors of compiled code: update the warning"
    if policy.needs_roles or ledger:
        assert not ran and "ran eagerly" in message
    else:
        assert ran and "compiled graph ran" in message


def test_autocast_weight_copies_cached_before_the_block_are_still_weights():
    """Micro-batches inside one autocast region reuse the weight casts the first one made."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 12 * 12, 3))
    forms = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for micro in range(2):
            ledger = et.SavedTensorLedger()
            with et.compress_activations(model, et.BackRazor(0.9), ledger=ledger):
                loss = model(torch.randn(4, 3, 16, 16)).float().sum()
            loss.backward()
            forms.append(sorted(r.form for r in ledger.records if r.op in ("convolution", "addmm") and r.dense_bytes))
    assert forms[0] == forms[1] and forms[0].count("prune") >= 2


def test_a_custom_function_keeps_what_it_saved_exact_even_when_a_linear_reads_it_next():
    """torch 2.14 calls Function.apply from C: the pack must still be known as the Function's."""

    class Square(torch.autograd.Function):  # backward reads the saved values themselves
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t * t

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            return 2 * t * g

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 3)

        def forward(self, x):
            h = self.a(x)  # saved by nothing before Square
            squared = Square.apply(h)
            logits = self.b(h)  # the very next op saves h too, for b's weight gradient (prunable)
            return squared.sum(1, keepdim=True) + logits

    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(16, 32), torch.randint(0, 3, (16,))
    plain, razor = grads(model, x, y), grads(model, x, y, et.BackRazor(0.9))
    assert torch.equal(plain[1], razor[1])  # the input gradient passes through Square's backward
    assert torch.equal(plain[2][0], razor[2][0])  # so does a's weight gradient
    assert any(r.op == "?" and r.form == "exact" for r in razor[3].records)


class CountingBitmap(et.Bitmap):
    """Bitmap that counts the tensors it was asked to encode (the codec's work)."""

    calls = packed = 0

    def encode(self, t, need=None, capacity=None):
        rep = super().encode(t) if need is None else super().encode(t, need, capacity)
        CountingBitmap.calls += 1
        CountingBitmap.packed += rep is not None
        return rep


class ConvBnRelu(nn.Module):
    """Saved per step: the input (external), a conv output feeding batch norm (no zeros: never
    compresses) and a ReLU output (half zeros: compresses), besides parameters."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).amax((2, 3)))


def test_a_position_that_did_not_compress_is_held_as_is_without_looking_again():
    torch.manual_seed(0)
    model, y = ConvBnRelu(), torch.tensor([0, 3])
    policy = CountingBitmap()
    CountingBitmap.calls = CountingBitmap.packed = 0
    with et.compress_activations(model, policy):
        model(torch.randn(2, 3, 24, 24)).sum().backward()
    looked_first = CountingBitmap.calls
    assert (looked_first, CountingBitmap.packed) == (2, 1)  # the batch-norm input; the ReLU output
    for _ in range(2):  # later steps: only the ReLU output is looked at, and it still compresses
        CountingBitmap.calls = CountingBitmap.packed = 0
        x = torch.randn(2, 3, 24, 24)
        assert_identical(grads(model, x, y), _grads_in_place(model, x, y, policy))
        assert (CountingBitmap.calls, CountingBitmap.packed) == (1, 1)
    # another policy (here a narrower value type) looks again: it might compress where this did not
    CountingBitmap.calls = 0
    with et.compress_activations(model, CountingBitmap(value_dtype=torch.float16)):
        model(torch.randn(2, 3, 24, 24)).sum().backward()
    assert CountingBitmap.calls == 2


def _grads_in_place(model, x, y, policy):
    """``grads`` on ``model`` itself, not a copy: the positions it learned are the model's."""
    x = x.clone().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    with et.compress_activations(model, policy) as scope:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert scope.saved_count > 0
    return loss.detach(), x.grad, [p.grad.clone() for p in model.parameters()], None


def test_a_policy_with_an_unhashable_field_still_works():
    """The positions a policy found incompressible are remembered by policy; a subclass with an
    unhashable field (the step_overhead bench's timed bitmap) is remembered by object."""
    from dataclasses import dataclass, field

    @dataclass(frozen=True)
    class Noted(et.Bitmap):
        notes: list = field(default_factory=list)

    torch.manual_seed(0)
    model, y = ConvBnRelu(), torch.tensor([0, 3])
    policy = Noted()
    with pytest.raises(TypeError):
        hash(policy)
    for _ in range(2):
        x = torch.randn(2, 3, 24, 24)
        assert_identical(grads(model, x, y), _grads_in_place(model, x, y, policy))
