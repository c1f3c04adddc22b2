"""The bottleneck payload: 8-bit affine quantisation in a small, versioned, validated binary format.

BottleFit sends the head's output (the bottleneck tensor) as 8-bit integers plus what is needed to
dequantise them, following Jacob et al. 2018 (the paper's [5]): ``q = clamp(round(x / s) + z, 0, 255)``
and ``x ~ s * (q - z)``, with the range widened to contain 0 so that 0 is exact. ``z`` is an
integer in [0, 255] and ``s > 0``; the rounding error is at most ``s / 2`` per element.

Two choices differ from the published reference code, on purpose:

* a range of width 0 (an all-zero tensor or sample) gets ``s = 1`` instead of dividing by zero;
* with ``per_sample=True`` (the default) every sample of the batch (dim 0) has its own ``s, z``,
  so a sample's payload and prediction do not depend on what else is in the batch.

Wire format, version 1 (all integers little-endian; nothing is pickled)::

    offset  size       field
    0       4          magic b"ETBQ"
    4       1          version = 1
    5       1          mode: 0 = one (s, z) for the tensor, 1 = one (s, z) per sample (dim 0)
    6       1          value dtype: 1 = uint8 (the only one in version 1)
    7       1          restored dtype: 1 = float32, 2 = float16, 3 = bfloat16, 4 = float64
    8       1          ndim, 1..8
    9       4          CRC-32 (zlib) of every other byte of the payload: bytes 0..8, then 13..end
    13      4 * ndim   shape, uint32 each, every dim >= 1
    ...     5 * G      G = 1 or shape[0] groups: scale float32 (finite, > 0), zero point uint8
    ...     numel      the quantised values, uint8, C order

Version 2 (:mod:`.coded`, ``encode(x, tables=...)``) has the same header with version = 2, then
the codes entropy-coded with a probability table per channel instead of one byte each: the decoded
tensor is the same, the payload smaller. Its length is not fixed by its shape, so :func:`decode`
bounds the element count it claims (``max_numel``) before allocating.

Version 3 (``encode(x, tables=...)`` with tables that hold fixed steps, :class:`~.coded.FixedSteps`)
quantises with a fixed scale and zero point per channel kept in the tables, which also hold one
sample's shape, so its header is 16 bytes::

    offset  size       field
    0       4          magic b"ETBQ"
    4       1          version = 3
    5       1          restored dtype (as in version 1)
    6       4          CRC-32 of every other byte: bytes 0..5, then 10..end
    10      2          N, the samples (dim 0), uint16, >= 1; the shape is (N, *tables' sample shape)
    12      4          table digest (as in version 2; it covers the steps and the sample shape)
    16      4 * W      the rANS stream, as in version 2

A tensor whose version-3 payload would be larger than its version-1 payload is sent as version 1.

So a version-1 payload is ``numel + 13 + 4 * ndim + 5 * G`` bytes: for a [1, 12, 28, 28] bottleneck,
9,408 values + 34 bytes. :func:`decode` checks every field, that the length is exact and the
checksum matches (so a corrupted payload is an error, never a plausible wrong tensor), that no
(scale, zero point) can dequantise to inf in float32 or the restored dtype (so a decoded tensor
is always finite), and raises :class:`PayloadError` (a ``ValueError``) naming what was wrong.
:func:`encode` refuses, with the same error, every tensor whose payload :func:`decode` would
refuse: what one side accepts, the other does.

Example:
    >>> x = torch.randn(2, 3, 4, 4)
    >>> blob = encode(x)
    >>> len(blob) == payload_size(x.shape)
    True
    >>> decode(blob).shape
    torch.Size([2, 3, 4, 4])
"""

from __future__ import annotations

import math
import operator
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import EdgetorchError

if TYPE_CHECKING:
    from .coded import CodeTables

MAGIC = b"ETBQ"
VERSION = 1
CODED_VERSION = 2  # the entropy-coded codes (edgetorch.split.coded)
STEPS_VERSION = 3  # entropy-coded codes of the tables' fixed per-channel steps
_CODED_EXTENSION = struct.Struct("<B4s")  # coding, table digest
_STEPS_HEADER = struct.Struct("<4sBBIH4s")  # magic, version, restored dtype, crc, samples, table digest
_STEPS_CRC_AT = 6
MAX_STEPS_SAMPLES = 2**16 - 1
#: the most elements decode accepts from a version-2 payload unless told otherwise (64 MiB as float32)
MAX_CODED_NUMEL = 2**24
MAX_NDIM = 8
_FIXED = struct.Struct("<4sBBBBBI")  # magic, version, mode, value dtype, restored dtype, ndim, crc
_CRC_AT = 9  # offset of the CRC field
_PARAM = np.dtype([("scale", "<f4"), ("zero_point", "u1")])  # 5 bytes, packed
_UINT8 = 1
_RESTORED = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16, 4: torch.float64}
_RESTORED_CODE = {dtype: code for code, dtype in _RESTORED.items()}
_QMAX = 255
# torch counts elements in int64: a shape with more cannot be a tensor, so its size means nothing.
MAX_NUMEL = 2**63 - 1


class PayloadError(EdgetorchError, ValueError):
    """A payload (or a tensor given to :func:`encode`) is not valid; the message says why."""


@dataclass(frozen=True)
class PayloadHeader:
    """The decoded header of a payload.

    Attributes:
        version: format version (1; 2 for entropy-coded codes; 3 for entropy-coded codes of fixed steps).
        per_sample: one (scale, zero point) per sample along dim 0, else one for the tensor.
        dtype: the floating dtype :func:`decode` returns.
        shape: the tensor's shape.
        header_bytes: bytes before the quantised values (fixed part, shape, scales/zero points;
            in version 2 also the coding byte and the table digest; version 3: 16).
        table_digest: versions 2 and 3: the digest of the code tables it was coded with; else None.
    """

    version: int
    per_sample: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    header_bytes: int
    table_digest: bytes | None = None

    @property
    def numel(self) -> int:
        """Number of quantised values (one byte each)."""
        return math.prod(self.shape)

    @property
    def total_bytes(self) -> int | None:
        """The exact length a valid version-1 payload with this header has (None in versions 2 and
        3, whose length depends on the codes)."""
        return self.header_bytes + self.numel if self.version == VERSION else None


def header_size(ndim: int, groups: int) -> int:
    """Bytes before the values: fixed part, ``ndim`` dims, ``groups`` (scale, zero point) pairs."""
    return _FIXED.size + 4 * ndim + _PARAM.itemsize * groups


def payload_size(shape: Sequence[int], per_sample: bool = True) -> int:
    """Exact byte length of ``encode(x, per_sample)`` for a tensor of ``shape``, without encoding.

    Args:
        shape: the tensor's shape: 1..8 integer dims, each in 1..2**32-1 (what the header can
            hold), with at most 2**63-1 elements in all (what a tensor can hold).
        per_sample: as in :func:`encode`.

    Returns:
        ``numel + header_size``, computed in Python integers (never wraps around).

    Raises:
        PayloadError: a shape outside those bounds, or dims that are not integers.

    Example:
        >>> payload_size((1, 12, 28, 28))
        9442
    """
    shape = _check_shape(_int_dims(shape))
    groups = shape[0] if per_sample else 1
    return math.prod(shape) + header_size(len(shape), groups)


def _int_dims(shape: Sequence[int]) -> tuple[int, ...]:
    # operator.index accepts ints, numpy integers and torch.Size entries, but not 2.5 or "3":
    # int() would silently truncate or parse them into a different shape.
    try:
        return tuple(operator.index(d) for d in shape)
    except TypeError:
        raise PayloadError(f"a shape is a sequence of integers, got {shape!r}") from None


def _check_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if not 1 <= len(shape) <= MAX_NDIM:
        raise PayloadError(f"a payload tensor has 1..{MAX_NDIM} dims, got {len(shape)}")
    if any(d < 1 or d >= 2**32 for d in shape):
        raise PayloadError(f"every dim must be in 1..2**32-1, got shape {shape}")
    if math.prod(shape) > MAX_NUMEL:
        raise PayloadError(f"shape {shape} has {math.prod(shape):.3g} elements; a tensor holds at most 2**63-1")
    return shape


def _check_range(scale: np.ndarray, zero_point: np.ndarray, dtype: torch.dtype) -> None:
    """Refuse (scale, zero point) pairs whose dequantised values would overflow to inf.

    :func:`dequantize` computes ``(q - z) * s`` in float32 and then casts to ``dtype``. ``q - z``
    is an exact integer in [-255, 255] and rounding is monotone, so the largest magnitude any
    value of the group can reach is ``s * max(z, 255 - z)``; if that is finite in float32 and
    after the cast, every value of the group is.
    """
    zero = torch.tensor(np.asarray(zero_point, dtype=np.float32))  # a copy: the tables' arrays are read-only
    reach = torch.maximum(zero, _QMAX - zero)
    scale32 = torch.tensor(np.asarray(scale, dtype=np.float32))
    if not bool(torch.isfinite((scale32 * reach).to(dtype)).all()):  # float32 product, as dequantize
        worst = float((scale32.double() * reach.double()).max())
        raise PayloadError(
            f"out of range: 8-bit values with scale up to {float(scale32.max()):.4g} dequantise to "
            f"magnitudes up to {worst:.4g}, which overflow {str(dtype).removeprefix('torch.')} "
            f"(largest finite {torch.finfo(dtype).max:.4g}; dequantisation runs in float32, largest "
            f"{torch.finfo(torch.float32).max:.4g}); accepted: tensors whose range max(x) - min(x) "
            "dequantises within both"
        )


def quantize(x: torch.Tensor, per_sample: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8-bit affine quantisation (Jacob et al. 2018) of a floating tensor.

    Args:
        x: finite floating tensor, at least 1-D, no zero-size dims.
        per_sample: one (scale, zero point) per index of dim 0, else one for the whole tensor.

    Returns:
        ``(q, scale, zero_point)``: ``q`` uint8 with ``x``'s shape; ``scale`` float32 and
        ``zero_point`` uint8, each of shape [G] with G = ``x.shape[0]`` or 1.

    Raises:
        PayloadError: not a dense float32/float16/bfloat16/float64 tensor with data (sparse, meta,
            nested, quantized, complex and integer tensors are refused), empty, or non-finite.
    """
    _check_tensor(x)
    groups = x.shape[0] if per_sample else 1
    flat = x.detach().to("cpu", torch.float64).reshape(groups, -1)
    if not torch.isfinite(flat).all():
        raise PayloadError("encode needs finite values; the tensor holds NaN or inf")
    # The range always contains 0 so that 0 (ReLU zeros, padding) is represented exactly ([5], 2.1).
    lo = flat.amin(dim=1).clamp(max=0.0)
    hi = flat.amax(dim=1).clamp(min=0.0)
    # Width-0 range = all-zero group: any positive scale is exact; 1 avoids the reference code's 0/0.
    scale = torch.where(hi > lo, (hi - lo) / _QMAX, torch.ones_like(hi)).to(torch.float32)
    # A scale below float32's range would be stored as 0; such tiny tensors are quantised at that
    # smallest scale instead (error still <= scale / 2 because |x| is then below it).
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    stored = scale.to(torch.float64)  # quantise with the value the receiver will read
    zero_point = torch.round(-lo / stored).clamp(0, _QMAX)
    q = torch.round(flat / stored[:, None] + zero_point[:, None]).clamp(0, _QMAX)
    return q.to(torch.uint8).reshape(x.shape), scale, zero_point.to(torch.uint8)


_ACCEPTED = "a dense (strided) float32/float16/bfloat16/float64 tensor on a CPU or GPU device"


def _check_tensor(x: object) -> None:
    """Refuse, with :class:`PayloadError`, anything that is not a tensor encode can serialise.

    Checked before touching the values, because sparse, meta and nested tensors raise their own
    RuntimeErrors from ``reshape``/``isfinite``, and a meta tensor has no values to send at all.
    """
    if not isinstance(x, torch.Tensor):
        raise PayloadError(f"encode takes {_ACCEPTED}, got {type(x).__name__}")
    if x.is_nested:
        raise PayloadError(f"encode takes {_ACCEPTED}, got a nested tensor; encode its parts one by one")
    if x.layout != torch.strided:
        raise PayloadError(f"encode takes {_ACCEPTED}, got layout {x.layout}; call .to_dense() first")
    if x.is_meta or x.device.type == "meta":
        raise PayloadError(f"encode takes {_ACCEPTED}, got a meta tensor (it has a shape but no values)")
    if x.is_quantized:
        raise PayloadError(f"encode takes {_ACCEPTED}, got quantized {x.dtype}; call .dequantize() first")
    if x.dtype not in _RESTORED_CODE:
        raise PayloadError(f"encode takes {_ACCEPTED}, got dtype {x.dtype}")
    _check_shape(tuple(x.shape))


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``scale * (q - zero_point)`` per group, as ``dtype``.

    Args:
        q: uint8 values, shape [G, ...] or any shape when G = 1.
        scale: float32 [G].
        zero_point: uint8 [G].
        dtype: the floating dtype to return.

    Returns:
        A tensor of ``q``'s shape.
    """
    groups = scale.numel()
    flat = q.reshape(groups, -1).to(torch.float32)
    real = (flat - zero_point.to(torch.float32)[:, None]) * scale[:, None]
    return real.reshape(q.shape).to(dtype)


def encode(x: torch.Tensor, per_sample: bool = True, tables: CodeTables | None = None) -> bytes:
    """Quantise ``x`` to 8 bits and serialise it in the version-1 wire format (module docstring),
    or with ``tables`` entropy-code the codes in version 2.

    Args:
        x: the bottleneck tensor (finite floating, 1..8 dims, no zero-size dims), any device.
        per_sample: one (scale, zero point) per sample along dim 0 (batch-size independent, 5 bytes
            per sample), else one pair for the whole tensor.
        tables: :class:`~edgetorch.split.coded.CodeTables` with one table per channel (dim 1 of
            ``x``): the version-2 payload, which :func:`decode` with the same tables turns into
            the same tensor as version 1's; with fixed steps in the tables, version 3 (the
            tables' quantiser: the tensor within half a step inside each channel's codes).
            Version 1 where the coded payload would be larger (codes far from the fitted ones can
            cost more than a byte each) or version 3 cannot carry the tensor (over 65,535
            samples, steps whose range overflows its dtype).

    Returns:
        The payload: ``len(result) == payload_size(x.shape, per_sample)`` in version 1, at most
        that with ``tables``.

    Raises:
        PayloadError: whatever :func:`decode` would refuse or turn into inf: a tensor that is not
            dense floating (see :func:`quantize`), a bad shape, non-finite values, or values whose
            dequantised range overflows float32 or the tensor's own dtype (float16 near 65504,
            float32/bfloat16 near 3.4e38, float64 beyond float32's range); with ``tables``, also
            a tensor whose dim 1 is not the tables' channels (with fixed steps: whose sample
            shape is not theirs).

    Example:
        >>> len(encode(torch.zeros(1, 3, 4, 4)))
        82
    """
    if tables is not None and tables.steps is not None:
        stepped = _encode_steps(x, tables)
        if stepped is not None and len(stepped) <= payload_size(x.shape, per_sample):
            return stepped
        # codes far outside the fitted ones (the 8-bit payload is smaller and finer), or what version 3
        # cannot carry (more samples than its header counts, a range the tensor's dtype cannot hold)
        tables = None
    q, scale, zero_point = quantize(x, per_sample)
    if not bool(torch.isfinite(scale).all()):
        # Finite float64 input whose range exceeds float32's: the float32 scale is inf.
        raise PayloadError(
            f"out of range: values span {float(x.max()) - float(x.min()):.4g}, more than a float32 scale "
            f"can step in 255 steps (range up to about {torch.finfo(torch.float32).max:.4g}); accepted: "
            "tensors whose range dequantises within float32"
        )
    _check_range(scale.numpy(), zero_point.numpy(), x.dtype)
    params = np.empty(scale.numel(), dtype=_PARAM)
    params["scale"] = scale.numpy()
    params["zero_point"] = zero_point.numpy()
    version, values = VERSION, q.contiguous().numpy().tobytes()
    if tables is not None:
        from .coded import CODING_ANS, encode_codes

        coded = _CODED_EXTENSION.pack(CODING_ANS, tables.digest) + encode_codes(q, tables)
        if len(coded) <= len(values):  # codes unlike the fitted ones can cost more than a byte each
            version, values = CODED_VERSION, coded
    fields = (MAGIC, version, int(per_sample), _UINT8, _RESTORED_CODE[x.dtype], x.dim())
    body = b"".join((struct.pack(f"<{x.dim()}I", *x.shape), params.tobytes(), values))
    unsealed = _FIXED.pack(*fields, 0)
    return _FIXED.pack(*fields, _checksum(unsealed, body)) + body


def _encode_steps(x: torch.Tensor, tables: CodeTables) -> bytes | None:
    """The version-3 payload of ``x`` (module docstring): the tables' fixed steps, then rANS; None
    where version 3 cannot carry it (over 65,535 samples, or steps whose range overflows ``x``'s dtype)."""
    from .coded import encode_codes

    _check_tensor(x)
    steps = tables.steps
    if tuple(x.shape[1:]) != steps.sample_shape:
        raise PayloadError(f"these code tables code samples of shape {steps.sample_shape}, got a tensor of shape "
                           f"{tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise PayloadError("encode needs finite values; the tensor holds NaN or inf")
    try:
        steps.check_dtype(x.dtype)
    except PayloadError:
        return None
    if x.shape[0] > MAX_STEPS_SAMPLES:
        return None
    words = encode_codes(steps.quantize(x), tables)
    header = bytearray(_STEPS_HEADER.pack(MAGIC, STEPS_VERSION, _RESTORED_CODE[x.dtype], 0, x.shape[0], tables.digest))
    struct.pack_into("<I", header, _STEPS_CRC_AT, _steps_checksum(header, words))
    return bytes(header) + words


def _steps_checksum(header: bytes | bytearray | memoryview, words: bytes | memoryview) -> int:
    """Version 3's CRC-32: every byte but the CRC field's own (the 16-byte header, then the words)."""
    return zlib.crc32(words, zlib.crc32(header[_STEPS_CRC_AT + 4:_STEPS_HEADER.size],
                                        zlib.crc32(header[:_STEPS_CRC_AT])))


def _checksum(fixed: bytes | memoryview, body: bytes | memoryview) -> int:
    """CRC-32 over the fixed header without its CRC field, then everything after the fixed header."""
    return zlib.crc32(body, zlib.crc32(fixed[:_CRC_AT]))


def read_header(data: bytes | bytearray | memoryview, tables: CodeTables | None = None) -> PayloadHeader:
    """Parse and validate a payload's header (not its length; :func:`decode` checks that).

    Args:
        data: the payload bytes.
        tables: the code tables a version-3 payload names (its sample shape is theirs).

    Returns:
        The :class:`PayloadHeader`.

    Raises:
        PayloadError: not bytes, bad magic, unknown version/mode/dtype/coding, bad ndim or shape,
            or too short to hold the header; version 3 without the tables it was coded with.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"a payload is bytes, got {type(data).__name__}")
    data = memoryview(data).cast("B")
    if len(data) >= 5 and data[4] == STEPS_VERSION and bytes(data[:4]) == MAGIC:
        return _read_steps_header(data, tables)
    if len(data) < _FIXED.size:
        raise PayloadError(f"truncated payload: {len(data)} bytes, the fixed header alone is {_FIXED.size}")
    magic, version, mode, value_dtype, restored, ndim, _ = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise PayloadError(f"not an edgetorch bottleneck payload: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version not in (VERSION, CODED_VERSION):
        raise PayloadError(f"payload format version {version} is not supported (this reader: {VERSION}, "
                           f"{CODED_VERSION} and {STEPS_VERSION})")
    if mode not in (0, 1):
        raise PayloadError(f"unknown quantisation mode {mode}; accepted: 0 (per tensor), 1 (per sample)")
    if value_dtype != _UINT8:
        raise PayloadError(f"unknown value dtype code {value_dtype}; accepted: only {_UINT8} (uint8)")
    if restored not in _RESTORED:
        raise PayloadError(f"unknown restored dtype code {restored}; accepted: {sorted(_RESTORED)}")
    if not 1 <= ndim <= MAX_NDIM:
        raise PayloadError(f"payload ndim {ndim} is outside 1..{MAX_NDIM}")
    if len(data) < _FIXED.size + 4 * ndim:
        raise PayloadError(f"truncated payload: {len(data)} bytes cannot hold a {ndim}-dim shape")
    shape = _check_shape(struct.unpack_from(f"<{ndim}I", data, _FIXED.size))
    groups = shape[0] if mode == 1 else 1
    size = header_size(ndim, groups)
    if version == VERSION:
        return PayloadHeader(VERSION, mode == 1, _RESTORED[restored], shape, size)
    from .coded import CODING_ANS

    if len(data) < size + _CODED_EXTENSION.size:
        raise PayloadError(f"truncated payload: {len(data)} bytes cannot hold a version-2 header of "
                           f"{size + _CODED_EXTENSION.size} bytes (shape {shape})")
    coding, digest = _CODED_EXTENSION.unpack_from(data, size)
    if coding != CODING_ANS:
        raise PayloadError(f"unknown coding {coding}; accepted: {CODING_ANS} (rANS, one table per channel)")
    return PayloadHeader(CODED_VERSION, mode == 1, _RESTORED[restored], shape, size + _CODED_EXTENSION.size,
                         bytes(digest))


def _read_steps_header(data: memoryview, tables: CodeTables | None) -> PayloadHeader:
    if len(data) < _STEPS_HEADER.size:
        raise PayloadError(f"truncated payload: {len(data)} bytes, a version-3 header is {_STEPS_HEADER.size}")
    _, _, restored, _, samples, digest = _STEPS_HEADER.unpack_from(data)
    if restored not in _RESTORED:
        raise PayloadError(f"unknown restored dtype code {restored}; accepted: {sorted(_RESTORED)}")
    if samples < 1:
        raise PayloadError("a version-3 payload holds at least one sample, its header says 0")
    _check_tables(tables, bytes(digest), STEPS_VERSION)
    if tables.steps is None:
        raise PayloadError("a version-3 payload needs code tables with fixed steps; these have none")
    return PayloadHeader(STEPS_VERSION, False, _RESTORED[restored], (samples, *tables.steps.sample_shape),
                         _STEPS_HEADER.size, bytes(digest))


def _check_tables(tables: CodeTables | None, digest: bytes, version: int) -> None:
    if tables is None:
        raise PayloadError(f"an entropy-coded (version {version}) payload decodes only with the code tables it was "
                           "coded with (the split artifact's); pass tables=")
    if digest != tables.digest:
        raise PayloadError(f"this payload was coded with code tables {digest.hex()}, not these "
                           f"({tables.digest.hex()}): use the same artifact on both sides")


def decode(data: bytes | bytearray | memoryview, max_bytes: int | None = None, tables: CodeTables | None = None,
           max_numel: int = MAX_CODED_NUMEL) -> torch.Tensor:
    """Validate a payload and return the dequantised tensor.

    Args:
        data: bytes produced by :func:`encode`.
        max_bytes: if given, payloads longer than this are rejected before anything is allocated.
        tables: the code tables a version-2 or version-3 payload was coded with (a version-1
            payload needs none).
        max_numel: a coded (version 2 or 3) payload claiming more elements is refused before
            anything is allocated (its length does not bound them: a likely code costs almost no bits).

    Returns:
        A CPU tensor of the encoded shape and dtype: within ``scale / 2`` of what was encoded in
        versions 1 and 2; in version 3 within half a step of it where it lay inside the range of
        codes 0..255 of the tables' steps, else that range's nearest end.

    Raises:
        PayloadError: any malformed payload: too long, truncated or with trailing bytes, bad
            header fields, a checksum mismatch, a scale that is not finite and positive, or a
            scale and zero point that would dequantise to inf in float32 or the restored dtype
            (so a decoded tensor is always finite); versions 2 and 3: no tables or other tables than
            it was coded with (version 3: tables without fixed steps), more than ``max_numel``
            elements, or a stream that does not decode to exactly its codes.

    Example:
        >>> decode(encode(torch.ones(2, 2))).tolist()
        [[1.0, 1.0], [1.0, 1.0]]
    """
    if max_bytes is not None and isinstance(data, (bytes, bytearray, memoryview)) and len(data) > max_bytes:
        raise PayloadError(f"payload of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    header = read_header(data, tables)
    data = memoryview(data).cast("B")
    if header.version == CODED_VERSION:
        _check_tables(tables, header.table_digest, CODED_VERSION)
    if header.version != VERSION and header.numel > max_numel:
        raise PayloadError(f"payload shape {header.shape} claims {header.numel} elements, above the limit of "
                           f"{max_numel}")
    if header.version == STEPS_VERSION:
        from .coded import decode_codes

        if _steps_checksum(data[:_STEPS_HEADER.size], data[_STEPS_HEADER.size:]) != _STEPS_HEADER.unpack_from(data)[3]:
            raise PayloadError("corrupted payload: its CRC-32 does not match its bytes")
        tables.steps.check_dtype(header.dtype)
        return tables.steps.dequantize(decode_codes(data[header.header_bytes:], header.shape, tables), header.dtype)
    if header.version == VERSION and len(data) != header.total_bytes:
        kind = "truncated" if len(data) < header.total_bytes else "oversized"
        raise PayloadError(
            f"{kind} payload: {len(data)} bytes, but its header (shape {header.shape}) needs exactly "
            f"{header.total_bytes}"
        )
    if _checksum(data[:_FIXED.size], data[_FIXED.size:]) != _FIXED.unpack_from(data)[-1]:
        raise PayloadError("corrupted payload: its CRC-32 does not match its bytes")
    groups = header.shape[0] if header.per_sample else 1
    params_at = _FIXED.size + 4 * len(header.shape)
    params = np.frombuffer(data, dtype=_PARAM, count=groups, offset=params_at)
    scale = params["scale"].astype(np.float32)
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise PayloadError("inconsistent payload: every scale must be finite and > 0")
    _check_range(scale, params["zero_point"], header.dtype)
    if header.version == CODED_VERSION:
        from .coded import decode_codes

        codes = decode_codes(data[header.header_bytes:], header.shape, tables)
    else:
        codes = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=header.header_bytes).copy())
    return dequantize(codes.reshape(header.shape), torch.from_numpy(scale),
                      torch.from_numpy(params["zero_point"].copy()), header.dtype)
