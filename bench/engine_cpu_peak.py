"""Measured process memory of one training step on CPU, dense against lossless bitmap (issue 10).

For every model of bench/bittrain_models.py at batch 16, and for squeezenet1_1 at batch 8 and
160 px, each policy runs ``edgetorch.activations.profile`` in a fresh process (a warm-up step,
then one measured step; what ``edgetorch profile`` does). Three checks per model:

- peak RSS under ``bitmap`` <= peak RSS under ``dense`` (what a user reads off ``top``);
- the forward's measured saving (dense's forward increase - bitmap's) is >= 90% of the
  ledger's saving (dense saved bytes - bitmap stored bytes): the saving is real memory;
- the step's peak increase under ``bitmap`` <= dense's (backward does not give it back).

Run: ``python bench/engine_cpu_peak.py [--resolution 224] [--models resnet18,vgg16]``
(224 px for all nine models takes about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse

from _common import mib, table, write_results

from edgetorch.activations.profile import profile_policies

MODELS = ["resnet18", "resnet50", "resnet101", "vgg16", "mobilenet_v2", "alexnet", "squeezenet1_0",
          "googlenet", "densenet121"]  # bench/bittrain_models.py's list
EXTRA = [("squeezenet1_1", 8, 160)]  # the issue's `edgetorch profile` example
BATCH = 16
FORWARD_SHARE = 0.90


def measure(name: str, batch: int, resolution: int) -> dict:
    profile = profile_policies(f"torchvision:{name}", batch, resolution, ["dense", "bitmap"], num_classes=10)
    dense, bitmap = profile.results
    ledger_saving = dense.activation_bytes - bitmap.activation_bytes
    forward_saving = dense.forward_increase_bytes - bitmap.forward_increase_bytes
    return {
        "model": name, "batch": batch, "resolution": resolution, "dense": dense.to_json(), "bitmap": bitmap.to_json(),
        "ledger_saving_bytes": ledger_saving, "forward_saving_bytes": forward_saving,
        "forward_share": forward_saving / ledger_saving if ledger_saving > 0 else None,
        "peak_ok": bitmap.peak_memory_bytes <= dense.peak_memory_bytes,
        "forward_ok": ledger_saving > 0 and forward_saving >= FORWARD_SHARE * ledger_saving,
        "step_ok": bitmap.step_peak_increase_bytes <= dense.step_peak_increase_bytes,
        "machine": profile.machine,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    runs = [(m, BATCH, args.resolution) for m in args.models.split(",") if m] + EXTRA
    rows, results = [], []
    for name, batch, resolution in runs:
        r = measure(name, batch, resolution)
        results.append(r)
        d, b = r["dense"], r["bitmap"]
        share = "n/a" if r["forward_share"] is None else f"{r['forward_share']:.0%}"
        rows.append([
            f"{name} b{batch} {resolution}px",
            f"{mib(d['activation_bytes'])} / {mib(b['activation_bytes'])}",
            f"{mib(d['forward_increase_bytes'])} / {mib(b['forward_increase_bytes'])} ({share})",
            f"{mib(d['step_peak_increase_bytes'])} / {mib(b['step_peak_increase_bytes'])}",
            f"{mib(d['peak_memory_bytes'])} / {mib(b['peak_memory_bytes'])}",
            f"{mib(d['rss_before_step_bytes'])} / {mib(b['rss_before_step_bytes'])}",
            " ".join(label if r[key] else label.upper()
                     for key, label in (("peak_ok", "peak"), ("forward_ok", "fwd"), ("step_ok", "step"))),
        ])
        print(rows[-1], flush=True)
    met = {k: all(r[k] for r in results) for k in ("peak_ok", "forward_ok", "step_ok")}
    body = (
        "One training step (SGD with momentum, random init, 10 classes) per policy, each in a fresh "
        "process with `HONEST_MALLOC_ENV` (every large tensor its own mapping, so RSS follows live "
        "memory), after a warm-up step. Every cell is `dense / bitmap`, MiB. Forward increase: "
        "resident memory the forward added and still held at its end (in brackets: the measured "
        "forward saving as a share of the ledger's). Step increase: the step's peak over the "
        "resident memory before it. Peak RSS: the whole process, interpreter, torch and edgetorch "
        "included. Before step: resident before the measured step (what the import and the warm-up "
        "left). Checks: lower case = met, UPPER CASE = missed.\n\n"
        + table(["model", "ledger saved MiB", "forward increase MiB", "step increase MiB",
                 "peak RSS MiB", "before step MiB", "checks"], rows)
        + "\n\n"
        + f"- bitmap peak RSS <= dense on every row: {'met' if met['peak_ok'] else 'NOT met'}.\n"
        + f"- forward's measured saving >= {FORWARD_SHARE:.0%} of the ledger's on every row: "
        + f"{'met' if met['forward_ok'] else 'NOT met'}.\n"
        + f"- bitmap step increase <= dense on every row: {'met' if met['step_ok'] else 'NOT met'}.\n"
    )
    write_results("engine_cpu_peak", "Measured CPU memory of a training step: dense vs lossless bitmap",
                  body, {"batch": BATCH, "results": results, "targets_met": met})


if __name__ == "__main__":
    main()
