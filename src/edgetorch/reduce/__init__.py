"""Layer reduction (Mauch & Yang): per-layer pruning / low-rank factors for a multiplication budget.

``solve_allocation`` solves the allocation problem (eq. 15) on its own; ``reduce_model`` applies it to a
trained MLP or plain CNN (an ``nn.Sequential`` chain, see ``edgetorch.reduce.sequential``), or to
any other CNN by its coupled channel groups (``edgetorch.reduce.grouped``), or to a BERT/ViT
transformer by its attention heads and MLP units (``edgetorch.reduce.transformer``), and returns a
physically smaller network; ``ChainReducer`` reduces one chain at many budgets from statistics
measured once; ``recover`` fine-tunes a reduced network (optionally distilling from the full model);
``count_macs`` counts multiplications the paper's way; ``save`` / ``load`` store a
reduced network without pickle; ``run_reduction`` is the whole ``edgetorch reduce`` job (load,
reduce, count, evaluate, fine-tune, time) as a call that returns its numbers.

One vocabulary throughout: every ``method=`` takes a word of :data:`METHODS` and every
``allocation=`` a word of :data:`ALLOCATIONS`, as do ``edgetorch reduce --method/--allocation``.
"""

from typing import Any

from .allocation import ALLOCATIONS, Allocation, solve_allocation
from .api import LayerFactor, Reduction, reduce_model
from .chain import ChainReducer
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
    "ChainReducer",
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
    "architecture",
    "compare_latency",
    "count_macs",
    "count_transformer_macs",
    "load",
    "recover",
    "reduce_model",
    "reduce_transformer",
    "run_reduction",
    "save",
    "solve_allocation",
]

# Names folded into the record-returning ones (each returned one field of the other): say where.
_FOLDED = {"reduce": "reduce_model(...).model", "allocate": "solve_allocation(...).theta"}


def __getattr__(name: str) -> Any:
    if name in _FOLDED:
        raise AttributeError(f"edgetorch.reduce.{name} was folded into {_FOLDED[name].split('(')[0]}: use "
                             f"{_FOLDED[name]}, which returns the same value")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
