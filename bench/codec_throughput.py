"""Bitmap codec throughput on CPU, as ratios to ``t.clone()`` of the same fp32 tensor.

For 1M, 10M and 100M fp32 elements at 0/25/50/75/100 % zeros, times (median of several
repeats; clone and the codec interleaved in each repeat, so that load on the machine hits them
alike, and the torch path in a round of its own after them):

- ``clone``: ``t.clone()``, the reference (a fresh buffer plus a copy at memory speed);
- ``pack`` / ``unpack``: the native numba kernel (``pack_bitmap`` / ``BitmapTensor.unpack``);
- ``pack_4k`` / ``unpack_4k``: the same kernel without its transparent-huge-page advice on
  large output buffers, i.e. paying one page fault per 4 KiB like ``clone`` does;
- ``torch_pack`` / ``torch_unpack``: the device-generic torch-ops path on CPU (up to 10M
  elements: it is several times slower than clone, which at 100M would double the runtime).

Ratio = clone time / codec time: above 1 the codec is faster than copying the tensor.

Every variant allocates its result, so the allocator's state is part of what is timed. Each of
two regimes runs in its own fresh process: ``default`` (glibc as configured: below 32 MiB a
freed block is often reused with its pages already mapped, so a small ``clone`` is a warm
memcpy) and ``fresh-pages`` (``HONEST_MALLOC_ENV``, as edgetorch's memory workers run: every
large block is a new mapping whose pages fault in on first write, for the codec and clone alike).

Writes docs/results/codec_throughput.{json,md} and prints the table.

Usage: ``python bench/codec_throughput.py [--quick]`` (``--quick``: 1M and 10M only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
from _common import write_results

from edgetorch.codecs import _cpu_kernels, pack_bitmap
from edgetorch.codecs.bitmap import pack_torch, unpack_torch
from edgetorch.measure.process import HONEST_MALLOC_ENV

SIZES = {1_000_000: 21, 10_000_000: 11, 100_000_000: 5}  # elements -> repeats
ZERO_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
TORCH_PATH_MAX_REPEATS = 5
TORCH_PATH_MAX_ELEMENTS = 10_000_000
REGIMES = {"default": {}, "fresh-pages": HONEST_MALLOC_ENV}
RATIO_COLUMNS = ("pack", "unpack", "pack_4k", "unpack_4k", "torch_pack", "torch_unpack")


def _sparse(n: int, zero_fraction: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g)
    t[torch.rand(n, generator=g) < zero_fraction] = 0.0
    return t


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _without_hugepages(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        saved = _cpu_kernels._native.set_hugepage_min(-1)
        try:
            return fn()
        finally:
            _cpu_kernels._native.set_hugepage_min(saved)
    return run


def measure(n: int, zero_fraction: float, repeats: int, seed: int = 0) -> dict:
    """Median seconds of every variant for one tensor size and zero fraction.

    Args:
        n: number of fp32 elements.
        zero_fraction: probability of each element being zero.
        repeats: repeats per variant (the torch path: at most ``TORCH_PATH_MAX_REPEATS``, and
            only up to ``TORCH_PATH_MAX_ELEMENTS``).
        seed: seed of the tensor's content.

    Returns:
        The cell: size, measured zero fraction, median and minimum seconds per variant, and
        ratios of the medians to clone's.
    """
    t = _sparse(n, zero_fraction, seed)
    bits = t.view(torch.int32)
    packed = pack_bitmap(t)
    assert torch.equal(packed.unpack(), t)
    # The torch path runs in its own round afterwards: its temporaries grow the heap, which would
    # otherwise change where the other variants' buffers come from.
    rounds = [
        (repeats, {
            "clone": t.clone,
            "pack": lambda: pack_bitmap(t),
            "unpack": packed.unpack,
            "pack_4k": _without_hugepages(lambda: pack_bitmap(t)),
            "unpack_4k": _without_hugepages(packed.unpack),
        }),
    ]
    if n <= TORCH_PATH_MAX_ELEMENTS:
        ref_bitmap, ref_values = pack_torch(bits, 0)
        rounds.append((min(repeats, TORCH_PATH_MAX_REPEATS), {
            "torch_pack": lambda: pack_torch(bits, 0),
            "torch_unpack": lambda: unpack_torch(ref_bitmap, ref_values, n),
        }))
    times: dict[str, list[float]] = {}
    for count, variants in rounds:
        for _ in range(count):
            for name, fn in variants.items():
                times.setdefault(name, []).append(_time(fn))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "elements": n,
        "zero_fraction": round(1 - packed.nnz / n, 4),
        "repeats": repeats,
        "seconds": median,
        "min_seconds": {name: min(ts) for name, ts in times.items()},
        "ratio_to_clone": {k: median["clone"] / s for k, s in median.items() if k != "clone"},
    }


def markdown(results: dict[str, list[dict]], load_start: float, load_end: float) -> str:
    """The results as markdown tables, one per allocator regime (the machine line is added by
    ``write_results``)."""
    lines = [
        f"1-min load average {load_start} at start, {load_end} at end (shared machine).",
        "",
        "Ratio = `t.clone()` time / codec time, medians measured in the same process (higher is "
        "faster; 1.00 = as fast as copying the tensor). `4k`: without the kernel's huge-page "
        "advice on output buffers of 32 MiB and more. `torch`: the torch-ops path (GPU path) "
        "on CPU. "
        "*default*: glibc as configured, where blocks under 32 MiB are often reused with their "
        "pages mapped (a warm memcpy for `clone`); *fresh-pages*: glibc's mmap threshold pinned "
        f"at {int(HONEST_MALLOC_ENV['MALLOC_MMAP_THRESHOLD_']) // 1024} KiB, so every large result "
        "faults its pages in, for `clone` and the codec alike.",
    ]
    for regime, rows in results.items():
        lines += [
            "",
            f"## {regime}",
            "",
            "| elements | zeros | clone ms | pack ms | unpack ms | pack | unpack | pack 4k "
            "| unpack 4k | torch pack | torch unpack |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            t, r = row["seconds"], row["ratio_to_clone"]
            ms = [f"{1e3 * t[k]:.2f}" for k in ("clone", "pack", "unpack")]
            ratios = [f"{r[k]:.2f}x" if k in r else "–" for k in RATIO_COLUMNS]
            cells = [f"{row['elements']:,}", f"{100 * row['zero_fraction']:.0f}%", *ms, *ratios]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_regime(sizes: dict[int, int]) -> list[dict]:
    """Measure every cell in this process (whose allocator settings define the regime).

    Args:
        sizes: elements -> repeats.

    Returns:
        One row per size and zero fraction, as :func:`measure` returns it.
    """
    pack_bitmap(torch.ones(16))  # load the compiled kernels before timing
    rows = []
    for n, repeats in sizes.items():
        for zf in ZERO_FRACTIONS:
            rows.append(measure(n, zf, repeats))
            r = rows[-1]["ratio_to_clone"]
            print(f"{n:>11,} zeros {zf:4.0%}: pack {r['pack']:.2f}x unpack {r['unpack']:.2f}x",
                  file=sys.stderr, flush=True)
    return rows


def main() -> None:
    """Run both regimes in fresh processes, write JSON and markdown under docs/results, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M and 10M elements only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = {n: r for n, r in SIZES.items() if not (args.quick and n > 10_000_000)}
    if args.worker:
        print(json.dumps(run_regime(sizes)))
        return
    load_start = round(os.getloadavg()[0], 2)
    results = {}
    for regime, env in REGIMES.items():
        print(f"regime {regime}", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--worker"] + (["--quick"] if args.quick else [])
        env = {**os.environ, **env}
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
        results[regime] = json.loads(proc.stdout.splitlines()[-1])
    load_end = round(os.getloadavg()[0], 2)
    write_results(
        "codec_throughput",
        "Bitmap codec throughput (CPU, fp32)",
        markdown(results, load_start, load_end),
        {"results": results},
    )

if __name__ == "__main__":
    main()
