"""Bitmap codec: lossless roundtrip, native kernel == torch reference, thresholds, byte counts.

The other codecs' native kernels, instruction sets, threads and the fallback: test_codec_native.py."""

from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetorch import pack_bitmap
from edgetorch.codecs import FLOAT_DTYPES, _cpu_kernels
from edgetorch.codecs._cpu_kernels import torch_ops
from edgetorch.codecs.bitmap import pack_bitmap_if_smaller, pack_torch, unpack_torch

INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}
SPECIALS = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-40, -1e-40, 3.0, -7.5]
CHUNK = _cpu_kernels.CHUNK_ELEMS  # elements per parallel chunk of the native kernel
HYPO = settings(max_examples=60, deadline=None)


def bit_pattern(x: torch.Tensor) -> torch.Tensor:
    """Integer bit patterns with -0.0 folded onto +0.0 (the only change a roundtrip may make)."""
    x = torch.where(x == 0, torch.zeros_like(x), x)
    return x.contiguous().view(INT_VIEW[x.dtype])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bit_pattern(a), bit_pattern(b))


def sample(shape: tuple[int, ...], dtype: torch.dtype, zero_frac: float, seed: int) -> torch.Tensor:
    """Random values with special values sprinkled in and a given fraction of exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    flat = x.view(-1)
    if flat.numel():
        where = torch.randint(0, flat.numel(), (max(1, flat.numel() // 16),), generator=g)
        flat[where] = torch.tensor(SPECIALS, dtype=torch.float64)[
            torch.randint(0, len(SPECIALS), where.shape, generator=g)
        ]
        flat[torch.rand(flat.numel(), generator=g, dtype=torch.float64) < zero_frac] = 0.0
    return x.to(dtype)


def noncontiguous(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    base = sample((6, 10, 12), dtype, 0.5, seed=7)
    return {
        "transposed": base.transpose(0, 2),
        "sliced": base[1:5, ::3, 1::2],
        "expanded": base[:, :1, 3:4].expand(6, 5, 9),
        "channels_last": sample((2, 3, 5, 7), dtype, 0.4, 8).to(memory_format=torch.channels_last),
    }


# --- lossless roundtrip -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "shape", [(), (0,), (3, 0, 2), (1,), (7,), (8,), (9,), (5, 13), (4, 64, 7), (CHUNK + 13,)]
)
def test_roundtrip_is_bit_identical(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = sample(shape, dtype, 0.5, seed=len(shape) * 31 + sum(shape))
    p = pack_bitmap(x)
    y = p.unpack()
    assert_same_bits(y, x)
    assert y.is_contiguous()
    assert p.nnz == int((x != 0).sum())  # NaN != 0, so NaN is kept


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kind", ["transposed", "sliced", "expanded", "channels_last"])
def test_roundtrip_noncontiguous(dtype: torch.dtype, kind: str) -> None:
    x = noncontiguous(dtype)[kind]
    assert not x.is_contiguous()
    assert_same_bits(pack_bitmap(x).unpack(), x)


@HYPO
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    values=st.lists(st.sampled_from(SPECIALS) | st.floats(width=32, allow_nan=True), max_size=200),
)
def test_roundtrip_hypothesis(dtype: torch.dtype, values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    assert_same_bits(pack_bitmap(x).unpack(), x)


def test_roundtrip_keeps_nan_payload_and_infinities() -> None:
    payloads = torch.tensor(
        [0x7FC00001, -0x00400001, 0x7F800000, -0x00800000, 0x1], dtype=torch.int32
    )
    x = payloads.view(torch.float32)  # two NaNs with payloads, +inf, -inf, smallest subnormal
    p = pack_bitmap(x)
    assert p.nnz == 5
    assert torch.equal(p.unpack().view(torch.int32), payloads)


def test_unpack_is_repeatable_and_owns_its_memory() -> None:
    x = sample((1000,), torch.float32, 0.5, seed=3)
    p = pack_bitmap(x)
    a, b = p.unpack(), p.unpack()
    assert_same_bits(a, b)
    a.fill_(1.0)
    assert_same_bits(p.unpack(), x)
    assert a.untyped_storage().data_ptr() != p.values.untyped_storage().data_ptr()


def test_requires_grad_input_is_packed_detached() -> None:
    x = sample((4, 5), torch.float32, 0.5, seed=4).requires_grad_()
    y = pack_bitmap(x).unpack()
    assert not y.requires_grad
    assert_same_bits(y, x.detach())


def test_large_tensor_roundtrip() -> None:
    # >= 32 MiB: the native kernel's output buffers take the huge-page path.
    x = torch.relu(torch.randn(9_000_000, generator=torch.Generator().manual_seed(5)))
    p = pack_bitmap(x)
    assert_same_bits(p.unpack(), x)
    assert torch.equal(p.values, x[x != 0])


# --- native kernel == torch reference, byte for byte ------------------------------------------


def check_kernel_matches_reference(bits: torch.Tensor, limit: int) -> None:
    bitmap, values = _cpu_kernels.pack(bits, limit)
    with torch_ops():
        ref_bitmap, ref_values = pack_torch(bits, limit)
        ref_dense = unpack_torch(ref_bitmap, ref_values, bits.numel())
    assert bitmap.dtype == torch.uint8 and values.dtype == bits.dtype
    assert torch.equal(bitmap, ref_bitmap)
    assert torch.equal(values, ref_values)
    dense = _cpu_kernels.unpack(bitmap, values, (bits.numel(),))
    assert torch.equal(dense, ref_dense)


needs_native = pytest.mark.skipif(not _cpu_kernels.NATIVE, reason="the C extension is not built")


@needs_native
@HYPO
@given(
    int_dtype=st.sampled_from([torch.int16, torch.int32, torch.int64]),
    n=st.integers(0, 3000),
    zero_frac=st.floats(0.0, 1.0),
    limit_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_kernel_matches_reference(
    int_dtype: torch.dtype, n: int, zero_frac: float, limit_frac: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(int_dtype)
    bits = torch.randint(info.min, info.max, (n,), dtype=int_dtype, generator=g)
    bits[torch.rand(n, generator=g) < zero_frac] = 0
    bits[torch.rand(n, generator=g) < zero_frac / 4] = info.min  # -0.0
    limit = 0 if limit_frac < 0.5 else min(int(limit_frac * info.max), info.max)
    check_kernel_matches_reference(bits, limit)


@needs_native
@pytest.mark.parametrize("n", [CHUNK - 1, CHUNK, 3 * CHUNK + 5, 9 * CHUNK + 13])  # last: threaded
@pytest.mark.parametrize(
    "pattern", ["random", "zero_tail", "zero_head", "all_zero", "all_kept", "one"]
)
def test_kernel_matches_reference_across_chunks(n: int, pattern: str) -> None:
    g = torch.Generator().manual_seed(n)
    bits = torch.randint(1, 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    bits[torch.rand(n, generator=g) < 0.5] = 0
    if pattern == "zero_tail":
        bits[n // 3 :] = 0
    elif pattern == "zero_head":
        bits[: n - CHUNK // 2] = 0
    elif pattern == "all_zero":
        bits.zero_()
    elif pattern == "all_kept":
        bits[bits == 0] = 9
    elif pattern == "one":
        bits.zero_()
        bits[CHUNK - 1 if n > CHUNK else n - 1] = 42
    check_kernel_matches_reference(bits, 0)


def test_golden_bitmap_bytes() -> None:
    # Element i is bit i % 8 (least significant first) of byte i // 8.
    x = torch.tensor([0, 1.5, 0, 0, -2, 0, 0, 3, 0, 0, 4], dtype=torch.float32)
    p = pack_bitmap(x)
    assert p.bitmap.tolist() == [0b1001_0010, 0b0000_0100]
    assert p.values.tolist() == [1.5, -2.0, 3.0, 4.0]
    assert p.shape == torch.Size([11]) and p.dtype == torch.float32


# --- threshold semantics ----------------------------------------------------------------------


def test_threshold_drops_up_to_and_including_boundary() -> None:
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([0.5, -0.5, 0.25, 0.75, -0.0, nan, inf, -inf, 0.5000001, 1e-30])
    p = pack_bitmap(x, threshold=0.5)
    kept = [False, False, False, True, False, True, True, True, True, False]
    expected = torch.where(torch.tensor(kept), x, torch.zeros_like(x))
    assert_same_bits(p.unpack(), expected)
    assert p.nnz == sum(kept)


def test_threshold_compares_exact_values_not_rounded_threshold() -> None:
    # float32(0.1) is 0.10000000149 > 0.1, so it is kept; the float32 just below 0.1 is dropped.
    above = torch.tensor(0.1, dtype=torch.float32)
    below = torch.nextafter(above, torch.tensor(0.0))
    p = pack_bitmap(torch.stack([above, below, -above, -below]), threshold=0.1)
    assert p.bitmap.tolist() == [0b0101]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("threshold", [1e-50, 1e-6, 0.01, 0.5, 1.0, 3.0, 1e6, 1e300])
def test_threshold_matches_float64_reference(dtype: torch.dtype, threshold: float) -> None:
    x = sample((3000,), dtype, 0.2, seed=11) * torch.tensor(10.0, dtype=dtype) ** torch.randint(
        -8, 6, (3000,), generator=torch.Generator().manual_seed(12)
    ).to(dtype)
    keep = ~(x.double().abs() <= threshold)  # NaN compares False: kept
    p = pack_bitmap(x, threshold=threshold)
    assert_same_bits(p.unpack(), torch.where(keep, x, torch.zeros_like(x)))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_infinite_threshold_drops_inf_keeps_nan(dtype: torch.dtype) -> None:
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e4, -3.0, 0.0], dtype=dtype)
    p = pack_bitmap(x, threshold=math.inf)
    assert p.nnz == 1
    assert p.bitmap.tolist() == [0b100]
    y = p.unpack()
    assert torch.isnan(y[2]) and torch.equal(y[[0, 1, 3, 4, 5]], torch.zeros(5, dtype=dtype))


# --- value dtype ------------------------------------------------------------------------------


@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_values(value_dtype: torch.dtype) -> None:
    x = sample((40, 50), torch.float32, 0.5, seed=13) * 1e3
    x[0, :4] = torch.tensor([1e5, 1e-9, 65504.0, 70000.0])  # fp16 overflow and underflow
    p = pack_bitmap(x, value_dtype=value_dtype)
    assert p.values.dtype == value_dtype and p.dtype == torch.float32
    keep = x != 0
    expected = torch.where(keep, x.to(value_dtype).to(torch.float32), torch.zeros_like(x))
    y = p.unpack()
    assert y.dtype == torch.float32
    assert_same_bits(y, expected)
    assert p.nbytes == 2 * p.nnz + math.ceil(x.numel() / 8)


def test_wider_value_dtype_is_lossless() -> None:
    x = sample((500,), torch.float16, 0.3, seed=14)
    p = pack_bitmap(x, value_dtype=torch.float64)
    assert p.values.dtype == torch.float64
    assert_same_bits(p.unpack(), x)


# --- byte accounting and the paper's Table 1 --------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [0, 1, 8, 13, 1001])
def test_nbytes(dtype: torch.dtype, n: int) -> None:
    p = pack_bitmap(sample((n,), dtype, 0.4, seed=n), threshold=0.1)
    value_bytes = torch.tensor([], dtype=dtype).element_size()
    assert p.nbytes == value_bytes * p.nnz + math.ceil(n / 8)
    assert p.bitmap.numel() == math.ceil(n / 8)


TABLE1 = {  # shape -> {non-zero %: (dense MB, bitmap MB, improvement %)}, theoretical columns
    (16, 3, 224, 224): {0: (9.19, 0.29), 25: (9.19, 2.58), 50: (9.19, 4.88), 75: (9.19, 7.18),
                        100: (9.19, 9.47)},
    (16, 7, 112, 112): {0: (5.36, 0.17), 25: (5.36, 1.51), 50: (5.36, 2.85), 75: (5.36, 4.19),
                        100: (5.36, 5.53)},
    (16, 64, 56, 56): {0: (12.25, 0.38), 25: (12.25, 3.45), 50: (12.25, 6.51), 75: (12.25, 9.57),
                       100: (12.25, 12.63)},
    (16, 128, 28, 28): {0: (6.13, 0.19), 25: (6.13, 1.72), 50: (6.13, 3.25), 75: (6.13, 4.79),
                        100: (6.13, 6.32)},
    (16, 256, 14, 14): {0: (3.06, 0.10), 25: (3.06, 0.86), 50: (3.06, 1.63), 75: (3.06, 2.39),
                        100: (3.06, 3.16)},
    (16, 512, 7, 7): {0: (1.53, 0.05), 25: (1.53, 0.43), 50: (1.53, 0.81), 75: (1.53, 1.20),
                      100: (1.53, 1.58)},
}
TABLE1_IMPROVEMENT = {0: 96.88, 25: 71.88, 50: 46.88, 75: 21.88, 100: -3.13}


def paper_round(x: float) -> float:
    """Two decimals, halves away from zero (as the paper prints 6.125 -> 6.13, -3.125 -> -3.13)."""
    return float(Decimal(repr(x)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))


@pytest.mark.parametrize("shape", list(TABLE1))
def test_paper_table1_theoretical_columns(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    for pct, (dense_mb, bitmap_mb) in TABLE1[shape].items():
        x = torch.zeros(shape)
        x.view(-1)[: n * pct // 100] = 1.0
        p = pack_bitmap(x)
        dense = x.numel() * x.element_size()
        assert paper_round(dense / 2**20) == dense_mb
        assert paper_round(p.nbytes / 2**20) == bitmap_mb
        assert paper_round(100 * (1 - p.nbytes / dense)) == TABLE1_IMPROVEMENT[pct]


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
)
def test_rejects_non_float_tensor(dtype: torch.dtype) -> None:
    accepted = r"\(float64, float32, float16, bfloat16\); got " + str(dtype)
    with pytest.raises(TypeError, match=r"stores floating-point tensors " + accepted):
        pack_bitmap(torch.zeros(4, dtype=dtype))


@pytest.mark.parametrize("bad", [[1.0, 0.0], 3.0, None])
def test_rejects_non_tensor(bad: object) -> None:
    with pytest.raises(TypeError, match=r"expects a torch\.Tensor, got " + type(bad).__name__):
        pack_bitmap(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("threshold", [-1.0, -1e-30, float("nan"), -math.inf])
def test_rejects_negative_or_nan_threshold(threshold: float) -> None:
    with pytest.raises(ValueError, match=r"threshold must be >= 0"):
        pack_bitmap(torch.ones(3), threshold=threshold)


@pytest.mark.parametrize("threshold", ["0.1", True, torch.tensor(0.1)])
def test_rejects_non_number_threshold(threshold: object) -> None:
    with pytest.raises(TypeError, match=r"threshold must be a non-negative number"):
        pack_bitmap(torch.ones(3), threshold=threshold)  # type: ignore[arg-type]


@pytest.mark.parametrize("value_dtype", [torch.int8, torch.float8_e4m3fn, "float16"])
def test_rejects_bad_value_dtype(value_dtype: object) -> None:
    accepted = r"value_dtype must be one of float64, float32, float16, bfloat16 or None"
    with pytest.raises(TypeError, match=accepted):
        pack_bitmap(torch.ones(3), value_dtype=value_dtype)  # type: ignore[arg-type]


# --- GPU path ---------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cuda_matches_cpu(dtype: torch.dtype) -> None:
    x = sample((3, CHUNK // 5 + 3), dtype, 0.5, seed=21)
    cpu = pack_bitmap(x, threshold=0.3)
    gpu = pack_bitmap(x.cuda(), threshold=0.3)
    assert gpu.device.type == "cuda" and gpu.bitmap.device.type == "cuda"
    assert torch.equal(gpu.bitmap.cpu(), cpu.bitmap)
    assert torch.equal(bit_pattern(gpu.values.cpu()), bit_pattern(cpu.values))
    assert_same_bits(gpu.unpack().cpu(), cpu.unpack())
    lossless = pack_bitmap(x.cuda().t())
    assert_same_bits(lossless.unpack().cpu(), x.t())


@needs_native
@HYPO
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    n=st.integers(1, 3000),
    zero_frac=st.floats(0.0, 1.0),
    threshold=st.sampled_from([0.0, 0.5]),
    value_dtype=st.sampled_from([None, torch.float16]),
    slack=st.integers(-3, 3),
    seed=st.integers(0, 2**31),
)
def test_pack_if_smaller_decides_like_torch_ops(dtype, n, zero_frac, threshold, value_dtype, slack, seed) -> None:
    """The C path stops after its counting pass exactly where the torch path's exact count does,
    at bounds around the packed size itself (one byte below, at, above)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(dtype)
    x[torch.rand(n, generator=g) < zero_frac] = 0
    packed_bytes = pack_bitmap(x, threshold, value_dtype).nbytes
    bound = packed_bytes + slack
    native = pack_bitmap_if_smaller(x, threshold, value_dtype, bound)
    with torch_ops():
        reference = pack_bitmap_if_smaller(x, threshold, value_dtype, bound)
    assert (native is None) == (reference is None) == (packed_bytes >= bound)
    if native is not None:
        assert torch.equal(native.bitmap, reference.bitmap)
        assert torch.equal(native.values.view(torch.uint8), reference.values.view(torch.uint8))
        assert torch.equal(native.unpack().view(torch.uint8), pack_bitmap(x, threshold, value_dtype).unpack().view(torch.uint8))
