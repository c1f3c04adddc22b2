"""The memory planner's predictions against measured training runs (issue 12: predicted peak within 10%).

For each model, batch and policy, a fresh process builds the model (torchvision, random init, 10
classes), asks :func:`edgetorch.plan_memory` for the peak of training at that batch (the planner
measures two small calibration batches in that same process), then trains 3 steps of SGD with
momentum at the full batch under the policy and reads the process's peak resident memory over
those steps. The prediction is what a user would be told before training; the measurement is what
``top`` would show during it.

Run: ``python bench/memory_plan.py [--quick]`` (about 8 minutes on 2 cores; --quick: two models).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _common import mib, table, write_results

RUNS = [("resnet18", 32, 160), ("resnet50", 16, 160), ("mobilenet_v2", 32, 160), ("vgg11", 16, 128),
        ("squeezenet1_1", 32, 160), ("densenet121", 8, 160)]
POLICIES = ["dense", "bitmap", "backrazor:sparsity=0.9", "bitmap+checkpoint"]
TARGET = 0.10


def worker(arch: str, batch: int, resolution: int, spec: str) -> dict:
    import torch
    import torch.nn.functional as F
    import torchvision

    from edgetorch import plan_memory
    from edgetorch.activations import forward_backward, parse_training_policy
    from edgetorch.measure.process import peak_rss_bytes, release_freed, reset_peak_rss

    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)(num_classes=10)
    x, y = torch.randn(batch, 3, resolution, resolution), torch.randint(0, 10, (batch,))
    start = time.perf_counter()
    plan = plan_memory(model, (x, y), "1000GiB", policies=[spec])
    plan_seconds = time.perf_counter() - start
    predicted = next(c for c in plan.candidates if c.batch == batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    how = parse_training_policy(spec)
    release_freed()
    reset_peak_rss()
    for _ in range(3):  # the standard loop: gradients are freed before the forward
        optimizer.zero_grad(set_to_none=True)
        forward_backward(model, x, y, how, F.cross_entropy)
        optimizer.step()
    measured = peak_rss_bytes()
    return {"model": arch, "batch": batch, "resolution": resolution, "policy": spec,
            "predicted_bytes": predicted.predicted_peak_bytes, "measured_bytes": measured,
            "error": (predicted.predicted_peak_bytes - measured) / measured, "held_bytes": plan.held_bytes,
            "calibration_batches": plan.calibration_batches, "plan_seconds": plan_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two models only")
    parser.add_argument("--worker", nargs=4, metavar=("ARCH", "BATCH", "RES", "POLICY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        arch, batch, res, spec = args.worker
        print(json.dumps(worker(arch, int(batch), int(res), spec)))
        return
    results, rows = [], []
    for arch, batch, res in RUNS[:2] if args.quick else RUNS:
        for spec in POLICIES:
            done = subprocess.run([sys.executable, __file__, "--worker", arch, str(batch), str(res), spec],
                                  capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(r)
            rows.append([f"{arch} b{batch} {res}px", spec, mib(r["predicted_bytes"]), mib(r["measured_bytes"]),
                         f"{r['error']:+.1%}", f"{r['plan_seconds']:.1f}"])
            print(rows[-1], flush=True)
    worst = max(abs(r["error"]) for r in results)
    body = (
        "Each row is a fresh process: `plan_memory` (two calibration batches, 1/8 and 1/4 of the "
        "batch, measured in that process) predicts the peak resident memory of training at the "
        "full batch; then 3 SGD-with-momentum steps run at that batch under the policy and the "
        "process's peak RSS over them is measured. Random init, random inputs, 10 classes.\n\n"
        + table(["model", "policy", "predicted peak MiB", "measured peak MiB", "error", "planning s"], rows)
        + f"\n\nLargest error {worst:.1%}; target |error| <= {TARGET:.0%} on every row: "
        + ("met" if worst <= TARGET else "NOT met") + ".\n"
    )
    write_results("memory_plan", "Memory planner: predicted against measured training peaks", body,
                  {"policies": POLICIES, "results": results, "largest_error": worst, "target": TARGET})


if __name__ == "__main__":
    main()
