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
whole bitmap bytes, so no two programs write the same byte):

1. a count kernel stores each block's number of kept elements;
2. ``torch.cumsum`` over those counts (on the device) gives each block its first output slot;
3. a compaction kernel writes the block's bitmap bytes and, through an in-block prefix sum,
   each kept value at its slot. Unpacking is the mirror image (popcounts, cumsum, scatter).

Host synchronisation: :func:`pack_bitmap` reads one number back (the kept count, to allocate
the values at their exact size); everything else here reads nothing back. Per-row top-k knows
its output size in advance (at most ``keep`` values a row), so it is written into a
``[rows, min(keep, n)]`` buffer and needs no sync at all.

The quantized codec (``quantized.py``'s format: codes of 8/4/2 bits, a float32 minimum and step
per group) is float arithmetic by nature: :func:`quantize` runs one program per few groups of a
row (a min/max pass, then a code pass that packs whole bytes: groups are multiples of 8 elements,
so no two programs share a byte), :func:`dequantize` one program per block of a row. Neither reads
anything back.

The block size (``BLOCK``) is a guess for a GPU, not a measurement: this code was written and
tested on a machine without one (Triton's interpreter, ``TRITON_INTERPRET=1``, runs the same
kernels on CPU tensors). Every function takes ``block=`` (a power of two >= 8) so tests can
cover many blocks with few elements.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .bitmap import _ABS_MASK
from .bitmap import _INT_VIEW as _INT_OF

BLOCK = 2048  # elements per program: 256 bitmap bytes, 8 KiB of float32 read per program
_RADIX_BITS = 8  # top-k threshold: 256-bin histogram per pass, 2/4/8 passes for 16/32/64 bits
QBLOCK = 1024  # elements per quantize program: 8 groups of the default 128, or 1024 columns of one


# Predicates of the flat kernels (constexpr MODE).
_THRESHOLD = 0  # keep iff (bits & absmask) > limit
_TOPK = 1  # keep iff abs > thr[row], or abs == thr[row] and column <= cut[row]
_BITMAP = 2  # the source is a bitmap: keep iff its bit is set


# --- kernels ------------------------------------------------------------------------------------


@triton.jit
def _keep_of(ab, idx, limit, thr_ptr, cut_ptr, ncols, MODE: tl.constexpr):
    """Whether each element (magnitude bits ``ab`` at flat index ``idx``) is kept."""
    if MODE == 0:
        keep = ab > limit
    else:
        row = idx // ncols
        thr = tl.load(thr_ptr + row)
        cut = tl.load(cut_ptr + row)
        keep = (ab > thr) | ((ab == thr) & (idx - row * ncols <= cut))
    return keep


@triton.jit
def _flags(src_ptr, idx, inb, limit, thr_ptr, cut_ptr, ncols, ABS_MASK: tl.constexpr, MODE: tl.constexpr):
    """Kept flags of the elements ``idx`` (false where ``inb`` is false) read from values or a bitmap."""
    if MODE == 2:
        byte = tl.load(src_ptr + (idx >> 3), mask=inb, other=0).to(tl.int32)
        keep = ((byte >> (idx & 7).to(tl.int32)) & 1) != 0
    else:
        ab = tl.load(src_ptr + idx, mask=inb, other=0) & ABS_MASK
        keep = _keep_of(ab, idx, limit, thr_ptr, cut_ptr, ncols, MODE)
    return keep & inb


@triton.jit
def _count_kernel(src_ptr, counts_ptr, numel, limit, thr_ptr, cut_ptr, ncols,
                  ABS_MASK: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """counts[b] = kept elements of block b."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = _flags(src_ptr, idx, idx < numel, limit, thr_ptr, cut_ptr, ncols, ABS_MASK, MODE)
    tl.store(counts_ptr + pid, tl.sum(keep.to(tl.int64), axis=0))


@triton.jit
def _row_start_kernel(src_ptr, starts_ptr, prefix_ptr, ncols, limit, thr_ptr, cut_ptr,
                      ABS_MASK: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """starts[r] = kept elements before flat index r * ncols (r = 0..rows), from the block prefix."""
    r = tl.program_id(0)
    pos = r.to(tl.int64) * ncols
    blk = pos // BLOCK
    idx = blk * BLOCK + tl.arange(0, BLOCK)
    keep = _flags(src_ptr, idx, idx < pos, limit, thr_ptr, cut_ptr, ncols, ABS_MASK, MODE)
    tl.store(starts_ptr + r, tl.load(prefix_ptr + blk) + tl.sum(keep.to(tl.int64), axis=0))


@triton.jit
def _compact_kernel(bits_ptr, bitmap_ptr, values_ptr, prefix_ptr, starts_ptr, numel, nbytes, nvalues, limit,
                    thr_ptr, cut_ptr, ncols, width,
                    ABS_MASK: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """One block's bitmap bytes, and its kept values at their slots.

    MODE 0: slot = prefix[block] + rank in block. MODE 1 (top-k rows): row r's values start at
    r * width, so slot = r * width + (kept before the element) - starts[r].
    """
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = idx < numel
    b = tl.load(bits_ptr + idx, mask=inb, other=0)
    keep = _keep_of(b & ABS_MASK, idx, limit, thr_ptr, cut_ptr, ncols, MODE) & inb
    k = keep.to(tl.int32)
    byte = tl.sum(tl.reshape(k, (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
    bidx = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(bitmap_ptr + bidx, byte.to(tl.uint8), mask=bidx < nbytes)
    slot = tl.load(prefix_ptr + pid) + (tl.cumsum(k, axis=0) - k).to(tl.int64)
    if MODE == 1:
        row = idx // ncols
        slot = row * width + slot - tl.load(starts_ptr + row, mask=inb, other=0)
    tl.store(values_ptr + slot, b, mask=keep & (slot < nvalues))  # a wrong nnz must not write past the end


@triton.jit
def _scatter_kernel(bitmap_ptr, values_ptr, out_ptr, prefix_ptr, starts_ptr, numel, nvalues, ncols, width,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = the value of element i where its bit is set, else 0 (unpacking one block)."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = idx < numel
    keep = _flags(bitmap_ptr, idx, inb, 0, bitmap_ptr, bitmap_ptr, 1, 0, 2)
    k = keep.to(tl.int32)
    slot = tl.load(prefix_ptr + pid) + (tl.cumsum(k, axis=0) - k).to(tl.int64)
    if ROWS:
        row = idx // ncols
        in_row = slot - tl.load(starts_ptr + row, mask=inb, other=0)
        keep = keep & (in_row < width)  # a malformed bitmap must not read another row's values
        slot = row * width + in_row
    v = tl.load(values_ptr + slot, mask=keep & (slot < nvalues), other=0)
    tl.store(out_ptr + idx, v, mask=inb)


@triton.jit
def _radix_hist_kernel(bits_ptr, hist_ptr, prefix_ptr, ncols, nchunks, shift,
                       ABS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of digit (abs >> shift) & 255 over the elements of row r whose higher digits
    equal prefix[r]; one program per (row, chunk), added atomically into hist[r]."""
    pid = tl.program_id(0)
    r = pid // nchunks
    col = (pid - r * nchunks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = col < ncols
    ab = tl.load(bits_ptr + r.to(tl.int64) * ncols + col, mask=inb, other=0) & ABS_MASK
    high = ab >> shift
    match = inb & ((high >> 8) == tl.load(prefix_ptr + r))
    h = tl.histogram((high & 255).to(tl.int32), 256, mask=match)
    tl.atomic_add(hist_ptr + r * 256 + tl.arange(0, 256), h, sem="relaxed")


@triton.jit
def _radix_select_kernel(hist_ptr, prefix_ptr, krem_ptr, thr_ptr, take_ptr, LAST: tl.constexpr):
    """Per row: the digit holding the krem-th smallest remaining magnitude; zeroes hist[r] for the
    next pass. After the last digit, thr = the k-th smallest magnitude's bits and take = how many
    elements equal to it (first by position) fill the row's quota (none when thr is 0)."""
    r = tl.program_id(0)
    bins = tl.arange(0, 256)
    h = tl.load(hist_ptr + r * 256 + bins).to(tl.int64)
    tl.store(hist_ptr + r * 256 + bins, tl.zeros([256], dtype=tl.int32))
    krem = tl.load(krem_ptr + r)
    d = tl.sum((tl.cumsum(h, axis=0) < krem).to(tl.int64), axis=0)
    below = tl.sum(tl.where(bins < d, h, 0), axis=0)
    equal = tl.sum(tl.where(bins == d, h, 0), axis=0)
    prefix = tl.load(prefix_ptr + r) * 256 + d
    krem = krem - below
    tl.store(prefix_ptr + r, prefix)
    tl.store(krem_ptr + r, krem)
    if LAST:
        # Elements below thr: k - krem; equal: `equal`; so (n - k) + krem - equal lie above it,
        # and the quota keep = n - k leaves room for equal - krem ties.
        tl.store(thr_ptr + r, prefix)
        tl.store(take_ptr + r, tl.where(prefix != 0, equal - krem, 0))


@triton.jit
def _tie_count_kernel(bits_ptr, ties_ptr, thr_ptr, take_ptr, ncols, nchunks,
                      ABS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """ties[r, c] = elements of chunk c of row r equal to thr[r] (0 if the row takes no ties)."""
    pid = tl.program_id(0)
    r = pid // nchunks
    if tl.load(take_ptr + r) > 0:
        col = (pid - r * nchunks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = col < ncols
        ab = tl.load(bits_ptr + r.to(tl.int64) * ncols + col, mask=inb, other=0) & ABS_MASK
        tl.store(ties_ptr + pid, tl.sum((inb & (ab == tl.load(thr_ptr + r))).to(tl.int64), axis=0))
    else:
        tl.store(ties_ptr + pid, 0)


@triton.jit
def _tie_cut_kernel(bits_ptr, ties_ptr, ties_incl_ptr, thr_ptr, take_ptr, cut_ptr, ncols, nchunks,
                    ABS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """cut[r] = column of row r's take[r]-th tie; written by the one chunk that holds it."""
    pid = tl.program_id(0)
    r = pid // nchunks
    take = tl.load(take_ptr + r)
    incl = tl.load(ties_incl_ptr + pid)
    before = incl - tl.load(ties_ptr + pid)
    if (take > before) & (take <= incl):
        c = pid - r * nchunks
        col = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = col < ncols
        ab = tl.load(bits_ptr + r.to(tl.int64) * ncols + col, mask=inb, other=0) & ABS_MASK
        tie = (inb & (ab == tl.load(thr_ptr + r))).to(tl.int64)
        at = tl.sum((tl.cumsum(tie, axis=0) < take - before).to(tl.int64), axis=0)
        tl.store(cut_ptr + r, c.to(tl.int64) * BLOCK + at)


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
    k = inside.to(tl.int32)
    byte = tl.sum(tl.reshape(k, (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
    bidx = pid.to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(bitmap_ptr + bidx, byte.to(tl.uint8), mask=bidx < nbytes)


@triton.jit
def _mask_unpack_kernel(bitmap_ptr, out_ptr, numel, in_bits, out_bits, BLOCK: tl.constexpr):
    """out[i] = in_bits where bit i is set, else out_bits (integer view of the float output)."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = idx < numel
    keep = _flags(bitmap_ptr, idx, inb, 0, bitmap_ptr, bitmap_ptr, 1, 0, 2)
    v = tl.where(keep, in_bits, out_bits)
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
        if t is not None and t.device.type == "cuda":
            with torch.cuda.device(t.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return on_device


# --- bitmap (BitTrain) ----------------------------------------------------------------------------


@_on_its_device
def count(bits: torch.Tensor, limit: int, *, block: int = BLOCK) -> torch.Tensor:
    """Per-block kept counts as an exclusive prefix: the first half of :func:`pack_bitmap`.

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
    nblocks = triton.cdiv(n, block)
    prefix = torch.zeros(nblocks + 1, dtype=torch.int64, device=bits.device)
    if n:
        counts = torch.empty(nblocks, dtype=torch.int64, device=bits.device)
        _count_kernel[(nblocks,)](bits, counts, n, limit, prefix, prefix, 1,  # no rows: thr/cut unused
                                  ABS_MASK=_ABS_MASK[bits.dtype], MODE=_THRESHOLD, BLOCK=block)
        torch.cumsum(counts, 0, out=prefix[1:])
    return prefix


@_on_its_device
def compact(
    bits: torch.Tensor, limit: int, prefix: torch.Tensor, nnz: int, *, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bitmap and kept values, given :func:`count`'s prefix and its total ``nnz = int(prefix[-1])``.

    ``nnz`` is trusted (checking it would be a second sync): a wrong value gives wrong output
    (values past ``nnz`` are dropped, never written out of bounds).
    """
    _check_bits(bits, "bits")
    _check_block(block)
    limit = _limit(bits, limit)
    if isinstance(nnz, bool) or not isinstance(nnz, int) or nnz < 0:
        raise ValueError(f"nnz must be the int total read from count()'s prefix[-1]; got {nnz!r}")
    n = bits.numel()
    nblocks = triton.cdiv(n, block)
    if prefix.shape != (nblocks + 1,) or prefix.dtype != torch.int64 or prefix.device != bits.device:
        raise ValueError(
            f"prefix must be count()'s int64 tensor of {nblocks + 1} entries on {bits.device} for {n} "
            f"elements and block={block}; got {prefix.dtype} of shape {tuple(prefix.shape)} on {prefix.device}"
        )
    bitmap = torch.empty((n + 7) // 8, dtype=torch.uint8, device=bits.device)
    values = torch.empty(nnz, dtype=bits.dtype, device=bits.device)
    if n:
        _compact_kernel[(nblocks,)](bits, bitmap, values, prefix, prefix, n, bitmap.numel(), nnz, limit,
                                    prefix, prefix, 1, 0,  # no rows: starts/thr/cut/width unused
                                    ABS_MASK=_ABS_MASK[bits.dtype], MODE=_THRESHOLD, BLOCK=block)
    return bitmap, values


def pack_bitmap(bits: torch.Tensor, limit: int, *, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Bitmap of ``(bits & absmask) > limit`` and the kept elements, like ``bitmap.pack_torch``.

    One host sync: the kept count is read back to allocate ``values`` at its exact size. Zero
    would need an upper-bound buffer (``n`` values, as large as the dense tensor: what packing
    is meant to save) plus a trim that is itself a sync. Callers that also want the count for a
    decision use :func:`count` + :func:`compact` and still read it once.

    Returns:
        ``(bitmap uint8[ceil(n / 8)], values[nnz] of bits.dtype)``.
    """
    prefix = count(bits, limit, block=block)
    nnz = int(prefix[-1]) if bits.numel() else 0
    return compact(bits, limit, prefix, nnz, block=block)


@_on_its_device
def unpack_bitmap(bitmap: torch.Tensor, values: torch.Tensor, numel: int, *, block: int = BLOCK) -> torch.Tensor:
    """Dense 1-D tensor of ``values.dtype``: the values where bits are set, zeros elsewhere. No sync.

    ``values`` may be a float tensor or its integer view; bits beyond ``values`` read back as 0.
    """
    _check_block(block)
    ints = _ints(values, "values")
    _check_bitmap(bitmap, numel, values.device)
    out = torch.empty(numel, dtype=ints.dtype, device=values.device)
    if numel:
        prefix = _bitmap_prefix(bitmap, numel, block)
        _scatter_kernel[(prefix.numel() - 1,)](bitmap, ints, out, prefix, prefix, numel, ints.numel(), 1, 0,
                                               ROWS=False, BLOCK=block)
    return out.view(values.dtype)


# --- per-row top-k (Back Razor) -----------------------------------------------------------------


@_on_its_device
def pack_topk_rows(
    x: torch.Tensor, keep: int, *, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``keep`` largest magnitudes as bitmap + ``[rows, min(keep, n)]`` values; no sync.

    The row threshold is the ``(n - keep)``-th smallest magnitude, found by a radix select on the
    magnitude bits (non-negative float bits order like the values, NaN above Inf): 8 bits a
    pass, each pass a histogram kernel over the row and a one-program-per-row digit choice, so
    no sort and no sync. Elements above the threshold are kept; ties at a non-zero threshold are
    taken by position (first ones) until the row holds exactly ``keep``; zeros are never kept.
    Edge cases as ``topk._topk_mask``: ``keep >= n`` keeps every non-zero, ``keep == 0`` nothing.

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
    values = torch.zeros(rows * width, dtype=bits.dtype, device=dev)
    if width == 0 or numel == 0:
        bitmap = torch.zeros((numel + 7) // 8, dtype=torch.uint8, device=dev)
        return bitmap, values.view(x.dtype).view(rows, width), torch.zeros(rows, dtype=torch.int64, device=dev)
    absmask = _ABS_MASK[bits.dtype]
    cut = torch.full((rows,), -1, dtype=torch.int64, device=dev)
    if keep >= n:
        thr = torch.zeros(rows, dtype=torch.int64, device=dev)  # every non-zero
    else:
        thr, take = _row_threshold(bits, rows, n, n - keep, block)
        _tie_cut(bits, rows, n, thr, take, cut, block)
    nblocks = triton.cdiv(numel, block)
    counts = torch.empty(nblocks, dtype=torch.int64, device=dev)
    _count_kernel[(nblocks,)](bits, counts, numel, 0, thr, cut, n, ABS_MASK=absmask, MODE=_TOPK, BLOCK=block)
    prefix = torch.zeros(nblocks + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=prefix[1:])
    starts = torch.empty(rows + 1, dtype=torch.int64, device=dev)
    _row_start_kernel[(rows + 1,)](bits, starts, prefix, n, 0, thr, cut, ABS_MASK=absmask, MODE=_TOPK, BLOCK=block)
    bitmap = torch.empty((numel + 7) // 8, dtype=torch.uint8, device=dev)
    _compact_kernel[(nblocks,)](bits, bitmap, values, prefix, starts, numel, bitmap.numel(), values.numel(), 0,
                                thr, cut, n, width,
                                ABS_MASK=absmask, MODE=_TOPK, BLOCK=block)
    return bitmap, values.view(x.dtype).view(rows, width), starts[1:] - starts[:-1]


@_on_its_device
def unpack_topk_rows(
    bitmap: torch.Tensor, values: torch.Tensor, rows: int, n: int, *, block: int = BLOCK
) -> torch.Tensor:
    """Dense ``[rows, n]`` tensor of ``values.dtype`` from :func:`pack_topk_rows`'s bitmap and
    ``[rows, width]`` values (row r's values start at ``r * width``). No host sync."""
    _check_block(block)
    if values.dim() != 2 or values.shape[0] != rows:
        raise ValueError(f"values must be [rows={rows}, width]; got shape {tuple(values.shape)}")
    ints = _ints(values, "values")
    numel = rows * n
    _check_bitmap(bitmap, numel, values.device)
    out = torch.empty(numel, dtype=ints.dtype, device=values.device)
    if numel:
        prefix = _bitmap_prefix(bitmap, numel, block)
        starts = torch.empty(rows + 1, dtype=torch.int64, device=values.device)
        _row_start_kernel[(rows + 1,)](bitmap, starts, prefix, n, 0, prefix, prefix, ABS_MASK=0, MODE=_BITMAP,
                                       BLOCK=block)
        _scatter_kernel[(prefix.numel() - 1,)](bitmap, ints.reshape(-1), out, prefix, starts, numel, ints.numel(), n,
                                               values.shape[1], ROWS=True, BLOCK=block)
    return out.view(values.dtype).view(rows, n)


def _row_threshold(bits, rows, n, k, block):
    """Per row, the bits of the k-th smallest magnitude (1-indexed) and how many ties to take."""
    dev = bits.device
    width = {torch.int16: 16, torch.int32: 32, torch.int64: 64}[bits.dtype]
    hist = torch.zeros(rows * 256, dtype=torch.int32, device=dev)
    prefix = torch.zeros(rows, dtype=torch.int64, device=dev)
    krem = torch.full((rows,), k, dtype=torch.int64, device=dev)
    thr = torch.empty(rows, dtype=torch.int64, device=dev)
    take = torch.empty(rows, dtype=torch.int64, device=dev)
    nchunks = triton.cdiv(n, block)
    shifts = range(width - _RADIX_BITS, -1, -_RADIX_BITS)  # the sign bit is 0 in the magnitudes
    for shift in shifts:
        _radix_hist_kernel[(rows * nchunks,)](bits, hist, prefix, n, nchunks, shift,
                                               ABS_MASK=_ABS_MASK[bits.dtype], BLOCK=block)
        _radix_select_kernel[(rows,)](hist, prefix, krem, thr, take, LAST=shift == 0)
    return thr, take


def _tie_cut(bits, rows, n, thr, take, cut, block):
    """cut[r] = column of row r's take[r]-th element equal to thr[r] (stays -1 when take is 0)."""
    nchunks = triton.cdiv(n, block)
    ties = torch.empty(rows * nchunks, dtype=torch.int64, device=bits.device)
    absmask = _ABS_MASK[bits.dtype]
    _tie_count_kernel[(rows * nchunks,)](bits, ties, thr, take, n, nchunks, ABS_MASK=absmask, BLOCK=block)
    incl = ties.view(rows, nchunks).cumsum(1).view(-1)
    _tie_cut_kernel[(rows * nchunks,)](bits, ties, incl, thr, take, cut, n, nchunks, ABS_MASK=absmask, BLOCK=block)


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
    nan_above = int(torch.tensor(math.inf, dtype=x.dtype).view(bits.dtype))
    _mask_pack_kernel[(triton.cdiv(n, block),)](bits, bitmap, n, bitmap.numel(), lo_key, hi_key, nan_above,
                                                ABS_MASK=_ABS_MASK[bits.dtype], HAS_HIGH=has_high, BLOCK=block)
    return bitmap


@_on_its_device
def unpack_mask(
    bitmap: torch.Tensor, numel: int, inside: float, outside: float, dtype: torch.dtype, *, block: int = BLOCK
) -> torch.Tensor:
    """Dense 1-D ``dtype`` tensor: ``inside`` where the bit is set, ``outside`` elsewhere. No sync."""
    _check_block(block)
    if dtype not in _INT_OF:
        raise TypeError(f"dtype must be one of {_names()}; got {dtype}")
    _check_bitmap(bitmap, numel, bitmap.device)
    ints = _INT_OF[dtype]
    in_bits, out_bits = torch.tensor([inside, outside], dtype=dtype).view(ints).tolist()  # host tensor
    out = torch.empty(numel, dtype=ints, device=bitmap.device)
    if numel:
        _mask_unpack_kernel[(triton.cdiv(numel, block),)](bitmap, out, numel, in_bits, out_bits, BLOCK=block)
    return out.view(dtype)


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
    from .quantized import _MASK32, _mix32_int, check_bits

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
    groups, row_bytes = triton.cdiv(n, group), (n * bits + 7) // 8
    codes = torch.empty((rows, row_bytes), dtype=torch.uint8, device=x.device)
    lo = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows and n:
        chunk = min(triton.next_power_of_2(group), block)
        per = block // chunk
        blocks = triton.cdiv(groups, per)
        _quantize_kernel[(rows * blocks,)](x.view(torch.int16) if bf16 else x, codes, lo, scale, n, groups, blocks,
                                           row_bytes, group, 0 if seed is None else _mix32_int(seed),
                                           BITS=bits, STOCHASTIC=seed is not None, GROUPS=per, CHUNK=chunk,
                                           BF16=bf16, enable_fp_fusion=False)
    return codes, lo, scale


@_on_its_device
def dequantize(
    codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, n: int, bits: int, group: int,
    dtype: torch.dtype, *, block: int = BLOCK,
) -> torch.Tensor:
    """``[rows, n]`` tensor of ``dtype``: ``lo + code * scale`` in float32, rounded to ``dtype``
    (``quantized._dequantize_torch(...).to(dtype)``). No sync."""
    from .quantized import check_bits

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
    groups, row_bytes = triton.cdiv(n, group), (n * bits + 7) // 8
    if codes.dtype != torch.uint8 or codes.shape != (rows, row_bytes) or not codes.is_contiguous():
        raise ValueError(f"codes must be contiguous uint8 [rows, ceil({n} * {bits} / 8) = {row_bytes}]; got "
                         f"{codes.dtype} {tuple(codes.shape)}")
    for name, t in (("lo", lo), ("scale", scale)):
        if (t.dtype != torch.float32 or t.shape != (rows, groups) or not t.is_contiguous()
                or t.device != codes.device):
            raise ValueError(f"{name} must be contiguous float32 [rows={rows}, ceil({n} / {group}) = {groups}] on "
                             f"{codes.device}; got {t.dtype} {tuple(t.shape)} on {t.device}")
    bf16 = dtype == torch.bfloat16
    out = torch.empty((rows, n), dtype=torch.int16 if bf16 else dtype, device=codes.device)
    if rows and n:
        blocks = triton.cdiv(n, block)
        _dequantize_kernel[(rows * blocks,)](codes, lo, scale, out, n, groups, blocks, row_bytes, group,
                                             BITS=bits, BLOCK=block, BF16=bf16, enable_fp_fusion=False)
    return out.view(dtype)


# --- helpers ------------------------------------------------------------------------------------


def _bitmap_prefix(bitmap: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """Exclusive prefix of the set bits per block of ``numel`` elements (last entry: total)."""
    nblocks = triton.cdiv(numel, block)
    counts = torch.empty(nblocks, dtype=torch.int64, device=bitmap.device)
    _count_kernel[(nblocks,)](bitmap, counts, numel, 0, counts, counts, 1, ABS_MASK=0, MODE=_BITMAP, BLOCK=block)
    prefix = torch.zeros(nblocks + 1, dtype=torch.int64, device=bitmap.device)
    torch.cumsum(counts, 0, out=prefix[1:])
    return prefix


def _order_key(v: float, dtype: torch.dtype) -> tuple[int, bool]:
    """``v`` rounded to ``dtype`` as the kernels' order key (+abs bits, or -abs bits if negative)."""
    ints = _INT_OF[dtype]
    b = int(torch.full((), v, dtype=dtype).view(ints))
    ab = b & _ABS_MASK[ints]
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
