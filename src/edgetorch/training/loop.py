"""The one training loop: zoo pretraining, fine-tuning after reduction, BottleFit's stages and
``edgetorch finetune`` all run :func:`train_epochs`.

What the loop fixes, so that no caller decides it again:

* **Batch order.** Epoch ``e`` (0-based) visits the samples in the ``e``-th permutation drawn from
  a ``torch.Generator`` seeded with ``Loop.seed``; nothing else draws from that generator. A run
  resumed after epoch ``e`` draws (and skips) ``e`` permutations first, so it sees the batches an
  uninterrupted run would. The global RNG is left to the model (dropout).
* **Batches.** Consecutive slices of the epoch's order; what happens to the last partial slice is
  the run's :class:`LastBatch` choice.
* **Steps.** Gradients are freed before each step (``zero_grad(set_to_none=True)``), the
  :data:`Step` runs forward and backward, then the optimizer steps and the schedule steps (once
  per step: a per-epoch schedule is a per-step one with a longer period).
* **Divergence.** A loss that is not finite stops the run with :class:`TrainingDiverged`; the
  checkpoint, if any, keeps the last finished epoch.
* **Checkpoints** (:mod:`edgetorch.training.checkpoint`): one format, written after every epoch,
  holding the CPU and CUDA RNG states too.

Model modes are the caller's: the loop never calls ``model.train()``, because a stage that trains
part of a model keeps the frozen rest in eval mode.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .._checks import check_positive_int
from ..errors import EdgetorchError
from . import checkpoint as checkpoints
from .losses import Loss, cross_entropy

log = logging.getLogger(__name__)

#: ``step(images, labels, index) -> loss``: run forward and backward on one batch (on the model's
#: device) and return the loss. ``index`` holds the batch's sample positions in the dataset, so a
#: loss can look up per-sample targets computed beforehand (a teacher's logits).
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TrainingDiverged(EdgetorchError, FloatingPointError):
    """The training loss became inf or NaN; every later step would train on garbage."""


class LastBatch(enum.Enum):
    """What a run does with the last partial batch of an epoch."""

    #: Leave it out: every step has ``batch_size`` samples (a different few are unseen each epoch).
    DROP = "drop"
    #: Fill it up with samples from the start of the epoch's order: every sample is used every
    #: epoch and every step is full (what a fine-tune on a few hundred images needs; with fewer
    #: samples than a batch, one step sees them all).
    FILL = "fill"
    #: Train on it as it is (Keras' and ``DataLoader``'s default).
    KEEP = "keep"


@dataclass(frozen=True)
class Loop:
    """How the data is walked.

    Attributes:
        epochs: passes over the data.
        batch_size: samples per step.
        seed: the batch order (see the module docstring).
        last_batch: what happens to the last partial batch of each epoch.
    """

    epochs: int
    batch_size: int
    seed: int = 0
    last_batch: LastBatch = LastBatch.DROP

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            check_positive_int(name, getattr(self, name))
        if not isinstance(self.last_batch, LastBatch):
            raise TypeError(f"last_batch must be a LastBatch ({', '.join(m.name for m in LastBatch)}), "
                            f"got {self.last_batch!r}")

    def steps_per_epoch(self, samples: int) -> int:
        """Optimizer steps in one epoch over ``samples`` samples.

        Raises:
            ValueError: fewer samples than one batch under ``LastBatch.DROP``.
        """
        if self.last_batch is not LastBatch.DROP:
            return -(-samples // self.batch_size)
        steps = samples // self.batch_size
        if steps == 0:
            raise ValueError(f"{samples} training samples is less than one batch of {self.batch_size}")
        return steps


def epoch_orders(samples: int, loop: Loop) -> Iterator[list[torch.Tensor]]:
    """Each epoch's batches of sample indices, epoch after epoch (the one batch-order rule).

    Example:
        >>> orders = epoch_orders(10, Loop(epochs=2, batch_size=4))
        >>> [len(b) for b in next(orders)]
        [4, 4]
    """
    generator = torch.Generator().manual_seed(loop.seed)
    while True:
        order = torch.randperm(samples, generator=generator)
        if loop.last_batch is LastBatch.FILL and samples > loop.batch_size:
            order = torch.cat([order, order[: -samples % loop.batch_size]])
        yield list(order.split(loop.batch_size))[: loop.steps_per_epoch(samples)]


#: The fields of every epoch record; a :class:`Watch` adds its ``measures``.
RECORD_FIELDS = ("epoch", "train_loss", "seconds", "images_per_second")


class Watch:
    """What a caller sees of a run; override the methods it needs (each default does nothing)."""

    #: The fields :meth:`measure` adds to every epoch record (a resumed history must have them).
    measures: tuple[str, ...] = ()

    def epoch_started(self, epoch: int) -> None:
        """Before the first step of ``epoch`` (1-based)."""

    def step_done(self, epoch: int, step: int, steps: int, loss: float, images_per_second: float) -> None:
        """After each optimizer step (``step`` of ``steps``, 1-based)."""

    def measure(self, record: dict[str, Any]) -> None:
        """After an epoch's last step, before its checkpoint: add fields to ``record`` (validation
        accuracy, a measured peak); they are saved in the checkpoint's history."""

    def epoch_done(self, history: list[dict[str, Any]]) -> None:
        """After the epoch's checkpoint is written; ``history`` holds every epoch's record so far
        (resumed ones included), this epoch's last."""


@dataclass(frozen=True)
class Checkpointing:
    """Where a run checkpoints, and what a checkpoint must match to be resumed.

    Attributes:
        directory: written after every epoch, resumed from when it holds a checkpoint.
        identity: JSON data that names the run (its config, data size, model); a checkpoint of
            another identity raises instead of resuming.
        extends: the identity of a finished run of fewer epochs that this run continues
            (its checkpoint is resumed, its schedule starts again: see ``checkpoints.resume``).
    """

    directory: Path
    identity: Mapping[str, Any]
    extends: Mapping[str, Any] | None = None


@dataclass
class TrainRun:
    """What :func:`train_epochs` did.

    Attributes:
        history: one record per epoch, resumed ones included: ``epoch`` (1-based), ``train_loss``
            (the mean over the epoch's steps), ``seconds`` (wall time of its steps),
            ``images_per_second``, and whatever :meth:`Watch.measure` added.
        resumed_from: the epoch a checkpoint was resumed after (0: a fresh run).
        step_losses: the loss of every step this call trained, in order (not those of resumed
            epochs): the loop reads each loss to the host once, so a caller need not again.
    """

    history: list[dict[str, Any]] = field(default_factory=list)
    resumed_from: int = 0
    step_losses: list[float] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        """The mean training loss of each epoch."""
        return [record["train_loss"] for record in self.history]


def train_epochs(model: nn.Module, data: Dataset, loop: Loop, step: Step, optimizer: torch.optim.Optimizer,
                 schedule: torch.optim.lr_scheduler.LRScheduler | None = None, *,
                 checkpoint: Checkpointing | None = None, watch: Watch | None = None,
                 label: str = "model") -> TrainRun:  # fmt: skip
    """Train ``model`` in place for ``loop.epochs`` epochs (see the module docstring for the rules).

    Args:
        model: the network, in the modes the caller wants (the loop does not change them).
        data: ``(image, label)`` samples. A ``TensorDataset`` is indexed directly (its tensors may
            live on the GPU); any other dataset is read through a ``DataLoader``. Batches are
            moved to the model's device.
        loop: epochs, batch size, seed, last-batch rule.
        step: forward and backward of one batch (:func:`supervised` makes one from a loss).
        optimizer: over the parameters that train.
        schedule: stepped after every optimizer step (``None``: a constant learning rate).
        checkpoint: write a checkpoint after every epoch and resume from one found there.
        watch: progress and per-epoch measurements.
        label: names the run in the log.

    Returns:
        The :class:`TrainRun`.

    Raises:
        ValueError: fewer samples than a batch under ``LastBatch.DROP``, or no samples.
        TrainingDiverged: the loss became inf or NaN.
        CheckpointError: the checkpoint belongs to another run or is damaged.

    Example:
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> run = train_epochs(model, TensorDataset(x, y), Loop(epochs=2, batch_size=32), supervised(model), opt)
        >>> len(run.history)
        2
    """
    if len(data) == 0:
        raise ValueError("no training samples")
    watch = watch or Watch()
    device = next(model.parameters()).device
    schedule = schedule or torch.optim.lr_scheduler.LambdaLR(optimizer, _constant)
    run = TrainRun()
    if checkpoint is not None:
        state = checkpoints.resume(checkpoint.directory, checkpoint.identity, model, optimizer, schedule, loop.epochs,
                                   (*RECORD_FIELDS, *watch.measures), checkpoint.extends)
        if state is not None:
            run.resumed_from, run.history = state.epoch, state.history
    orders = epoch_orders(len(data), loop)
    for _ in range(run.resumed_from):
        next(orders)  # the batch order of an epoch depends on the draws before it, not on a clock
    for epoch in range(run.resumed_from + 1, loop.epochs + 1):
        batches = next(orders)
        watch.epoch_started(epoch)
        record = _epoch(model, data, batches, step, optimizer, schedule, epoch, device, watch, run.step_losses)
        log.info("%s epoch %d/%d: train loss %.4f", label, epoch, loop.epochs, record["train_loss"])
        watch.measure(record)
        if set(record) != {*RECORD_FIELDS, *watch.measures}:
            raise TypeError(f"{type(watch).__name__}.measure added {sorted(set(record) - set(RECORD_FIELDS))}, "
                            f"not its measures {list(watch.measures)}")
        run.history.append(record)
        if checkpoint is not None:
            checkpoints.save(checkpoint.directory, checkpoint.identity, model, optimizer, schedule, run.history)
        watch.epoch_done(run.history)
    return run


def supervised(model: nn.Module, loss: Loss = cross_entropy) -> Step:
    """The :data:`Step` of plain supervised training: ``loss(model(x), y, index).backward()``.

    Args:
        model: the network.
        loss: ``loss(logits, labels, index)`` (default: cross entropy with the labels).

    Returns:
        The step.
    """
    def step(images: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        value = loss(model(images), labels, index)
        value.backward()
        return value

    return step


def _constant(_: int) -> float:
    return 1.0


def _batches(data: Dataset, batches: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    if isinstance(data, TensorDataset):
        images, labels = data.tensors
        for index in batches:
            where = index.to(images.device)
            yield images[where], labels[where], index
    else:
        # A generator of its own: the loader draws a worker seed per epoch, which would otherwise
        # come from the global RNG that the model's dropout draws from.
        loader = DataLoader(data, batch_sampler=[index.tolist() for index in batches], generator=torch.Generator())
        for index, (images, labels) in zip(batches, loader):
            yield images, labels, index


def _epoch(model: nn.Module, data: Dataset, batches: list[torch.Tensor], step: Step, optimizer, schedule,
           epoch: int, device: torch.device, watch: Watch, losses: list[float]) -> dict[str, Any]:
    total, seen, start = 0.0, 0, time.perf_counter()
    for number, (images, labels, index) in enumerate(_batches(data, batches), 1):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        value = step(images, labels, index).item()
        if not math.isfinite(value):
            raise TrainingDiverged(f"the training loss is {value} at epoch {epoch}, step {number}: training diverged; "
                                   f"lower the learning rate (lr={optimizer.param_groups[0]['lr']:g})")
        optimizer.step()
        schedule.step()
        losses.append(value)
        total += value
        seen += len(labels)
        watch.step_done(epoch, number, len(batches), total / number, seen / (time.perf_counter() - start))
    optimizer.zero_grad(set_to_none=True)  # no gradients held through validation or the checkpoint
    seconds = time.perf_counter() - start
    return {"epoch": epoch, "train_loss": total / len(batches), "seconds": seconds, "images_per_second": seen / seconds}


def one_cycle_adamw(model: nn.Module, loop: Loop, samples: int, lr: float,
                    weight_decay: float) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:  # fmt: skip
    """The zoo's recipe (pretraining and fine-tuning after reduction): AdamW, one-cycle learning rate.

    Args:
        model: every parameter trains.
        loop: the run (its steps set the schedule's length).
        samples: training samples.
        lr: the schedule's peak learning rate.
        weight_decay: AdamW's decoupled weight decay.

    Returns:
        ``(optimizer, schedule)`` for :func:`train_epochs`.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    total = loop.epochs * loop.steps_per_epoch(samples)
    return optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total)
