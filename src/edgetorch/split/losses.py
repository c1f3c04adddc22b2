"""BottleFit's training losses: (generalised) head network distillation and knowledge distillation."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def ghnd_loss(student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor]) -> torch.Tensor:
    """Eq. 4: sum over matched layers of the squared error between student and teacher outputs.

    Each term is a mean over elements (``F.mse_loss``), and every balancing factor lambda is 1 as in
    the paper. The mean rather than the paper's plain sum of squares keeps terms of very different
    sizes (a 128x28x28 decoder output vs a 512x7x7 block output) on a comparable scale; with Adam
    the overall scale of the loss does not change the updates. Head network distillation (HND) is
    this loss with only the first pair (the decoder output vs the teacher's front output).

    Args:
        student: the student's outputs ``[decoder, block..., ]`` (same length as ``teacher``).
        teacher: the teacher's outputs at the same places (no gradient needed).

    Returns:
        A scalar loss.

    Raises:
        ValueError: the sequences differ in length, are empty, or a pair differs in shape.

    Example:
        >>> a, b = torch.zeros(2, 3), torch.ones(2, 3)
        >>> float(ghnd_loss([a, a], [b, a]))
        1.0
    """
    if len(student) != len(teacher) or not student:
        raise ValueError(f"need equally many (>= 1) student and teacher outputs, got {len(student)} and {len(teacher)}")
    total = student[0].new_zeros(())
    for s, t in zip(student, teacher):
        if s.shape != t.shape:
            raise ValueError(f"student output {list(s.shape)} does not match teacher output {list(t.shape)}")
        total = total + F.mse_loss(s, t.detach())
    return total


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
            alpha: float = 0.5, tau: float = 1.0) -> torch.Tensor:  # fmt: skip
    """Eq. 6-7 (Hinton et al.): ``alpha * CE(s, y) + (1 - alpha) * tau^2 * KL(p || q)``.

    ``p = softmax(t / tau)`` is the teacher's soft target and ``q = softmax(s / tau)`` the
    student's; the KL divergence is averaged over the batch, as cross entropy is.

    Args:
        student_logits: ``[N, classes]``.
        teacher_logits: ``[N, classes]`` (treated as constants).
        labels: ``[N]`` int class labels.
        alpha: weight of the hard-label cross entropy, in [0, 1] (paper: 0.5).
        tau: temperature > 0 (paper: 1).

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
