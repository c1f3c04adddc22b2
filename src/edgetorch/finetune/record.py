"""``model.json``, what ``edgetorch finetune`` writes beside its weights, read back as a file from elsewhere.

``predict``, ``val``, ``export`` and ``reduce`` all take a run's record; each field they use is
checked here before it is used. The model spec is one of them: ``pkg.module:factory`` imports that
module, so a record (which anyone may hand over with the weights) may name only ``zoo:`` and
``torchvision:`` models.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

#: A spec a record may name: building it imports no module of the record's choosing.
_SAFE_SPEC = re.compile(r"(zoo|torchvision):[A-Za-z0-9_]{1,64}")

_CHECKS = {
    "model": lambda v: type(v) is str and _SAFE_SPEC.fullmatch(v) is not None,
    "image_size": lambda v: type(v) is int and 0 < v <= 4096,
    "channels": lambda v: v in (1, 3),
    "classes": lambda v: isinstance(v, list) and 0 < len(v) and all(type(c) is str for c in v),
    "normalize": lambda v: v in ("imagenet", None),
    "val_fraction": lambda v: type(v) in (int, float) and 0 < v < 1,
    "config": lambda v: isinstance(v, dict) and type(v.get("seed", 0)) is int,
}


def read_record(path: str | Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a finetune ``model.json`` (or the ``reduction`` part of a reduced model's record).

    Args:
        path: the JSON file (read within :data:`edgetorch._files.MAX_JSON_BYTES`).
        required: fields that must be present.

    Returns:
        The record, every field of it that edgetorch reads checked.

    Raises:
        InputFileError: not a JSON object, a required field missing, or a field not as finetune
            writes it (a ``model`` other than ``zoo:NAME`` / ``torchvision:NAME`` included).
    """
    from .._files import read_json

    return check_record(read_json(path), Path(path), required)


def check_record(record: object, path: Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """:func:`read_record` for a record already parsed (``path`` names it in messages)."""
    from .._files import InputFileError

    if not isinstance(record, dict):
        raise InputFileError(f"{path} is not a finetune record (a JSON object with classes and image_size)")
    for name, valid in _CHECKS.items():
        if (name in required and name not in record) or (name in record and not valid(record[name])):
            hint = (" (a record may name only zoo:NAME or torchvision:NAME models: building another imports "
                    "its module)" if name == "model" else "")
            raise InputFileError(f"{path}: {name} {str(record.get(name))[:80]!r} is missing or not what edgetorch "
                                 f"finetune writes there{hint}; give the record of its run")
    return record
