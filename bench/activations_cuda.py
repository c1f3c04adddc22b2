"""BitTrain and Back Razor on a GPU: CUDA allocator peak and step time of one training step.

What it measures, per torchvision model (random init, train mode, 224 px, batch 32, SGD step) and
policy (``dense``, lossless ``bitmap``, ``bitmap:threshold=0.05``, ``backrazor:sparsity=0.9``):

* the CUDA caching allocator's peak during one step (``torch.cuda.max_memory_allocated``) minus
  what was allocated before it (model, optimizer state, the batch): the memory the step itself
  needs, measured, not modelled;
* the forward's increase (allocated at the end of the forward minus before it), which is what the
  saved activations occupy, next to the ledger's stored bytes of the same step;
* the median step time over STEPS timed steps after WARMUP, with ``torch.cuda.synchronize``
  around each; policies interleave step by step so clock and thermal drift hit all alike.

Bitmap packing on CUDA uses torch ops (there is no custom kernel), so its step time is the price of
that path today. Requires a CUDA device; prints and writes ``docs/results/activations_cuda.{json,md}``.

Run: ``python bench/activations_cuda.py`` on a machine with a GPU (about 2 minutes on an H100).
"""

from __future__ import annotations

import statistics
import time

import torch
import torchvision
from _common import mib, table, write_results
from torch.nn import functional as F

import edgetorch

MODELS = ("resnet18", "resnet50", "vgg11_bn", "mobilenet_v2")
POLICIES = ("dense", "bitmap", "bitmap:threshold=0.05", "backrazor:sparsity=0.9")
BATCH, SIZE, WARMUP, STEPS = 32, 224, 3, 10


def step(model, opt, x, y, policy, ledger=None) -> tuple[int, int, float]:
    """One training step: (peak over the start, forward increase, seconds)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with edgetorch.compress_activations(model, edgetorch.parse_policy(policy), ledger=ledger):
        loss = F.cross_entropy(model(x), y)
    torch.cuda.synchronize()
    forward = torch.cuda.memory_allocated() - before
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # gradients stay allocated: every step starts from the same state
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, forward, time.perf_counter() - start


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("activations_cuda needs a CUDA device")
    torch.backends.cudnn.benchmark = True
    rows = []
    for name in MODELS:
        torch.manual_seed(0)
        model = torchvision.models.get_model(name, weights=None, num_classes=1000).cuda().train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        x = torch.randn(BATCH, 3, SIZE, SIZE, device="cuda")
        y = torch.randint(0, 1000, (BATCH,), device="cuda")
        for _ in range(WARMUP):  # cuDNN autotuning, optimizer state, allocator pools
            for policy in POLICIES:
                step(model, opt, x, y, policy)
        peaks: dict[str, int] = {}
        forwards: dict[str, int] = {}
        totals = {}
        for policy in POLICIES:  # memory and ledger from one step; the ledger's bookkeeping is not timed
            ledger = edgetorch.SavedTensorLedger()
            peaks[policy], forwards[policy], _ = step(model, opt, x, y, policy, ledger)
            totals[policy] = ledger.total()  # the ledger itself is dropped before the next step
        times: dict[str, list[float]] = {p: [] for p in POLICIES}
        for _ in range(STEPS):
            for policy in POLICIES:
                times[policy].append(step(model, opt, x, y, policy)[2])
        dense_time = statistics.median(times["dense"])
        for policy in POLICIES:
            total = totals[policy]
            rows.append({"model": name, "policy": policy, "step_peak_bytes": peaks[policy],
                         "forward_increase_bytes": forwards[policy], "ledger_dense_bytes": total.dense_bytes,
                         "ledger_stored_bytes": total.stored_bytes, "median_step_seconds": statistics.median(times[policy]),
                         "step_time_ratio": statistics.median(times[policy]) / dense_time,
                         "step_peak_ratio": peaks[policy] / peaks["dense"],
                         "forward_ratio": forwards[policy] / forwards["dense"]})
            r = rows[-1]
            print(f"{name:13s} {policy:24s} peak {mib(r['step_peak_bytes'])} MiB ({r['step_peak_ratio']:.3f}x), "
                  f"forward {mib(r['forward_increase_bytes'])} MiB, ledger {mib(r['ledger_stored_bytes'])} MiB, "
                  f"step {1e3 * r['median_step_seconds']:.1f} ms ({r['step_time_ratio']:.2f}x)", flush=True)
        del model, opt
        torch.cuda.empty_cache()
    body = f"""
Device: {torch.cuda.get_device_name()}. Per model: batch {BATCH}, {SIZE} px, random init, train mode,
SGD; {WARMUP} warm-up steps per policy, then {STEPS} timed steps per policy, interleaved.

- **step peak**: the CUDA allocator's peak during one step minus what was allocated before it
  (model, gradients, momentum, the batch), measured;
- **forward**: allocated at the end of the forward minus before it: the saved activations as held;
- **ledger stored**: the bytes the ledger counts for the same step's saved tensors (the codec's
  exact sizes), for comparison with the measured forward;
- times are medians; ratios are to dense in the same run.

A measured forward more than 5% below the ledger means memory allocated before the step was freed
during it (the measurement, not the policy, is then off); such rows: {", ".join(
    f"{r['model']} {r['policy']}" for r in rows if r["forward_increase_bytes"] < 0.95 * r["ledger_stored_bytes"]) or "none"}.

{table(["model", "policy", "step peak MiB", "peak vs dense", "forward MiB", "forward vs dense",
        "ledger stored MiB", "step ms", "time vs dense"],
       [[r["model"], r["policy"], mib(r["step_peak_bytes"]), f"{r['step_peak_ratio']:.3f}",
         mib(r["forward_increase_bytes"]), f"{r['forward_ratio']:.3f}", mib(r["ledger_stored_bytes"]),
         f"{1e3 * r['median_step_seconds']:.1f}", f"{r['step_time_ratio']:.2f}"] for r in rows])}
"""
    write_results("activations_cuda", "BitTrain and Back Razor on a GPU: allocator peak and step time", body,
                  {"batch": BATCH, "size": SIZE, "warmup": WARMUP, "steps": STEPS, "rows": rows})


if __name__ == "__main__":
    main()
