"""Layer reduction (Mauch & Yang): per-layer pruning / low-rank factors for a multiplication budget.

``allocate`` solves the allocation problem (eq. 15) on its own; ``reduce`` applies it to a
trained MLP or plain CNN (an ``nn.Sequential`` chain, see ``edgetorch.reduce.sequential``) and
returns a physically smaller network; ``count_macs`` counts multiplications
the paper's way; ``save_reduced`` / ``load_reduced`` store a reduced network without pickle.
"""

from .allocate import SOLVERS, Allocation, allocate, solve_allocation
from .api import ALLOCATIONS, REDUCTIONS, LayerFactor, Reduction, reduce, reduce_model
from .checkpoint import architecture, load_reduced, save_reduced
from .latency import LatencyComparison, compare_latency
from .macs import count_macs
from .sequential import KeepFeatures
from .problem import METHODS

__all__ = [
    "ALLOCATIONS",
    "METHODS",
    "REDUCTIONS",
    "SOLVERS",
    "Allocation",
    "KeepFeatures",
    "LatencyComparison",
    "LayerFactor",
    "Reduction",
    "allocate",
    "architecture",
    "compare_latency",
    "count_macs",
    "load_reduced",
    "reduce",
    "reduce_model",
    "save_reduced",
    "solve_allocation",
]
