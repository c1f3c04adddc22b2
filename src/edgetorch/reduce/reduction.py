"""What a reduction returns: the smaller model with its allocation, per weight layer or per channel group."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .allocation import Allocation
from .grouped import GroupFactor


@dataclass(frozen=True)
class LayerFactor:
    """One weight layer of the reduction.

    Attributes:
        layer: weight layer number l (1-based, as in the paper).
        in_features, out_features: ``M_{l-1}``, ``M_l`` of the full layer, in units (features,
            or channels of a convolution and of a Linear after a convolution's Flatten).
        kept_inputs: ``M~_{l-1}`` (pruning) -- ``None`` for low-rank.
        rank: ``k_l`` (low-rank; ``K_l`` means kept dense) -- ``None`` for pruning.
        macs: multiplications of the reduced layer per sample.
        alpha: the layer's reduction factor ``1 - macs / full macs`` (eq. 5, 6, 10).
        error: ``J_l`` at the chosen value.
        name: the layer's qualified name in the model (``"3"``, ``"classifier.1"``, ``"layer1.0.conv1"``).
    """

    layer: int
    in_features: int
    out_features: int
    kept_inputs: int | None
    rank: int | None
    macs: int
    alpha: float
    error: float
    name: str = ""


@dataclass(frozen=True)
class Reduction:
    """The reduced model with its allocation and per-layer factors.

    Attributes:
        model: the smaller model (eval mode).
        method: one of :data:`~edgetorch.reduce.METHODS`.
        allocation: the solver's record.
        layers: one :class:`LayerFactor` per weight layer of a chain, or per factorable layer of any
            other network under low-rank (empty for a grouped reduction).
        groups: one :class:`~edgetorch.reduce.grouped.GroupFactor` per channel group of a network
            that is not a chain (empty for a chain), in the order of ``allocation.theta``.
    """

    model: nn.Module
    method: str
    allocation: Allocation
    layers: list[LayerFactor]
    groups: list[GroupFactor] = field(default_factory=list)
