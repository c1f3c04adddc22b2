"""Demo section: a short Back Razor transfer run, with its accuracy and memory next to the baselines.

Source: the zoo CNN pretrained on scikit-learn digits (cached; seconds to train). Target:
Fashion-MNIST (4,000 training images) when the Debian package is installed, else the digits
with inverted contrast, a shifted target that ships everywhere. Every method fine-tunes the
same copy for the same steps; Back Razor runs on top of full fine-tuning with frozen batch norm
(the paper's setting), and its forward equals plain PyTorch's at every step.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

from .. import BackRazor, Dense, SavedTensorLedger, compress_activations, freeze_batchnorm
from ..data import DatasetNotFoundError, load_dataset
from ..zoo import evaluate_accuracy, pretrained

STEPS, BATCH, LR = 120, 64, 3e-3


def target_task() -> tuple[str, torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    try:
        train = load_dataset("fashion-mnist", "train", size=28, limit=4000)
        test = load_dataset("fashion-mnist", "test", size=28, limit=2000)
        return "Fashion-MNIST (4,000 train / 2,000 test)", train, test
    except DatasetNotFoundError:
        train, test = (load_dataset("digits", split, size=28) for split in ("train", "test"))
        invert = lambda d: torch.utils.data.TensorDataset(1 - d.tensors[0], d.tensors[1])  # noqa: E731
        return "inverted digits (Fashion-MNIST not installed)", invert(train), invert(test)


def trainable(model: nn.Module, method: str) -> list[nn.Parameter]:
    """The parameters a method trains (the others get requires_grad False)."""
    if method == "FT-Last":
        keep = set(model.classifier.parameters())
    elif method == "FT-Norm+Last":
        keep = set(model.classifier.parameters()) | {
            p for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()}
    else:
        keep = set(model.parameters())
    for p in model.parameters():
        p.requires_grad_(p in keep)
    return [p for p in model.parameters() if p.requires_grad]


def fine_tune(base: nn.Module, data, method: str) -> tuple[nn.Module, SavedTensorLedger, list[float]]:
    model = copy.deepcopy(base).train()
    params = trainable(model, method)
    policy = Dense()
    if method.startswith("Back Razor"):
        # After trainable(), which would turn the affine's requires_grad back on: a batch norm
        # that trains its weight needs its input exactly, and Back Razor would save little.
        freeze_batchnorm(model)
        policy = BackRazor(0.9)
    optimizer = torch.optim.Adam([p for p in params if p.requires_grad], lr=LR)
    generator = torch.Generator().manual_seed(0)
    losses, ledger = [], SavedTensorLedger()
    for step in range(STEPS):
        idx = torch.randint(0, len(data), (BATCH,), generator=generator)
        # Only the last step's ledger is reported: record that one alone.
        with compress_activations(model, policy, ledger=ledger if step == STEPS - 1 else None):
            loss = F.cross_entropy(model(data.tensors[0][idx]), data.tensors[1][idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, ledger, losses


def run(console: Console) -> None:
    """Print the Back Razor section; exits non-zero if Back Razor failed to learn the target."""
    torch.manual_seed(0)
    console.rule("edgetorch demo: Back Razor transfer (zoo CNN pretrained on digits)")
    base = pretrained("cnn", dataset="digits")
    name, train, test = target_task()
    base.classifier = nn.Linear(base.classifier.in_features, 10)  # a new head for the target
    console.print(f"target task: {name}; {STEPS} Adam steps of batch {BATCH} per method")

    table = Table(title="fine-tuning: accuracy and saved activations per step (ledger)")
    for col in ("method", "test acc", "saved KiB / step", "vs FT-Full", "last loss"):
        table.add_column(col, justify="right")
    results = {}
    for method in ("FT-Last", "FT-Norm+Last", "FT-Full", "Back Razor@90%"):
        model, ledger, losses = fine_tune(base, train, method)
        results[method] = (evaluate_accuracy(model, test), ledger.total().stored_bytes, losses[-1])
    full = results["FT-Full"][1]
    for method, (acc, stored, last) in results.items():
        table.add_row(method, f"{acc:.3f}", f"{stored / 1024:,.0f}", f"{stored / full:.2f}", f"{last:.3f}")
    console.print(table)
    console.print("Saved KiB counts what autograd keeps for backward in the last step (frozen "
                  "layers save less). Back Razor keeps the forward dense and prunes only the "
                  "copies that feed weight gradients; see README and docs/results/backrazor_*.")
    if results["Back Razor@90%"][0] < results["FT-Last"][0] - 0.05:
        raise SystemExit("Back Razor fine-tuning fell far below FT-Last: this is a bug")
