"""Fine-tuning after reduction: recover accuracy on labelled data, optionally distilling from the full model.

The paper reduces without retraining; a user who has the training data recovers most of what an
aggressive reduction loses with a short fine-tune. :func:`recover` runs the same loop that
pretrains the zoo (:func:`edgetorch.training.train_epochs` with :func:`~edgetorch.training.one_cycle_adamw`) on any model, reduced by edgetorch or by
another library, so methods compared with it get equal fine-tuning. With ``distill=True`` the
loss is :func:`~edgetorch.training.kd_loss` against the unreduced model's logits (the
teacher), computed once before training: the teacher is frozen and in eval mode, and the data is
not augmented, so its logits per sample never change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import TensorDataset

from .._checks import check_positive_int
from ..training import Loop, Watch, cross_entropy, evaluate_accuracy, kd_loss, one_cycle_adamw, seeded, supervised, train_epochs


@dataclass(frozen=True)
class RecoverConfig:
    """How a reduced model is fine-tuned.

    Attributes:
        epochs: passes over the training data.
        lr: peak learning rate of the one-cycle AdamW schedule (a third of pretraining's: the
            weights start trained).
        batch_size: samples per step (the last partial batch of each epoch is dropped).
        seed: batch order, and the model's own randomness (dropout) during training.
        weight_decay: AdamW decoupled weight decay.
        distill: train against the teacher's logits too (:func:`kd_loss`); needs a teacher.
        kd_alpha: weight of the hard-label cross entropy in the distillation loss, in [0, 1].
        tau: distillation temperature > 0.
    """

    epochs: int = 1
    lr: float = 1e-3
    batch_size: int = 64
    seed: int = 0
    weight_decay: float = 1e-4
    distill: bool = False
    kd_alpha: float = 0.5
    tau: float = 1.0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            check_positive_int(name, getattr(self, name))
        if not (self.lr > 0 and self.weight_decay >= 0):
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got lr={self.lr}, weight_decay={self.weight_decay}")
        if not 0.0 <= self.kd_alpha <= 1.0 or not self.tau > 0:
            raise ValueError(f"need 0 <= kd_alpha <= 1 and tau > 0, got kd_alpha={self.kd_alpha}, tau={self.tau}")


@dataclass
class RecoverHistory:
    """What :func:`recover` measured.

    Attributes:
        accuracy_before: test accuracy before fine-tuning (``None`` without test data).
        accuracy: test accuracy after each epoch (empty without test data).
        train_loss: mean training loss of each epoch.
        seconds: wall time of the training (teacher logits included, evaluation not).
    """

    accuracy_before: float | None
    accuracy: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def accuracy_after(self) -> float | None:
        """Test accuracy after the last epoch (``None`` without test data)."""
        return self.accuracy[-1] if self.accuracy else None


class _Evaluating(Watch):
    """Records each epoch's loss and test accuracy, and the time evaluation took (not training's)."""

    def __init__(self, history: RecoverHistory, model: nn.Module, test: TensorDataset | None) -> None:
        self.history, self.model, self.test, self.seconds = history, model, test, 0.0

    def measure(self, record: dict) -> None:
        self.history.train_loss.append(record["train_loss"])
        if self.test is not None:
            began = time.perf_counter()
            self.history.accuracy.append(evaluate_accuracy(self.model, self.test))
            self.seconds += time.perf_counter() - began


@torch.no_grad()
def _logits(model: nn.Module, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    was_training = model.training
    model.eval()
    try:
        return torch.cat([model(x) for x in images.split(batch_size)])
    finally:
        model.train(was_training)


def recover(model: nn.Module, train: TensorDataset, config: RecoverConfig = RecoverConfig(),
             teacher: nn.Module | None = None, test: TensorDataset | None = None) -> RecoverHistory:
    """Fine-tune ``model`` in place on labelled data, optionally distilling from ``teacher``.

    Args:
        model: the reduced network (any ``nn.Module`` classifier returning logits).
        train: ``(images, labels)`` tensors shaped for ``model`` (grey images for an RGB model:
            :func:`edgetorch.zoo.registry.with_channels`).
        config: epochs, learning rate, distillation ...
        teacher: the unreduced model; required when ``config.distill``, unused otherwise.
        test: ``(images, labels)`` evaluated before training and after every epoch.

    Returns:
        The :class:`RecoverHistory`; ``model`` is left in eval mode.

    Raises:
        ValueError: ``config.distill`` without a teacher, or fewer training samples than a batch.

    Example:
        >>> history = recover(reduce_model(model, 0.7, "prune-ls", calibration=x).model, train,
        ...                    RecoverConfig(epochs=2, distill=True), teacher=model, test=test)
        >>> history.accuracy_after >= history.accuracy_before
        True
    """
    if config.distill and teacher is None:
        raise ValueError("distill=True needs the unreduced model as teacher=")
    if len(train) < config.batch_size:
        raise ValueError(f"{len(train)} training samples is less than one batch of {config.batch_size}")
    history = RecoverHistory(evaluate_accuracy(model, test) if test is not None else None)
    start = time.perf_counter()
    if config.distill:
        targets = _logits(teacher, train.tensors[0])

        def loss(logits: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            return kd_loss(logits, targets[index], labels, config.kd_alpha, config.tau)
    else:
        loss = cross_entropy

    evaluating = _Evaluating(history, model, test)
    loop = Loop(config.epochs, config.batch_size, config.seed)
    optimizer, schedule = one_cycle_adamw(model, loop, len(train), config.lr, config.weight_decay)
    model.train()
    with seeded(config.seed, next(model.parameters()).device):  # dropout draws from the seed, not the caller's RNG
        train_epochs(model, train, loop, supervised(model, loss), optimizer, schedule, watch=evaluating,
                     label=f"fine-tune {type(model).__name__}")  # fmt: skip
    history.seconds = time.perf_counter() - start - evaluating.seconds
    model.eval()
    return history
