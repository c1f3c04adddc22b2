"""BottleFit training (Sec. III-C): one resumable training stage, configured by a plain dataclass.

A run of the paper is two calls of :func:`train_stage` on the same student:

* stage 1, GHND (eq. 4): ``StageConfig(loss="ghnd", trainable="bottleneck", optimizer="adam")`` --
  encoder and decoder learn to reproduce the teacher's front output *and*, through the frozen
  later blocks, the teacher's block outputs; no labels are used;
* stage 2: ``loss="ce"`` (FT) or ``loss="kd"`` (eq. 6-7) with ``trainable="tail"`` (frozen encoder,
  "FE" in Table II) or ``trainable="all"``, ``optimizer="sgd"``.

The baselines are single stages: conventional training (``ce``/``all``), KD (``kd``/``all``), HND
(``hnd``/``bottleneck``: the front output only) and the autoencoder (``hnd``/``bottleneck`` on an
:func:`~edgetorch.split.bottleneck.inject_autoencoder` student: a reconstruction loss on the
front's output with the AE layers alone trainable).

Frozen modules are kept in eval mode for the whole stage, so their batch-norm running statistics do
not move (the published reference code puts the whole student in train mode, which updates the
statistics of "frozen" blocks). The teacher is always in eval mode and never receives gradients.

Checkpoints (``checkpoint_dir``) are the training loop's (:mod:`edgetorch.training.checkpoint`),
written after every epoch; their run identity is the stage's config and the number of training
samples. Calling :func:`train_stage` again with the same directory resumes after the last finished
epoch and gives the same weights as an uninterrupted run. A directory written for another config
or data, or weights that do not match the model or the recorded hash, raise
:class:`~edgetorch.zoo.CheckpointError` instead of training from a silent mismatch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn
from torch.utils.data import TensorDataset

from .._checks import check_choice, check_positive_int
from .._files import read_json
from ..training import Checkpointing, Loop, Watch, train_epochs
from ..training.loop import RECORD_FIELDS
from ..training.checkpoint import state_history
from ..weights import CheckpointError
from .bottleneck import BottleneckModel, decompose
from .coded import FixedSteps
from .losses import ghnd_loss, kd_loss
from .rate import RateTerm

LOSSES = ("ce", "kd", "hnd", "ghnd")
TRAINABLE = ("all", "bottleneck", "tail")
OPTIMIZERS = ("adam", "sgd")
_NEEDS_TEACHER = ("kd", "hnd", "ghnd")
# The BottleFit authors' training configs: SGD (stage 2) with weight decay 5e-4, Adam (stage 1)
# without; the paper does not say.
_AUTHORS_WEIGHT_DECAY = {"sgd": 5e-4, "adam": 0.0}


@dataclass(frozen=True)
class StageConfig:
    """One training stage.

    Attributes:
        loss: ``"ce"`` (cross entropy, eq. 5), ``"kd"`` (eq. 6-7), ``"hnd"`` (MSE at the decoder
            output only) or ``"ghnd"`` (eq. 4: decoder output and every later block's output).
        trainable: ``"all"``, ``"bottleneck"`` (encoder + decoder; for the autoencoder baseline the
            AE layers) or ``"tail"`` (everything after the bottleneck: stage 2 with a frozen
            encoder).
        epochs: passes over the training data.
        optimizer: ``"adam"`` (the paper's stage 1) or ``"sgd"`` with ``momentum`` (stage 2).
        lr: initial learning rate (paper: 1e-3 in both stages).
        momentum: SGD momentum (paper: 0.9).
        weight_decay: L2 penalty; ``None`` takes the authors' code: 5e-4 for SGD (stage 2), 0 for
            Adam (stage 1). The paper's text names none.
        lr_step: multiply the learning rate by 0.1 every ``lr_step`` epochs (paper: 5 of 10);
            ``None`` keeps it constant.
        batch_size: samples per step; the last partial batch of an epoch is dropped.
        alpha: KD weight of the hard-label loss (paper: 0.5).
        tau: KD temperature (paper: 1).
        seed: fixes the batch order (:func:`edgetorch.training.epoch_orders`).
        rate_weight: ``ce``/``kd`` given fixed steps (:func:`train_stage`'s ``steps``): the loss
            adds this times the estimated bits per sample of the coded bottleneck
            (:class:`~edgetorch.split.rate.RateTerm`); 0 trains through the rounding alone.
    """

    loss: str = "ghnd"
    trainable: str = "bottleneck"
    epochs: int = 1
    optimizer: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float | None = None
    lr_step: int | None = None
    batch_size: int = 64
    alpha: float = 0.5
    tau: float = 1.0
    seed: int = 0
    rate_weight: float = 0.0

    def __post_init__(self) -> None:
        for name, accepted in (("loss", LOSSES), ("trainable", TRAINABLE), ("optimizer", OPTIMIZERS)):
            check_choice(name, getattr(self, name), accepted)
        for name in ("epochs", "batch_size"):
            check_positive_int(name, getattr(self, name))
        if self.lr_step is not None and (not isinstance(self.lr_step, int) or self.lr_step < 1):
            raise ValueError(f"lr_step must be None or a positive int, got {self.lr_step!r}")
        if self.weight_decay is not None and not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be None or >= 0, got {self.weight_decay!r}")
        if isinstance(self.rate_weight, bool) or not (isinstance(self.rate_weight, (int, float))
                                                      and 0 <= self.rate_weight < float("inf")):
            raise ValueError(f"rate_weight must be a finite number >= 0, got {self.rate_weight!r}")
        if self.rate_weight and self.loss not in ("ce", "kd"):
            raise ValueError(f"rate_weight applies to stage 2 (loss ce or kd), not loss={self.loss!r}")
        if not (self.lr > 0 and 0 <= self.momentum < 1 and 0 <= self.alpha <= 1 and self.tau > 0):
            raise ValueError(
                f"need lr > 0, 0 <= momentum < 1, 0 <= alpha <= 1, tau > 0; got lr={self.lr}, "
                f"momentum={self.momentum}, alpha={self.alpha}, tau={self.tau}"
            )


    def identity(self) -> dict[str, Any]:
        """The config as plain data for checkpoint and cache keys: without ``rate_weight`` when it
        is 0, so the keys of stages trained before the rate term existed still match."""
        fields = dataclasses.asdict(self)
        if not self.rate_weight:
            del fields["rate_weight"]
        return fields


def _trainable_parts(model: nn.Module, trainable: str) -> list[nn.Module]:
    if trainable == "all":
        return [model]
    if not isinstance(model, BottleneckModel):
        raise ValueError(f"trainable={trainable!r} needs a BottleneckModel, got {type(model).__name__}")
    return model.bottleneck_parts() if trainable == "bottleneck" else [model.tail]


def _set_modes(model: nn.Module, parts: list[nn.Module]) -> list[nn.Parameter]:
    """Train mode and gradients for ``parts``; eval mode (flag set module by module) elsewhere."""
    inside = {id(m) for part in parts for m in part.modules()}
    for module in model.modules():
        # Set each module's own flag: Module.eval() would recurse into trainable children.
        module.training = id(module) in inside
    params = [p for part in parts for p in part.parameters()]
    chosen = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in chosen)
    return params


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, config: StageConfig,
          target_logits: torch.Tensor | None, stages, rate: RateTerm | None) -> torch.Tensor:  # fmt: skip
    # target_logits (kd), stages (hnd, ghnd: the teacher's decomposition) and rate (fixed steps)
    # come from train_stage, built once per stage.
    if config.loss in ("ce", "kd"):
        bits = 0.0
        if rate is None:
            logits = model(x)
        else:
            rounded, bits = rate(model.head(x))
            logits = model.tail(rounded)
        if config.loss == "ce":
            return F.cross_entropy(logits, y) + config.rate_weight * bits
        assert target_logits is not None  # computed once per stage by train_stage
        return kd_loss(logits, target_logits, y, config.alpha, config.tau) + config.rate_weight * bits
    with torch.no_grad():
        targets = [stages.front(x)] if config.loss == "hnd" else stages.taps(x)[:-1]
    if config.loss == "hnd":  # only the decoder output: no need to run the later blocks
        return ghnd_loss([model.tail.decoder(model.head(x))], targets)
    return ghnd_loss(model.taps(x)[:-1], targets)


def stage_progress(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """What a stage's checkpoint records about its training, without loading any weights.

    Args:
        checkpoint_dir: a directory :func:`train_stage` wrote.

    Returns:
        ``{"epoch": finished epochs, "history": mean loss per epoch, "epoch_seconds": wall-clock
        seconds per epoch}``, or ``None`` when no epoch has finished there.

    Raises:
        CheckpointError: an unreadable state file.

    Example:
        >>> stage_progress("runs/c12/stage1-ghnd")  # doctest: +SKIP
        {'epoch': 2, 'history': [0.41, 0.22], 'epoch_seconds': [61.2, 60.8]}
    """
    path = Path(checkpoint_dir) / "state.json"
    if not path.is_file():
        return None
    try:
        history = state_history(read_json(path, error=CheckpointError), RECORD_FIELDS)
    except ValueError as exc:
        raise CheckpointError(f"{path}: not a training state this version wrote ({exc})") from None
    return {"epoch": len(history), "history": [r["train_loss"] for r in history],
            "epoch_seconds": [r["seconds"] for r in history]}


class _Bar(Watch):
    """A rich progress bar per epoch (none when disabled)."""

    def __init__(self, bar: Progress, config: StageConfig) -> None:
        self.bar, self.config, self.task = bar, config, None

    def epoch_started(self, epoch: int) -> None:
        self.task = self.bar.add_task(f"{self.config.loss}/{self.config.trainable} epoch {epoch}/{self.config.epochs}",
                                      total=None, loss=float("nan"))  # fmt: skip

    def step_done(self, epoch: int, step: int, steps: int, loss: float, images_per_second: float) -> None:
        self.bar.update(self.task, total=steps, completed=step, loss=loss)


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn(),
                    disable=not enabled, transient=True)  # fmt: skip


def train_stage(model: nn.Module, data: TensorDataset, config: StageConfig, teacher: nn.Module | None = None,
                checkpoint_dir: str | Path | None = None, progress: bool = True,
                steps: FixedSteps | None = None) -> list[float]:  # fmt: skip
    """Train ``model`` for one stage (see the module docstring for the paper's configurations).

    Args:
        model: the student (a :class:`BottleneckModel` unless ``loss="ce"``/``"kd"`` with
            ``trainable="all"``, which also trains a plain classifier such as the teacher itself).
        data: ``TensorDataset`` of images ``[N, 3, H, W]`` and int labels, on any device (each
            batch is moved to the model's device).
        config: the stage.
        teacher: the original model, on the student's device; required by ``kd``, ``hnd`` and
            ``ghnd``. Kept in eval mode.
        checkpoint_dir: write a checkpoint there after every epoch and resume from it if present.
        progress: show a rich progress bar.
        steps: ``ce``/``kd`` on a BottleneckModel: the tail trains on the bottleneck rounded with
            these fixed steps (payload version 3's quantiser), and ``config.rate_weight`` weighs
            the rate term (:mod:`edgetorch.split.rate`).

    Returns:
        The mean training loss of each epoch (of all epochs, including resumed ones). The model is
        left in eval mode with every parameter's ``requires_grad`` as it was before.

    Raises:
        ValueError: a missing teacher, a stage that needs a BottleneckModel, or data smaller than
            a batch.
        CheckpointError: ``checkpoint_dir`` holds a checkpoint of another config, data or model.
        TrainingDiverged: the loss became inf or NaN (a ``FloatingPointError``; the checkpoint keeps
            the last finished epoch).
    """
    if config.loss in _NEEDS_TEACHER and teacher is None:
        raise ValueError(f"loss={config.loss!r} needs the teacher model")
    if config.loss in ("hnd", "ghnd") and not isinstance(model, BottleneckModel):
        raise ValueError(f"loss={config.loss!r} needs a BottleneckModel, got {type(model).__name__}")
    if config.rate_weight and steps is None:
        raise ValueError("rate_weight > 0 needs the fixed steps the bottleneck is rounded with (steps=)")
    if steps is not None and (config.loss not in ("ce", "kd") or not isinstance(model, BottleneckModel)):
        raise ValueError(f"steps= trains a BottleneckModel through rounding with loss ce or kd, got loss="
                         f"{config.loss!r} on {type(model).__name__}")
    if config.rate_weight and config.trainable != "all":
        raise ValueError("the rate term trains the encoder: it needs trainable='all' (the encoder frozen, only "
                         "the rounding would be trained)")
    loop = Loop(config.epochs, config.batch_size, config.seed)
    per_epoch = loop.steps_per_epoch(len(data))
    device = next(model.parameters()).device
    was_required = [p.requires_grad for p in model.parameters()]
    params = _set_modes(model, _trainable_parts(model, config.trainable))
    decay = config.weight_decay if config.weight_decay is not None else _AUTHORS_WEIGHT_DECAY[config.optimizer]
    if config.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=config.lr, weight_decay=decay)
    else:
        opt = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=decay)
    # x0.1 every lr_step epochs, counted in steps: the loop steps a schedule after every step.
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=(config.lr_step or config.epochs + 1) * per_epoch, gamma=0.1)
    checkpoint = None
    if checkpoint_dir is not None:
        checkpoint = Checkpointing(Path(checkpoint_dir), {"stage": config.identity(), "train_samples": len(data),
                                                          **({} if steps is None else {"steps": steps.to_json()})})
    logits = stages = None
    rate = None if steps is None else RateTerm(steps)
    if teacher is not None:
        teacher.eval()
        stages = decompose(teacher) if config.loss in ("hnd", "ghnd") else None
        if config.loss == "kd":
            # The teacher is frozen in eval mode and the data is not augmented, so its logits are the
            # same every epoch: compute them once, not once per step.
            with torch.no_grad():
                logits = torch.cat([teacher(batch.to(device)) for batch in data.tensors[0].split(256)])

    def step(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        loss = _loss(model, x, y, config, None if logits is None else logits[index.to(device)], stages, rate)
        loss.backward()
        return loss

    try:
        with _progress(progress) as bar:
            run = train_epochs(model, data, loop, step, opt, sched, checkpoint=checkpoint, watch=_Bar(bar, config),
                               label=f"{config.loss}/{config.trainable}")  # fmt: skip
    finally:
        model.eval()
        for p, required in zip(model.parameters(), was_required):
            p.requires_grad_(required)
    return run.losses
