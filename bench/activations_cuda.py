"""Activation compression on a GPU, the whole story in one run: allocator peak, step time, GPU kernel time, launches, host syncs.

What it measures, per torchvision model (random init, train mode, 224 px, batch 32, SGD step) and
configuration:

* ``plain``: plain PyTorch, no edgetorch at all (every ratio divides by it);
* ``dense``: the engine with the ``Dense()`` policy, which packs nothing: the engine's own cost;
* ``bitmap`` (lossless BitTrain), ``backrazor@0.9``, ``backrazor@0.9 exact=int8`` and
  ``quantized8`` (``Quantized(8)``);
* ``checkpoint (per block)``: the peer a GPU user picks, non-reentrant ``torch.utils.checkpoint``
  around every block, no edgetorch, on a copy of the model with in-place activations turned off
  (:func:`edgetorch.activations.checkpoint.checkpoint_blocks`);
* ``captured ...``: the whole step (forward under the policy, backward, SGD step) captured as one
  CUDA graph by :func:`edgetorch.capture_step` and replayed: ``captured plain`` (the fair baseline
  for graph replay), ``captured backrazor@0.9``, ``captured quantized8``;
* ``bf16 ...``: plain, bitmap, Back Razor and Quantized(8) under ``torch.autocast("cuda",
  dtype=torch.bfloat16)``, against bf16 plain;
* ``compiled budget=B`` (resnet18 only, to bound compile time): ``torch.compile(model)`` with
  ``torch._functorch.config.activation_memory_budget`` = 1.0 and 0.5, timed against eager plain in
  its own phase.

For each: the CUDA caching allocator's peak during one step minus what was allocated before it;
the median step time over STEPS timed steps (configurations interleaved step by step, so drift
hits all alike); one step under ``torch.profiler``: its wall time next to the sum of its GPU
kernels' durations, the kernels it ran and the launch calls the host made; and the host syncs one
step makes (``torch.cuda.set_sync_debug_mode("warn")`` warns once per sync; they are counted).
Each configuration is measured in isolation from failure: an error is recorded in its row.

Requires a CUDA device; writes ``docs/results/activations_cuda.{json,md}``. ``--smoke`` is the same
run on resnet18 at batch 2, 32 px, one step of each configuration the device has (no captured rows
without CUDA, and torch.compile through aot_eager), printed and not written. That the per-block checkpoint peer of every model gives plain
PyTorch's gradients is checked by ``tests/test_checkpoint_blocks.py``.

Run: ``python bench/activations_cuda.py`` on a machine with a GPU (about 3-4 minutes on an H200,
``--budget-s`` bounds it; SIGTERM writes what was measured so far).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import os
import signal
import statistics
import time
from pathlib import Path
from collections.abc import Callable

import torch
import torchvision
from _common import mib, table, write_results
from torch import nn
from torch.nn import functional as F

import edgetorch
from edgetorch.activations import capacity
from edgetorch.activations.checkpoint import checkpoint_blocks
from edgetorch.measure.counters import allocator_peak, count_host_syncs, host_profile, kernel_profile
from edgetorch.measure.timing import per_call, synchronize, wall_time

MODELS = ("resnet18", "resnet50", "vgg11_bn", "mobilenet_v2")
BATCH, SIZE, WARMUP, STEPS = 32, 224, 3, 10
COMPILE_MODEL, BUDGETS = "resnet18", (1.0, 0.5)
BUDGET_S = 300  # seconds: models left when it is spent are skipped; compile needs COMPILE_S of it
COMPILE_S = 120
TIME_TARGETS = {"dense": 1.05, "bitmap": 1.20, "backrazor": 1.30, "quantized": 1.30}  # step time vs plain
SYNC_TARGETS = {"bitmap": 1, "backrazor": 0, "quantized": 0}  # host syncs per step, at most


class Stop(Exception):
    """SIGTERM: stop measuring and write what was measured."""


@dataclasses.dataclass
class Config:
    label: str
    policy: edgetorch.Policy | None = None
    bf16: bool = False
    kind: str = "eager"  # eager | checkpoint | captured

    @property
    def baseline(self) -> str:
        return "bf16 plain" if self.bf16 else "plain"


def configurations(cuda: bool) -> list[Config]:
    """Every configuration; the captured ones only where there is CUDA."""
    br, br8 = edgetorch.BackRazor(0.9), edgetorch.BackRazor(0.9, exact="int8")
    q8, bitmap = edgetorch.Quantized(8), edgetorch.Bitmap()
    configs = [Config("plain"), Config("dense", edgetorch.Dense()), Config("bitmap", bitmap),
               Config("backrazor@0.9", br), Config("backrazor@0.9 exact=int8", br8), Config("quantized8", q8),
               Config("checkpoint (per block)", kind="checkpoint")]
    if cuda:
        configs += [Config("captured plain", kind="captured"), Config("captured backrazor@0.9", br, kind="captured"),
                    Config("captured quantized8", q8, kind="captured")]
    configs += [Config("bf16 plain", bf16=True), Config("bf16 bitmap", bitmap, bf16=True),
                Config("bf16 backrazor@0.9", br, bf16=True), Config("bf16 quantized8", q8, bf16=True)]
    return configs


# -- one configuration, ready to step -----------------------------------------------------------

class Runner:
    """A configuration's model, optimizer and step; ``error`` holds why it stopped, if it did."""

    def __init__(self, config: Config, net: nn.Module, opt: torch.optim.Optimizer):
        self.config, self.net, self.opt = config, net, opt
        self.captured = None
        self.error: str | None = None

    def capture(self, x, y, warmup: int) -> None:
        self.captured = edgetorch.capture_step(self.net, self.config.policy, self.opt, x, y, warmup=warmup)

    def step(self, x, y, ledger=None, marks: dict | None = None) -> None:
        if self.captured is not None:
            self.captured(x, y)
            return
        policy, device = self.config.policy, x.device
        scope = (edgetorch.compress_activations(self.net, policy, ledger=ledger)
                 if policy is not None else contextlib.nullcontext())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.config.bf16), scope:
            loss = F.cross_entropy(self.net(x).float(), y)
        if marks is not None and device.type == "cuda":
            marks["forward_end"] = torch.cuda.memory_allocated()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)  # gradients stay allocated: every step starts alike

    def fail(self, what: str, e: BaseException) -> None:
        text = str(e).splitlines()[0][:300].replace("|", "/") if str(e) else ""
        self.error = f"{what}: {type(e).__name__}: {text}"
        print(f"    {self.config.label}: {self.error}", flush=True)


def peak_of(run: Callable[[dict], None], device) -> tuple[int | None, int | None]:
    """Allocator peak of one step minus what was allocated before it, and the forward's increase."""
    marks: dict = {}
    peak = allocator_peak(lambda: run(marks), device)
    if peak is None:
        return None, None
    return peak.increase, (marks["forward_end"] - peak.before if "forward_end" in marks else None)


def syncs_of(run: Callable[[], None], device) -> int | None:
    """Host syncs one step makes: those torch's sync debug mode warns (reads of device values),
    plus edgetorch's waits for bitmap counts (``Event.synchronize``, which the mode does not see)."""
    waits = capacity.host_waits()
    syncs = count_host_syncs(run, device)
    return None if syncs is None else syncs + capacity.host_waits() - waits


def profile_of(run: Callable[[], None], device) -> dict:
    """One step under torch.profiler: wall ms, the sum of GPU kernel durations, kernel count,
    memcpy/memset count, and the host's launch API calls (a graph replay is one)."""
    p = kernel_profile(run, device)
    return {"profiled_wall_ms": 1e3 * p.wall_s, "kernel_ms": None if p.kernel_ns is None else p.kernel_ns / 1e6,
            "kernels": p.kernels, "copies": p.copies, "host_launch_calls": p.launch_calls}


def host_profile_of(run: Callable[[], None], device, top: int = 12) -> dict:
    """One step under cProfile (:func:`~edgetorch.measure.counters.host_profile`): the functions
    with the most self time, and the Triton kernel launches (``JITFunction.run``) with their total time."""
    p = host_profile(run, device)
    launches = [f for f in p.functions if f.name == "run" and "triton" in f.file and "jit" in f.file]
    return {
        "host_profile_ms": p.total_s * 1e3,
        "host_top": [{"function": f"{Path(f.file).name}:{f.line}:{f.name}", "calls": f.calls, "self_ms": f.self_s * 1e3}
                     for f in p.functions[:top]],
        "triton_launches": sum(f.calls for f in launches),
        "triton_launch_ms": sum(f.cumulative_s for f in launches) * 1e3,
    }


def launch_costs(device, calls: int = 300) -> list[dict]:
    """Host microseconds per call of each codec on a tiny tensor (so the host sets the pace), with the
    compiled kernels launched directly and through Triton's own launch path, next to one torch op."""
    from edgetorch.codecs import _backend
    from edgetorch.codecs import _triton as T

    _backend.device(torch.zeros(1, device=device))  # loads the kernels and checks the direct launch
    x = torch.randn(4096, device=device)
    bits, rows = x.view(torch.int32), x.view(4, 1024)
    bitmap = torch.zeros(512, dtype=torch.uint8, device=device)
    calls_of = {
        "torch add_ (reference)": lambda: x.add_(0),
        "pack_mask": lambda: T.pack_mask(x, 0.0),
        "pack_bitmap_capped": lambda: T.pack_bitmap_capped(bits, 0, 4096),
        "unpack_bitmap": lambda: T.unpack_bitmap(bitmap, bits, 4096),
        "pack_topk_rows": lambda: T.pack_topk_rows(rows, 100),
        "quantize": lambda: T.quantize(rows, 8, 64),
    }

    def host_us(fn) -> float:
        return per_call(fn, calls, warmup=20, device=device).wall_s * 1e6

    direct = T._DIRECT
    out = []
    try:
        for name, fn in calls_of.items():
            T._DIRECT = False
            ordinary = host_us(fn)
            T._DIRECT = direct
            out.append({"call": name, "host_us_direct": host_us(fn) if direct else None, "host_us_triton": ordinary})
    finally:
        T._DIRECT = direct
    return out


# -- one model ----------------------------------------------------------------------------------

def _attempt(runner: Runner, what: str, fn: Callable[[], object], default=None):
    if runner.error is not None:
        return default
    try:
        return fn()
    except Stop:
        raise
    except Exception as e:  # one configuration failing must not end the run
        runner.fail(what, e)
        return default


def workload(name: str, device: torch.device, batch: int, size: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The seed-0 model (1,000 classes, train mode) and one random batch that every configuration steps."""
    torch.manual_seed(0)
    base = torchvision.models.get_model(name, weights=None, num_classes=1000).to(device).train()
    return base, torch.randn(batch, 3, size, size, device=device), torch.randint(0, 1000, (batch,), device=device)


def sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9)


def run_model(name: str, device: torch.device, batch: int, size: int, warmup: int, steps: int) -> list[dict]:
    print(f"{name}: building", flush=True)
    configs = configurations(device.type == "cuda" and os.environ.get("ACT_NO_CAPTURED") != "1")
    base, x, y = workload(name, device, batch, size)
    eager_opt = sgd(base)  # every eager configuration steps the same model
    runners: list[Runner] = []
    for c in configs:
        if c.kind == "eager":
            runners.append(Runner(c, base, eager_opt))
        else:
            runner = Runner(c, None, None)
            try:
                net = copy.deepcopy(base)
                if c.kind == "checkpoint":
                    net = checkpoint_blocks(net)
                runner.net, runner.opt = net, sgd(net)
            except Exception as e:
                runner.fail("build", e)
            runners.append(runner)
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())

    print(f"{name}: warm-up ({warmup} steps each) and capture", flush=True)
    for _ in range(warmup):  # cuDNN autotuning, optimizer state, allocator pools, Triton compiles
        for r in runners:
            if r.config.kind != "captured":
                _attempt(r, "warm-up", lambda r=r: r.step(x, y))
    for r in runners:
        if r.config.kind == "captured":
            _attempt(r, "capture", lambda r=r: r.capture(x, y, warmup))

    print(f"{name}: {steps} timed steps, interleaved", flush=True)
    times: dict[str, list[float]] = {r.config.label: [] for r in runners}
    for _ in range(steps):
        for r in runners:
            t = _attempt(r, "timed step", lambda r=r: wall_time(lambda: r.step(x, y), device))
            if t is not None:
                times[r.config.label].append(t)

    print(f"{name}: peak, syncs, ledger and one profiled step per configuration", flush=True)
    measured: dict[str, dict] = {}
    for r in runners:
        m = measured[r.config.label] = {}
        peak = _attempt(r, "peak step", lambda r=r: peak_of(lambda marks=None: r.step(x, y, marks=marks), device))
        m["peak"], m["forward"] = peak if peak is not None else (None, None)
        if r.captured is not None and r.captured.peak_bytes is not None:
            # A replay allocates nothing: its peak is the allocator's peak while the step was captured,
            # less the gradients it allocated then (an eager row holds them before its step). The
            # pool the graph keeps reserved is reported beside it.
            m["pool"] = r.captured.pool_bytes
            m["peak"] = r.captured.peak_bytes - grad_bytes
        m["syncs"] = _attempt(r, "sync count", lambda r=r: syncs_of(lambda: r.step(x, y), device))
        if r.config.policy is not None and r.config.kind == "eager":
            ledger = edgetorch.SavedTensorLedger()
            _attempt(r, "ledger step", lambda r=r: r.step(x, y, ledger=ledger))
            m["ledger"] = ledger.total().stored_bytes if r.error is None else None
        m.update(_attempt(r, "profiled step", lambda r=r: profile_of(lambda: r.step(x, y), device), {}))
        if r.config.kind == "eager" and not r.config.bf16:
            m.update(_attempt(r, "host profile", lambda r=r: host_profile_of(lambda: r.step(x, y), device), {}))

    rows = []
    med = {label: statistics.median(ts) for label, ts in times.items() if ts}
    for r in runners:
        c, m = r.config, measured[r.config.label]
        base_peak = measured.get(c.baseline, {}).get("peak")
        rows.append({
            "model": name, "config": c.label, "kind": c.kind, "bf16": c.bf16, "baseline": c.baseline,
            "policy": None if c.policy is None else c.policy.spec(),
            "step_peak_bytes": m.get("peak"), "graph_pool_bytes": m.get("pool"),
            "forward_increase_bytes": m.get("forward"), "ledger_stored_bytes": m.get("ledger"),
            "step_peak_ratio": (m["peak"] / base_peak if m.get("peak") is not None and base_peak else None),
            "median_step_seconds": med.get(c.label), "timed_steps": len(times[c.label]),
            "step_time_ratio": (med[c.label] / med[c.baseline] if c.label in med and c.baseline in med else None),
            "time_vs_captured_plain": (med[c.label] / med["captured plain"]
                                       if c.kind == "captured" and c.label in med and "captured plain" in med else None),
            "host_syncs_per_step": m.get("syncs"),
            **{k: m.get(k) for k in ("profiled_wall_ms", "kernel_ms", "kernels", "copies", "host_launch_calls",
                                     "host_profile_ms", "host_top", "triton_launches", "triton_launch_ms")},
            "error": r.error,
        })
    return rows


# -- the compiled peer --------------------------------------------------------------------------

def run_compiled(name: str, device: torch.device, batch: int, size: int, warmup: int, steps: int,
                 backend: str = "inductor") -> list[dict]:
    """``torch.compile(model)`` at each activation_memory_budget, timed against eager plain
    (``backend``: the smoke run on a CPU uses aot_eager, to check this code without inductor's compile)."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    base, x, y = workload(name, device, batch, size)
    eager = Runner(Config("plain"), base, sgd(base))
    rows = []
    for budget in BUDGETS:
        print(f"{name}: torch.compile, activation_memory_budget={budget}", flush=True)
        torch._dynamo.reset()
        net = copy.deepcopy(base)
        runner = Runner(Config(f"compiled budget={budget}" + ("" if backend == "inductor" else f" ({backend})")),
                        torch.compile(net, backend=backend), sgd(net))
        patch = {"activation_memory_budget": budget}
        if hasattr(functorch_config, "enable_autograd_cache"):
            patch["enable_autograd_cache"] = False  # a cached partition must not serve another budget
        compile_s = None
        # The whole phase under the budget: the partition is decided when the first forward and
        # backward compile, and a recompile (there should be none) must see the same budget.
        with functorch_config.patch(**patch):
            start = time.perf_counter()
            for _ in range(warmup):
                _attempt(runner, "compile and warm-up", lambda: runner.step(x, y))
            if runner.error is None:
                synchronize(device)
                compile_s = time.perf_counter() - start
            for _ in range(warmup):
                eager.step(x, y)
            times: dict[str, list[float]] = {"plain": [], "compiled": []}
            for _ in range(steps):
                times["plain"].append(wall_time(lambda: eager.step(x, y), device))
                t = _attempt(runner, "timed step", lambda: wall_time(lambda: runner.step(x, y), device))
                if t is not None:
                    times["compiled"].append(t)
            plain_peak, _ = peak_of(lambda marks=None: eager.step(x, y, marks=marks), device)
            peak = _attempt(runner, "peak step",
                            lambda: peak_of(lambda marks=None: runner.step(x, y, marks=marks), device))
            peak = None if peak is None else peak[0]
            prof = _attempt(runner, "profiled step", lambda: profile_of(lambda: runner.step(x, y), device), {})
            syncs = _attempt(runner, "sync count", lambda: syncs_of(lambda: runner.step(x, y), device))
        med_plain = statistics.median(times["plain"])
        med = statistics.median(times["compiled"]) if times["compiled"] else None
        rows.append({
            "model": name, "config": runner.config.label, "kind": "compiled", "bf16": False, "baseline": "plain",
            "backend": backend, "activation_memory_budget": budget, "compile_and_warmup_seconds": compile_s,
            "step_peak_bytes": peak, "plain_step_peak_bytes": plain_peak,
            "step_peak_ratio": peak / plain_peak if peak is not None and plain_peak else None,
            "median_step_seconds": med, "plain_median_step_seconds": med_plain,
            "step_time_ratio": med / med_plain if med is not None else None,
            "host_syncs_per_step": syncs, **prof, "error": runner.error,
        })
        del runner, net
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return rows


# -- verdicts and the report --------------------------------------------------------------------

def verdicts(rows: list[dict], compiled: list[dict]) -> list[str]:
    out = []

    def ok(flag: bool) -> str:
        return "met" if flag else "NOT met"

    for r in rows:
        family = (r["policy"] or "").partition(":")[0]
        if r["error"]:
            if family in TIME_TARGETS or r["kind"] == "checkpoint":
                out.append(f"- {r['model']} {r['config']}: not measured ({r['error']})")
            continue
        target = TIME_TARGETS.get(family)
        if target is not None and r["step_time_ratio"] is not None:
            extra = (f" ({r['time_vs_captured_plain']:.2f}x of captured plain)"
                     if r["time_vs_captured_plain"] is not None else "")
            out.append(f"- {r['model']} {r['config']}: step {r['step_time_ratio']:.2f}x of {r['baseline']}"
                       f"{extra} (target <= {target:.2f}x): {ok(r['step_time_ratio'] <= target)}")
        limit = SYNC_TARGETS.get(family)
        if limit is not None and r["host_syncs_per_step"] is not None:
            out.append(f"- {r['model']} {r['config']}: {r['host_syncs_per_step']} host syncs per step "
                       f"(target <= {limit}): {ok(r['host_syncs_per_step'] <= limit)}")
    for model in dict.fromkeys(r["model"] for r in rows):
        peer = next((r for r in rows if r["model"] == model and r["kind"] == "checkpoint"), None)
        if peer is None or peer["error"] or peer["step_peak_bytes"] is None or peer["median_step_seconds"] is None:
            out.append(f"- {model}: per-block checkpointing not measured, no comparison")
            continue
        ours = [r for r in rows if r["model"] == model and r["policy"] and not r["bf16"] and not r["error"]
                and r["step_peak_bytes"] is not None and r["median_step_seconds"] is not None]
        both = [r for r in ours if r["step_peak_bytes"] < peer["step_peak_bytes"]
                and r["median_step_seconds"] < peer["median_step_seconds"]]
        names = ", ".join(f"{r['config']} ({mib(r['step_peak_bytes'])} MiB, {1e3 * r['median_step_seconds']:.1f} ms)"
                          for r in both) or "none"
        out.append(f"- {model}: edgetorch configurations (fp32) with both a lower peak and a lower time than "
                   f"per-block checkpointing ({mib(peer['step_peak_bytes'])} MiB, "
                   f"{1e3 * peer['median_step_seconds']:.1f} ms): {names}: {ok(bool(both))}")
    good = [c for c in compiled if not c["error"] and c["step_peak_bytes"] is not None and c["step_time_ratio"]]
    if good:
        best = min(good, key=lambda c: c["step_peak_bytes"])
        ours = [r for r in rows if r["model"] == best["model"] and r["policy"] and not r["bf16"] and not r["error"]
                and r["step_peak_bytes"] is not None and r["step_time_ratio"] is not None]
        # times compared through each phase's own eager plain: edgetorch/plain over compiled/plain
        wins = [r for r in ours if r["step_peak_bytes"] < best["step_peak_bytes"]
                and r["step_time_ratio"] / best["step_time_ratio"] <= 1.10]
        out.append(f"- {best['model']} under torch.compile: edgetorch does not run inside a compiled graph (not built); "
                   f"edgetorch configurations (fp32, eager or captured) with a lower peak than the lowest-peak compiled setting "
                   f"({best['config']}, {mib(best['step_peak_bytes'])} MiB) at <= 1.10x its time: "
                   f"{', '.join(r['config'] for r in wins) or 'none'}: NOT met as the issue states it (under compile)")
    return out


def _f(v, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if v is None else format(v * scale if scale != 1.0 else v, fmt)


def report(rows: list[dict], compiled: list[dict], settings: dict, notes: list[str],
           launches: list[dict] | None = None) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke)"
    main = table(
        ["model", "config", "step peak MiB", "peak vs base", "pool MiB", "step ms", "time vs base", "vs captured plain",
         "profiled wall ms", "GPU kernel ms", "kernels", "host launch calls", "host syncs", "ledger stored MiB", "error"],
        [[r["model"], r["config"] + (" †" if r["kind"] == "captured" else ""),
          "n/a" if r["step_peak_bytes"] is None else mib(r["step_peak_bytes"]), _f(r["step_peak_ratio"], ".3f"),
          "" if r["graph_pool_bytes"] is None else mib(r["graph_pool_bytes"]),
          _f(r["median_step_seconds"], ".1f", 1e3), _f(r["step_time_ratio"], ".2f"), _f(r["time_vs_captured_plain"], ".2f"),
          _f(r.get("profiled_wall_ms"), ".1f"), _f(r.get("kernel_ms"), ".1f"), _f(r.get("kernels"), "d"),
          _f(r.get("host_launch_calls"), "d"), _f(r["host_syncs_per_step"], "d"),
          "" if r["ledger_stored_bytes"] is None else mib(r["ledger_stored_bytes"]), r["error"] or ""]
         for r in rows])
    comp = table(
        ["model", "config", "compile + warm-up s", "step peak MiB", "peak vs eager plain", "step ms", "eager plain ms",
         "time vs eager plain", "profiled wall ms", "GPU kernel ms", "kernels", "host syncs", "error"],
        [[c["model"], c["config"], _f(c["compile_and_warmup_seconds"], ".0f"),
          "n/a" if c["step_peak_bytes"] is None else mib(c["step_peak_bytes"]), _f(c["step_peak_ratio"], ".3f"),
          _f(c["median_step_seconds"], ".1f", 1e3), _f(c["plain_median_step_seconds"], ".1f", 1e3),
          _f(c["step_time_ratio"], ".2f"), _f(c.get("profiled_wall_ms"), ".1f"), _f(c.get("kernel_ms"), ".1f"),
          _f(c.get("kernels"), "d"), _f(c["host_syncs_per_step"], "d"), c["error"] or ""]
         for c in compiled]) if compiled else "Not run."
    profiled = [r for r in rows if r.get("host_top")]
    host = table(
        ["model", "config", "host ms (cProfile)", "Triton launches", "their ms", "most self time (ms, calls)"],
        [[r["model"], r["config"], _f(r["host_profile_ms"], ".1f"), _f(r["triton_launches"], "d"),
          _f(r["triton_launch_ms"], ".1f"),
          "; ".join(f"{t['function']} {t['self_ms']:.1f} ({t['calls']})" for t in r["host_top"][:5])]
         for r in profiled]) if profiled else "Not measured."
    costs = table(["call (4,096 elements)", "host us, compiled kernel launched directly", "host us, Triton's launch path"],
                  [[c["call"], _f(c["host_us_direct"], ".1f"), _f(c["host_us_triton"], ".1f")]
                   for c in launches]) if launches else "Not measured."
    lines = "\n".join(verdicts(rows, compiled))
    extra = "\n".join(f"- {n}" for n in notes)
    return f"""
Device: {device}. Per model: batch {settings['batch']}, {settings['size']} px, random init, train mode,
SGD (lr 1e-4, momentum 0.9); {settings['warmup']} warm-up steps per configuration, then {settings['steps']} timed
steps each, interleaved step by step. Ratios are to `plain` (or `bf16 plain` for the bf16 rows) in the same run.

- Step peak: the CUDA allocator's peak during one step minus what was allocated before it (gradients are
  kept allocated between steps, so they are not in it). † Captured rows: a replay allocates nothing; their
  peak is the allocator's peak while the step was captured (`CapturedStep.peak_bytes`: the same measure, the
  blocks the step uses at once) minus the gradients it allocated then. The graph's private pool keeps more
  reserved for as long as the step lives (`pool MiB`: its blocks are sized and split as the allocator's
  segments are); a user pays that reservation, so it is shown beside the peak.
- Step ms: median wall time of a step, synchronized before and after. Captured rows: copy the batch into
  the static inputs and replay the graph (`edgetorch.capture_step`); `vs captured plain` divides by the
  captured plain step, the fair baseline for graph replay.
- Profiled: one step under `torch.profiler` (CUDA activity only: kernels and the CUDA API calls, no
  per-op CPU events): its wall time (profiler overhead included) next to the sum of its GPU kernels' durations; kernels: GPU kernel events (memcpy/memset not
  counted); host launch calls: the host's kernel and graph launch API calls (a graph replay is one).
  A captured row with 0 kernels means the profiler (CUPTI) did not trace the kernels inside the
  graph replay, not that none ran; its GPU kernel ms is then not measured either.
- Host syncs: `torch.cuda.set_sync_debug_mode("warn")` warnings over one whole step, plus the times the
  host waited for a lossless bitmap's kept count (`edgetorch.activations.capacity.host_waits()`: an
  `Event.synchronize`, which the debug mode does not report).
- Ledger stored: the ledger's stored bytes from a separate untimed step with a ledger attached (eager
  policy rows); the timed and peak steps run without one.
- Per-block checkpoint peer: non-reentrant `torch.utils.checkpoint` around every ResNet block, every
  MobileNet `features` block, and every conv + batch norm + ReLU (+ pool) group of VGG's flat `features`;
  built on a copy of the model with **in-place activations turned off** (`inplace=False` on its
  ReLU/ReLU6/Hardtanh/SiLU/Hardswish/LeakyReLU modules): torchvision's in-place ReLU modified a tensor a
  checkpointed layer had saved (vgg11_bn crashed with one checkpoint per `features` child). No edgetorch.
- Each configuration has its own optimizer over its own copy of the model except the eager ones, which
  share one model and one SGD (their steps cannot interfere with each other's measurements).
- torch.compile (resnet18 only, to bound compile time): `torch.compile(model)` (default mode) compiled
  afresh (`torch._dynamo.reset()`) under each `torch._functorch.config.activation_memory_budget`, the AOT
  autograd cache off; timed and measured against eager plain in its own phase. edgetorch under
  `torch.compile` is not built: the engine's saved-tensor hooks are disabled while dynamo traces, so a
  compiled model either runs eagerly under the engine or stores its compiled graph's saved tensors as one
  opaque function's (see `compress_activations`' warning); the compiled rows are the peer only.
{extra}

{main}

### Host time per codec call

{costs}

### Where an eager step's host time goes

One step per eager fp32 configuration under `cProfile` (which slows every Python call, so read shares,
not absolute times): its total, the launches that went through Triton's own path (`JITFunction.run`;
with direct launches on, only each kernel specialization's first) and their cumulative time, and the
five functions with the most self time. cProfile sees the calling thread only: on CUDA, backward's
unpack hooks run on autograd's device thread and are not in it (`run_backward` is the main thread
waiting for them).

{host}

### torch.compile peer

{comp}

### Verdicts against issue 23's targets

{lines}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny run on any device; writes nothing")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="skip models (and torch.compile) not started when this much time is spent")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    parser.add_argument("--out", default="activations_cuda", help="results name under docs/results/")
    args = parser.parse_args()
    started = time.perf_counter()

    def stop(*_):
        raise Stop

    signal.signal(signal.SIGTERM, stop)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("activations_cuda needs a CUDA device (use --smoke to check the script elsewhere)")
    # --smoke off CUDA compiles through aot_eager: the code path, not inductor's compile
    batch, size, warmup, steps = (2, 32, 1, 1) if args.smoke else (BATCH, SIZE, args.warmup, args.steps)
    models = ["resnet18"] if args.smoke else [m for m in args.models.split(",") if m]
    torch.backends.cudnn.benchmark = not args.smoke
    rows: list[dict] = []
    compiled: list[dict] = []
    notes: list[str] = ["smoke run"] if args.smoke else []
    launches = launch_costs(device) if device.type == "cuda" else []
    for row in launches:
        print(row, flush=True)
    try:
        for name in models:
            spent = time.perf_counter() - started
            if spent > args.budget_s:
                notes.append(f"{name} skipped: {spent:.0f} s spent of the {args.budget_s:.0f} s budget")
                print(notes[-1], flush=True)
                continue
            model_rows = run_model(name, device, batch, size, warmup, steps)
            rows += model_rows
            for r in model_rows:
                print(r, flush=True)
            print(f"{name}: done at {time.perf_counter() - started:.0f} s", flush=True)
            gc.collect()  # the captured graphs and their pools go with their runners
            torch.cuda.empty_cache()
        spent = time.perf_counter() - started
        if args.no_compile or COMPILE_MODEL not in models:
            notes.append("torch.compile peer not run (--no-compile, or its model not among --models)")
        elif spent > args.budget_s - COMPILE_S:
            notes.append(f"torch.compile peer skipped: {spent:.0f} s spent, it needs about {COMPILE_S} s "
                         f"of the {args.budget_s:.0f} s budget")
        else:
            compiled = run_compiled(COMPILE_MODEL, device, batch, size, warmup, steps,
                                    backend="inductor" if device.type == "cuda" else "aot_eager")
            for c in compiled:
                print(c, flush=True)
    except Stop:
        notes.append(f"run stopped by SIGTERM after {time.perf_counter() - started:.0f} s: rows after the "
                     "last complete model are missing")
    except KeyboardInterrupt:
        notes.append("run interrupted: rows after the last complete model are missing")
    notes.append(f"whole run: {time.perf_counter() - started:.0f} s")
    settings = {"batch": batch, "size": size, "warmup": warmup, "steps": steps}
    if args.smoke:
        print(report(rows, compiled, settings, notes))
        failed = [r for r in rows + compiled if r["error"]]
        if failed:
            raise SystemExit(f"{len(failed)} configurations failed: " + "; ".join(r["config"] for r in failed))
        return
    try:
        body = report(rows, compiled, settings, notes, launches)
    except Exception as e:  # the measurements must reach the JSON even if the markdown cannot be made
        body = f"Report failed ({type(e).__name__}: {e}); the rows are in {args.out}.json."
    write_results(args.out,
                  "Activation compression on a GPU: allocator peak, step time, kernel time, launches, host syncs",
                  body, {**settings, "notes": notes, "launch_costs": launches, "rows": rows, "compiled": compiled},
                  script=None if args.out == "activations_cuda" else f"bench/activations_cuda.py --out {args.out}")


if __name__ == "__main__":
    main()
