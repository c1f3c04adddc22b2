"""Demo section: fine-tune the zoo CNN with dense and with bitmap activation storage, side by side.

On the embedded default data (scikit-learn digits at 28x28): load the cached pretrained CNN (or
train it, seconds), fine-tune a copy per policy with ``edgetorch.finetune``, check that the
lossless bitmap's loss is bit-identical to dense's at every step, and print how much
saved-activation memory each policy holds (ledger). Then measure one training step's process
memory, dense against bitmap, on a torchvision model whose step is mostly saved activations.
"""

from __future__ import annotations

import copy

from rich.console import Console
from rich.table import Table

from ..activations import step_ledger
from ..activations.profile import profile_policies
from ..data import load_dataset
from ..finetune import FinetuneConfig, finetune
from ..zoo import evaluate_accuracy, pretrained

EPOCHS, BATCH, LR = 1, 64, 0.01
POLICIES = ("dense", "bitmap", "bitmap:threshold=0.05", "bitmap:value_dtype=float16")
# The measured table: a model whose training step is mostly saved activations, so what the bitmap
# saves shows in the process's peak (docs/results/engine_cpu_peak.md: 786 -> 750 MiB), in seconds.
MEASURED_MODEL, MEASURED_BATCH, MEASURED_SIZE = "torchvision:squeezenet1_1", 8, 160


def run(console: Console) -> None:
    """Print the BitTrain section; exits non-zero if lossless storage changed any loss."""
    console.rule("edgetorch demo: BitTrain on the zoo CNN (scikit-learn digits, 28x28)")
    base = pretrained("cnn", dataset="digits")
    train = load_dataset("digits", "train", size=28)
    test = load_dataset("digits", "test", size=28)
    console.print(f"pretrained zoo CNN: test accuracy {evaluate_accuracy(base, test):.3f}")

    runs = {}
    x, y = train.tensors[0][:BATCH], train.tensors[1][:BATCH]
    for policy in POLICIES:
        model, losses = copy.deepcopy(base), []
        config = FinetuneConfig(policy=policy, epochs=EPOCHS, batch_size=BATCH, lr=LR, schedule="constant")
        with console.status(f"fine-tuning under {policy}"):
            finetune(model, train, test, config,
                     on_progress=lambda e: losses.append(e["loss"]) if e["event"] == "step" else None)
        runs[policy] = (losses, step_ledger(model, x, y, policy), evaluate_accuracy(model, test))

    dense_losses = runs["dense"][0]
    identical = runs["bitmap"][0] == dense_losses
    console.print(
        f"fine-tuning {len(dense_losses)} steps, batch {BATCH}: lossless bitmap losses identical to dense at "
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
        measured = profile_policies(MEASURED_MODEL, MEASURED_BATCH, MEASURED_SIZE, ["dense", "bitmap"])
    table = Table(title=f"measured: one step of {MEASURED_MODEL}, batch {MEASURED_BATCH}, {MEASURED_SIZE}px")
    for col in ("policy", "ledger stored MiB", "forward increase MiB", "step increase MiB", "peak RSS MiB"):
        table.add_column(col, justify="right")
    for r in measured.results:
        table.add_row(r.policy, *(f"{v / 2**20:.1f}" for v in (
            r.activation_bytes, r.forward_increase_bytes, r.step_peak_increase_bytes, r.peak_memory_bytes)))
    console.print(table)
    console.print("Measured = resident memory, each policy in a fresh process (random init): 'forward increase' "
                  "is what the forward added and "
                  "still held at its end, 'step increase' the step's peak over what was resident "
                  "before it (backward adds gradients and decoded activations), and peak RSS "
                  "includes the interpreter, torch and edgetorch.")
    if not identical:
        raise SystemExit("lossless bitmap diverged from dense: this is a bug")
