"""Figures of memory results, and the two helpers every edgetorch figure is made with.

Figures are built on ``matplotlib.figure.Figure`` directly, never through ``pyplot``: no
backend is chosen (``matplotlib.use("Agg")`` would switch the whole process's, a notebook's
included), no figure is registered globally, and nothing needs a display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_PARTS = [
    ("parameter_bytes", "parameters"),
    ("gradient_bytes", "gradients"),
    ("optimizer_state_bytes", "optimizer state"),
    ("activation_bytes", "saved activations (ledger)"),
]


def new_figure(figsize: tuple[float, float], nrows: int = 1, ncols: int = 1, squeeze: bool = True) -> tuple[Any, Any]:
    """A figure and its axes, outside pyplot (see the module docstring).

    Args:
        figsize: width and height in inches.
        nrows, ncols, squeeze: as for ``Figure.subplots``.

    Returns:
        ``(figure, axes)``.

    Example:
        >>> fig, ax = new_figure((4, 3))
        >>> save_figure(fig, "plot.png")  # doctest: +SKIP
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, squeeze=squeeze)


def save_figure(fig: Any, path: str | Path, title: str = "") -> Path:
    """Title, lay out and write a figure (the format follows the suffix).

    Returns:
        The path written.
    """
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def plot_memory_breakdown(profile: dict, path: str | Path) -> Path:
    """Two panels per policy: the ledger's memory parts (stacked) and the measured increases.

    The panels are kept apart on purpose: ledger bytes are exact tensor sizes, measured bytes
    are resident process memory, and a shared axis would invite comparing them as equals.

    Args:
        profile: the record ``edgetorch profile --json`` writes
            (:meth:`edgetorch.activations.profile.ProfileResult.to_json`).
        path: where to write the PNG.

    Returns:
        The path written.
    """
    results = profile["results"]
    names = [r["policy"] for r in results]
    xs = list(range(len(names)))
    mib = 2.0**20
    fig, (ledger_ax, measured_ax) = new_figure((4 + 2.4 * len(names), 5.6), 1, 2)
    bottom = [0.0] * len(names)
    for key, label in _PARTS:
        heights = [r[key] / mib for r in results]
        ledger_ax.bar(xs, heights, 0.6, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ledger_ax.set_title("ledger (exact tensor bytes)")
    for offset, key, label in ((-0.2, "forward_increase_bytes", "forward: held at its end"),
                               (0.2, "step_peak_increase_bytes", "step: peak incl. backward")):
        values = [(r.get(key) or 0) / mib for r in results]
        measured_ax.bar([x + offset for x in xs], values, 0.4, label=label)
    measured_ax.set_title(f"measured ({results[0]['peak_memory_kind']}) increase over resident")
    for ax in (ledger_ax, measured_ax):
        ax.set_xticks(xs, names, rotation=15, fontsize=8)
        ax.set_ylabel("MiB")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    return save_figure(fig, path, f"{profile['model']}  batch {profile['batch']}  {profile['resolution']}px")


def plot_training(history: list[dict], path: str | Path, title: str = "") -> Path:
    """Training loss and validation accuracy per epoch, side by side.

    Args:
        history: records with ``epoch``, ``train_loss`` and ``val_accuracy`` (what
            :func:`edgetorch.finetune.finetune` returns in ``history``).
        path: where to write the PNG.
        title: figure title.

    Returns:
        The path written.
    """
    epochs = [r["epoch"] for r in history]
    fig, (loss_ax, acc_ax) = new_figure((9, 3.6), 1, 2)
    loss_ax.plot(epochs, [r["train_loss"] for r in history], marker="o")
    loss_ax.set(xlabel="epoch", ylabel="training loss (mean over the epoch)")
    acc_ax.plot(epochs, [100 * r["val_accuracy"] for r in history], marker="o", color="tab:green")
    acc_ax.set(xlabel="epoch", ylabel="validation accuracy (%)")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    return save_figure(fig, path, title)
