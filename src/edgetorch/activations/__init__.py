"""Autograd integration: which codec stores each tensor saved for backward."""

from .batchnorm import freeze_batchnorm
from .checkpoint import CheckpointEvery
from .engine import compress_activations
from .policies import POLICIES, BackRazor, Bitmap, Dense, Policy, parse_policy

__all__ = ["POLICIES", "BackRazor", "Bitmap", "CheckpointEvery", "Dense", "Policy", "compress_activations", "freeze_batchnorm",
           "parse_policy"]
