"""Demo section: reduce the pretrained zoo MLP and plain CNN (digits, 28x28) at several budgets; accuracy tables.

Pruning (the paper's naive and the correlation-aware variant) and low-rank, each with the exact
optimal per-layer allocation and, for comparison, the paper's uniform baseline. Raises SystemExit
if a reduced network misses its multiplication budget or alpha = 0 changes the outputs.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from ..data import load_dataset
from ..reduce import count_macs, reduce_model
from ..zoo import evaluate_accuracy, pretrained

# The CNN has far less redundancy than the 2-hidden-layer MLP, so it is shown at smaller budgets.
ALPHAS = {"mlp": (0.5, 0.7, 0.8, 0.9, 0.95), "plaincnn": (0.2, 0.3, 0.5, 0.7)}
VARIANTS = (("prune", "uniform"), ("prune", "optimal"), ("prune-ls", "optimal"),
            ("lowrank", "uniform"), ("lowrank", "optimal"))


def run(console: Console) -> None:
    """Print the reduction section; exits non-zero if a budget or the alpha = 0 identity fails."""
    for name, what in (("mlp", "MLP"), ("plaincnn", "plain CNN (channels pruned, convolutions factored)")):
        console.rule(f"edgetorch demo: layer reduction factors on the zoo {what} (scikit-learn digits, 28x28)")
        _reduce_table(console, name)
    console.print("optimal = exact solution of the paper's eq. 15 (per-layer factors minimising the "
                  "summed normalised errors); prune-ls = correlation-aware pruning with a "
                  "least-squares refit. No retraining anywhere.")


def _reduce_table(console: Console, name: str) -> None:
    model = pretrained(name, dataset="digits").eval()
    train = load_dataset("digits", "train", size=28)
    test = load_dataset("digits", "test", size=28)
    calibration = train.tensors[0][:500]
    one = test.tensors[0][:1]
    full_macs = count_macs(model, one)
    if not torch.equal(reduce_model(model, 0.0, "prune", calibration=calibration).model(test.tensors[0]),
                       model(test.tensors[0])):
        raise SystemExit(f"reduce of the zoo {name} at alpha = 0 changed the outputs")

    table = Table(title=f"test accuracy ({len(test)} digits); full network {evaluate_accuracy(model, test):.3f}, "
                        f"{full_macs:,} MACs per sample")
    table.add_column("alpha_tot", justify="right")
    table.add_column("MACs kept", justify="right")
    for method, allocation in VARIANTS:
        table.add_column(f"{method}\n{allocation}", justify="right")
    for alpha in ALPHAS[name]:
        cells = []
        for method, allocation in VARIANTS:
            result = reduce_model(model, alpha, method, allocation, calibration=calibration)
            macs = count_macs(result.model, one)
            if 1 - macs / full_macs < alpha:
                raise SystemExit(f"{method}/{allocation} at alpha {alpha} kept {macs} MACs: over budget")
            cells.append(f"{evaluate_accuracy(result.model, test):.3f}")
        table.add_row(f"{alpha:.2f}", f"<= {int((1 - alpha) * full_macs):,}", *cells)
    console.print(table)
