"""BottleFit end to end: a trained teacher and a dataset in, a split-ready student out.

Two layers, both used by ``edgetorch split train`` and ``bench/split_training.py``: the stages in
:mod:`.bottlefit`, the scoring in :mod:`.evaluate`, and here the recipe that joins them:

* :func:`train_bottlefit` -- from a teacher in memory and training tensors: inject the bottleneck
  (seeded), stage 1 GHND (encoder + decoder, Adam), then stage 2 FT (cross entropy) or KD (SGD),
  with the encoder frozen if asked. Each stage checkpoints every epoch in its own directory under
  ``out_dir`` (``stage1-ghnd``, ``stage2-ft``, ``stage2-kd-fe``, ...): a rerun resumes, and runs
  that differ only in stage 2 share stage 1;
* :func:`train_student` -- the whole recipe from files: the teacher from a model spec and a local
  weight file, the data from an image folder or a built-in dataset, :func:`train_bottlefit`, then
  an evaluation on the validation split through the real 8-bit payload (:func:`evaluate_split`)
  against the teacher and against sending the same images as PNG or JPEG files
  (:func:`file_offload`). It returns a :class:`~edgetorch.split.student.StudentRun` and writes
  ``student.safetensors`` and ``student.json`` (its ``to_json()``), which
  ``edgetorch split export --trained DIR`` reads (:func:`~edgetorch.split.student.load_trained`).

Choices (docs/split_training.md says why): images go through the device client's own
preprocessing (:func:`edgetorch.split.client.preprocess_images`; for a folder, finetune's
evaluation transform: short side resized, centre crop, then normalised; a built-in dataset's
square images are resized whole), so the student trains on exactly what ``split infer`` sends;
there is no augmentation, so the teacher's KD logits are computed once and a resumed run gives the
same weights; the learning rate drops x0.1 after the first half of each stage, as in the paper.

Example:
    >>> config = RecipeConfig(teacher="torchvision:resnet18", teacher_weights="teacher.safetensors",
    ...                       data="photos", size=64, bottlefit=BottleFitConfig(channels=3, epochs=2))
    >>> run = train_student(config, "runs/c3")  # doctest: +SKIP
    >>> run.evaluation.student.quantized_accuracy  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn
from torch.utils.data import TensorDataset

from .._files import InputFileError, read_json, write_json_atomically
from ..data import (DATASETS, DatasetNotFoundError, ImageFolderDataset, ImageFolderError, dataset_info,
                    image_folder_splits)
from ..data.folder import IMAGENET_MEAN, IMAGENET_STD, SKIP_HINT
from ..measure.plots import new_figure, save_figure
from ..zoo import CheckpointError, build_model, evaluate_accuracy, save_weights
from ..weights import file_sha256
from .bottlefit import BottleFitConfig, Log, StageRun, build_student, train_bottlefit
from .coded import save_code_tables
from .evaluate import DECODE_CHUNK, EVAL_BATCH, evaluate_split, file_offload, fit_payload_tables
from .manifest import Preprocess
from .student import RECORD_NAME, TABLES_NAME, WEIGHTS_NAME, StudentEvaluation, StudentRun
from .teacher import load_rgb

# Pixel normalisation after scaling to [0, 1]: what `split export --normalize` and `split train` accept.
NORMALISATIONS = {"none": ((0.0,), (1.0,)), "imagenet": (IMAGENET_MEAN, IMAGENET_STD)}
RECIPE_NAME = "recipe.json"


@dataclass(frozen=True)
class RecipeConfig:
    """Everything ``edgetorch split train`` takes.

    Attributes:
        teacher: model spec: ``torchvision:NAME`` (resnet18/50/152, densenet121/169/201) or a
            ``package.module:factory`` returning one (see :func:`edgetorch.zoo.build_model`).
        data: an image folder (one subfolder per class, or a ``path,label`` CSV:
            :func:`edgetorch.data.image_folder`), or a built-in dataset: ``digits``,
            ``fashion-mnist`` (write ``./digits`` for a folder of that name).
        teacher_weights: the teacher's trained weights (``.safetensors`` or a state dict read with
            ``weights_only=True``); required for ``torchvision:`` specs, since nothing is downloaded.
        size: input height = width (a multiple of the student's ``input_multiple``, 8 or 16).
        color: ``"rgb"`` or ``"gray"``; ``None``: rgb for folders, gray for built-ins (which are gray).
        normalize: a key of :data:`NORMALISATIONS`; ``None``: imagenet for folders (what
            torchvision's pretrained weights expect), none for built-ins (edgetorch's own teachers).
        val_fraction: folders: the share of each class held out for evaluation (stratified,
            seeded by ``bottlefit.seed``); ``None``: 0.2. Built-ins evaluate on their test split.
        train_limit, val_limit: built-ins only: the first N images of the train / test split.
        skip_bad_images: folders only: leave out the images that cannot be decoded, listed in the
            record's ``skipped_images`` (see :func:`edgetorch.data.image_folder`); default: one
            is an error that names it.
        bottlefit: the student and its stages.
    """

    teacher: str
    data: str
    teacher_weights: str | None = None
    size: int = 224
    color: str | None = None
    normalize: str | None = None
    val_fraction: float | None = None
    train_limit: int | None = None
    val_limit: int | None = None
    skip_bad_images: bool = False
    bottlefit: BottleFitConfig = BottleFitConfig()

    @property
    def builtin(self) -> bool:
        """Whether ``data`` names a built-in dataset rather than a folder."""
        return "/" not in self.data and self.data.strip().lower().replace("_", "-") in DATASETS

    def resolved(self) -> RecipeConfig:
        """This config with ``color`` and ``normalize`` filled in and checked.

        Raises:
            ValueError: an unknown color or normalisation, rgb or limits where they do not apply.
        """
        color = self.color or ("gray" if self.builtin else "rgb")
        normalize = self.normalize or ("none" if self.builtin else "imagenet")
        if color not in ("rgb", "gray"):
            raise ValueError(f"color must be rgb or gray, got {color!r}")
        if normalize not in NORMALISATIONS:
            raise ValueError(f"normalize must be one of {', '.join(NORMALISATIONS)}, got {normalize!r}")
        if self.builtin and color != "gray":
            raise ValueError(f"{self.data} is a gray dataset; color must be gray")
        if not self.builtin and (self.train_limit or self.val_limit):
            raise ValueError("train/val limits apply to the built-in datasets; for a folder, use fewer images")
        if self.builtin and self.val_fraction is not None:
            raise ValueError(f"{self.data} is evaluated on its own test split; val_fraction applies to folders")
        if self.builtin and self.skip_bad_images:
            raise ValueError(f"{self.data} is a built-in dataset; skip_bad_images applies to folders")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size must be a positive int, got {self.size!r}")
        fraction = None if self.builtin else 0.2 if self.val_fraction is None else self.val_fraction
        if fraction is not None and not 0 < fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1): the student is evaluated on it, got {fraction}")
        return dataclasses.replace(self, color=color, normalize=normalize, val_fraction=fraction)


@dataclass
class _Prepared:
    teacher: nn.Module
    train: TensorDataset
    val: TensorDataset
    class_names: list[str]
    preprocess: Preprocess
    identity: dict[str, Any]
    skipped: list[tuple[Path, str]]


def _folder_tensors(config: RecipeConfig, parts: dict[str, ImageFolderDataset],
                    preprocess: Preprocess) -> tuple[TensorDataset, TensorDataset, str]:  # fmt: skip
    """Train and validation tensors from the listed folder, and a fingerprint of its files."""
    from .client import preprocess_images

    source = Path(config.data)
    base = source if source.is_dir() else source.parent  # a CSV's paths are relative to its folder
    listing = sorted((os.path.relpath(path, base), label, path.stat().st_size)
                     for part in parts.values() for path, label in part.samples)  # fmt: skip
    fingerprint = hashlib.sha256(json.dumps([parts["train"].classes, listing]).encode()).hexdigest()
    # The recipe trains from tensors (KD targets are computed once per stage), so every image is
    # decoded up front: a large folder must be refused here, not end in the OOM killer mid-decode.
    needed = sum(len(part) for part in parts.values()) * 3 * config.size**2 * 4
    available = psutil.virtual_memory().available
    if needed > available // 2:
        raise ValueError(f"{source}: {sum(len(p) for p in parts.values()):,} images at {config.size} px take "
                         f"{needed / 2**30:.1f} GiB decoded, more than half the {available / 2**30:.1f} GiB "
                         "of memory available; lower --size or train on fewer images")
    sets = []
    for part in parts.values():
        paths = [path for path, _ in part.samples]
        try:
            images = torch.cat([preprocess_images(paths[i : i + DECODE_CHUNK], preprocess, 3)
                                for i in range(0, len(paths), DECODE_CHUNK)])  # fmt: skip
        except InputFileError as exc:  # damaged data behind a header the listing read
            raise ImageFolderError(f"{exc}. Remove or replace it, {SKIP_HINT}") from None
        sets.append(TensorDataset(images, part.labels))
    return sets[0], sets[1], fingerprint


def _builtin_tensors(config: RecipeConfig, preprocess: Preprocess,
                     device: torch.device) -> tuple[TensorDataset, TensorDataset, str]:  # fmt: skip
    """Train (on ``device``) and test split of a built-in dataset (gray, repeated to RGB,
    normalised), and its identity."""
    name = dataset_info(config.data).name
    sets = []
    for split_name, limit, where in (("train", config.train_limit, device), ("test", config.val_limit, "cpu")):
        try:
            images, labels = load_rgb(name, split_name, config.size, limit, where).tensors
        except DatasetNotFoundError as exc:  # bad input like any other, not a failure of the run
            raise ValueError(str(exc)) from None
        # Without normalisation the images stay load_rgb's expanded view: one channel in memory, not three.
        if config.normalize != "none":
            m, s = (torch.tensor(v, device=where).view(1, -1, 1, 1) for v in (preprocess.mean, preprocess.std))
            images = (images - m) / s
        sets.append(TensorDataset(images, labels))
    return sets[0], sets[1], f"{name}:{config.train_limit}:{config.val_limit}"


def _load_teacher(config: RecipeConfig, num_classes: int, device: torch.device) -> nn.Module:
    weights = config.teacher_weights
    if weights is None and config.teacher.startswith("torchvision:"):
        raise ValueError("a torchvision teacher needs its trained weights (--teacher-weights FILE): nothing is "
                         "downloaded, and a randomly initialised teacher teaches nothing")
    try:
        teacher = build_model(config.teacher, num_classes=num_classes, weights=weights)
    except CheckpointError as exc:
        raise CheckpointError(f"teacher {config.teacher} for {num_classes} classes ({config.data}): {exc}") from None
    return teacher.to(device).eval()


def _prepare(config: RecipeConfig, device: torch.device) -> _Prepared:
    """Every check that can fail on bad input, cheapest first; then the pixels are decoded."""
    if config.teacher_weights is not None:
        path = Path(config.teacher_weights)
        if not path.is_file():
            raise CheckpointError(f"teacher weight file {path} " + ("is a directory, not a file" if path.is_dir()
                                                                    else "does not exist"))
    # A folder's images take finetune's framing (a fine-tuned teacher scored 67.5% here against
    # 80.0% in finetune on the same images when they were stretched instead); the built-ins are square.
    preprocess = Preprocess((config.size, config.size), config.color, *NORMALISATIONS[config.normalize],
                            resize="stretch" if config.builtin else "center-crop")
    if config.builtin:
        class_names = list(dataset_info(config.data).class_names)
    else:  # list and header-check the folder before building anything
        parts = image_folder_splits(config.data, config.size, ("train", "val"), val_fraction=config.val_fraction,
                                    seed=config.bottlefit.seed, color=config.color, normalize=None,
                                    skip_bad_images=config.skip_bad_images)  # fmt: skip
        if not len(parts["val"]):
            raise ValueError(f"{config.data}: no validation images at val_fraction={config.val_fraction}; add images")
        class_names = list(parts["train"].classes)
    teacher = _load_teacher(config, len(class_names), device)
    probe = build_student(teacher, config.bottlefit)  # raises for an architecture that takes no bottleneck
    if config.size % probe.input_multiple:
        up = -(-config.size // probe.input_multiple) * probe.input_multiple
        raise ValueError(f"size {config.size} is not a multiple of {probe.input_multiple}, which the "
                         f"{probe.arch} {probe.split_point} student needs (e.g. {up})")
    del probe
    if config.builtin:
        train, val, fingerprint = _builtin_tensors(config, preprocess, device)
    else:
        train, val, fingerprint = _folder_tensors(config, parts, preprocess)
    if len(train) < config.bottlefit.batch_size:
        raise ValueError(f"{len(train)} training images is less than one batch of {config.bottlefit.batch_size}; "
                         "lower the batch size")
    # skip_bad_images is not part of it: which images are used is, through the data fingerprint.
    identity = {**{k: v for k, v in dataclasses.asdict(config).items()
                   if k not in ("teacher_weights", "data", "bottlefit", "skip_bad_images")},
                **{k: v for k, v in dataclasses.asdict(config.bottlefit).items() if k not in ("stage2", "freeze_encoder", "rate_weight", "code_levels")},
                "resize": preprocess.resize,
                "teacher_sha256": file_sha256(config.teacher_weights) if config.teacher_weights else None,
                "data_fingerprint": fingerprint}  # fmt: skip
    return _Prepared(teacher, train, val, class_names, preprocess, identity,
                     [] if config.builtin else parts["train"].skipped)


def _claim(out: Path, identity: dict[str, Any]) -> None:
    """Make ``out`` this recipe's run directory, or refuse one that holds another run or other files."""
    recorded = out / RECIPE_NAME
    if recorded.is_file():
        # A recipe.json from before the architecture option ran the paper design.
        raw = read_json(recorded, error=CheckpointError)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{recorded}: not a recipe record (a JSON object); delete {out} to start over")
        # ... and one from before resize was recorded stretched every image.
        before = {"architecture": "paper", "resize": "stretch", **raw}
        differs = sorted(k for k in set(before) | set(identity) if before.get(k) != identity.get(k))
        if differs:
            raise CheckpointError(f"{out} holds a run of another recipe (it differs in {', '.join(differs)}); "
                                  "give another output directory, or delete this one to start over")
        return
    if out.is_dir() and any(out.iterdir()):
        raise CheckpointError(f"{out} is not empty and holds no {RECIPE_NAME}: not a `split train` directory; "
                              "give a new or empty one")
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomically(recorded, identity)


def train_student(config: RecipeConfig, out_dir: str | Path, device: str | torch.device = "cpu",
                  progress: bool = True, log: Log | None = None) -> StudentRun:  # fmt: skip
    """The BottleFit recipe from files: train, evaluate and save a student that ``split export`` takes.

    Every check of the input runs before any training: a missing or mismatched weight file, an
    empty or unreadable folder, a size the student cannot take, data smaller than a batch, or an
    ``out_dir`` that holds another run.

    Args:
        config: the teacher, data and student.
        out_dir: the run directory: ``recipe.json`` (what the checkpoints belong to), one
            checkpoint directory per stage (the same call resumes after the last finished epoch),
            then ``student.safetensors`` and ``student.json`` (the result's ``to_json()``).
        device: where the teacher and student train (``"cpu"``, ``"cuda"``).
        progress: show progress bars.
        log: called with a line per step of the recipe.

    Returns:
        The :class:`~edgetorch.split.student.StudentRun`: the trained student, its resolution,
        preprocessing and class names, the resolved ``recipe``, each stage's
        :class:`~edgetorch.split.bottlefit.StageRun`, and the ``evaluation`` on the validation
        images (the teacher's accuracy, the student's :class:`SplitAccuracy`, and the teacher on
        PNG and JPEG files, :func:`file_offload`).

    Raises:
        ValueError: bad input (subclasses: :class:`~edgetorch.data.ImageFolderError`,
            :class:`~edgetorch.zoo.CheckpointError`; a built-in dataset whose files are not found
            too), before any training.
        FloatingPointError: a loss became inf or NaN.
    """
    config = config.resolved()
    log = log or (lambda line: None)
    device = torch.device(device)
    out = Path(out_dir)
    prepared = _prepare(config, device)
    _claim(out, prepared.identity)
    log(f"data: {len(prepared.train):,} training and {len(prepared.val):,} validation images, "
        f"{len(prepared.class_names)} classes, {config.size} px {config.color}")
    if prepared.skipped:
        log(f"left out {len(prepared.skipped)} unreadable image(s) (skip_bad_images), each listed with the reason "
            f"in {out / RECORD_NAME}")
    train = TensorDataset(*(t.to(device) for t in prepared.train.tensors))
    run = train_bottlefit(prepared.teacher, train, config.bottlefit, out, progress, log)
    # The payload code tables, from the training images' codes (the validation images are scored with
    # them); a rate-trained student's keep its fixed steps (payload version 3)
    tables = fit_payload_tables(run.student, train, steps=run.steps)
    log("evaluating on the validation images (8-bit and entropy-coded payloads, PNG, JPEG)")
    preprocess = prepared.preprocess
    evaluation = StudentEvaluation(len(prepared.val),
                                   evaluate_accuracy(prepared.teacher, prepared.val, batch_size=EVAL_BATCH),
                                   evaluate_split(run.student, prepared.val, tables=tables),
                                   file_offload(prepared.teacher, prepared.val, config.color, preprocess.mean,
                                                preprocess.std))
    result = StudentRun(run.student, save_weights(run.student, out / WEIGHTS_NAME), config.size, preprocess,
                        tuple(prepared.class_names), config, tuple(why for _, why in prepared.skipped),
                        tuple(run.stages), evaluation, torch.__version__, tables,
                        save_code_tables(tables, out / TABLES_NAME))  # fmt: skip
    write_json_atomically(out / RECORD_NAME, result.to_json())
    return result


def plot_losses(stages: Sequence[StageRun], path: str | Path, title: str = "") -> Path:
    """Training loss per epoch, one panel per stage (GHND's and FT/KD's losses have different units).

    Args:
        stages: the stages as trained (:attr:`StudentRun.stages <edgetorch.split.student.StudentRun.stages>`).
        path: the image to write (format from the suffix: .png, .pdf, .svg).
        title: the figure's title.

    Returns:
        The path written.
    """
    fig, axes = new_figure((4.5 * len(stages), 3.6), 1, len(stages), squeeze=False)
    for ax, stage in zip(axes[0], stages):
        history = stage.loss_history
        ax.plot(range(1, len(history) + 1), history, "o-")
        ax.set_title(f"{stage.name} ({stage.config.loss}, {stage.config.trainable} trainable)", fontsize=9)
        ax.set_xlabel("epoch")
        ax.set_ylabel("mean training loss")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    return save_figure(fig, path, title)
