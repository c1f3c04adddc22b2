"""What a ``split train`` run leaves in its directory: ``student.safetensors`` and ``student.json``.

:func:`~edgetorch.split.recipe.train_student` returns a :class:`StudentRun` and writes its
:meth:`StudentRun.to_json` as ``student.json``; :func:`load_trained` reads a run directory back
(``edgetorch split export --trained DIR``), checking every field it uses, since the directory may
come from anyone. The record's format is versioned (:data:`RECORD_FORMAT`, :data:`RECORD_VERSION`):
a change to its keys is a new version, never a silent one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._checks import check_json_fields
from .._files import read_json
from ..weights import file_sha256
from ..zoo import CheckpointError, load_weights
from .bottlefit import StageRun
from .bottleneck import BottleneckModel, rebuild
from .coded import CodeTables, load_code_tables_file
from .evaluate import OffloadScore, SplitAccuracy
from .manifest import MAX_RESOLUTION, Preprocess

if TYPE_CHECKING:  # recipe.py writes this module's record: a run-time import would be a cycle
    from .recipe import RecipeConfig

WEIGHTS_NAME, RECORD_NAME, TABLES_NAME = "student.safetensors", "student.json", "code_tables.safetensors"
# Version 2 adds the payload code tables (code_tables, evaluation.student.coded_payload_bytes);
# version 1 records still load, without tables.
RECORD_FORMAT, RECORD_VERSION = "edgetorch-split-student", 2
_READABLE_RECORDS = (1, RECORD_VERSION)


@dataclass(frozen=True)
class StudentEvaluation:
    """A trained student scored on the validation images, beside its teacher.

    Attributes:
        val_images: how many validation images were scored.
        teacher_accuracy: the teacher on the float inputs (nothing sent).
        student: the student with the float bottleneck and through the deployed 8-bit payload.
        offload: the teacher on the same images sent as files, by format: ``"png"``, ``"jpeg90"``
            (:func:`~edgetorch.split.evaluate.file_offload`).
    """

    val_images: int
    teacher_accuracy: float
    student: SplitAccuracy
    offload: dict[str, OffloadScore]


@dataclass(frozen=True)
class StudentRun:
    """What :func:`~edgetorch.split.recipe.train_student` returns: the trained student and its record.

    Attributes:
        model: the trained student, in eval mode, on the device it trained on.
        weights_sha256: SHA-256 of the run directory's ``student.safetensors``.
        resolution: the input height = width it was trained at.
        preprocess: how images become its input (what ``split export`` writes to the manifest).
        class_names: one name per class, in label order.
        recipe: the config it was trained with, resolved (:meth:`RecipeConfig.resolved`).
        skipped_images: why each image left out was left out (``skip_bad_images``); else empty.
        stages: each training stage's :class:`~edgetorch.split.bottlefit.StageRun`, in order.
        evaluation: the :class:`StudentEvaluation` on the validation images.
        torch_version: the torch that trained it.
        code_tables: the payload code tables fitted on the training images' codes, saved as
            ``code_tables.safetensors`` (``split export --trained`` writes them into the artifact).
        code_tables_sha256: that file's SHA-256.

    Example:
        >>> run = train_student(config, "runs/c3")  # doctest: +SKIP
        >>> run.evaluation.student.quantized_accuracy, run.stages[0].loss_history  # doctest: +SKIP
    """

    model: BottleneckModel
    weights_sha256: str
    resolution: int
    preprocess: Preprocess
    class_names: tuple[str, ...]
    recipe: RecipeConfig
    skipped_images: tuple[str, ...]
    stages: tuple[StageRun, ...]
    evaluation: StudentEvaluation
    torch_version: str
    code_tables: CodeTables
    code_tables_sha256: str

    def to_json(self) -> dict[str, Any]:
        """The ``student.json`` record (:data:`RECORD_FORMAT` version :data:`RECORD_VERSION`), key for key.

        Returns:
            ``format``, ``version``, ``weights`` (``path``, ``sha256``), ``code_tables`` (``path``,
            ``sha256``), ``model`` (the student's
            spec, :meth:`BottleneckModel.spec`), ``resolution``, ``preprocess`` (``color``,
            ``mean``, ``std``, ``resize``; a record without ``resize`` was trained stretched), ``class_names``, ``recipe``, ``skipped_images``, ``stages``
            (:meth:`StageRun.to_json`), ``evaluation`` and ``torch_version``, as plain JSON data.
        """
        return {"format": RECORD_FORMAT, "version": RECORD_VERSION,
                "weights": {"path": WEIGHTS_NAME, "sha256": self.weights_sha256},
                "code_tables": {"path": TABLES_NAME, "sha256": self.code_tables_sha256},
                "model": self.model.spec(), "resolution": self.resolution,
                "preprocess": {"color": self.preprocess.color, "mean": list(self.preprocess.mean),
                               "std": list(self.preprocess.std), "resize": self.preprocess.resize},
                "class_names": list(self.class_names), "recipe": dataclasses.asdict(self.recipe),
                "skipped_images": list(self.skipped_images), "stages": [stage.to_json() for stage in self.stages],
                "evaluation": dataclasses.asdict(self.evaluation), "torch_version": self.torch_version}  # fmt: skip


@dataclass(frozen=True)
class TrainedStudent:
    """A student read back from a :func:`~edgetorch.split.recipe.train_student` directory.

    Attributes:
        model: the student with its trained weights (CPU, eval mode).
        resolution: the input height = width it was trained at.
        preprocess: how images become its input (what ``split export`` writes to the manifest).
        class_names: one name per class.
        record: the whole ``student.json``.
        code_tables: its payload code tables (None for a version-1 record, trained before them).
    """

    model: BottleneckModel
    resolution: int
    preprocess: Preprocess
    class_names: tuple[str, ...]
    record: dict[str, Any]
    code_tables: CodeTables | None


def load_trained(directory: str | Path) -> TrainedStudent:
    """Read ``student.json`` and ``student.safetensors`` from a :func:`~edgetorch.split.recipe.train_student` directory.

    The layers are rebuilt from the recorded spec (:func:`~edgetorch.split.bottleneck.rebuild`:
    torchvision constructors only) and the weights loaded strictly after their SHA-256 is checked
    against the record; nothing is unpickled.

    Args:
        directory: the ``--out`` of ``edgetorch split train``.

    Returns:
        The :class:`TrainedStudent`.

    Raises:
        ValueError: not such a directory, an unfinished run, a malformed record, or weights that
            differ from the record (:class:`~edgetorch.zoo.CheckpointError`).

    Example:
        >>> trained = load_trained("runs/c12")  # doctest: +SKIP
        >>> save(trained.model, "artifact", trained.resolution, trained.preprocess)  # doctest: +SKIP
    """
    root = Path(directory)
    path = root / RECORD_NAME
    if not path.is_file():
        what = "has no " + RECORD_NAME if root.is_dir() else "is not a directory"
        raise ValueError(f"{root} {what}: it is written when `edgetorch split train --out {root}` finishes "
                         "(an interrupted run resumes with the same command)")
    record = read_json(path, error=CheckpointError)
    try:
        if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or \
                record.get("version") not in _READABLE_RECORDS or type(record.get("version")) is not int:
            got = (record.get("format"), record.get("version")) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{got} is not {RECORD_FORMAT!r} version 1 or {RECORD_VERSION}")
        with torch.device("meta"):  # a record's sizes cost nothing until the weights are known to hold them
            skeleton = rebuild(record["model"])
        resolution, prep, class_names = record["resolution"], record["preprocess"], record["class_names"]
        if isinstance(resolution, bool) or not isinstance(resolution, int) or not 0 < resolution <= MAX_RESOLUTION:
            raise ValueError(f"resolution must be an int in [1, {MAX_RESOLUTION}], got {resolution!r}")
        check_json_fields(Preprocess, {k: v for k, v in prep.items() if k != "size"}, "preprocess")
        preprocess = Preprocess((resolution, resolution), prep["color"], tuple(prep["mean"]), tuple(prep["std"]),
                                prep.get("resize", "stretch"))
        preprocess.check(3)
        if not isinstance(class_names, list) or not all(isinstance(name, str) for name in class_names):
            raise ValueError("class_names must be a list of strings")
        sha256 = record["weights"]["sha256"]
        tables_sha256 = record["code_tables"]["sha256"] if record["version"] > 1 else None
        if tables_sha256 is not None and not isinstance(tables_sha256, str):
            raise ValueError("code_tables.sha256 must be a string")
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable `split train` record ({exc})") from None
    weights = root / WEIGHTS_NAME
    if not weights.is_file() or file_sha256(weights) != sha256:
        raise CheckpointError(f"{weights} is missing or differs from the one recorded in {path}")
    needed = sum(t.numel() * t.element_size() for t in skeleton.state_dict().values())
    if needed > weights.stat().st_size:  # the layers are built for real only once the file can fill them
        raise CheckpointError(f"{path} describes a model of {needed} bytes of weights; {weights} has "
                              f"{weights.stat().st_size}")
    tables = None if tables_sha256 is None else load_code_tables_file(root / TABLES_NAME, tables_sha256)
    model = rebuild(record["model"])
    return TrainedStudent(load_weights(model, weights).eval(), resolution, preprocess, tuple(class_names), record,
                          tables)
