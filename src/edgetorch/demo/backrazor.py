"""Demo section: a short Back Razor transfer run, with its accuracy and memory next to the baselines.

Source: the zoo CNN pretrained on scikit-learn digits (cached; seconds to train). Target:
Fashion-MNIST (4,000 training images) when the Debian package is installed, else the digits
with inverted contrast, a shifted target that ships everywhere. Every method is an
``edgetorch.finetune`` run from the same start, with the same data order, optimizer and length.
FT-Full and Back Razor both freeze batch norm (the paper's transfer setting), so the only
difference between them is what backward keeps; FT-Norm+Last trains the batch-norm affine, so its
batch norm cannot be frozen.
"""

from __future__ import annotations

import copy

import torch
from rich.console import Console
from rich.table import Table

from ..activations import step_ledger
from ..data import DatasetNotFoundError, load_dataset
from ..finetune import FinetuneConfig, finetune, replace_classifier
from ..zoo import pretrained

# Two epochs of 62 Adam steps: long enough for full fine-tuning to pull ahead of the linear probe.
EPOCHS, BATCH, LR = 2, 64, 3e-3
METHODS = {  # the Back Razor paper's Table 1 rows, as finetune configs
    "FT-Last": FinetuneConfig(scope="last", freeze_batchnorm=True),
    "FT-Norm+Last": FinetuneConfig(scope="norm+last"),
    "FT-Full": FinetuneConfig(scope="full", freeze_batchnorm=True),
    "Back Razor@90%": FinetuneConfig(policy="backrazor:sparsity=0.9", scope="full", freeze_batchnorm=True),
}


def target_task() -> tuple[str, torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    try:
        train = load_dataset("fashion-mnist", "train", size=28, limit=4000)
        test = load_dataset("fashion-mnist", "test", size=28, limit=2000)
        return "Fashion-MNIST (4,000 train / 2,000 test)", train, test
    except DatasetNotFoundError:
        train, test = (load_dataset("digits", split, size=28) for split in ("train", "test"))
        invert = lambda d: torch.utils.data.TensorDataset(1 - d.tensors[0], d.tensors[1])  # noqa: E731
        return "inverted digits (Fashion-MNIST not installed)", invert(train), invert(test)


def run(console: Console) -> None:
    """Print the Back Razor section; exits non-zero if Back Razor failed to learn the target."""
    console.rule("edgetorch demo: Back Razor transfer (zoo CNN pretrained on digits)")
    base = pretrained("cnn", dataset="digits")
    name, train, test = target_task()
    console.print(f"target task: {name}; {EPOCHS} epochs of Adam, batch {BATCH}, per method, from the same start")

    table = Table(title="fine-tuning: accuracy and saved activations per step (ledger)")
    for col in ("method", "batch norm", "test acc", "saved KiB / step", "vs FT-Full", "last epoch loss"):
        table.add_column(col, justify="right")
    results = {}
    x, y = train.tensors[0][:BATCH], train.tensors[1][:BATCH]
    for method, preset in METHODS.items():
        config = FinetuneConfig(**{**preset.__dict__, "epochs": EPOCHS, "batch_size": BATCH, "optimizer": "adam",
                                   "lr": LR, "schedule": "constant"})
        torch.manual_seed(0)  # the same new classifier for every method
        model = copy.deepcopy(base)
        replace_classifier(model, 10)
        with console.status(f"fine-tuning {method}"):
            result = finetune(model, train, test, config)
        results[method] = (config, result.val_accuracy, step_ledger(model, x, y, config.policy).total().stored_bytes,
                           result.history[-1]["train_loss"])
    full = results["FT-Full"][2]
    for method, (config, acc, stored, loss) in results.items():
        table.add_row(method, "frozen" if config.freeze_batchnorm else "trains", f"{acc:.3f}", f"{stored / 1024:,.0f}",
                      f"{stored / full:.2f}", f"{loss:.3f}")
    console.print(table)
    console.print("Saved KiB counts what autograd keeps for backward in one step (frozen layers save "
                  "less). Back Razor keeps the forward dense and prunes only the copies that feed weight "
                  "gradients; see README and docs/results/backrazor_*. The same runs from the command "
                  "line: edgetorch finetune --model zoo:cnn --data fashion-mnist --policy backrazor:sparsity=0.9 "
                  "--freeze-batchnorm")
    if results["Back Razor@90%"][1] < results["FT-Last"][1] - 0.05:
        raise SystemExit("Back Razor fine-tuning fell far below FT-Last: this is a bug")
