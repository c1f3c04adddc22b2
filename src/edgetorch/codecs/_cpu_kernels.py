"""Native CPU kernels for bitmap packing (numba), byte-identical to ``bitmap.pack_torch``.

Both directions work on the integer view of the float tensor, so one compiled kernel per integer
width serves float16, bfloat16, float32 and float64 (numba knows no half types). Work is split
into chunks of whole bitmap bytes; each chunk learns where its values start from a popcount
prefix sum, so chunks run in parallel and every buffer is allocated at its exact final size.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch
from numba import njit, prange

_MASKS = {torch.int16: 0x7FFF, torch.int32: 0x7FFF_FFFF, torch.int64: 0x7FFF_FFFF_FFFF_FFFF}
_CHUNK_BYTES = 1 << 13  # 64 Ki elements: a chunk's output stays in L2 while it is written
_POPCOUNT = np.array([bin(b).count("1") for b in range(256)], dtype=np.int64)

# A fresh buffer costs one page fault per 4 KiB on first write, which dominates a pass at memory
# speed (10M fp32: ~12 ms of faults against ~3 ms of copying). Like numpy, ask for transparent
# huge pages on large buffers. Above 32 MiB glibc always serves a block from its own mapping, so
# the advice cannot spill onto heap memory that other allocations share.
_HUGEPAGE_MIN_BYTES = 32 << 20
_MADV_HUGEPAGE = 14
_PAGE = 4096
if sys.platform.startswith("linux"):
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
else:
    _madvise = None


def _empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(numel, dtype=dtype)
    size = numel * out.element_size()
    if _madvise is not None and size >= _HUGEPAGE_MIN_BYTES:
        start = -(-out.data_ptr() // _PAGE) * _PAGE
        end = (out.data_ptr() + size) // _PAGE * _PAGE
        _madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: failure changes nothing
    return out


@njit(cache=True, nogil=True, parallel=True)
def _build_bitmap(x, mask, limit, bitmap, counts):
    n = x.shape[0]
    full = n // 8
    for c in prange(counts.shape[0]):
        lo = c * _CHUNK_BYTES
        hi = min(lo + _CHUNK_BYTES, bitmap.shape[0])
        kept = 0
        for b in range(lo, min(hi, full)):
            byte = 0
            for j in range(8):
                byte |= np.int64((x[8 * b + j] & mask) > limit) << j
            bitmap[b] = byte
            kept += _POPCOUNT[byte]
        if hi > full:  # ragged last byte: its unused high bits stay 0
            byte = 0
            for j in range(n - 8 * full):
                byte |= np.int64((x[8 * full + j] & mask) > limit) << j
            bitmap[full] = byte
            kept += _POPCOUNT[byte]
        counts[c] = kept


@njit(cache=True, nogil=True, parallel=True)
def _compact(x, bitmap, offsets, out):
    for c in prange(offsets.shape[0] - 1):
        lo = c * _CHUNK_BYTES
        last = min(lo + _CHUNK_BYTES, bitmap.shape[0]) - 1
        # Branch-free: write every element, advance only past kept ones. The write after the
        # chunk's last kept element would land in the next chunk's slice, so the last non-empty
        # byte goes bit by bit.
        while last >= lo and bitmap[last] == 0:
            last -= 1
        o = offsets[c]
        for b in range(lo, last):
            byte = bitmap[b]
            for j in range(8):
                out[o] = x[8 * b + j]
                o += (byte >> j) & 1
        if last >= lo:
            byte = bitmap[last]
            for j in range(8):
                if (byte >> j) & 1:
                    out[o] = x[8 * last + j]
                    o += 1


@njit(cache=True, nogil=True, parallel=True)
def _chunk_counts(bitmap, counts):
    for c in prange(counts.shape[0]):
        kept = 0
        for b in range(c * _CHUNK_BYTES, min((c + 1) * _CHUNK_BYTES, bitmap.shape[0])):
            kept += _POPCOUNT[bitmap[b]]
        counts[c] = kept


@njit(cache=True, nogil=True, parallel=True)
def _scatter(bitmap, values, offsets, out):
    n = out.shape[0]
    nnz = values.shape[0]
    for c in prange(offsets.shape[0] - 1):
        lo = c * _CHUNK_BYTES
        hi = min(lo + _CHUNK_BYTES, bitmap.shape[0])
        # The branch-free byte reads values[o + rank of bit j], up to one past its own values;
        # that is in bounds while a set bit follows, i.e. before the last non-empty byte overall.
        fast_end = min(hi, n // 8)
        if offsets[c + 1] == nnz:
            last = hi - 1
            while last >= lo and bitmap[last] == 0:
                last -= 1
            fast_end = min(fast_end, max(last, lo))
        o = offsets[c]
        for b in range(lo, fast_end):
            byte = np.int64(bitmap[b])
            i = 8 * b
            # Ranks as a running sum rather than a loop-carried o keeps the 8 loads independent.
            r = o
            for j in range(8):
                bit = (byte >> j) & 1
                out[i + j] = values[r] & -bit
                r += bit
            o = r
        for b in range(fast_end, hi):
            byte = bitmap[b]
            for j in range(min(8, n - 8 * b)):
                if (byte >> j) & 1:
                    out[8 * b + j] = values[o]
                    o += 1
                else:
                    out[8 * b + j] = 0


def _offsets(counts: np.ndarray) -> np.ndarray:
    offsets = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def _n_chunks(nbytes: int) -> int:
    return (nbytes + _CHUNK_BYTES - 1) // _CHUNK_BYTES


def pack(bits: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bitmap and kept values of the integer view of a float tensor.

    Args:
        bits: contiguous 1-D ``int16``/``int32``/``int64`` CPU tensor of float bit patterns.
        limit: largest ``abs`` bit pattern that counts as zero (``bitmap.zero_limit_bits``).

    Returns:
        ``(bitmap, values)``: ``uint8`` bitmap of ``ceil(n / 8)`` bytes and the kept elements
        in order, in ``bits.dtype``.
    """
    n = bits.numel()
    bitmap = torch.empty((n + 7) // 8, dtype=torch.uint8)
    if n == 0:
        return bitmap, bits.new_empty(0)
    x = bits.numpy()
    counts = np.empty(_n_chunks(bitmap.numel()), dtype=np.int64)
    _build_bitmap(x, np.int64(_MASKS[bits.dtype]), np.int64(limit), bitmap.numpy(), counts)
    offsets = _offsets(counts)
    values = _empty(int(offsets[-1]), bits.dtype)
    if values.numel():
        _compact(x, bitmap.numpy(), offsets, values.numpy())
    return bitmap, values


def unpack(bitmap: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """Dense integer view rebuilt from a bitmap and the kept values, zeros elsewhere.

    Args:
        bitmap: ``uint8`` CPU tensor of ``ceil(numel / 8)`` bytes.
        values: contiguous 1-D integer CPU tensor, one element per set bit, in order.
        numel: number of elements of the dense tensor.

    Returns:
        A new contiguous 1-D tensor of ``numel`` elements in ``values.dtype``.
    """
    if values.numel() == 0:
        return values.new_zeros(numel)
    out = _empty(numel, values.dtype)
    bm = bitmap.numpy()
    counts = np.empty(_n_chunks(bm.shape[0]), dtype=np.int64)
    _chunk_counts(bm, counts)
    _scatter(bm, values.numpy(), _offsets(counts), out.numpy())
    return out
