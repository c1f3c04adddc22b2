"""How long a grouped reduction of torchvision resnet50 at 224 px takes, stage by stage (issue 13: <= 2 min on 2 cores).

What it measures. ``edgetorch.reduce.grouped.reduce_grouped`` on torchvision resnet50
(``num_classes=10``, random weights with trained-looking batch norms: timing does not depend on
training) at 224 x 224, method prune-ls, exact allocation, alpha 0.5, from N calibration images
(Fashion-MNIST training images resized to 224 and repeated over the RGB channels). Its
stages are timed one by one: graph (Torch-Pruning's trace and the channel graph), statistics (the
calibration forward passes and the covariances), curves (pivoted Cholesky per group), solver,
prune (least-squares refits and Torch-Pruning's deletion) and check (counting the reduced model's
MACs). Two runs on the same data: the library default (each convolution keeps at most
``max(VECTORS_PER_UNIT x channels, MIN_VECTORS)`` random input positions) and
``vectors_per_unit=None`` (every position). The forward passes alone (no hooks) are timed too, as
the floor the statistics cannot go under. With a second argument ``_before`` the script times only
the library default and writes ``reduce_resnet50_before``: run so from a checkout of an older
commit (its header names the commit), for a before/after comparison.

Outputs: docs/results/reduce_resnet50.{json,md}. Run:
``.venv/bin/python bench/reduce_resnet50.py [N [_before]]`` (N defaults to SAMPLES; all torch threads).
Timings on a shared machine: the load average before and after each run is recorded.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torchvision
from _common import table, write_results
from torch import nn

from edgetorch.data import load_dataset
from edgetorch.reduce import count_macs
from edgetorch.reduce.allocation import solve_graph_allocation
from edgetorch.reduce.graph import channel_graph
from edgetorch.reduce.graph_problem import make_graph_problem
from edgetorch.reduce.grouped import group_orders, group_statistics, prune_groups
from edgetorch.zoo import redraw_batchnorm

NAME = "reduce_resnet50"
SAMPLES = 128
ALPHA = 0.5
STAGES = ("graph", "statistics", "curves", "solver", "prune", "check")


def resnet50() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None, num_classes=10)
    return redraw_batchnorm(model)  # trained-looking batch norms, so channels differ in scale and shift


def stages(model: nn.Module, images: torch.Tensor, cap: int | None | str) -> tuple[dict[str, float], dict]:
    """Seconds per stage of a grouped reduction, calling the stages :func:`reduce_grouped` runs
    one by one (so that the same script also times a commit without its ``seconds`` record)."""
    seconds, clock = {}, time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        seconds[stage], clock = time.perf_counter() - clock, time.perf_counter()

    reduced = copy.deepcopy(model).eval()
    graph, dependency = channel_graph(reduced, images[:1])
    lap("graph")
    capped = {} if cap == "library" else {"vectors_per_unit": cap}  # a commit before the cap has no argument
    stats = group_statistics(reduced, graph, images, **capped)
    lap("statistics")
    orders = group_orders(graph, stats, correlated=True)
    lap("curves")
    problem = make_graph_problem(graph, [curve for _, curve in orders], ALPHA)
    chosen = solve_graph_allocation(problem, "prune-ls", "optimal", seed=0, time_limit=60.0)
    lap("solver")
    prune_groups(reduced, graph, dependency, chosen.theta, orders, stats, refit=True)
    lap("prune")
    macs = count_macs(reduced, images[:1])
    lap("check")
    assert macs == chosen.cost
    return seconds, {"J": chosen.objective, "cost": chosen.cost, "full_cost": graph.cost(),
                     "proven_gap": chosen.proven_gap}


def main() -> None:
    samples = int(sys.argv[1]) if len(sys.argv) > 1 else SAMPLES
    suffix = sys.argv[2] if len(sys.argv) > 2 else ""  # "_before": run from a checkout of an older commit
    images = load_dataset("fashion-mnist", "train", size=224, limit=samples).tensors[0].repeat(1, 3, 1, 1)
    model = resnet50()
    with torch.no_grad():
        start = time.perf_counter()
        for batch in images.split(64):
            model(batch)
        forward = time.perf_counter() - start
    caps = ["library"] if suffix else ["library", None]
    runs = []
    for cap in caps:
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        seconds, result = stages(model, images, cap)
        total = time.perf_counter() - start
        runs.append({"vectors_per_unit": cap, "total_seconds": total, "seconds": seconds,
                     "load_before": load_before, "load_after": os.getloadavg()[0], **result})
        print(runs[-1], flush=True)
    rows = [["library default" if r["vectors_per_unit"] == "library" else "every position",
             *(f"{r['seconds'][s]:.1f}" for s in STAGES), f"{r['total_seconds']:.1f}",
             f"{r['load_before']:.1f} / {r['load_after']:.1f}", f"{r['J']:.4g}", f"{r['cost'] / r['full_cost']:.3f}"]
            for r in runs]
    body = (
        f"torchvision resnet50 (num_classes 10, random weights), 224 px, prune-ls, exact allocation, alpha {ALPHA}, "
        f"N = {samples} calibration images, {torch.get_num_threads()} torch threads. Seconds per stage. The forward "
        f"passes alone, without the statistics' hooks, took {forward:.1f} s for the {samples} images. Load average is "
        "the 1-minute value before / after each run: above about 2 on this 2-core machine the seconds include "
        "waiting for other jobs.\n\n"
        + table(["calibration vectors kept", *STAGES, "total", "load", "J", "MAC ratio"], rows)
    )
    write_results(NAME + suffix, "resnet50 grouped reduction: seconds per stage", body,
                  {"samples": samples, "alpha": ALPHA, "forward_seconds": forward, "runs": runs})


if __name__ == "__main__":
    main()
