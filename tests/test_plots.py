"""Figures are written without touching matplotlib's process-wide state (backend, pyplot's figures)."""

from __future__ import annotations

import matplotlib

from edgetorch.measure.plots import plot_training
from edgetorch.reduce.api import LayerFactor
from edgetorch.reduce.plots import plot_layer_factors


def test_plotting_keeps_the_callers_backend_and_registers_no_figure(tmp_path):
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # what a caller chose: a library must not switch it
    try:
        plot_training([{"epoch": 1, "train_loss": 1.0, "val_accuracy": 0.5}, {"epoch": 2, "train_loss": 0.5,
                       "val_accuracy": 0.7}], tmp_path / "training.png", "t")  # fmt: skip
        layers = [LayerFactor(layer=1, in_features=8, out_features=4, kept_inputs=None, rank=2, macs=16, alpha=0.5,
                              error=0.1, name="0")]
        plot_layer_factors(layers, 0.5, tmp_path / "factors.png")
        assert matplotlib.get_backend() == "svg"
        import matplotlib.pyplot as plt

        assert plt.get_fignums() == []  # nothing left open in pyplot's registry
        assert (tmp_path / "training.png").read_bytes()[:4] == b"\x89PNG"
        assert (tmp_path / "factors.png").stat().st_size > 0
    finally:
        matplotlib.use(before)
