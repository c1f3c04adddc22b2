"""The piece every training-loop integration shares: compress one step's forward, then stop."""

from __future__ import annotations

from torch import nn

from ..activations import Policy, compress_activations
from ..measure import SavedTensorLedger


class StepCompression:
    """Start :func:`edgetorch.compress_activations` at a step's start, stop it after the forward.

    Frameworks call the forward and backward themselves; they offer hooks around them. Call
    :meth:`start` before the forward and :meth:`stop` once the loss exists (stopping later, after
    backward, is also correct: it only costs the hooks' overhead during backward).

    Args:
        policy: e.g. ``edgetorch.BackRazor(0.9)`` or ``edgetorch.Bitmap()``.
        track: keep a :class:`edgetorch.SavedTensorLedger` of the last step in ``.ledger``.

    Example:
        >>> step = StepCompression(edgetorch.BackRazor(0.9))
        >>> for x, y in loader:
        ...     step.start(model)
        ...     loss = criterion(model(x), y)
        ...     step.stop()
        ...     loss.backward(); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, policy: Policy, *, track: bool = False):
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be an edgetorch Policy (e.g. edgetorch.BackRazor(0.9)), got {policy!r}")
        self.policy, self.track = policy, track
        self.ledger: SavedTensorLedger | None = None
        self.steps = 0
        self._active: compress_activations | None = None

    def start(self, model: nn.Module) -> None:
        """Begin compressing what ``model``'s forward saves (a running step is stopped first)."""
        self.stop()
        self.ledger = SavedTensorLedger() if self.track else None
        self._active = compress_activations(model, self.policy, ledger=self.ledger)
        self._active.__enter__()

    def stop(self) -> None:
        """End the step's compression; safe to call when none is running."""
        if self._active is not None:
            active, self._active = self._active, None
            active.__exit__(None, None, None)
            self.steps += 1
