"""The root ``edgetorch`` Typer app and the console every command prints to."""

from __future__ import annotations

import typer
from rich.console import Console

app = typer.Typer(help="edgetorch: memory-efficient training and deployment on edge devices.",
                  no_args_is_help=True, add_completion=False)
console = Console(width=130)


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        console.print(f"edgetorch {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="print the version and exit"),
) -> None:
    """edgetorch command line."""


def mib(n: int | None) -> str:
    """Bytes as MiB with one decimal, '-' for unknown."""
    return "-" if n is None else f"{n / 2**20:,.1f}"
