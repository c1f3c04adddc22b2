"""BitTrain and Back Razor on a GPU: CUDA allocator peak, step time and host syncs of one step.

What it measures, per torchvision model (random init, train mode, 224 px, batch 32, SGD step) and
configuration:

* ``plain``: plain PyTorch, no edgetorch at all (every ratio divides by it);
* ``dense``: the engine with the ``Dense()`` policy, which packs nothing: the engine's own cost;
* ``bitmap`` (lossless BitTrain) and ``backrazor:sparsity=0.9``;
* ``checkpoint``: the peer a GPU user picks, ``torch.utils.checkpoint`` around every block
  (non-reentrant, no edgetorch);
* ``bf16 ...``: the same under ``torch.autocast("cuda", dtype=torch.bfloat16)``, against plain
  bf16 autocast.

For each: the CUDA caching allocator's peak during one step minus what was allocated before it,
the forward's increase next to the ledger's stored bytes, the median step time over STEPS timed
steps (configurations interleaved step by step, so drift hits all alike), and the host syncs one
step makes (``torch.cuda.set_sync_debug_mode("warn")`` warns once per sync; they are counted).

Requires a CUDA device; writes ``docs/results/activations_cuda.{json,md}``. ``--smoke`` runs one
tiny model for one step on whatever device there is and writes nothing (a check that the script
works, for machines without a GPU).

Run: ``python bench/activations_cuda.py`` on a machine with a GPU (a few minutes on an H100).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
import warnings

import torch
import torchvision
from _common import mib, table, write_results
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import edgetorch

MODELS = ("resnet18", "resnet50", "vgg11_bn", "mobilenet_v2")
POLICIES = ("dense", "bitmap", "backrazor:sparsity=0.9")
BATCH, SIZE, WARMUP, STEPS = 32, 224, 3, 10
TARGETS = {"dense": 1.05, "bitmap": 1.15, "backrazor:sparsity=0.9": 1.30}  # step time vs plain


class _Checkpointed(nn.Module):
    """One block run under non-reentrant ``torch.utils.checkpoint`` (the peer configuration)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False) if torch.is_grad_enabled() else self.block(x)


def per_block_checkpoint(model: nn.Module) -> nn.Module:
    """Wrap every block of a torchvision CNN (ResNet stages' blocks, ``features`` children)."""
    stages = [getattr(model, f"layer{i}") for i in range(1, 5) if hasattr(model, f"layer{i}")]
    if hasattr(model, "features"):
        stages.append(model.features)
    for stage in stages:
        for i, block in enumerate(stage):
            stage[i] = _Checkpointed(block)
    return model


def configurations() -> dict[str, tuple[edgetorch.Policy | None, bool, bool]]:
    """name -> (policy or None for no edgetorch, bf16 autocast, per-block checkpoint)."""
    policies = {p: edgetorch.parse_policy(p) for p in POLICIES}  # parsed once, outside every timing
    configs = {"plain": (None, False, False)}
    configs.update({p: (policy, False, False) for p, policy in policies.items()})
    configs["checkpoint (per block)"] = (None, False, True)
    configs["bf16 plain"] = (None, True, False)
    configs.update({f"bf16 {p}": (policy, True, False) for p, policy in policies.items() if p != "dense"})
    return configs


def step(model, ckpt_model, opt, x, y, config, ledger=None, count_syncs=False) -> dict:
    """One training step: peak over the start, forward increase, seconds, host syncs."""
    policy, bf16, ckpt = config
    device = x.device
    net = ckpt_model if ckpt else model
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    counting = count_syncs and cuda
    caught: list = []
    # Syncs are counted in an untimed step only: the warning machinery is no part of a step.
    recorder = warnings.catch_warnings(record=True) if counting else contextlib.nullcontext(caught)
    with recorder as caught:
        if counting:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        start = time.perf_counter()
        scope = (edgetorch.compress_activations(net, policy, ledger=ledger)
                 if policy is not None else contextlib.nullcontext())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), scope:
            loss = F.cross_entropy(net(x).float(), y)
        forward_end = torch.cuda.memory_allocated() if cuda else 0
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: every step starts alike
        if counting:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before if cuda else 0
    return {"peak": peak, "forward": forward_end - before, "seconds": seconds, "syncs": syncs}


def run_model(name: str, device: torch.device, batch: int, size: int, warmup: int, steps: int) -> list[dict]:
    configs = configurations()
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, num_classes=1000).to(device).train()
    ckpt_model = per_block_checkpoint(copy.deepcopy(model))  # same weights, blocks wrapped
    params = list(model.parameters()) + list(ckpt_model.parameters())
    opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    for _ in range(warmup):  # cuDNN autotuning, optimizer state, allocator pools, Triton compiles
        for config in configs.values():
            step(model, ckpt_model, opt, x, y, config)
    measured = {}
    for label, config in configs.items():  # memory, ledger and syncs from one untimed step
        ledger = edgetorch.SavedTensorLedger() if config[0] is not None else None
        measured[label] = step(model, ckpt_model, opt, x, y, config, ledger, count_syncs=True)
        measured[label]["ledger_stored_bytes"] = ledger.total().stored_bytes if ledger else None
    times: dict[str, list[float]] = {label: [] for label in configs}
    for _ in range(steps):
        for label, config in configs.items():
            times[label].append(step(model, ckpt_model, opt, x, y, config)["seconds"])
    rows = []
    for label, config in configs.items():
        base = "bf16 plain" if config[1] else "plain"
        m = measured[label]
        rows.append({
            "model": name, "config": label, "baseline": base,
            "step_peak_bytes": m["peak"], "forward_increase_bytes": m["forward"],
            "ledger_stored_bytes": m["ledger_stored_bytes"], "host_syncs_per_step": m["syncs"],
            "median_step_seconds": statistics.median(times[label]),
            "step_time_ratio": statistics.median(times[label]) / statistics.median(times[base]),
            "step_peak_ratio": m["peak"] / measured[base]["peak"] if measured[base]["peak"] else None,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny run on any device; writes nothing")
    args = parser.parse_args()
    if args.smoke:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        for row in run_model("resnet18", device, batch=2, size=32, warmup=1, steps=1):
            print(row)
        return
    if not torch.cuda.is_available():
        raise SystemExit("activations_cuda needs a CUDA device (use --smoke to check the script elsewhere)")
    torch.backends.cudnn.benchmark = True
    rows = []
    for name in MODELS:
        rows += run_model(name, torch.device("cuda"), BATCH, SIZE, WARMUP, STEPS)
        for r in rows[-len(configurations()):]:
            print(r, flush=True)
        torch.cuda.empty_cache()
    verdicts = []
    for r in rows:
        target = TARGETS.get(r["config"].removeprefix("bf16 "))
        if target is not None:
            ok = r["step_time_ratio"] <= target
            verdicts.append(f"- {r['model']} {r['config']}: step {r['step_time_ratio']:.2f}x of "
                            f"{r['baseline']} (target <= {target:.2f}x): {'met' if ok else 'NOT met'}")
    body = f"""
Device: {torch.cuda.get_device_name()}. Per model: batch {BATCH}, {SIZE} px, random init, train mode,
SGD; {WARMUP} warm-up steps per configuration, then {STEPS} timed steps each, interleaved.
Step peak: the CUDA allocator's peak during one step minus what was allocated before it. Forward:
allocated at the end of the forward minus before it, next to the ledger's stored bytes. Host syncs:
counted with `torch.cuda.set_sync_debug_mode("warn")` over one whole step. Ratios are to `plain`
(or `bf16 plain` for the bf16 rows) in the same run.

{table(["model", "config", "step peak MiB", "peak vs baseline", "forward MiB", "ledger stored MiB",
        "step ms", "time vs baseline", "host syncs"],
       [[r["model"], r["config"], mib(r["step_peak_bytes"]),
         "n/a" if r["step_peak_ratio"] is None else f"{r['step_peak_ratio']:.3f}",
         mib(r["forward_increase_bytes"]),
         "" if r["ledger_stored_bytes"] is None else mib(r["ledger_stored_bytes"]),
         f"{1e3 * r['median_step_seconds']:.1f}", f"{r['step_time_ratio']:.2f}", r["host_syncs_per_step"]]
        for r in rows])}

{chr(10).join(verdicts)}
"""
    write_results("activations_cuda", "BitTrain and Back Razor on a GPU: allocator peak, step time, host syncs",
                  body, {"batch": BATCH, "size": SIZE, "warmup": WARMUP, "steps": STEPS, "rows": rows})


if __name__ == "__main__":
    main()
