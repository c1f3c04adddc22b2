"""BottleFit's two-stage training from a teacher in memory and training tensors: inject the bottleneck
(seeded), stage 1 GHND (encoder + decoder, Adam), then stage 2 FT (cross entropy) or KD (SGD), with the
encoder frozen if asked. Each stage checkpoints every epoch in its own directory under ``out_dir``
(``stage1-ghnd``, ``stage2-ft``, ``stage2-kd-fe``, ...): a rerun resumes, and runs that differ only in
stage 2 share stage 1. The learning rate drops x0.1 after the first half of each stage, as in the paper.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..training import seeded
from .bottleneck import ARCHITECTURES, SPLIT_POINTS, BottleneckModel, inject_bottleneck
from .coded import FixedSteps
from .payload import PayloadError
from .evaluate import EVAL_BATCH, TABLE_IMAGES
from .train import StageConfig, stage_progress, train_stage

STAGE2 = ("ft", "kd")
STEPS_NAME = "fixed_steps.json"  # a rate-aware stage 2's steps, in its checkpoint directory
#: rate-aware stage 2's default codes per channel range, chosen in one-epoch 64 px trials before the
#: measured runs (not kept as results; with 256 levels, the 8-bit step, the batch histogram is too
#: sparse to steer the encoder); every run in docs/results/split_coded*.md used it
CODE_LEVELS = 16
Log = Callable[[str], None]


def lr_step(epochs: int) -> int:
    """Epochs between x0.1 learning-rate drops: after the first half of a stage (the paper: 5 of 10).

    A 1-epoch stage keeps its rate (the scheduler steps after the last epoch).

    Args:
        epochs: the stage's epochs.

    Returns:
        ``max(1, (epochs + 1) // 2)``.

    Example:
        >>> lr_step(10), lr_step(3), lr_step(1)
        (5, 2, 1)
    """
    return max(1, (epochs + 1) // 2)


@dataclass(frozen=True)
class BottleFitConfig:
    """The student and its two training stages (hyperparameters as in the paper unless noted).

    Attributes:
        channels: bottleneck channels C (the paper: 1, 2, 3, 6, 9, 12).
        split_point: ``"sp1"`` or ``"sp2"`` (:func:`~edgetorch.split.inject_bottleneck`).
        downsample: halve the bottleneck's height and width once more.
        architecture: the encoder/decoder design: ``"paper"`` (the paper's text) or ``"released"``
            (the authors' code; :func:`~edgetorch.split.inject_bottleneck`).
        stage2: ``"ft"`` (cross entropy, eq. 5), ``"kd"`` (eq. 6-7), or ``None``: stage 1 only.
        freeze_encoder: stage 2 trains only the tail ("FE" in the paper's Table II).
        epochs: per stage (the paper: 10).
        batch_size: samples per step (the last partial batch of an epoch is dropped).
        lr: initial learning rate of both stages (the paper: 1e-3), x0.1 after :func:`lr_step` epochs.
        seed: the new layers' initialisation and the batch order.
        rate_weight: ``None``: stage 2 as in the paper (payloads are 8-bit with per-sample scales).
            A number >= 0: rate-aware stage 2 (issue 27): after stage 1, fixed per-channel steps are
            fitted on the training bottlenecks (:class:`~edgetorch.split.coded.FixedSteps`), and
            stage 2 trains the whole student through them with this weight on the estimated bits
            per image (:mod:`edgetorch.split.rate`); payloads are then version 3. Needs stage 2
            with the encoder trainable.
        code_levels: with ``rate_weight``: codes spanning each channel's fitted range (2..256; the
            steps are range / (levels - 1)). Coarser steps leave the rate term a code histogram it
            can estimate from one batch, and the decoder values it can learn to use (default 16:
            docs/results/split_coded_96px.md).
    """

    channels: int = 12
    split_point: str = "sp2"
    downsample: bool = False
    architecture: str = "paper"
    stage2: str | None = "ft"
    freeze_encoder: bool = False
    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-3
    seed: int = 0
    rate_weight: float | None = None
    code_levels: int = CODE_LEVELS

    def __post_init__(self) -> None:
        if self.stage2 not in (*STAGE2, None):
            raise ValueError(f"stage2={self.stage2!r}; accepted: {', '.join(STAGE2)} (or None: stage 1 only)")
        if self.split_point not in SPLIT_POINTS:
            raise ValueError(f"split_point={self.split_point!r}; accepted: {', '.join(SPLIT_POINTS)}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r}; accepted: {', '.join(ARCHITECTURES)}")
        if isinstance(self.channels, bool) or not isinstance(self.channels, int) or self.channels < 1:
            raise ValueError(f"channels must be a positive int, got {self.channels!r}")
        if self.rate_weight is not None and (self.stage2 is None or self.freeze_encoder):
            raise ValueError("rate_weight trains the encoder in stage 2: it needs stage2 (ft or kd) and "
                             "freeze_encoder=False")
        if isinstance(self.code_levels, bool) or not isinstance(self.code_levels, int) or not 2 <= self.code_levels <= 256:
            raise ValueError(f"code_levels must be an int in 2..256, got {self.code_levels!r}")
        if self.rate_weight is None and self.code_levels != CODE_LEVELS:
            raise ValueError("code_levels sets the fixed steps of rate-aware stage 2: give rate_weight too")
        self.stages()  # StageConfig checks epochs, batch size, learning rate, seed and rate weight

    def stages(self) -> list[tuple[str, StageConfig]]:
        """``(checkpoint directory name, config)`` of each stage, in order.

        Returns:
            Stage 1 (GHND, encoder + decoder, Adam) and, unless ``stage2`` is None, stage 2 (SGD,
            momentum 0.9, the whole student or with ``freeze_encoder`` the tail).
        """
        common = dict(epochs=self.epochs, lr=self.lr, lr_step=lr_step(self.epochs), batch_size=self.batch_size,
                      seed=self.seed)
        stages = [("stage1-ghnd", StageConfig(loss="ghnd", trainable="bottleneck", optimizer="adam", **common))]
        if self.stage2 is not None:
            name = f"stage2-{self.stage2}" + ("-fe" if self.freeze_encoder else "")
            if self.rate_weight is not None:
                name += f"-rate{self.rate_weight:g}-levels{self.code_levels}"
            stages.append((name, StageConfig(loss="ce" if self.stage2 == "ft" else "kd", optimizer="sgd",
                                             trainable="tail" if self.freeze_encoder else "all",
                                             rate_weight=self.rate_weight or 0.0, **common)))
        return stages


@dataclass(frozen=True)
class StageRun:
    """One stage as trained (or resumed, or loaded finished) by :func:`run_stage`.

    Attributes:
        name: the checkpoint directory's name.
        config: the stage.
        loss_history: mean training loss of every epoch.
        seconds: wall-clock training time of all its epochs, over every run that trained some.
        seconds_this_run: time spent in this call (about 0 for a finished stage).
    """

    name: str
    config: StageConfig
    loss_history: list[float]
    seconds: float
    seconds_this_run: float

    def to_json(self) -> dict[str, Any]:
        """The run as plain JSON data."""
        return {**dataclasses.asdict(self), "config": dataclasses.asdict(self.config)}


def run_stage(model: nn.Module, train: TensorDataset, config: StageConfig, teacher: nn.Module | None,
              directory: str | Path, progress: bool = True, log: Log | None = None,
              steps: FixedSteps | None = None) -> StageRun:
    """:func:`~edgetorch.split.train.train_stage` in ``directory``, timed and logged.

    Args:
        model: the student (changed in place).
        train: training images and labels.
        config: the stage.
        teacher: the teacher, for ``kd``/``hnd``/``ghnd``.
        directory: the stage's checkpoint directory (resumed if it holds a checkpoint).
        progress: show a progress bar.
        log: called with one line when the stage starts and when it ends.
        steps: the fixed steps a rate-aware stage 2 rounds with (:func:`train_stage`).

    Returns:
        The :class:`StageRun`.
    """
    directory = Path(directory)
    log = log or (lambda line: None)
    done = stage_progress(directory)
    log(f"{directory.name}: " + (f"resuming after epoch {done['epoch']}/{config.epochs}" if done else "training")
        + f" ({config.loss}, {config.trainable} trainable, {config.epochs} epoch(s))")
    start = time.perf_counter()
    history = train_stage(model, train, config, teacher=teacher, checkpoint_dir=directory, progress=progress,
                          steps=steps)
    elapsed = time.perf_counter() - start
    # Always there: train_stage checkpoints in ``directory`` after every epoch (a stage has at least
    # one), each epoch's record holds its seconds, and a checkpoint without them is refused on resume.
    seconds = float(sum(stage_progress(directory)["epoch_seconds"]))
    log(f"{directory.name}: done in {elapsed:.0f} s this run, loss per epoch {[round(h, 4) for h in history]}")
    return StageRun(directory.name, config, history, seconds, elapsed)


@dataclass
class BottleFitRun:
    """What :func:`train_bottlefit` returns.

    Attributes:
        student: the trained student, in eval mode, on the teacher's device.
        stages: each stage's :class:`StageRun`.
        steps: the fixed steps of a rate-aware run (``config.rate_weight`` set), else None.
    """

    student: BottleneckModel
    stages: list[StageRun]
    steps: FixedSteps | None = None


def build_student(teacher: nn.Module, config: BottleFitConfig) -> BottleneckModel:
    """The untrained student: ``teacher`` with the bottleneck injected, its new layers seeded by ``config.seed``.

    Args:
        teacher: a torchvision ResNet/DenseNet (copied, never changed).
        config: channels, split point, downsampling, architecture and seed.

    Returns:
        The student on the teacher's device (the caller's random state is left as it was).
    """
    device = next(teacher.parameters()).device
    with seeded(config.seed, device):
        return inject_bottleneck(teacher, config.channels, config.split_point, config.downsample, config.architecture)


def train_bottlefit(teacher: nn.Module, train: TensorDataset, config: BottleFitConfig, out_dir: str | Path,
                    progress: bool = True, log: Log | None = None) -> BottleFitRun:  # fmt: skip
    """Inject the bottleneck into ``teacher`` and train the student in BottleFit's stages.

    Args:
        teacher: the trained torchvision ResNet/DenseNet (kept in eval mode, never changed); the
            student is built on its device.
        train: ``TensorDataset`` of input images ``[N, 3, H, W]`` (as the teacher takes them) and labels.
        config: the student and stages.
        out_dir: one checkpoint directory per stage is kept under it (see :meth:`BottleFitConfig.stages`).
            A stage resumes by its config alone, so use one ``out_dir`` per teacher and training data.
        progress: show progress bars.
        log: called with a line as each stage starts and ends.

    Returns:
        The :class:`BottleFitRun`.

    Raises:
        ValueError: the teacher is not an accepted architecture, or the data is smaller than a batch.
        CheckpointError: a stage directory holds a checkpoint of another config or model.
        FloatingPointError: a loss became inf or NaN.
    """
    student = build_student(teacher, config)
    runs, steps = [], None
    for name, stage in config.stages():
        directory = Path(out_dir) / name
        if stage.loss in ("ce", "kd") and config.rate_weight is not None:
            steps = _stage_steps(student, train, config.code_levels, directory)
        runs.append(run_stage(student, train, stage, teacher, directory, progress, log, steps))
    return BottleFitRun(student, runs, steps)


def _stage_steps(student: BottleneckModel, train: TensorDataset, levels: int, directory: Path) -> FixedSteps:
    """The rate-aware stage's fixed steps: fitted on the stage-1 student when the stage starts and kept
    in its directory (``fixed_steps.json``), so a resumed stage rounds with the very same steps (a refit
    on another device or torch could differ in the last bit)."""
    from .._files import read_json, write_json_atomically
    from ..weights import CheckpointError

    path = directory / STEPS_NAME
    if path.is_file():
        try:
            return FixedSteps.from_json(read_json(path, error=CheckpointError))
        except PayloadError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
    steps = fit_steps(student, train, levels)
    directory.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, steps.to_json())
    return steps


@torch.inference_mode()
def fit_steps(student: BottleneckModel, train: TensorDataset, levels: int = CODE_LEVELS, limit: int = TABLE_IMAGES,
              batch_size: int = EVAL_BATCH) -> FixedSteps:
    """Fixed per-channel steps over the bottlenecks of the first ``limit`` training images.

    Args:
        student: the student after stage 1 (its mode is restored afterwards).
        train: training images (any device) and labels.
        levels: codes spanning each channel's range (:meth:`FixedSteps.fit`).
        limit: the most images used.
        batch_size: images per forward pass.

    Returns:
        The :class:`~edgetorch.split.coded.FixedSteps`.
    """
    was_training = student.training
    device = next(student.parameters()).device
    student.eval()
    z = torch.cat([student.head(x.to(device)).cpu() for x in train.tensors[0][:limit].split(batch_size)])
    student.train(was_training)
    return FixedSteps.fit(z, levels)
