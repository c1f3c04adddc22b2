"""Layer reduction (Mauch & Yang): per-layer pruning / low-rank factors for a multiplication budget."""

from .allocate import SOLVERS, Allocation, allocate, solve_allocation
from .problem import METHODS

__all__ = ["METHODS", "SOLVERS", "Allocation", "allocate", "solve_allocation"]
