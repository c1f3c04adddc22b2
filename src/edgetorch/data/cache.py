"""Where edgetorch keeps files it creates on the user's behalf (downloads, pretrained models)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "EDGETORCH_CACHE"


def cache_dir() -> Path:
    """The edgetorch cache directory (not created here).

    Returns:
        ``$EDGETORCH_CACHE`` when set and non-empty, else ``~/.cache/edgetorch``.
    """
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "edgetorch"
