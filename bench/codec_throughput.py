"""CPU codec speed: bitmap throughput against ``t.clone()``, fixed cost per call, what a fresh
process pays for its first pack, per-row top-k, and the other codecs.

The CPU kernels are the C extension ``edgetorch.codecs._native`` (``_cpu_kernels.NATIVE``);
``torch`` columns are the torch-ops fallback it replaces where it is missing (also the GPU path).

1. **First call** (fresh processes): RSS added by ``import edgetorch`` plus the first
   ``pack_bitmap`` and ``unpack`` of 1,000 fp32 elements over ``import torch`` alone, and the
   time of that first pack + unpack (and of the import).
2. **Fixed cost**: time per call of ``pack_bitmap`` and ``BitmapTensor.unpack`` on 1k and 64k
   fp32 elements (50% zeros), Python wrapper included, next to ``clone``.
3. **Throughput**: for 1M, 10M and 100M fp32 elements at 0/25/50/75/100 % zeros, median times
   of ``clone``, ``pack`` / ``unpack`` (the kernels, with their huge-page advice on outputs of
   32 MiB and more), ``pack_4k`` / ``unpack_4k`` (without it: one page fault per 4 KiB, like
   ``clone``) and ``torch_pack`` / ``torch_unpack`` (the fallback, up to 10M elements). Clone and
   the kernels are interleaved in each repeat so load on the machine hits them alike; the torch
   path runs in a round of its own after them. Two regimes, each in its own fresh process:
   ``default`` (glibc as configured: below 32 MiB a freed block is often reused with its pages
   mapped, so a small ``clone`` is a warm memcpy) and ``fresh-pages`` (``HONEST_MALLOC_ENV``, as
   edgetorch's memory workers run: every large block is a new mapping whose pages fault in on
   first write, for the codec and clone alike).
4. **Instruction sets**: the same kernels compiled for each instruction set this CPU runs
   (``generic`` is the portable C that ARM boards get), 1M and 10M elements at 50% zeros.
5. **Top-k**: ``pack_topk`` at sparsity 0.9 (whole pack: threshold per row, bitmap, values)
   against the numpy path it replaced (numpy's introselect on the magnitude bits over two threads,
   then torch ops for the mask, the values and ``pack_bits``; kept below, verbatim in behaviour),
   the torch fallback, and ``clone``.
6. **Mask and narrowing**: ``pack_mask`` (ReLU's ``> 0``) + unpack, and ``pack_narrow`` of int64
   max-pool indices + unpack, against the torch fallback, 10M elements.

Ratio = clone time / codec time (above 1 the codec is faster than copying the tensor), or
baseline time / native time where the baseline is named.

Writes docs/results/codec_throughput.{json,md} and prints the tables.

Usage: ``python bench/codec_throughput.py [--quick]`` (``--quick``: 1M and 10M only, fewer repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch
from _common import against_clone, table, write_results

from edgetorch.codecs import _cpu_kernels, pack_bitmap
from edgetorch.codecs._cpu_kernels import torch_ops
from edgetorch.codecs.bitmap import BitmapTensor, pack_bits, pack_torch, unpack_torch
from edgetorch.codecs.mask import pack_mask
from edgetorch.codecs.narrow import pack_narrow
from edgetorch.codecs.topk import kept_per_row, pack_topk
from edgetorch.measure.footprint import first_call_footprint
from edgetorch.measure.process import HONEST_MALLOC_ENV
from edgetorch.measure.timing import interleave, interleave_rounds, per_call, within

SIZES = {1_000_000: 21, 10_000_000: 11, 100_000_000: 5}  # elements -> repeats
ZERO_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
TORCH_PATH_MAX_REPEATS = 5
TORCH_PATH_MAX_ELEMENTS = 10_000_000
REGIMES = {"default": {}, "fresh-pages": HONEST_MALLOC_ENV}
RATIO_COLUMNS = ("pack", "unpack", "pack_4k", "unpack_4k", "torch_pack", "torch_unpack")
FIXED_SIZES = (1_000, 65_536)
FIRST_CALL_RUNS = 7
TOPK_SHAPES = ((16, 200_000), (8, 802_816))  # the second: resnet18's first activation at batch 8


def _sparse(n: int, zero_fraction: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g)
    t[torch.rand(n, generator=g) < zero_fraction] = 0.0
    return t


def _without_hugepages(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        saved = _cpu_kernels._native.set_hugepage_min(-1)
        try:
            return fn()
        finally:
            _cpu_kernels._native.set_hugepage_min(saved)
    return run


# --- 2. fixed cost --------------------------------------------------------------------------------


def fixed_cost(n: int) -> dict:
    """Seconds per call (median over batches of calls) of pack, unpack and clone on n elements."""
    t = _sparse(n, 0.5, seed=1)
    packed = pack_bitmap(t)
    calls = max(200, 2_000_000 // max(n, 1_000))
    variants = {"pack": lambda: pack_bitmap(t), "unpack": packed.unpack, "clone": t.clone}
    costs = interleave(variants, 15, measure=lambda fn: per_call(fn, calls))
    return {"elements": n, "calls_per_batch": calls,
            "seconds": {k: statistics.median(c.wall_s for c in v) for k, v in costs.items()},
            "min_seconds": {k: min(c.wall_s for c in v) for k, v in costs.items()},
            "thread_cpu_seconds": {k: statistics.median(c.thread_s for c in v) for k, v in costs.items()}}


# --- 3. throughput --------------------------------------------------------------------------------


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
    rounds = [({
        "clone": t.clone,
        "pack": lambda: pack_bitmap(t),
        "unpack": packed.unpack,
        "pack_4k": _without_hugepages(lambda: pack_bitmap(t)),
        "unpack_4k": _without_hugepages(packed.unpack),
    }, repeats)]
    if n <= TORCH_PATH_MAX_ELEMENTS:
        with torch_ops():
            ref_bitmap, ref_values = pack_torch(bits, 0)
        assert torch.equal(ref_bitmap, packed.bitmap)
        rounds.append(({
            "torch_pack": within(torch_ops, lambda: pack_torch(bits, 0)),
            "torch_unpack": within(torch_ops, lambda: unpack_torch(ref_bitmap, ref_values, n)),
        }, min(repeats, TORCH_PATH_MAX_REPEATS)))
    times = interleave_rounds(rounds)
    return {"elements": n, "zero_fraction": round(1 - packed.nnz / n, 4), "repeats": repeats, **against_clone(times)}


def run_throughput(sizes: dict[int, int]) -> list[dict]:
    """Measure every cell in this process (whose allocator settings define the regime)."""
    pack_bitmap(torch.ones(16)).unpack()  # load the extension before timing
    rows = []
    for n, repeats in sizes.items():
        for zf in ZERO_FRACTIONS:
            rows.append(measure(n, zf, repeats))
            r = rows[-1]["ratio_to_clone"]
            print(f"{n:>11,} zeros {zf:4.0%}: pack {r['pack']:.2f}x unpack {r['unpack']:.2f}x",
                  file=sys.stderr, flush=True)
    return rows


# --- 4. instruction sets --------------------------------------------------------------------------


def by_isa(sizes: tuple[int, ...], repeats: int) -> list[dict]:
    """pack / unpack against clone for each instruction set, 50% zeros."""
    native = _cpu_kernels._native
    best = native.isa()
    rows = []
    for n in sizes:
        t = _sparse(n, 0.5, seed=2)
        packed = pack_bitmap(t)
        variants: dict[str, Callable[[], object]] = {"clone": t.clone}
        for isa in native.isa_available():
            def with_isa(fn, isa=isa):
                def run():
                    native.set_isa(isa)
                    try:
                        return fn()
                    finally:
                        native.set_isa(best)
                return run
            variants[f"pack_{isa}"] = with_isa(lambda: pack_bitmap(t))
            variants[f"unpack_{isa}"] = with_isa(packed.unpack)
        rows.append({"elements": n, **against_clone(interleave(variants, repeats))})
    return rows


# --- 5. top-k -------------------------------------------------------------------------------------

_old_pool = ThreadPoolExecutor(max_workers=2)


def _old_kth_smallest(a: torch.Tensor, k: int) -> torch.Tensor:
    """The numpy introselect of the replaced CPU path, rows split over two threads."""
    bits = a.view(torch.int32).numpy()
    out = np.empty((bits.shape[0], 1), dtype=bits.dtype)

    def select(lo: int, hi: int) -> None:
        out[lo:hi] = np.partition(bits[lo:hi], k - 1, axis=1)[:, k - 1 : k]

    half = bits.shape[0] // 2
    other = _old_pool.submit(select, half, bits.shape[0])
    select(0, half)
    other.result()
    return torch.from_numpy(out).view(a.dtype)


def _old_pack_topk(t: torch.Tensor, sparsity: float) -> BitmapTensor:
    """The replaced CPU pack_topk (fp32): numpy threshold, torch mask, values and pack_bits."""
    x = t.reshape(t.shape[0], -1)
    n, keep = x.shape[1], kept_per_row(x.shape[1], sparsity)
    a = x.abs()
    thr = _old_kth_smallest(a, n - keep)
    mask = ~(a <= thr)
    short = (keep - mask.sum(1)) * (thr.squeeze(1) > 0)
    for r in short.nonzero().flatten().tolist():
        tied = (a[r] == thr[r]).nonzero().flatten()[: int(short[r])]
        mask[r, tied] = True
    with torch_ops():  # the old pack_bits was numpy's packbits; torch ops are at least as fast
        bitmap = pack_bits(mask)
    return BitmapTensor(bitmap, x[mask], t.shape, t.dtype)


def topk(shape: tuple[int, int], repeats: int) -> dict:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    native, old = pack_topk(t, 0.9), _old_pack_topk(t, 0.9)
    assert torch.equal(native.bitmap, old.bitmap) and torch.equal(native.values, old.values)
    times = interleave({
        "clone": t.clone,
        "native": lambda: pack_topk(t, 0.9),
        "old_numpy": lambda: _old_pack_topk(t, 0.9),
        "torch_fallback": within(torch_ops, lambda: pack_topk(t, 0.9)),
        "native_unpack": native.unpack,
    }, repeats)
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"shape": list(shape), "sparsity": 0.9, "seconds": median,
            "min_seconds": {k: min(v) for k, v in times.items()},
            "native_speedup": {k: median[k] / median["native"] for k in ("old_numpy", "torch_fallback")},
            "ratio_to_clone": {k: median["clone"] / median[k] for k in ("native", "old_numpy", "native_unpack")}}


# --- 6. mask and narrowing ------------------------------------------------------------------------


def other_codecs(n: int, repeats: int) -> list[dict]:
    x = _sparse(n, 0.5, seed=4)
    # max-pool indices of an n-element input (2x2 pooling: n / 4 int64 positions in 112x112 planes)
    _, idx = torch.nn.functional.max_pool2d(torch.randn(1, n // (112 * 112), 112, 112), 2, return_indices=True)
    rows = []
    for name, pack in (("mask (x > 0)", lambda: pack_mask(x, 0.0)), ("narrow int64 indices", lambda: pack_narrow(idx))):
        packed = pack()
        times = interleave({
            "clone": (x if name.startswith("mask") else idx).clone,
            "pack": pack, "unpack": packed.unpack,
            "torch_pack": within(torch_ops, pack), "torch_unpack": within(torch_ops, packed.unpack),
        }, repeats)
        rows.append({"codec": name, "elements": (x if name.startswith("mask") else idx).numel(),
                     **against_clone(times)})
    return rows


def run_extras(quick: bool) -> dict:
    pack_bitmap(torch.ones(16)).unpack()
    reps = 5 if quick else 11
    out = {"fixed_cost": [fixed_cost(n) for n in FIXED_SIZES]}
    print("fixed cost done", file=sys.stderr, flush=True)
    out["by_isa"] = by_isa((1_000_000, 10_000_000), reps) if _cpu_kernels.NATIVE else []
    out["topk"] = [topk(shape, reps) for shape in TOPK_SHAPES]
    print("top-k done", file=sys.stderr, flush=True)
    out["other_codecs"] = other_codecs(10_000_000, reps)
    return out


# --- report ---------------------------------------------------------------------------------------


def _ms(s: float) -> str:
    return f"{1e3 * s:.2f}"


def _us(s: float) -> str:
    return f"{1e6 * s:.2f}"


def markdown(results: dict[str, list[dict]], extras: dict, first: list[dict], load: tuple[float, float]) -> str:
    """The results as markdown (the machine line is added by ``write_results``)."""
    rss = sorted(r["rss_delta_bytes"] / 2**20 for r in first)
    call = sorted(1e3 * r["first_call_seconds"] for r in first)
    imp = sorted(1e3 * r["import_seconds"] for r in first)

    def fixed_row(row: dict) -> list[str]:
        s, m, c = row["seconds"], row["min_seconds"], row["thread_cpu_seconds"]
        return [f"{row['elements']:,}", f"{_us(s['pack'])} ({_us(m['pack'])})", f"{_us(s['unpack'])} ({_us(m['unpack'])})",
                _us(s["pack"] + s["unpack"]), _us(c["pack"]), _us(c["unpack"]), _us(s["clone"])]

    lines = [
        f"1-min load average {load[0]} at start, {load[1]} at end (shared machine). Codec kernels: "
        f"`{_cpu_kernels.build_description()}`; {torch.get_num_threads()} torch threads.",
        "",
        "## First call in a fresh process",
        "",
        f"{len(first)} fresh processes: `import torch`, a 1,000-element fp32 tensor, then `import edgetorch`, "
        "`pack_bitmap` and `unpack`. RSS is read from /proc before `import edgetorch` and after the unpack.",
        "",
        table(["", "median", "max"], [
            ["RSS added over `import torch` (MiB)", f"{statistics.median(rss):.2f}", f"{rss[-1]:.2f}"],
            ["first `pack_bitmap` + `unpack` (ms)", f"{statistics.median(call):.3f}", f"{call[-1]:.3f}"],
            ["`import edgetorch` (ms)", f"{statistics.median(imp):.1f}", f"{imp[-1]:.1f}"]]),
        "",
        "## Fixed cost per call",
        "",
        "fp32, 50% zeros; microseconds per call, wall time, median of 15 batches (min in brackets), "
        "and the calling thread's CPU time (median), which a process sharing the core does not "
        "inflate. Below 2 x 32,768 elements the kernels run on the calling thread only; `clone` "
        "may use torch's threads.",
        "",
        table(["elements", "pack_bitmap us", "unpack us", "pack + unpack us", "pack CPU us", "unpack CPU us",
               "clone us"],
              [fixed_row(row) for row in extras["fixed_cost"]]),
        "",
        "## Bitmap throughput (fp32)",
        "",
        "Ratio = `t.clone()` time / codec time, medians measured in the same process (higher is "
        "faster; 1.00 = as fast as copying the tensor). `4k`: without the kernel's huge-page "
        "advice on output buffers of 32 MiB and more. `torch`: the torch-ops fallback (and GPU "
        "path) on CPU. *default*: glibc as configured, where blocks under 32 MiB are often reused "
        "with their pages mapped (a warm memcpy for `clone`); *fresh-pages*: glibc's mmap "
        f"threshold pinned at {int(HONEST_MALLOC_ENV['MALLOC_MMAP_THRESHOLD_']) // 1024} KiB, so every "
        "large result faults its pages in, for `clone` and the codec alike. On this machine (a "
        "virtual machine) a first-touch page fault costs several times more in some runs than in "
        "others, so cells where fresh pages dominate (fresh-pages, and everything at 100M) move "
        "by up to 3x between runs; compare within a row.",
    ]
    for regime, rows in results.items():
        lines += [
            "",
            f"### {regime}",
            "",
            table(["elements", "zeros", "clone ms", "pack ms", "unpack ms", "pack", "unpack", "pack 4k", "unpack 4k",
                   "torch pack", "torch unpack"],
                  [[f"{row['elements']:,}", f"{100 * row['zero_fraction']:.0f}%",
                    *(_ms(row["seconds"][k]) for k in ("clone", "pack", "unpack")),
                    *(f"{row['ratio_to_clone'][k]:.2f}x" if k in row["ratio_to_clone"] else "–" for k in RATIO_COLUMNS)]
                   for row in rows]),
        ]
    if extras["by_isa"]:
        isas = [k.removeprefix("pack_") for k in extras["by_isa"][0]["ratio_to_clone"] if k.startswith("pack_")]
        lines += [
            "",
            "## By instruction set",
            "",
            "50% zeros, default regime: milliseconds (ratio to the clone measured alongside). "
            "`generic` is the portable C that every other CPU runs (ARM boards included; there the "
            "compiler vectorises it for NEON, not measured here).",
            "",
            table(["elements", "clone ms", *(f"{k} {i}" for i in isas for k in ("pack", "unpack"))],
                  [[f"{row['elements']:,}", _ms(row["seconds"]["clone"]),
                    *(f"{_ms(row['seconds'][k + i])} ({row['ratio_to_clone'][k + i]:.2f}x)"
                      for i in isas for k in ("pack_", "unpack_"))] for row in extras["by_isa"]]),
        ]
    lines += [
        "",
        "## Per-row top-k (fp32, sparsity 0.9)",
        "",
        "`native`: `pack_topk` with the extension (selection, bitmap and values in C); `old numpy`: "
        "the path it replaced (numpy introselect on two threads + torch ops); `torch`: the fallback "
        "(`kthvalue` on the magnitude bits). Milliseconds, medians.",
        "",
        table(["rows x row length", "clone ms", "native ms", "old numpy ms", "torch ms", "native vs old numpy",
               "native vs torch", "clone / native", "unpack ms"],
              [[f"{row['shape'][0]} x {row['shape'][1]:,}",
                *(_ms(row["seconds"][k]) for k in ("clone", "native", "old_numpy", "torch_fallback")),
                *(f"{row['native_speedup'][k]:.2f}x faster" for k in ("old_numpy", "torch_fallback")),
                f"{row['ratio_to_clone']['native']:.2f}x", _ms(row["seconds"]["native_unpack"])]
               for row in extras["topk"]]),
        "",
        "## Mask and integer narrowing",
        "",
        "Ratio to clone of the input; `torch`: the fallback.",
        "",
        table(["codec", "elements", "clone ms", "pack", "unpack", "torch pack", "torch unpack"],
              [[row["codec"], f"{row['elements']:,}", _ms(row["seconds"]["clone"]),
                *(f"{row['ratio_to_clone'][k]:.2f}x" for k in ("pack", "unpack", "torch_pack", "torch_unpack"))]
               for row in extras["other_codecs"]]),
    ]
    return "\n".join(lines) + "\n"


def _worker(kind: str, quick: bool, env: dict[str, str]) -> object:
    cmd = [sys.executable, __file__, "--worker", kind] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> None:
    """Run every section in fresh processes, write JSON and markdown under docs/results, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M and 10M elements only, fewer repeats")
    parser.add_argument("--worker", choices=("throughput", "extras"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = {n: (min(r, 7) if args.quick else r) for n, r in SIZES.items() if not (args.quick and n > 10_000_000)}
    if args.worker == "throughput":
        print(json.dumps(run_throughput(sizes)))
        return
    if args.worker == "extras":
        print(json.dumps(run_extras(args.quick)))
        return
    load_start = round(os.getloadavg()[0], 2)
    print("first call", file=sys.stderr, flush=True)
    first = [first_call_footprint() for _ in range(FIRST_CALL_RUNS)]  # 1. each in a fresh process
    print("extras", file=sys.stderr, flush=True)
    extras = _worker("extras", args.quick, {})
    results = {}
    for regime, env in REGIMES.items():
        print(f"regime {regime}", file=sys.stderr, flush=True)
        results[regime] = _worker("throughput", args.quick, env)
    load_end = round(os.getloadavg()[0], 2)
    write_results(
        "codec_throughput",
        "CPU codec speed (bitmap throughput, fixed cost, first call, top-k)",
        markdown(results, extras, first, (load_start, load_end)),
        {"quick": args.quick, "first_call": first, **extras, "results": results},
    )


if __name__ == "__main__":
    main()
