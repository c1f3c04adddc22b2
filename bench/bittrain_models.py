"""BitTrain Figures 7 and 9: saved-activation memory of classification CNNs, dense vs bitmap.

Three parts, kept apart because they answer different questions:

1. Ledger ("theoretical": exact bytes of the tensors autograd saves) for torchvision models at
   ImageNet (224 px) and CIFAR (32 px) input sizes, batch 16, one train-mode forward per model
   and policy (followed by a backward, to free the graph): dense, lossless bitmap, and bitmap with activation pruning (thresholds 0.01,
   0.05, 0.1). Weights are randomly initialised (nothing can be downloaded here), so natural
   ReLU sparsity is realistic but the share of near-zero values is not.
2. The same ledger for a network trained on real data (the zoo CNN pretrained on
   Fashion-MNIST) fed real Fashion-MNIST test images, next to the same network untrained: this
   is where the pruning thresholds mean what they mean in the paper.
3. Measured process memory (peak RSS of one training step, each policy in a fresh process) for
   three models at 32 px, with the ledger numbers of the same step beside them.

Run: ``python bench/bittrain_models.py`` (about 10 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

import torch
import torchvision
from _common import MIB, RESULTS_DIR, mib, pct, table, write_results
from _workloads import ledger_totals
from torch import nn

import edgetorch
from edgetorch.activations.profile import profile_policies
from edgetorch.data import load_dataset
from edgetorch.measure.plots import new_figure, save_figure
from edgetorch.zoo import build_model, pretrained

POLICIES = ["dense", "bitmap", "bitmap:threshold=0.01", "bitmap:threshold=0.05", "bitmap:threshold=0.1"]
BATCH = 16
# (dataset label, input resolution, classifier outputs)
SIZES = [("ImageNet", 224, 1000), ("CIFAR-10", 32, 10)]
# Builder kwargs that make a randomly initialised model return plain logits in train mode.
MODELS: dict[str, dict] = {
    "resnet18": {},
    "resnet50": {},
    "resnet101": {},
    "vgg16": {},
    "mobilenet_v2": {},
    "alexnet": {},
    "squeezenet1_0": {},
    # Without these GoogLeNet returns auxiliary outputs in train mode and warns about init.
    "googlenet": {"aux_logits": False, "init_weights": True},
    "densenet121": {},
}
# AlexNet's stride-4 stem and three stride-2 max-pools shrink 32 px to nothing.
TOO_SMALL = {("alexnet", 32): "input too small (needs >= 63 px)"}
MEASURED_MODELS = ["resnet18", "mobilenet_v2", "squeezenet1_0"]
MEASURED_POLICIES = ["dense", "bitmap"]
FMNIST_BATCHES = 10


def sweep(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], frozen_bn: bool = False
) -> dict[str, dict]:
    """:func:`ledger_totals` under every policy of :data:`POLICIES`, the model in train mode.

    ``frozen_bn`` keeps batch norm on its running statistics (eval mode), as when fine-tuning
    a pretrained network with frozen normalisation; activations then follow the trained
    statistics instead of being re-standardised per batch.
    """
    model.train()
    if frozen_bn:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    return {spec: ledger_totals(model, batches, edgetorch.parse_policy(spec)) for spec in POLICIES}


def random_models(log: Callable[[str], None]) -> list[dict]:
    rows = []
    for dataset, resolution, classes in SIZES:
        for name, kwargs in MODELS.items():
            if (name, resolution) in TOO_SMALL:
                rows.append({"model": name, "dataset": dataset, "resolution": resolution,
                             "skipped": TOO_SMALL[name, resolution]})  # fmt: skip
                continue
            torch.manual_seed(0)
            model = torchvision.models.get_model(name, weights=None, num_classes=classes, **kwargs)
            x = torch.randn(BATCH, 3, resolution, resolution)
            y = torch.randint(0, classes, (BATCH,))
            start = time.perf_counter()
            results = sweep(model, [(x, y)])
            seconds = time.perf_counter() - start
            rows.append({"model": name, "dataset": dataset, "resolution": resolution,
                         "policies": results, "seconds": seconds})  # fmt: skip
            log(f"{name} @ {resolution}px: {seconds:.1f} s")
            del model, x, y, results
            gc.collect()  # one model's graphs and weights gone before the next is built
    return rows


def fashion_mnist_models(log: Callable[[str], None]) -> list[dict]:
    images, labels = load_dataset("fashion-mnist", "test", limit=BATCH * FMNIST_BATCHES).tensors
    batches = list(zip(images.split(BATCH), labels.split(BATCH)))
    rows = []
    torch.manual_seed(0)
    trained = pretrained("cnn", dataset="fashion-mnist")
    candidates = [
        ("zoo cnn, pretrained", trained, False),
        ("zoo cnn, pretrained, BN frozen", trained, True),
        ("zoo cnn, random init", build_model("zoo:cnn", num_classes=10), False),
    ]
    for label, model, frozen_bn in candidates:
        start = time.perf_counter()
        rows.append({"model": label, "dataset": "Fashion-MNIST (real test images)", "resolution": 28,
                     "batches": len(batches), "frozen_bn": frozen_bn,
                     "policies": sweep(model, batches, frozen_bn),
                     "seconds": time.perf_counter() - start})  # fmt: skip
        log(f"{label}: {rows[-1]['seconds']:.1f} s")
    return rows


def measured(log: Callable[[str], None]) -> list[dict]:
    out = []
    for name in MEASURED_MODELS:
        start = time.perf_counter()
        profile = profile_policies(f"torchvision:{name}", BATCH, 32, MEASURED_POLICIES, num_classes=10)
        out.append({"model": name, "resolution": 32, "results": profile.to_json()["results"]})
        log(f"measured {name}: {time.perf_counter() - start:.1f} s")
    return out


def ledger_table(rows: list[dict]) -> str:
    headers = ["model", "input", "dense MiB"] + [
        f"{spec} MiB (saving)" for spec in POLICIES[1:]
    ] + ["sparsity (lossless)"]
    body = []
    for row in rows:
        label = [row["model"], f"{row['resolution']} px"]
        if "skipped" in row:
            body.append(label + [f"n/a: {row['skipped']}"] + [""] * (len(headers) - 3))
            continue
        p = row["policies"]
        dense = p["dense"]["stored_bytes"]
        cells = [f"{mib(p[s]['stored_bytes'])} ({pct(1 - p[s]['stored_bytes'] / dense)})" for s in POLICIES[1:]]
        body.append(label + [mib(dense)] + cells + [pct(p["bitmap"]["sparsity"])])
    return table(headers, body)


def measured_table(rows: list[dict]) -> str:
    headers = ["model", "policy", "ledger saved activations MiB (theoretical)",
               "measured forward increase MiB (RSS)", "measured step peak increase MiB (peak RSS)",
               "measured RSS before step MiB", "step s"]  # fmt: skip
    body = [
        [row["model"], r["policy"], mib(r["activation_bytes"]), mib(r["forward_increase_bytes"]),
         mib(r["step_peak_increase_bytes"]), mib(r["rss_before_step_bytes"]), f"{r['step_seconds']:.3f}"]  # fmt: skip
        for row in rows
        for r in row["results"]
    ]
    return table(headers, body)


def plot(random_rows: list[dict], real_rows: list[dict], path) -> None:
    """Grouped bars per model, one bar per policy (the paper's Fig. 7/9 layout), one panel per size."""
    panels = [(f"{d} {r} px, random init", [x for x in random_rows if x["resolution"] == r and "policies" in x])
              for d, r, _ in SIZES] + [("Fashion-MNIST 28 px, real images", real_rows)]  # fmt: skip
    fig, axes = new_figure((12.5, 4 * len(panels)), len(panels), 1)
    width = 0.8 / len(POLICIES)
    for ax, (title, rows) in zip(axes, panels):
        for i, spec in enumerate(POLICIES):
            heights = [row["policies"][spec]["stored_bytes"] / MIB for row in rows]
            xs = [j + (i - (len(POLICIES) - 1) / 2) * width for j in range(len(rows))]
            ax.bar(xs, heights, width, label=spec.replace("bitmap:threshold=", "bitmap_"))
        ax.set_xticks(range(len(rows)), [row["model"] for row in rows], fontsize=8)
        ax.set_ylabel("saved activations, MiB (ledger)")
        ax.set_title(f"{title}, batch {BATCH}")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: never hides a bar
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-measured", action="store_true", help="ledger parts only (faster)")
    args = parser.parse_args()

    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {message}", flush=True)

    random_rows = random_models(log)
    real_rows = fashion_mnist_models(log)
    measured_rows = [] if args.skip_measured else measured(log)
    total_seconds = time.perf_counter() - start

    plot(random_rows, real_rows, RESULTS_DIR / "bittrain_models.png")
    body = "\n\n".join([
        "All memory numbers are MiB (2^20 bytes). \"Ledger\" numbers are exact bytes of the "
        "tensors autograd saves for backward (the paper's theoretical column; parameters, "
        "buffers and the input batch are excluded since the caller holds them anyway, and a "
        "tensor saved by several ops counts once). They are not process memory. Saving = "
        "1 - policy / dense. Sparsity = share of held elements not stored as values under "
        "lossless bitmap. Tensors that would not shrink are kept dense by the engine.",
        f"## Figures 7 and 9: random-init torchvision models, batch {BATCH}, ledger (theoretical)",
        "Random weights give realistic ReLU sparsity (about half of each ReLU output is zero), "
        "but the pruning columns are not representative of trained networks: the magnitude "
        "of random-init activations depends on the init scheme, not on learning.",
        ledger_table(random_rows),
        f"## Real data: zoo CNN on Fashion-MNIST test images, batch {BATCH}, ledger (theoretical)",
        f"Average over {FMNIST_BATCHES} real batches; forward in train mode. Batch norm uses "
        "the batch's statistics, except in the `BN frozen` row (running statistics, as when "
        "fine-tuning with frozen normalisation). The pretrained rows are the ones to read for "
        "the effect of activation-pruning thresholds on a trained network. Lossless sparsity "
        "is about the same trained or not: batch norm re-standardises every pre-activation, "
        "so about half of each ReLU output is zero either way, and the convolution outputs "
        "that batch norm saves are dense.",
        ledger_table(real_rows),
        "## Measured process memory vs ledger, 32 px, batch 16",
        "One training step (forward, backward, SGD step) per policy, each in a fresh process "
        "after a warm-up step (`edgetorch.activations.profile.profile_policies`). Measured "
        "columns come from the operating system: `forward increase` = RSS after the forward "
        "minus RSS before the step (saved activations plus logits and allocator slack: the "
        "measured counterpart of the ledger column); `step peak increase` = peak RSS of the "
        "step minus RSS before it (also covers gradients and backward temporaries). `RSS "
        "before step` is the process baseline; it is about 110 MiB higher under bitmap because "
        "that process also loads the compiled codec kernels. The ledger column is the "
        "theoretical saved-activation bytes of the same step.",
        measured_table(measured_rows) if measured_rows else "(skipped: --skip-measured)",
        f"Plot: `bittrain_models.png`. Total runtime {total_seconds:.0f} s.",
    ])
    write_results(
        "bittrain_models",
        "BitTrain Fig. 7/9: saved-activation memory, dense vs bitmap",
        body,
        {"batch": BATCH, "policies": POLICIES, "random_init": random_rows,
         "fashion_mnist": real_rows, "measured": measured_rows,
         "runtime_seconds": total_seconds},  # fmt: skip
    )


if __name__ == "__main__":
    main()
