"""Codec throughput on a GPU, as ratios to ``t.clone()`` of the same fp32 tensor (issue 10 targets).

For 10M and 100M fp32 elements at 50% zeros: ``pack_bitmap`` (two launches and the sync that
sizes its values) and ``BitmapTensor.unpack``, ``pack_bitmap_capped`` (one sync-free launch, capacity
= the kept count plus 5%, as the engine sizes it from the previous step) and its unpack,
``pack_topk`` at sparsity 0.9 over 32 rows (sync-free radix select) and its unpack, ``pack_mask``
(the ReLU bitmap) and its unpack, and the torch-ops reference path for comparison. Times are
medians of REPEATS, each timed with CUDA events, codec and clone interleaved. Ratio = clone time /
codec time (1.0 = as fast as copying). Launches per call are GPU kernels counted by
``torch.profiler`` over one call (memcpy/memset included, as they occupy the stream too).

Targets (issue 23): pack >= 0.6x, unpack >= 0.8x, per-row top-k pack >= 0.5x of clone; at most 2
launches to pack and 1 to unpack.

Requires a CUDA device; writes ``docs/results/codec_cuda.{json,md}``. ``--smoke`` runs 64k
elements on whatever device there is and writes nothing.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _common import table, write_results

from edgetorch import pack_bitmap
from edgetorch.codecs.bitmap import pack_bitmap_capped, pack_torch, unpack_torch
from edgetorch.codecs.mask import pack_mask
from edgetorch.codecs.topk import pack_topk
from edgetorch.measure.counters import kernel_profile
from edgetorch.measure.timing import event_time, interleave

SIZES = (10_000_000, 100_000_000)
REPEATS = 11
ROWS = 32
TARGETS = {"pack": 0.6, "unpack": 0.8, "topk_pack": 0.5}
COLUMNS = ("pack", "unpack", "capped_pack", "capped_unpack", "topk_pack", "topk_unpack", "mask_pack", "mask_unpack",
           "torch_pack", "torch_unpack")


def _launches(fn, device: torch.device) -> int | None:
    """GPU kernels (and memcpy/memset) that one warm call of ``fn`` puts on the stream (None off CUDA)."""
    fn()
    return kernel_profile(fn, device).on_stream


def measure(n: int, device: torch.device, repeats: int) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    t = torch.randn(n, device=device, generator=g)
    t[torch.rand(n, device=device, generator=g) < 0.5] = 0.0
    packed = pack_bitmap(t)
    capacity = packed.nnz + packed.nnz // 20  # previous step's count + 5%
    capped = pack_bitmap_capped(t, capacity)
    rows = t.view(ROWS, -1)
    top = pack_topk(rows, 0.9)
    mask = pack_mask(t, 0.0)
    bits = t.view(torch.int32)
    ref = pack_torch(bits, 0)
    variants = {
        "pack": lambda: pack_bitmap(t),
        "unpack": packed.unpack,
        "capped_pack": lambda: pack_bitmap_capped(t, capacity),
        "capped_unpack": capped.unpack,
        "topk_pack": lambda: pack_topk(rows, 0.9),
        "topk_unpack": top.unpack,
        "mask_pack": lambda: pack_mask(t, 0.0),
        "mask_unpack": mask.unpack,
        "torch_pack": lambda: pack_torch(bits, 0),
        "torch_unpack": lambda: unpack_torch(ref[0], ref[1], n),
    }
    # clone is timed right before every variant: each ratio compares neighbours
    pairs = [pair for name, fn in variants.items() for pair in (("clone", t.clone), (name, fn))]
    times = interleave(pairs, repeats, measure=lambda fn: event_time(fn, device))
    clone = statistics.median(times["clone"])
    return {"elements": n, "clone_seconds": clone,
            **{f"{k}_seconds": statistics.median(v) for k, v in times.items() if k != "clone"},
            **{f"{k}_ratio": clone / statistics.median(times[k]) for k in variants},
            **{f"{k}_launches": _launches(fn, device) for k, fn in variants.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="64k elements on any device; writes nothing")
    args = parser.parse_args()
    if args.smoke:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(measure(ROWS * 2048, device, repeats=1))
        return
    if not torch.cuda.is_available():
        raise SystemExit("codec_cuda needs a CUDA device (use --smoke to check the script elsewhere)")
    results = [measure(n, torch.device("cuda"), REPEATS) for n in SIZES]
    rows = [[f"{r['elements']:,}", f"{1e3 * r['clone_seconds']:.2f}", *(f"{r[k + '_ratio']:.2f}x" for k in COLUMNS)]
            for r in results]
    launches = [[k, *(str(r[k + "_launches"]) for r in results)] for k in COLUMNS]
    verdicts = [f"- {k} >= {v}x of clone at every size: "
                f"{'met' if all(r[k + '_ratio'] >= v for r in results) else 'NOT met'}" for k, v in TARGETS.items()]
    body = (f"Device: {torch.cuda.get_device_name()}. fp32, 50% zeros; top-k over {ROWS} rows at sparsity "
            "0.9; capped pack with capacity = kept + 5%. Ratio = clone time / codec time, medians of "
            f"{REPEATS} CUDA-event timings.\n\n"
            + table(["elements", "clone ms", "pack", "unpack", "capped pack", "capped unpack", "top-k pack",
                     "top-k unpack", "mask pack", "mask unpack", "torch-ops pack", "torch-ops unpack"], rows)
            + "\n\nGPU kernels per call (torch.profiler, one call):\n\n"
            + table(["call", *(f"{r['elements']:,}" for r in results)], launches)
            + "\n\n" + "\n".join(verdicts))
    write_results("codec_cuda", "Codec throughput on a GPU (Triton kernels)", body, {"results": results})


if __name__ == "__main__":
    main()
