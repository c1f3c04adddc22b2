"""Demo section: fine-tune the zoo CNN with dense and with bitmap activation storage, side by side.

On the embedded default data (scikit-learn digits at 28x28): load the cached pretrained CNN (or
train it, seconds), fine-tune a copy with plain PyTorch and a copy under lossless BitTrain, check
that every loss is bit-identical, and print how much saved-activation memory each policy holds
(ledger) next to measured process memory.
"""

from __future__ import annotations

import copy

import torch
from rich.console import Console
from rich.table import Table
from torch.nn import functional as F

from .. import Bitmap, Dense, SavedTensorLedger, compress_activations
from ..activations.profile import profile_policies
from ..data import load_dataset
from ..zoo import evaluate_accuracy, pretrained

STEPS, BATCH, LR = 30, 64, 0.01


def fine_tune(model: torch.nn.Module, data, policy) -> tuple[list[float], SavedTensorLedger]:
    """A few SGD steps over fixed batches; returns the losses and the last step's ledger."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        idx = torch.randint(0, len(data), (BATCH,), generator=generator)
        x, y = data.tensors[0][idx], data.tensors[1][idx]
        ledger = SavedTensorLedger()
        with compress_activations(model, policy, ledger=ledger):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, ledger


def run(console: Console) -> None:
    """Print the BitTrain section; exits non-zero if lossless storage changed any loss."""
    torch.manual_seed(0)
    console.rule("edgetorch demo: BitTrain on the zoo CNN (scikit-learn digits, 28x28)")
    base = pretrained("cnn", dataset="digits")
    train = load_dataset("digits", "train", size=28)
    test = load_dataset("digits", "test", size=28)
    console.print(f"pretrained zoo CNN: test accuracy {evaluate_accuracy(base, test):.3f}")

    runs = {}
    for policy in (Dense(), Bitmap(), Bitmap(threshold=0.05), Bitmap(value_dtype=torch.float16)):
        model = copy.deepcopy(base)
        losses, ledger = fine_tune(model, train, policy)
        runs[policy.spec()] = (losses, ledger, evaluate_accuracy(model, test))

    dense_losses = runs["dense"][0]
    identical = runs["bitmap"][0] == dense_losses
    console.print(
        f"fine-tuning {STEPS} steps, batch {BATCH}: lossless bitmap losses identical to dense at "
        f"every step: [bold]{'yes' if identical else 'NO'}[/bold] "
        f"(first {dense_losses[0]:.4f}, last {dense_losses[-1]:.4f})"
    )

    table = Table(title="saved activations per training step (ledger: exact tensor bytes)")
    for col in ("policy", "dense KiB", "stored KiB", "stored / dense", "sparsity", "last loss", "test acc"):
        table.add_column(col, justify="right")
    for name, (losses, ledger, acc) in runs.items():
        t = ledger.total()
        table.add_row(name, f"{t.dense_bytes / 1024:,.0f}", f"{t.stored_bytes / 1024:,.0f}",
                      f"{t.stored_bytes / t.dense_bytes:.3f}", f"{t.sparsity:.1%}",
                      f"{losses[-1]:.4f}", f"{acc:.3f}")
    console.print(table)

    with console.status("measuring process memory: one fresh process per policy"):
        measured = profile_policies("zoo:cnn", 256, 28, ["dense", "bitmap"])
    table = Table(title="measured: one training step, zoo CNN (random init), batch 256, in a fresh process")
    for col in ("policy", "ledger stored MiB", "forward increase MiB", "step increase MiB", "peak RSS MiB"):
        table.add_column(col, justify="right")
    for r in measured["results"]:
        table.add_row(r["policy"], *(f"{r[k] / 2**20:.1f}" for k in (
            "activation_bytes", "forward_increase_bytes", "step_peak_increase_bytes", "peak_memory_bytes")))
    console.print(table)
    console.print("Measured = resident memory: 'forward increase' is what the forward added and "
                  "still held at its end, 'step increase' the step's peak over what was resident "
                  "before it (backward adds gradients and decoded activations), and peak RSS "
                  "includes the interpreter, torch and edgetorch.")
    if not identical:
        raise SystemExit("lossless bitmap diverged from dense: this is a bug")
