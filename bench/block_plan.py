"""Per-block memory plans against the best whole-model policy at the same budget (issue 26).

For each model, three budgets are set between the smallest whole-model candidate's predicted peak
and dense's, at the model's requested batch (a quarter, half and three quarters of the way). At
each budget:

1. a fresh process plans with :func:`edgetorch.plan_memory` (``per_block=True``, the default
   candidates), as ``edgetorch finetune --memory-budget`` does (its choice is the per-block plan
   where one fits and no exact policy fits at its batch or a larger one, else the whole-model
   candidate), trains ``STEPS`` SGD steps under its choice and reads its own peak resident memory
   from start to end, against the budget; it does nothing else;
2. another process measures the gradient fidelity cost
   (:attr:`GradientFidelity.mean_squared_relative_error`, the cost the per-block solver minimises)
   of that choice and of the best whole-model candidate that fits, each on the batch it would
   train at, and, at equal batches, their step times (interleaved, the least of each).

Whole-model fidelity is measured the same way as the plan's. Where the whole-model policy is one
of the per-block forms (``costs.DEFAULT_FORMS``) its uniform plan is among the solver's options, so
a chosen plan's predicted cost is at most its; the table shows the measured costs of both.

Run: ``python bench/block_plan.py [--quick]`` (hours on 2 CPU cores; --quick: resnet18 at
one low budget).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time

from _common import mib, table, write_results

# model -> (spec, input resolution or sequence length, batch)
# Sizes where saved activations are large against the planner's 5% headroom on a ~1 GiB process.
MODELS = {"resnet18": ("torchvision:resnet18", 128, 16), "mobilenet_v2": ("torchvision:mobilenet_v2", 128, 16),
          "deit_tiny": ("timm.models:deit_tiny_patch16_224", 224, 8), "minilm": ("minilm", 64, 8)}
FRACTIONS = (0.25, 0.5, 0.75)
STEPS = 3
MARGIN = 0.05  # plan_memory's default headroom
TIME_ROUNDS = 5


def _workload(name: str):
    """The model and batch; every module the worker uses is imported first, so that the bounds
    process holds what the worker does before planning (without it, the worker predicted its
    smallest candidate at batch 8 as high as the bounds process did at batch 16, and nothing fit)."""
    import torch
    import torch.nn.functional as F  # noqa: F401

    import edgetorch.activations.fidelity  # noqa: F401
    import edgetorch.activations.step  # noqa: F401
    import edgetorch.measure.process  # noqa: F401
    from _workloads import minilm_batch, photo_batch, random_model, step_times  # noqa: F401

    spec, size, batch = MODELS[name]
    torch.manual_seed(0)
    if spec == "minilm":
        model, ids, labels = minilm_batch(size)
        index = torch.arange(batch) % len(ids)
        return model, ids[index], labels[index]
    return random_model(spec), photo_batch(batch, size), torch.arange(batch) % 10


def bounds(name: str) -> dict:
    """Dense's and the smallest whole-model candidate's predicted peaks at the requested batch."""
    from edgetorch import plan_memory

    model, x, y = _workload(name)
    plan = plan_memory(model, (x, y), "1000GiB")
    at_batch = [c for c in plan.candidates if c.batch == len(x)]
    dense = next(c for c in at_batch if c.policy == "dense").predicted_peak_bytes
    return {"dense": dense, "smallest": min(c.predicted_peak_bytes for c in at_batch)}


def worker(name: str, budget: int) -> dict:
    """Plan and train in this process, nothing else: its peak from start to end is what a user's
    run would reach (a fidelity check runs plain PyTorch's step, which would raise it)."""
    import torch
    import torch.nn.functional as F

    from edgetorch import plan_memory
    from edgetorch.activations.step import forward_backward, parse_training_policy
    from edgetorch.measure.process import process_peak_rss_bytes

    model, x, y = _workload(name)
    start = time.perf_counter()
    plan = plan_memory(model, (x, y), budget, per_block=True)
    planning = time.perf_counter() - start
    whole = next((c for c in plan.candidates if c.fits and not c.policy.startswith("per-block")), None)
    result = {"model": name, "budget_bytes": budget, "planning_seconds": planning, "reason": plan.reason,
              "per_block": plan.chosen is not None and plan.chosen.policy.startswith("per-block"),
              "chosen": None if plan.chosen is None else dataclasses.asdict(plan.chosen),
              "whole": None if whole is None else dataclasses.asdict(whole), "rows": None}
    if plan.blocks is not None:
        result["rows"] = [dataclasses.asdict(r) for r in plan.blocks.plan.rows]
    if plan.chosen is None:
        return result
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    how, batch = parse_training_policy(plan.chosen.policy), plan.chosen.batch
    for _ in range(STEPS):  # the loop finetune runs: gradients freed before the forward
        optimizer.zero_grad(set_to_none=True)
        forward_backward(model, x[:batch], y[:batch], how, F.cross_entropy)
        optimizer.step()
    result["process_peak_bytes"] = process_peak_rss_bytes()
    return result


def measure(name: str, specs: list[str], batches: list[int]) -> dict:
    """Each policy's fidelity cost on the batch it trains at, and, where the batches are equal, their
    step times (interleaved, the least of each)."""
    from _workloads import step_times
    from edgetorch.activations.fidelity import gradient_fidelity

    model, x, y = _workload(name)
    out = {}
    for spec, batch in zip(specs, batches):
        fidelity = gradient_fidelity(model, (x[:batch], y[:batch]), spec)
        out[spec] = {"fidelity_cost": fidelity.mean_squared_relative_error, "worst_cosine": fidelity.worst_cosine}
    if len(set(batches)) == 1 and len(set(specs)) == 2:
        times = step_times(model, x[: batches[0]], y[: batches[0]], specs, TIME_ROUNDS)
        out["step_time_ratio"] = times[specs[0]] / times[specs[1]]
    return out


def _run(*args: str) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="resnet18 at the budget a tenth of the way from the smallest candidate to dense")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "BUDGET"), help=argparse.SUPPRESS)
    parser.add_argument("--bounds", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return
    if args.bounds:
        print(json.dumps(bounds(args.bounds)))
        return
    if args.measure:
        print(json.dumps(measure(**json.loads(args.measure))))
        return
    names, fractions = (["resnet18"], (0.1,)) if args.quick else (list(MODELS), FRACTIONS)
    runs = []
    for name in names:
        limits = _run("--bounds", name)
        for fraction in fractions:
            # With the planner's 5% headroom: fraction 0 is where the smallest candidate just fits.
            budget = int((limits["smallest"] + fraction * (limits["dense"] - limits["smallest"])) * (1 + MARGIN))
            print(f"{name} at {mib(budget)} MiB ...", file=sys.stderr)
            run = {**_run("--worker", name, str(budget)), "fraction": fraction, "bounds": limits}
            picked = [c for c in (run["chosen"], run["whole"]) if c is not None]
            if picked:  # in another process: plain PyTorch's reference step must not count in the peak
                run["measured"] = _run("--measure", json.dumps({"name": name, "specs": [c["policy"] for c in picked],
                                                                "batches": [c["batch"] for c in picked]}))
            runs.append(run)
    rows = []
    for r in runs:
        chosen, whole, measured = r["chosen"] or {}, r["whole"] or {}, r.get("measured", {})
        cost = {spec: f"{m['fidelity_cost']:.3g}" for spec, m in measured.items() if isinstance(m, dict)}
        peak = r.get("process_peak_bytes")
        rows.append([f"{r['model']} {r['fraction']:.2f}", mib(r["budget_bytes"]),
                     "per-block" if r["per_block"] else chosen.get("policy", "nothing fits"), chosen.get("batch", "-"),
                     cost.get(chosen.get("policy"), "-"),
                     f"{whole['policy']} b{whole['batch']}" if whole else "none fits", cost.get(whole.get("policy"), "-"),
                     f"{measured['step_time_ratio']:.2f}" if "step_time_ratio" in measured else "-",
                     "-" if peak is None else mib(peak),
                     "-" if peak is None else ("yes" if peak <= r["budget_bytes"] else "NO"),
                     f"{r['planning_seconds']:.0f}"])
    body = ("Each row is a fresh process (see the script's docstring). Fidelity cost: mean squared relative "
            "error of the weight gradients against plain PyTorch's on the batch trained at (0: exact). "
            f"Peak: the process's peak resident memory from start to the end of {STEPS} training steps.\n\n")
    body += table(["model, budget point", "budget MiB", "choice", "batch", "its fidelity cost",
                   "best whole-model that fits", "its fidelity cost", "step time vs it", "process peak MiB",
                   "within", "planning s"], rows, right=[1, 3, 4, 6, 7, 8, 10])
    write_results("block_plan_quick" if args.quick else "block_plan", "Per-block memory plans against whole-model "
                  "policies (issue 26)", body, {"runs": runs}, "bench/block_plan.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
