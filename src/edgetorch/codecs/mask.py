"""One bit per element: where a value lies strictly inside an interval, which is all that the
backward of ReLU, ReLU6/hardtanh and leaky ReLU reads from its saved tensor.

ReLU's backward passes the gradient where its output is > 0; hardtanh's where its input lies in
(min, max); leaky ReLU's scales it by 1 or the slope on the sign of its input. Storing that
predicate as a bitmap (``n / 8`` bytes) and reading back a stand-in value on each side gives the
exact same gradient (Back Razor keeps ReLU6 this way; Jiang et al., NeurIPS'22, Sec. 4.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _backend, _cpu_kernels
from .bitmap import FLOAT_DTYPES, pack_bits, unpack_bits
from .protocol import HeldShape


@dataclass(frozen=True, eq=False)
class MaskTensor(HeldShape):
    """Which elements lay inside an open interval, read back as ``inside`` / ``outside`` values.

    Attributes:
        bitmap: ``uint8``, bit ``i % 8`` of byte ``i // 8`` set when element ``i`` was inside.
        shape: logical shape of the original tensor.
        dtype: dtype that :meth:`unpack` returns.
        inside: value read back where the bit is set.
        outside: value read back elsewhere.
    """

    bitmap: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    inside: float
    outside: float

    @property
    def nnz(self) -> int:
        """Stored values: none, only bits."""
        return 0

    @property
    def nbytes(self) -> int:
        """Exact bytes held: the bitmap."""
        return self.bitmap.numel()

    def unpack(self) -> torch.Tensor:
        """A new tensor of ``shape`` and ``dtype``: ``inside`` where the bit is set, else ``outside``,
        each rounded to ``dtype`` with its sign (``outside=-0.0`` reads back as -0.0 on every backend)."""
        kernels = _backend.CPU if self.bitmap.is_cpu else _backend.device(self.bitmap)
        # The kernels write float bit patterns; a hand-built form of another dtype takes torch ops.
        if (kernel := kernels.unpack_mask) is not None and self.dtype in FLOAT_DTYPES:
            return kernel(self.bitmap, self.shape, self.dtype, self.inside, self.outside)
        inside = unpack_bits(self.bitmap, self.numel).view(self.shape)
        # The ReLU mask in one pass; -0.0 == 0.0, so the sign is asked too (the cast writes +0.0).
        if self.inside == 1.0 and self.outside == 0.0 and math.copysign(1.0, self.outside) > 0:
            return inside.to(self.dtype)
        values = torch.tensor([self.inside, self.outside], dtype=self.dtype, device=self.bitmap.device)
        return torch.where(inside, values[0], values[1])


def pack_mask(
    t: torch.Tensor, low: float, high: float = math.inf, *, inside: float = 1.0, outside: float | None = None
) -> MaskTensor:
    """Store only whether each element of ``t`` lies in the open interval ``(low, high)``.

    Args:
        t: a floating-point tensor.
        low: lower bound (exclusive).
        high: upper bound (exclusive); ``inf`` for "greater than ``low``".
        inside: value :meth:`MaskTensor.unpack` writes where ``low < v < high``; must itself
            lie in the interval, so the predicate survives a second pack.
        outside: value written elsewhere (default ``low``, which is outside the interval).

    Returns:
        A :class:`MaskTensor` of ``t.numel() / 8`` bytes.

    Example:
        >>> y = torch.relu(torch.randn(4, 8))
        >>> m = pack_mask(y, 0.0)          # ReLU backward reads y > 0 only
        >>> torch.equal(m.unpack() > 0, y > 0)
        True
    """
    if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"pack_mask stores floating-point tensors; got {getattr(t, 'dtype', type(t))}")
    outside = low if outside is None else outside
    if not low < inside < high or low < outside < high:
        raise ValueError(
            f"inside={inside} must lie in ({low}, {high}) and outside={outside} must not"
        )
    return mask_checked(t, low, high, float(inside), float(outside))


def mask_checked(t: torch.Tensor, low: float, high: float, inside: float, outside: float) -> MaskTensor:
    """:func:`pack_mask` of a float tensor and an interval it has checked (``inside`` and
    ``outside`` floats): the policies' call, with the intervals of the ops they know (a saved
    tensor's checks cost microseconds)."""
    if (kernel := (_backend.CPU if t.is_cpu else _backend.device(t)).pack_mask) is not None:
        bitmap = kernel(t, low, high)  # the predicate straight into bits, in one pass
    else:
        if t.is_cpu:
            _cpu_kernels.warn_fallback()
        d = t.detach()
        bitmap = pack_bits(d > low if math.isinf(high) else (d > low) & (d < high))
    return MaskTensor(bitmap, t.shape, t.dtype, inside, outside)
