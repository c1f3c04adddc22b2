"""Figure of a reduction: the per-layer reduction factors (the paper's Fig. 2, for one budget)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..measure.plots import new_figure, save_figure
from .reduction import LayerFactor


def plot_layer_factors(layers: Sequence[LayerFactor], alpha: float, path: str | Path, title: str = "") -> Path:
    """A bar per weight layer: its reduction factor ``alpha_l``, next to the total reduction.

    Args:
        layers: the :attr:`Reduction.layers <edgetorch.reduce.Reduction>` table.
        alpha: the achieved total reduction factor (``Reduction.allocation.alpha``), drawn as a line.
        path: where to write the figure (the suffix picks the format: .png, .pdf, .svg).
        title: figure title.

    Returns:
        The path written.

    Example:
        >>> result = reduce_model(model, 0.8, "lowrank")
        >>> plot_layer_factors(result.layers, result.allocation.alpha, "factors.png")
        PosixPath('factors.png')
    """
    xs, alphas = list(range(len(layers))), [f.alpha for f in layers]
    fig, ax = new_figure((2.5 + 0.7 * len(layers), 3.8))
    ax.bar(xs, alphas, 0.6, label="layer factor alpha_l")
    ax.axhline(alpha, color="black", linestyle="--", linewidth=1, label=f"total alpha {alpha:.3f}")
    ax.set_xticks(xs, [f"{f.layer}\n{f.in_features}x{f.out_features}" for f in layers], fontsize=8)
    ax.set(xlabel="weight layer (units in x out)", ylabel="share of multiplications removed",
           ylim=(min(0.0, *alphas), 1))  # a factored layer near full rank costs more than dense: alpha_l < 0
    ax.legend(fontsize=8, loc="best")
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path, title)
