"""Files written so a reader never sees half of one: a temporary name in the same folder, then a rename."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomically(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` (parent folders created), atomically.

    The temporary name carries the process id, so concurrent writers never interleave bytes;
    values JSON cannot hold (paths, dtypes) are written as their ``str``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
