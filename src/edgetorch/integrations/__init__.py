"""Training-loop integrations: turn an activation policy on for every training step.

* :class:`edgetorch.integrations.lightning.CompressActivations`: a PyTorch Lightning callback.
* :class:`edgetorch.integrations.huggingface.CompressActivations`: a Hugging Face
  ``TrainerCallback``.

Both hold one :class:`StepCompression`, the generic helper any hand-written loop can use too.
Each module imports its framework only when imported itself.
"""

from .step import StepCompression

__all__ = ["StepCompression"]
