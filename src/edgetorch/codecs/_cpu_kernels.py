"""Native CPU kernels for bitmap packing (numba), byte-identical to ``bitmap.pack_torch``.

Both directions work on the integer view of the float tensor, so one compiled kernel per integer
width serves float16, bfloat16, float32 and float64 (numba knows no half types). Work is split
into chunks of whole bitmap bytes; each chunk learns where its values start from a popcount
prefix sum, so chunks are independent and every buffer is allocated at its exact final size.

Large inputs are split over ``torch.get_num_threads()`` threads of a plain thread pool (the
kernels release the GIL), not numba's ``parallel=True``: its OpenMP workers spin at the barrier,
and on a loaded machine a 1,000-element pack took 32 ms instead of 32 us waiting for a time
slice. Here the calling thread takes back any share no worker has started, never waits for a
core, and the pool is rebuilt after ``fork``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

_MASKS = {torch.int16: 0x7FFF, torch.int32: 0x7FFF_FFFF, torch.int64: 0x7FFF_FFFF_FFFF_FFFF}
_CHUNK_BYTES = 1 << 13  # 64 Ki elements: a chunk's output stays in L2 while it is written
_MIN_CHUNKS_PER_THREAD = 4  # below ~256 Ki elements per thread, a hand-off costs what it saves
_POPCOUNT = np.array([bin(b).count("1") for b in range(256)], dtype=np.int64)
_POPCOUNT_U = _POPCOUNT.astype(np.uint64)
# Per byte value and bit j: where bit j's value sits among the byte's kept values (an unset bit
# takes a set neighbour's rank, so the read stays inside the byte's values), and an all-ones or
# all-zeros mask that keeps or clears what was read.
_RANK = np.array(
    [[min(bin(b & ((1 << j) - 1)).count("1"), max(bin(b).count("1") - 1, 0)) for j in range(8)]
     for b in range(256)],
    dtype=np.uint8,
)
_SELECT = np.array([[-((b >> j) & 1) for j in range(8)] for b in range(256)], dtype=np.int32)

# A fresh buffer costs one page fault per 4 KiB on first write, which dominates a pass at memory
# speed (10M fp32: ~12 ms of faults against ~3 ms of copying). Like numpy, ask for transparent
# huge pages on large buffers. Above 32 MiB glibc always serves a block from its own mapping, so
# the advice cannot spill onto heap memory that other allocations share.
_HUGEPAGE_MIN_BYTES = 32 << 20
_MADV_HUGEPAGE = 14
if sys.platform.startswith("linux"):
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
else:
    _madvise = None



def _new_pool() -> None:
    global _pool
    # Threads start on demand, up to what the callers ask for at once.
    _pool = ThreadPoolExecutor(max_workers=os.cpu_count(), thread_name_prefix="edgetorch-bitmap")


_new_pool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_pool)  # a forked child has none of the parent's threads


def _empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(numel, dtype=dtype)
    size = numel * out.element_size()
    if _madvise is not None and size >= _HUGEPAGE_MIN_BYTES:
        start = -(-out.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (out.data_ptr() + size) // mmap.PAGESIZE * mmap.PAGESIZE
        _madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: failure changes nothing
    return out


def over_chunks(kernel, n_chunks: int, *args, min_per_thread: int = _MIN_CHUNKS_PER_THREAD) -> None:
    """Run ``kernel(*args, lo, hi)`` over chunk ranges covering ``[0, n_chunks)``."""
    threads = min(torch.get_num_threads(), n_chunks // min_per_thread)
    if threads <= 1:
        kernel(*args, 0, n_chunks)
        return
    bounds = [n_chunks * k // threads for k in range(threads + 1)]
    shares = zip(bounds[1:-1], bounds[2:])
    parts = [(_pool.submit(kernel, *args, lo, hi), lo, hi) for lo, hi in shares]
    kernel(*args, bounds[0], bounds[1])
    for future, lo, hi in parts:
        if future.cancel():  # no worker got a core in the meantime: do it here, don't wait
            kernel(*args, lo, hi)
        else:
            future.result()


@njit(cache=True, nogil=True)
def _build_bitmap(x, mask, limit, bitmap, counts, c_lo, c_hi):
    n = x.shape[0]
    full = n // 8
    # One 0/1 byte per element first: that loop vectorises, and eight flags read as one
    # little-endian word become a bitmap byte with one multiply (bit k lands in bit 56 + k).
    flags = np.empty(8 * _CHUNK_BYTES, dtype=np.uint8)
    for c in range(c_lo, c_hi):
        lo = c * _CHUNK_BYTES
        hi = min(lo + _CHUNK_BYTES, full)
        # Slices indexed from 0 spare numba's negative-index check, which blocks vectorising.
        xs = x[8 * lo : 8 * hi]
        kept = 0
        for i in range(xs.shape[0]):
            f = (xs[i] & mask) > limit
            flags[i] = f
            kept += f
        bs = bitmap[lo:hi]
        for b in range(bs.shape[0]):
            word = np.uint64(0)
            for j in range(8):  # byte-order independent; compiles to one load on little-endian
                word |= np.uint64(flags[8 * b + j]) << np.uint64(8 * j)
            bs[b] = (word * np.uint64(0x0102040810204080)) >> np.uint64(56)
        if n % 8 and c == full // _CHUNK_BYTES:
            byte = 0  # ragged last byte: its unused high bits stay 0
            for j in range(n - 8 * full):
                byte |= np.int64((x[8 * full + j] & mask) > limit) << j
            bitmap[full] = byte
            kept += _POPCOUNT[byte]
        counts[c] = kept


@njit(cache=True, nogil=True)
def _compact(x, bitmap, offsets, out, c_lo, c_hi):
    for c in range(c_lo, c_hi):
        lo = c * _CHUNK_BYTES
        last = min(lo + _CHUNK_BYTES, bitmap.shape[0]) - 1
        # Branch-free: write every element, advance only past kept ones. The write after the
        # chunk's last kept element would land in the next chunk's slice, so the last non-empty
        # byte goes bit by bit.
        while last >= lo and bitmap[last] == 0:
            last -= 1
        xs, bs, outs = x[8 * lo :], bitmap[lo:], out[offsets[c] :]
        o = np.uint64(0)  # unsigned: numba adds no negative-index check for it
        for b in range(last - lo):
            byte = bs[b]
            for j in range(8):
                outs[o] = xs[8 * b + j]
                o += np.uint64((byte >> j) & 1)
        if last >= lo:
            byte = bitmap[last]
            for j in range(8):
                if (byte >> j) & 1:
                    outs[o] = x[8 * last + j]
                    o += np.uint64(1)


@njit(cache=True, nogil=True)
def _chunk_counts(bitmap, counts):
    for c in range(counts.shape[0]):
        kept = 0
        for b in range(c * _CHUNK_BYTES, min((c + 1) * _CHUNK_BYTES, bitmap.shape[0])):
            kept += _POPCOUNT[bitmap[b]]
        counts[c] = kept


@njit(cache=True, nogil=True)
def _scatter(bitmap, values, offsets, out, c_lo, c_hi):
    n = out.shape[0]
    nnz = values.shape[0]
    for c in range(c_lo, c_hi):
        lo = c * _CHUNK_BYTES
        hi = min(lo + _CHUNK_BYTES, bitmap.shape[0])
        # The branch-free byte reads values[o + rank], where an unset bit borrows a neighbour's
        # rank; that stays in bounds before the last non-empty byte overall. That byte goes bit
        # by bit, and everything after it is a plain zero fill.
        fast_end = min(hi, n // 8)
        zero_from = hi
        if offsets[c + 1] == nnz:
            last = hi - 1
            while last >= lo and bitmap[last] == 0:
                last -= 1
            fast_end = min(fast_end, max(last, lo))
            zero_from = last + 1
        bs, vs, outs = bitmap[lo:fast_end], values[offsets[c] :], out[8 * lo : 8 * fast_end]
        o = np.uint64(0)  # unsigned: numba adds no negative-index check for it
        for b in range(bs.shape[0]):
            byte = bs[b]
            for j in range(8):
                outs[8 * b + j] = vs[o + _RANK[byte, j]] & _SELECT[byte, j]
            o += _POPCOUNT_U[byte]
        k = offsets[c] + np.int64(o)
        for b in range(fast_end, zero_from):
            byte = bitmap[b]
            for j in range(min(8, n - 8 * b)):
                if (byte >> j) & 1:
                    out[8 * b + j] = values[k]
                    k += 1
                else:
                    out[8 * b + j] = 0
        out[8 * zero_from : min(8 * hi, n)] = 0


def _offsets(counts: np.ndarray) -> np.ndarray:
    offsets = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def pack(bits: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bitmap and kept values of the integer view of a float tensor.

    Args:
        bits: contiguous 1-D ``int16``/``int32``/``int64`` CPU tensor of float bit patterns.
        limit: largest ``abs`` bit pattern that counts as zero (``bitmap.zero_limit_bits``).

    Returns:
        ``(bitmap, values)``: ``uint8`` bitmap of ``ceil(n / 8)`` bytes and the kept elements
        in order, in ``bits.dtype``.
    """
    bitmap = torch.empty((bits.numel() + 7) // 8, dtype=torch.uint8)
    x, bm = bits.numpy(), bitmap.numpy()
    n_chunks = -(-bm.shape[0] // _CHUNK_BYTES)
    counts = np.empty(n_chunks, dtype=np.int64)
    # Mask and limit as wide as the elements: a wider compare would halve the vector lanes.
    mask, limit = x.dtype.type(_MASKS[bits.dtype]), x.dtype.type(limit)
    over_chunks(_build_bitmap, n_chunks, x, mask, limit, bm, counts)
    offsets = _offsets(counts)
    values = _empty(int(offsets[-1]), bits.dtype)
    over_chunks(_compact, n_chunks, x, bm, offsets, values.numpy())
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
    out = _empty(numel, values.dtype)
    bm = bitmap.numpy()
    counts = np.empty(-(-bm.shape[0] // _CHUNK_BYTES), dtype=np.int64)
    _chunk_counts(bm, counts)
    over_chunks(_scatter, counts.shape[0], bm, values.numpy(), _offsets(counts), out.numpy())
    return out
