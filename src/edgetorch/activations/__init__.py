"""Autograd integration: which codec stores each tensor saved for backward."""

from .batchnorm import freeze_batchnorm
from .blockplan import BlockChoice, BlockPlan, plan_blocks
from .blocks import PerBlock, Recompute, find_blocks, recomputing
from .budget import Candidate, MemoryPlan, parse_bytes, plan_memory
from .budget_blocks import BlockFit
from .checkpoint import CheckpointEvery, checkpoint_stages, find_stages
from .costs import BlockCosts, FormCost, measure_block_costs
from .engine import compress_activations
from .fidelity import GradientComparison, GradientFidelity, gradient_fidelities, gradient_fidelity
from .graphed import CapturedStep, CaptureError, capture_step
from .policies import POLICIES, BackRazor, Bitmap, Dense, Policy, Quantized
from .specs import parse_policy
from .step import TrainingPolicy, forward_backward, parse_training_policy, step_ledger

__all__ = ["POLICIES", "BackRazor", "Bitmap", "BlockChoice", "BlockCosts", "BlockFit", "BlockPlan", "Candidate", "CaptureError",
           "CapturedStep", "CheckpointEvery", "Dense", "FormCost", "GradientComparison", "GradientFidelity", "MemoryPlan",
           "PerBlock", "Policy", "Quantized", "Recompute", "TrainingPolicy", "capture_step", "checkpoint_stages",
           "compress_activations", "find_blocks", "find_stages", "forward_backward", "freeze_batchnorm",
           "gradient_fidelities", "gradient_fidelity", "measure_block_costs", "parse_bytes", "parse_policy",
           "parse_training_policy", "plan_blocks", "plan_memory", "recomputing", "step_ledger"]
