"""The losses the training loop's callers share: cross entropy with the labels, and knowledge distillation."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

#: ``loss(logits, labels, index)``: ``index`` holds the batch's sample positions in the dataset,
#: so a loss can look up per-sample targets computed beforehand (a teacher's logits).
Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The default :data:`Loss`: cross entropy with the hard labels (``index`` unused)."""
    return F.cross_entropy(logits, labels)


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
