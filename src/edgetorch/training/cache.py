"""One content-addressed cache of trained models: a weights file and a JSON record per identity.

An entry is named ``{stem}-{key}``, where ``key`` is the first 12 hex digits of the SHA-256 of the
canonical JSON (sorted keys) of everything that determines the trained weights: the recipe, the
architecture's parameter layout, the version of the training loop where it matters. Changing any of
it names another entry rather than reusing a stale one. The zoo's pretrained models, the BottleFit
teachers and the benchmarks' source models all live here.

The record (the caller's fields plus the weights' SHA-256) is written last, atomically: weights
without a record count as absent, and weights that do not match their record's hash are refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from .._files import read_json, write_json_atomically
from ..data import cache_dir
from ..weights import CheckpointError, file_sha256, load_weights, save_weights


@dataclass(frozen=True)
class CachedModel:
    """Where one trained model lives in the cache.

    Attributes:
        weights: the ``.safetensors`` file.
        record: the ``.json`` record beside it.
    """

    weights: Path
    record: Path

    def read(self, model: nn.Module) -> dict[str, Any] | None:
        """Load the cached weights into ``model`` and return the record (``None``: not cached).

        Raises:
            CheckpointError: an unreadable record, weights whose SHA-256 differs from it, or
                weights that do not fit ``model``.
        """
        if not (self.weights.is_file() and self.record.is_file()):
            return None
        record = read_json(self.record, error=CheckpointError)
        if not isinstance(record, dict) or file_sha256(self.weights) != record.get("sha256"):
            raise CheckpointError(f"{self.weights}: SHA-256 differs from the one recorded in {self.record.name} "
                                  "(file corrupted or replaced); delete both files to train it again")
        load_weights(model, self.weights)
        return record

    def write(self, model: nn.Module, record: dict[str, Any]) -> dict[str, Any]:
        """Store ``model``'s weights, then ``record`` with their SHA-256 added; return that record."""
        record = json.loads(json.dumps({**record, "sha256": save_weights(model, self.weights)}))  # as read back
        write_json_atomically(self.record, record)
        return record


def cached_model(folder: str, stem: str, identity: object, root: str | Path | None = None) -> CachedModel:
    """The cache entry of the model that ``identity`` determines.

    Args:
        folder: the cache's subfolder (``"zoo"``, ``"split"``, ...).
        stem: a readable start of the file names (model and dataset).
        identity: JSON data: everything that determines the trained weights.
        root: the cache root; ``None`` means :func:`edgetorch.data.cache_dir`.

    Returns:
        The :class:`CachedModel` (its files may not exist yet).

    Example:
        >>> entry = cached_model("zoo", "cnn-digits", [{"epochs": 6}, [["fc.weight", [10, 64]]]])
        >>> entry.weights.name  # doctest: +SKIP
        'cnn-digits-3f2a9c1b7d04.safetensors'
    """
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    base = (Path(root) if root is not None else cache_dir()) / folder
    return CachedModel(base / f"{stem}-{key}.safetensors", base / f"{stem}-{key}.json")
