"""`make demo`: one short section per feature, run in order.

``python -m edgetorch.demo`` runs every section; ``python -m edgetorch.demo bittrain`` runs one.
Each section module exposes ``run(console)`` and raises ``SystemExit`` if what it shows is wrong.
"""

from __future__ import annotations

import importlib
import sys

from rich.console import Console

SECTIONS = ("bittrain", "backrazor", "reduce", "split")


def main(argv: list[str] | None = None) -> None:
    names = list(argv if argv is not None else sys.argv[1:]) or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown demo section(s) {unknown}; choose from {list(SECTIONS)}")
    console = Console(width=110)
    for name in names:
        importlib.import_module(f"{__name__}.{name}").run(console)
