"""A record of finished runs that survives an interruption: one JSON line per run, appended as it ends.

A sweep of many runs (methods x seeds) that takes hours is stopped by a crash, a reboot or a
shared machine's limits; with its finished runs read back, a rerun does only what is missing.
A process killed while it appends leaves a cut-short last line: that run is not finished, so it is
skipped with a warning (and removed before the next line is appended); any other line that is not
JSON is an error, since nothing edgetorch does can leave one there.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from .._files import InputFileError


class RunLog:
    """Finished runs of a sweep, each a JSON object, kept in JSON-lines files.

    A run is found again by ``key(run)``, computed from its own record. A line written by an
    older version of the sweep (another record layout) has a key the sweep no longer asks for, so
    that run is done again rather than misread.

    Args:
        paths: the files to read back; those that do not exist yet are skipped.
        key: the identity of a run, computed from its record.

    Raises:
        InputFileError: a line before the last is not JSON (only the last one can be cut short by
            an interrupted append; it is skipped with a warning).

    Example:
        >>> log = RunLog([path], key=lambda run: json.dumps([run["model"], run["seed"]]))  # doctest: +SKIP
        >>> run = log.get(key) or log.add(path, train_one(model, seed))  # doctest: +SKIP
    """

    def __init__(self, paths: Iterable[str | Path], key: Callable[[dict[str, Any]], str]) -> None:
        self._key = key
        self._done: dict[str, dict[str, Any]] = {}
        for path in map(Path, paths):
            if path.exists():
                for run in _read_runs(path):
                    self._done[key(run)] = run

    def get(self, key: str) -> dict[str, Any] | None:
        """The finished run with this key, or None."""
        return self._done.get(key)

    def add(self, path: str | Path, run: dict[str, Any]) -> dict[str, Any]:
        """Append ``run`` to ``path`` (a line of JSON) and remember it.

        Args:
            path: the JSON-lines file; created if missing.
            run: the finished run's record (JSON-serialisable).

        Returns:
            ``run`` itself.
        """
        with Path(path).open("a+b") as f:  # "a": every write lands at the end, even after a truncate
            _mend_last_line(f, path)
            f.write((json.dumps(run) + "\n").encode())
        self._done[self._key(run)] = run
        return run


def _complete(line: str | bytes) -> dict[str, Any] | None:
    """The record on a line that lost its newline, or None where the write stopped inside it.

    ``add`` writes a record and its newline in one call, so a killed process can stop anywhere in
    it; a JSON object parses only once its closing brace is there, so a line that parses lost at
    most its newline and holds a whole run.
    """
    try:
        run = json.loads(line)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        return None
    return run if isinstance(run, dict) else None


def _read_runs(path: Path) -> list[dict[str, Any]]:
    *lines, last = path.read_text().split("\n")  # ``last`` is "" when the file ends with its newline
    runs = []
    for number, line in enumerate(lines, 1):
        try:
            runs.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise InputFileError(f"{path}: line {number} is not a JSON record ({err.msg}); only the last line "
                                 "may be cut short (by a process killed while it appended). Remove or mend that "
                                 "line, or move the file away to redo its runs") from err
    if last:
        run = _complete(last)
        if run is None:
            warnings.warn(f"{path}: skipped its cut-short last line ({len(last)} characters, a process killed "
                          "while it appended): that run is done again", stacklevel=3)
        else:
            runs.append(run)
    return runs


def _mend_last_line(f: BinaryIO, path: str | Path) -> None:
    """End ``f`` with a newline before a record is appended, dropping a cut-short last line.

    Appending after a line without its newline would glue the new record onto it, and the file
    would then hold a malformed line in the middle.
    """
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return
    f.seek(end - 1)
    if f.read(1) == b"\n":
        return
    f.seek(0)
    data = f.read()  # only after an interruption, so reading the whole file once is cheap enough
    start = data.rfind(b"\n") + 1
    if _complete(data[start:]) is not None:
        f.write(b"\n")
    else:
        f.truncate(start)
        warnings.warn(f"{path}: removed its cut-short last line ({end - start} bytes) before appending",
                      stacklevel=3)
