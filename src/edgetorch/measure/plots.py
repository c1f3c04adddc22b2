"""Figures of memory results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

_PARTS = [
    ("parameter_bytes", "parameters"),
    ("gradient_bytes", "gradients"),
    ("optimizer_state_bytes", "optimizer state"),
    ("activation_bytes", "saved activations (ledger)"),
]


def plot_memory_breakdown(profile: dict, path: str | Path) -> Path:
    """Stacked bars of the ledger's memory parts per policy, with the measured peak beside them.

    Args:
        profile: the dict returned by :func:`edgetorch.activations.profile.profile_policies`.
        path: where to write the PNG.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = profile["results"]
    names = [r["policy"] for r in results]
    mib = 2.0**20
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(names), 4.5))
    xs = range(len(names))
    bottom = [0.0] * len(names)
    for key, label in _PARTS:
        heights = [r[key] / mib for r in results]
        ax.bar([x - 0.2 for x in xs], heights, 0.4, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    peaks = [r.get("step_peak_increase_bytes") or r["peak_memory_bytes"] for r in results]
    ax.bar([x + 0.2 for x in xs], [p / mib for p in peaks], 0.4, color="0.6", hatch="//",
           label="measured step peak (process)")
    ax.set_xticks(list(xs), names, rotation=15)
    ax.set_ylabel("MiB")
    ax.set_title(f"{profile['model']}  batch {profile['batch']}  {profile['resolution']}px")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
