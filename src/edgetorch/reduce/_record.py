"""Checks on the JSON records ``edgetorch.reduce.load`` rebuilds a network from, and the limits they enforce.

A record may come from anyone, and every number in it sizes something that is built. Before
anything is built, every field is checked here (type, range, accepted words) and the record's
implied parameter count is compared with the weights file's real size; the build itself then runs
on the meta device (no memory) with a cap on the modules it may create, because some constructors
(torchvision's, the zoo's) take arguments whose cost only the constructor knows. Without these, a
ViT ``patch_size`` of 0 raised ``ZeroDivisionError``, a BERT ``hidden_act`` of ``"x"`` a
``KeyError``, and a layer count of 10**6 built layers for minutes before any size was compared.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.modules.module import register_module_module_registration_hook

from ..zoo import CheckpointError

MAX_RECORD_BYTES = 4 << 20  # a chain of MAX_MODULES convolutions is 1.3 MB of JSON, a resnet18 record 4.5 KB
MAX_WEIGHT_BYTES = 8 << 30  # the largest torchvision classifier (vit_h_14) has 2.5 GB of float32 weights
MAX_WIDTH = 1 << 24  # any width, channel count, vocabulary or image size (BERT vocabularies reach 250k)
MAX_MODULES = 4096  # modules one record may build (efficientnet_v2_l, torchvision's largest, registers 1408)
MAX_LAYERS = 128  # transformer layers (BERT-large has 24, ViT-H 32); a BERT layer registers 18 modules
_SHOWN = 80  # characters of a refused value quoted in a message (a value may be megabytes long)


def shown(value: Any) -> str:
    """``repr(value)``, cut short: a message quotes what was refused, not a whole file."""
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


@dataclass(frozen=True)
class Field:
    """What one field accepts: ``accepted`` says it in words, ``test`` decides, ``convert`` makes the
    value the constructor takes (a JSON list into a tuple, an int into a float)."""

    accepted: str
    test: Callable[[Any], bool]
    convert: Callable[[Any], Any] = lambda value: value

    def __call__(self, value: Any, where: str) -> Any:
        if not self.test(value):
            raise CheckpointError(f"{where} must be {self.accepted}, got {shown(value)}")
        return self.convert(value)


def integer(low: int = 1, high: int = MAX_WIDTH) -> Field:
    """An integer in ``low..high`` (``true`` is not one)."""
    return Field(f"an integer from {low} to {high}", lambda v: type(v) is int and low <= v <= high)


def number(low: float = -MAX_WIDTH, high: float = MAX_WIDTH, *, above: bool = False) -> Field:
    """A finite number in ``[low, high]`` (``(low, high]`` with ``above``), as a float. JSON's
    ``1e400`` parses as infinity, so finiteness is checked here."""
    def test(v: Any) -> bool:
        return (type(v) in (int, float) and math.isfinite(v) and (v > low if above else v >= low) and v <= high)
    return Field(f"a number > {low} and <= {high}" if above else f"a number from {low} to {high}", test, float)


def word(*accepted: str) -> Field:
    """One of the ``accepted`` strings (tested as a string first: a list or dict is not hashable)."""
    return Field(f"one of {', '.join(map(repr, accepted))}", lambda v: isinstance(v, str) and v in accepted)


def optional(field: Field) -> Field:
    """``null`` or what ``field`` accepts."""
    return Field(f"null or {field.accepted}", lambda v: v is None or field.test(v),
                 lambda v: None if v is None else field.convert(v))


def pair(field: Field) -> Field:
    """A list of two values ``field`` accepts, as a tuple."""
    return Field(f"a list of two of: {field.accepted}",
                 lambda v: isinstance(v, list) and len(v) == 2 and all(field.test(x) for x in v),
                 lambda v: tuple(field.convert(x) for x in v))


def one_or_pair(field: Field) -> Field:
    """One value ``field`` accepts, or a list of two (torch's ``int | tuple[int, int]`` arguments)."""
    two = pair(field)
    return Field(f"{field.accepted}, or a list of two", lambda v: field.test(v) or two.test(v),
                 lambda v: two.convert(v) if isinstance(v, list) else field.convert(v))


def listing(field: Field, most: int) -> Field:
    """A list of at most ``most`` values ``field`` accepts."""
    return Field(f"a list of at most {most} of: {field.accepted}",
                 lambda v: isinstance(v, list) and len(v) <= most and all(field.test(x) for x in v),
                 lambda v: [field.convert(x) for x in v])


FLAG = Field("true or false", lambda v: isinstance(v, bool))
TEXT = Field("a string of at most 256 characters", lambda v: isinstance(v, str) and len(v) <= 256)
NESTED = Field("a JSON value", lambda v: True)  # a field whose parts are checked on their own


def fields(entry: Any, where: str, required: dict[str, Field], optional_fields: dict[str, Field] | None = None,
           ) -> dict[str, Any]:
    """Check a JSON object's fields: every required one present, none unknown, each accepted.

    Args:
        entry: the parsed JSON value (anything: it came from a file).
        where: names the object in errors ("module 3 (Linear)").
        required: the fields it must have.
        optional_fields: the fields it may have.

    Returns:
        The converted values by field name (only the fields present).

    Raises:
        CheckpointError: not an object, a missing or unknown field, or a refused value.
    """
    optional_fields = optional_fields or {}
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where} must be a JSON object, got {shown(entry)}")
    known = {**required, **optional_fields}
    missing = [key for key in required if key not in entry]
    unknown = [key for key in entry if key not in known]
    if missing or unknown:
        wrong = "; ".join(f"{what} {', '.join(map(shown, keys[:5]))}{f' (+{len(keys) - 5} more)' * (len(keys) > 5)}"
                          for what, keys in (("missing", missing), ("unknown", unknown)) if keys)
        takes = " and ".join(part for part in (", ".join(required), ", ".join(optional_fields) and
                                               f"optionally {', '.join(optional_fields)}") if part)
        raise CheckpointError(f"{where}: {wrong} field; it takes {takes or 'no fields'}")
    return {key: known[key](value, f"{where}: {key}") for key, value in entry.items()}


def mapping(value: Any, where: str, what: str, most: int) -> dict[str, Any]:
    """A JSON object of at most ``most`` entries; ``what`` says what it maps, for the message."""
    if not isinstance(value, dict) or len(value) > most:
        raise CheckpointError(f"{where} must map {what} (a JSON object of at most {most} entries), got {shown(value)}")
    return value


def check_fits(parameters: int, have: int, weights: Any) -> None:
    """Refuse a record whose weights cannot be in a file of ``have`` bytes, before anything is built.

    Args:
        parameters: the fewest weights (elements) the record's network has, counted from its fields.
        have: the weights file's size in bytes.
        weights: the weights file, for the message.
    """
    need = parameters * torch.empty((), dtype=torch.get_default_dtype()).element_size()
    if need > have:
        raise CheckpointError(f"the record's network has at least {parameters:,} weights ({need:,} bytes) but "
                              f"{weights} holds {have:,} bytes: the two files do not belong together "
                              "(save writes both)")


@contextmanager
def meta_build(most_modules: int = MAX_MODULES) -> Iterator[None]:
    """Build on the meta device (no memory), refusing once more than ``most_modules`` modules are made.

    The count covers constructors the record only names (``torchvision:NAME`` with keyword
    arguments, ``zoo:cnn`` with ``blocks_per_stage``): their cost is not known until they run, and
    10**6 blocks took minutes even on the meta device. Modules registered by other threads are not
    counted (the hook is process-wide).
    """
    thread, count = threading.get_ident(), 0

    def counted(parent: torch.nn.Module, name: str, module: Any) -> None:
        nonlocal count
        if threading.get_ident() == thread:
            count += 1
            if count > most_modules:
                raise CheckpointError(f"the record's network has more than {most_modules} modules, the most "
                                      "a reduced-network record may build")

    handle = register_module_module_registration_hook(counted)
    try:
        with torch.device("meta"):
            yield
    finally:
        handle.remove()
