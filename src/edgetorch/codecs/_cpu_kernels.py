"""CPU kernels of the codecs: thin wrappers over the C extension ``_native`` (see ``_native.c``).

The extension is built by the package's normal install (``setup.py``; optional, so an install
without a C compiler still succeeds). Where it is missing, or ``EDGETORCH_NO_NATIVE=1`` is set
before edgetorch is imported, ``NATIVE`` is False and the codecs use torch ops on CPU instead:
the same bytes, several times slower. Which kernels a codec runs is decided in ``_backend``'s
table; :func:`torch_ops` switches it to torch ops for a block.

Every wrapper takes CPU tensors, allocates its outputs with torch (so they are ordinary tensors
that own their memory; values at their exact size, known after counting) and passes addresses
and lengths to C, which releases the GIL and splits large inputs over ``torch.get_num_threads()``
threads. The wrappers are the per-call fixed cost, so they stay lean: no checks the C side
repeats, no torch ops beyond the allocations.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings

from collections.abc import Iterator

import torch

_FORCED_OFF = os.environ.get("EDGETORCH_NO_NATIVE", "").strip() not in ("", "0")
_ABI = 2  # _native.c's NATIVE_ABI: the functions this module calls


def _load():
    if _FORCED_OFF:
        return None, "EDGETORCH_NO_NATIVE is set"
    import importlib.util

    if importlib.util.find_spec(f"{__package__}._native") is None:
        # Python's own message here blames a "partially initialized module" (a circular import)
        return None, "the C extension is not built (no compiler at install time, or run from a source tree)"
    try:
        from . import _native
    except ImportError as exc:  # built for another Python or platform
        return None, f"{type(exc).__name__}: {exc}"
    if _native.ABI != _ABI:  # an editable install whose extension predates its source
        return None, f"the built extension is ABI {_native.ABI}, this source needs {_ABI} (rebuild it)"
    return _native, None


_native, UNAVAILABLE_REASON = _load()
NATIVE = _native is not None
CHUNK_ELEMS = _native.CHUNK_ELEMS if NATIVE else 8 * 4096  # elements per parallel chunk
_U8, _I64, _BOOL, _F32 = torch.uint8, torch.int64, torch.bool, torch.float32
_INF = float("inf")
_INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
           torch.bfloat16: torch.int16}
_warned = False


def warn_fallback() -> None:
    """Warn once per process that a codec runs on torch ops because the extension is missing.

    Silent when the fallback was chosen (``EDGETORCH_NO_NATIVE``) or the extension is loaded and
    merely switched off.
    """
    global _warned
    if _warned or _native is not None or _FORCED_OFF:
        return
    _warned = True
    warnings.warn(
        f"edgetorch's compiled CPU codec kernels are not available ({UNAVAILABLE_REASON}); bitmap, "
        "top-k, mask, integer-narrowing and quantized codecs run on torch ops instead, which gives the same "
        "bytes but packs and unpacks several times slower than copying the tensor. To fix it, "
        "install a C compiler (Debian/Ubuntu: apt install gcc python3-dev; macOS: xcode-select "
        "--install) and reinstall edgetorch (pip install --force-reinstall --no-deps edgetorch, "
        "or pip install -e . in a checkout). Set EDGETORCH_NO_NATIVE=1 to choose torch ops "
        "without this warning.",
        RuntimeWarning,
        stacklevel=3,
    )


@contextlib.contextmanager
def torch_ops() -> Iterator[None]:
    """Within the block the CPU codecs run on torch ops, as they do without the extension.

    The references of the tests and the fallback rows of the benchmarks use it. It points the
    backend table's CPU entry (the codecs' and the policies' only question) at torch ops, for the
    whole process: not thread-safe.
    """
    from . import _backend

    cpu = _backend.CPU
    _backend.CPU = _backend.TORCH
    try:
        yield
    finally:
        _backend.CPU = cpu


def build_description() -> str:
    """One line for the machine record: how the CPU kernels were built, or why they are missing."""
    if _native is None:
        return f"torch ops ({UNAVAILABLE_REASON})"
    info = _native.build_info()
    return f"C extension (abi {info['abi']}, {info['compiler'].strip()}, {info['isa']} kernels)"


def pack(t: torch.Tensor, limit: int, max_kept: int | None = None, rows: int = 0
         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Bitmap and kept elements of a float (or integer-view) CPU tensor, row-major: a first pass
    writes the bitmap and counts, then, unless more than ``max_kept`` were kept, a second gathers
    the kept values. (The bitmap codec's kernel, called once per stored tensor: :func:`topk`
    calls it, not the other way round, to spare the hot path a frame.)

    Args:
        t: CPU tensor of 2-, 4- or 8-byte elements, any shape and layout.
        limit: keep element i iff ``bits(i) & absmask > limit`` (``bitmap.zero_limit_bits``);
            with ``rows``, the values kept in each row.
        max_kept: give up after the first pass when more elements than this are kept: the
            values are then never gathered. None: no limit.
        rows: 0, or :func:`topk`'s rows.

    Returns:
        ``(bitmap, values)``: ``uint8`` bitmap of ``ceil(n / 8)`` bytes and the kept elements in
        order, 1-D in ``t.dtype``; None when more than ``max_kept`` are kept.
    """
    if not t.is_contiguous():
        t = t.detach().contiguous()
    n = t.numel()
    bitmap = torch.empty((n + 7) >> 3, dtype=_U8)
    threads = torch.get_num_threads()
    ptr, width, bm = t.data_ptr(), t.element_size(), bitmap.data_ptr()
    # per-chunk kept counts, from the first pass to the second: only above one chunk
    counts = torch.empty(-(-n // CHUNK_ELEMS), dtype=_I64) if n > CHUNK_ELEMS else None
    cp = 0 if counts is None else counts.data_ptr()
    if rows:
        kept = _native.topk_build(ptr, rows, n // rows, width, limit, bm, cp, threads)
    else:
        kept = _native.pack_build(ptr, n, width, limit, bm, cp, threads)
    if max_kept is not None and kept > max_kept:
        return None
    values = torch.empty(kept, dtype=t.dtype)
    if kept:
        _native.pack_compact(ptr, n, width, bm, cp, values.data_ptr(), kept, threads)
    return bitmap, values


def topk(x: torch.Tensor, rows: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row top-k of ``x`` split row-major into ``rows`` (>= 1) equal rows, as ``(bitmap, values)``.

    Each row keeps its ``keep`` largest magnitudes (compared on the bits, NaN largest), ties
    taken by position, zeros never: ``min(keep, non-zeros)`` values a row.
    """
    return pack(x, keep, None, rows)


def unpack(bitmap: torch.Tensor, values: torch.Tensor, shape) -> torch.Tensor:
    """Dense tensor of ``shape`` in ``values.dtype``: the values where a bit is set, zeros elsewhere.

    Raises:
        ValueError: the bitmap's size or number of set bits does not match.
    """
    out = torch.empty(size=shape, dtype=values.dtype)  # size=: twice as fast as a positional Size
    if not values.is_contiguous():
        values = values.contiguous()
    if not bitmap.is_contiguous():
        bitmap = bitmap.contiguous()
    _native.unpack(bitmap.data_ptr(), bitmap.numel(), values.data_ptr(), values.numel(),
                   values.element_size(), out.data_ptr(), out.numel(), torch.get_num_threads())
    return out


@functools.lru_cache(maxsize=256)
def _signed_bits(value: float, negative: bool, dtype: torch.dtype) -> int:
    return int(torch.tensor(value, dtype=torch.float64).to(dtype).view(_INT_OF[dtype]).item())


def _bits(value: float, dtype: torch.dtype) -> int:
    """``value`` rounded to ``dtype`` (as torch rounds a Python scalar), as a signed bit pattern."""
    # 0.0 and -0.0 are equal keys to a cache: the sign is part of the key
    return _signed_bits(value, math.copysign(1.0, value) < 0, dtype)


@functools.lru_cache(maxsize=256)
def _order_key(value: float, dtype: torch.dtype) -> int:
    """+|v| or -|v| of ``value``'s bits in ``dtype``: integers that order like the floats (both
    zeros map to 0, so the cache may mix them up)."""
    bits = _bits(value, dtype)
    return bits if bits >= 0 else -(bits & ((1 << (8 * dtype.itemsize - 1)) - 1))


def mask_pack(t: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Bitmap of ``low < t < high``, compared in ``t.dtype`` like ``(t > low) & (t < high)``;
    ``high = inf`` means no upper bound (``t > low``: +Inf is inside, NaN never is)."""
    if not t.is_contiguous():
        t = t.detach().contiguous()
    n = t.numel()
    bitmap = torch.empty((n + 7) >> 3, dtype=_U8)
    hi = _order_key(high, t.dtype) + (high == _INF)  # one above +Inf's key, still below every NaN's
    _native.mask_pack(t.data_ptr(), n, t.element_size(), _order_key(low, t.dtype), hi, bitmap.data_ptr(),
                      torch.get_num_threads())
    return bitmap


def mask_unpack(bitmap: torch.Tensor, shape, dtype: torch.dtype, inside: float, outside: float) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype``: ``inside`` where the bit is set, else ``outside``."""
    out = torch.empty(size=shape, dtype=dtype)
    if not bitmap.is_contiguous():
        bitmap = bitmap.contiguous()
    _native.mask_unpack(bitmap.data_ptr(), bitmap.numel(), out.numel(), out.element_size(),
                        _bits(inside, dtype), _bits(outside, dtype), out.data_ptr(), torch.get_num_threads())
    return out


def bits_pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as a bitmap (row-major, least significant bit first)."""
    if not mask.is_contiguous():
        mask = mask.contiguous()
    n = mask.numel()
    bitmap = torch.empty((n + 7) >> 3, dtype=_U8)
    _native.bits_pack(mask.data_ptr(), n, bitmap.data_ptr(), torch.get_num_threads())
    return bitmap


def bits_unpack(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` bits of ``bitmap`` as a 1-D bool tensor."""
    out = torch.empty(numel, dtype=_BOOL)
    if not bitmap.is_contiguous():
        bitmap = bitmap.contiguous()
    _native.mask_unpack(bitmap.data_ptr(), bitmap.numel(), numel, 1, 1, 0, out.data_ptr(), torch.get_num_threads())
    return out


def minmax(t: torch.Tensor) -> tuple[int, int]:
    """Smallest and largest element of a non-empty contiguous int16/int32/int64 CPU tensor."""
    return _native.minmax(t.data_ptr(), t.numel(), t.element_size(), torch.get_num_threads())


def convert(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous int16/int32/int64 CPU tensor as ``dtype`` (an integer type that holds it)."""
    out = torch.empty(size=t.shape, dtype=dtype)
    _native.convert(t.data_ptr(), t.numel(), t.element_size(), out.data_ptr(), out.element_size(),
                    torch.get_num_threads())
    return out


_BF16 = torch.bfloat16


@functools.lru_cache(maxsize=None)
def _nan16(dtype: torch.dtype) -> int:
    """The bits torch's ``.to(dtype)`` writes for the float32 NaN a non-finite group decodes to
    (bfloat16: 0x7FC0 from torch's scalar rounding, 0xFFFF from its AVX2 loops; asked once)."""
    return int(torch.full((64,), math.nan).to(dtype).view(torch.int16)[0]) & 0xFFFF


def quantize(t: torch.Tensor, rows: int, n: int, bits: int, group: int,
             seed: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantized codec's ``(codes, lo, scale)`` of a float CPU tensor read row-major as
    ``[rows, n]`` (float16, bfloat16, float32; float64 is read as float32, as the reference rounds
    it); ``rows``, ``bits``, ``group`` and ``seed`` as ``quantized.pack_quantized`` checked them.

    ``t`` may have any shape: only its address is passed, so a contiguous tensor is neither
    reshaped nor detached (each a few microseconds, which is what a pass over 1M elements saves
    against a copy); one that is not contiguous is copied first.
    """
    if not t.is_contiguous():
        t = t.detach().contiguous()
    groups = -(-n // group)
    codes = torch.empty(rows, (n * bits + 7) >> 3, dtype=_U8)
    lo = torch.empty(rows, groups, dtype=_F32)
    scale = torch.empty(rows, groups, dtype=_F32)
    _native.quantize(t.data_ptr(), rows, n, t.element_size(), t.dtype is _BF16, bits, group,
                     -1 if seed is None else seed, codes.data_ptr(), lo.data_ptr(), scale.data_ptr(),
                     torch.get_num_threads())
    return codes, lo, scale


def dequantize(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, n: int, bits: int, group: int,
               dtype: torch.dtype, shape=None) -> torch.Tensor:
    """``[rows, n]`` tensor of ``dtype``: ``lo + code * scale`` in float32, rounded to ``dtype`` as
    ``.to(dtype)`` rounds (rows: ``lo.shape[0]``); allocated as ``shape`` when given (``rows * n``
    elements: no view of the result afterwards, which costs as much as the allocation).

    Raises:
        ValueError: codes is not uint8, lo or scale not float32, or their sizes do not match.
    """
    if codes.dtype is not _U8 or lo.dtype is not _F32 or scale.dtype is not _F32:
        raise ValueError(f"codes must be uint8 and lo, scale float32; got {codes.dtype}, {lo.dtype}, {scale.dtype}")
    if not (codes.is_contiguous() and lo.is_contiguous() and scale.is_contiguous()):
        codes, lo, scale = codes.contiguous(), lo.contiguous(), scale.contiguous()
    rows = lo.shape[0] if lo.dim() else 0
    out = torch.empty(size=(rows, n) if shape is None else shape, dtype=dtype)
    _native.dequantize(codes.data_ptr(), codes.numel(), lo.data_ptr(), lo.numel(), scale.data_ptr(),
                       scale.numel(), rows, n, bits, group, out.data_ptr(), out.element_size(), dtype is _BF16,
                       _nan16(dtype) if out.element_size() == 2 else 0, torch.get_num_threads())
    return out


def sided_select(q: torch.Tensor, inside: torch.Tensor, low: float, high: float, inner_low: float,
                 inner_high: float, mid: float) -> torch.Tensor:
    """``quantized.SidedQuantizedTensor``'s decoding of a contiguous float CPU tensor ``q`` (which it
    overwrites): where the bit of ``inside`` is set, ``q`` clamped into ``[inner_low, inner_high]``;
    elsewhere ``high`` if ``q > mid``, else ``low`` (values of ``q.dtype``; NaN stays NaN inside and
    reads ``low`` outside, as the torch ops' ``where``).

    The torch ops took 25-50 ms on 1M float32 elements on the 2-core VM (100-200x a clone: two
    ``where`` of ~5 ms each and 4.5 fresh tensors of q's bytes, page faults included); this is a
    clamp in place, two bitmap kernels and three in-place integer operations (~6 ms there, most of it
    the page faults of its two fresh tensors).
    """
    if not inside.is_contiguous():
        inside = inside.contiguous()
    dtype, n, width, threads = q.dtype, q.numel(), q.element_size(), torch.get_num_threads()
    up = mask_pack(q, mid, _INF)  # q > mid, compared in q.dtype (NaN never)
    q.clamp_(inner_low, inner_high)
    out = torch.empty(size=q.shape, dtype=dtype)
    _native.mask_unpack(up.data_ptr(), up.numel(), n, width, _bits(high, dtype), _bits(low, dtype), out.data_ptr(),
                        threads)
    ints = _INT_OF[dtype]
    keep = torch.empty(size=q.shape, dtype=ints)  # all ones where inside (torch.where: ~5 ms on 1M)
    _native.mask_unpack(inside.data_ptr(), inside.numel(), n, width, -1, 0, keep.data_ptr(), threads)
    o, c = out.view(ints), q.view(ints)
    c ^= o  # out ^ ((out ^ q) & keep): q where inside, out elsewhere
    c &= keep
    o ^= c
    return out
