"""The quantized codec (codecs/quantized.py): golden bytes, error bounds, unbiased stochastic
rounding, non-finite groups, byte accounting and argument errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from edgetorch.codecs import BitmapTensor, pack_bitmap, pack_quantized, pack_quantized_sided, quantize_values
from edgetorch.codecs.bitmap import pack_bitmap_capped
from edgetorch.codecs.protocol import HeldTensor
from edgetorch.codecs.mask import pack_mask
from edgetorch.codecs.narrow import pack_narrow
from edgetorch.codecs.topk import pack_topk
from edgetorch.codecs.quantized import _hash_uniform

HYPO = settings(max_examples=60, deadline=None)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def expanded(per_group: torch.Tensor, group: int, n: int) -> torch.Tensor:
    return per_group.repeat_interleave(group, dim=1)[:, :n]


# --- golden bytes: the wire format the C and Triton kernels must also write ---------------------


def test_golden_8bit_codes_and_ranges() -> None:
    # Two groups in one row (8 elements, then a short one of 2); v = (x - lo) * 255 / d, rounded.
    q = pack_quantized(torch.tensor([[-1.0, 0, 1, 2, 3, 4, 5, 6, 10, 12]]), 8, group=8)
    assert q.codes.dtype == torch.uint8
    assert q.codes.tolist() == [[0, 36, 73, 109, 146, 182, 219, 255, 0, 255]]
    assert q.lo.tolist() == [[-1.0, 10.0]]
    assert q.scale.tolist() == [[torch.tensor(7 / 255).item(), torch.tensor(2 / 255).item()]]
    assert q.nbytes == 10 + 2 * 4 * 2


def test_golden_2bit_packing_is_least_significant_first() -> None:
    # lo 0, step 2.5: codes 0 0 1 1 2 2 2 3, four to a byte, element 0 in the low bits.
    q = pack_quantized(torch.tensor([[0.0, 1, 2, 3, 4, 5, 6, 7.5]]), 2, group=8)
    assert q.codes.tolist() == [[0b01010000, 0b11101010]]
    assert q.unpack().tolist() == [[0, 0, 2.5, 2.5, 5, 5, 5, 7.5]]


def test_golden_4bit_rows_pad_to_whole_bytes() -> None:
    # 3 elements a row at 4 bits: 2 bytes a row, the last high nibble 0.
    q = pack_quantized(torch.tensor([[0.0, 15.0, 5.0], [1.0, 1.0, 1.0]]), 4, group=8)
    assert q.codes.tolist() == [[0xF0, 0x05], [0x00, 0x00]]
    assert q.scale.tolist() == [[1.0], [0.0]] and q.lo.tolist() == [[0.0], [1.0]]


def test_golden_stochastic_hash() -> None:
    # The counter-based uniforms every kernel must reproduce, and one stochastic packing.
    assert _hash_uniform(torch.arange(4), 12345).tolist() == [
        0.0649571418762207, 0.9291001558303833, 0.1555212140083313, 0.41283518075942993]
    q = pack_quantized(torch.linspace(0, 1, 16).view(1, 16), 4, group=8, seed=99)
    assert q.codes.tolist() == [[48, 100, 184, 252, 48, 117, 169, 252]]


# --- properties ----------------------------------------------------------------------------------


finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@HYPO
@given(
    values=st.lists(finite, min_size=1, max_size=300),
    rows=st.sampled_from([1, 2, 3]),
    bits=st.sampled_from([8, 4, 2]),
    group=st.sampled_from([8, 16, 64, 128]),
    dtype=st.sampled_from(DTYPES),
    stochastic=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
@example(values=[0.0, 1.5, -1.5], rows=1, bits=4, group=8, dtype=torch.bfloat16, stochastic=False, seed=0)
def test_error_within_half_a_step_or_one_under_stochastic(values, rows, bits, group, dtype, stochastic, seed) -> None:
    n = len(values) // rows
    if n == 0:
        return
    x = torch.tensor(values[: rows * n], dtype=torch.float64).to(dtype).view(rows, n)
    assume(bool(torch.isfinite(x).all()))  # float16 overflows beyond 65504 (non-finite: tested below)
    q = pack_quantized(x, bits, group=group, seed=seed if stochastic else None)
    assert q.unpack().dtype == dtype and q.unpack().shape == x.shape
    assert q.codes.shape == (rows, math.ceil(n * bits / 8))
    assert q.lo.shape == q.scale.shape == (rows, math.ceil(n / group))
    assert q.nbytes == rows * math.ceil(n * bits / 8) + 8 * rows * math.ceil(n / group)
    ref = x.float()
    err = (q.unpack().float() - ref).abs()
    step = expanded(q.scale, group, n)
    # float32 arithmetic adds a few ulp; a 16-bit dtype adds its own rounding of the result
    slack = 1e-5 * (ref.abs() + step * 2**bits) + 1e-30
    if dtype in (torch.float16, torch.bfloat16):
        # the decoded value is rounded to the dtype, so the slack scales with it, not with x
        # (x = 0 between -1.5 and 1.5 decodes to 0.1 in bfloat16 as 0.10009765625)
        slack = slack + torch.maximum(ref.abs(), q.unpack().float().abs()) * torch.finfo(dtype).eps
    bound = step * (1.0 if stochastic else 0.5)
    assert bool((err <= bound + slack).all()), (err - bound).max()
    # a group's minimum and maximum come back exactly (codes 0 and L) under nearest rounding
    if not stochastic and dtype == torch.float32:
        assert torch.equal(q.unpack().amin(1), ref.amin(1))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_stochastic_rounding_is_unbiased(bits: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 256, generator=g)
    mean = sum(pack_quantized(x, bits, group=64, seed=s).unpack() for s in range(400)) / 400
    step = pack_quantized(x, bits, group=64).scale.max().item()
    # the mean of 400 draws of a value rounded up or down within one step: std <= step / 40
    assert (mean - x).abs().mean().item() < step / 40
    assert (pack_quantized(x, bits, group=64, seed=1).unpack() != pack_quantized(x, bits, group=64, seed=2).unpack()).any()
    assert torch.equal(pack_quantized(x, bits, group=64, seed=5).codes, pack_quantized(x, bits, group=64, seed=5).codes)


def test_nearest_rounding_is_the_best_code() -> None:
    x = torch.randn(2, 1000, generator=torch.Generator().manual_seed(1))
    q = pack_quantized(x, 4, group=128)
    step = expanded(q.scale, 128, 1000)
    lo = expanded(q.lo, 128, 1000)
    best = torch.round((x - lo) / step).clamp(0, 15)
    assert ((q.unpack() - x).abs() <= ((lo + best * step) - x).abs() + 1e-6).all()


@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
def test_a_group_with_a_non_finite_value_decodes_to_nan(special: float) -> None:
    x = torch.arange(24, dtype=torch.float32).view(1, 24)
    x[0, 9] = special
    out = pack_quantized(x, 8, group=8).unpack()
    assert torch.isnan(out[0, 8:16]).all()  # the group that held it: visibly diverged
    others = torch.cat([out[0, :8] - x[0, :8], out[0, 16:] - x[0, 16:]])
    assert (others.abs() <= 7 / 255 / 2 * 1.0001).all()  # the other groups are untouched by it


def test_a_range_that_overflows_float32_is_non_finite_not_clipped() -> None:
    x = torch.tensor([[-3e38, 3e38] + [0.0] * 6])
    assert torch.isnan(pack_quantized(x, 8, group=8).unpack()).all()


def test_float64_is_rounded_to_float32_first() -> None:
    x = torch.tensor([[1e300, 0.0] + [1.0] * 6], dtype=torch.float64)  # beyond float32: Inf
    assert torch.isnan(pack_quantized(x, 8, group=8).unpack()).all()


@pytest.mark.parametrize("shape", [(), (0,), (0, 4), (5,), (2, 3, 4, 5)])
def test_shapes_round_trip(shape) -> None:
    x = torch.randn(shape)
    q = pack_quantized(x, 8)
    assert q.unpack().shape == x.shape
    assert torch.allclose(q.unpack(), x, atol=q.scale.max().item() if q.scale.numel() else 0)


def test_non_contiguous_input_is_read_in_logical_order() -> None:
    x = torch.randn(16, 8).t()
    assert torch.equal(pack_quantized(x, 8, group=8).codes, pack_quantized(x.contiguous(), 8, group=8).codes)


def test_rows_keep_groups_apart() -> None:
    x = torch.cat([torch.zeros(1, 8), torch.full((1, 8), 1000.0)]).view(16)
    # one row of 16 with group 8 has the same groups as two rows: same ranges
    a, b = pack_quantized(x, 8, group=8, rows=1), pack_quantized(x, 8, group=8, rows=2)
    assert a.lo.flatten().tolist() == b.lo.flatten().tolist() == [0.0, 1000.0]


def test_bytes_at_the_default_group() -> None:
    x = torch.randn(8, 197, 768)
    for bits, ratio in [(8, 0.265625), (4, 0.140625), (2, 0.078125)]:
        assert pack_quantized(x, bits).nbytes / (4 * x.numel()) == ratio


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 3}, "bits must be one of 8, 4, 2"),
        ({"bits": True}, "bits must be one of"),
        ({"group": 12}, "multiple of 8"),
        ({"group": 0}, "multiple of 8"),
        ({"rows": 5}, "rows must be a positive int dividing"),
        ({"seed": -1}, "seed must be None"),
        ({"seed": 2**32}, "seed must be None"),
    ],
)
def test_bad_arguments_say_what_is_accepted(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        pack_quantized(torch.randn(4, 16), **kwargs)


def test_integer_tensors_are_refused() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        pack_quantized(torch.arange(10))


# --- quantized values of another codec (Back Razor's "+ Mesa") ----------------------------------


def test_quantized_values_of_a_bitmap() -> None:
    x = torch.relu(torch.randn(4, 1000, generator=torch.Generator().manual_seed(3)))
    packed = pack_bitmap(x)
    held = quantize_values(packed, 8)
    assert held.nnz == packed.nnz
    assert held.nbytes == packed.bitmap.numel() + held.values.nbytes
    assert held.nbytes < packed.nbytes / 3
    out = held.unpack()
    assert torch.equal(out == 0, x == 0)  # positions stay exact; only values are rounded
    assert (out - x).abs().max() <= held.values.scale.max() / 2 * 1.001
    assert isinstance(packed, BitmapTensor) and packed.values.numel() == packed.nnz  # input untouched


@HYPO
@given(
    values=st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=1, max_size=200),
    bits=st.sampled_from([8, 4, 2]),
    dtype=st.sampled_from(DTYPES),
    ends=st.tuples(st.floats(-4, 4, width=16), st.floats(0.25, 6, width=16)),
)
@example(values=[-3.01, -2.99, 2.999, 3.001, -3.0, 3.0], bits=2, dtype=torch.float32, ends=(-3.0, 6.0))
def test_sided_keeps_every_value_on_its_side_and_within_the_codes_error(values, bits, dtype, ends) -> None:
    low, high = ends[0], ends[0] + ends[1]
    x = torch.tensor(values, dtype=dtype).view(1, -1)
    s = pack_quantized_sided(x, bits, low, high, group=64)
    out, plain = s.unpack(), s.values.unpack()
    assert out.dtype == dtype and out.shape == x.shape
    assert s.nbytes == s.values.nbytes + math.ceil(x.numel() / 8)
    inside = (x > low) & (x < high)
    assert torch.equal((out > low) & (out < high), inside)
    # inside, keeping a decoded value inside only moves it towards x; outside, only the end is read
    assert bool(((out - x).abs() <= (plain - x).abs())[inside].all())
    assert bool((out[~inside] == torch.where(x[~inside] >= high, high, low).to(dtype)).all())


def test_sided_refuses_an_empty_or_infinite_interval() -> None:
    for low, high in [(3.0, 3.0), (1.0, -1.0), (-math.inf, 3.0)]:
        with pytest.raises(ValueError, match="low < high"):
            pack_quantized_sided(torch.zeros(1, 8), 8, low, high)


# --- the C kernels' batched path: whole groups of a multiple of 32, ranges found 8 at a time -----


@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_batched_groups_write_the_reference_bytes(group: int) -> None:
    # The AVX2 kernels find the ranges of up to 8 consecutive whole groups together (special
    # groups anywhere in a batch, batches cut short by a row's end or its short last group) and
    # must write what the torch ops write, on every instruction set the CPU runs.
    from edgetorch.codecs import _cpu_kernels
    from edgetorch.codecs._cpu_kernels import torch_ops

    if not _cpu_kernels.NATIVE:
        pytest.skip("the C extension is not built")
    native = _cpu_kernels._native
    g = torch.Generator().manual_seed(group)
    rows, n = 3, group * 19 + 40  # 19 whole groups a row (batches of 8, 8, 3) and a short one
    x = torch.randn(rows, n, generator=g, dtype=torch.float64) * 3
    specials = [math.nan, math.inf, -math.inf, 3e38]
    for k, where in enumerate([0, 7, 8, 13, 18, 19]):  # first / last of a batch, the short group
        x[k % rows, where * group + 5] = specials[k % len(specials)]
    x[1, 2 * group:3 * group] = 0.0
    x[1, 2 * group + 3] = -0.0  # a -0.0 minimum after a +0.0: lo is the first zero, +0.0
    x[2, 9 * group:10 * group] = 0.0
    x[2, 9 * group] = -0.0  # ... and a -0.0 first: lo = -0.0
    x[2, 10 * group:11 * group] = 7.0  # constant
    x[0, 4 * group:5 * group] = 0.0
    x[0, 4 * group + 1] = 1e-45  # d of one subnormal: L / d overflows to inv = Inf
    saved = native.isa()
    try:
        for isa in native.isa_available():
            native.set_isa(isa)
            for dtype in DTYPES:
                xd = x.to(dtype)
                for bits in (8, 4, 2):
                    for seed in (None, 77):
                        q = pack_quantized(xd, bits, group=group, seed=seed)
                        with torch_ops():
                            r = pack_quantized(xd, bits, group=group, seed=seed)
                        assert torch.equal(q.codes, r.codes), (isa, dtype, bits, seed)
                        assert torch.equal(q.lo.view(torch.int32), r.lo.view(torch.int32)), (isa, dtype, bits, seed)
                        assert torch.equal(q.scale.view(torch.int32), r.scale.view(torch.int32))
                        out = q.unpack()
                        with torch_ops():
                            ref = r.unpack()
                        assert torch.equal(torch.isnan(out), torch.isnan(ref))
                        assert torch.equal(out.nan_to_num(0.0), ref.nan_to_num(0.0)), (isa, dtype, bits, seed)
    finally:
        native.set_isa(saved)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sided_decoding_on_the_c_kernels_equals_the_torch_ops(dtype: torch.dtype) -> None:
    # SidedQuantizedTensor.unpack on CPU selects bitwise from the C bitmap kernels; the bits must
    # be those of the torch ops' where/clamp (NaN inside stays NaN, outside reads low; both zeros).
    from edgetorch.codecs import _cpu_kernels
    from edgetorch.codecs._cpu_kernels import torch_ops

    if not _cpu_kernels.NATIVE:
        pytest.skip("the C extension is not built")
    ints = {torch.float64: torch.int64, torch.float32: torch.int32}.get(dtype, torch.int16)
    g = torch.Generator().manual_seed(5)
    for low, high in [(-3.0, 3.0), (-1.0, 6.0), (0.0, 0.1), (-2.99, 3.01)]:
        x = torch.randn(5, 300, generator=g, dtype=torch.float64) * 4
        x[0, :10] = torch.tensor([low, high, -0.0, 0.0, math.nan, math.inf, -math.inf, (low + high) / 2,
                                  low - 1e-7, high + 1e-7], dtype=torch.float64)
        x[3, 128:192] = math.nan  # a non-finite group: decodes to NaN everywhere
        x = x.to(dtype)
        for bits in (8, 4, 2):
            s = pack_quantized_sided(x, bits, low, high, group=64)
            out = s.unpack()
            with torch_ops():
                ref = s.unpack()
            assert out.dtype == ref.dtype and out.shape == ref.shape
            assert torch.equal(out.view(ints), ref.view(ints)), (low, high, bits)


def test_every_held_form_answers_the_codec_protocol() -> None:
    x = torch.relu(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))
    forms = [pack_bitmap(x), pack_bitmap_capped(x, 40), pack_topk(x, 0.5), pack_mask(x, 0.0), pack_quantized(x, 4),
             pack_quantized_sided(x, 4, -1.0, 1.0), quantize_values(pack_topk(x, 0.5))]
    for form in forms + [pack_narrow(torch.arange(300))]:
        assert isinstance(form, HeldTensor), type(form).__name__
    for form in forms:
        assert form.unpack().shape == x.shape and form.nbytes > 0
    assert not isinstance(x, HeldTensor)  # a tensor has nbytes, but neither nnz nor unpack
