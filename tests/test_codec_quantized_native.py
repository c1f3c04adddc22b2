"""The quantized codec's C kernels (codecs/_native.c) against its torch-ops reference, byte for byte.

Codes, ``lo``, ``scale`` and the decoded tensor's bits must equal what ``quantized._quantize_torch``
and ``_dequantize_torch(...).to(dtype)`` write, for every input: every instruction set this CPU runs
(the portable C loops included), every element type, both roundings, non-finite and signed-zero
groups, subnormals, ranges that overflow, tensors of many chunks on two threads. The golden tests
of test_codec_quantized.py run on both paths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import test_codec_quantized as golden
from edgetorch.codecs import _backend, _cpu_kernels, pack_quantized
from edgetorch.codecs._cpu_kernels import torch_ops
from edgetorch.codecs.quantized import QuantizedTensor, _group_ranges, _hash_uniform

pytestmark = pytest.mark.skipif(not _cpu_kernels.NATIVE, reason="the C extension is not built")
ISAS = _cpu_kernels._native.isa_available() if _cpu_kernels.NATIVE else ()
CHUNK = _cpu_kernels.CHUNK_ELEMS
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
          torch.bfloat16: torch.int16}
NAN, INF = float("nan"), float("inf")
# NaN, Infs, signed zeros, float32 subnormals, float16 subnormals/extremes, values whose range overflows
SPECIALS = [NAN, INF, -INF, 0.0, -0.0, 1e-45, -1e-45, 1e-40, 6e-8, -6e-8, 6.1e-5, 65504.0, -65504.0,
            3e38, -3e38, 1.0, -1.0]
HYPO = settings(max_examples=50, deadline=None)


@contextlib.contextmanager
def isa(name: str):
    saved = _cpu_kernels._native.isa()
    _cpu_kernels._native.set_isa(name)
    try:
        yield
    finally:
        _cpu_kernels._native.set_isa(saved)


@contextlib.contextmanager
def threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_OF[t.dtype]) if t.dtype in INT_OF else t


def assert_same(x: torch.Tensor, bits_: int, group: int, seed: int | None, rows: int | None = None) -> QuantizedTensor:
    """Pack and unpack ``x`` on both paths; every byte must agree. Returns the native packing."""
    q = pack_quantized(x, bits_, group=group, seed=seed, rows=rows)
    out = q.unpack()
    with torch_ops():
        r = pack_quantized(x, bits_, group=group, seed=seed, rows=rows)
        ref = r.unpack()
    assert torch.equal(q.codes, r.codes), (q.codes != r.codes).nonzero()[:5]
    assert torch.equal(bits(q.lo), bits(r.lo)), (bits(q.lo) != bits(r.lo)).nonzero()[:5]
    assert torch.equal(bits(q.scale), bits(r.scale))
    assert out.dtype == ref.dtype == x.dtype and out.shape == ref.shape == x.shape
    assert torch.equal(bits(out), bits(ref)), (bits(out) != bits(ref)).nonzero()[:5]
    return q


def sample(rows: int, n: int, dtype: torch.dtype, magnitude: float, special_frac: float, ints: bool,
           seed: int) -> torch.Tensor:
    """Random values of about ``magnitude`` (rounded to integers for ties and constant groups), some
    replaced by specials, in ``dtype`` (float16 overflows to Inf beyond 65504: a non-finite group)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g, dtype=torch.float64) * magnitude
    if ints:
        x = x.round()
    pick = torch.rand(rows, n, generator=g) < special_frac
    specials = torch.tensor(SPECIALS, dtype=torch.float64)
    x[pick] = specials[torch.randint(0, len(SPECIALS), (int(pick.sum()),), generator=g)]
    return x.to(dtype)


@HYPO
@given(
    isa_name=st.sampled_from(ISAS or ["generic"]),
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 4),
    n=st.integers(1, 300),
    bits_=st.sampled_from([8, 4, 2]),
    group=st.sampled_from([8, 16, 24, 64, 128]),
    stochastic=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    magnitude=st.sampled_from([1e-42, 1e-6, 1.0, 1e4, 1e30]),
    special_frac=st.sampled_from([0.0, 0.02, 0.3]),
    ints=st.booleans(),
)
def test_native_matches_reference(isa_name, dtype, rows, n, bits_, group, stochastic, seed, magnitude, special_frac,
                                  ints) -> None:
    x = sample(rows, n, dtype, magnitude, special_frac, ints, seed % 1000)
    with isa(isa_name):
        assert_same(x, bits_, group, seed if stochastic else None)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_groups(isa_name: str, dtype: torch.dtype) -> None:
    groups = [
        [NAN, 1, 2, 3, 4, 5, 6, 7],             # NaN: lo = scale = NaN, codes 0
        [1, 2, INF, 3, 4, 5, 6, 7],             # +Inf
        [-INF, 2, 3, 4, 5, 6, 7, 8],            # -Inf
        [0.0, -0.0, 1, 2, 3, 4, 5, 6],          # the first zero is lo: +0.0
        [-0.0, 0.0, 1, 2, 3, 4, 5, 6],          # ... -0.0
        [3, 0.0, 4, -0.0, 5, 6, 7, 8],          # ... +0.0, not in first place
        [-0.0, -0.0, -0.0, 0.0, 0, 0, 0, 0],    # constant zeros of both signs
        [-0.0] * 8,
        [5.0] * 8,                              # constant: scale 0
        [-3e38, 3e38, 0, 0, 0, 0, 0, 0],        # the range overflows float32: NaN
        [0.0, 1e-45, 0, 1e-45, 0, 0, 0, 0],     # d = 1 subnormal: L / d overflows (inv = Inf)
        [1e-40, 2e-40, 3e-40, -1e-40, 0, 1e-45, 4e-40, 5e-40],  # float32 subnormals
        [6e-8, 1.2e-7, 6.1e-5, -6e-8, 0, 3e-5, 1e-6, 2e-6],     # float16 subnormals
        [65504, -65504, 1, 2, 3, 4, 5, 6],      # float16's extremes
        [1e38, 2e38, 3e38, 3.4e38, 0, 1, 2, 3],  # decoded lo + code * scale can overflow to Inf
        [0, 1, 2, 3, 4, 5, 6, 7.5],
    ]
    x = torch.tensor(groups, dtype=torch.float64).to(dtype).view(1, -1)
    with isa(isa_name):
        for bits_ in (8, 4, 2):
            for seed in (None, 7):
                assert_same(x, bits_, 8, seed)
                # each case as a group of 72 (the SIMD loops take 32 at a time, the C loops the rest)
                assert_same(x.view(-1, 8).repeat_interleave(9, 0).view(-1, 72), bits_, 72, seed)


def test_every_operation_rounds_as_the_torch_ops_do() -> None:
    # A fused multiply-add (FMA, what a compiler may contract a * b + c into) rounds once where the
    # torch ops round twice. Under nearest rounding floor((x - lo) * inv + 0.5) is the same either
    # way, but a stochastic offset flips a few codes (3 of these 524,288) and lo + code * scale
    # differs in the last bit often. Both must be the twice-rounded values.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 128, generator=g)
    lo, scale, inv = _group_ranges(x, 8, 128)
    u = _hash_uniform(torch.arange(x.numel()).view(x.shape), 99)
    twice = torch.floor((x - lo) * inv + u)
    once = torch.floor(((x - lo).double() * inv.double() + u.double()).float())
    tricky = twice != once
    assert tricky.any()
    for name in ISAS:
        with isa(name):
            q = assert_same(x, 8, 128, 99)
            assert torch.equal(q.codes[tricky].float(), twice[tricky])
            once_decoded = (q.lo.double() + q.codes.double() * q.scale.double()).float()
            assert (bits(once_decoded) != bits(q.unpack())).sum() > 1000


@pytest.mark.parametrize("bits_", [8, 4, 2])
def test_many_chunks_on_two_threads(bits_: int) -> None:
    # rows of 40,000 elements (a short last group), 5 chunks; short rows (many rows per task);
    # groups longer than the kernel's 256-code block, not a multiple of it
    g = torch.Generator().manual_seed(bits_)
    with threads(2):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(4, 40_000, generator=g) * 3).to(dtype)
            x[1, 777] = NAN
            for seed in (None, 123):
                assert_same(x, bits_, 128, seed)
        assert_same(torch.randn(20_000, 10, generator=g), bits_, 8, 5)
        assert_same(torch.randn(3, 3 * CHUNK + 5, generator=g), bits_, 1032, None)
    assert _cpu_kernels._native.pool_workers() >= 1  # the work was shared


def test_concurrent_callers_get_their_own_results() -> None:
    # the kernels release the GIL; a caller finding the pool busy works alone
    xs = [torch.randn(8, 20_000, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch_ops():
        want = [pack_quantized(x, 4, seed=i).unpack() for i, x in enumerate(xs)]
    got = [None] * len(xs)

    def work(i: int) -> None:
        for _ in range(5):
            got[i] = pack_quantized(xs[i], 4, seed=i).unpack()

    with threads(2):
        pool = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_non_contiguous_and_reshaped_inputs() -> None:
    x = torch.randn(6, 50, 8)
    assert_same(x.transpose(0, 1), 4, 16, None)       # copied to row-major
    assert_same(x[:, :40], 8, 8, 3)                   # a view the reshape must copy
    assert_same(x, 2, 24, None, rows=3)               # rows other than shape[0]
    assert_same(torch.randn(()), 8, 8, None)         # 0-d: one row of one


def test_native_path_is_taken(monkeypatch) -> None:
    import edgetorch.codecs.quantized as qmod

    def refuse(*args, **kwargs):
        raise AssertionError("the torch-ops reference ran")

    monkeypatch.setattr(qmod, "_quantize_torch", refuse)
    monkeypatch.setattr(qmod, "_dequantize_torch", refuse)
    pack_quantized(torch.randn(3, 100), 4).unpack()


def test_fallback_warns_once_without_the_extension(monkeypatch) -> None:
    monkeypatch.setattr(_cpu_kernels, "NATIVE", False)
    monkeypatch.setattr(_backend, "CPU", _backend.TORCH)  # what the table holds without the extension
    monkeypatch.setattr(_cpu_kernels, "_native", None)
    monkeypatch.setattr(_cpu_kernels, "_FORCED_OFF", False)
    monkeypatch.setattr(_cpu_kernels, "_warned", False)
    with pytest.warns(RuntimeWarning, match="quantized") as rec:
        pack_quantized(torch.randn(3, 100), 4).unpack()
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pack_quantized(torch.randn(3, 100), 4).unpack()  # once per process


def test_unpack_refuses_fields_that_do_not_match() -> None:
    q = pack_quantized(torch.randn(4, 100), 4, group=16)
    bad = [
        QuantizedTensor(q.codes[:, :-1], q.lo, q.scale, q.shape, q.dtype, q.bits, q.group),
        QuantizedTensor(q.codes, q.lo[:, :-1], q.scale, q.shape, q.dtype, q.bits, q.group),
        QuantizedTensor(q.codes, q.lo, q.scale, q.shape, q.dtype, q.bits, 32),
    ]
    for b in bad:
        with pytest.raises(ValueError, match="need"):
            b.unpack()
    with pytest.raises(ValueError, match="uint8"):
        QuantizedTensor(q.codes.int(), q.lo, q.scale, q.shape, q.dtype, q.bits, q.group).unpack()


def test_float16_and_bfloat16_rounding_of_decoded_values() -> None:
    # decoded float32 values across the whole range (lo anywhere, steps from subnormal to huge),
    # rounded to nearest even as .to() rounds them, overflow to Inf, NaN as torch writes it
    g = torch.Generator().manual_seed(0)
    groups = 20_000
    sign = torch.randint(0, 2, (groups, 1), generator=g) * 2 - 1
    lo = (sign * torch.exp2(torch.randint(-150, 128, (groups, 1), generator=g).double())
          * (1 + torch.rand(groups, 1, generator=g, dtype=torch.float64))).float()
    scale = (torch.exp2(torch.randint(-150, 125, (groups, 1), generator=g).double())
             * torch.rand(groups, 1, generator=g, dtype=torch.float64)).float()
    lo[::97] = NAN
    scale[::89] = NAN
    codes = torch.randint(0, 256, (groups, 8), generator=g, dtype=torch.uint8)
    for dtype in DTYPES:
        q = QuantizedTensor(codes, lo, scale, torch.Size((groups, 8)), dtype, 8, 8)
        for name in ISAS:
            with isa(name):
                out = q.unpack()
            with torch_ops():
                ref = q.unpack()
            assert torch.equal(bits(out), bits(ref)), (name, dtype)


GOLDEN = [golden.test_golden_8bit_codes_and_ranges, golden.test_golden_2bit_packing_is_least_significant_first,
          golden.test_golden_4bit_rows_pad_to_whole_bytes, golden.test_golden_stochastic_hash,
          golden.test_float64_is_rounded_to_float32_first,
          golden.test_a_range_that_overflows_float32_is_non_finite_not_clipped, golden.test_rows_keep_groups_apart]


@pytest.mark.parametrize("path", ["native", "torch ops"])
@pytest.mark.parametrize("case", GOLDEN, ids=lambda f: f.__name__)
def test_golden_bytes_on_both_paths(path: str, case) -> None:
    with torch_ops() if path == "torch ops" else contextlib.nullcontext():
        case()


@pytest.mark.parametrize("special", [NAN, INF, -INF])
def test_non_finite_groups_on_both_paths(special: float) -> None:
    golden.test_a_group_with_a_non_finite_value_decodes_to_nan(special)
    with torch_ops():
        golden.test_a_group_with_a_non_finite_value_decodes_to_nan(special)


def test_nan_decodes_to_the_bits_torch_writes() -> None:
    q = pack_quantized(torch.tensor([[NAN] * 8]), 8, group=8)
    assert bits(q.lo).item() == bits(q.scale).item() == 0x7FC00000  # torch's float("nan")
    for dtype in DTYPES:
        out = dataclasses.replace(q, dtype=dtype).unpack()
        assert torch.equal(bits(out), bits(torch.full((1, 8), math.nan).to(dtype)))
