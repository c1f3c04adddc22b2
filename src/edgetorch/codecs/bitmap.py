"""Bitmap storage of one tensor: one bit per element ("stored") plus the stored elements packed.

BitTrain (Hosny et al., SEC'21), Sec. 3.2: for n elements of which nnz are kept, the bitmap
format holds ``value_bytes * nnz + n / 8`` bytes (the paper's M_b), against ``value_bytes * n``
dense (M_d). Zero is decided on the bit pattern, so NaN and Inf are kept exactly and -0.0 counts
as zero (the only thing a lossless roundtrip may change is the sign of a zero).

Bit order: element i is bit ``i % 8`` (least significant first) of byte ``i // 8``, row-major
over the tensor's logical shape, whatever its strides.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import _backend, _cpu_kernels, _cuda
from .protocol import HeldValues

# Floats are compared as integers of the same width: |v| as bits is monotone in |v| for every
# IEEE-style float (NaN sorts above Inf), so "keep iff abs_bits > limit" is one integer test.
_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}
_ABS_MASK = {torch.int64: 0x7FFF_FFFF_FFFF_FFFF, torch.int32: 0x7FFF_FFFF, torch.int16: 0x7FFF}
FLOAT_DTYPES = tuple(_INT_VIEW)


@dataclass(frozen=True, eq=False)
class BitmapTensor(HeldValues):
    """A tensor held as a bitmap of stored positions plus the stored values.

    Attributes:
        bitmap: ``uint8`` tensor of ``ceil(numel / 8)`` bytes; bit ``i % 8`` of byte ``i // 8``
            is set when element ``i`` (row-major) is stored in ``values``.
        values: 1-D tensor of the stored elements in row-major order, in the value dtype.
        shape: logical shape of the original tensor.
        dtype: dtype of the original tensor (what :meth:`unpack` returns).
    """

    bitmap: torch.Tensor
    values: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nnz(self) -> int:
        """Number of stored values."""
        return self.values.numel()

    @property
    def nbytes(self) -> int:
        """Exact bytes of tensor memory held: bitmap bytes + stored value bytes."""
        return self.bitmap.numel() + self.value_bytes

    def unpack(self) -> torch.Tensor:
        """Rebuild the dense tensor (a new, contiguous tensor; this object is left intact).

        Returns:
            A tensor of ``shape`` and ``dtype`` on ``device``: stored values in place, zeros elsewhere.
        """
        values = self.values if self.values.dtype == self.dtype else self.values.to(self.dtype)
        if (kernel := (_backend.CPU if values.is_cpu else _backend.device(values)).unpack_bitmap) is not None:
            return kernel(self.bitmap, values, self.shape)
        if values.is_cpu:
            _cpu_kernels.warn_fallback()
        flat = unpack_torch(self.bitmap, values.view(_INT_VIEW[self.dtype]), self.numel)
        return flat.view(self.dtype).view(self.shape)


def pack_bitmap(
    t: torch.Tensor, threshold: float = 0.0, value_dtype: torch.dtype | None = None
) -> BitmapTensor:
    """Store ``t`` as a bitmap plus its non-zero values.

    Args:
        t: a floating-point tensor (float16, bfloat16, float32, float64) of any shape, including
            0-d, empty and non-contiguous; on any device.
        threshold: values with ``|v| <= threshold`` are dropped (read back as 0). ``0.0`` is
            lossless: only exact zeros are dropped, NaN and Inf are kept bit for bit.
        value_dtype: store the kept values in this float dtype (e.g. ``torch.float16``, the
            paper's Fig. 8 combination); ``None`` keeps ``t.dtype``. Rounding follows
            ``Tensor.to``: float16 overflows to Inf beyond 65504, bfloat16 does not.

    Returns:
        A :class:`BitmapTensor`; ``.unpack()`` gives the dense tensor back.

    Example:
        >>> x = torch.relu(torch.randn(16, 64, 56, 56))
        >>> p = pack_bitmap(x)
        >>> p.nbytes == 4 * p.nnz + (x.numel() + 7) // 8
        True
        >>> torch.equal(p.unpack(), x)
        True
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"pack_bitmap expects a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INT_VIEW:
        raise TypeError(
            f"pack_bitmap stores floating-point tensors ({_names(FLOAT_DTYPES)}); got {t.dtype}. "
            "Integer and bool tensors have no activation sparsity to exploit: keep them dense."
        )
    limit = 0 if threshold.__class__ is float and threshold == 0.0 else zero_limit_bits(t.dtype, threshold)
    if value_dtype is not None and value_dtype not in _INT_VIEW:
        raise TypeError(f"value_dtype must be one of {_names(FLOAT_DTYPES)} or None; got {value_dtype}")
    if (kernel := (_backend.CPU if t.is_cpu else _backend.device(t)).pack_bitmap) is not None:
        bitmap, values = kernel(t, limit)  # the C kernel reads t's memory: no reshape or view to pay for
    else:
        if t.is_cpu:
            _cpu_kernels.warn_fallback()
        bitmap, values = pack_torch(t.detach().reshape(-1).view(_INT_VIEW[t.dtype]), limit)
        values = values.view(t.dtype)
    if value_dtype is not None and value_dtype != t.dtype:
        values = values.to(value_dtype)
    return BitmapTensor(bitmap, values, t.shape, t.dtype)  # positional: keywords cost 0.2 us a call


@dataclass(frozen=True, eq=False)
class CappedBitmapTensor(HeldValues):
    """A bitmap plus a fixed number of value slots, packed without a host sync.

    The caller chooses ``capacity`` before the kept count is known (the engine takes the count
    of the tensor saved at the same position in the previous step, plus a margin). The kernel
    writes the bitmap, the first ``min(count, capacity)`` kept values in row-major order and the
    true kept ``count`` on the device: ``count > capacity`` (:meth:`overflowed`) says that values
    were dropped, and the caller re-packs (for example once per step, when backward starts).

    Attributes:
        bitmap: ``uint8``, bit ``i % 8`` of byte ``i // 8`` set when element ``i`` is kept
            (exact whatever the capacity).
        values: 1-D ``[capacity]`` tensor in the value dtype; slots past the count are undefined.
        count: ``int64 [1]`` on the device: the number of kept elements (may exceed capacity).
        shape, dtype: the original tensor's.
    """

    bitmap: torch.Tensor
    values: torch.Tensor
    count: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nnz(self) -> int:
        """Kept elements (a host sync: read it for reports, not on the training path)."""
        return int(self.count[0])

    @property
    def lazy_nnz(self) -> torch.Tensor:
        """The kept count as the device tensor it is (no sync): what a ledger records."""
        return self.count

    @property
    def nbytes(self) -> int:
        """Bytes held: bitmap, every value slot (unused ones included) and the 8-byte count."""
        return self.bitmap.numel() + self.value_bytes + 8

    def overflowed(self) -> torch.Tensor:
        """0-d bool tensor on the device: more elements were kept than there are slots (no sync)."""
        return self.count[0] > self.values.numel()

    def unpack(self) -> torch.Tensor:
        """The dense tensor (a new one): exact when ``count <= capacity``; after an overflow the
        kept elements past the capacity read back as 0. On CUDA one launch and no sync."""
        values = self.values if self.values.dtype == self.dtype else self.values.to(self.dtype)
        kernels = _backend.CPU if values.is_cpu else _backend.device(values)
        if kernels.unpack_bitmap_capped is not None:
            return kernels.unpack_bitmap_capped(self.bitmap, values, self.shape)
        ints = values.view(_INT_VIEW[self.dtype])
        kept = min(int(self.count[0]), values.numel())  # no GPU kernels here: reading it is no stall
        mask = unpack_bits(self.bitmap, self.numel)
        if kept < self.nnz:  # an overflow: drop the set bits that have no value
            mask = mask.clone()
            mask[mask.nonzero().flatten()[kept:]] = False
        if kernels.unpack_bitmap is not None:
            return kernels.unpack_bitmap(pack_bits(mask), values[:kept], self.shape)
        out = torch.zeros(self.numel, dtype=ints.dtype, device=ints.device).masked_scatter_(mask, ints[:kept])
        return out.view(self.dtype).view(self.shape)


def pack_bitmap_capped(
    t: torch.Tensor, capacity: int, threshold: float = 0.0, value_dtype: torch.dtype | None = None
) -> CappedBitmapTensor:
    """:func:`pack_bitmap` into ``capacity`` value slots chosen in advance: no host sync on CUDA.

    Args:
        t: a floating-point tensor of any shape, on any device.
        capacity: value slots to allocate (>= 0). If more elements are kept, the bitmap and the
            count are still exact, the first ``capacity`` values are stored and
            :meth:`CappedBitmapTensor.overflowed` is true.
        threshold, value_dtype: as in :func:`pack_bitmap`.

    Returns:
        A :class:`CappedBitmapTensor`. On CUDA with Triton one kernel launch (plus a cast when
        ``value_dtype`` differs) and no sync; elsewhere :func:`pack_bitmap`'s path, copied into
        the fixed-capacity layout.
    """
    if not isinstance(t, torch.Tensor) or t.dtype not in _INT_VIEW:
        raise TypeError(f"pack_bitmap_capped stores floating-point tensors ({_names(FLOAT_DTYPES)}); got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity must be an int >= 0 (value slots); got {capacity!r}")
    if value_dtype is not None and value_dtype not in _INT_VIEW:
        raise TypeError(f"value_dtype must be one of {_names(FLOAT_DTYPES)} or None; got {value_dtype}")
    limit = zero_limit_bits(t.dtype, threshold)
    bits = _cuda.untracked(t).reshape(-1).view(_INT_VIEW[t.dtype])
    if (kernel := (_backend.CPU if bits.is_cpu else _backend.device(bits)).pack_bitmap_capped) is not None:
        bitmap, values, count = kernel(bits.contiguous(), limit, capacity)
        values = values.view(t.dtype)
    else:
        packed = pack_bitmap(t, threshold)
        bitmap, kept = packed.bitmap, packed.values
        values = torch.zeros(capacity, dtype=t.dtype, device=t.device)
        values[: min(capacity, kept.numel())] = kept[:capacity]
        count = torch.tensor([kept.numel()], dtype=torch.int64, device=t.device)
    if value_dtype is not None and value_dtype != t.dtype:
        values = values.to(value_dtype)
    return CappedBitmapTensor(bitmap, values, count, t.shape, t.dtype)


def zero_limit_bits(dtype: torch.dtype, threshold: float) -> int:
    """Largest ``abs`` bit pattern of ``dtype`` that counts as zero under ``|v| <= threshold``."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise TypeError(f"threshold must be a non-negative number, got {threshold!r}")
    if not threshold >= 0:  # also rejects NaN
        raise ValueError(f"threshold must be >= 0 (0 = lossless), got {threshold!r}")
    if threshold == 0:
        return 0
    try:
        threshold = float(threshold)
    except OverflowError:  # an int beyond float range exceeds every finite value, like inf
        threshold = math.inf
    return _limit_bits(dtype, threshold)


@functools.lru_cache(maxsize=256)
def _limit_bits(dtype: torch.dtype, threshold: float) -> int:
    # Cached: a policy packs every tensor at the same threshold, and the two reads below are
    # ~10 us of host time per packed tensor (and look like device reads to a sync counter).
    as_dtype = torch.tensor(threshold, dtype=torch.float64).to(dtype)
    bits = int(as_dtype.view(_INT_VIEW[dtype]).item())
    # Rounding to dtype may land above the threshold; then the largest value <= threshold is
    # the next representable value below it (one step down in the bit pattern).
    if as_dtype.double().item() > threshold:
        bits -= 1
    return bits


def pack_bitmap_if_smaller(
    t: torch.Tensor, threshold: float, value_dtype: torch.dtype | None, max_bytes: int
) -> BitmapTensor | None:
    """:func:`pack_bitmap` of a float tensor, or None when the result would hold ``max_bytes`` or more.

    The decision reads the exact kept count from packing's own first pass: on CUDA with the one
    host sync that sizing the values takes anyway, and with the C extension on a CPU before the
    values are gathered (a tensor that does not shrink costs one pass that writes only the
    bitmap). :class:`edgetorch.Bitmap` uses it on GPUs, where a separate estimate would be a
    second sync per tensor, and on a CPU for tensors small enough that this pass costs less
    than estimating from a sample (a few torch calls).
    """
    limit = zero_limit_bits(t.dtype, threshold)
    value_bytes = (value_dtype or t.dtype).itemsize
    n = t.numel()
    if (kernel := (_backend.CPU if t.is_cpu else _backend.device(t)).pack_bitmap) is not None:
        # kept values that still leave the packed form under max_bytes
        packed = kernel(t, limit, (max_bytes - (n + 7) // 8 - 1) // value_bytes)
        if packed is None:
            return None
        bitmap, values = packed
    else:
        bits = t.detach().reshape(-1).view(_INT_VIEW[t.dtype])
        keep = _kept(bits, limit)
        if (n + 7) // 8 + int(keep.sum()) * value_bytes >= max_bytes:
            return None
        bitmap, values = pack_bits(keep), bits[keep].view(t.dtype)
    if value_dtype is not None and value_dtype != t.dtype:
        values = values.to(value_dtype)
    return BitmapTensor(bitmap, values, t.shape, t.dtype)


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as a bitmap: bit ``i % 8`` of byte ``i // 8`` is element ``i`` (row-major).

    Args:
        mask: bool tensor of any shape, on any device.

    Returns:
        ``uint8`` tensor of ``ceil(mask.numel() / 8)`` bytes; the unused high bits are 0.
    """
    if mask.is_cpu and (kernel := _backend.CPU.pack_bits) is not None:
        return kernel(mask)
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = _BIT_WEIGHTS.to(flat.device)
    return (flat.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` bits of ``bitmap`` as a 1-D bool tensor (inverse of :func:`pack_bits`)."""
    if bitmap.is_cpu and (kernel := _backend.CPU.unpack_bits) is not None:
        return kernel(bitmap, numel)
    weights = _BIT_WEIGHTS.to(bitmap.device)
    return (bitmap.unsqueeze(1) & weights).ne(0).view(-1)[:numel]


def pack_torch(bits: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-generic packing with torch ops (the reference, and the fallback without kernels)."""
    keep = _kept(bits, limit)
    return pack_bits(keep), bits[keep]


def _kept(bits: torch.Tensor, limit: int) -> torch.Tensor:
    """Which elements of an integer view are stored: ``|v|`` as bits above ``limit``."""
    return (bits & _ABS_MASK[bits.dtype]) > limit


def unpack_torch(bitmap: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """Device-generic unpacking with torch ops (the reference, and the fallback without kernels)."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    return out.masked_scatter_(unpack_bits(bitmap, numel), values)


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)
