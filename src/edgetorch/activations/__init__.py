"""Autograd integration: which codec stores each tensor saved for backward."""

from .batchnorm import freeze_batchnorm
from .budget import Candidate, MemoryPlan, parse_bytes, plan_memory
from .checkpoint import CheckpointEvery, checkpoint_stages, find_stages
from .engine import compress_activations
from .fidelity import GradientComparison, GradientFidelity, gradient_fidelity
from .graphed import CapturedStep, CaptureError, capture_step
from .policies import POLICIES, BackRazor, Bitmap, Dense, Policy, Quantized, parse_policy
from .step import TrainingPolicy, forward_backward, parse_training_policy, step_ledger

__all__ = ["POLICIES", "BackRazor", "Bitmap", "Candidate", "CaptureError", "CapturedStep", "CheckpointEvery", "Dense",
           "GradientComparison", "GradientFidelity", "MemoryPlan", "Policy", "Quantized", "TrainingPolicy",
           "capture_step", "checkpoint_stages", "compress_activations", "find_stages", "forward_backward",
           "freeze_batchnorm", "gradient_fidelity", "parse_bytes", "parse_policy", "parse_training_policy",
           "plan_memory", "step_ledger"]
