"""Measured CPU inference latency of a reduced network against the full one (a ratio, one run).

Fewer multiplications do not always mean less time (two thin layers launch two kernels, small
matrices use the cores poorly), so the time is measured, never inferred from MACs. The two models
run interleaved, round after round (:func:`edgetorch.measure.interleave`, the order rotated so
that each goes first in every other round), so that load from other processes hits both alike;
the ratio of medians is reported.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch import nn

from ..measure.timing import interleave


@dataclass(frozen=True)
class LatencyComparison:
    """Median seconds per forward pass of each model and their ratio (reduced / full)."""

    full_seconds: float
    reduced_seconds: float
    rounds: int

    @property
    def ratio(self) -> float:
        """``reduced / full``: below 1 means the reduced network is faster."""
        return self.reduced_seconds / self.full_seconds


@torch.inference_mode()
def compare_latency(full: nn.Module, reduced: nn.Module, example: torch.Tensor,
                    rounds: int = 30, warmup: int = 3) -> LatencyComparison:
    """Time ``full(example)`` and ``reduced(example)`` interleaved; medians over ``rounds``.

    Args:
        full: the original network.
        reduced: the reduced network.
        example: the input batch both are timed on.
        rounds: timed forward passes per model.
        warmup: untimed passes per model first (allocator, kernel selection).

    Returns:
        The medians and their ratio.

    Raises:
        ValueError: ``rounds`` below 1 or ``warmup`` below 0.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1 and warmup >= 0, got {rounds}, {warmup}")
    full.eval(), reduced.eval()
    for _ in range(warmup):
        full(example), reduced(example)
    times = interleave({"full": lambda: full(example), "reduced": lambda: reduced(example)}, rounds, rotate=True)
    return LatencyComparison(statistics.median(times["full"]), statistics.median(times["reduced"]), rounds)
