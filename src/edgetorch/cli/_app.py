"""The root ``edgetorch`` Typer app and the console every command prints to."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
import typer
import typer.core
import typer.rich_utils
from rich.console import Console

from .._checks import check_device
from .._extras import EXTRAS, install_hint

# Piped or captured help (a pager, a file, CI logs) would be laid out at rich's 80 columns, which
# truncates long option help with an ellipsis; a terminal keeps its own width.
if typer.rich_utils.MAX_WIDTH is None and not sys.stdout.isatty() and "COLUMNS" not in os.environ:
    typer.rich_utils.MAX_WIDTH = 120

#: Option spellings of edgetorch 0.1 that became one vocabulary across the commands, old -> new.
#: The old ones still work, with a warning, until 0.3; help shows only the new ones.
RENAMED_OPTIONS = {"--batch": "--batch-size", "--resolution": "--size", "--dataset": "--data",
                   "--output": "--out", "--limit": "--train-limit"}


class _FlagHelp:
    """Shows ``--help`` as the flag it is: Typer gives its own help option no metavar, so help
    listed it as ``--help <bool>`` (edgetorch's boolean flags say ``metavar=""`` themselves)."""

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.metavar = ""
        return option


class Command(_FlagHelp, typer.core.TyperCommand):
    """Every edgetorch command (see :class:`App`)."""


class Group(_FlagHelp, typer.core.TyperGroup):
    """A group of edgetorch commands, such as ``edgetorch split``."""


class App(typer.Typer):
    """A Typer app whose commands are :class:`Command` unless they name another class."""

    def command(self, *args: object, cls: type[typer.core.TyperCommand] | None = None, **kwargs: object):
        return super().command(*args, cls=cls or Command, **kwargs)


class _Commands(Group):
    """The root group: before any command parses its options, an old spelling becomes the new one
    (``--batch 8`` and ``--batch=8`` alike; nothing after a bare ``--``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)
        renamed = []
        for i, arg in enumerate(args[:end]):
            name, equals, value = arg.partition("=")
            if name in RENAMED_OPTIONS:
                args[i] = RENAMED_OPTIONS[name] + equals + value
                renamed.append(name)
        for name in dict.fromkeys(renamed):
            click.echo(f"warning: {name} is now {RENAMED_OPTIONS[name]} (the old spelling works until edgetorch 0.3)",
                       err=True)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> object:
        # An optional package a command needs and the install left out: say which extra brings it.
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] not in EXTRAS:
                raise
            console.print(install_hint(err), style="red")
            raise typer.Exit(1) from None


app = App(cls=_Commands, help="edgetorch: memory-efficient training and deployment on edge devices.",
                  no_args_is_help=True, add_completion=False)
class _Terminal(Console):
    """A console that prints text from files as text.

    What commands print holds file names, class names and error messages taken from files. As
    rich markup a class name "[/bold]" crashed `split infer` (so markup is off: style goes in
    ``style=``), and rich passes escape sequences through, so an ANSI escape in a name reached
    the terminal raw: control characters other than newline and tab are printed escaped.
    """

    def print(self, *objects: object, **kwargs: object) -> None:  # type: ignore[override]
        super().print(*(_visible(o) if isinstance(o, str) else o for o in objects), **kwargs)


def _visible(text: str) -> str:
    import unicodedata

    return "".join(c if c in "\n\t" or unicodedata.category(c) not in ("Cc", "Cf") else ascii(c)[1:-1]
                   for c in text)


# A terminal's own width; piped or captured output (CI logs, files) at 130 columns, not rich's 80.
console = _Terminal(width=None if sys.stdout.isatty() else 130, markup=False, emoji=False)


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        console.print(f"edgetorch {__version__}")
        raise typer.Exit()


def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   line: str | None = None) -> str:
    """The commands' ``warnings.formatwarning``: ``warning: <message>`` on one line, without
    Python's file name and source line (a user of the command has no use for them). Formatting,
    not showing, is replaced: ``warnings.catch_warnings(record=True)`` (``pytest.warns``) still
    records what a command warns. Control characters are shown escaped, as the console shows them:
    a warning may quote a file name."""
    return f"warning: {_visible(str(message))}\n"


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", metavar="", is_eager=True, callback=_print_version,
                                 help="print the version and exit"),
) -> None:
    """edgetorch command line."""
    import warnings

    warnings.formatwarning = format_warning


def output_file(path: Path | None) -> Path | None:
    """Typer callback for an option naming a file to write: refuse at the start what would
    otherwise fail after the whole run (a missing directory, a directory given as the file)."""
    if path is None:
        return None
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a directory; give a file path")
    if not path.parent.is_dir():
        raise typer.BadParameter(f"directory {path.parent} does not exist; create it first")
    return path


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def plot_file(path: Path | None) -> Path | None:
    """Typer callback for ``--plot``: a writable file (see :func:`output_file`) matplotlib can save by suffix."""
    path = output_file(path)
    if path is not None and path.suffix.lower() not in PLOT_SUFFIXES:
        raise typer.BadParameter(f"{path}: give a {', '.join(PLOT_SUFFIXES)} file")
    import importlib.util

    if path is not None and importlib.util.find_spec("matplotlib") is None:  # said now, not after the run
        raise typer.BadParameter(install_hint(ModuleNotFoundError(name="matplotlib")))
    return path


def output_dir(path: Path | None) -> Path | None:
    """Typer callback for an option naming a directory to write into (created if missing)."""
    if path is not None and path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{path} is an existing file; give a directory")
    return path


def device_option(device: str) -> str:
    """Typer callback for ``--device``: ``cpu``, ``cuda`` or ``cuda:N``, and CUDA only where present."""
    try:
        return check_device(device)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def write_json(path: Path | None, record: object) -> None:
    """Write a command's ``--json`` record (when given) and say so."""
    if path is not None:
        import json

        path.write_text(json.dumps(record, indent=2) + "\n")
        console.print(f"wrote {path}")


def mib(n: int | None) -> str:
    """Bytes as MiB with one decimal, '-' for unknown."""
    return "-" if n is None else f"{n / 2**20:,.1f}"
