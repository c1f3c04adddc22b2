"""Top-k storage of one tensor: per row, only the largest magnitudes survive (Back Razor, Sec. 3.2).

Jiang et al. (NeurIPS'22) prune each sample to a fixed sparsity with a per-sample threshold and
store the result as bitmap + values, ``n / 8 + kept * value_bytes`` bytes. Two corners of the
published code are handled differently here:

* A row with more exact zeros than the requested sparsity keeps its non-zeros only: zeros are
  never stored as values (thresholding with ``kthvalue`` over all values gives threshold 0 there
  and stores every zero). The effective sparsity is max(natural, requested).
* Ties at the threshold are broken by position, so every row keeps exactly its quota of values
  (or all of its non-zeros, if fewer). NaN counts as the largest magnitude.

The threshold is a selection, not a sort, so its cost is linear in the row length. On CPU the C
extension does the whole pack: a radix select on the magnitude bits of each row (rows in
parallel), then the bitmap and the values written directly, at their exact size. On CUDA, Triton
kernels do the same with no host sync (:class:`TopkRowsTensor`). Elsewhere, or without either,
torch ops do the same with ``kthvalue`` on the magnitude bits; all three keep the same elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _backend, _cpu_kernels, _cuda
from .bitmap import _ABS_MASK, _INT_VIEW, FLOAT_DTYPES, BitmapTensor, pack_bits
from .protocol import HeldValues


def kept_per_row(row_numel: int, sparsity: float) -> int:
    """How many values a row of ``row_numel`` elements keeps at ``sparsity``: ``n - round(s * n)``."""
    return row_numel - round(sparsity * row_numel)


def pack_topk(
    t: torch.Tensor,
    sparsity: float,
    *,
    rows: int | None = None,
    value_dtype: torch.dtype | None = None,
) -> BitmapTensor:
    """Keep the largest-magnitude values of each row of ``t``; drop (read back as 0) the rest.

    Args:
        t: a floating-point tensor (float16, bfloat16, float32, float64), on any device.
        sparsity: fraction of each row's values to drop, in [0, 1).
        rows: split ``t`` (row-major) into this many equal rows, one threshold each. Default
            ``t.shape[0]``: one per sample for a batch-first tensor (the paper's choice).
        value_dtype: store the kept values in this float dtype (e.g. ``torch.float16``);
            ``None`` keeps ``t.dtype``.

    Returns:
        A :class:`BitmapTensor` of ``t``'s shape; each row holds exactly
        ``min(kept_per_row(n, sparsity), non-zeros of the row)`` values. On CUDA with Triton, a
        :class:`TopkRowsTensor` instead: the same bitmap, each row's values in a fixed-width
        slot, so that packing never waits for the host.

    Example:
        >>> x = torch.randn(8, 64, 14, 14)
        >>> p = pack_topk(x, 0.9)
        >>> p.nnz == 8 * kept_per_row(64 * 14 * 14, 0.9)
        True
    """
    if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"pack_topk stores floating-point tensors; got {getattr(t, 'dtype', type(t))}")
    check_sparsity(sparsity)
    if value_dtype is not None and value_dtype not in FLOAT_DTYPES:
        raise TypeError(f"value_dtype must be a float dtype or None; got {value_dtype}")
    rows = (t.shape[0] if t.dim() else 1) if rows is None else rows
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1 or t.numel() % rows:
        raise ValueError(f"rows must be a positive int dividing numel={t.numel()}; got {rows!r}")
    keep = kept_per_row(t.numel() // rows, sparsity)
    kernels = _backend.CPU if t.is_cpu else _backend.device(t)
    if kernels.topk_rows is not None:
        bitmap, values, counts = kernels.topk_rows(_cuda.untracked(t).reshape(rows, -1).contiguous(), keep)
        if value_dtype is not None and value_dtype != t.dtype:
            values = values.to(value_dtype)
        return TopkRowsTensor(bitmap, values, counts, t.shape, t.dtype)
    if kernels.topk is not None:
        bitmap, values = kernels.topk(t, rows, keep)
    else:
        x = t.detach().reshape(rows, -1)
        if t.is_cpu:
            _cpu_kernels.warn_fallback()
        mask = _topk_mask(x, keep)
        bitmap, values = pack_bits(mask), x[mask]
    if value_dtype is not None and value_dtype != t.dtype:
        values = values.to(value_dtype)
    return BitmapTensor(bitmap=bitmap, values=values, shape=t.shape, dtype=t.dtype)


@dataclass(frozen=True, eq=False)
class TopkRowsTensor(HeldValues):
    """Per-row top-k held without a host sync (the CUDA path of :func:`pack_topk`).

    Every row keeps at most ``keep`` values, a number known before the kernel runs; so row r's
    kept values sit at the start of ``values[r]`` (``counts[r]`` of them, zeros after) and no
    size has to be read back to allocate them. The bitmap is byte-identical to the CPU codec's.

    Attributes:
        bitmap: ``uint8``, bit ``i % 8`` of byte ``i // 8`` set where element ``i`` is kept.
        values: ``[rows, width]`` kept values in the value dtype, row-major within each row.
        counts: ``int64 [rows]`` values used in each row.
        shape, dtype: the original tensor's.
    """

    bitmap: torch.Tensor
    values: torch.Tensor
    counts: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nnz(self) -> int:
        """Values kept (a host sync: read it for reports, not on the training path)."""
        return int(self.counts.sum())

    @property
    def lazy_nnz(self) -> torch.Tensor:
        """The per-row kept counts as the device tensor they are (no sync): what a ledger records."""
        return self.counts

    @property
    def nbytes(self) -> int:
        """Bytes held: bitmap, every value slot (padding included) and the row counts."""
        return self.bitmap.numel() + self.value_bytes + self.counts.numel() * self.counts.element_size()

    def unpack(self) -> torch.Tensor:
        """The dense tensor: kept values in place, zeros elsewhere (a new tensor). No host sync."""
        values = self.values if self.values.dtype == self.dtype else self.values.to(self.dtype)
        rows = self.values.shape[0]
        kernels = _backend.CPU if values.is_cpu else _backend.device(values)
        return kernels.unpack_topk_rows(self.bitmap, values, rows, self.numel // max(rows, 1), shape=self.shape)


def check_sparsity(sparsity: float) -> None:
    """Raise unless ``sparsity`` is a number in [0, 1)."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
        raise ValueError(
            f"sparsity must be a number in [0, 1) (the fraction of each sample's values dropped, "
            f"e.g. 0.9); got {sparsity!r}"
        )



def _topk_mask(x: torch.Tensor, keep: int) -> torch.Tensor:
    """Bool mask of each row's ``keep`` largest non-zero magnitudes (ties broken by position).

    The torch-ops path on any device (no C extension, no Triton) and the reference the kernels
    are tested against. It decides on magnitude bits, as the kernels do: the bits of ``|v|``
    order like ``|v|`` with NaN above Inf, so NaN is simply the largest magnitude and a row keeps
    exactly ``min(keep, non-zeros)`` values even when it holds more NaNs than ``keep``.
    """
    n = x.shape[1]
    a = x.view(_INT_VIEW[x.dtype]) & _ABS_MASK[_INT_VIEW[x.dtype]]
    if keep >= n or n == 0:
        return a != 0
    if keep == 0:
        return torch.zeros_like(a, dtype=torch.bool)
    thr = a.kthvalue(n - keep, dim=1, keepdim=True).values
    mask = a > thr
    short = (keep - mask.sum(1)) * (thr.squeeze(1) > 0)
    for r in short.nonzero().flatten().tolist():
        tied = (a[r] == thr[r]).nonzero().flatten()[: int(short[r])]
        mask[r, tied] = True
    return mask
