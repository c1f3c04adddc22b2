"""Argument checks every config and public function shares, so a refusal reads the same everywhere."""

from __future__ import annotations

from collections.abc import Iterable


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
