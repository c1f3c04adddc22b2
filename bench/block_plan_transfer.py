"""Does the memory plan cost accuracy? A short transfer fine-tune at a middle budget, three seeds,
beside full fine-tuning (FT-Full) and the best whole-model policy at the same budget (issue 26).

The task: edgetorch's zoo CNN, pretrained on scikit-learn digits by the zoo's recipe (four residual
blocks), fine-tuned on Fashion-MNIST (``--data fashion-mnist --train-limit N``: the first N training
images, validated on the first N test images) at 96 px, batch 64, ``EPOCHS`` epochs of SGD with
momentum, cosine schedule; each run is ``edgetorch finetune`` in a fresh process, as a user runs it.

1. FT-Full: ``--memory-budget 1000GiB`` at seed 0 (the planner chooses dense at the requested
   batch; its plan gives every candidate's predicted peak at batch 64), ``--policy dense`` at the
   other seeds (the same training).
2. The middle budget: half way from the smallest whole-model candidate's predicted peak at batch 64
   to dense's, with the planner's 5% headroom (as ``bench/block_plan.py`` sets its budgets).
3. Per seed at that budget: ``--memory-budget`` alone (the default: per-block plans allowed), and
   ``--memory-budget`` with every default policy given as ``--policy`` (whole-model candidates only).

With ``--fixed-batch`` the budget lies half way from the smallest candidate's predicted peak to
the smallest exact candidate's (dense+checkpoint, say), and both plans train at batch 64
(``--min-batch 64``): only lossy whole-model policies fit there, so the accuracy of a lossy plan
(per-block or whole-model) is what is measured, not the lossless bitmap's.

Run: ``python bench/block_plan_transfer.py [--fixed-batch]`` (about 30 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _common import mib, table, write_results
from finetune_budget import run

SEEDS = (0, 1, 2)
EPOCHS = 2
TRAIN_LIMIT = 1000
SIZE, BATCH = 96, 64
MARGIN = 0.05  # plan_memory's default headroom
FRACTION = 0.5


def finetune(args: list[str], json_path: Path) -> dict:
    """``edgetorch finetune`` on this bench's task, in a fresh process; its summary."""
    summary = run(["--model", "zoo:cnn", "--data", "fashion-mnist", "--train-limit", str(TRAIN_LIMIT), "--size",
                   str(SIZE), "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--out",
                   str(json_path.with_suffix("")), *args], json_path)
    if isinstance(summary, str):
        raise RuntimeError(f"finetune {' '.join(args)} trained nothing: {summary}")
    return summary


def _summary(run: dict) -> dict:
    plan = run.get("plan") or {}
    chosen = plan.get("chosen") or {}
    return {"val_accuracy": run["val_accuracy"], "policy": chosen.get("policy", run["config"].get("policy")),
            "batch": chosen.get("batch", run["config"].get("batch_size")), "reason": plan.get("reason"),
            "process_peak_bytes": run["process_peak_bytes"], "budget_bytes": plan.get("budget_bytes"),
            "within_budget": plan.get("within_budget")}


def main() -> None:
    from edgetorch.activations.budget import DEFAULT_POLICIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixed-batch", action="store_true",
                        help="budget below the smallest exact candidate, every plan at batch 64 (lossy plans)")
    fixed = parser.parse_args().fixed_batch
    runs: dict[str, list[dict]] = {"ft_full": [], "plan": [], "whole_model": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        first = finetune(["--seed", "0", "--memory-budget", "1000GiB"], tmp / "full0.json")
        at_batch = [c for c in first["plan"]["candidates"] if c["batch"] == BATCH]
        # the top of the range: dense's peak, or with --fixed-batch the smallest exact candidate's
        top_name = "the smallest exact candidate's" if fixed else "dense's"
        dense = (min(c["predicted_peak_bytes"] for c in at_batch if c["exact"]) if fixed else
                 next(c for c in at_batch if c["policy"] == "dense")["predicted_peak_bytes"])
        smallest = min(c["predicted_peak_bytes"] for c in at_batch)
        budget = int((smallest + FRACTION * (dense - smallest)) * (1 + MARGIN))
        print(f"budget {mib(budget)} MiB (smallest {mib(smallest)}, top {mib(dense)})", file=sys.stderr, flush=True)
        runs["ft_full"].append(_summary(first))
        whole = [a for spec in DEFAULT_POLICIES for a in ("--policy", spec)]
        at = ["--memory-budget", str(budget), *(["--min-batch", str(BATCH)] if fixed else [])]
        for seed in SEEDS:
            s = ["--seed", str(seed)]
            if seed:
                runs["ft_full"].append(_summary(finetune([*s, "--policy", "dense"], tmp / f"full{seed}.json")))
            runs["plan"].append(_summary(finetune([*s, *at], tmp / f"plan{seed}.json")))
            runs["whole_model"].append(_summary(finetune([*s, *at, *whole], tmp / f"whole{seed}.json")))
            print(f"seed {seed}: " + ", ".join(f"{k} {v[-1]['val_accuracy']:.4f}" for k, v in runs.items()),
                  file=sys.stderr, flush=True)
    names = {"ft_full": "FT-Full (dense, batch 64)", "plan": "finetune --memory-budget (per-block allowed)",
             "whole_model": "best whole-model policy at the budget"}
    rows = []
    for key, results in runs.items():
        accuracy = [r["val_accuracy"] for r in results]
        gap = [100 * (a - f["val_accuracy"]) for a, f in zip(accuracy, runs["ft_full"])]
        rows.append([names[key], "; ".join(sorted({f"{r['policy']} b{r['batch']}" for r in results})),
                     " / ".join(f"{100 * a:.2f}" for a in accuracy), f"{100 * statistics.mean(accuracy):.2f}",
                     "-" if key == "ft_full" else f"{statistics.mean(gap):+.2f}",
                     "-" if key == "ft_full" else ("yes" if all(r["within_budget"] for r in results) else "NO"),
                     "-" if key == "ft_full" else mib(max(r["process_peak_bytes"] for r in results))])
    body = (f"zoo:cnn (pretrained on digits) fine-tuned on the first {TRAIN_LIMIT} Fashion-MNIST training images, "
            f"validated on the first {TRAIN_LIMIT} test images, {SIZE} px, {EPOCHS} epochs, seeds {list(SEEDS)}; "
            f"budget {mib(budget)} MiB: half way from the smallest whole-model candidate's predicted peak at batch "
            f"{BATCH} ({mib(smallest)} MiB) to {top_name} ({mib(dense)} MiB), with 5% headroom"
            f"{f', every plan at batch {BATCH} (--min-batch {BATCH})' if fixed else ''}. Accuracy gap: mean over "
            "seeds of the run's validation accuracy minus FT-Full's at the same seed, in points.\n\n")
    body += table(["run", "chosen", "val accuracy % per seed", "mean %", "gap to FT-Full (points)", "within budget",
                   "largest process peak MiB"], rows, right=[3, 4, 6])
    write_results("block_plan_transfer_fixed_batch" if fixed else "block_plan_transfer",
                  "A short transfer fine-tune under a memory plan (issue 26)", body,
                  {"budget_bytes": budget, "smallest_bytes": smallest, "top_bytes": dense, "fixed_batch": fixed,
                   "runs": runs})


if __name__ == "__main__":
    main()
