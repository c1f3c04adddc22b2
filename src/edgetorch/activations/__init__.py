"""Autograd integration: which codec stores each tensor saved for backward."""

from .batchnorm import freeze_batchnorm
from .budget import Candidate, MemoryPlan, parse_bytes, plan_memory
from .checkpoint import CheckpointEvery
from .engine import compress_activations
from .policies import POLICIES, BackRazor, Bitmap, Dense, Policy, parse_policy

__all__ = ["POLICIES", "BackRazor", "Bitmap", "Candidate", "CheckpointEvery", "Dense", "MemoryPlan", "Policy",
           "compress_activations", "freeze_batchnorm", "parse_bytes", "parse_policy", "plan_memory"]
