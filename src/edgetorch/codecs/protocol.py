"""What every stored form of a tensor answers: the codecs' protocol.

Each ``pack_*`` function returns a *held form* (:class:`~.bitmap.BitmapTensor`,
:class:`~.quantized.QuantizedTensor`, :class:`~.mask.MaskTensor`, ...). The activations engine
stores one per saved tensor and asks it only what :class:`HeldTensor` declares, so a new codec
is one more class that answers the same. Forms are told apart by their class (``isinstance``),
never by probing their attributes; the one optional member, ``lazy_nnz`` (see
:class:`HeldTensor`), is looked up on the form's class (no property runs where it is absent,
and a new form that counts on the host has nothing to declare).

The forms answer the protocol structurally and do not inherit from it: a subclass of a
``Protocol`` gets its metaclass, whose ``isinstance`` is Python code (2.5 us a check, against
0.1 us), and the engine tells forms apart per saved tensor.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class HeldTensor(Protocol):
    """A tensor held by a codec.

    Attributes:
        nbytes: exact bytes of tensor memory the form holds (what the ledger counts).
        nnz: values kept (every element for dense and quantized forms, none for a mask). Forms
            that count on the device (their values sit in fixed slots: ``CappedBitmapTensor``,
            ``TopkRowsTensor``) read it back with a host sync.
        lazy_nnz: optional, not declared here: the count as the device tensor it is, without the
            sync. The slotted forms above answer it, and so do forms that carry one of them
            (``QuantizedValues``, a caller's wrappers), passing on their inner form's. A caller
            counts a form without it by ``nnz``, looking the member up on the form's class.
    """

    @property
    def nbytes(self) -> int: ...

    @property
    def nnz(self) -> int: ...

    def unpack(self) -> torch.Tensor:
        """A new dense tensor of the original shape and dtype (the form is left intact)."""
        ...


class HeldShape:
    """Base of the forms that record the original tensor's ``shape``: its element count."""

    shape: torch.Size

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class HeldValues(HeldShape):
    """Base of the forms that keep a tensor of ``shape``'s elements, or some of them, in ``values``."""

    values: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def value_bytes(self) -> int:
        """Bytes of ``values`` (every slot, used or not)."""
        return self.values.numel() * self.values.element_size()
