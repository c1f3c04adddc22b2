"""compress_activations: exact gradients, one copy per tensor, hands off what the caller holds."""

import contextlib
import copy
import warnings

import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F

import edgetorch as et


def step(model, x, y, ctx=None, seed=0):
    """Loss and parameter gradients of one training step, optionally inside ``ctx``."""
    torch.manual_seed(seed)  # same dropout masks in both runs
    model.zero_grad(set_to_none=True)
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def assert_same_step(model, x, y, policy, **kw):
    plain = copy.deepcopy(model)
    loss0, grads0 = step(plain, x, y)
    ledger = et.SavedTensorLedger()
    loss1, grads1 = step(model, x, y, et.compress_activations(model, policy, ledger=ledger, **kw))
    assert torch.equal(loss0, loss1)
    for (name, _), g0, g1 in zip(model.named_parameters(), grads0, grads1):
        assert torch.equal(g0, g1), f"gradient of {name} differs"
    for (name, b0), b1 in zip(plain.named_buffers(), model.buffers()):
        assert torch.equal(b0, b1), f"buffer {name} differs"
    return ledger


@pytest.mark.parametrize(
    "name,size",
    [("resnet18", 32), ("resnet50", 32), ("vgg11_bn", 32), ("mobilenet_v2", 32), ("alexnet", 64)],
)
def test_lossless_bitmap_gives_bit_identical_gradients(name, size):
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, num_classes=10)
    x, y = torch.randn(2, 3, size, size), torch.tensor([1, 7])
    ledger = assert_same_step(model, x, y, et.Bitmap())
    total = ledger.total()
    assert 0 < total.stored_bytes < total.dense_bytes
    assert any(r.storage == "stored" for r in ledger.records)


def test_transformer_layer_with_views_and_transposes_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True), nn.Flatten(), nn.Linear(32 * 16, 5)
    )
    x, y = torch.randn(3, 16, 32), torch.tensor([0, 4, 2])
    assert_same_step(model, x, y, et.Bitmap())


class ConvReluConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.fc = nn.Linear(8 * 16 * 16, 4)

    def forward(self, x):
        h = self.relu(self.conv1(x))
        return self.fc(F.relu(self.conv2(h)).flatten(1))


def test_tensor_saved_by_several_ops_is_stored_once():
    torch.manual_seed(0)
    model = ConvReluConv()
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    ledger = assert_same_step(model, x, y, et.Bitmap())
    relu_out = [r for r in ledger.records if r.module == "relu"]
    assert [r.storage for r in relu_out] == ["stored"]
    conv2_in = [r for r in ledger.records if r.module == "conv2" and r.shape == (4, 8, 16, 16)]
    assert [r.storage for r in conv2_in] == ["shared"]
    # Linear saves a flattened view of relu(conv2): one stored entry serves both.
    fc_in = [r for r in ledger.records if r.module == "fc" and r.shape == (4, 8 * 16 * 16)]
    assert [r.storage for r in fc_in] == ["shared"]
    stored = [r for r in ledger.records if r.storage == "stored"]
    assert len(stored) == 2
    # each stored tensor: exact bitmap bytes
    for r in stored:
        assert r.stored_bytes == 4 * r.nnz + (r.numel + 7) // 8


def test_parameters_buffers_and_inputs_are_not_encoded():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 3))
    x, y = torch.randn(8, 2048), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    ledger = assert_same_step(model, x, y, et.Bitmap())
    external = [r for r in ledger.records if r.storage == "external"]
    assert (8, 2048) in [r.shape for r in external]  # the caller's batch
    assert (64, 3) in [r.shape for r in external]  # the last weight (a transposed view)
    assert all(r.stored_bytes == 0 and r.dense_bytes == 0 for r in external)


def test_keep_argument_protects_tensors_used_outside_the_model_call():
    model = nn.Linear(1024, 4)
    side = torch.randn(8, 4).requires_grad_(False)
    ledger = et.SavedTensorLedger()
    with et.compress_activations(model, et.Bitmap(), ledger=ledger, keep=(side,)):
        big = torch.relu(torch.randn(8, 1024))
        loss = (model(big) * side).sum()
    loss.backward()
    assert {r.shape: r.storage for r in ledger.records}[(8, 4)] in ("external", "dense")


@pytest.mark.parametrize("policy, narrowed", [(et.Bitmap(), True), (et.BackRazor(0.9), True), (et.Dense(), False)])
def test_tiny_tensors_stay_dense_and_wide_integers_are_narrowed(policy, narrowed):
    model = nn.Linear(4, 4)
    ledger = et.SavedTensorLedger()
    with et.compress_activations(model, policy, ledger=ledger):
        h = torch.relu(model(torch.randn(2, 4)))  # tiny
        emb = nn.functional.embedding(torch.randint(0, 10, (64, 64)), torch.randn(10, 3, requires_grad=True))
        loss = h.sum() + emb.sum()
    loss.backward()
    (index,) = [r for r in ledger.records if r.dtype == "int64" and r.dense_bytes]
    assert index.dense_bytes == 64 * 64 * 8
    assert (index.storage, index.stored_bytes) == (("stored", 64 * 64) if narrowed else ("dense", 64 * 64 * 8))
    assert all(r.storage != "stored" for r in ledger.records if r.dtype == "float32")


def test_max_pool_indices_are_narrowed_and_gradients_stay_identical():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 16 * 16, 4))
    ledger = assert_same_step(model, torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]), et.Bitmap())
    (pool,) = [r for r in ledger.records if r.op == "max_pool2d_with_indices" and r.dtype == "int64"]
    assert pool.storage == "stored" and pool.stored_bytes * 4 == pool.dense_bytes  # int64 -> int16


def test_retain_graph_and_repeated_unpack():
    torch.manual_seed(0)
    model = ConvReluConv()
    x = torch.randn(2, 3, 16, 16)
    with et.compress_activations(model, et.Bitmap()):
        out = model(x).square().sum()
    g1 = torch.autograd.grad(out, list(model.parameters()), retain_graph=True)
    g2 = torch.autograd.grad(out, list(model.parameters()), retain_graph=True)
    out.backward()
    for a, b, p in zip(g1, g2, model.parameters()):
        assert torch.equal(a, b) and torch.equal(p.grad, a)


def test_inplace_change_after_saving_is_reported_like_pytorch():
    w = torch.randn(64, 64, requires_grad=True)
    model = nn.Identity()
    for size in (4, 64):  # kept dense (tiny) and stored
        with et.compress_activations(model, et.Bitmap()):
            h = torch.relu(torch.randn(size, 64) @ w)
            out = (h @ w).sum()
        h.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()


@pytest.mark.parametrize("policy", [None, et.Dense(), et.Bitmap(), et.BackRazor(0.5)],
                         ids=lambda p: "plain" if p is None else p.name)
@pytest.mark.parametrize("changed", ["weight", "frozen features"])
def test_inplace_change_of_a_held_leaf_is_reported_like_pytorch(policy, changed):
    """Leaves (a weight, a frozen backbone's feature map) are held as themselves, not as detached
    aliases: an in-place change between forward and backward must still be caught, as PyTorch
    catches it (the plain row checks that it does)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    # a leaf made without grad, like a frozen backbone's output; requiring grad, the weight is saved
    features = torch.relu(torch.randn(32, 64)).requires_grad_(changed == "weight")
    with contextlib.nullcontext() if policy is None else et.compress_activations(model, policy):
        out = model(features).square().sum()
    with torch.no_grad():
        (model.weight if changed == "weight" else features).mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_threshold_and_fp16_values_store_less():
    torch.manual_seed(0)
    model = ConvReluConv()
    x = torch.randn(4, 3, 16, 16)
    stored = {}
    for policy in (et.Bitmap(), et.Bitmap(threshold=0.1), et.Bitmap(value_dtype=torch.float16)):
        ledger = et.SavedTensorLedger()
        with et.compress_activations(model, policy, ledger=ledger):
            loss = model(x).sum()
        loss.backward()
        stored[policy.spec()] = ledger.total().stored_bytes
    assert stored["bitmap:threshold=0.1"] < stored["bitmap"]
    assert stored["bitmap:value_dtype=float16"] < 0.6 * stored["bitmap"]


def test_warns_when_it_cannot_act():
    model = ConvReluConv()
    x = torch.randn(2, 3, 16, 16)
    with pytest.warns(UserWarning, match="non-reentrant"):
        with et.compress_activations(model, et.Bitmap()):
            torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).sum().backward()
    with pytest.warns(UserWarning, match="inside another saved_tensors_hooks"):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            with et.compress_activations(model, et.Bitmap()):
                model(x)


def test_no_warning_in_normal_use_and_decorator_form():
    model = ConvReluConv()
    x = torch.randn(2, 3, 16, 16)

    @et.compress_activations(model, et.Bitmap())
    def forward():
        return model(x).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forward().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bad_arguments_are_clear():
    with pytest.raises(TypeError, match="nn.Module"):
        et.compress_activations("resnet", et.Bitmap())
    with pytest.raises(TypeError, match="parse_policy"):
        et.compress_activations(nn.Linear(2, 2), "bitmap")
    with pytest.raises(ValueError, match="min_bytes"):
        et.compress_activations(nn.Linear(2, 2), et.Bitmap(), min_bytes=-1)
    with pytest.raises(ValueError, match=">= 0"):
        et.Bitmap(threshold=-0.1)
    with pytest.raises(ValueError, match="value_dtype"):
        et.Bitmap(value_dtype=torch.int8)


def test_parse_policy_roundtrip_and_errors():
    assert et.parse_policy("dense") == et.Dense()
    assert et.parse_policy("bitmap") == et.Bitmap()
    p = et.parse_policy("bitmap:threshold=0.05,value_dtype=float16")
    assert p == et.Bitmap(threshold=0.05, value_dtype=torch.float16)
    assert et.parse_policy(p.spec()) == p
    with pytest.raises(ValueError, match="unknown policy 'zip'.*accepted: dense, bitmap"):
        et.parse_policy("zip")
    with pytest.raises(ValueError, match="accepted: threshold"):
        et.parse_policy("bitmap:sparsity=0.9")
    with pytest.raises(ValueError, match="not a number"):
        et.parse_policy("bitmap:threshold=abc")
    with pytest.raises(ValueError, match=">= 0"):
        et.parse_policy("bitmap:threshold=-1")


def test_checkpoint_every_matches_plain_training_and_lowers_the_peak():
    torch.manual_seed(0)
    net = torchvision.models.mobilenet_v2(num_classes=4)
    blocks = nn.Sequential(*net.features, nn.AdaptiveAvgPool2d(1), nn.Flatten(), net.classifier)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    plain = copy.deepcopy(blocks)
    loss0, grads0 = step(plain, x, y)

    flat_ledger = et.SavedTensorLedger()
    bitmap_only = copy.deepcopy(blocks)
    step(bitmap_only, x, y, et.compress_activations(bitmap_only, et.Bitmap(), ledger=flat_ledger))

    ledger = et.SavedTensorLedger()
    model = et.CheckpointEvery(blocks, every=4, ledger=ledger)
    loss1, grads1 = step(model, x, y)
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    for b0, b1 in zip(plain.buffers(), blocks.buffers()):
        assert torch.equal(b0, b1)  # running stats updated once, not twice
    assert ledger.peak_live_bytes < 0.75 * flat_ledger.peak_live_bytes
    with pytest.raises(ValueError, match="every"):
        et.CheckpointEvery(blocks, every=0)


@pytest.mark.parametrize("every", [1, 2])
def test_a_segment_that_starts_in_place_trains_like_plain_pytorch(every):
    # mobilenet_v3's classifier: a segment starting at Dropout(inplace=True) got a leaf that
    # requires grad in the recomputation ("a leaf Variable ... used in an in-place operation"),
    # and in the first pass would have changed the input checkpointing keeps for it.
    torch.manual_seed(0)
    blocks = nn.Sequential(nn.Linear(8, 16), nn.Hardswish(), nn.Dropout(0.5, inplace=True), nn.Linear(16, 3),
                           nn.ReLU(inplace=True))
    x, y = torch.randn(6, 8), torch.tensor([0, 1, 2, 0, 1, 2])
    loss0, grads0 = step(copy.deepcopy(blocks), x, y)
    loss1, grads1 = step(et.CheckpointEvery(blocks, every=every, policy=et.Dense()), x, y)
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))


def test_a_shared_tensor_is_decoded_once_per_backward(monkeypatch):
    calls = []
    original = et.BitmapTensor.unpack
    monkeypatch.setattr(et.BitmapTensor, "unpack", lambda self: calls.append(1) or original(self))
    model = ConvReluConv()
    with et.compress_activations(model, et.Bitmap()):
        loss = model(torch.randn(2, 3, 16, 16)).sum()
    loss.backward()
    # two stored entries (relu(conv1), relu(conv2)), each saved by two ops
    assert len(calls) == 2


@pytest.mark.parametrize("policy", [et.Dense(), et.Bitmap()])
def test_a_graph_dropped_without_backward_frees_what_it_saved(policy):
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.Linear(256, 4))
    with et.compress_activations(model, policy):
        # sigmoid saves its own output, which has no zeros: kept as is under both policies
        h = torch.sigmoid(model[1](model[0](torch.randn(64, 256))))
        out = model[2](h).sum()
    ref = weakref.ref(h)
    del h, out
    gc.collect()
    assert ref() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profile_on_cuda_measures_the_allocator_not_host_memory():
    from edgetorch.activations.profile import ProfileRequest, profile_one

    for policy in ("dense", "bitmap"):
        r = profile_one(ProfileRequest("torchvision:resnet18", batch=8, resolution=64, policy=policy, device="cuda"))
        assert r.peak_memory_kind == "cuda_max_allocated"
        assert r.step_peak_increase_bytes >= r.forward_increase_bytes > 0
        # The allocator holds what the ledger says the forward saved, plus logits and rounding.
        assert 0.98 * r.activation_bytes <= r.forward_increase_bytes <= 1.05 * r.activation_bytes + 2**20
