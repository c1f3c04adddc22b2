"""BitTrain Fig. 11: checkpoint-every-m alone vs combined with bitmap storage (MobileNetV2).

MobileNetV2 (torchvision, random init) is flattened into one ``nn.Sequential`` of its 19
feature blocks, the pooling and the classifier (21 blocks), so checkpoint-every-m can cut it
anywhere. For each configuration one training step runs with a ledger, whose
``peak_live_bytes`` is the most saved-activation memory alive at any instant, forward and
backward, including the segments recomputed during backward. These are ledger numbers
("theoretical": exact tensor bytes), not process memory.

Step times come from separate steps without a ledger, interleaved across configurations
(one step of each per round, order rotated) so load on a shared machine hits all alike.
Contention only adds time, so time ratios use each configuration's fastest step.

Run: ``python bench/checkpoint_compound.py`` (a few minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from statistics import median

import torch
import torchvision
from _common import mib, pct, table, timed_step, write_results
from torch import nn

import edgetorch

BATCH = 16
EVERY = (2, 3, 4, 6)
# Given a ledger (or None when timing), a configuration yields the module to call and the
# scope its forward runs in.
Configuration = Callable[[edgetorch.SavedTensorLedger | None], tuple[nn.Module, contextlib.AbstractContextManager]]


def flat_mobilenet_v2(num_classes: int) -> nn.Sequential:
    """MobileNetV2 as a flat sequence of blocks, computing what torchvision's forward computes."""
    net = torchvision.models.mobilenet_v2(weights=None, num_classes=num_classes)
    pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return nn.Sequential(*net.features, pool, net.classifier)


def configurations(blocks: nn.Sequential) -> dict[str, Configuration]:
    """The benchmarked configurations by name, all sharing ``blocks`` (and so its weights).

    Without a ledger the plain "dense" configuration is plain PyTorch (no hooks), the
    baseline a user would otherwise run.
    """

    def plain(policy: edgetorch.Policy) -> Configuration:
        def make(ledger):
            if ledger is None and isinstance(policy, edgetorch.Dense):
                return blocks, contextlib.nullcontext()
            return blocks, edgetorch.compress_activations(blocks, policy, ledger=ledger)

        return make

    def checkpointed(every: int, policy: edgetorch.Policy) -> Configuration:
        def make(ledger):
            # CheckpointEvery applies its policy itself: no outer compress_activations.
            return edgetorch.CheckpointEvery(blocks, every=every, policy=policy, ledger=ledger), contextlib.nullcontext()

        return make

    configs = {"dense": plain(edgetorch.Dense()), "bitmap": plain(edgetorch.Bitmap())}
    for m in EVERY:
        configs[f"checkpoint every {m}, dense"] = checkpointed(m, edgetorch.Dense())
        configs[f"checkpoint every {m}, bitmap"] = checkpointed(m, edgetorch.Bitmap())
    return configs


def run_step(make: Configuration, ledger, x: torch.Tensor, y: torch.Tensor, optimizer) -> float:
    """One forward/backward/SGD step of the configuration ``make`` builds; returns seconds."""
    module, scope = make(ledger)
    torch.manual_seed(0)  # same dropout mask in every configuration
    return timed_step(module, scope, x, y, optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=224, help="input height = width")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per configuration")
    args = parser.parse_args()

    torch.manual_seed(0)
    blocks = flat_mobilenet_v2(num_classes=1000).train()
    optimizer = torch.optim.SGD(blocks.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(BATCH, 3, args.resolution, args.resolution)
    y = torch.randint(0, 1000, (BATCH,))
    configs = configurations(blocks)
    names = list(configs)

    peaks = {}
    for name in names:  # also the warm-up for the timed steps below
        ledger = edgetorch.SavedTensorLedger()
        run_step(configs[name], ledger, x, y, optimizer)
        peaks[name] = {"peak_live_bytes": ledger.peak_live_bytes,
                       "stored_bytes": ledger.total().stored_bytes}  # fmt: skip
        print(f"{name}: peak {mib(ledger.peak_live_bytes)} MiB", flush=True)

    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        shift = r * len(names) // args.rounds
        for name in names[shift:] + names[:shift]:
            times[name].append(run_step(configs[name], None, x, y, optimizer))
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    dense_peak, dense_time = peaks["dense"]["peak_live_bytes"], min(times["dense"])
    results = {name: {**peaks[name], "seconds": times[name], "median_s": median(times[name]),
                      "min_s": min(times[name])} for name in names}  # fmt: skip
    rows = []
    for name in names:
        peak, t = results[name]["peak_live_bytes"], results[name]["min_s"]
        rows.append([name, mib(peak), pct(1 - peak / dense_peak), f"{results[name]['median_s']:.3f}",
                     f"{t:.3f}", f"{t / dense_time:.2f}x"])  # fmt: skip

    compound_rows = []
    for m in EVERY:
        ckpt = results[f"checkpoint every {m}, dense"]
        both = results[f"checkpoint every {m}, bitmap"]
        compound_rows.append([
            m, mib(ckpt["peak_live_bytes"]), mib(both["peak_live_bytes"]),
            pct(1 - both["peak_live_bytes"] / ckpt["peak_live_bytes"]),
            f"{both['min_s'] / ckpt['min_s']:.2f}x",
        ])  # fmt: skip

    body = "\n\n".join([
        f"torchvision mobilenet_v2, random init, flattened to 21 blocks; {args.resolution} px, "
        f"batch {BATCH}, CPU. Peak = ledger `peak_live_bytes` of one training step: the most "
        "saved-activation bytes alive at once, forward and backward, including recomputed "
        "segments (theoretical: exact tensor bytes, not process memory; gradients and "
        "parameters excluded). Times: "
        f"{args.rounds} interleaved steps per configuration without a ledger; 'dense' time is "
        "plain PyTorch without hooks; time ratios compare fastest steps (the machine is shared "
        "and contention only adds time).",
        table(["configuration", "peak saved activations MiB", "saving vs dense", "median step s",
               "min step s", "time vs dense (min)"], rows),  # fmt: skip
        "## Compound saving: bitmap + checkpointing vs checkpointing alone",
        table(["m", "checkpoint, dense MiB", "checkpoint + bitmap MiB", "extra saving from bitmap",
               "time, bitmap vs dense inside (min)"], compound_rows),  # fmt: skip
        "MobileNetV2's block outputs are linear bottlenecks (no ReLU after the last batch "
        "norm), so the segment inputs kept by checkpointing have no natural zeros and stay "
        "dense; the bitmap saving comes from the ReLU6 outputs inside the segment being "
        "recomputed.",
    ])
    write_results(
        "checkpoint_compound",
        f"BitTrain Fig. 11: checkpoint-every-m combined with bitmap (MobileNetV2, {args.resolution} px)",
        body,
        {"model": "mobilenet_v2", "blocks": len(blocks), "resolution": args.resolution, "batch": BATCH,
         "every": list(EVERY), "rounds": args.rounds, "results": results},  # fmt: skip
    )


if __name__ == "__main__":
    main()
