"""Quantized storage of one tensor: 8, 4 or 2 bits per element with a min/scale per group.

ActNN (Chen et al., ICML'21), GACT and Mesa store saved activations at a few bits with per-group
ranges; derivatives of smooth nonlinearities and normalisations barely notice the rounding. This
codec is that storage, lossy by design, with an exact byte count and a stated error bound.

Format (the golden tests pin it; the CPU kernel, the Triton kernel and the torch ops here write
the same bytes):

* ``t`` is read row-major as ``[rows, n]`` (default ``rows = t.shape[0]``: one row per sample),
  in float32 (float64 is rounded to float32 first). Each row is cut into groups of ``group``
  consecutive elements, the last one shorter when ``group`` does not divide ``n``; no group
  spans two rows.
* Per group: ``lo = min``, ``d = max - lo``, ``scale = d / L`` with ``L = 2**bits - 1``, all
  float32. A constant group has ``scale = 0`` and every code 0 (decoded exactly). A group holding
  NaN or +-Inf, or whose range overflows float32, stores ``lo = scale = NaN`` and codes 0: it
  decodes to NaN, so a diverged activation stays visible in the gradients instead of being
  clipped into plausible numbers.
* Codes: ``v = (x - lo) * (L / d)``, then ``floor(v + 0.5)`` (nearest) or ``floor(v + u)``
  (stochastic, unbiased: ``E[code] = v``), clamped to ``[0, L]``. ``u`` is a counter-based hash
  of the seed and the element's row-major index (``_hash_uniform``), so one seed gives the same
  codes on every device and in every kernel, whatever the thread split.
* Bytes: row r's codes take ``ceil(n * bits / 8)`` bytes; element j sits at bit
  ``(j * bits) % 8`` of byte ``j * bits // 8`` of its row (least significant first, as the bitmap
  codec's bits), unused high bits 0. ``lo`` and ``scale`` are float32 ``[rows, groups]``.
* Decoding: ``lo + code * scale`` in float32, then rounded to the tensor's dtype.

Error bound: nearest rounding puts every finite value within ``scale / 2`` of its decoded value
(plus float32 rounding of the arithmetic, a few ulp, and the final rounding to a 16-bit dtype);
stochastic rounding within one step, ``scale``.

Bytes held: ``rows * ceil(n * bits / 8) + 8 * rows * ceil(n / group)``: at 8 bits and the
default group of 128, 1.0625 bytes per element, 0.27x of float32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import _backend, _cpu_kernels
from .bitmap import FLOAT_DTYPES, CappedBitmapTensor, _names, unpack_bits
from .protocol import HeldValues
from .mask import pack_mask
from .topk import TopkRowsTensor

BITS = (8, 4, 2)
DEFAULT_GROUP = 128
_MASK32 = 0xFFFF_FFFF
_NAN = float("nan")
_SLOTTED = (CappedBitmapTensor, TopkRowsTensor)  # values in fixed slots, the kept count held apart


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A tensor held as ``bits``-bit codes with a float32 minimum and step per group.

    Attributes:
        codes: ``uint8 [rows, ceil(n * bits / 8)]``, the packed codes (see the module's format).
        lo: ``float32 [rows, groups]``, each group's minimum (NaN for a non-finite group).
        scale: ``float32 [rows, groups]``, each group's step between codes.
        shape: the original tensor's shape; ``dtype``: its dtype (what :meth:`unpack` returns).
        bits: 8, 4 or 2; ``group``: elements per group.
    """

    codes: torch.Tensor
    lo: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    group: int

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nnz(self) -> int:
        """Every element is stored (as a code)."""
        return self.numel

    @property
    def nbytes(self) -> int:
        """Exact bytes held: codes + float32 minimum and step of every group."""
        return self.codes.numel() + 4 * (self.lo.numel() + self.scale.numel())

    def unpack(self) -> torch.Tensor:
        """The decoded tensor: ``lo + code * scale`` per element (a new tensor of ``shape``/``dtype``)."""
        rows = self.lo.shape[0]
        if not rows:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)
        codes = self.codes
        if (kernel := (_backend.CPU if codes.is_cpu else _backend.device(codes)).dequantize) is not None:
            # one pass, straight into a tensor of the shape and dtype
            return kernel(codes, self.lo, self.scale, self.shape.numel() // rows, self.bits, self.group, self.dtype,
                          self.shape)
        if codes.is_cpu:
            _cpu_kernels.warn_fallback()
        return _dequantize_torch(self.codes, self.lo, self.scale, self.numel // rows, self.bits, self.group).to(self.dtype).view(self.shape)


def pack_quantized(
    t: torch.Tensor,
    bits: int = 8,
    *,
    group: int = DEFAULT_GROUP,
    rows: int | None = None,
    seed: int | None = None,
) -> QuantizedTensor:
    """Store ``t`` at ``bits`` bits per element, with a minimum and a step per group of ``group``.

    Args:
        t: a floating-point tensor (float16, bfloat16, float32, float64), any shape and device.
        bits: 8, 4 or 2.
        group: elements per group, a multiple of 8 (so groups start on a byte); each group's
            range sets its step, so smaller groups are more exact and cost more bytes.
        rows: read ``t`` row-major as this many rows (groups never span two); default
            ``t.shape[0]`` (one row per sample of a batch-first tensor; 1 for a 0-d tensor).
        seed: None rounds to nearest; an int (0 <= seed < 2**32) rounds stochastically,
            reproducibly for that seed (unbiased: the decoded value's expectation is the input).

    Returns:
        A :class:`QuantizedTensor`; ``.unpack()`` decodes it.

    Raises:
        TypeError: ``t`` is not a floating-point tensor.
        ValueError: bits, group, rows or seed out of range (the message says what is accepted).

    Example:
        >>> x = torch.randn(8, 197, 768)
        >>> q = pack_quantized(x, bits=8)
        >>> q.nbytes / (4 * x.numel())          # 1 byte per code + 8 bytes per 128 elements
        0.265625
        >>> bool(((q.unpack() - x).abs() <= q.scale.max() / 2 * 1.001).all())
        True
    """
    if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"pack_quantized stores floating-point tensors ({_names(FLOAT_DTYPES)}); "
                        f"got {getattr(t, 'dtype', type(t).__name__)}")
    check_bits(bits)
    if isinstance(group, bool) or not isinstance(group, int) or group < 8 or group % 8:
        raise ValueError(f"group must be a positive multiple of 8 (elements per min/step pair), e.g. 64 or 128; "
                         f"got {group!r}")
    rows = (t.shape[0] if t.dim() else 1) if rows is None else rows
    if t.numel() == 0:
        rows = 0
    elif isinstance(rows, bool) or not isinstance(rows, int) or rows < 1 or t.numel() % rows:
        raise ValueError(f"rows must be a positive int dividing numel={t.numel()}; got {rows!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MASK32):
        raise ValueError(f"seed must be None (round to nearest) or an int in [0, 2**32) (stochastic rounding); "
                         f"got {seed!r}")
    return quantize_checked(t, bits, group, rows, seed)


def quantize_checked(t: torch.Tensor, bits: int, group: int, rows: int, seed: int | None) -> QuantizedTensor:
    """:func:`pack_quantized` of arguments it has checked (``rows`` 0 for an empty ``t``, else a
    divisor of its elements): the policies' call, which checked ``bits`` and ``group`` once when
    they were made and store one tensor per saved activation (the checks cost microseconds)."""
    # CUDA: Triton, no host sync. CPU: the C kernel (groups in batches: their ranges together,
    # then their codes from L1), reading t in place: no reshape or detach (a few microseconds each)
    if rows and (kernel := (_backend.CPU if t.is_cpu else _backend.device(t)).quantize) is not None:
        codes, lo, scale = kernel(t, rows, t.numel() // rows, bits, group, seed)
    else:
        x = t.detach().reshape(rows, -1) if rows else t.detach().new_empty((0, 0))
        if x.is_cpu and rows:
            _cpu_kernels.warn_fallback()
        codes, lo, scale = _quantize_torch(x.float(), bits, group, seed)
    return QuantizedTensor(codes, lo, scale, t.shape, t.dtype, bits, group)


def check_bits(bits: int) -> None:
    """Raise unless ``bits`` is one of the widths the codec stores."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be one of {', '.join(map(str, BITS))}; got {bits!r}")


def _group_ranges(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group ``(lo, scale, inv)`` of a float32 ``[rows, n]`` tensor, as the format defines them."""
    rows, n = x.shape
    full = n // group
    parts = []
    if full:
        parts.append(torch.aminmax(x[:, : full * group].reshape(rows, full, group), dim=2))
    if n % group:
        tail = torch.aminmax(x[:, full * group:], dim=1)
        parts.append((tail.min.unsqueeze(1), tail.max.unsqueeze(1)))
    lo = torch.cat([p[0] for p in parts], 1) if parts else x.new_zeros(rows, 0)
    hi = torch.cat([p[1] for p in parts], 1) if parts else x.new_zeros(rows, 0)
    levels = float(2**bits - 1)
    d = hi - lo  # NaN or Inf for a group holding NaN/Inf, Inf when a finite range overflows
    bad = ~torch.isfinite(d)
    positive = d > 0
    # Tensor by tensor: IEEE divisions. `levels / d` would be `d.reciprocal() * levels` (two
    # roundings: Tensor.__rtruediv__), and on CUDA `d / levels` multiplies by 1 / levels.
    levels_t = torch.full_like(d, levels)
    scale = torch.where(positive, d / levels_t, torch.zeros_like(d))
    inv = torch.where(positive, levels_t / d, torch.zeros_like(d))
    nan = torch.full_like(d, _NAN)
    lo, scale = torch.where(bad, nan, lo), torch.where(bad, nan, scale)
    return lo, scale, torch.where(bad, torch.zeros_like(d), inv)


def _quantize_torch(x: torch.Tensor, bits: int, group: int, seed: int | None):
    """The format's reference with torch ops (any device): ``(codes, lo, scale)`` of float32 ``[rows, n]``."""
    rows, n = x.shape
    lo, scale, inv = _group_ranges(x, bits, group)
    per_group = lambda g: g.repeat_interleave(group, dim=1)[:, :n]  # noqa: E731
    lo_e = torch.where(torch.isnan(per_group(lo)), torch.zeros_like(x), per_group(lo))
    v = (x - lo_e) * per_group(inv)
    if seed is None:
        offset = torch.full_like(v, 0.5)
    else:
        index = torch.arange(rows * n, dtype=torch.int64, device=x.device).view(rows, n)
        offset = _hash_uniform(index, seed)
    levels = 2**bits - 1
    # NaN (a non-finite group's x) counts as code 0; the group decodes to NaN through its scale.
    codes = torch.nan_to_num(torch.floor(v + offset), nan=0.0).clamp_(0, levels).to(torch.uint8)
    return _pack_codes(codes, bits), lo, scale


def _hash_uniform(index: torch.Tensor, seed: int) -> torch.Tensor:
    """A float32 in [0, 1) per int64 ``index``: ``(mix(index mod 2**32 xor mix(seed)) >> 8) / 2**24``.

    ``mix`` is a 32-bit integer finaliser (xor-shift and multiply rounds); its multipliers are
    below 2**31, so the products of 32-bit values stay inside int64 here, in C and in Triton.
    """
    h = _mix32((index & _MASK32) ^ _mix32_int(seed))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


_M1, _M2 = 0x7FEB352D, 0x2C1B3C6D


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * _M1) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _M2) & _MASK32
    return h ^ (h >> 16)


def _mix32_int(h: int) -> int:
    h &= _MASK32
    h ^= h >> 16
    h = (h * _M1) & _MASK32
    h ^= h >> 15
    h = (h * _M2) & _MASK32
    return h ^ (h >> 16)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8 [rows, n]`` codes packed ``8 // bits`` to a byte, each row padded to whole bytes."""
    if bits == 8:
        return codes.contiguous()
    per = 8 // bits
    rows, n = codes.shape
    padded = torch.nn.functional.pad(codes, (0, (-n) % per)).view(rows, -1, per).to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (padded << shifts).sum(2).to(torch.uint8)


def _unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(2) >> shifts) & (2**bits - 1)).view(packed.shape[0], -1)[:, :n]


def _dequantize_torch(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, n: int, bits: int,
                      group: int) -> torch.Tensor:
    """Float32 ``[rows, n]``: ``lo + code * scale`` per element (the format's decoding)."""
    per_group = lambda g: g.repeat_interleave(group, dim=1)[:, :n]  # noqa: E731
    return per_group(lo) + _unpack_codes(codes, n, bits).to(torch.float32) * per_group(scale)


@dataclass(frozen=True, eq=False)
class QuantizedValues:
    """Another codec's kept values held quantized: Back Razor's top-k values at 8 bits (its
    "+ Mesa" row). ``held`` is that codec's object with an empty ``values``; ``values`` the
    quantized values (one row per row of the original values, groups of the default size).
    """

    held: HeldValues
    values: QuantizedTensor

    @property
    def nnz(self) -> int:
        # A form with value slots counts its kept values apart; otherwise every value was kept.
        return self.held.nnz if isinstance(self.held, _SLOTTED) else self.values.numel

    @property
    def lazy_nnz(self) -> int | torch.Tensor:
        """:attr:`nnz` without a host sync (a device tensor of counts where reading it would sync)."""
        return self.held.lazy_nnz if isinstance(self.held, _SLOTTED) else self.values.numel

    @property
    def nbytes(self) -> int:
        return self.held.nbytes + self.values.nbytes

    def unpack(self) -> torch.Tensor:
        return dataclasses.replace(self.held, values=self.values.unpack()).unpack()


def quantize_values(packed, bits: int = 8, *, group: int = DEFAULT_GROUP) -> QuantizedValues:
    """Hold the ``values`` of a bitmap-style codec object (:class:`~edgetorch.codecs.BitmapTensor`,
    the CUDA top-k form) quantized, and the rest as it is.

    Args:
        packed: a codec object with a float ``values`` tensor (1-D, or one row per sample).
        bits, group: as :func:`pack_quantized`.

    Returns:
        A :class:`QuantizedValues` whose ``unpack()`` gives ``packed.unpack()`` with its values decoded.
    """
    values = packed.values
    q = pack_quantized(values, bits, group=group, rows=values.shape[0] if values.dim() == 2 else 1)
    return QuantizedValues(dataclasses.replace(packed, values=values.new_empty((0,) * values.dim())), q)


@dataclass(frozen=True, eq=False)
class SidedQuantizedTensor:
    """Quantized values whose side of an open interval ``(low, high)`` is kept exactly.

    The backward of a function with kinks at ``low`` and ``high`` (hardswish at -3 and 3: slope 0
    below, x/3 + 1/2 inside, 1 above; torch's CPU kernel counts -3 and 3 themselves as outside)
    reads which piece each input was on; rounding a value across a kink changes its derivative by
    a jump (0.5 for hardswish), which cost mobilenet_v3_small's 8-bit input gradient a cosine of
    0.997. One exact bit per element settles the piece; the codes give the value within it, and
    spend their range only there: outside, a value is read back as the nearer end.

    Attributes:
        values: the :class:`QuantizedTensor` of the input clamped into ``[low, high]``.
        inside: ``uint8`` bitmap, bit set where ``low < x < high`` (as :mod:`~edgetorch.codecs.mask`).
        low, high: the interval.
    """

    values: QuantizedTensor
    inside: torch.Tensor
    low: float
    high: float

    @property
    def nnz(self) -> int:
        return self.values.nnz

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.inside.numel()

    def unpack(self) -> torch.Tensor:
        """Inside: the decoded value, kept strictly inside ``(low, high)``. Outside: ``low`` or
        ``high``, whichever end the decoded value is nearer."""
        q = self.values.unpack()
        low, high = torch.tensor([self.low, self.high], dtype=q.dtype, device=q.device)
        inner_low, inner_high = torch.nextafter(low, high), torch.nextafter(high, low)
        if q.is_cpu and (kernel := _backend.CPU.sided_select) is not None:
            # the same values, bitwise from the C bitmap kernels
            bounds = torch.stack([low, high, inner_low, inner_high, (low + high) / 2]).tolist()
            return kernel(q, self.inside, *bounds)
        inside = unpack_bits(self.inside, q.numel()).view(q.shape)
        return torch.where(inside, q.clamp(inner_low, inner_high), torch.where(q > (low + high) / 2, high, low))


def pack_quantized_sided(t: torch.Tensor, bits: int, low: float, high: float, *, group: int = DEFAULT_GROUP,
                         rows: int | None = None, seed: int | None = None) -> SidedQuantizedTensor:
    """:func:`pack_quantized` of ``t`` clamped into ``[low, high]``, plus one exact bit per element:
    whether it lay in the open interval ``(low, high)``.

    Args:
        t, bits, group, rows, seed: as :func:`pack_quantized` (default: one row per sample).
        low, high: the interval, ``low < high``, both finite.

    Returns:
        A :class:`SidedQuantizedTensor`: ``bits + 1`` bits per element plus the group ranges.

    Example:
        >>> x = torch.tensor([[-3.01, -2.99, 2.999, 3.001] * 32])
        >>> y = pack_quantized_sided(x, 2, -3.0, 3.0).unpack()
        >>> bool((((y > -3) & (y < 3)) == ((x > -3) & (x < 3))).all())
        True
    """
    if not (isinstance(low, (int, float)) and isinstance(high, (int, float)) and -float("inf") < low < high < float("inf")):
        raise ValueError(f"low < high must be finite numbers; got low={low!r}, high={high!r}")
    # Outside the interval only the side is read back, so the codes spend their range on the
    # inside: a group's step comes from its values clamped into [low, high], not from outliers.
    values = pack_quantized(t.clamp(low, high), bits, group=group, rows=rows, seed=seed)
    inside = pack_mask(t, low, high, inside=(low + high) / 2).bitmap
    return SidedQuantizedTensor(values, inside, float(low), float(high))
