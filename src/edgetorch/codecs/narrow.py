"""Integer narrowing: a wide integer tensor held in the smallest integer dtype that holds its range.

Autograd saves integer tensors too, and in CNNs they are large: max pooling keeps the position of
every maximum as ``int64`` (8 bytes per output element, twice a float32 activation). The values
are positions inside one feature plane, so they almost always fit ``int16`` or ``int32``. Storing
them narrowed is lossless; the only cost is one min/max pass and a dtype conversion each way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _backend, _cpu_kernels
from .protocol import HeldValues

WIDE_INTS = (torch.int16, torch.int32, torch.int64)
_NARROWER = (torch.int8, torch.int16, torch.int32)


@dataclass(frozen=True, eq=False)
class NarrowIntTensor(HeldValues):
    """An integer tensor held in a narrower integer dtype.

    Attributes:
        values: the elements (same shape as the original) in the narrow dtype.
        dtype: the original dtype, which :meth:`unpack` returns.
    """

    values: torch.Tensor
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Exact bytes held: ``numel * narrow itemsize``."""
        return self.value_bytes

    @property
    def nnz(self) -> int:
        """Every element is stored."""
        return self.values.numel()

    @property
    def shape(self) -> torch.Size:
        """The original shape: every element is held, in place."""
        return self.values.shape

    def unpack(self) -> torch.Tensor:
        """The original tensor (a new, contiguous tensor of the original dtype)."""
        if self.values.is_cpu and (convert := _backend.CPU.convert) is not None and self.values.is_contiguous():
            return convert(self.values, self.dtype)
        return self.values.to(self.dtype)


def pack_narrow(t: torch.Tensor, bound: int | None = None) -> NarrowIntTensor | None:
    """Hold ``t`` in the smallest of int8 / int16 / int32 that contains all its values.

    Args:
        t: an ``int16``, ``int32`` or ``int64`` tensor, any shape and device.
        bound: when every value is known to lie in ``[0, bound]`` (max pooling's indices lie
            within one input plane), the dtype is chosen from it without reading the values'
            range back: no host sync on a GPU. A wrong bound corrupts the values; leave it None
            unless it holds by construction.

    Returns:
        The narrowed tensor, or None when no dtype narrower than ``t.dtype`` holds its range (or
        ``t`` is empty): keep ``t`` as it is then.

    Raises:
        TypeError: ``t`` is not one of the accepted integer dtypes.

    Example:
        >>> _, idx = torch.nn.functional.max_pool2d(torch.randn(1, 8, 64, 64), 2, return_indices=True)
        >>> pack_narrow(idx).values.dtype   # positions in a 64x64 plane fit int16
        torch.int16
    """
    if not isinstance(t, torch.Tensor) or t.dtype not in WIDE_INTS:
        raise TypeError(f"pack_narrow stores int16, int32 or int64 tensors; got {getattr(t, 'dtype', type(t))}")
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
        raise TypeError(f"bound must be an int >= 0 (values lie in [0, bound]) or None; got {bound!r}")
    if bound is not None and bound < 0:
        raise ValueError(f"bound must be an int >= 0 (values lie in [0, bound]) or None; got {bound!r}")
    if t.numel() == 0:
        return None
    kernels = _backend.CPU if t.is_cpu and t.is_contiguous() else _backend.TORCH  # no GPU kernels
    if bound is not None:
        low, high = 0, bound
    elif kernels.minmax is not None:  # min and max in one pass
        low, high = kernels.minmax(t)
    else:
        if t.is_cpu:
            _cpu_kernels.warn_fallback()
        low, high = torch.stack(torch.aminmax(t)).tolist()  # one device sync, not two
    for dtype in _NARROWER:
        if dtype.itemsize >= t.dtype.itemsize:
            return None
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return NarrowIntTensor(t.to(dtype) if kernels.convert is None else kernels.convert(t, dtype), t.dtype)
    return None
