"""How much the cap on calibration vectors changes J (issue 13: "a cap on the calibration data ... by how much it changes J").

What it measures. torchvision resnet18 (``num_classes=10``, random weights with trained-looking
batch norms) at 224 px, N Fashion-MNIST training images resized to 224 and repeated over the RGB
channels. Each convolution's statistics keep ``max(vectors_per_unit x channels, MIN_VECTORS)``
random output positions (``edgetorch.reduce.statistics.Moments``); the reference keeps every
position (``vectors_per_unit=None``), which is affordable on resnet18. For each cap, with
prune-ls curves (pivoted Cholesky of the shrunk covariances):

* per group, the relative change of ``J_g(k_g)`` at the reference allocation's ``k_g`` (median and
  largest over the groups) and of the total J there;
* the allocation the capped curves choose (exact, alpha 0.5), scored on the reference curves:
  ``J_ref(theta_cap) / J_ref(theta_ref) - 1`` is what the cap costs in the objective the paper
  minimises, and how many groups get a different ``k_g``;
* the statistics' seconds (forward passes included) and vectors kept.

For scale, the same numbers for the uncapped statistics of the *next* N images: how much J moves
with the calibration sample itself.

Outputs: docs/results/reduce_calibration_cap.{json,md}. Run:
``.venv/bin/python bench/reduce_calibration_cap.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
import torchvision
from _common import table, write_results
from torch import nn

from edgetorch.data import load_dataset
from edgetorch.reduce.allocation import solve_graph_allocation
from edgetorch.reduce.graph import channel_graph
from edgetorch.reduce.graph_problem import make_graph_problem
from edgetorch.reduce.grouped import group_orders, group_statistics
from edgetorch.reduce.statistics import MIN_VECTORS
from edgetorch.zoo import redraw_batchnorm

NAME = "reduce_calibration_cap"
SAMPLES = 128
ALPHA = 0.5
CAPS = (None, 64, 16, 4)


def resnet18() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    return redraw_batchnorm(model)  # trained-looking batch norms, so channels differ in scale and shift


def main() -> None:
    pool = load_dataset("fashion-mnist", "train", size=224, limit=2 * SAMPLES).tensors[0].repeat(1, 3, 1, 1)
    model = resnet18()
    graph, _ = channel_graph(model, pool[:1])
    runs = {}
    for cap, images in [(cap, pool[:SAMPLES]) for cap in CAPS] + [("other images", pool[SAMPLES:])]:
        load = os.getloadavg()[0]
        start = time.perf_counter()
        stats = group_statistics(model, graph, images, vectors_per_unit=None if cap == "other images" else cap)
        seconds = time.perf_counter() - start
        curves = [curve for _, curve in group_orders(graph, stats, correlated=True)]
        problem = make_graph_problem(graph, curves, ALPHA)
        theta = solve_graph_allocation(problem, "prune-ls", "optimal", time_limit=120).theta
        runs[cap] = {"curves": curves, "theta": theta, "seconds": seconds, "load": load,
                     "vectors": sum(stats.vectors.values()), "shrinkage": stats.shrinkage}
        print(cap, seconds, theta, flush=True)
    reference = runs[None]
    score = lambda curves, theta: float(sum(c[k] for c, k in zip(curves, theta)))  # noqa: E731
    best = score(reference["curves"], reference["theta"])
    rows, records = [], []
    for cap, run in runs.items():
        at_ref = np.array([c[k] for c, k in zip(run["curves"], reference["theta"])])
        ref = np.array([c[k] for c, k in zip(reference["curves"], reference["theta"])])
        change = np.abs(at_ref - ref) / np.maximum(ref, 1e-300)
        total_change = abs(at_ref.sum() - ref.sum()) / ref.sum()
        regret = score(reference["curves"], run["theta"]) / best - 1
        moved = sum(a != b for a, b in zip(run["theta"], reference["theta"]))
        records.append({"vectors_per_unit": cap, "seconds": run["seconds"], "load": run["load"],
                        "vectors": run["vectors"], "theta": run["theta"], "group_J_at_reference": at_ref.tolist(),
                        "group_relative_change": change.tolist(), "total_relative_change": total_change,
                        "objective_regret": regret, "groups_moved": moved,
                        "shrinkage": run["shrinkage"]})
        label = ("every position (reference)" if cap is None else f"every position, the next {SAMPLES} images"
                 if cap == "other images" else f"{cap} per channel")
        rows.append([label, f"{run['vectors']:,}",
                     f"{run['seconds']:.1f} (load {run['load']:.1f})", f"{100 * np.median(change):.2f}%",
                     f"{100 * change.max():.2f}%", f"{100 * total_change:.2f}%", f"{100 * regret:.3f}%",
                     f"{moved} of {len(graph.groups)}"])
    body = (
        f"torchvision resnet18 (random weights, trained-looking batch norms), 224 px, N = {SAMPLES} images, "
        f"prune-ls curves, exact allocation at alpha {ALPHA}. A cap keeps max(cap x channels, {MIN_VECTORS}) random "
        "output positions of each convolution's input. J changes are taken at the reference allocation's kept "
        "channels; 'objective cost' is J_ref(allocation from capped curves) / J_ref(reference allocation) - 1. "
        "Seconds are the statistics (calibration forward passes included) on a shared 2-core machine.\n\n"
        + table(["vectors kept", "vectors (all consumers)", "statistics s", "J_g change, median", "J_g change, max",
                 "total J change", "objective cost", "groups with another k_g"], rows)
    )
    write_results(NAME, "Capping the calibration vectors: J change on resnet18", body,
                  {"samples": SAMPLES, "alpha": ALPHA, "min_vectors": MIN_VECTORS, "runs": records})


if __name__ == "__main__":
    main()
