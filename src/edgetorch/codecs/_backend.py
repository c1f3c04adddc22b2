"""The codecs' backend table: for each kernel operation, which implementation runs on a tensor.

=====================  ==========================  =========================  =============
backend                CPU tensor                  CUDA tensor                other devices
=====================  ==========================  =========================  =============
C extension (NATIVE)   when it loaded              -                          -
Triton (``triton()``)  emulate_gpu_path (tests)    when triton imports        -
torch ops (TORCH)      otherwise                   otherwise                  always
=====================  ==========================  =========================  =============

A backend is a :class:`Kernels`: one field per operation, holding the function that runs it, or
None where that backend has no kernel for it; there the codec runs its torch ops, the format's
reference, which stays beside the format (``bitmap.pack_torch``, ``quantized._quantize_torch``,
...). TORCH is all None. A codec asks ``(CPU if t.is_cpu else device(t)).operation`` and calls
what it gets, or its torch ops on None.

The table is resolved once, not per tensor: ``CPU`` at import, the CUDA entry on the first CUDA
tensor (which imports triton and checks one launch). ``CPU`` is a module attribute read inline,
because the CPU path is the activations engine's per-saved-tensor hot path: no call and no
lookup per tensor. The switches rebind it for a block: :func:`~._cpu_kernels.torch_ops` (TORCH,
the tests' references and the benchmarks' fallback rows) and :func:`~._cuda.emulate_gpu_path`
(Triton on CPU tensors, through its interpreter); ``EDGETORCH_NO_NATIVE=1`` and
``EDGETORCH_NO_TRITON=1`` choose torch ops for the whole process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import _cpu_kernels

_Op = Callable | None


@dataclass(frozen=True, eq=False)
class Kernels:
    """One backend's implementation of each codec operation (None: the codec's torch ops run).

    Signatures (every tensor on the backend's device):

    - ``pack_bitmap(t, limit, max_kept=None)``: ``(bitmap, values)`` of a float tensor of any
      shape, values in ``t.dtype``; None when more than ``max_kept`` elements are kept.
    - ``unpack_bitmap(bitmap, values, shape)``: the dense tensor of ``values.dtype``; as many
      values as set bits. ``unpack_bitmap_capped``: the same, with fewer values allowed (the
      set bits past them read back as 0).
    - ``pack_bitmap_capped(bits, limit, capacity)``: ``(bitmap, values, count)`` of a contiguous
      1-D integer view into ``capacity`` slots (``bitmap.pack_bitmap_capped``).
    - ``pack_bits(mask)``, ``unpack_bits(bitmap, numel)``: bool tensor <-> bitmap.
    - ``pack_mask(t, low, high)``: the bitmap of ``low < t < high`` (``high = inf``: no upper
      bound) of a float tensor of any shape, compared in ``t.dtype``;
      ``unpack_mask(bitmap, shape, dtype, inside, outside)``: ``inside`` where a bit is set, else
      ``outside``, rounded to the float ``dtype`` with their signs.
    - ``topk(x, rows, keep)``: ``(bitmap, values)`` at their exact size;
      ``topk_rows(x, keep)``: ``(bitmap, values, counts)`` of a 2-D tensor, ``keep`` slots a row,
      read back by ``unpack_topk_rows(bitmap, values, rows, n, shape=)``.
    - ``quantize(t, rows, n, bits, group, seed)``: ``(codes, lo, scale)``;
      ``dequantize(codes, lo, scale, n, bits, group, dtype, shape)``: the decoded tensor.
    - ``sided_select(q, inside, low, high, inner_low, inner_high, mid)``: the sided decoding.
    - ``minmax(t)``, ``convert(t, dtype)``: integer narrowing of a contiguous tensor.
    """

    name: str
    pack_bitmap: _Op = None
    unpack_bitmap: _Op = None
    unpack_bitmap_capped: _Op = None
    pack_bitmap_capped: _Op = None
    pack_bits: _Op = None
    unpack_bits: _Op = None
    pack_mask: _Op = None
    unpack_mask: _Op = None
    topk: _Op = None
    topk_rows: _Op = None
    unpack_topk_rows: _Op = None
    quantize: _Op = None
    dequantize: _Op = None
    sided_select: _Op = None
    minmax: _Op = None
    convert: _Op = None


TORCH = Kernels("torch ops")
NATIVE = Kernels(
    "C extension", pack_bitmap=_cpu_kernels.pack, unpack_bitmap=_cpu_kernels.unpack,
    pack_bits=_cpu_kernels.bits_pack, unpack_bits=_cpu_kernels.bits_unpack, pack_mask=_cpu_kernels.mask_pack,
    unpack_mask=_cpu_kernels.mask_unpack, topk=_cpu_kernels.topk,
    quantize=_cpu_kernels.quantize, dequantize=_cpu_kernels.dequantize, sided_select=_cpu_kernels.sided_select,
    minmax=_cpu_kernels.minmax, convert=_cpu_kernels.convert,
)
CPU: Kernels = NATIVE if _cpu_kernels.NATIVE else TORCH


@functools.cache
def triton() -> Kernels:
    """The Triton column (imports triton: only on the GPU path or while emulating it)."""
    from . import _triton

    return Kernels(
        "Triton", pack_bitmap=_triton.codec_pack_bitmap, unpack_bitmap=_triton.codec_unpack_bitmap,
        unpack_bitmap_capped=_triton.codec_unpack_bitmap, pack_bitmap_capped=_triton.pack_bitmap_capped,
        pack_mask=_triton.codec_pack_mask, unpack_mask=_triton.codec_unpack_mask,
        topk_rows=_triton.pack_topk_rows, unpack_topk_rows=_triton.unpack_topk_rows,
        quantize=_triton.codec_quantize, dequantize=_triton.codec_dequantize,
    )


def device(t: torch.Tensor) -> Kernels:
    """The entry for a tensor that is not on the CPU: Triton for CUDA when it loads, else torch ops."""
    return _cuda_entry() if t.is_cuda else TORCH


@functools.cache
def _cuda_entry() -> Kernels:
    from . import _cuda

    return TORCH if _cuda._load() is None else triton()
