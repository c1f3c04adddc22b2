"""What a tamperer without the signing key does to a split artifact: edit its manifest, then make
the manifest's hashes fit the altered files. Shared by the runtime and attack tests."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path


def edit_manifest(directory: Path, edit: Callable[[dict], None]) -> None:
    """Apply ``edit`` to the parsed manifest.json of ``directory`` and write it back."""
    path = directory / "manifest.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def rehash(directory: Path) -> None:
    """Make every file hash in the manifest match the file as it is now."""
    def edit(raw: dict) -> None:
        for entry in raw["files"].values():
            entry["sha256"] = hashlib.sha256((directory / entry["path"]).read_bytes()).hexdigest()
    edit_manifest(directory, edit)
