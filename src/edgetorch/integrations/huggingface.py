"""Hugging Face Transformers: ``Trainer(..., callbacks=[CompressActivations(edgetorch.BackRazor(0.9))])``."""

from __future__ import annotations

try:
    from transformers import TrainerCallback
except ImportError as error:
    raise ImportError(f"edgetorch.integrations.huggingface is a callback for Hugging Face Transformers' Trainer, "
                      f"which is not installed ({error}): pip install transformers  (or: pip install 'edgetorch[hf]')"
                      ) from error

from ..activations import Policy
from .step import StepCompression


class CompressActivations(TrainerCallback):
    """Store the activations of every training step under ``policy``.

    ``TrainerCallback`` has no hook between forward and backward, so compression spans the
    whole step (``on_step_begin`` to ``on_step_end``, all gradient-accumulation micro-batches
    included): the saved tensors are the same, backward only passes through the hooks.

    Args:
        policy: e.g. ``edgetorch.BackRazor(0.9)``.
        track: keep the last step's ledger in ``.step.ledger``.

    Example:
        >>> trainer = Trainer(model, args, train_dataset=ds,
        ...                   callbacks=[CompressActivations(edgetorch.BackRazor(0.9))])
    """

    def __init__(self, policy: Policy, *, track: bool = False):
        self.step = StepCompression(policy, track=track)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("the Trainer passed no model to on_step_begin; cannot compress activations")
        self.step.start(model)

    def on_step_end(self, args, state, control, **kwargs):
        self.step.stop()

    def on_train_end(self, args, state, control, **kwargs):
        self.step.stop()
