"""The one supervised training loop: zoo pretraining and fine-tuning after reduction both run it.

:func:`fit` is AdamW with a one-cycle learning-rate schedule over full batches in a seeded order;
the loss is cross entropy unless the caller passes another one, such as :func:`kd_loss` against
a teacher's logits (distillation). It lives here, below ``reduce`` and ``split``, so that both
may use it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

log = logging.getLogger(__name__)

#: ``loss(logits, labels, index)``: ``index`` holds the batch's sample positions in the dataset,
#: so a loss can look up per-sample targets computed beforehand (a teacher's logits).
Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Schedule(Protocol):
    """What :func:`fit` reads from a config (``PretrainConfig`` and ``FinetuneConfig`` have it)."""

    epochs: int
    lr: float
    batch_size: int
    seed: int
    weight_decay: float


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The default :data:`Loss`: cross entropy with the hard labels (``index`` unused)."""
    return F.cross_entropy(logits, labels)


def fit(model: nn.Module, data: TensorDataset, schedule: Schedule, loss: Loss = cross_entropy,
        after_epoch: Callable[[int, float], None] | None = None, label: str = "model") -> float:
    """Train ``model`` in place: AdamW, one-cycle learning rate, full batches in a seeded order.

    The last partial batch of each epoch is dropped, so every step sees ``batch_size`` samples.
    Batch order comes from ``schedule.seed`` alone (the global RNG only feeds the model's own
    randomness, e.g. dropout).

    Args:
        model: the network (left in training mode).
        data: ``(images, labels)`` tensors.
        schedule: epochs, peak learning rate, batch size, seed, weight decay.
        loss: ``loss(logits, labels, index)`` (default: cross entropy).
        after_epoch: called with ``(epoch, mean train loss)`` after each epoch (1-based epoch);
            a callback that evaluates should restore training mode (``evaluate_accuracy`` does).
        label: names the run in the log.

    Returns:
        The mean training loss of the last epoch.

    Raises:
        ValueError: fewer samples than one batch.

    Example:
        >>> fit(model, TensorDataset(x, y), PretrainConfig("mlp", "digits", epochs=1))
        0.93...
    """
    images, labels = data.tensors
    steps_per_epoch = len(labels) // schedule.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(labels)} training samples is less than one batch of {schedule.batch_size}")
    opt = torch.optim.AdamW(model.parameters(), lr=schedule.lr, weight_decay=schedule.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=schedule.lr,
                                                total_steps=schedule.epochs * steps_per_epoch)
    order = torch.Generator().manual_seed(schedule.seed)
    model.train()
    mean = 0.0
    for epoch in range(1, schedule.epochs + 1):
        perm = torch.randperm(len(labels), generator=order)
        total = 0.0
        for step in range(steps_per_epoch):
            idx = perm[step * schedule.batch_size : (step + 1) * schedule.batch_size]
            value = loss(model(images[idx]), labels[idx], idx)
            opt.zero_grad(set_to_none=True)
            value.backward()
            opt.step()
            sched.step()
            total += value.item()
        mean = total / steps_per_epoch
        log.info("%s epoch %d/%d: train loss %.4f", label, epoch, schedule.epochs, mean)
        if after_epoch is not None:
            after_epoch(epoch, mean)
    return mean


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
            alpha: float = 0.5, tau: float = 1.0) -> torch.Tensor:  # fmt: skip
    """Eq. 6-7 (Hinton et al.): ``alpha * CE(s, y) + (1 - alpha) * tau^2 * KL(p || q)``.

    ``p = softmax(t / tau)`` is the teacher's soft target and ``q = softmax(s / tau)`` the
    student's; the KL divergence is averaged over the batch, as cross entropy is.

    Args:
        student_logits: ``[N, classes]``.
        teacher_logits: ``[N, classes]`` (treated as constants).
        labels: ``[N]`` int class labels.
        alpha: weight of the hard-label cross entropy, in [0, 1] (BottleFit: 0.5).
        tau: temperature > 0 (BottleFit: 1).

    Returns:
        A scalar loss.

    Raises:
        ValueError: ``alpha`` outside [0, 1], ``tau`` not positive, or mismatched logit shapes.
    """
    if not 0.0 <= alpha <= 1.0 or not tau > 0:
        raise ValueError(f"need 0 <= alpha <= 1 and tau > 0, got alpha={alpha}, tau={tau}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {list(student_logits.shape)} vs teacher {list(teacher_logits.shape)}")
    hard = F.cross_entropy(student_logits, labels)
    log_q = F.log_softmax(student_logits / tau, dim=1)
    p = F.softmax(teacher_logits.detach() / tau, dim=1)
    soft = F.kl_div(log_q, p, reduction="batchmean")
    return alpha * hard + (1.0 - alpha) * tau**2 * soft
