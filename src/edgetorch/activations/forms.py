"""Stored forms: what a policy keeps of one saved tensor, as typed, interned values.

A form is one of :class:`FormKind` plus its parameters (a mask's interval, a quantized form's
bits and, for a sided copy, the kinks it keeps exact). Forms are interned: each distinct form is
one object, made once, so the engine compares and hashes them by identity on every saved tensor
(as cheaply as the strings they replace) and never parses text to learn what a form is. ``text``
is the form's name in the ledger and in every report (``exact``, ``prune``, ``mask(0,inf)``,
``int8``, ``int8-sided(-3,3)``, ``shape``).
"""

from __future__ import annotations

import enum


class FormKind(enum.Enum):
    """What a stored form keeps of a tensor."""

    EXACT = "exact"  # every value, losslessly
    PRUNE = "prune"  # each sample's top-k magnitudes (Back Razor)
    MASK = "mask"  # whether each value lies in an interval: one bit per value
    QUANTIZED = "quantized"  # every value at a few bits (optionally with its piece kept exact)
    SHAPE = "shape"  # nothing but the shape


class Form:
    """One stored form (make them with the constants and functions of this module, not directly).

    Attributes:
        kind: the :class:`FormKind`.
        bits: a quantized form's bits (None otherwise).
        interval: a mask's ``(low, high)``, or a sided quantized form's kinks (None otherwise).
        text: the form's name in ledgers and reports.
    """

    __slots__ = ("kind", "bits", "interval", "text")

    def __init__(self, kind: FormKind, bits: int | None, interval: tuple[float, float] | None, text: str):
        self.kind, self.bits, self.interval, self.text = kind, bits, interval, text

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__


EXACT_FORM = Form(FormKind.EXACT, None, None, "exact")
PRUNE_FORM = Form(FormKind.PRUNE, None, None, "prune")
SHAPE_FORM = Form(FormKind.SHAPE, None, None, "shape")
_INTERNED: dict[tuple, Form] = {}


def mask_form(low: float, high: float) -> Form:
    """The 1-bit mask of ``(low, high)``."""
    form = _INTERNED.get(("mask", low, high))
    if form is None:
        form = _INTERNED[("mask", low, high)] = Form(FormKind.MASK, None, (low, high), f"mask({low:g},{high:g})")
    return form


def quantized_form(bits: int, kinks: tuple[float, float] | None = None) -> Form:
    """``bits``-bit codes; with ``kinks``, a copy that also keeps which piece of a kinked
    function each value was on (:func:`~edgetorch.codecs.pack_quantized_sided`): another form,
    so it never serves an op that reads the values."""
    form = _INTERNED.get(("quantized", bits, kinks))
    if form is None:
        text = f"int{bits}" if kinks is None else f"int{bits}-sided({kinks[0]:g},{kinks[1]:g})"
        form = _INTERNED[("quantized", bits, kinks)] = Form(FormKind.QUANTIZED, bits, kinks, text)
    return form
