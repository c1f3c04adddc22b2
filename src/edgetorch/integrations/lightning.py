"""PyTorch Lightning: ``Trainer(callbacks=[CompressActivations(edgetorch.BackRazor(0.9))])``."""

from __future__ import annotations

try:
    from pytorch_lightning import Callback
except ImportError:  # the unified `lightning` package ships the same class
    try:
        from lightning.pytorch import Callback
    except ImportError as error:
        raise ImportError(f"edgetorch.integrations.lightning is a callback for PyTorch Lightning's Trainer, which is "
                          f"not installed ({error}): pip install lightning  (or: pip install pytorch-lightning)"
                          ) from error

from ..activations import Policy
from .step import StepCompression


class CompressActivations(Callback):
    """Store the activations of every training step under ``policy``.

    The forward runs between ``on_train_batch_start`` and ``on_before_backward``; the callback
    compresses exactly that span (and closes it at batch end if no backward ran, e.g. under
    manual optimisation that skipped a step).

    Args:
        policy: e.g. ``edgetorch.BackRazor(0.9)``.
        track: keep the last step's ledger in ``.step.ledger``.

    Example:
        >>> trainer = pl.Trainer(callbacks=[CompressActivations(edgetorch.BackRazor(0.9))])
    """

    def __init__(self, policy: Policy, *, track: bool = False):
        self.step = StepCompression(policy, track=track)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step.start(pl_module)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.step.stop()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step.stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.step.stop()
