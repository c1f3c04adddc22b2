"""Layer reduction (Mauch & Yang): per-layer pruning / low-rank factors for a multiplication budget.

``allocate`` solves the allocation problem (eq. 15) on its own; ``reduce`` applies it to a
trained MLP or plain CNN (an ``nn.Sequential`` chain, see ``edgetorch.reduce.sequential``), or to
any other CNN by its coupled channel groups (``edgetorch.reduce.grouped``), or to a BERT/ViT
transformer by its attention heads and MLP units (``edgetorch.reduce.transformer``), and returns a
physically smaller network; ``recover`` fine-tunes it afterwards (optionally distilling from the
full model); ``count_macs`` counts multiplications the paper's way; ``save`` / ``load`` store a
reduced network without pickle; ``run_reduction`` is the whole ``edgetorch reduce`` job (load,
reduce, count, evaluate, fine-tune, time) as a call that returns its numbers.

One vocabulary throughout: every ``method=`` takes a word of :data:`METHODS` and every
``allocation=`` a word of :data:`ALLOCATIONS`, as do ``edgetorch reduce --method/--allocation``.
"""

from .allocate import ALLOCATIONS, Allocation, allocate, solve_allocation
from .api import LayerFactor, Reduction, reduce, reduce_model
from .grouped import GroupFactor
from .checkpoint import architecture, load, save
from .latency import LatencyComparison, compare_latency
from .macs import count_macs
from .problem import METHODS
from .recover import RecoverConfig, RecoverHistory, recover
from .sequential import KeepFeatures
from .transformer import TransformerReduction, count_transformer_macs, reduce_transformer
from .workflow import ReduceJob, ReduceRun, run_reduction

__all__ = [
    "ALLOCATIONS",
    "METHODS",
    "Allocation",
    "GroupFactor",
    "KeepFeatures",
    "LatencyComparison",
    "LayerFactor",
    "RecoverConfig",
    "RecoverHistory",
    "ReduceJob",
    "ReduceRun",
    "Reduction",
    "TransformerReduction",
    "allocate",
    "architecture",
    "compare_latency",
    "count_macs",
    "count_transformer_macs",
    "load",
    "recover",
    "reduce",
    "reduce_model",
    "reduce_transformer",
    "run_reduction",
    "save",
    "solve_allocation",
]
