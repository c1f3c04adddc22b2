"""The bottleneck payload codec: exact bytes, round-trip error bound, and rejection of bad payloads."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from edgetorch.split.payload import (
    PayloadError,
    decode,
    encode,
    header_size,
    payload_size,
    quantize,
    read_header,
)

SMALL = torch.tensor([[0.0, 1.0, 2.0, 3.0], [-1.0, 0.0, 0.5, 1.0]])


def test_golden_bytes_per_sample():
    # magic ETBQ, v1, per-sample, uint8, float32, ndim 2, CRC-32, shape (2, 4), (scale f32, zp u8) x2.
    assert encode(SMALL).hex() == (
        "45544251" "01" "01" "01" "01" "02" "87f14ff4" "02000000" "04000000"
        "c1c0403c" "00" "8180003c" "7f" "0055aaff" "007fbffe"
    )


def test_golden_bytes_per_tensor():
    assert encode(SMALL, per_sample=False).hex() == (
        "45544251" "01" "00" "01" "01" "02" "d2fa8274" "02000000" "04000000"
        "8180803c" "40" "4080bfff" "00406080"
    )


def test_size_is_elements_plus_constant_header():
    x = torch.randn(3, 12, 7, 7)
    assert len(encode(x)) == x.numel() + 13 + 4 * 4 + 5 * 3 == payload_size(x.shape)
    assert len(encode(x, per_sample=False)) == x.numel() + header_size(4, 1) == payload_size(x.shape, False)


def _tensors():
    shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)
    values = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False)
    return shapes.flatmap(lambda s: arrays(np.float32, s, elements=values)).map(torch.from_numpy)


@settings(max_examples=200, deadline=None)
@given(_tensors(), st.booleans())
def test_round_trip_error_at_most_half_a_step(x, per_sample):
    blob = encode(x, per_sample)
    y = decode(blob)
    assert y.shape == x.shape and y.dtype == x.dtype and len(blob) == payload_size(x.shape, per_sample)
    _, scale, _ = quantize(x, per_sample)
    step = scale.reshape(-1, *([1] * (x.dim() - 1))) if per_sample else scale
    bound = step / 2 * (1 + 1e-5) + 1e-6 * x.abs()  # float32 arithmetic in dequantisation
    assert ((y - x).abs() <= bound).all()
    assert (y[x == 0] == 0).all()  # zero is exact


@settings(max_examples=50, deadline=None)
@given(_tensors())
def test_per_sample_payload_does_not_depend_on_the_batch(x):
    other = torch.randn(3, *x.shape[1:]) * 100
    alone = decode(encode(x[:1]))
    batched = decode(encode(torch.cat([x[:1], other])))
    assert torch.equal(alone[0], batched[0])


def test_constant_and_zero_tensors_do_not_divide_by_zero():
    for value in (0.0, 5.0, -3.25):
        x = torch.full((2, 3, 4), value)
        for per_sample in (True, False):
            assert torch.equal(decode(encode(x, per_sample)), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_restores_the_floating_dtype(dtype):
    x = torch.randn(2, 3, dtype=dtype)
    assert decode(encode(x)).dtype == dtype


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([1.0, float("nan")]), "finite"),
    (torch.tensor([1.0, float("inf")]), "finite"),
    (torch.arange(4), "float32/float16"),
    (torch.tensor(1.0), "1..8 dims"),
    (torch.zeros(2, 0), "every dim"),
    (torch.zeros([1] * 9), "1..8 dims"),
])
def test_encode_rejects_bad_tensors(bad, match):
    with pytest.raises(PayloadError, match=match):
        encode(bad)


def _with(blob: bytes, offset: int, value: bytes, reseal: bool = False) -> bytes:
    """``blob`` with ``value`` written at ``offset``; ``reseal`` recomputes the CRC (a lying encoder)."""
    out = blob[:offset] + value + blob[offset + len(value):]
    if reseal:
        crc = zlib.crc32(out[13:], zlib.crc32(out[:9]))
        out = out[:9] + struct.pack("<I", crc) + out[13:]
    return out


@pytest.mark.parametrize("edit, match", [
    (lambda b: b[:5], "truncated"),
    (lambda b: b[:-1], "truncated payload: 38 bytes"),
    (lambda b: b + b"\0", "oversized payload: 40 bytes"),
    (lambda b: _with(b, 0, b"XXXX"), "magic"),
    (lambda b: _with(b, 4, b"\x04"), "version 4 is not supported"),
    (lambda b: _with(b, 5, b"\x07"), "mode 7"),
    (lambda b: _with(b, 6, b"\x02"), "value dtype code 2"),
    (lambda b: _with(b, 7, b"\x09"), "restored dtype code 9"),
    (lambda b: _with(b, 8, b"\x00"), "ndim 0"),
    (lambda b: _with(b, 8, b"\x09"), "ndim 9"),
    (lambda b: _with(b, 13, struct.pack("<I", 0)), "every dim"),
    (lambda b: _with(b, 13, struct.pack("<I", 2**31)), "oversized|truncated"),
    (lambda b: _with(b, 30, b"\x01"), "corrupted payload: its CRC-32"),
    (lambda b: _with(b, 9, b"\0\0\0\0"), "corrupted payload: its CRC-32"),
    (lambda b: _with(b, 21, struct.pack("<f", 0.0), reseal=True), "scale"),
    (lambda b: _with(b, 21, struct.pack("<f", float("nan")), reseal=True), "scale"),
    (lambda b: _with(b, 21, struct.pack("<f", -1.0), reseal=True), "scale"),
    (lambda b: b"", "truncated"),
])
def test_decode_rejects_malformed_payloads(edit, match):
    with pytest.raises(PayloadError, match=match):
        decode(edit(encode(SMALL)))


def test_decode_limit_and_type():
    blob = encode(SMALL)
    with pytest.raises(PayloadError, match="exceeds the limit of 10 bytes"):
        decode(blob, max_bytes=10)
    assert decode(blob, max_bytes=len(blob)).shape == SMALL.shape
    with pytest.raises(PayloadError, match="a payload is bytes"):
        decode("not bytes")  # type: ignore[arg-type]
    assert decode(bytearray(blob)).shape == decode(memoryview(blob)).shape == SMALL.shape


def test_read_header_reports_the_layout():
    header = read_header(encode(torch.zeros(3, 2, 5)))
    assert (header.shape, header.per_sample, header.dtype) == ((3, 2, 5), True, torch.float32)
    assert header.total_bytes == 30 + header_size(3, 3) == 30 + 13 + 12 + 15


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_mutated_or_cut_payload_is_a_payload_error(data):
    x = torch.randn(2, 3, 4)
    original = encode(x, data.draw(st.booleans()))
    blob = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    blob = bytes(blob[:cut] + data.draw(st.binary(max_size=8)))
    if blob == original:
        assert decode(blob).shape == x.shape
        return
    with pytest.raises(PayloadError):
        decode(blob)


F32_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("x, per_sample", [
    # One (scale, zero point) for both signs: z = 128, so -128 * scale lands past float32's max.
    (torch.tensor([F32_MAX, -F32_MAX]), False),
    (torch.tensor([65504.0, -65504.0], dtype=torch.float16), False),
    (torch.tensor([1.0, -1.0], dtype=torch.bfloat16) * torch.finfo(torch.bfloat16).max, False),
    # float64 values beyond float32's range: the float32 arithmetic of decode would give inf.
    (torch.tensor([1e39, 0.0], dtype=torch.float64), True),
    (torch.tensor([1e41, 0.0], dtype=torch.float64), True),
])
def test_encode_refuses_values_decode_would_turn_into_inf(x, per_sample):
    with pytest.raises(PayloadError, match="out of range.*accepted"):
        encode(x, per_sample)


def test_extreme_values_that_fit_still_round_trip_finite():
    for x in (torch.tensor([F32_MAX, 0.0]), torch.tensor([-F32_MAX, 1.0]),
              torch.tensor([65504.0, -1.0], dtype=torch.float16), torch.tensor([3e38, 0.0], dtype=torch.float64)):
        y = decode(encode(x, per_sample=False))
        assert torch.isfinite(y).all() and y.dtype == x.dtype


@pytest.mark.parametrize("restored, scale, zero_point", [
    (b"\x01", 3e38, 0),      # float32: 255 * 3e38 overflows the float32 product
    (b"\x02", 1e5, 0),       # float16: 255 * 1e5 is finite in float32 but not in float16
    (b"\x03", 1.5e36, 0),    # bfloat16
    (b"\x04", 3e36, 128),    # float64 output still goes through the float32 product: 128 * 3e36
])
def test_decode_refuses_a_sealed_payload_whose_scale_would_give_inf(restored, scale, zero_point):
    blob = _with(encode(SMALL), 7, restored)
    blob = _with(blob, 21, struct.pack("<fB", scale, zero_point), reseal=True)
    with pytest.raises(PayloadError, match="out of range"):
        decode(blob)


def _quantized():
    import warnings

    with warnings.catch_warnings():  # quantized tensors are deprecated: still a caller's input
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.zeros(2, 2), 0.1, 0, torch.quint8)


def _nested():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])


@pytest.mark.parametrize("make, match", [
    (lambda: torch.eye(3).to_sparse(), "layout torch.sparse_coo"),
    pytest.param(lambda: torch.eye(3).to_sparse_csr(), "layout torch.sparse_csr",
                 marks=pytest.mark.filterwarnings("ignore:Sparse CSR")),
    (lambda: torch.zeros(2, 3, device="meta"), "meta tensor"),
    (_nested, "nested tensor"),
    (_quantized, "quantized"),
    (lambda: torch.zeros(2, 2, dtype=torch.complex64), "dtype torch.complex64"),
    (lambda: torch.zeros(2, 2, dtype=torch.bool), "dtype torch.bool"),
    (lambda: torch.zeros(2, 2, dtype=torch.uint8), "dtype torch.uint8"),
    (lambda: [1.0, 2.0], "got list"),
    (lambda: np.zeros(3, dtype=np.float32), "got ndarray"),
])
def test_encode_refuses_tensors_it_cannot_serialise_with_a_payload_error(make, match):
    with pytest.raises(PayloadError, match=f"encode takes a dense .*{match}"):
        encode(make())


@pytest.mark.parametrize("shape, match", [
    ((2**32 - 1,) * 8, "2\\*\\*63-1"),
    ((2**32 - 1, 2**32 - 1), "2\\*\\*63-1"),
    ((2**32,), "1..2\\*\\*32-1"),
    ((0, 3), "1..2\\*\\*32-1"),
    ((-1, 3), "1..2\\*\\*32-1"),
    ((), "1..8 dims"),
    ((1,) * 9, "1..8 dims"),
    ((2.5, 3), "integers"),
    (("3",), "integers"),
    ((None,), "integers"),
])
def test_payload_size_refuses_shapes_it_cannot_size(shape, match):
    with pytest.raises(PayloadError, match=match):
        payload_size(shape)


def test_payload_size_is_exact_integer_arithmetic_up_to_the_limit():
    big = (2**32 - 1, 2**31)  # numel = 2**63 - 2**31: still a possible tensor
    assert payload_size(big) == (2**32 - 1) * 2**31 + 13 + 8 + 5 * (2**32 - 1)
    assert payload_size(big, per_sample=False) == (2**32 - 1) * 2**31 + 13 + 8 + 5
    assert payload_size((np.int64(2), torch.tensor(3).item())) == payload_size((2, 3))


_DTYPES = {torch.float32: 32, torch.float16: 16, torch.float64: 64, torch.bfloat16: 32}


@st.composite
def _any_float_tensor(draw):
    """A floating tensor of any of the four dtypes with values anywhere in (and at the edge of) its range."""
    dtype = draw(st.sampled_from(list(_DTYPES)))
    top = torch.finfo(dtype).max if dtype != torch.float64 else 1e300
    edges = [top, -top, top / 2, torch.finfo(torch.float32).max, 1e39, 65504.0, -65504.0, 1e-45, 0.0]
    values = st.one_of(st.floats(width=_DTYPES[dtype]), st.sampled_from(edges),
                       st.floats(-1e3, 1e3, width=_DTYPES[dtype]))
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    flat = draw(st.lists(values, min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    return torch.tensor(flat, dtype=torch.float64).to(dtype).reshape(shape)


@settings(max_examples=300, deadline=None)
@given(_any_float_tensor(), st.booleans())
def test_every_tensor_encode_accepts_decodes_finite_and_every_refusal_is_a_payload_error(x, per_sample):
    try:
        blob = encode(x, per_sample)
    except PayloadError as err:
        assert "finite" in str(err) or "out of range" in str(err)
        return
    y = decode(blob)
    assert y.shape == x.shape and y.dtype == x.dtype and bool(torch.isfinite(y).all())


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_every_resealed_mutation_decodes_finite_or_is_a_payload_error(data):
    # A lying encoder recomputes the CRC, so the mutation reaches every check behind it.
    x = torch.randn(2, 3, 4) * data.draw(st.sampled_from([1.0, 1e30, 1e4]))
    blob = bytearray(encode(x, data.draw(st.booleans())))
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    blob = bytes(blob[:data.draw(st.integers(0, len(blob)))])
    if len(blob) >= 13:
        blob = _with(blob, 0, blob[:13], reseal=True)
    try:
        y = decode(blob)
    except PayloadError:
        return
    assert bool(torch.isfinite(y).all()) and y.shape == read_header(blob).shape
