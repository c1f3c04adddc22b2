"""Autograd integration: which codec stores each tensor saved for backward."""

from .checkpoint import CheckpointEvery
from .engine import compress_activations
from .policies import POLICIES, Bitmap, Dense, Policy, parse_policy

__all__ = ["POLICIES", "Bitmap", "CheckpointEvery", "Dense", "Policy", "compress_activations", "parse_policy"]
