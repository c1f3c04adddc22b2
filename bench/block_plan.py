"""Per-block memory plans against the best whole-model policy, and against what a user would pick
instead, at the same budgets (issue 26).

For each model, three budgets are set between the smallest whole-model candidate's predicted peak
and dense's, at the model's requested batch (a quarter, half and three quarters of the way). At
each budget:

1. a fresh process plans with :func:`edgetorch.plan_memory` (``per_block=True``, the default
   candidates), as ``edgetorch finetune --memory-budget`` does (its choice is the per-block plan
   where one fits and no exact policy fits at its batch or a larger one, else the whole-model
   candidate), trains ``STEPS`` SGD steps under its choice and reads its own peak from start to
   end (resident memory on a CPU, the CUDA allocator's on a GPU), against the budget; it does
   nothing else;
2. the peer a user would reach for first, ``torch.utils.checkpoint``, chosen by the same planner
   from dense and dense+checkpoint alone (batch and whether to checkpoint), run the same way (a
   model with no ``nn.Sequential`` stage, MiniLM's ``ModuleList``: every layer checkpointed);
3. another process measures the gradient fidelity cost
   (:attr:`GradientFidelity.mean_squared_relative_error`, the cost the per-block solver minimises)
   of the choice and of the best whole-model candidate that fits, each on the batch it would
   train at, and the time per sample of every choice's step against plain PyTorch's at the
   requested batch (interleaved, the least of each); on a CPU the times once more in a process
   with glibc set as the planner sets it (``honest_malloc``: the planning run trains under it, and
   it moves the ratios: deit_tiny's 4-bit step took 1.20x-1.23x plain's under the defaults and
   1.42x under the planner's settings, ad hoc runs of this function).

Once per model, ``torch.compile`` under torch's ``activation_memory_budget`` at each of
``COMPILE_RATIOS`` (it takes a ratio, not bytes): each ratio's step peak (the whole process's
resident memory during a step on a CPU, compiled code included; the allocator's on a GPU) and time
per step against eager PyTorch in the same process. Each budget's row shows the fastest ratio
whose step peak fits.

Whole-model fidelity is measured the same way as the plan's. Where the whole-model policy is one
of the per-block forms (``costs.DEFAULT_FORMS``) its uniform plan is among the solver's options, so
a chosen plan's predicted cost is at most its; the table shows the measured costs of both.

On a GPU (``--device cuda``: resnet18 and vit_b_16) the runs share one process, one after another,
each after freeing the last and restarting the allocator's peak (process start-up costs seconds per
run there, and the allocator's peak, unlike resident memory, starts clean).

With ``--fixed-batch`` every choice trains at the requested batch (``min_batch`` at it), and the
budgets lie between the smallest candidate's predicted peak and the smallest exact candidate's
(dense+checkpoint, say) instead of dense's: without it, the planner may halve the batch to keep an
exact policy, and a per-block plan is then compared with an exact choice at another batch; below
the smallest exact candidate only lossy whole-model policies fit the batch, and that is where a
per-block plan can be strictly better.

With ``--malloc-cost ROUNDS`` (``malloc_cost``) only the timing: plain PyTorch's step and the middle
fixed-batch budget's two choices, under glibc's defaults, the planner's settings and those with
torch's huge pages (``MALLOC_SETTINGS``), in fresh processes.

Run: ``python bench/block_plan.py [--quick] [--device cuda] [--fixed-batch] [--models M,...] [--fractions F,...]
[--budget-s S] [--malloc-cost ROUNDS]``
(hours on 2 CPU cores; --quick: resnet18 at one low budget; --budget-s: start nothing new after S
seconds, results so far are written).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import time

from _common import mib, table, write_results

# model -> (spec, input resolution or sequence length, batch)
# CPU: sizes where saved activations are large against the planner's 5% headroom on a ~1 GiB process.
MODELS = {"resnet18": ("torchvision:resnet18", 128, 16), "mobilenet_v2": ("torchvision:mobilenet_v2", 128, 16),
          "deit_tiny": ("timm.models:deit_tiny_patch16_224", 224, 8), "minilm": ("minilm", 256, 8)}
# Larger workloads, run by name (--models): at the sizes above the range from the smallest candidate
# to the smallest exact one is 17-20 MiB for resnet18 and deit_tiny, too narrow for a per-block plan.
LARGER = {"resnet18_224": ("torchvision:resnet18", 224, 16), "deit_tiny_b32": ("timm.models:deit_tiny_patch16_224", 224, 32)}
CUDA_MODELS = {"resnet18": ("torchvision:resnet18", 224, 64), "vit_b_16": ("torchvision:vit_b_16", 224, 32)}
FRACTIONS = (0.25, 0.5, 0.75)
STEPS = 3
MARGIN = 0.05  # plan_memory's default headroom
TIME_ROUNDS = 5
CHECKPOINT_POLICIES = ("dense", "dense+checkpoint")
COMPILE_RATIOS = (0.1, 0.5)  # torch._functorch.config.activation_memory_budget values tried


def _models(device: str, larger: bool = True) -> dict:
    """The device's workloads by name; on a CPU the larger ones too, unless ``larger`` is False (the default run)."""
    return CUDA_MODELS if device == "cuda" else {**MODELS, **LARGER} if larger else MODELS


def _workload(name: str, device: str):
    """The model and batch, on ``device``; every module the worker uses is imported first, so that the
    bounds process holds what the worker does before planning (without it, the worker predicted its
    smallest candidate at batch 8 as high as the bounds process did at batch 16, and nothing fit)."""
    import torch
    import torch.nn.functional as F  # noqa: F401

    import edgetorch.activations.fidelity  # noqa: F401
    import edgetorch.activations.step  # noqa: F401
    import edgetorch.measure.process  # noqa: F401
    from _workloads import minilm_batch, photo_batch, random_model, step_times  # noqa: F401

    spec, size, batch = _models(device)[name]
    torch.manual_seed(0)
    if spec == "minilm":
        model, ids, labels = minilm_batch(size)
        index = torch.arange(batch) % len(ids)
        model, x, y = model, ids[index], labels[index]
    else:
        model, x, y = random_model(spec), photo_batch(batch, size), torch.arange(batch) % 10
    return model.to(device), x.to(device), y.to(device)


def bounds(name: str, device: str) -> dict:
    """Dense's, the smallest exact whole-model candidate's and the smallest candidate's predicted
    peaks at the requested batch."""
    from edgetorch import plan_memory

    model, x, y = _workload(name, device)
    plan = plan_memory(model, (x, y), "1000GiB")
    at_batch = [c for c in plan.candidates if c.batch == len(x)]
    dense = next(c for c in at_batch if c.policy == "dense").predicted_peak_bytes
    return {"dense": dense, "exact": min(c.predicted_peak_bytes for c in at_batch if c.exact),
            "smallest": min(c.predicted_peak_bytes for c in at_batch)}


def worker(name: str, device: str, budget: int, policies: list[str] | None = None, fixed_batch: bool = False) -> dict:
    """Plan and train, nothing else: the peak from start to end is what a user's run would reach (a
    fidelity check runs plain PyTorch's step, which would raise it). ``policies`` None: the default
    candidates and the per-block plan, as finetune plans; else only those whole-model policies.
    ``fixed_batch``: only the requested batch is a candidate (``finetune --min-batch`` at the batch)."""
    import torch
    import torch.nn.functional as F

    from edgetorch import Dense, plan_memory
    from edgetorch.activations.blocks import PerBlock, Recompute, find_blocks
    from edgetorch.activations.checkpoint import find_stages
    from edgetorch.activations.step import forward_backward, parse_training_policy
    from edgetorch.measure.process import process_peak_bytes

    model, x, y = _workload(name, device)
    if policies == list(CHECKPOINT_POLICIES) and not find_stages(model):
        # A model whose layers sit in a ModuleList (BERT) has no nn.Sequential stage to wrap: the
        # peer is torch.utils.checkpoint around every layer (a plan recomputing each block, keeping
        # its input dense), which is what a user writes by hand there.
        policies = ["dense", PerBlock(tuple((b, Recompute(Dense())) for b in find_blocks(model)), Dense()).spec()]
    start = time.perf_counter()
    options = {"per_block": True} if policies is None else {"policies": policies}
    if fixed_batch:
        options["min_batch"] = len(x)
    plan = plan_memory(model, (x, y), budget, **options)
    planning = time.perf_counter() - start
    planned_peak = process_peak_bytes(torch.device(device))  # the peak so far: planning's, or loading's
    whole = next((c for c in plan.candidates if c.fits and not c.policy.startswith("per-block")), None)
    result = {"model": name, "budget_bytes": budget, "planning_seconds": planning, "reason": plan.reason,
              "peak_after_planning_bytes": planned_peak,
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
    result["process_peak_bytes"] = process_peak_bytes(torch.device(device))
    return result


def measure(name: str, device: str, fidelity: list[list], timed: list[list], planner_malloc: bool = False) -> dict:
    """The fidelity cost of each ``[spec, batch]`` in ``fidelity`` on the batch it trains at, and the
    time per sample of each ``[spec, batch]`` in ``timed`` over plain PyTorch's at the requested batch
    (interleaved rounds, the least of each). ``planner_malloc``: with glibc set as the planner sets it
    (``honest_malloc``), which ``finetune --memory-budget`` then trains under; else its defaults."""
    import torch
    import torch.nn.functional as F

    from edgetorch.activations.fidelity import gradient_fidelity
    from edgetorch.activations.step import parse_training_policy, step_seconds
    from edgetorch.measure.process import honest_malloc, process_peak_bytes

    if planner_malloc and device == "cpu":
        honest_malloc()
    model, x, y = _workload(name, device)
    out = {"fidelity": {}}
    for spec, batch in fidelity:
        f = gradient_fidelity(model, (x[:batch], y[:batch]), spec)
        out["fidelity"][spec] = {"fidelity_cost": f.mean_squared_relative_error, "worst_cosine": f.worst_cosine}
    steps = {f"{spec}@{batch}": (x[:batch], y[:batch], parse_training_policy(spec))
             for spec, batch in [["dense", len(x)], *timed]}
    times = step_seconds(model, steps, F.cross_entropy, TIME_ROUNDS)
    out["seconds_per_sample"] = per_sample = {key: t / len(steps[key][0]) for key, t in times.items()}
    out["time_per_sample_vs_plain"] = {f"{spec}@{batch}": per_sample[f"{spec}@{batch}"] / per_sample[f"dense@{len(x)}"]
                                       for spec, batch in timed}
    out["process_peak_bytes"] = process_peak_bytes(torch.device(device))
    out["minor_page_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # the process's, from start
    return out


# setting -> (honest_malloc in the process, environment added at its start)
MALLOC_SETTINGS = {"default": (False, {}), "planner's": (True, {}),
                   "planner's + huge pages": (True, {"THP_MEM_ALLOC_ENABLE": "1"})}


def malloc_cost(names: list[str], rounds: int) -> None:
    """What the planner's malloc settings (``honest_malloc``, which ``finetune --memory-budget`` trains
    under) cost a step against glibc's defaults: plain PyTorch's, the middle fixed-batch budget's
    whole-model choice's and per-block plan's (from ``block_plan_fixed_batch_NAME.json``), each timed
    by ``measure`` in a fresh process per setting (``MALLOC_SETTINGS``), ``rounds`` processes each,
    the order rotated per round; the ratio is the median seconds per sample under a setting over the
    median under the defaults (processes apart: noisier than one run's ratios), beside each
    process's peak resident memory and its minor page faults. The third setting asks torch for huge
    pages for tensors of 2 MiB or more (``THP_MEM_ALLOC_ENABLE``, read at the process's first
    tensor): every large tensor is a fresh mapping under the planner's settings, so each first
    touch faults, once per 4 KiB page without them."""
    from pathlib import Path

    results = Path(__file__).resolve().parent.parent / "docs" / "results"
    settings = list(MALLOC_SETTINGS)
    data = {}
    for name in names:
        record = json.loads((results / f"block_plan_fixed_batch_{name}.json").read_text())
        middle = min(record["runs"], key=lambda r: abs(r["fraction"] - 0.5))
        timed = [[c["policy"], c["batch"]] for c in (middle["whole"], middle["chosen"]) if c is not None]
        runs: dict[str, list[dict]] = {k: [] for k in settings}
        for i in range(rounds):
            for setting in settings[i % len(settings):] + settings[:i % len(settings)]:
                print(f"{name}: round {i}, {setting} malloc", file=sys.stderr, flush=True)
                honest, env = MALLOC_SETTINGS[setting]
                runs[setting].append(_call("cpu", "measure", env=env, name=name, fidelity=[], timed=timed,
                                           planner_malloc=honest))
        failed = [r["error"] for v in runs.values() for r in v if "error" in r]
        if failed:
            raise RuntimeError(f"{name}: {failed[0]}")
        data[name] = {"timed": timed, "runs": runs}
    write_malloc_cost(rounds, data)


def write_malloc_cost(rounds: int, data: dict) -> None:
    """``malloc_cost``'s table and results from its measurements (``data``: model -> timed steps and
    runs per setting)."""
    import statistics

    settings = list(MALLOC_SETTINGS)
    rows = []
    for name, record in data.items():
        runs = record["runs"]

        def median(setting: str, field: str, key: str | None = None) -> float:
            return statistics.median(r[field][key] if key else r[field] for r in runs[setting])

        for key in runs["default"][0]["seconds_per_sample"]:
            default = median("default", "seconds_per_sample", key)
            cells = []
            for setting in settings[1:]:
                t = median(setting, "seconds_per_sample", key)
                cells += [f"{1e3 * t:.1f}", f"{t / default:.2f}"]
            spec, batch = key.rsplit("@", 1)
            rows.append([name, _short(spec), batch, f"{1e3 * default:.1f}", *cells])
        peaks = [mib(max(r["process_peak_bytes"] for r in runs[k])) for k in settings]
        rows.append([name, "process peak MiB (largest)", "-", peaks[0], *[c for p in peaks[1:] for c in (p, "-")]])
        faults = {k: median(k, "minor_page_faults") for k in settings}
        rows.append([name, "minor page faults per process (median)", "-", f"{faults['default']:,.0f}",
                     *[c for k in settings[1:] for c in (f"{faults[k]:,.0f}", f"{faults[k] / faults['default']:.2f}")]])
    body = (f"Each step timed by this bench's `measure` (one untimed pass, then the least of {TIME_ROUNDS} interleaved "
            f"rounds) in a fresh process, {rounds} processes per setting, order rotated; ms per sample is the median "
            "over those processes. 'planner's' is glibc set as `plan_memory` sets it (`honest_malloc`: large "
            "allocations mapped and returned at once, freed heap trimmed), which `finetune --memory-budget` then "
            "trains under; 'default' is glibc's own settings; '+ huge pages' adds `THP_MEM_ALLOC_ENABLE=1` (torch "
            "asks the kernel for 2 MiB pages for tensors of 2 MiB or more; not what the planner sets). The steps are "
            "forward and backward only (no optimizer step), at the middle budget of the fixed-batch runs' choices. "
            "Peaks: each process's peak resident memory from start (model build and the timed steps, no planning); "
            "page faults: the process's minor faults from start.\n\n")
    body += table(["model", "step", "batch", "default ms/sample", "planner's ms/sample", "/ default",
                   "+ huge pages ms/sample", "/ default"], rows, right=[2, 3, 4, 5, 6, 7])
    write_results("block_plan_malloc_cost", "What the planner's malloc settings cost a training step (issue 26)", body,
                  {"rounds": rounds, "settings": {k: {"honest_malloc": h, "env": e} for k, (h, e) in
                                                  MALLOC_SETTINGS.items()}, "models": data},
                  f"bench/block_plan.py --malloc-cost {rounds} --models {','.join(data)}")


def compiled(name: str, device: str) -> dict:
    """``torch.compile`` at each of ``COMPILE_RATIOS``: compile time, step peak and step time against
    eager plain PyTorch (interleaved, the least of each), SGD with momentum as the worker trains."""
    import torch
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch.nn.functional as F

    from edgetorch.measure.process import honest_malloc, peak_bytes, reset_peak
    from edgetorch.measure.timing import interleave, wall_time

    # As the planner sets it in the worker: resident memory follows what is live (without it, glibc
    # kept freed memory resident and eager resnet18's step peaked 1,383 MiB here against ~1,040 there).
    honest = device == "cpu" and honest_malloc()
    base, x, y = _workload(name, device)
    dev = torch.device(device)

    def stepper(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        return step

    eager = stepper(base)
    eager()
    rows = []
    for ratio in COMPILE_RATIOS:
        torch._dynamo.reset()
        net = copy.deepcopy(base)
        step = stepper(torch.compile(net))
        patch = {"activation_memory_budget": ratio}
        if hasattr(functorch_config, "enable_autograd_cache"):
            patch["enable_autograd_cache"] = False  # a cached partition must not serve another ratio
        row = {"ratio": ratio}
        try:
            with functorch_config.patch(**patch):  # the partition is decided at the first forward+backward
                start = time.perf_counter()
                step()
                step()
                row["compile_seconds"] = wall_time(lambda: None, dev) + time.perf_counter() - start
                reset_peak(dev)
                step()
                row["step_peak_bytes"] = peak_bytes(dev)
                times = interleave({"eager": lambda: wall_time(eager, dev), "compiled": lambda: wall_time(step, dev)},
                                   TIME_ROUNDS, rotate=True, measure=lambda fn: fn())
                row["step_time_vs_eager"] = min(times["compiled"]) / min(times["eager"])
        except Exception as e:  # noqa: BLE001 - a failed compile is a result of the peer, recorded
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        del step, net
        gc.collect()
    reset_peak(dev)
    eager()
    return {"eager_step_peak_bytes": peak_bytes(dev), "ratios": rows, "honest_malloc": honest}


def _run(*args: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True,
                          env={**os.environ, **env} if env else None)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _call(device: str, what: str, env: dict[str, str] | None = None, **kwargs) -> dict:
    """One measurement: in a fresh process on a CPU (resident memory starts clean only there), with
    ``env`` added to its environment; in this one on a GPU, after freeing the last and restarting the
    allocator's peaks."""
    if device != "cuda":
        try:
            return _run("--call", json.dumps({"what": what, **kwargs}), env=env)
        except subprocess.CalledProcessError as e:  # recorded; the other models still run
            print(e.stderr[-3000:], file=sys.stderr)
            return {"error": e.stderr.strip().splitlines()[-1][:500] if e.stderr.strip() else f"exit {e.returncode}"}
    import torch

    from edgetorch.measure.process import restart_peaks

    gc.collect()
    torch.cuda.empty_cache()
    restart_peaks(torch.device(device))
    try:
        return json.loads(json.dumps(CALLS[what](device=device, **kwargs)))  # the same record as a child's
    except Exception as e:  # noqa: BLE001 - one run's failure is recorded; the lease is too short to lose the rest
        import traceback

        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}


CALLS = {"bounds": bounds, "worker": worker, "measure": measure, "compiled": compiled}


def _best_compiled(compile_runs: dict, budget: int) -> dict | None:
    fitting = [r for r in compile_runs["ratios"] if "error" not in r and r["step_peak_bytes"] <= budget]
    return min(fitting, key=lambda r: r["step_time_vs_eager"], default=None)


def _short(spec: str) -> str:
    """A policy's spec for the table: a per-block plan that recomputes every block, in words."""
    if spec.startswith("per-block(") and all(part.strip().startswith("default=") or "=recompute(dense)" in part
                                             for part in spec[len("per-block("):-1].split(";")):
        return "every layer checkpointed"
    return spec


def _report(runs: list[dict], compile_runs: dict, device: str, quick: bool, complete: bool, models: str | None,
            fixed_batch: bool, fractions: str | None) -> None:
    rows = []
    for r in runs:
        if "fraction" not in r:  # the model's bounds failed
            rows.append([r["model"], "-", f"failed: {r['error']}"] + ["-"] * 11)
            continue
        chosen, whole, ckpt = r["chosen"] or {}, r["whole"] or {}, (r.get("checkpoint") or {}).get("chosen") or {}
        measured = r.get("measured", {})
        cost = {spec: f"{m['fidelity_cost']:.3g}" for spec, m in measured.get("fidelity", {}).items()}
        again = r.get("measured_planner_malloc", {}).get("time_per_sample_vs_plain", {})
        speed = {k: f"{v:.2f}" + (f" / {again[k]:.2f}" if k in again else "")
                 for k, v in measured.get("time_per_sample_vs_plain", {}).items()}
        peak, ckpt_peak = r.get("process_peak_bytes"), (r.get("checkpoint") or {}).get("process_peak_bytes")
        comp = compile_runs.get(r["model"])
        comp = None if comp is None or "error" in comp else comp
        best = None if comp is None else _best_compiled(comp, r["budget_bytes"])

        def at(c: dict) -> str:
            return f"{c['policy']}@{c['batch']}" if c else ""
        rows.append([
            f"{r['model']} {r['fraction']:.2f}", mib(r["budget_bytes"]),
            f"failed: {r['error']}" if "error" in r else
            ("per-block" if r["per_block"] else chosen.get("policy", "nothing fits")) + (f" b{chosen['batch']}" if chosen else ""),
            cost.get(chosen.get("policy"), "-"), speed.get(at(chosen), "-"),
            "-" if peak is None else mib(peak) + ("" if peak <= r["budget_bytes"] else " (over)"),
            f"{whole['policy']} b{whole['batch']}" if whole else "none fits", cost.get(whole.get("policy"), "-"),
            speed.get(at(whole), "-"),
            (f"failed: {r['checkpoint']['error']}" if "error" in (r.get("checkpoint") or {}) else
             f"{_short(ckpt['policy'])} b{ckpt['batch']}" if ckpt else "none fits"), speed.get(at(ckpt), "-"),
            "-" if ckpt_peak is None else mib(ckpt_peak) + ("" if ckpt_peak <= r["budget_bytes"] else " (over)"),
            "not run" if comp is None else
            (f"{best['ratio']}: {best['step_time_vs_eager']:.2f}, {mib(best['step_peak_bytes'])}" if best else "none fits"),
            f"{r['planning_seconds']:.0f}"])
    peak_name = "the allocator's peak" if device == "cuda" else "the process's peak resident memory"
    body = (("**Incomplete: the run stopped (its time budget, or a failure) after the rows below.**\n\n" if not complete else "")
            + ("Fixed batch (`--fixed-batch`): every candidate, plan and peer trains at the model's requested batch, "
               "as `finetune --memory-budget --min-batch B` with B the batch does, so no choice trades the batch for "
               "exactness. Budget point: the fraction of the way from the smallest candidate's predicted peak to "
               "the smallest exact candidate's (plus the 5% headroom), where only lossy whole-model policies fit. "
               "torch.compile is not rerun here (it chooses no batch): see the run without the flag.\n\n"
               if fixed_batch else "")
            + f"Each plan and checkpoint row is its own run (see the script's docstring). Fidelity cost: mean "
            "squared relative error of the weight gradients against plain PyTorch's on the batch trained at (0: "
            "exact). Time: per sample, against plain PyTorch's step at the requested batch; where two are given, "
            "in a process with glibc's default malloc settings / with the planner's (large allocations mapped and "
            "returned at once, `honest_malloc`, which `plan_memory` sets and `finetune --memory-budget` then trains "
            "under). Peak: "
            f"{peak_name} from start (planning included) to the end of {STEPS} training steps. torch.compile: the "
            "fastest `activation_memory_budget` ratio whose step peak fits the budget, its step time against eager "
            "and its step peak.\n\n")
    body += table(["model, budget point", "budget MiB", "edgetorch's choice", "its fidelity cost", "its time",
                   "its peak MiB", "best whole-model that fits", "its fidelity cost", "its time",
                   "checkpoint (planner)", "its time", "its peak MiB", "torch.compile ratio: time, peak MiB",
                   "planning s"], rows, right=[1, 3, 4, 5, 7, 8, 10, 11, 13])
    for name, comp in compile_runs.items():
        if "error" in comp:
            body += f"\n\n{name}: torch.compile failed: {comp['error']}"
            continue
        malloc = "" if comp.get("honest_malloc", device == "cuda") else (
            " (measured before this script set glibc to return freed memory, as the planner does: resident memory "
            "then includes freed memory glibc kept, for eager and compiled alike)")
        body += (f"\n\n{name}: torch.compile at each ratio{malloc}, eager step peak {mib(comp['eager_step_peak_bytes'])} MiB: "
                 + "; ".join(f"{r['ratio']}: " + (r["error"] if "error" in r else
                             f"peak {mib(r['step_peak_bytes'])} MiB, time {r['step_time_vs_eager']:.2f}x eager, "
                             f"compiled in {r['compile_seconds']:.0f} s") for r in comp["ratios"]))
    flags = [("--quick", "_quick", quick), ("--device cuda", "_cuda", device == "cuda"),
             ("--fixed-batch", "_fixed_batch", fixed_batch),
             (f"--models {models}", f"_{(models or '').replace(',', '_')}", bool(models)),
             (f"--fractions {fractions}", f"_at_{(fractions or '').replace(',', '_')}", bool(fractions))]
    stem = "block_plan" + "".join(suffix for _, suffix, on in flags if on)
    script = " ".join(["bench/block_plan.py"] + [flag for flag, _, on in flags if on])
    write_results(stem, "Per-block memory plans against whole-model policies and the peers (issue 26)", body,
                  {"runs": runs, "compiled": compile_runs, "complete": complete}, script)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="resnet18 at the budget a tenth of the way from the smallest candidate to dense")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--models", help="comma-separated subset of the device's models, or of the larger CPU workloads "
                        f"({', '.join(LARGER)}) (results: block_plan[_cuda]_MODELS.*)")
    parser.add_argument("--fixed-batch", action="store_true",
                        help="train every choice at the requested batch (results: block_plan[...]_fixed_batch.*)")
    parser.add_argument("--fractions", help="comma-separated budget points instead of 0.25,0.5,0.75 (results under "
                        "their own name; torch.compile is not run)")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start nothing new after this many seconds")
    parser.add_argument("--malloc-cost", type=int, metavar="ROUNDS",
                        help="time the --models' middle fixed-batch choices and plain PyTorch under glibc's defaults, "
                        "the planner's malloc settings and those with huge pages, ROUNDS processes each (results: "
                        "block_plan_malloc_cost.*)")
    parser.add_argument("--call", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.call:
        kwargs = json.loads(args.call)
        print(json.dumps(CALLS[kwargs.pop("what")](device="cpu", **kwargs)))
        return
    if args.malloc_cost:
        malloc_cost(args.models.split(",") if args.models else ["deit_tiny_b32", "mobilenet_v2"], args.malloc_cost)
        return
    started = time.perf_counter()
    names = args.models.split(",") if args.models else ["resnet18"] if args.quick else list(_models(args.device, larger=False))
    fractions = (0.1,) if args.quick else tuple(map(float, args.fractions.split(","))) if args.fractions else FRACTIONS
    runs, compile_runs, complete = [], {}, True

    def left() -> bool:
        return time.perf_counter() - started < args.budget_s

    for name in names:
        if not left():
            complete = False
            break
        limits = _call(args.device, "bounds", name=name)
        if "error" in limits:
            runs.append({"model": name, "error": limits["error"]})
            continue
        for fraction in fractions:
            if not left():
                complete = False
                break
            # With the planner's 5% headroom: fraction 0 is where the smallest candidate just fits, 1
            # where dense does (with --fixed-batch: the smallest exact candidate, below which only a
            # lossy whole-model policy fits at the batch, and a per-block plan can be strictly better).
            top = limits["exact"] if args.fixed_batch else limits["dense"]
            budget = int((limits["smallest"] + fraction * (top - limits["smallest"])) * (1 + MARGIN))
            print(f"{name} at {mib(budget)} MiB ...", file=sys.stderr, flush=True)
            run = {"model": name, "budget_bytes": budget, "chosen": None, "whole": None, "per_block": False,
                   "planning_seconds": float("nan"),
                   **_call(args.device, "worker", name=name, budget=budget, fixed_batch=args.fixed_batch),
                   "fraction": fraction, "bounds": limits}
            run["checkpoint"] = _call(args.device, "worker", name=name, budget=budget, policies=list(CHECKPOINT_POLICIES),
                                      fixed_batch=args.fixed_batch)
            picked = [c for c in (run["chosen"], run["whole"], run["checkpoint"].get("chosen")) if c is not None]
            if picked:  # in another run: plain PyTorch's reference step must not count in the peak
                fidelity = [[c["policy"], c["batch"]] for c in picked[:2]]
                timed = list({(c["policy"], c["batch"]): None for c in picked})
                run["measured"] = _call(args.device, "measure", name=name, fidelity=fidelity,
                                        timed=[list(t) for t in timed])
                if args.device == "cpu":  # the same steps under the allocator the planner's own run trains with
                    run["measured_planner_malloc"] = _call(args.device, "measure", name=name, fidelity=[],
                                                           timed=[list(t) for t in timed], planner_malloc=True)
            runs.append(run)
            _report(runs, compile_runs, args.device, args.quick, False, args.models, args.fixed_batch, args.fractions)
        # compile has no batch to choose or budget to meet: measured once, in a run of every budget point
        if not args.quick and not args.fixed_batch and not args.fractions and left():
            print(f"{name}: torch.compile ...", file=sys.stderr, flush=True)
            compile_runs[name] = _call(args.device, "compiled", name=name)
            _report(runs, compile_runs, args.device, args.quick, False, args.models, args.fixed_batch, args.fractions)
    _report(runs, compile_runs, args.device, args.quick, complete, args.models, args.fixed_batch, args.fractions)


if __name__ == "__main__":
    main()
