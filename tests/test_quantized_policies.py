"""Quantized activation storage as policies: Quantized(bits), BackRazor(exact="int8") and
BackRazor(values="int8"): what each stores, where gradients stay exact, and the spec strings."""

import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetorch as et
from edgetorch.activations.roles import Need, NeedKind
from edgetorch.codecs import QuantizedTensor, QuantizedValues

from test_backrazor import CNN_INPUT, FusedAttention, SmallCNN, compare, tiny_vit


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def worst_cosine(reference: dict, other: dict, keys=None) -> float:
    """Smallest gradient cosine over the parameters, leaving out gradients that are zero up to
    rounding noise (a conv bias before batch norm: its exact gradient is 0, and cosine of noise
    is meaningless)."""
    scale = max(g.norm() for g in reference.values())
    return min(cosine(reference[k], other[k]) for k in (keys or reference) if reference[k].norm() > 1e-5 * scale)


def forms(ledger: et.SavedTensorLedger) -> set[tuple[str, str]]:
    return {(r.op, r.form) for r in ledger.records if r.dense_bytes}


class BnSiLU(nn.Module):
    """Conv -> trained BN -> in-place SiLU (EfficientNet's block) -> conv -> head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.SiLU(inplace=True),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.SiLU(inplace=True))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.body(x), 1).flatten(1))


BN_INPUT = (torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3]))


def test_quantized_8bit_stores_every_float_tensor_at_a_quarter_and_moves_gradients_little():
    torch.manual_seed(0)
    ledger = et.SavedTensorLedger()
    (o0, dx0, g0), (o1, dx1, g1) = compare(BnSiLU(), *BN_INPUT, et.Quantized(8), ledger)
    assert torch.equal(o0, o1)  # the forward never reads the stored copies
    total = ledger.total()
    assert 0.25 < total.stored_bytes / total.dense_bytes < 0.30
    assert {r.form for r in ledger.records if r.dense_bytes > 1024} == {"int8"}  # tiny ones stay as they are
    assert cosine(dx0, dx1) > 0.999
    assert worst_cosine(g0, g1) > 0.99


def test_quantized_keeps_relu_masks_exact_so_input_gradients_stay_exact_without_batch_norm():
    # Rounding a small positive ReLU output to 0 closes its gradient: resnet50's 8-bit input
    # gradient had a cosine of 0.92 before masks were kept. Without batch norm, only weight
    # gradients read the rounded copies.
    torch.manual_seed(0)
    ledger = et.SavedTensorLedger()
    (o0, dx0, g0), (o1, dx1, g1) = compare(SmallCNN(), *CNN_INPUT, et.Quantized(2), ledger)
    assert torch.equal(dx0, dx1)
    assert {"mask(0,inf)", "mask(0,6)", "int2"} <= {r.form for r in ledger.records}
    assert not all(torch.equal(g0[k], g1[k]) for k in g0)  # the weights' inputs were rounded


class HardActivations(nn.Module):
    """MobileNetV3's activations: hardswish, and the hardsigmoid of squeeze-excitation."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 3)

    def forward(self, x):
        h = F.hardswish(self.a(x))
        return self.head(h * F.hardsigmoid(self.b(h)))


def test_hardswish_keeps_each_value_on_its_side_of_the_kinks_and_hardsigmoid_is_a_mask():
    torch.manual_seed(0)
    model, x, y = HardActivations(), 4 * torch.randn(16, 8), torch.arange(16) % 3
    ledger = et.SavedTensorLedger()
    (_, dx0, _), (_, dx1, _) = compare(model, x, y, et.Quantized(8), ledger)
    assert ("hardsigmoid", "mask(-3,3)") in forms(ledger)
    hardswish = next(r for r in ledger.records if r.op == "hardswish")
    # 8-bit codes, one side bit per element, a min and step per 64
    assert hardswish.stored_bytes == 16 * (64 + 64 // 8 + 8)
    assert cosine(dx0, dx1) > 0.9999

    # hardswish's slope is 0 below -3, x/3 + 1/2 between, 1 above: a value rounded across
    # -3 or 3 gets the wrong piece (a jump of 0.5); with the side bit, never.
    t = torch.linspace(-3.5, 3.5, 64 * 8).view(8, 64)[:, torch.randperm(64)]
    need = et.activations.roles.input_need("hardswish", t, (t,), {}, lambda _: False)
    slope = torch.ops.aten.hardswish_backward(torch.ones_like(t), t)
    for policy in (et.Quantized(2), et.BackRazor(0.9, exact="int2")):
        stored = policy.encode(t, need).unpack()
        sided = torch.ops.aten.hardswish_backward(torch.ones_like(t), stored)
        assert torch.equal((stored > -3) & (stored < 3), (t > -3) & (t < 3))  # torch: -3 and 3 are outside
        assert (sided - slope).abs().max() <= 6 / 3 / 3 / 2 + 1e-6  # half a 2-bit step of the clamped range 6, slope 1/3
    unsided = torch.ops.aten.hardswish_backward(torch.ones_like(t), _Unsided(2).encode(t, need).unpack())
    assert (unsided - slope).abs().max() > 0.4  # a value rounded across -3: 0 against about -0.5


@dataclass(frozen=True)
class _Unsided(et.Quantized):
    """Quantized with hardswish's sides left to the codes, to show what the side bit buys."""

    def encode(self, t, need):
        return super().encode(t, replace(need, kinks=None))


def test_fewer_bits_store_less_and_move_gradients_more():
    torch.manual_seed(0)
    results = {}
    for bits in (8, 4, 2):
        ledger = et.SavedTensorLedger()
        (_, dx0, _), (_, dx1, _) = compare(BnSiLU(), *BN_INPUT, et.Quantized(bits), ledger)
        results[bits] = (ledger.total().stored_bytes, cosine(dx0, dx1))
    assert results[8][0] > results[4][0] > results[2][0]
    assert results[8][1] > results[4][1] > results[2][1]


def test_stochastic_rounding_repeats_under_the_same_seed():
    model, (x, y) = BnSiLU(), BN_INPUT
    policy = et.Quantized(4, stochastic=True)
    torch.manual_seed(3)
    a = compare(model, x, y, policy)[1][1]
    torch.manual_seed(3)
    b = compare(model, x, y, policy)[1][1]
    nearest = compare(model, x, y, et.Quantized(4))[1][1]
    assert torch.equal(a, b) and not torch.equal(a, nearest)


def test_exact_int8_quantizes_batch_norm_and_silu_inputs_and_keeps_relu_masks_exact():
    torch.manual_seed(0)
    default, int8 = et.SavedTensorLedger(), et.SavedTensorLedger()
    compare(BnSiLU(), *BN_INPUT, et.BackRazor(0.9), default)
    (o0, dx0, g0), (o1, dx1, g1) = compare(BnSiLU(), *BN_INPUT, et.BackRazor(0.9, exact="int8"), int8)
    assert ("native_batch_norm", "exact") in forms(default) and ("silu_", "exact") in forms(default)
    assert {("native_batch_norm", "int8"), ("silu_", "int8"), ("convolution", "prune")} <= forms(int8)
    assert int8.total().stored_bytes < 0.5 * default.total().stored_bytes
    assert torch.equal(o0, o1) and cosine(dx0, dx1) > 0.999
    # A ReLU network without batch norm has nothing to quantize: the same bytes and gradients.
    plain, quantized = et.SavedTensorLedger(), et.SavedTensorLedger()
    (_, dx2, g2), (_, dx3, g3) = compare(SmallCNN(), *CNN_INPUT, et.BackRazor(0.9), plain)
    torch.manual_seed(0)
    (_, dx4, g4) = compare(SmallCNN(), *CNN_INPUT, et.BackRazor(0.9, exact="int8"), quantized)[1]
    assert torch.equal(dx3, dx4) and all(torch.equal(g3[k], g4[k]) for k in g3)
    assert plain.total().stored_bytes == quantized.total().stored_bytes


def test_exact_int8_on_a_vision_transformer():
    torch.manual_seed(0)
    vit, x, y = tiny_vit(), torch.randn(2, 3, 32, 32), torch.tensor([1, 4])
    default, int8 = et.SavedTensorLedger(), et.SavedTensorLedger()
    (o0, dx0, g0), (_, dx_default, g_default) = compare(vit, x, y, et.BackRazor(0.9), default)
    (_, _, _), (o1, dx1, g1) = compare(vit, x, y, et.BackRazor(0.9, exact="int8"), int8)
    assert torch.equal(o0, o1)
    assert {("gelu", "int8"), ("native_layer_norm", "int8")} <= forms(int8)
    assert int8.total().stored_bytes < 0.5 * default.total().stored_bytes
    assert cosine(dx0, dx1) > 0.99
    # the parameters default Back Razor leaves exact stay close under int8
    exact_by_default = [k for k in g0 if torch.equal(g0[k], g_default[k])]
    assert exact_by_default and worst_cosine(g0, g1, exact_by_default) > 0.99


def test_fused_attention_q_and_k_are_rounded_but_the_logsumexp_stays_exact():
    torch.manual_seed(0)
    model, x, y = FusedAttention(), torch.randn(4, 64, 32), torch.tensor([0, 1, 2, 0])
    ledger = et.SavedTensorLedger()
    (_, dx0, g0), (_, dx1, g1) = compare(model, x, y, et.BackRazor(0.9, exact="int8"), ledger)
    attention = sorted((len(r.shape), r.form) for r in ledger.records if "attention" in r.op and r.dense_bytes)
    assert attention == [(3, "exact"), (4, "int8"), (4, "int8"), (4, "int8"), (4, "int8")]  # lse; q, k, v, out
    assert cosine(dx0, dx1) > 0.99


def test_values_int8_holds_the_kept_values_quantized():
    torch.manual_seed(0)
    full, quantized = et.SavedTensorLedger(), et.SavedTensorLedger()
    (_, dx0, g0), (_, dx1, g1) = compare(SmallCNN(), *CNN_INPUT, et.BackRazor(0.8), full)
    (_, dx2, g2) = compare(SmallCNN(), *CNN_INPUT, et.BackRazor(0.8, values="int8"), quantized)[1]
    assert torch.equal(dx1, dx2)  # input gradients read the exact masks, not the values
    pruned = lambda ledger: sum(r.stored_bytes for r in ledger.records if r.form == "prune")  # noqa: E731
    assert pruned(quantized) < 0.6 * pruned(full)
    assert {r.nnz for r in quantized.records if r.form == "prune"} == {r.nnz for r in full.records if r.form == "prune"}
    assert worst_cosine(g1, g2) > 0.99


def test_encode_returns_the_quantized_codecs():
    x = torch.randn(4, 1000)
    assert isinstance(et.Quantized(4).encode(x, et.activations.roles.Need(et.activations.roles.NeedKind.EXACT, op="gelu")), QuantizedTensor)
    assert not isinstance(et.Quantized(4).encode(x), QuantizedTensor)  # no op known: kept lossless
    kept = et.BackRazor(0.9, values="int8").encode(x, et.activations.roles.Need(et.activations.roles.NeedKind.PRUNE))
    assert isinstance(kept, QuantizedValues) and kept.nnz == 4 * 100


@pytest.mark.parametrize("spec", ["quantized", "quantized:bits=4", "quantized:bits=2,group=64,stochastic=true",
                                  "backrazor:sparsity=0.9,exact=int8", "backrazor:sparsity=0.8,exact=int8,values=int8",
                                  "backrazor:sparsity=0.95,scope=all,exact=int4"])
def test_specs_round_trip(spec):
    policy = et.parse_policy(spec)
    assert et.parse_policy(policy.spec()) == policy


def test_spec_words():
    assert et.parse_policy("backrazor:exact=int8") == et.BackRazor(0.9, exact="int8")
    assert et.parse_policy("backrazor:exact=lossless") == et.BackRazor(0.9)
    assert et.parse_policy("quantized:bits=4,stochastic=true") == et.Quantized(4, stochastic=True)
    assert et.BackRazor(0.8, exact="int8", values="int8").spec() == "backrazor:sparsity=0.8,exact=int8,values=int8"


@pytest.mark.parametrize(("spec", "message"), [
    ("quantized:bits=3", "bits must be one of 8, 4, 2"),
    ("quantized:bits=eight", "not a whole number"),
    ("quantized:group=12", "multiple of 8"),
    ("quantized:stochastic=maybe", "accepted are true or false"),
    ("backrazor:exact=int3", "exact must be None or one of int8, int4, int2"),
    ("backrazor:values=fp8", "values must be None or one of"),
    ("backrazor:values=int8,value_dtype=float16", "not both"),
    ("quantised", "accepted: dense, bitmap, quantized, backrazor"),
    # per-block plans (edgetorch.activations.blocks.PerBlock.spec)
    ("per-block", "written per-block\\(BLOCK=POLICY"),
    ("per-block(layer1.0 bitmap)", "bad item 'layer1.0 bitmap'"),
    ("per-block(layer1.0=)", "bad item 'layer1.0='"),
    ("per-block(layer1.0=zip)", "unknown policy 'zip'"),
    ("per-block(layer1.0=bitmap; default=recompute(bitmap))", "Recompute\\(policy\\) for a block"),
    ("per-block(layer1.0=per-block(layer1.1=dense))", "not a PerBlock"),
])
def test_bad_specs_say_what_is_accepted(spec, message):
    with pytest.raises(ValueError, match=message):
        et.parse_policy(spec)


def test_retain_graph_decodes_the_same_gradients_twice():
    x = BN_INPUT[0].clone().requires_grad_(True)
    with et.compress_activations(model := BnSiLU(), et.BackRazor(0.9, exact="int8", values="int8")):
        loss = model(x).sum()
    first = torch.autograd.grad(loss, x, retain_graph=True)[0]
    assert torch.equal(first, torch.autograd.grad(loss, x)[0])


def test_checkpointed_segment_inputs_stay_exact_under_quantized():
    # A rounded segment input would be carried through the whole recomputed segment: resnet50
    # with checkpointed stages had an input-gradient cosine of 0.987 at 8 bits. Segment inputs
    # (saved by checkpointing, no ATen op) stay lossless; inside the segments, ReLU masks are
    # exact and only weight gradients read rounded copies, so the input gradient is exact.
    torch.manual_seed(0)
    blocks = nn.Sequential(*(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()) for _ in range(4)))
    x = torch.randn(2, 8, 12, 12, requires_grad=True)
    blocks(x).square().sum().backward()
    dx0, g0 = x.grad.clone(), [p.grad.clone() for p in blocks.parameters()]
    x.grad = None
    blocks.zero_grad()
    ledger = et.SavedTensorLedger()
    et.CheckpointEvery(blocks, every=2, policy=et.Quantized(8), ledger=ledger)(x).square().sum().backward()
    assert torch.equal(x.grad, dx0)
    assert worst_cosine(dict(enumerate(g0)), dict(enumerate(p.grad for p in blocks.parameters()))) > 0.999
    assert {("?", "exact"), ("convolution", "int8")} <= {(r.op, r.form) for r in ledger.records}


class HardswishAndLinearShareAnInput(nn.Module):
    """One tensor read by hardswish (which needs only its piece outside (-3, 3)) and by a Linear
    (whose weight gradient needs its values): a clamped, sided copy must not serve the Linear."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 32), nn.Linear(32, 3), nn.Linear(32, 3)

    def forward(self, x):
        h = self.a(x)
        return self.head(F.hardswish(h)) + self.b(h)


@pytest.mark.parametrize("policy", [et.Quantized(8), et.BackRazor(0.5, exact="int8")])
def test_a_sided_copy_never_serves_a_need_for_the_values(policy):
    torch.manual_seed(0)
    model, x, y = HardswishAndLinearShareAnInput(), 6 * torch.randn(512, 8), torch.arange(512) % 3
    ledger = et.SavedTensorLedger()
    (_, _, g0), (_, _, g1) = compare(model, x, y, policy, ledger)
    assert ("hardswish", "int8-sided(-3,3)") in {(r.op, r.form) for r in ledger.records}
    # b's weight gradient reads h: rounded at 8 bits it stays close; clamped into (-3, 3) it would not
    assert cosine(g0["b.weight"], g1["b.weight"]) > (0.999 if isinstance(policy, et.Quantized) else 0.8)


def test_a_policy_subclass_with_a_name_of_its_own_parses_by_it():
    @dataclass(frozen=True)
    class Halves(et.Policy):
        name = "halves-test"
        keep: float = 0.5

        def encode(self, t, need=et.activations.roles.EXACT):
            return None

    try:
        assert et.parse_policy("halves-test:keep=0.25") == Halves(keep=0.25)
        assert Halves(keep=0.25).spec() == "halves-test:keep=0.25"
    finally:
        del et.activations.policies.POLICIES["halves-test"]
    with pytest.raises(ValueError, match="unknown policy 'halves-test'"):
        et.parse_policy("halves-test")


def test_forms_are_interned_and_named_as_the_ledger_shows_them():
    from edgetorch.activations.forms import EXACT_FORM, FormKind, mask_form, quantized_form

    assert mask_form(0.0, math.inf) is mask_form(0.0, math.inf) and mask_form(0.0, 6.0).text == "mask(0,6)"
    sided = quantized_form(8, (-3.0, 3.0))
    assert sided is quantized_form(8, (-3.0, 3.0)) and sided.text == "int8-sided(-3,3)" and sided.bits == 8
    assert quantized_form(4).kind is FormKind.QUANTIZED and quantized_form(4).interval is None
    razor = et.BackRazor(0.9, exact="int8")
    # a plain quantized copy serves a top-k need; a sided one (only the pieces outside the kinks) does not
    assert razor.covers(quantized_form(8), et.activations.forms.PRUNE_FORM)
    assert not razor.covers(sided, et.activations.forms.PRUNE_FORM) and razor.covers(EXACT_FORM, sided)


def test_a_policy_name_already_taken_is_refused_and_names_are_looked_up_in_lower_case():
    with pytest.raises(ValueError, match="policy name 'bitmap' is taken by Bitmap"):
        @dataclass(frozen=True)
        class Shadow(et.Bitmap):
            name = "Bitmap"

    @dataclass(frozen=True)
    class Mixed(et.Dense):
        name = "Mixed-Case-Test"

    try:
        assert type(et.parse_policy("Mixed-Case-Test")) is Mixed
    finally:
        del et.activations.policies.POLICIES["mixed-case-test"]


def _held_tensors(rep) -> list[torch.Tensor]:
    """Every tensor a stored form holds, in a fixed order (its bytes)."""
    if isinstance(rep, torch.Tensor):
        return [rep]
    return [t for v in vars(rep).values() for t in _held_tensors(v)] if hasattr(rep, "__dict__") else []


@pytest.mark.parametrize("policy", [et.Quantized(8), et.Quantized(2, stochastic=True), et.BackRazor(0.7),
                                    et.BackRazor(0.7, exact="int4"), et.BackRazor(0.7, values="int8"), et.Bitmap()],
                         ids=lambda p: p.spec())
@pytest.mark.parametrize("need", [Need(NeedKind.EXACT, prunable=True, op="gelu"),
                                  Need(NeedKind.MASK, 0.0, 6.0, 3.0, 0.0, op="hardtanh_"),
                                  Need(NeedKind.PRUNE, op="convolution"),
                                  Need(NeedKind.EXACT, prunable=True, op="hardswish", kinks=(-3.0, 3.0))],
                         ids=lambda n: n.op)
def test_encode_region_stores_the_bytes_of_encode_on_rows_and_decodes_to_the_saved_shape(policy, need):
    # The engine hands the saved region as it is with its rows (no [rows, n] view at pack, none
    # back at unpack): the built-in policies must store exactly what they store for the view.
    t = torch.relu(torch.randn(4, 6, 5, 3)) - 0.25
    t[1, 2] = 0
    rows = 2  # not the outermost extent: the codecs must take rows from the engine
    form = policy.form(need)
    torch.manual_seed(3)
    by_view = policy.encode(t.view(rows, -1), need)
    torch.manual_seed(3)
    by_region = policy.encode_region(t, rows, need, form)
    assert type(by_region) is type(by_view)
    if by_view is None:
        return
    held, expected = _held_tensors(by_region), _held_tensors(by_view)
    assert len(held) == len(expected) > 0
    for a, b in zip(held, expected):
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1), b.reshape(-1))
    decoded = by_region.unpack()
    assert decoded.shape == t.shape
    assert torch.equal(decoded.reshape(-1), by_view.unpack().reshape(-1))
