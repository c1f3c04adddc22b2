"""CPU speed of the quantized codec (``pack_quantized`` / ``QuantizedTensor.unpack``) against ``t.clone()``.

The CPU kernels are the C extension ``edgetorch.codecs._native`` (``_cpu_kernels.NATIVE``);
``torch`` columns are the torch-ops reference they replace where it is missing (also the
fallback, and the bytes both must write).

1. **Throughput**: float32 tensors of 2^16 .. 2^24 elements as rows of 1,024 (the default group of
   128), ``pack_quantized`` at 8, 4 and 2 bits (rounding to nearest; 8 bits also stochastic) and
   ``unpack`` of each, next to ``clone``. Every variant runs once per repeat, interleaved, so load
   on the shared machine hits them alike; the table holds medians. The torch reference (8 bits)
   runs in a round of its own after them, up to 2^22 elements.
2. **One thread each**: the same at 2^20 and 2^22 elements with ``torch.set_num_threads(1)``
   for clone and the kernels alike: the work per core, without the hand-off to a second thread
   (on a shared machine, torch's OpenMP clone can wait milliseconds for a busy core).
3. **Element types**: float16, bfloat16 and float64 at 2^22 elements, 8 bits, against ``clone``
   and ``copy_`` of the same tensor (float64 runs the portable C loops, compiler-vectorised;
   float32, float16 and bfloat16 have AVX2 loops, float16 converted with F16C).

Ratio = clone time / codec time (above 1 the codec is faster than copying the tensor), measured
in the same run, with torch's default threads for both. Pack returns about a quarter of clone's
bytes (8 bits: 1 byte per element + 8 bytes per group of 128); unpack writes as many as clone.
``copy_`` (into a tensor allocated once) is clone without its allocation: where clone's result
is a fresh mapping (glibc maps blocks above its mmap threshold, at most 32 MiB, anew each time,
and their pages fault in on first write) clone pays page faults that the smaller pack output
does not, so pack is also given as a ratio to ``copy_``.

Writes docs/results/quantized_codec.{json,md} and prints the tables.

Bytes moved per element (float32, groups of 128): clone reads 4 and writes 4; pack reads 4 and
writes 1.0625 (8 bits), 0.5625 (4) or 0.3125 (2); unpack reads those and writes 4. Both move at
most 5.1 bytes where clone moves 8, so where clone is bound by memory they need not be; what they
cost beyond it is arithmetic (pack: a min/max pass, then a subtract, multiply, add and truncation
per element; unpack: a convert, multiply and add).

Usage: ``python bench/quantized_codec.py [--quick]`` (``--quick``: up to 2^20 elements, fewer repeats).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch
from _common import against_clone, table, write_results

from edgetorch.codecs import _cpu_kernels, pack_quantized
from edgetorch.codecs._cpu_kernels import torch_ops
from edgetorch.measure.timing import interleave, interleave_rounds, within

SIZES = {2**16: 201, 2**18: 101, 2**20: 101, 2**22: 41, 2**24: 15}  # elements -> repeats (a noisy shared VM)
QUICK_SIZES = {2**16: 31, 2**18: 15, 2**20: 9}
ROW = 1024
BITS = (8, 4, 2)
TORCH_MAX_ELEMENTS = 2**22
TORCH_MAX_REPEATS = 5
DTYPE_ELEMENTS = 2**22
TARGET_FROM = 2**20  # the goal: pack and unpack (8, 4, 2 bits) at least as fast as clone from 1M elements
ONE_THREAD_SIZES = {2**20: 101, 2**22: 41}


def _cell(times: dict[str, list[float]], n: int, repeats: int) -> dict:
    return {"elements": n, "repeats": repeats, **against_clone(times)}


def throughput(n: int, repeats: int) -> dict:
    """Median seconds of clone, pack and unpack at every width for n float32 elements."""
    x = torch.randn(n // ROW, ROW, generator=torch.Generator().manual_seed(n))
    packed = {bits: pack_quantized(x, bits) for bits in BITS}
    into = torch.empty_like(x)
    variants: dict[str, Callable[[], object]] = {"clone": x.clone, "copy": lambda: into.copy_(x)}
    for bits in BITS:
        variants[f"pack{bits}"] = lambda bits=bits: pack_quantized(x, bits)
        variants[f"unpack{bits}"] = packed[bits].unpack
    variants["pack8_stochastic"] = lambda: pack_quantized(x, 8, seed=1)
    rounds = [(variants, repeats)]
    if n <= TORCH_MAX_ELEMENTS:
        with torch_ops():  # the reference writes the same bytes (tests pin it; checked once here)
            ref = pack_quantized(x, 8)
            assert torch.equal(ref.codes, packed[8].codes) and torch.equal(ref.unpack(), packed[8].unpack())
        rounds.append(({"torch_pack8": within(torch_ops, lambda: pack_quantized(x, 8)),
                        "torch_unpack8": within(torch_ops, ref.unpack)}, min(repeats, TORCH_MAX_REPEATS)))
    return _cell(interleave_rounds(rounds), n, repeats)


def one_thread(n: int, repeats: int) -> dict:
    """clone, pack and unpack (8/4/2 bits) with one torch thread for all of them."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(n // ROW, ROW, generator=torch.Generator().manual_seed(n))
        packed = {bits: pack_quantized(x, bits) for bits in BITS}
        variants: dict[str, Callable[[], object]] = {"clone": x.clone}
        for bits in BITS:
            variants[f"pack{bits}"] = lambda bits=bits: pack_quantized(x, bits)
            variants[f"unpack{bits}"] = packed[bits].unpack
        return _cell(interleave(variants, repeats), n, repeats)
    finally:
        torch.set_num_threads(saved)


def element_types(n: int, repeats: int) -> list[dict]:
    """8-bit pack and unpack of float16, bfloat16 and float64 tensors against their clone."""
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = torch.randn(n // ROW, ROW, generator=torch.Generator().manual_seed(1)).to(dtype)
        packed, into = pack_quantized(x, 8), torch.empty_like(x)
        times = interleave({"clone": x.clone, "copy": lambda x=x, into=into: into.copy_(x),
                            "pack8": lambda x=x: pack_quantized(x, 8), "unpack8": packed.unpack}, repeats)
        rows.append({"dtype": str(dtype).removeprefix("torch."), **_cell(times, n, repeats)})
    return rows


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}" if seconds < 1e-2 else f"{seconds * 1e3:,.1f} ms"


def _lowest(cells: list[dict], keys: list[str]) -> str:
    """The lowest ratio to clone over ``cells`` and ``keys``, where it is, and whether it reaches 1."""
    ratio, key, at = min((c["ratio_to_clone"][k], k, c["elements"]) for c in cells for k in keys)
    return f"{ratio:.2f}x ({key} at {at:,} elements: {'met' if ratio >= 1.0 else f'missed by {1 / ratio:.2f}x'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="up to 2^20 elements, fewer repeats")
    args = parser.parse_args()
    if not _cpu_kernels.NATIVE:
        sys.exit(f"the C extension is not available ({_cpu_kernels.UNAVAILABLE_REASON}): nothing to measure")
    sizes = QUICK_SIZES if args.quick else SIZES
    pack_quantized(torch.ones(4, 128)).unpack()  # load the extension before timing
    load_start = os.getloadavg()[0]
    rows = []
    for n, repeats in sizes.items():
        rows.append(throughput(n, repeats))
        r = rows[-1]["ratio_to_clone"]
        print(f"{n:>11,}: pack8 {r['pack8']:.2f}x unpack8 {r['unpack8']:.2f}x", file=sys.stderr, flush=True)
    single = [] if args.quick else [one_thread(n, r) for n, r in ONE_THREAD_SIZES.items()]
    types = [] if args.quick else element_types(DTYPE_ELEMENTS, 41)
    load_end = os.getloadavg()[0]

    headers = ["elements", "clone us"] + [f"pack {b}-bit" for b in BITS] + [f"unpack {b}-bit" for b in BITS] + [
        "pack 8-bit stochastic", "torch ops pack / unpack 8-bit", "copy_ us", "pack 8-bit vs copy_"]
    body_rows = []
    for row in rows:
        r, s = row["ratio_to_clone"], row["seconds"]
        torch_cell = (f"{r['torch_pack8']:.2f}x / {r['torch_unpack8']:.2f}x" if "torch_pack8" in r else "-")
        body_rows.append([f"{row['elements']:,}", _us(s["clone"])]
                         + [f"{r[f'pack{b}']:.2f}x ({_us(s[f'pack{b}'])})" for b in BITS]
                         + [f"{r[f'unpack{b}']:.2f}x ({_us(s[f'unpack{b}'])})" for b in BITS]
                         + [f"{r['pack8_stochastic']:.2f}x", torch_cell, _us(s["copy"]),
                            f"{s['copy'] / s['pack8']:.2f}x"])
    gate = [row for row in rows if row["elements"] >= TARGET_FROM]
    codec_keys = [f"{op}{b}" for op in ("pack", "unpack") for b in BITS]
    codec_headers = [f"{op} {b}-bit" for op in ("pack", "unpack") for b in BITS]
    body = (
        f"1-min load average {load_start:.2f} at start, {load_end:.2f} at end (shared machine). Codec kernels: "
        f"`{_cpu_kernels.build_description()}`; {torch.get_num_threads()} torch threads for clone and the kernels.\n\n"
        "## Throughput (float32, rows of 1,024, groups of 128)\n\n"
        "Ratio = `x.clone()` time / codec time, medians of interleaved repeats in this run (higher is faster; "
        "1.00x = as fast as copying the tensor); median time in brackets, microseconds. Pack includes the "
        "Python wrapper and its three allocations; `torch ops`: the reference / fallback; `copy_`: a copy into "
        "a tensor allocated once (clone without the allocation and, above glibc's mmap threshold, the page "
        "faults of a fresh mapping that clone pays on every call).\n\n"
        + table(headers, body_rows)
    )
    if gate:
        body += (f"\n\nTarget: pack and unpack (8, 4 and 2 bits) at least as fast as `clone` from {TARGET_FROM:,} "
                 f"elements. Lowest ratio from there: {_lowest(gate, codec_keys)}.")
        cores = os.cpu_count() or 1
        if max(load_start, load_end) > cores / 2:
            body += (f" Not a verdict in this run: the load average ({load_start:.1f} / {load_end:.1f} on {cores} "
                     "cores) left no core free, so torch's OpenMP clone, whose threads wait for each other, "
                     "stalled for milliseconds (see its times) while the codec's pool, whose caller does any work "
                     "no worker took, did not; the one-thread table below compares the work itself.")
    fast = [row for row in rows if row["elements"] >= TARGET_FROM // 4]
    if fast:
        frows = [[f"{row['elements']:,}", _us(row["min_seconds"]["clone"])]
                 + [f"{row['min_seconds']['clone'] / row['min_seconds'][k]:.2f}x" for k in codec_keys] for row in fast]
        body += ("\n\nThe same repeats, fastest of each variant (the quietest moments of a shared machine; "
                 "medians above are the result):\n\n"
                 + table(["elements", "clone us (fastest)"] + codec_headers, frows))
    if single:
        srows = [[f"{c['elements']:,}", _us(c["seconds"]["clone"])]
                 + [f"{c['ratio_to_clone'][k]:.2f}x ({_us(c['seconds'][k])})" for k in codec_keys] for c in single]
        body += ("\n\n## One thread each (float32, 8/4/2 bits)\n\n"
                 "`torch.set_num_threads(1)` for clone and the kernels alike: what a core does, without handing "
                 "work to a second thread (on a loaded machine the two-thread clone above can wait for a core; "
                 "these are the steadier numbers).\n\n"
                 + table(["elements", "clone us"] + codec_headers, srows)
                 + f"\n\nLowest ratio with one thread each: {_lowest(single, codec_keys)}.")
    if types:
        trows = [[t["dtype"], _us(t["seconds"]["clone"]), f"{t['ratio_to_clone']['pack8']:.2f}x",
                  f"{t['ratio_to_clone']['unpack8']:.2f}x", _us(t["seconds"]["copy"]),
                  f"{t['seconds']['copy'] / t['seconds']['pack8']:.2f}x",
                  f"{t['seconds']['copy'] / t['seconds']['unpack8']:.2f}x"] for t in types]
        body += (f"\n\n## Element types ({DTYPE_ELEMENTS:,} elements, 8 bits)\n\n"
                 "Against `clone` and `copy_` of the same tensor (float16 and bfloat16 copy half the bytes of "
                 "float32; float64 twice, 32 MiB here: a fresh mapping for every clone). float64 runs the portable "
                 "C loops; float32, float16 and bfloat16 AVX2 loops (float16 converted with F16C) where the CPU "
                 "has them.\n\n" + table(["dtype", "clone us", "pack vs clone", "unpack vs clone", "copy_ us",
                                          "pack vs copy_", "unpack vs copy_"], trows))
    write_results("quantized_codec", "CPU speed of the quantized codec (pack / unpack vs clone)", body,
                  {"load_average": [load_start, load_end], "row": ROW, "group": 128, "throughput": rows,
                   "one_thread": single, "element_types": types,
                  "codec_kernels": _cpu_kernels.build_description()})


if __name__ == "__main__":
    main()
