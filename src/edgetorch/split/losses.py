"""BottleFit's training losses: (generalised) head network distillation, and knowledge distillation (``kd_loss``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# kd_loss lives with the training loop (edgetorch.training), below split and reduce, so that reduce can distil too.
from ..training import kd_loss

__all__ = ["ghnd_loss", "kd_loss"]


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
