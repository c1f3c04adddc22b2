"""Argument checks every config and public function shares, so a refusal reads the same everywhere."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping


def check_choice(name: str, value: object, accepted: Iterable[str]) -> None:
    """Raise ``ValueError`` naming ``value`` and the accepted words unless ``value`` is one of them.

    Example:
        >>> check_choice("method", "svd", ("prune", "lowrank"))
        Traceback (most recent call last):
        ValueError: unknown method 'svd'; accepted: prune, lowrank
    """
    accepted = tuple(accepted)
    if value not in accepted:
        raise ValueError(f"unknown {name} {value!r}; accepted: {', '.join(accepted)}")


def check_positive_int(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 1 (``True`` is not a count).

    Example:
        >>> check_positive_int("epochs", 0)
        Traceback (most recent call last):
        ValueError: epochs must be a positive int, got 0
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_device(device: str) -> str:
    """Return ``device`` if it is ``cpu``, ``cuda`` or ``cuda:N`` and this machine has it, else raise ``ValueError``.

    The words are the devices a run seeds and measures (a memory peak, the RNG of one GPU); other
    torch devices are refused by name rather than failing later, inside a step. torch is imported
    only when CUDA is asked for, so that the CLI's ``--device cpu`` starts without it.

    Args:
        device: the device string a caller gave.

    Returns:
        ``device`` unchanged.

    Raises:
        ValueError: not one of the accepted words, CUDA asked for where there is none, or a CUDA
            index this machine does not have.

    Example:
        >>> check_device("tpu")
        Traceback (most recent call last):
        ValueError: 'tpu' is not a device; accepted: cpu, cuda, cuda:N
    """
    if not (isinstance(device, str) and re.fullmatch(r"cpu|cuda(:[0-9]+)?", device)):
        raise ValueError(f"{device!r} is not a device; accepted: cpu, cuda, cuda:N")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            build = f"for CUDA {torch.version.cuda}" if torch.version.cuda else "without CUDA"
            raise ValueError(f"{device} asked for, but no CUDA device is available here (torch {torch.__version__}, "
                             f"built {build}); accepted: cpu")
        count = torch.cuda.device_count()
        if ":" in device and int(device.split(":")[1]) >= count:
            raise ValueError(f"{device}: this machine has {count} CUDA device(s); accepted: cuda, "
                             f"cuda:0 to cuda:{count - 1}")
    return device


def check_json_fields(cls: type, values: Mapping[str, object], what: str) -> None:
    """Raise ``ValueError`` unless each of ``values`` has the type its field of dataclass ``cls`` is annotated with.

    For data parsed from a JSON file someone else wrote: a dataclass stores whatever it is given, so
    a string where a float belongs failed later, deep inside a computation, as a traceback. Types
    are read as JSON gives them: a float field takes an int, never a bool, and only finite values;
    an int-keyed dict takes the string keys JSON writes; a nested dataclass is its object form.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Profile:
        ...     seconds: float
        >>> check_json_fields(Profile, {"seconds": "fast"}, "device profile")
        Traceback (most recent call last):
        ValueError: device profile: seconds must be a finite number, got 'fast'
    """
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if name in hints and not _has_type(value, hints[name]):
            raise ValueError(f"{what}: {name} must be {_describe(hints[name])}, got {value!r}"[:300])


def _describe(kind: object) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(sorted((_describe(a) for a in args), key=lambda d: d != "null"))
    if origin is dict:
        return f"an object of {_describe(args[1])} values"
    if origin in (list, tuple):
        return f"a list of {_describe(args[0])} items" if args else "a list"
    if dataclasses.is_dataclass(kind):
        return f"an object with the keys {[f.name for f in dataclasses.fields(kind)]}"
    words = {type(None): "null", bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}
    return words.get(kind, getattr(kind, "__name__", str(kind)))


def _has_type(value: object, kind: object) -> bool:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, arg) for arg in args)
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is str:
        return isinstance(value, str)
    if origin is dict:
        key, item = args
        return isinstance(value, dict) and all(
            _has_type(k, str) if key is str else _int_key(k) for k in value) and all(_has_type(v, item) for v in value.values())
    if origin in (list, tuple):
        item = args[0] if args else object
        return isinstance(value, list) and all(_has_type(v, item) for v in value)
    if dataclasses.is_dataclass(kind):
        names = {f.name for f in dataclasses.fields(kind)}
        if isinstance(value, kind):
            return True
        if not isinstance(value, dict) or not set(value) <= names:
            return False
        try:
            check_json_fields(kind, value, kind.__name__)
        except ValueError:
            return False
        return True
    return kind is object


def _int_key(key: object) -> bool:
    return isinstance(key, int) and not isinstance(key, bool) or isinstance(key, str) and key.lstrip("-").isdigit() and len(key) < 20
