"""Issue 13, item 5: a pruned MLP's input selection -- keep the gather, fold it, or never prune the input?

The paper prunes input neurons too: its choice is ``[M~_0, ..., M~_{L-1}]`` (eq. 5-7, 15), so a
pruned MLP on images reads only the kept pixels, which edgetorch does with a
:class:`~edgetorch.reduce.KeepFeatures` gather before the first Linear. The issue measured our MLPs
slower than Torch-Pruning's at batch 1 at equal MACs "partly because of the input-selection layer".
Three networks per point, all from the library's own statistics and allocation:

* ``select``: the paper's problem (``M~_0`` free): the gather, then a narrow first layer.
* ``fold-zero``: the same network with the gather folded into the first Linear as zero columns
  (identical outputs, no gather; the first layer is back at ``M_0`` inputs, so it costs more MACs).
* ``keep-input``: ``M~_0 = M_0`` fixed and the same budget spent on the hidden layers (no gather;
  what a library that cannot prune the input, such as Torch-Pruning, is limited to): the
  library's default since this measurement (``reduce(..., prune_input=False)``).

Network: the zoo MLP (784-256-128-10) pretrained on Fashion-MNIST (``edgetorch.zoo.pretrained``),
statistics from 2,000 unlabeled training images, optimal allocation, ``prune`` and ``prune-ls`` at
alpha 0.5 and 0.7, accuracy on the 10,000 test images. Latency: ``compare_latency`` (reduced /
full, interleaved rounds, medians) at batch 1 and 64, one torch thread, repeated; the median of the
repeats' ratios is reported, with the spread.

Outputs: docs/results/reduce_input_selection.{json,md}.
Run: ``.venv/bin/python bench/reduce_input_selection.py`` (a few minutes; the MLP is trained on
first use, about a minute).
"""

from __future__ import annotations

import os
import statistics

import torch
from _common import table, write_results
from torch import nn

from edgetorch.data import load_dataset
from edgetorch.reduce import ChainReducer, KeepFeatures, compare_latency, count_macs
from edgetorch.zoo import evaluate_accuracy
from edgetorch.zoo.pretrain import pretrained

ALPHAS = (0.5, 0.7)
METHODS = ("prune", "prune-ls")
CALIBRATION = 2000
BATCHES = {1: 400, 64: 60}  # batch size: timed rounds per repeat
REPEATS = 5


def fold_zero(model: nn.Sequential, inputs: int) -> nn.Sequential:
    """The same network without the gather: the first Linear takes all ``inputs``, zero where pruned."""
    index = next(i for i, m in enumerate(model) if isinstance(m, KeepFeatures))
    keep, narrow = model[index].index, model[index + 1]
    wide = nn.Linear(inputs, narrow.out_features, bias=narrow.bias is not None)
    with torch.no_grad():
        wide.weight.zero_()
        wide.weight[:, keep] = narrow.weight
        if narrow.bias is not None:
            wide.bias.copy_(narrow.bias)
    modules = list(model)
    return nn.Sequential(*modules[:index], wide, *modules[index + 2:]).eval()


def latency(full: nn.Module, models: dict[str, nn.Module], test_images: torch.Tensor) -> dict:
    out = {}
    for batch, rounds in BATCHES.items():
        example = test_images[:batch]
        for name, model in models.items():
            ratios = [compare_latency(full, model, example, rounds=rounds, warmup=20).ratio for _ in range(REPEATS)]
            out[f"{name}@{batch}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    full = pretrained("mlp", "fashion-mnist").eval()
    train, test = load_dataset("fashion-mnist", "train"), load_dataset("fashion-mnist", "test")
    calibration = train.tensors[0][:CALIBRATION]
    reducer = ChainReducer(full, calibration)  # the statistics and prune orders once, for every network below
    widths = reducer.widths
    full_macs = count_macs(full, test.tensors[0][:1])
    rows, points = [], []
    for method in METHODS:
        for alpha in ALPHAS:  # the library's own path (reduce_model's reductions), with and without prune_input
            free = reducer.reduce(alpha, method, "optimal", prune_input=True)
            kept_in = reducer.reduce(alpha, method, "optimal")
            assert kept_in.allocation.theta[0] == widths[0]
            models = {"select": free.model, "fold-zero": fold_zero(free.model, widths[0]), "keep-input": kept_in.model}
            thetas = {"select": free.allocation.theta, "fold-zero": free.allocation.theta,
                      "keep-input": kept_in.allocation.theta}
            with torch.inference_mode():
                x = test.tensors[0][:256]
                assert torch.allclose(models["fold-zero"](x), free.model(x), atol=1e-5)
            times = latency(full, models, test.tensors[0])
            for name, model in models.items():
                point = {"method": method, "alpha": alpha, "variant": name,
                         "theta": thetas[name],
                         "mac_ratio": count_macs(model, test.tensors[0][:1]) / full_macs,
                         "accuracy": evaluate_accuracy(model, test),
                         **{f"latency_ratio_batch{b}": times[f"{name}@{b}"] for b in BATCHES}}
                points.append(point)
                rows.append([method, alpha, name, " / ".join(map(str, point["theta"])), f"{point['mac_ratio']:.3f}",
                             f"{100 * point['accuracy']:.2f}%",
                             *(f"{point[f'latency_ratio_batch{b}']['median']:.2f} "
                               f"({point[f'latency_ratio_batch{b}']['min']:.2f}-{point[f'latency_ratio_batch{b}']['max']:.2f})"
                               for b in BATCHES)])
                print(rows[-1], flush=True)
    load = os.getloadavg()
    body = (
        f"Zoo MLP {'-'.join(map(str, widths))} on Fashion-MNIST (full accuracy "
        f"{100 * evaluate_accuracy(full, test):.2f}%), {CALIBRATION} calibration images, optimal allocation. "
        "`select`: the paper's problem, input pixels pruned and gathered (`KeepFeatures`); `fold-zero`: the same "
        "network with the gather folded into the first Linear as zero columns (no gather, first layer at full "
        "width); `keep-input`: no input pruning (M~_0 = M_0) at the same budget. Latency: reduced / full, "
        f"`compare_latency` medians, 1 torch thread, median (min-max) of {REPEATS} repeats; load average at the "
        f"end {load[0]:.1f} (2 cores shared: absolute times are noise, the ratios are from interleaved rounds).\n\n"
        + table(["method", "alpha", "variant", "kept M~_0 / M~_1 / M~_2", "MAC ratio", "accuracy",
                 *(f"latency ratio, batch {b}" for b in BATCHES)], rows)
    )
    write_results("reduce_input_selection", "Input selection of a pruned MLP: gather, fold or keep", body,
                  {"points": points, "calibration": CALIBRATION, "repeats": REPEATS, "rounds": BATCHES,
                   "torch_threads": 1, "load_average_end": load})


if __name__ == "__main__":
    main()
