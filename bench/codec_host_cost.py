"""Host time of one codec call on the GPU path, without the GPU: a CPU proxy for issue 23.

An eager compressed training step on a GPU is host-bound (on an H100 even plain resnet18 at batch 32
is), so what a codec call costs the host is what it costs the step. That cost is the Python around
the kernel launch (argument checks, output allocations, views, the launch key) plus the launch
itself. This bench measures the first part on any machine: the GPU code path runs on CPU tensors
(``edgetorch.codecs._cuda.emulate_gpu_path``) with ``_triton._launch`` replaced by a no-op, so
each call does everything a CUDA call does on the host except launching (the launch, through
Triton's own path or directly, was measured on an H100 in ``activations_cuda``).

Each call: a ``[32, 4096]`` float32 ReLU output (a batch of 32 samples), the engine's own entry
points (``pack_bitmap_capped``, ``pack_topk``, ``pack_mask``, ``pack_quantized`` and the ``unpack``
of what they return). Per call: the median over rounds of the mean host microseconds of a block of
calls.

Whole steps too, the same way: torchvision's mobilenet_v2 at width 0.25 (the same 458 saved
tensors a step as the full model, little arithmetic), batch 2, 32 px, one thread, SGD, every saved
tensor encoded (``min_bytes=0``, as at 224 px where all are large). The stubbed launches write 0 as
every kept count a bitmap pack reads back, so the bitmap rows pack fewer tensors (a tensor of under
~1,400 elements is not smaller with the slack's slots) than a real step would. A step's host time over plain
PyTorch's, divided by the tensors it saves, is what the engine and the codec wrappers cost the host
per saved tensor on a GPU, launches aside: the CPU proxy of an eager GPU step's extra time.

``--before REV`` measures a second library (REV's ``src``, extracted) in the same run, rounds
interleaved, each side in its own process.

Run: ``python bench/codec_host_cost.py --before REV`` (a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

from _common import ROOT, revision_src, table, timed_step, write_results

ROUNDS, CALLS = 7, 500
STEPS = 10  # timed steps per configuration and round (after 3 warm-up steps)
POLICIES = ("plain", "Dense()", "Bitmap()", "BackRazor(0.9)", "Quantized(bits=8)", 'BackRazor(0.9, exact="int8")')


def measure(calls: int) -> dict[str, float]:
    """One round in this process: mean host us per call of each codec entry point."""
    os.environ["TRITON_INTERPRET"] = "1"  # the kernels module imports on a machine without a GPU
    import torch

    from edgetorch.codecs import _cuda, _triton
    from edgetorch.codecs.bitmap import pack_bitmap_capped
    from edgetorch.codecs.mask import pack_mask
    from edgetorch.codecs.quantized import pack_quantized
    from edgetorch.codecs.topk import pack_topk
    from edgetorch.measure.timing import per_call

    torch.manual_seed(0)
    x = torch.relu(torch.randn(32, 4096))
    out = {}
    with _cuda.emulate_gpu_path():
        _triton._launch = lambda *args, **kwargs: None  # everything but the launch
        capped, topk = pack_bitmap_capped(x, 70_000), pack_topk(x, 0.9)
        mask, quantized = pack_mask(x, 0.0), pack_quantized(x, 8, group=64)
        for name, fn in {
            "pack_bitmap_capped": lambda: pack_bitmap_capped(x, 70_000),
            "capped bitmap unpack": capped.unpack,
            "pack_topk": lambda: pack_topk(x, 0.9),
            "top-k unpack": topk.unpack,
            "pack_mask": lambda: pack_mask(x, 0.0),
            "mask unpack": mask.unpack,
            "pack_quantized": lambda: pack_quantized(x, 8, group=64),
            "quantized unpack": quantized.unpack,
        }.items():
            out[name] = per_call(fn, calls, warmup=20).wall_s * 1e6
        _triton._launch = _launch_writing_zero_counts
        out.update(_steps())
    return out


def _launch_writing_zero_counts(kernel, grid, *args, **kwargs) -> None:
    """The step's launch stub: what a kernel would write is never read, except the kept counts a
    bitmap pack reads back (1-2 int64 entries at these sizes), which are written as 0 (so every
    bitmap is sized for none kept plus its slack, and nothing overflows)."""
    import torch

    for a in args[1:]:
        if isinstance(a, torch.Tensor) and a.dtype == torch.int64 and a.numel() <= 4:
            a.zero_()


def _steps() -> dict[str, float]:
    """Host ms per whole training step of each policy (GPU path emulated, launches stubbed), and
    the tensors a step saves; inside :func:`measure`'s emulation."""
    import contextlib

    import torch
    import torchvision

    import edgetorch

    torch.set_num_threads(1)
    model = torchvision.models.mobilenet_v2(width_mult=0.25, num_classes=10).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    policies = {"plain": None, "Dense()": edgetorch.Dense(), "Bitmap()": edgetorch.Bitmap(),
                "BackRazor(0.9)": edgetorch.BackRazor(0.9), "Quantized(bits=8)": edgetorch.Quantized(bits=8),
                'BackRazor(0.9, exact="int8")': edgetorch.BackRazor(0.9, exact="int8")}
    assert tuple(policies) == POLICIES

    def step(policy) -> float:  # the benches' own step: forward in the scope, loss, backward, SGD
        scope = contextlib.nullcontext() if policy is None else edgetorch.compress_activations(model, policy, min_bytes=0)
        return timed_step(model, scope, x, y, optimizer)

    out = {}
    for name, policy in policies.items():
        for _ in range(3):  # a watched first step records the role tape; counts and caches settle
            step(policy)
        out[f"step {name}"] = sum(step(policy) for _ in range(STEPS)) / STEPS * 1e3
    scope = edgetorch.compress_activations(model, policies["Dense()"], min_bytes=0)
    with scope:
        model(x)
    out["saved tensors"] = scope.saved_count
    return out


def _round(src: Path, calls: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure-only", str(calls)],
                          env=env, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a git revision to measure beside the working tree")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--measure-only", type=int, metavar="CALLS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_only:
        print(json.dumps(measure(args.measure_only)))
        return
    sides = {"now": ROOT / "src"}
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            sides = {args.before: revision_src(args.before, tmp), **sides}
        rounds: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, src in sides.items():
                rounds[side].append(_round(src, CALLS))
    names = list(rounds["now"][0])
    result = {side: {c: median(r[c] for r in rs) for c in names} for side, rs in rounds.items()}
    calls = [c for c in names if not c.startswith("step ") and c != "saved tensors"]
    headers = ["call ([32, 4096] float32)", *(f"host us, {side}" for side in sides)]
    rows = [[c, *(f"{result[side][c]:.1f}" for side in sides)] for c in calls]
    saved = result["now"]["saved tensors"]
    # per round: (step - plain step) of the same round and process, then the median over rounds
    extra = {side: {p: median((r[f"step {p}"] - r["step plain"]) * 1e3 / saved for r in rs) for p in POLICIES[1:]}
             for side, rs in rounds.items()}
    step_headers = ["policy", *(f"step ms, {side}" for side in sides), *(f"host us per saved tensor over plain, {side}"
                                                                          for side in sides)]
    step_rows = [[p, *(f"{result[side][f'step {p}']:.2f}" for side in sides),
                  *("" if p == "plain" else f"{extra[side][p]:.1f}" for side in sides)] for p in POLICIES]
    body = f"""
The GPU code path on CPU tensors with the kernel launch stubbed out: the host's Python around each
launch. Median over {args.rounds} rounds of the mean of {CALLS} calls; sides interleaved round by round, each
round in a fresh process. The launch itself is not in these numbers (see `activations_cuda`: host us
per codec call on an H100, with the launch).

{table(headers, rows)}

Whole steps (mobilenet_v2 at width 0.25, batch 2, 32 px, {saved:.0f} saved tensors a step, all
encoded; median over rounds of the mean of {STEPS} steps after 3 warm-up steps; the extra per saved
tensor is taken per round against that round's plain step):

{table(step_headers, step_rows)}
"""
    write_results("codec_host_cost", "Host time per codec call and per step on the GPU path, launch excluded (CPU proxy)",
                  body, {"rounds": args.rounds, "calls": CALLS, "steps": STEPS,
                         "sides": {s: str(p) for s, p in sides.items()}, "host_us": result,
                         "step_extra_us_per_saved_tensor": extra})


if __name__ == "__main__":
    main()
