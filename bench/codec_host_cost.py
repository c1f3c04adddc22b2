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
calls. ``--before REV`` measures a second tree (a git worktree of REV) in the same run, rounds
interleaved, each side in its own process.

Run: ``python bench/codec_host_cost.py --before REV`` (under a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import median, table, write_results

ROOT = Path(__file__).resolve().parent.parent
ROUNDS, CALLS = 7, 500


def measure(calls: int) -> dict[str, float]:
    """One round in this process: mean host us per call of each codec entry point."""
    os.environ["TRITON_INTERPRET"] = "1"  # the kernels module imports on a machine without a GPU
    import time

    import torch

    from edgetorch.codecs import _cuda, _triton
    from edgetorch.codecs.bitmap import pack_bitmap_capped
    from edgetorch.codecs.mask import pack_mask
    from edgetorch.codecs.quantized import pack_quantized
    from edgetorch.codecs.topk import pack_topk

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
            for _ in range(20):
                fn()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name] = (time.perf_counter() - start) / calls * 1e6
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
            tree = Path(tmp) / "before"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.before], cwd=ROOT, check=True,
                           capture_output=True)
            sides = {args.before: tree / "src", **sides}
        try:
            rounds: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
            for _ in range(args.rounds):
                for side, src in sides.items():
                    rounds[side].append(_round(src, CALLS))
        finally:
            if args.before:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    calls = list(rounds["now"][0])
    result = {side: {c: median(r[c] for r in rs) for c in calls} for side, rs in rounds.items()}
    headers = ["call ([32, 4096] float32)", *(f"host us, {side}" for side in sides)]
    rows = [[c, *(f"{result[side][c]:.1f}" for side in sides)] for c in calls]
    body = f"""
The GPU code path on CPU tensors with the kernel launch stubbed out: the host's Python around each
launch. Median over {args.rounds} rounds of the mean of {CALLS} calls; sides interleaved round by round, each
round in a fresh process. The launch itself is not in these numbers (see `activations_cuda`: host us
per codec call on an H100, with the launch).

{table(headers, rows)}
"""
    write_results("codec_host_cost", "Host time per codec call on the GPU path, launch excluded (CPU proxy)", body,
                  {"rounds": args.rounds, "calls": CALLS, "sides": {s: str(p) for s, p in sides.items()},
                   "host_us": result})


if __name__ == "__main__":
    main()
