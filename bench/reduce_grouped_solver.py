"""The exact grouped allocation against the paper's PSO and uniform: J and solver seconds (issue 13).

What it measures. For each torchvision CNN in MODELS (random weights with trained-looking batch
norms, 224 px, 1,000 classes) the grouped problem of ``reduce_grouped(..., "prune-ls")`` is built as
that function builds it: ``channel_graph`` + ``group_statistics`` on a fixed calibration set (the
first CALIBRATION Fashion-MNIST test images, upsampled to 224 px and repeated over RGB) +
``group_orders(correlated=True)`` + ``make_graph_problem``. At every alpha in ALPHAS it then runs
the three allocations of :func:`edgetorch.reduce.allocation.solve_graph_allocation` (exact,
PSO with seed 0, uniform) and records J, seconds and the exact solver's proven gap. The target
checked: exact J <= PSO J (and <= uniform J) everywhere.

The curves depend only on the model and the calibration set, so they are cached as .npz under
``CACHE`` (the statistics of resnet50 take about half a minute on 2 cores); only the solvers are
timed. ``--baseline REV`` also times the exact solver of git revision REV (its ``src`` tree,
extracted to a temporary directory, in a subprocess) on the same cached problems: the before/after
of a solver change, measured in one run on one machine.

Outputs: docs/results/reduce_grouped_solver.{json,md}. Run:
``.venv/bin/python bench/reduce_grouped_solver.py [--baseline REV] [--models resnet50 ...]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ALPHAS = (0.3, 0.5, 0.7, 0.9)
MODELS = ("resnet50", "resnet18", "mobilenet_v2", "efficientnet_b0", "squeezenet1_0", "densenet121")
CALIBRATION = 64
RESOLUTION = 224
CACHE = Path(tempfile.gettempdir()) / "edgetorch_grouped_solver"
NAME = "reduce_grouped_solver"
_TERM_FIELDS = ("scale", "fixed_in", "output", "fixed_out", "depthwise", "units_in", "taps")


def _build_curves(name: str, path: Path) -> None:
    # Imported here: the baseline subprocess reads cached curves only.
    import torch
    import torchvision
    from _common import log

    from edgetorch.data import load_dataset
    from edgetorch.reduce.graph import channel_graph
    from edgetorch.reduce.grouped import group_orders, group_statistics
    from edgetorch.zoo import redraw_batchnorm

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).eval()
    redraw_batchnorm(model)  # trained-looking batch norms, so channels differ in scale and shift
    images = load_dataset("fashion-mnist", "test", size=RESOLUTION, limit=CALIBRATION).tensors[0].repeat(1, 3, 1, 1)
    start = time.perf_counter()
    graph, _ = channel_graph(model, images[:1])
    stats = group_statistics(model, graph, images)
    curves = [curve for _, curve in group_orders(graph, stats, correlated=True)]
    log(f"{name}: {len(graph.groups)} groups, {len(graph.terms)} layers, curves in {time.perf_counter() - start:.1f} s")
    inputs = np.full((len(graph.terms), max(len(t.inputs) for t in graph.terms) or 1), -1, dtype=np.int64)
    for i, t in enumerate(graph.terms):
        inputs[i, : len(t.inputs)] = t.inputs
    terms = np.array([[-1 if getattr(t, f) is None else int(getattr(t, f)) for f in _TERM_FIELDS] for t in graph.terms],
                     dtype=np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, sizes=np.array(graph.sizes), terms=terms, inputs=inputs,
             **{f"curve{g}": c for g, c in enumerate(curves)})


def _cache_path(name: str) -> Path:
    return CACHE / f"{name}_{RESOLUTION}px_{CALIBRATION}.npz"


def load_problem_data(name: str):
    """The model's channel graph (groups without consumers: the solver needs sizes and costs) and curves."""
    from edgetorch.reduce.graph import ChannelGraph, ChannelGroup, CostTerm

    path = _cache_path(name)
    if not path.exists():
        _build_curves(name, path)
    data = np.load(path, allow_pickle=False)
    groups = tuple(ChannelGroup(g, int(s), f"group{g}", (), ()) for g, s in enumerate(data["sizes"]))
    terms = []
    for i, (row, reads) in enumerate(zip(data["terms"], data["inputs"])):
        f = dict(zip(_TERM_FIELDS, (int(v) for v in row)))
        terms.append(CostTerm(f"layer{i}", f["scale"], tuple(int(g) for g in reads if g >= 0), f["fixed_in"],
                              None if f["output"] < 0 else f["output"], f["fixed_out"], bool(f["depthwise"]),
                              f["units_in"], f["taps"]))
    graph = ChannelGraph(groups, tuple(terms), terms[-1].module)
    return graph, [data[f"curve{g}"] for g in range(len(groups))]


def solve_exact_only(names, alphas) -> dict[str, list[dict]]:
    """The exact solver alone on each model's cached problem (what the baseline subprocess runs)."""
    try:
        from edgetorch.reduce.allocation import solve_graph_allocation
    except ImportError:  # a baseline revision from before reduce/allocate.py was renamed
        from edgetorch.reduce.allocate import solve_graph_allocation
    from edgetorch.reduce.graph_problem import make_graph_problem

    results = {}
    for name in names:
        graph, curves = load_problem_data(name)
        rows = results.setdefault(name, [])
        for alpha in alphas:
            try:
                problem = make_graph_problem(graph, curves, alpha)
            except ValueError:
                rows.append({"alpha": alpha, "infeasible": True})
                continue
            cpu = time.process_time()
            result = solve_graph_allocation(problem, "prune-ls", "optimal", seed=0)
            rows.append({"alpha": alpha, "J": result.objective, "seconds": result.seconds,
                         "cpu_seconds": time.process_time() - cpu, "proven_gap": result.proven_gap})
    return results


def start_baseline(revision: str, names, alphas, tmp: str) -> subprocess.Popen:
    """:func:`solve_exact_only` at git ``revision`` (its whole ``src`` tree, extracted under ``tmp``), in a
    subprocess that runs beside this one (the old solver takes minutes per resnet50 point)."""
    from _common import revision_src

    env = {**os.environ, "PYTHONPATH": str(revision_src(revision, tmp))}
    return subprocess.Popen([sys.executable, __file__, "--exact-only", *names, "--alphas", *map(str, alphas)],
                            env=env, stdout=subprocess.PIPE, text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--alphas", nargs="+", type=float, default=list(ALPHAS))
    parser.add_argument("--baseline", help="git revision whose exact solver is timed too (before/after)")
    parser.add_argument("--exact-only", nargs="+", help=argparse.SUPPRESS)  # the baseline subprocess
    args = parser.parse_args()
    if args.exact_only:
        print(json.dumps(solve_exact_only(args.exact_only, args.alphas)))
        return
    run(args.models, args.alphas, args.baseline)


def run(models, alphas, revision: str | None) -> None:
    import torch
    from _common import log, table, write_results

    from edgetorch.reduce.allocation import solve_graph_allocation
    from edgetorch.reduce.graph_problem import make_graph_problem

    torch.set_num_threads(1)
    for name in models:  # build every cache first: the baseline subprocess only reads them
        load_problem_data(name)
    tmp = tempfile.TemporaryDirectory()
    old = start_baseline(revision, models, alphas, tmp.name) if revision else None
    rows = []
    for name in models:
        graph, curves = load_problem_data(name)
        for alpha in alphas:
            try:
                problem = make_graph_problem(graph, curves, alpha)
            except ValueError as exc:
                rows.append({"model": name, "alpha": alpha, "infeasible": str(exc)})
                log(f"{name} alpha {alpha}: infeasible")
                continue
            row = {"model": name, "alpha": alpha, "groups": problem.layers, "load_before": os.getloadavg()[0]}
            for allocation in ("optimal", "pso", "uniform"):
                cpu = time.process_time()
                result = solve_graph_allocation(problem, "prune-ls", allocation, seed=0)
                row[allocation] = {"J": result.objective, "seconds": result.seconds, "cost": result.cost,
                                   "cpu_seconds": time.process_time() - cpu}
                if allocation == "optimal":
                    row["proven_gap"] = result.proven_gap
            row["load_after"] = os.getloadavg()[0]
            rows.append(row)
            log(f"{name} alpha {alpha}: exact J {row['optimal']['J']:.6g} in {row['optimal']['seconds']:.2f} s "
                f"(cpu {row['optimal']['cpu_seconds']:.2f} s, gap {row['proven_gap']}), PSO {row['pso']['J']:.6g}, "
                f"uniform {row['uniform']['J']:.6g}")
    if old is not None:
        before = json.loads(old.communicate()[0].strip().splitlines()[-1])
        tmp.cleanup()
        for row in rows:
            row["baseline"] = next(b for b in before[row["model"]] if b["alpha"] == row["alpha"])
    solved = [r for r in rows if "optimal" in r]
    held = all(r["optimal"]["J"] <= r["pso"]["J"] + 1e-9 * max(1.0, r["pso"]["J"]) for r in solved)
    held_uniform = all(r["optimal"]["J"] <= r["uniform"]["J"] + 1e-9 * max(1.0, r["uniform"]["J"]) for r in solved)
    headers = ["model", "alpha", "groups", "exact J", "PSO J", "uniform J", "proven gap", "exact s (cpu)", "PSO s",
               "uniform s", "load"]
    if revision:
        headers += [f"exact s (cpu) at {revision}", f"J at {revision}", f"gap at {revision}"]
    lines = []
    for r in rows:
        if "optimal" not in r:
            lines.append([r["model"], r["alpha"], "infeasible", *[""] * (len(headers) - 3)])
            continue
        line = [r["model"], r["alpha"], r["groups"], f"{r['optimal']['J']:.6g}", f"{r['pso']['J']:.6g}",
                f"{r['uniform']['J']:.6g}", "none" if r["proven_gap"] is None else f"{r['proven_gap']:.2g}",
                f"{r['optimal']['seconds']:.2f} ({r['optimal']['cpu_seconds']:.2f})", f"{r['pso']['seconds']:.2f}",
                f"{r['uniform']['seconds']:.3f}", f"{r['load_before']:.1f}-{r['load_after']:.1f}"]
        if revision:
            b = r.get("baseline", {})
            gap = b.get("proven_gap", "")
            line += [f"{b['seconds']:.2f} ({b['cpu_seconds']:.2f})" if "seconds" in b else "",
                     f"{b['J']:.6g}" if "J" in b else "", "none" if gap is None else f"{gap:.2g}" if gap != "" else ""]
        lines.append(line)
    if revision:
        log("baseline done")
    body = (
        f"Grouped prune-ls problems of torchvision models at {RESOLUTION} px (random weights, trained-looking batch "
        f"norms), curves from the first {CALIBRATION} Fashion-MNIST test images upsampled to {RESOLUTION} px; one "
        "torch thread. Exact = `solve_graph_allocation(..., 'optimal')` (its seconds include the uniform and PSO "
        "allocations that seed it; 60 s search limit, the default), PSO = the paper-style swarm, seed 0. Seconds are "
        "wall clock with the process CPU seconds in brackets; load is the 1-minute load average before and after "
        "the row (2 cores: above 1.5 the wall clock mostly measures other processes, the CPU seconds less so).\n\n"
        + table(headers, lines)
        + f"\n\nTarget exact J <= PSO J: {'held' if held else 'MISSED'} at every solved point "
        f"({len(solved)}); exact J <= uniform J: {'held' if held_uniform else 'MISSED'}.\n"
    )
    caches = {name: {"path": str(_cache_path(name)),
                     "sha256": hashlib.sha256(_cache_path(name).read_bytes()).hexdigest(),
                     "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_cache_path(name).stat().st_mtime))}
              for name in models}
    write_results(NAME, "Grouped exact allocation vs PSO and uniform", body,
                  {"rows": rows, "baseline_revision": revision, "curve_caches": caches, "calibration": CALIBRATION,
                   "resolution": RESOLUTION, "exact_le_pso": held, "exact_le_uniform": held_uniform})


if __name__ == "__main__":
    main()
