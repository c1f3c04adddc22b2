"""A record of finished runs that survives an interruption: one JSON line per run, appended as it ends.

A sweep of many runs (methods x seeds) that takes hours is stopped by a crash, a reboot or a
shared machine's limits; with its finished runs read back, a rerun does only what is missing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


class RunLog:
    """Finished runs of a sweep, each a JSON object, kept in JSON-lines files.

    A run is found again by ``key(run)``, computed from its own record. A line written by an
    older version of the sweep (another record layout) has a key the sweep no longer asks for, so
    that run is done again rather than misread.

    Args:
        paths: the files to read back; those that do not exist yet are skipped.
        key: the identity of a run, computed from its record.

    Example:
        >>> log = RunLog([path], key=lambda run: json.dumps([run["model"], run["seed"]]))  # doctest: +SKIP
        >>> run = log.get(key) or log.add(path, train_one(model, seed))  # doctest: +SKIP
    """

    def __init__(self, paths: Iterable[str | Path], key: Callable[[dict[str, Any]], str]) -> None:
        self._key = key
        self._done: dict[str, dict[str, Any]] = {}
        for path in map(Path, paths):
            if path.exists():
                for line in path.read_text().splitlines():
                    run = json.loads(line)
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
        with Path(path).open("a") as f:
            f.write(json.dumps(run) + "\n")
        self._done[self._key(run)] = run
        return run
