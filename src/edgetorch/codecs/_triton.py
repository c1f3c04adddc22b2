"""Triton kernels for the bitmap, top-k, mask and quantized codecs on CUDA, byte-identical to the
torch reference.

This module imports ``triton`` at import time: import it only on the path that runs kernels
(``import edgetorch`` must not pull triton in). The bitmap, top-k and mask kernels work on the
integer view of a float tensor (int16 for float16/bfloat16, int32 for float32, int64 for
float64), so one compiled variant per width serves every float dtype and none of them compares
floats (no flush-to-zero or NaN subtleties on the device: zero, NaN and order are decided on bit
patterns, as on the CPU).

Formats, shared with ``bitmap.pack_torch`` / ``topk.pack_topk`` / ``mask.pack_mask``: element
``i`` (row-major) is bit ``i % 8`` (least significant first) of byte ``i // 8``; unused high bits
of the last byte are 0; stored values are the kept elements in row-major order.

How the compaction works (every kernel handles ``block`` consecutive elements, i.e. ``block / 8``
whole bitmap bytes, so no two programs write the same byte): each block needs the number of kept
elements before it. It gets it by a decoupled look-back inside the kernel (a single-pass scan:
the block takes a ticket, publishes its own count, sums its predecessors' published counts back to
the nearest published running total, then publishes its own running total), so no cumsum launch
and no zeroed buffer per call: the tickets and status words live in a cached per-device, per-stream
scratch buffer that the last program of every kernel zeroes again. Launches per call:

- :func:`pack_bitmap`: 2 (:func:`count`'s scan kernel, then :func:`compact`) and one host sync (the
  kept count sizes ``values``); :func:`pack_bitmap_capped`: 1, no sync (count, look-back and
  compaction in one pass into ``capacity`` slots, plus the true count);
- :func:`unpack_bitmap`, :func:`unpack_topk_rows`, :func:`pack_mask`, :func:`unpack_mask`,
  :func:`quantize`, :func:`dequantize`: 1 each, no sync;
- :func:`pack_topk_rows`: one radix-select pass per 8 bits of magnitude (2 / 4 / 8 for 16 / 32 /
  64-bit floats; the digit is picked by the last program of each row, no separate launch) and one
  compaction (ties by position through per-row look-back scans): 5 launches for float32, no sync.
  It misses issue 23's two-launch target: fewer passes need wider digits (a 2048-bin histogram per
  program costs far more compute than 256 bins) or a grid-wide barrier between passes.

Per-row top-k knows its output size in advance (at most ``keep`` values a row), so it is written
into a ``[rows, min(keep, n)]`` buffer and needs no sync at all.

Correctness on a GPU rests on the atomics: tickets and the per-row "last program" counters are
``acq_rel`` atomics, status words are published with release exchanges and read with acquire
atomics, and a waiting program only waits on tiles whose tickets came earlier (so it cannot
deadlock). The interpreter runs programs one at a time, which never exercises a wait; the tests
force the look-back through many windows instead (``_AGG_ONLY``).

The quantized codec (``quantized.py``'s format: codes of 8/4/2 bits, a float32 minimum and step
per group) is float arithmetic by nature: :func:`quantize` runs one program per few groups of a
row (a min/max pass, then a code pass that packs whole bytes: groups are multiples of 8 elements,
so no two programs share a byte), :func:`dequantize` one program per block of a row. Neither reads
anything back.

The block size (``BLOCK`` = 4096 elements, 8 warps: 16 consecutive elements a thread, 64-byte
vector loads of float32) is chosen by reasoning, not measured: this code was written and
tested on a machine without one (Triton's interpreter, ``TRITON_INTERPRET=1``, runs the same
kernels on CPU tensors). Every function takes ``block=`` (a power of two >= 8) so tests can
cover many blocks with few elements.
"""

from __future__ import annotations

import functools
import inspect
import math
import struct
import warnings

import torch
import triton
import triton.language as tl

from ._cuda import untracked
from .bitmap import _ABS_MASK
from .bitmap import _INT_VIEW as _INT_OF
from .quantized import _MASK32, _mix32_int, check_bits

BLOCK = 4096  # elements per program: 512 bitmap bytes, 16 KiB of float32 read per program
_RADIX_BITS = 8  # top-k threshold: 256-bin histogram per pass, 2/4/8 passes for 16/32/64 bits
QBLOCK = 1024  # elements per quantize program: 8 groups of the default 128, or 1024 columns of one


# --- kernels ------------------------------------------------------------------------------------


# Decoupled look-back (single-pass scan across programs). Every scanning kernel takes its tile
# number from an atomic ticket (scratch[0]), not from program_id: a program that waits on its
# predecessors then only waits on programs that have already started, so the spin cannot deadlock
# however the GPU schedules programs. Each tile publishes a status word ``value << 2 | flag``
# (flag _AGGREGATE: the tile's own sum, _PREFIX: the inclusive prefix up to and including the
# tile; _EMPTY: nothing yet), first its aggregate, then, after looking back over its predecessors' words (W at a time,
# summing aggregates back to the nearest inclusive prefix), its inclusive prefix. A segmented scan
# (per-row top-k) publishes an inclusive prefix at once when a row starts inside the tile. The last
# program to finish (ticket scratch[1]) zeroes the ticket, the counter and the status words, so
# the scratch is all zeros again for the next kernel on the stream.
_W = tl.constexpr(32)  # status words read per look-back step
_EMPTY = tl.constexpr(0)  # status flags, in a status word's low _FLAG_BITS bits
_AGGREGATE = tl.constexpr(1)
_PREFIX = tl.constexpr(2)
_FLAG_BITS = tl.constexpr(2)
_FLAG_MASK = tl.constexpr(3)
_RESET = tl.constexpr(1024)  # status words zeroed per store by the last program


@triton.jit
def _ticket(scratch_ptr):
    """This program's tile number, in the order programs start."""
    return tl.atomic_add(scratch_ptr, 1, sem="acq_rel")


@triton.jit
def _publish(status_ptr, tile, value, flag):
    tl.atomic_xchg(status_ptr + tile, (value.to(tl.int64) << _FLAG_BITS) | flag, sem="release")


@triton.jit
def _look_back(status_ptr, tile):
    """Sum of the tiles before ``tile`` (> 0), from their status words: spins while a needed
    predecessor has published nothing yet."""
    pos = tl.arange(0, _W)
    excl = tl.zeros([], dtype=tl.int64)
    end = tile.to(tl.int64)  # the window is [end - W, end)
    while end > 0:
        idx = end - _W + pos
        valid = idx >= 0
        s = tl.atomic_add(status_ptr + idx, tl.zeros([_W], dtype=tl.int64), mask=valid, sem="acquire")
        s = tl.where(valid, s, _PREFIX)  # before tile 0: an inclusive prefix of 0
        flag = s & _FLAG_MASK
        lastp = tl.max(tl.where(flag == _PREFIX, pos, -1), axis=0)  # nearest inclusive prefix in the window
        waiting = tl.sum(((pos > lastp) & (flag == _EMPTY)).to(tl.int32), axis=0)
        add = tl.sum(tl.where(pos >= lastp, s >> _FLAG_BITS, 0), axis=0)
        excl += tl.where(waiting == 0, add, 0)
        end = tl.where(waiting == 0, tl.where(lastp >= 0, 0, end - _W), end)
    return excl


@triton.jit
def _finish(scratch_ptr, ntiles, NSTATUS: tl.constexpr):
    """Count this program done; the last one zeroes the tickets and NSTATUS * ntiles status words."""
    if tl.atomic_add(scratch_ptr + 1, 1, sem="acq_rel") == ntiles - 1:
        for off in range(0, NSTATUS * ntiles, _RESET):
            z = off + tl.arange(0, _RESET)
            tl.store(scratch_ptr + 2 + z, tl.zeros([_RESET], dtype=tl.int64), mask=z < NSTATUS * ntiles)
        tl.store(scratch_ptr, 0)
        tl.store(scratch_ptr + 1, 0)


@triton.jit
def _flat_prefix(status_ptr, tile, agg, AGG_ONLY: tl.constexpr):
    """Exclusive prefix of tile ``tile`` of a whole-tensor scan whose tile sum is ``agg``.
    AGG_ONLY (tests): tiles after the first publish only their aggregate, so every look-back
    walks back to tile 0 through many windows."""
    excl = tl.zeros([], dtype=tl.int64)
    if tile == 0:
        _publish(status_ptr, tile, agg, _PREFIX)
    else:
        _publish(status_ptr, tile, agg, _AGGREGATE)
        excl = _look_back(status_ptr, tile)
        if not AGG_ONLY:
            _publish(status_ptr, tile, excl + agg, _PREFIX)
    return excl


@triton.jit
def _bitmap_bytes(keep, BLOCK: tl.constexpr):
    k = keep.to(tl.int32)
    return tl.sum(tl.reshape(k, (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :], axis=1).to(tl.uint8)


@triton.jit
def _seg_add(a, fa, b, fb):
    return tl.where(fb != 0, b, a + b), fa | fb


@triton.jit
def _seg_add2(a, ta, fa, b, tb, fb):
    return tl.where(fb != 0, b, a + b), tl.where(fb != 0, tb, ta + tb), fa | fb


@triton.jit
def _scan_kernel(bits_ptr, prefix_ptr, scratch_ptr, numel, ntiles, limit,
                 ABS_MASK: tl.constexpr, BLOCK: tl.constexpr, AGG_ONLY: tl.constexpr):
    """prefix[b] = kept elements before block b; prefix[ntiles] = all kept (one pass, no cumsum)."""
    tile = _ticket(scratch_ptr)
    idx = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = idx < numel
    keep = inb & ((tl.load(bits_ptr + idx, mask=inb, other=0) & ABS_MASK) > limit)
    agg = tl.sum(keep.to(tl.int64), axis=0)
    excl = _flat_prefix(scratch_ptr + 2, tile, agg, AGG_ONLY)
    tl.store(prefix_ptr + tile, excl)
    if tile == ntiles - 1:
        tl.store(prefix_ptr + ntiles, excl + agg)
    _finish(scratch_ptr, ntiles, 1)


@triton.jit
def _compact_kernel(bits_ptr, bitmap_ptr, values_ptr, prefix_ptr, numel, nbytes, nvalues, limit,
                    ABS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """One block's bitmap bytes, and its kept values at slot prefix[block] + rank in block."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = idx < numel
    b = tl.load(bits_ptr + idx, mask=inb, other=0)
    keep = inb & ((b & ABS_MASK) > limit)
    bidx = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(bitmap_ptr + bidx, _bitmap_bytes(keep, BLOCK), mask=bidx < nbytes)
    k = keep.to(tl.int32)
    slot = tl.load(prefix_ptr + pid) + (tl.cumsum(k, axis=0) - k).to(tl.int64)
    tl.store(values_ptr + slot, b, mask=keep & (slot < nvalues))  # a wrong nnz must not write past the end


@triton.jit
def _capped_kernel(bits_ptr, bitmap_ptr, values_ptr, count_ptr, scratch_ptr, numel, nbytes, capacity, ntiles,
                   limit, ABS_MASK: tl.constexpr, BLOCK: tl.constexpr, AGG_ONLY: tl.constexpr):
    """Bitmap, the first ``capacity`` kept values and the true kept count, in one pass: each tile's
    first slot comes from the look-back, so nothing waits for the host."""
    tile = _ticket(scratch_ptr)
    idx = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = idx < numel
    b = tl.load(bits_ptr + idx, mask=inb, other=0)
    keep = inb & ((b & ABS_MASK) > limit)
    k = keep.to(tl.int32)
    agg = tl.sum(k.to(tl.int64), axis=0)
    excl = _flat_prefix(scratch_ptr + 2, tile, agg, AGG_ONLY)
    bidx = tile.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(bitmap_ptr + bidx, _bitmap_bytes(keep, BLOCK), mask=bidx < nbytes)
    slot = excl + (tl.cumsum(k, axis=0) - k).to(tl.int64)
    tl.store(values_ptr + slot, b, mask=keep & (slot < capacity))  # past capacity: counted, not written
    if tile == ntiles - 1:
        tl.store(count_ptr, excl + agg)
    _finish(scratch_ptr, ntiles, 1)


@triton.jit
def _unpack_kernel(bitmap_ptr, values_ptr, out_ptr, scratch_ptr, numel, nvalues, ncols, width, ntiles,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr, AGG_ONLY: tl.constexpr):
    """out[i] = the value of element i where its bit is set, else 0, in one pass.

    ROWS false: values in row-major order, slot = set bits before i (a whole-tensor look-back).
    ROWS: row r = i // ncols holds its values at ``r * width``; slot = r * width + set bits of
    row r before i, a scan that restarts at each row (a tile holding a row start publishes its
    inclusive prefix at once). A malformed bitmap never reads past a row's values or the end."""
    tile = _ticket(scratch_ptr)
    idx = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = idx < numel
    byte = tl.load(bitmap_ptr + (idx >> 3), mask=inb, other=0).to(tl.int32)
    keep = inb & (((byte >> (idx & 7).to(tl.int32)) & 1) != 0)
    k = keep.to(tl.int32)  # in-tile scans in int32 (<= BLOCK): fewer registers
    status = scratch_ptr + 2
    if ROWS:
        row = idx // ncols
        start = (inb & (idx == row * ncols)).to(tl.int32)
        seg, seen = tl.associative_scan((k, start), 0, _seg_add)  # inclusive, restarting at row starts
        last = tl.arange(0, BLOCK) == BLOCK - 1
        agg = tl.sum(tl.where(last, seg, 0), axis=0)
        has_start = tl.sum(tl.where(last, seen, 0), axis=0) != 0
        excl = tl.zeros([], dtype=tl.int64)
        if (tile == 0) | has_start:
            _publish(status, tile, agg, _PREFIX)
            if (tile > 0) & (tl.sum(tl.where(tl.arange(0, BLOCK) == 0, start, 0), axis=0) == 0):
                excl = _look_back(status, tile)  # the tile's leading elements continue a row
        else:
            _publish(status, tile, agg, _AGGREGATE)
            excl = _look_back(status, tile)
            if not AGG_ONLY:
                _publish(status, tile, excl + agg, _PREFIX)
        in_row = tl.where(seen != 0, seg - k, excl + seg - k)
        keep = keep & (in_row < width)  # a malformed bitmap must not read another row's values
        slot = row * width + in_row
    else:
        agg = tl.sum(k, axis=0)
        excl = _flat_prefix(status, tile, agg, AGG_ONLY)
        slot = excl + (tl.cumsum(k, axis=0) - k).to(tl.int64)
    v = tl.load(values_ptr + slot, mask=keep & (slot < nvalues), other=0)
    tl.store(out_ptr + idx, v, mask=inb)
    _finish(scratch_ptr, ntiles, 1)


@triton.jit
def _select_kernel(bits_ptr, scratch_ptr, state_ptr, values_ptr, nrows, ncols, nchunks, k, width, shift,
                   ABS_MASK: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK: tl.constexpr):
    """One radix-select pass for per-row top-k, one program per (row, chunk of BLOCK columns).

    Each program adds the histogram of digit (abs >> shift) & 255 over its elements whose higher
    digits equal prefix[r] into the row's 256 bins (scratch, atomically), then takes a ticket
    of its row; the last program of the row (it has seen every other's bins: acq_rel) picks the
    digit holding the krem-th smallest remaining magnitude, zeroes the bins and the ticket. After
    the last digit it writes thr (the k-th smallest magnitude's bits), take (how many elements
    equal to it, first by position, fill the quota; none when thr is 0), the row's kept count,
    and zeroes the row's unused value slots. ``state``: five int64 rows of ``nrows`` (prefix, krem,
    thr, take, counts), one tensor so the host makes no view per row.
    """
    prefix_ptr, krem_ptr, thr_ptr = state_ptr, state_ptr + nrows, state_ptr + 2 * nrows
    take_ptr, counts_ptr = state_ptr + 3 * nrows, state_ptr + 4 * nrows
    pid = tl.program_id(0)
    r = pid // nchunks
    col = (pid - r * nchunks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = col < ncols
    ab = tl.load(bits_ptr + r.to(tl.int64) * ncols + col, mask=inb, other=0) & ABS_MASK
    high = ab >> shift
    if FIRST:
        match = inb
    else:
        match = inb & ((high >> 8) == tl.load(prefix_ptr + r))
    bins = tl.arange(0, 256)
    hist = scratch_ptr + 2 + r.to(tl.int64) * 257  # 256 bins, then the row's ticket
    h = tl.histogram((high & 255).to(tl.int32), 256, mask=match)
    tl.atomic_add(hist + bins, h.to(tl.int64), mask=h != 0, sem="relaxed")
    if tl.atomic_add(hist + 256, 1, sem="acq_rel") == nchunks - 1:
        row_h = tl.load(hist + bins, volatile=True)
        tl.store(hist + bins, tl.zeros([256], dtype=tl.int64))
        tl.store(hist + 256, 0)
        if FIRST:
            krem = k
            prefix = 0
        else:
            krem = tl.load(krem_ptr + r)
            prefix = tl.load(prefix_ptr + r)
        d = tl.sum((tl.cumsum(row_h, axis=0) < krem).to(tl.int64), axis=0)
        below = tl.sum(tl.where(bins < d, row_h, 0), axis=0)
        equal = tl.sum(tl.where(bins == d, row_h, 0), axis=0)
        prefix = prefix * 256 + d
        krem = krem - below
        tl.store(prefix_ptr + r, prefix)
        tl.store(krem_ptr + r, krem)
        if LAST:
            # Below thr: k - krem elements; equal: `equal`; so n - (k - krem) - equal lie above it,
            # and the quota n - k leaves room for equal - krem ties (when thr is not 0).
            take = tl.where(prefix != 0, equal - krem, 0)
            kept = ncols - (k - krem) - equal + take
            tl.store(thr_ptr + r, prefix)
            tl.store(take_ptr + r, take)
            tl.store(counts_ptr + r, kept)
            for off in range(0, width, BLOCK):  # zero padding after the row's values
                c = off + tl.arange(0, BLOCK)
                tl.store(values_ptr + r.to(tl.int64) * width + c, tl.zeros([BLOCK], dtype=values_ptr.dtype.element_ty),
                         mask=(c >= kept) & (c < width))


@triton.jit
def _topk_compact_kernel(bits_ptr, bitmap_ptr, values_ptr, state_ptr, scratch_ptr, nrows, numel, nbytes,
                         ncols, width, ntiles,
                         ABS_MASK: tl.constexpr, BLOCK: tl.constexpr, AGG_ONLY: tl.constexpr):
    """Per-row top-k bitmap and values in one pass over flat blocks (which may span rows).

    Kept: magnitude above thr[row], or equal to it and among the row's first take[row] such
    elements. Two scans restart at each row start: elements above thr, and ties, before each
    element in its row (look-back over two status arrays); a kept element goes to slot
    row * width + above before it + min(ties before it, take). thr and take: rows 2 and 3 of
    :func:`_select_kernel`'s state."""
    thr_ptr, take_ptr = state_ptr + 2 * nrows, state_ptr + 3 * nrows
    tile = _ticket(scratch_ptr)
    pos = tl.arange(0, BLOCK)
    idx = tile.to(tl.int64) * BLOCK + pos
    inb = idx < numel
    b = tl.load(bits_ptr + idx, mask=inb, other=0)
    ab = b & ABS_MASK
    row = idx // ncols
    thr = tl.load(thr_ptr + row, mask=inb, other=0)
    take = tl.load(take_ptr + row, mask=inb, other=0)
    above = (inb & (ab > thr)).to(tl.int32)  # in-tile scans in int32 (<= BLOCK): fewer registers
    tie = (inb & (ab == thr) & (take > 0)).to(tl.int32)
    start = (inb & (idx == row * ncols)).to(tl.int32)
    sa, st, seen = tl.associative_scan((above, tie, start), 0, _seg_add2)
    last = pos == BLOCK - 1
    agg_a = tl.sum(tl.where(last, sa, 0), axis=0)
    agg_t = tl.sum(tl.where(last, st, 0), axis=0)
    has_start = tl.sum(tl.where(last, seen, 0), axis=0) != 0
    sta, stt = scratch_ptr + 2, scratch_ptr + 2 + ntiles
    excl_a = tl.zeros([], dtype=tl.int64)
    excl_t = tl.zeros([], dtype=tl.int64)
    if (tile == 0) | has_start:
        _publish(sta, tile, agg_a, _PREFIX)
        _publish(stt, tile, agg_t, _PREFIX)
        if (tile > 0) & (tl.sum(tl.where(pos == 0, start, 0), axis=0) == 0):
            excl_a = _look_back(sta, tile)
            excl_t = _look_back(stt, tile)
    else:
        _publish(sta, tile, agg_a, _AGGREGATE)
        _publish(stt, tile, agg_t, _AGGREGATE)
        excl_a = _look_back(sta, tile)
        excl_t = _look_back(stt, tile)
        if not AGG_ONLY:
            _publish(sta, tile, excl_a + agg_a, _PREFIX)
            _publish(stt, tile, excl_t + agg_t, _PREFIX)
    before_a = tl.where(seen != 0, sa - above, excl_a + sa - above)
    before_t = tl.where(seen != 0, st - tie, excl_t + st - tie)
    keep = (above != 0) | ((tie != 0) & (before_t < take))
    bidx = tile.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(bitmap_ptr + bidx, _bitmap_bytes(keep, BLOCK), mask=bidx < nbytes)
    in_row = before_a + tl.minimum(before_t, take)
    tl.store(values_ptr + row * width + in_row, b, mask=keep & (in_row < width))
    _finish(scratch_ptr, ntiles, 2)


@triton.jit
def _mask_pack_kernel(bits_ptr, bitmap_ptr, numel, nbytes, lo_key, hi_key, nan_above,
                      ABS_MASK: tl.constexpr, HAS_HIGH: tl.constexpr, BLOCK: tl.constexpr):
    """Bitmap of lo < v < hi, compared on order keys: key = +abs for v >= 0, -abs for v < 0
    (so -0.0 and +0.0 are equal, as floats compare); NaN (abs above Inf) is never inside."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = idx < numel
    b = tl.load(bits_ptr + idx, mask=inb, other=0)
    ab = b & ABS_MASK
    key = tl.where(b < 0, -ab, ab)
    inside = inb & (ab <= nan_above) & (key > lo_key)
    if HAS_HIGH:
        inside = inside & (key < hi_key)
    bidx = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(bitmap_ptr + bidx, _bitmap_bytes(inside, BLOCK), mask=bidx < nbytes)


@triton.jit
def _mask_unpack_kernel(bitmap_ptr, out_ptr, numel, in_bits, out_bits, BLOCK: tl.constexpr):
    """out[i] = in_bits where bit i is set, else out_bits (integer view of the float output)."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = idx < numel
    byte = tl.load(bitmap_ptr + (idx >> 3), mask=inb, other=0).to(tl.int32)
    v = tl.where(((byte >> (idx & 7).to(tl.int32)) & 1) != 0, in_bits, out_bits)
    tl.store(out_ptr + idx, v.to(out_ptr.dtype.element_ty), mask=inb)


# Quantized codec (constexpr BITS = 8, 4 or 2). Float32 throughout, as ``quantized._quantize_torch``.
# On a GPU the compiler may contract ``(x - lo) * inv + 0.5`` (or ``lo + code * scale``) into one
# fused multiply-add, which rounds once instead of twice: a value exactly at a half-step could then
# get the other code (still within the stated error bound, but not the reference's byte). The
# launches pass ``enable_fp_fusion=False`` so the compiled kernels round every operation as the
# torch ops do; the interpreter runs numpy ops, one rounding each, and matches the reference byte
# for byte either way. Divisions use ``tl.math.div_rn`` (IEEE round-to-nearest): a plain ``/`` may
# lower to an approximate division on the GPU. The compiled floor flushes subnormal inputs to 0
# (``cvt.rmi.ftz``); its input ``v + offset`` is never negative (``x >= lo``), so that changes nothing.
# Which zero a group's ``lo`` is when it holds both -0.0 and +0.0 is left to ``tl.min`` (torch's
# own aminmax answer depends on its vectorisation); codes and decoded values do not depend on it.
_FLT_MAX = tl.constexpr(3.4028234663852886e38)  # |x| <= this: finite (false for NaN)


@triton.jit
def _mix32(h):
    """``quantized._mix32`` on uint32: products wrap mod 2**32, as the reference's masks do."""
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x2C1B3C6D
    return h ^ (h >> 16)


@triton.jit
def _uniform(idx, seed_mix):
    """``quantized._hash_uniform``: a float32 in [0, 1) per int64 row-major index ``idx``, with
    ``seed_mix = _mix32_int(seed)`` computed on the host (the cast keeps ``idx mod 2**32``)."""
    h = _mix32(idx.to(tl.uint32) ^ seed_mix.to(tl.uint32))
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


# bfloat16 travels as its int16 bits and is converted here with integer ops: exact, the same as
# the hardware's conversions and torch's, and independent of the interpreter, whose own
# bfloat16 casts truncate and flush subnormals (Triton 3.8).
@triton.jit
def _bf16_to_f32(bits):
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16(v):
    """Round to nearest even (NaN: 0x7FC0), as ``torch.Tensor.to(torch.bfloat16)``; int16 bits."""
    b = v.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(v == v, r, 0x7FC0).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _load_f32(ptr, mask, BF16: tl.constexpr):
    if BF16:
        x = _bf16_to_f32(tl.load(ptr, mask=mask, other=0))
    else:
        x = tl.load(ptr, mask=mask, other=0).to(tl.float32)
    return x


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, lo_ptr, scale_ptr, n, groups, blocks, row_bytes, group, seed_mix,
                     BITS: tl.constexpr, STOCHASTIC: tl.constexpr, GROUPS: tl.constexpr, CHUNK: tl.constexpr,
                     BF16: tl.constexpr):
    """Codes, minimum and step of GROUPS consecutive groups of one row, CHUNK columns at a time.

    Program ``pid`` holds row ``pid // blocks``; a group's columns are ``[start, start + size)``
    (the row's last group may be short). Pass 1: min/max of the finite values and whether any
    value is not finite; pass 2: codes, packed ``8 // BITS`` to a byte (whole bytes: ``group`` and
    CHUNK are multiples of 8, so no byte holds two groups' codes). BF16: ``x`` is bfloat16 bits.
    """
    pid = tl.program_id(0)
    row = pid // blocks
    g = (pid - row * blocks) * GROUPS + tl.arange(0, GROUPS)
    in_row = g < groups
    start = g.to(tl.int64) * group
    size = tl.minimum(n - start, group)
    base = row.to(tl.int64) * n
    cols = tl.arange(0, CHUNK)
    lo = tl.full([GROUPS], float("inf"), tl.float32)
    hi = tl.full([GROUPS], float("-inf"), tl.float32)
    odd = tl.zeros([GROUPS], dtype=tl.int32)  # 1: the group holds a NaN or +-Inf
    for k in range(0, group, CHUNK):
        col = k + cols[None, :]
        m = in_row[:, None] & (col < size[:, None])
        x = _load_f32(x_ptr + base + start[:, None] + col, m, BF16)
        finite = tl.abs(x) <= _FLT_MAX
        lo = tl.minimum(lo, tl.min(tl.where(m & finite, x, float("inf")), axis=1))
        hi = tl.maximum(hi, tl.max(tl.where(m & finite, x, float("-inf")), axis=1))
        odd = tl.maximum(odd, tl.max((m & ~finite).to(tl.int32), axis=1))
    d = hi - lo
    bad = (odd != 0) | ~(tl.abs(d) <= _FLT_MAX)  # non-finite values, or a range that overflows
    positive = (d > 0) & ~bad
    levels = tl.full([GROUPS], (1 << BITS) - 1, tl.float32)
    scale = tl.where(positive, tl.math.div_rn(d, levels), 0.0)
    inv = tl.where(positive, tl.math.div_rn(levels, tl.where(positive, d, 1.0)), 0.0)
    at = row.to(tl.int64) * groups + g
    tl.store(lo_ptr + at, tl.where(bad, float("nan"), lo), mask=in_row)
    tl.store(scale_ptr + at, tl.where(bad, float("nan"), scale), mask=in_row)
    lo = tl.where(bad, 0.0, lo)
    out = row.to(tl.int64) * row_bytes + (start * BITS) // 8  # each group's first byte
    for k in range(0, group, CHUNK):
        col = k + cols[None, :]
        m = in_row[:, None] & (col < size[:, None])
        x = _load_f32(x_ptr + base + start[:, None] + col, m, BF16)
        v = (x - lo[:, None]) * inv[:, None]
        if STOCHASTIC:
            q = tl.floor(v + _uniform(base + start[:, None] + col, seed_mix))
        else:
            q = tl.floor(v + 0.5)
        q = tl.minimum(tl.maximum(tl.where(q == q, q, 0.0), 0.0), (1 << BITS) - 1)  # NaN -> 0, +Inf -> L
        code = tl.where(m & ~bad[:, None], q.to(tl.int32), 0)  # a non-finite group's codes are 0
        if BITS == 8:
            tl.store(codes_ptr + out[:, None] + col, code.to(tl.uint8), mask=m)
        else:
            per: tl.constexpr = 8 // BITS
            shifts = tl.arange(0, per) * BITS
            byte = tl.sum(tl.reshape(code, (GROUPS, CHUNK // per, per)) << shifts[None, None, :], axis=2)
            b = tl.arange(0, CHUNK // per)[None, :]
            keep = in_row[:, None] & (k + b * per < size[:, None])  # a byte holding any of the group
            tl.store(codes_ptr + out[:, None] + k // per + b, byte.to(tl.uint8), mask=keep)


@triton.jit
def _dequantize_kernel(codes_ptr, lo_ptr, scale_ptr, out_ptr, n, groups, blocks, row_bytes, group,
                       BITS: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr):
    """out = lo + code * scale in float32 (rounded to out's dtype; BF16: out holds bfloat16 bits)
    for BLOCK columns of one row."""
    pid = tl.program_id(0)
    row = pid // blocks
    r = row.to(tl.int64)
    col = (pid - row * blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = col < n
    byte = tl.load(codes_ptr + r * row_bytes + ((col * BITS) >> 3), mask=m, other=0).to(tl.int32)
    code = (byte >> ((col * BITS) & 7).to(tl.int32)) & ((1 << BITS) - 1)
    at = r * groups + col // group
    lo = tl.load(lo_ptr + at, mask=m, other=0.0)
    scale = tl.load(scale_ptr + at, mask=m, other=0.0)
    v = lo + code.to(tl.float32) * scale
    if BF16:
        tl.store(out_ptr + r * n + col, _f32_to_bf16(v), mask=m)
    else:
        tl.store(out_ptr + r * n + col, v.to(out_ptr.dtype.element_ty), mask=m)


def _on_its_device(fn):
    """Launch on the device of the first tensor argument: Triton launches on the current device,
    which need not be the tensor's (a tensor on cuda:1 while cuda:0 is current)."""

    @functools.wraps(fn)
    def on_device(*args, **kwargs):
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        # Entering torch.cuda.device costs ~4 us of host a call (measured on an H100): only when
        # the tensor is not on the current device.
        if t is not None and t.is_cuda and t.device.index != torch._C._cuda_getDevice():
            with torch.cuda.device(t.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return on_device


# --- bitmap (BitTrain) ----------------------------------------------------------------------------


# Streaming kernels run 8 warps (256 threads) over BLOCK = 4096 elements: 16 consecutive elements
# a thread, i.e. 64-byte vector loads of float32, and 512 whole bitmap bytes a program.
# Triton's launch path (``kernel[grid](...)``: binding the arguments, computing their
# specialization, a cache-key string, hook lookups) is Python on every launch, and an eager step's
# extra time is host time. So the compiled kernel of each specialization is kept and, from the
# second launch on, its launcher is called directly with its handles and the current stream (what
# ``CompiledKernel[grid]``'s runner does, without its per-launch closure, its device and stream
# lookups through Triton's driver proxy, and the launch metadata it builds for profiler hooks: those
# launches take Triton's runner while a hook is registered). Measured on an H100 (activations_cuda,
# 4,096-element calls): a one-launch codec call costs 23-28 us of host time, 4-8 us less than through
# Triton's own path (top-k's five launches: 105 against 146 us); a torch op costs 7 us. The key is at least as fine as Triton's own specialization (a tensor's dtype and
# 16-byte alignment; an int's range class, divisibility by 16 and equality to 1; every constexpr and
# option by value), so a kept kernel is the one Triton would pick. Triton >= 3.3 passes every
# parameter to the launcher (constexprs included) and >= 3.4 keeps its launch hooks in ``knobs``;
# older versions and the interpreter take the ordinary path. The first CUDA use checks the direct path against the ordinary one
# (:func:`check_direct_launch`) and turns it off if they differ or it fails.
try:
    from triton import knobs
except ImportError:  # Triton < 3.4 keeps its launch hooks elsewhere: launch its way
    knobs = None
_SUPPORTED = knobs is not None and tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 3)
_DIRECT: bool | None = None if _SUPPORTED else False  # None: not checked yet on this machine
_COMPILED: dict = {}


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv is a constexpr function: called from the host it costs ~3 us (its wrapper).
    return -(-a // b)


def _spec(a) -> object:
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if a.__class__ is int:
        return a == 1, a % 16 == 0, -0x80000000 <= a <= 0x7FFFFFFF, a >= 1 << 63
    if a.__class__ is float:
        return float
    return a.__class__, a  # bool, None: by value


def _launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, directly through its compiled kernel once Triton has
    compiled it for this specialization (see above). ``args``: the kernel's leading parameters,
    positionally; ``kwargs``: its constexprs and launch options by name."""
    first = args[0]
    if _DIRECT is None and first.is_cuda:
        check_direct_launch()
    if not (_DIRECT and first.is_cuda):
        kernel[grid](*args, **kwargs)
        return
    index = first.device.index
    key = (kernel, index, *map(_spec, args), *kwargs.items())
    direct = _COMPILED.get(key)
    if direct is None:
        compiled = kernel[grid](*args, **kwargs)  # compiles (or finds) it, and launches
        names = kernel.arg_names[len(args):]
        defaults = {n: p.default for n, p in inspect.signature(kernel.fn).parameters.items()}
        tails = tuple(kwargs[n] if n in kwargs else defaults[n] for n in names)
        if compiled is not None:
            _COMPILED[key] = _direct_entry(compiled, tails)
        return
    run, function, metadata, compiled, tails = direct
    g = (*grid, 1, 1)  # a compiled kernel takes a 3-d grid
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if getattr(enter, "calls", enter) or getattr(leave, "calls", leave):  # a HookChain, or a bare hook
        compiled[g[:3]](*args, *tails)  # a profiler listens: Triton's runner builds what its hooks read
        return
    # What CompiledKernel's runner does, less its per-launch closure, its device and stream lookups
    # through the driver proxy, and the launch metadata and two hook calls made for no listener.
    run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(index), function, metadata, None, None, None,
        *args, *tails)


def _direct_entry(compiled, tails: tuple) -> tuple:
    """What :func:`_launch` keeps per specialization: the compiled kernel's launcher and handles."""
    compiled._init_handles()  # done by its first launch already; cheap when done
    return compiled.run, compiled.function, compiled.packed_metadata, compiled, tails


def check_direct_launch() -> bool:
    """Compare the direct launch with Triton's own on one kernel (called once per process, on the
    first CUDA use); turn it off if it fails or differs. Returns whether it is on."""
    global _DIRECT
    if not _SUPPORTED:
        return False
    if torch.cuda.is_current_stream_capturing():
        return False  # comparing reads back (no sync is allowed in a capture): Triton's way until a later call
    # The first CUDA use may come inside a block that forbids syncs (capture_step's checked warm-up
    # step, a test): the comparison's one read-back is the check's, not the caller's.
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        x = torch.arange(-3000, 3000, dtype=torch.float32, device="cuda") / 7
        _DIRECT = False
        ordinary = [pack_mask(x[1:], 0.5), pack_mask(x, -0.25)]
        _DIRECT = True
        direct = [pack_mask(x[1:], 0.5) for _ in range(2)] + [pack_mask(x, -0.25) for _ in range(2)]
        same = all(torch.equal(d, o) for d, o in zip(direct, [ordinary[0]] * 2 + [ordinary[1]] * 2))
    except Exception:  # noqa: BLE001 - any failure means: launch the ordinary way
        same = False
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    _DIRECT = same
    if not same:
        warnings.warn(f"edgetorch: launching Triton {triton.__version__}'s compiled kernels directly did not match "
                      "its own launch; the codecs use Triton's launch path (correct, a few us more host time "
                      "per launch)", RuntimeWarning, stacklevel=2)
    return same


_WARPS = 8
_AGG_ONLY = False  # tests: look-backs walk to tile 0 through aggregates (see _flat_prefix)
_SCRATCH: dict = {}
# Outgrown buffers are kept, never freed: a kernel captured into a CUDA graph holds its buffer's
# address, and a buffer freed in the middle of a capture would be handed to a later allocation of
# the same graph, which then overwrites the tickets (an illegal address on replay, seen on an H200).
_RETIRED: list = []


def _scratch(device: torch.device, words: int) -> torch.Tensor:
    """A zeroed int64 buffer of at least ``words`` entries, one per device and stream, kept across
    calls: every kernel that uses it leaves it zeroed again (tickets, status words, histograms),
    so no call pays a zeroing launch; it is only allocated (torch.zeros) when it must grow."""
    # The raw stream handle: torch.cuda.current_stream() builds a Stream object (~5 us of host).
    key = (device, torch._C._cuda_getCurrentRawStream(device.index)) if device.type == "cuda" else device
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < words:
        if buf is not None:
            _RETIRED.append(buf)
        size = max(words, 1 << 16, 2 * (0 if buf is None else buf.numel()))
        buf = _SCRATCH[key] = torch.zeros(size, dtype=torch.int64, device=device)
    return buf


@_on_its_device
def count(bits: torch.Tensor, limit: int, *, block: int = BLOCK) -> torch.Tensor:
    """Per-block kept counts as an exclusive prefix: the first half of :func:`pack_bitmap`.

    One launch: each block counts its kept elements and finds its prefix by a decoupled look-back.

    Args:
        bits: contiguous 1-D int16/int32/int64 tensor, the integer view of a float tensor.
        limit: keep element ``i`` iff ``(bits[i] & absmask) > limit`` (``bitmap.zero_limit_bits``).
        block: elements per program (a power of two >= 8); pass the same value to :func:`compact`.

    Returns:
        ``int64`` tensor of ``ceil(n / block) + 1`` entries on ``bits.device``: entry ``b`` is the
        number of kept elements before block ``b``, the last entry the total kept count. Nothing
        is read back: ``int(prefix[-1])`` is the caller's one sync (the kept fraction tells the
        policy whether packing pays; the same number sizes ``values`` in :func:`compact`).
    """
    _check_bits(bits, "bits")
    _check_block(block)
    limit = _limit(bits, limit)
    n = bits.numel()
    nblocks = _cdiv(n, block)
    if not n:
        return torch.zeros(1, dtype=torch.int64, device=bits.device)
    prefix = torch.empty(nblocks + 1, dtype=torch.int64, device=bits.device)
    _launch(_scan_kernel, (nblocks,), bits, prefix, _scratch(bits.device, 2 + nblocks), n, nblocks, limit,
                             ABS_MASK=_ABS_MASK[bits.dtype], BLOCK=block, AGG_ONLY=_AGG_ONLY, num_warps=_WARPS)
    return prefix


@_on_its_device
def compact(
    bits: torch.Tensor, limit: int, prefix: torch.Tensor, nnz: int, *, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bitmap and kept values, given :func:`count`'s prefix and its total ``nnz = int(prefix[-1])``.

    ``nnz`` is trusted (checking it would be a second sync): a wrong value gives wrong output
    (values past ``nnz`` are dropped, never written out of bounds). One launch.
    """
    _check_bits(bits, "bits")
    _check_block(block)
    limit = _limit(bits, limit)
    if isinstance(nnz, bool) or not isinstance(nnz, int) or nnz < 0:
        raise ValueError(f"nnz must be the int total read from count()'s prefix[-1]; got {nnz!r}")
    n = bits.numel()
    nblocks = _cdiv(n, block)
    if prefix.shape != (nblocks + 1,) or prefix.dtype != torch.int64 or prefix.device != bits.device:
        raise ValueError(
            f"prefix must be count()'s int64 tensor of {nblocks + 1} entries on {bits.device} for {n} "
            f"elements and block={block}; got {prefix.dtype} of shape {tuple(prefix.shape)} on {prefix.device}"
        )
    bitmap = torch.empty((n + 7) // 8, dtype=torch.uint8, device=bits.device)
    values = torch.empty(nnz, dtype=bits.dtype, device=bits.device)
    if n:
        _launch(_compact_kernel, (nblocks,), bits, bitmap, values, prefix, n, bitmap.numel(), nnz, limit,
                                    ABS_MASK=_ABS_MASK[bits.dtype], BLOCK=block, num_warps=_WARPS)
    return bitmap, values


def pack_bitmap(bits: torch.Tensor, limit: int, *, block: int = BLOCK,
                max_kept: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Bitmap of ``(bits & absmask) > limit`` and the kept elements, like ``bitmap.pack_torch``.

    Two launches (:func:`count`, :func:`compact`) and one host sync: the kept count is read back
    to allocate ``values`` at its exact size (and to decide against ``max_kept``: more kept than
    that returns None after the first launch). :func:`pack_bitmap_capped` avoids the sync with a
    caller-given capacity.

    Returns:
        ``(bitmap uint8[ceil(n / 8)], values[nnz] of bits.dtype)``, or None (see ``max_kept``).
    """
    prefix = count(bits, limit, block=block)
    nnz = int(prefix[-1]) if bits.numel() else 0
    if max_kept is not None and nnz > max_kept:
        return None
    return compact(bits, limit, prefix, nnz, block=block)


@_on_its_device
def pack_bitmap_capped(
    bits: torch.Tensor, limit: int, capacity: int, *, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bitmap, the first ``capacity`` kept values and the true kept count, with no host sync.

    One launch: each block counts its kept elements, finds its first slot by a decoupled
    look-back, and writes its bitmap bytes and the values whose slot is below ``capacity``
    (the rest are counted, never written). The input is read once: the same bytes as a copy of
    the input reads, plus n / 8 bitmap and ``kept * itemsize`` value bytes written.

    Returns:
        ``(bitmap uint8[ceil(n / 8)], values[capacity] of bits.dtype, count int64[1])``:
        ``values[:min(count, capacity)]`` are the kept elements in row-major order, the slots
        after them are not written; ``count`` is the total kept, which exceeds ``capacity``
        when the caller sized it too small (the overflow signal; the bitmap is exact either way).
    """
    _check_bits(bits, "bits")
    _check_block(block)
    limit = _limit(bits, limit)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity must be an int >= 0 (value slots); got {capacity!r}")
    n, dev = bits.numel(), bits.device
    bitmap = torch.empty((n + 7) // 8, dtype=torch.uint8, device=dev)
    values = torch.empty(capacity, dtype=bits.dtype, device=dev)
    if not n:
        return bitmap, values, torch.zeros(1, dtype=torch.int64, device=dev)
    total = torch.empty(1, dtype=torch.int64, device=dev)
    nblocks = _cdiv(n, block)
    _launch(_capped_kernel, (nblocks,), bits, bitmap, values, total, _scratch(dev, 2 + nblocks), n, bitmap.numel(),
                               capacity, nblocks, limit, ABS_MASK=_ABS_MASK[bits.dtype], BLOCK=block,
                               AGG_ONLY=_AGG_ONLY, num_warps=_WARPS)
    return bitmap, values, total


@_on_its_device
def unpack_bitmap(bitmap: torch.Tensor, values: torch.Tensor, numel: int, *, block: int = BLOCK,
                  shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Dense tensor of ``values.dtype``, 1-D or of ``shape`` (``numel`` elements, allocated so): the
    values where bits are set, zeros elsewhere.

    One launch, no sync: each block finds its first value by a look-back over the blocks'
    popcounts. ``values`` may be a float tensor or its integer view; bits beyond ``values``
    read back as 0.
    """
    _check_block(block)
    ints = _ints(values, "values")
    _check_bitmap(bitmap, numel, values.device)
    out = _output(numel, shape, values.dtype, values.device)
    if numel:
        nblocks = _cdiv(numel, block)
        _launch(_unpack_kernel, (nblocks,), bitmap, ints if ints.dim() == 1 else ints.reshape(-1), out.view(ints.dtype),
                _scratch(values.device, 2 + nblocks), numel, ints.numel(), numel, 0, nblocks,
                ROWS=False, BLOCK=block, AGG_ONLY=_AGG_ONLY, num_warps=_WARPS)
    return out


# --- per-row top-k (Back Razor) -----------------------------------------------------------------


@_on_its_device
def pack_topk_rows(
    x: torch.Tensor, keep: int, *, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``keep`` largest magnitudes as bitmap + ``[rows, min(keep, n)]`` values; no sync.

    The row threshold is the ``(n - keep)``-th smallest magnitude, found by a radix select on the
    magnitude bits (non-negative float bits order like the values, NaN above Inf): 8 bits a pass
    (2 / 4 / 8 passes for 16 / 32 / 64-bit floats), each pass one kernel that adds the row's
    256-bin histogram atomically and whose last program per row picks the digit (no separate
    selection launch, no sort, no sync). Then one compaction kernel writes the bitmap and the
    values: elements above the threshold are kept; ties at a non-zero threshold are taken by
    position (first ones) until the row holds exactly ``keep``, which two per-row scans (above,
    ties) by decoupled look-back decide in the same pass; zeros are never kept. Edge cases as
    ``topk._topk_mask``: ``keep >= n`` keeps every non-zero, ``keep == 0`` nothing. Launches:
    passes + 1 (5 for float32); the input is read passes + 1 times.

    Args:
        x: contiguous 2-D float16/bfloat16/float32/float64 tensor ``[rows, n]``.
        keep: values kept per row (``topk.kept_per_row``), >= 0.
        block: elements per program (power of two >= 8).

    Returns:
        ``(bitmap, values, counts)``: ``bitmap`` uint8 of ``ceil(rows * n / 8)`` bytes, equal to
        ``pack_topk``'s; ``values`` ``[rows, min(keep, n)]`` of ``x.dtype`` holding row r's kept
        values in order in ``values[r, :counts[r]]`` and zeros after; ``counts`` int64 ``[rows]``,
        ``min(keep, non-zeros of row r)``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D [rows, n] tensor; got {getattr(x, 'shape', type(x))}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep must be an int >= 0 (values kept per row); got {keep!r}")
    _check_block(block)
    bits = _ints(x, "x").reshape(-1)
    rows, n = x.shape
    width = min(keep, n)
    dev, numel = x.device, rows * n
    if width == 0 or numel == 0:
        bitmap = torch.zeros((numel + 7) // 8, dtype=torch.uint8, device=dev)
        values = torch.empty((rows, width), dtype=x.dtype, device=dev)
        return bitmap, values, torch.zeros(rows, dtype=torch.int64, device=dev)
    absmask = _ABS_MASK[bits.dtype]
    values = torch.empty(rows * width, dtype=bits.dtype, device=dev)
    # prefix, krem, thr, take, counts: one tensor the kernels index by row (a view per row would be
    # a torch call each, microseconds of host on a GPU)
    state = torch.empty((5, rows), dtype=torch.int64, device=dev)
    nchunks = _cdiv(n, block)
    nblocks = _cdiv(numel, block)
    scratch = _scratch(dev, 2 + max(257 * rows, 2 * nblocks))
    k = max(n - keep, 0)  # k-th smallest magnitude; k = 0 (keep >= n) selects 0: every non-zero
    nbits = {torch.int16: 16, torch.int32: 32, torch.int64: 64}[bits.dtype]
    shifts = range(nbits - _RADIX_BITS, -1, -_RADIX_BITS)  # the sign bit is 0 in the magnitudes
    for shift in shifts:
        _launch(_select_kernel, (rows * nchunks,), bits, scratch, state, values, rows, n, nchunks, k, width, shift,
                ABS_MASK=absmask, FIRST=shift == shifts[0], LAST=shift == 0, BLOCK=block, num_warps=_WARPS)
    bitmap = torch.empty((numel + 7) // 8, dtype=torch.uint8, device=dev)
    _launch(_topk_compact_kernel, (nblocks,), bits, bitmap, values, state, scratch, rows, numel, bitmap.numel(), n,
            width, nblocks, ABS_MASK=absmask, BLOCK=block, AGG_ONLY=_AGG_ONLY, num_warps=_WARPS)
    return bitmap, values.view(x.dtype).view(rows, width), state[4]


@_on_its_device
def unpack_topk_rows(
    bitmap: torch.Tensor, values: torch.Tensor, rows: int, n: int, *, block: int = BLOCK,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Dense ``[rows, n]`` tensor of ``values.dtype`` (or of ``shape``, ``rows * n`` elements,
    allocated so) from :func:`pack_topk_rows`'s bitmap and ``[rows, width]`` values (row r's values
    start at ``r * width``). One launch (a per-row scan of the set bits by look-back), no host sync."""
    _check_block(block)
    if values.dim() != 2 or values.shape[0] != rows:
        raise ValueError(f"values must be [rows={rows}, width]; got shape {tuple(values.shape)}")
    ints = _ints(values, "values")
    numel = rows * n
    _check_bitmap(bitmap, numel, values.device)
    out = _output(numel, (rows, n) if shape is None else shape, values.dtype, values.device)
    if numel:
        nblocks = _cdiv(numel, block)
        _launch(_unpack_kernel, (nblocks,), bitmap, ints.reshape(-1), out.view(ints.dtype),
                _scratch(values.device, 2 + nblocks), numel, ints.numel(), n, values.shape[1], nblocks,
                ROWS=True, BLOCK=block, AGG_ONLY=_AGG_ONLY, num_warps=_WARPS)
    return out


# --- mask (ReLU / hardtanh backward) ------------------------------------------------------------


@_on_its_device
def pack_mask(x: torch.Tensor, low: float, high: float = math.inf, *, block: int = BLOCK) -> torch.Tensor:
    """Bitmap of ``low < v < high`` over the elements of ``x`` (row-major), like ``mask.pack_mask``.

    As there, ``high`` infinite (either sign) means "greater than ``low``" only, and the bounds
    are rounded to ``x.dtype`` first (what a comparison of a tensor with a Python number does on
    the CPU). No sync.
    """
    _check_block(block)
    bits = _ints(x, "x").reshape(-1)
    n = bits.numel()
    bitmap = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    if not n:
        return bitmap
    has_high = not math.isinf(high)
    lo_key, lo_nan = _order_key(low, x.dtype)
    hi_key, hi_nan = _order_key(high if has_high else 0.0, x.dtype)
    if lo_nan or hi_nan:  # nothing compares true with NaN
        return bitmap.zero_()
    nan_above, _ = _order_key(math.inf, x.dtype)
    _launch(_mask_pack_kernel, (_cdiv(n, block),), bits, bitmap, n, bitmap.numel(), lo_key, hi_key, nan_above,
                                                ABS_MASK=_ABS_MASK[bits.dtype], HAS_HIGH=has_high, BLOCK=block,
                                                num_warps=_WARPS)
    return bitmap


@_on_its_device
def unpack_mask(
    bitmap: torch.Tensor, numel: int, inside: float, outside: float, dtype: torch.dtype, *, block: int = BLOCK,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Dense ``dtype`` tensor: ``inside`` where the bit is set, ``outside`` elsewhere. No sync.
    1-D, or of ``shape`` (``numel`` elements, row-major): allocated so, with no view to make."""
    _check_block(block)
    if dtype not in _INT_OF:
        raise TypeError(f"dtype must be one of {_names()}; got {dtype}")
    _check_bitmap(bitmap, numel, bitmap.device)
    ints = _INT_OF[dtype]
    in_bits, out_bits = _bits_of(inside, dtype), _bits_of(outside, dtype)
    out = _output(numel, shape, dtype, bitmap.device)
    if numel:  # the kernel writes the values' bits: through an integer view of the same memory
        _launch(_mask_unpack_kernel, (_cdiv(numel, block),), bitmap, out.view(ints), numel, in_bits, out_bits,
                BLOCK=block, num_warps=_WARPS)
    return out


# --- quantized (ActNN / GACT / Mesa-style storage) -----------------------------------------------


@_on_its_device
def quantize(
    x: torch.Tensor, bits: int, group: int, seed: int | None = None, *, block: int = QBLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantized._quantize_torch`` as a kernel: ``(codes, lo, scale)`` of a ``[rows, n]`` tensor. No sync.

    Args:
        x: 2-D float16/bfloat16/float32 tensor (float64 is rounded to float32 first, as the
            reference does; any layout, read row-major).
        bits: 8, 4 or 2. group: elements per group, a multiple of 8.
        seed: None rounds to nearest; an int in [0, 2**32) rounds stochastically with the
            reference's hash of the seed and each element's row-major index.
        block: elements per program (a power of two >= 8): ``block // chunk`` groups of a row,
            ``chunk = min(next_power_of_2(group), block)`` columns of each at a time.

    Returns:
        ``codes`` uint8 ``[rows, ceil(n * bits / 8)]``, ``lo`` and ``scale`` float32
        ``[rows, ceil(n / group)]``: the bytes ``_quantize_torch`` writes for ``x.float()``.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _INT_OF:
        raise TypeError(f"x must be a float tensor ({_names()}); got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 2:
        raise ValueError(f"x must be a 2-D [rows, n] tensor; got shape {tuple(x.shape)}")
    check_bits(bits)
    if isinstance(group, bool) or not isinstance(group, int) or group < 8 or group % 8:
        raise ValueError(f"group must be a positive multiple of 8; got {group!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MASK32):
        raise ValueError(f"seed must be None (nearest) or an int in [0, 2**32); got {seed!r}")
    _check_block(block)
    x = (x.float() if x.dtype == torch.float64 else x).contiguous()
    bf16 = x.dtype == torch.bfloat16
    rows, n = x.shape
    groups, row_bytes = _cdiv(n, group), (n * bits + 7) // 8
    codes = torch.empty((rows, row_bytes), dtype=torch.uint8, device=x.device)
    lo = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows and n:
        chunk = min(1 << (group - 1).bit_length(), block)
        per = block // chunk
        blocks = _cdiv(groups, per)
        _launch(_quantize_kernel, (rows * blocks,), x.view(torch.int16) if bf16 else x, codes, lo, scale, n, groups, blocks,
                                           row_bytes, group, 0 if seed is None else _mix32_int(seed),
                                           BITS=bits, STOCHASTIC=seed is not None, GROUPS=per, CHUNK=chunk,
                                           BF16=bf16, enable_fp_fusion=False)
    return codes, lo, scale


@_on_its_device
def dequantize(
    codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, n: int, bits: int, group: int,
    dtype: torch.dtype, *, block: int = BLOCK, shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``[rows, n]`` tensor of ``dtype`` (or of ``shape``, ``rows * n`` elements row-major, allocated
    so): ``lo + code * scale`` in float32, rounded to ``dtype``
    (``quantized._dequantize_torch(...).to(dtype)``). No sync."""
    check_bits(bits)
    _check_block(block)
    if dtype not in _INT_OF:
        raise TypeError(f"dtype must be one of {_names()}; got {dtype}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0 (elements a row); got {n!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 8 or group % 8:
        raise ValueError(f"group must be a positive multiple of 8; got {group!r}")
    if not all(isinstance(t, torch.Tensor) for t in (codes, lo, scale)):
        raise TypeError("codes, lo and scale must be torch.Tensors (a QuantizedTensor's fields)")
    rows = codes.shape[0] if codes.dim() == 2 else -1
    groups, row_bytes = _cdiv(n, group), (n * bits + 7) // 8
    if codes.dtype != torch.uint8 or codes.shape != (rows, row_bytes) or not codes.is_contiguous():
        raise ValueError(f"codes must be contiguous uint8 [rows, ceil({n} * {bits} / 8) = {row_bytes}]; got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    for name, t in (("lo", lo), ("scale", scale)):
        if (t.dtype != torch.float32 or t.shape != (rows, groups) or not t.is_contiguous()
                or t.device != codes.device):
            raise ValueError(f"{name} must be contiguous float32 [rows={rows}, ceil({n} / {group}) = {groups}] on "
                             f"{codes.device}; got {t.dtype} {tuple(t.shape)} on {t.device}")
    bf16 = dtype == torch.bfloat16
    out = _output(rows * n, (rows, n) if shape is None else shape, dtype, codes.device)
    if rows and n:
        blocks = _cdiv(n, block)
        _launch(_dequantize_kernel, (rows * blocks,), codes, lo, scale, out.view(torch.int16) if bf16 else out, n,
                groups, blocks, row_bytes, group, BITS=bits, BLOCK=block, BF16=bf16, enable_fp_fusion=False)
    return out


# --- the codecs' operations (the Triton column of ``_backend``'s table) ----------------------------
# Signatures as the C extension's wrappers in ``_cpu_kernels`` (see ``_backend.Kernels``): a codec
# calls either the same way. They replace the codecs' own preparation of the arguments, so a
# codec call on CUDA makes no more Python calls than before the table.


def codec_pack_bitmap(t: torch.Tensor, limit: int, max_kept: int | None = None):
    """:func:`pack_bitmap` of a float tensor of any shape: values in ``t.dtype``, or None."""
    packed = pack_bitmap(untracked(t).reshape(-1).view(_INT_OF[t.dtype]), limit, max_kept=max_kept)
    return None if packed is None else (packed[0], packed[1].view(t.dtype))


def codec_unpack_bitmap(bitmap: torch.Tensor, values: torch.Tensor, shape) -> torch.Tensor:
    """:func:`unpack_bitmap` into a tensor of ``shape``: the table's ``unpack_bitmap`` and
    ``unpack_bitmap_capped`` both, since the kernel reads the set bits past the last value as 0
    (a capped bitmap's ``[capacity]`` values after an overflow). ``contiguous()`` returns a
    contiguous tensor itself without a dispatch (~50 ns; the capped values always are)."""
    return unpack_bitmap(bitmap, values.contiguous(), math.prod(shape), shape=shape)


def codec_pack_mask(t: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """:func:`pack_mask` of a float tensor of any shape."""
    return pack_mask(untracked(t).contiguous(), low, high)


def codec_unpack_mask(bitmap: torch.Tensor, shape, dtype: torch.dtype, inside: float, outside: float) -> torch.Tensor:
    """:func:`unpack_mask` into a tensor of ``shape``."""
    return unpack_mask(bitmap, math.prod(shape), inside, outside, dtype, shape=shape)


def codec_quantize(t: torch.Tensor, rows: int, n: int, bits: int, group: int, seed: int | None):
    """:func:`quantize` of ``t`` read row-major as ``[rows, n]``."""
    x = untracked(t)
    return quantize(x if x.dim() == 2 and x.shape[0] == rows else x.reshape(rows, -1), bits, group, seed)


def codec_dequantize(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, n: int, bits: int, group: int,
                     dtype: torch.dtype, shape) -> torch.Tensor:
    """:func:`dequantize` into a tensor of ``shape``."""
    return dequantize(codes, lo, scale, n, bits, group, dtype, shape=shape)


# --- helpers ------------------------------------------------------------------------------------


def _output(numel: int, shape: tuple[int, ...] | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised output of ``numel`` elements, 1-D or of the caller's ``shape``: allocated in
    it, so the caller makes no view after (a torch call each, microseconds of host on a GPU)."""
    out = torch.empty(numel if shape is None else shape, dtype=dtype, device=device)
    if out.numel() != numel:
        raise ValueError(f"shape {tuple(shape)} does not hold {numel} elements")
    return out


def _bits_of(v: float, dtype: torch.dtype) -> int:
    """The bits of ``v`` rounded to ``dtype`` (a host tensor once per value and dtype, then cached:
    no tensor op on the per-call path). Keyed by the double's bits: -0.0 == 0.0 as a dict key."""
    return _bits_cached(struct.pack("<d", v), dtype)


@functools.lru_cache(maxsize=256)
def _bits_cached(double: bytes, dtype: torch.dtype) -> int:
    return int(torch.full((), struct.unpack("<d", double)[0], dtype=dtype).view(_INT_OF[dtype]))


def _order_key(v: float, dtype: torch.dtype) -> tuple[int, bool]:
    """``v`` rounded to ``dtype`` as the kernels' order key (+abs bits, or -abs bits if negative)."""
    b = _bits_of(v, dtype)
    ab = b & _ABS_MASK[_INT_OF[dtype]]
    return (-ab if b < 0 else ab), math.isnan(v)


def _ints(t: torch.Tensor, name: str) -> torch.Tensor:
    """The integer view of a float tensor (int tensors of the three widths pass through)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype in _INT_OF:
        t = t.view(_INT_OF[t.dtype])
    elif t.dtype not in _ABS_MASK:
        raise TypeError(f"{name} must be one of {_names()} or int16/int32/int64; got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def _check_bits(bits: torch.Tensor, name: str) -> None:
    if not isinstance(bits, torch.Tensor) or bits.dtype not in _ABS_MASK or bits.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int16/int32/int64 tensor; got {getattr(bits, 'dtype', type(bits))}"
                        f" of shape {tuple(getattr(bits, 'shape', ()))}")
    if not bits.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_bitmap(bitmap: torch.Tensor, numel: int, device: torch.device) -> None:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an int >= 0; got {numel!r}")
    if not isinstance(bitmap, torch.Tensor) or bitmap.dtype != torch.uint8 or bitmap.dim() != 1:
        raise TypeError(f"bitmap must be a 1-D uint8 tensor; got {getattr(bitmap, 'dtype', type(bitmap))}")
    if bitmap.numel() != (numel + 7) // 8 or not bitmap.is_contiguous() or bitmap.device != device:
        raise ValueError(
            f"bitmap must be contiguous, on {device}, with ceil({numel} / 8) = {(numel + 7) // 8} bytes; "
            f"got {bitmap.numel()} bytes on {bitmap.device}"
        )


def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 8 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 8; got {block!r}")


def _limit(bits: torch.Tensor, limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be an int >= 0 (bitmap.zero_limit_bits); got {limit!r}")
    return min(limit, _ABS_MASK[bits.dtype])  # above absmask nothing is kept either way; fits the width


def _names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in _INT_OF)
