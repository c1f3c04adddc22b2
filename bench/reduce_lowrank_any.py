"""Low-rank on a network that is not a chain: the zoo SmallResNet, each layer factored on its own.

Issue 13 found low-rank refused for anything but an ``nn.Sequential`` chain, "although factoring a
layer needs no chain". This measures what ``reduce(model, alpha, "lowrank", ...)`` now gives on the
zoo's residual CNN (SmallResNet, pretrained on scikit-learn digits at 28 px by
``edgetorch.zoo.pretrained``; the recipe is cached): test accuracy (all 359 test images) with no
retraining, at alpha 0.3 / 0.5 / 0.7 for the optimal, PSO and uniform allocations (uniform: the
paper's baseline, last layer dense), next to channel-group pruning (``prune-ls``, optimal) at the
same budgets; the MAC ratio; and the CPU latency ratio reduced / full (``compare_latency``, one
torch thread, batch 1 and 64, median of 3 repeats).

Outputs: docs/results/reduce_lowrank_any.{json,md}.
Run: ``.venv/bin/python bench/reduce_lowrank_any.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import os
import statistics

import torch
from _common import table, write_results

from edgetorch.data import load_dataset
from edgetorch.reduce import compare_latency, count_macs, reduce_model
from edgetorch.zoo import evaluate_accuracy
from edgetorch.zoo.pretrain import pretrained

ALPHAS = (0.3, 0.5, 0.7)
CONFIGS = (("lowrank", "optimal"), ("lowrank", "pso"), ("lowrank", "uniform"), ("prune-ls", "optimal"))
CALIBRATION = 1000
BATCHES = {1: 200, 64: 30}  # batch size: timed rounds per repeat
REPEATS = 3


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    full = pretrained("cnn", "digits").eval()
    train, test = load_dataset("digits", "train", size=28), load_dataset("digits", "test", size=28)
    calibration = train.tensors[0][:CALIBRATION]
    images = test.tensors[0]
    full_macs, full_accuracy = count_macs(full, images[:1]), evaluate_accuracy(full, test)
    rows, points = [], []
    for alpha in ALPHAS:
        for method, allocation in CONFIGS:
            result = reduce_model(full, alpha, method, allocation, calibration)
            macs = count_macs(result.model, images[:1])
            assert macs <= (1 - alpha) * full_macs
            latency = {}
            for batch, rounds in BATCHES.items():
                ratios = [compare_latency(full, result.model, images[:batch], rounds=rounds, warmup=10).ratio
                          for _ in range(REPEATS)]
                latency[batch] = statistics.median(ratios)
            factored = sum(1 for f in result.layers if f.rank is not None and f.alpha > 0)
            point = {"alpha": alpha, "method": method, "allocation": allocation, "mac_ratio": macs / full_macs,
                     "accuracy": evaluate_accuracy(result.model, test), "objective_J": result.allocation.objective,
                     "layers_factored": factored if method == "lowrank" else None,
                     "ranks": {f.name: f.rank for f in result.layers} if method == "lowrank" else None,
                     **{f"latency_ratio_batch{b}": v for b, v in latency.items()}}
            points.append(point)
            rows.append([alpha, method, allocation, f"{point['mac_ratio']:.3f}", f"{100 * point['accuracy']:.1f}%",
                         "-" if method != "lowrank" else f"{factored} of {len(result.layers)}",
                         *(f"{latency[b]:.2f}" for b in BATCHES)])
            print(rows[-1], flush=True)
    load = os.getloadavg()
    body = (
        f"Zoo SmallResNet (residual) pretrained on digits, full accuracy {100 * full_accuracy:.1f}% on the "
        f"{len(test)} test images, {full_macs:,} MACs per image; no retraining. Low-rank factors every Conv2d "
        "and the classifier on its own (thin convolution + 1x1); `prune-ls` prunes channel groups. Latency: "
        f"reduced / full, `compare_latency`, 1 torch thread, median of {REPEATS} repeats; load average at the end "
        f"{load[0]:.1f} on 2 shared cores (ratios from interleaved rounds).\n\n"
        + table(["alpha", "method", "allocation", "MAC ratio", "accuracy", "layers factored",
                 *(f"latency ratio, batch {b}" for b in BATCHES)], rows)
    )
    write_results("reduce_lowrank_any", "Low-rank on a residual network (zoo SmallResNet, digits)", body,
                  {"points": points, "full_accuracy": full_accuracy, "full_macs": full_macs,
                   "calibration": CALIBRATION, "repeats": REPEATS, "rounds": BATCHES, "torch_threads": 1,
                   "load_average_end": load})


if __name__ == "__main__":
    main()
