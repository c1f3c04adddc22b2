"""Checkpoint-every-m combined with a storage policy (BitTrain, Sec. 4 and Fig. 11).

The forward keeps only the input of every m-th block (encoded by the policy); backward
recomputes one segment at a time, and that recomputation stores its own saved tensors under the
policy too, so the peak is (segment inputs + one segment), each compressed.

Reentrant checkpointing is used on purpose: it runs the first pass under no_grad and the
recomputation under our hooks, whereas the non-reentrant variant is itself built on
saved_tensors_hooks and would hide the segment's tensors from ours.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..measure.ledger import SavedTensorLedger
from .engine import compress_activations
from .policies import Bitmap, Policy


class CheckpointEvery(nn.Module):
    """Run ``blocks`` in segments of ``every`` blocks, storing only segment inputs for backward.

    The module applies ``policy`` itself (to segment inputs in the forward, and to each
    segment's saved tensors while it is recomputed in backward): call it without an outer
    :func:`edgetorch.compress_activations`. Gradients and batch-norm running statistics are
    identical to running ``blocks`` plainly: recomputation replays the RNG state and does not
    update running statistics a second time (a known wart of plain checkpointing).

    Args:
        blocks: the sequence of blocks (an ``nn.Sequential`` or an iterable of modules).
        every: blocks per segment, ``m`` in the paper's checkpoint-every-m (>= 1).
        policy: storage policy for segment inputs and recomputed segments (default lossless
            :class:`edgetorch.Bitmap`).
        ledger: optional :class:`edgetorch.SavedTensorLedger`; its ``peak_live_bytes`` then
            covers the forward and every recomputation in backward.

    Example:
        >>> model = edgetorch.CheckpointEvery(net.features, every=2)
        >>> loss = model(x).sum(); loss.backward()
    """

    def __init__(
        self,
        blocks: nn.Sequential | Iterable[nn.Module],
        every: int,
        policy: Policy | None = None,
        ledger: SavedTensorLedger | None = None,
    ):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (blocks per segment), got {every!r}")
        self.blocks = blocks if isinstance(blocks, nn.Sequential) else nn.Sequential(*blocks)
        if len(self.blocks) == 0:
            raise ValueError("blocks is empty: give at least one module to run")
        self.every = every
        self.policy = policy if policy is not None else Bitmap()
        self.ledger = ledger

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.blocks(x)
        with compress_activations(self, self.policy, ledger=self.ledger, keep=(x,)):
            for start in range(0, len(self.blocks), self.every):
                segment = self.blocks[start : start + self.every]
                if not x.requires_grad:
                    # Reentrant checkpointing only backpropagates into a segment whose input
                    # requires grad; the detached alias shares the caller's memory.
                    x = x.detach().requires_grad_()
                x = checkpoint(self._run_segment, segment, x, use_reentrant=True)
        return x

    def _run_segment(self, segment: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # the first pass: nothing is saved
            return segment(x)
        with _running_stats_frozen(segment), compress_activations(
            segment, self.policy, ledger=self.ledger
        ):
            return segment(x)


@contextlib.contextmanager
def _running_stats_frozen(module: nn.Module) -> Iterator[None]:
    """Batch norm in train mode, but running statistics left as they are (momentum 0)."""
    norms = [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(norms, saved):
            m.momentum = momentum
            m.num_batches_tracked.copy_(tracked)
