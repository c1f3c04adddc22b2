"""`edgetorch finetune --memory-budget` on a real image folder: does each run stay within its budget, how
close was the prediction, and what did the chosen configuration cost in accuracy against dense?

The folder: the first 60 images of each of Fashion-MNIST's 10 classes from its test split (600
real photographs of clothing, 28x28 gray, written as PNG files, one subfolder per class; digits
when Fashion-MNIST is not installed). ``edgetorch finetune`` holds out 20% of each class.

Two models, each run as a user would run the command (a fresh process per run):

* ``zoo:cnn``, pretrained on scikit-learn digits by edgetorch's zoo recipe, fine-tuned at 96 px,
  batch 64 (transfer from digits to clothing);
* ``torchvision:resnet18`` from a weight file with torchvision's 1,000-class classifier, at 224 px,
  batch 32 (at 112 px the step adds only ~210 MiB to the ~855 MiB the process holds, so budgets
  between the two are within a few percent of each other and of the predictor's error). No ImageNet
  weights can be downloaded here, so the file holds a random initialisation: the memory is
  resnet18's, the accuracy is training from scratch on 480 images.

For each model, the first run has a budget nothing could exceed; it plans, chooses dense at the
requested batch, and trains: that is the dense reference (its measured peak and accuracy). Then
three budgets between what the process holds before training and dense's measured peak
(``held + f * (dense peak - held)``, f = 0.7, 0.45, 0.25), each a run that plans, chooses and trains,
and f = 0.85 with ``--min-batch`` at the requested batch, so a memory policy, not a smaller
batch, has to make the room (its accuracy then compares with dense's at the same batch).
Each run reports the peak resident memory measured over its training epochs and over the whole
process (start to end); the bench also reads ``ru_maxrss`` of the child, which adds the
interpreter's shutdown.

Run: ``python bench/finetune_budget.py`` (about 50 minutes on 2 shared cores; resnet18 at 224 px dominates).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import mib, table, write_results

FRACTIONS = (0.7, 0.45, 0.25)
FIXED_BATCH_FRACTION = 0.85
PER_CLASS = 60
EPOCHS = 3
MODELS = [  # spec, size, batch, needs a weight file
    ("zoo:cnn", 96, 64, False),
    ("torchvision:resnet18", 224, 32, True),
]


def write_folder(root: Path) -> str:
    """PNG files of real images, one subfolder per class; returns the source's name."""
    from PIL import Image

    from edgetorch.data import DatasetNotFoundError, dataset_info, load_dataset

    try:
        name, test = "fashion-mnist", load_dataset("fashion-mnist", "test")
    except DatasetNotFoundError:
        name, test = "digits", load_dataset("digits", "test")
    classes = dataset_info(name).class_names
    images, labels = test.tensors
    for label, cls in enumerate(classes):
        folder = root / cls.replace("/", "-")
        folder.mkdir(parents=True)
        for i, index in enumerate((labels == label).nonzero().flatten()[:PER_CLASS].tolist()):
            pixels = (images[index, 0] * 255).round().byte().numpy()
            Image.fromarray(pixels, mode="L").save(folder / f"{i:03d}.png")
    return name


def run(args: list[str], json_path: Path) -> dict | str:
    """``edgetorch finetune ARGS`` in a fresh process: its JSON summary plus the process's own peak,
    or the planner's reason when it refused to train because nothing fits."""
    proc = subprocess.Popen([sys.executable, "-m", "edgetorch.cli", "finetune", *args, "--json", str(json_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    # The planner's "why" line when it chose nothing (nothing predicted to fit, or every
    # candidate it ran measured above the budget).
    refusal = " ".join(output.split("why: ")[-1].split()) if "why: " in output else None
    if code == 1 and refusal:
        return refusal
    if code != 0:
        raise RuntimeError(f"finetune {' '.join(args)} failed ({code}):\n{output[-3000:]}")
    summary = json.loads(json_path.read_text())
    summary["process_max_rss_bytes"] = usage.ru_maxrss * 1024  # Linux reports KiB
    return summary


def main() -> None:
    import torch
    import torchvision

    from edgetorch.zoo import save_weights

    results, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = write_folder(tmp / "images")
        torch.manual_seed(0)
        save_weights(torchvision.models.resnet18(), tmp / "resnet18.safetensors")
        for spec, size, batch, needs_weights in MODELS:
            base = ["--model", spec, "--data", str(tmp / "images"), "--size", str(size), "--batch-size", str(batch),
                    "--epochs", str(EPOCHS), "--optimizer", "adam", "--lr", "0.001"]
            if needs_weights:
                base += ["--weights", str(tmp / "resnet18.safetensors")]

            def finetune(budget: str, label: str, extra: tuple[str, ...] = ()) -> dict:
                out = tmp / f"{spec.replace(':', '_')}-{label.replace(' ', '').replace(',', '-')}"
                summary = run([*base, *extra, "--out", str(out), "--memory-budget", budget], tmp / f"{out.name}.json")
                if isinstance(summary, str):  # refused before training: nothing fits
                    record = {"model": spec, "size": size, "requested_batch": batch, "run": label,
                              "budget_bytes": int(budget), "refused": summary}
                    print(json.dumps(record), flush=True)
                    return record
                plan = summary["plan"]
                record = {"model": spec, "size": size, "requested_batch": batch, "run": label,
                          "budget_bytes": plan["budget_bytes"], "held_bytes": plan["held_bytes"],
                          "policy": plan["chosen"]["policy"], "batch": plan["chosen"]["batch"],
                          "predicted_peak_bytes": plan["chosen"]["predicted_peak_bytes"],
                          "measured_peak_bytes": summary["peak_bytes"],
                          "process_peak_bytes": summary["process_peak_bytes"],
                          "process_max_rss_bytes": summary["process_max_rss_bytes"],
                          "within_budget": plan["within_budget"], "prediction_error": plan["prediction_error"],
                          "val_accuracy": summary["val_accuracy"], "history": summary["history"],
                          "candidates": plan["candidates"]}
                print(json.dumps({k: v for k, v in record.items() if k not in ("history", "candidates")}), flush=True)
                return record

            dense = finetune("1000GiB", "dense")
            assert dense["policy"] == "dense" and dense["batch"] == batch, dense["policy"]
            results.append(dense)
            held, peak = dense["held_bytes"], dense["measured_peak_bytes"]
            for f in FRACTIONS:
                budget = int(held + f * (peak - held))
                results.append(finetune(str(budget), f"f={f}"))
            # The same middle budget with the batch held at the request: a memory policy must
            # make room, and its accuracy compares with dense's at the same batch.
            budget = int(held + FIXED_BATCH_FRACTION * (peak - held))
            results.append(finetune(str(budget), f"f={FIXED_BATCH_FRACTION}, batch fixed", ["--min-batch", str(batch)]))
        for r in results:
            dense = next(d for d in results if d["model"] == r["model"] and d["run"] == "dense")
            budget = "none (reference)" if r["run"] == "dense" else mib(r["budget_bytes"])
            if "fixed" in r["run"]:
                budget += " (batch fixed)"
            over = "" if r["run"] == "dense" else ("yes" if dense["measured_peak_bytes"] > r["budget_bytes"] else "no")
            if "refused" in r:
                rows.append([f"{r['model']} {r['size']}px", budget, over, "refused: " + r["refused"]] + ["-"] * 8)
                continue
            rows.append([f"{r['model']} {r['size']}px", budget, over, f"{r['policy']} @ {r['batch']}",
                         mib(r["predicted_peak_bytes"]), mib(r["measured_peak_bytes"]),
                         f"{r['prediction_error']:+.1%}", "-" if r["run"] == "dense" else
                         ("yes" if r["within_budget"] else "**NO**"), mib(r["process_peak_bytes"]),
                         mib(r["process_max_rss_bytes"]),
                         f"{r['val_accuracy']:.3f}", f"{r['val_accuracy'] - dense['val_accuracy']:+.3f}"])
    budgeted = [r for r in results if r["run"] != "dense" and "refused" not in r]
    refused = [r for r in results if "refused" in r]
    worst = max(abs(r["prediction_error"]) for r in results if "refused" not in r)
    all_within = all(r["within_budget"] for r in budgeted)
    dense_over = all(next(d for d in results if d["model"] == r["model"] and d["run"] == "dense")
                     ["measured_peak_bytes"] > r["budget_bytes"] for r in budgeted)
    body = (
        f"Folder: {PER_CLASS} images per class of {source}'s test split (10 classes, PNG), 20% of each class "
        f"held out for validation. {EPOCHS} epochs of Adam (lr 0.001, cosine), scope full. "
        "Every row is `edgetorch finetune --memory-budget B` in a fresh process; the first row of each model "
        "has a budget nothing exceeds, so it plans and trains dense at the requested batch (the reference). "
        "Budgets lie between what the process holds before training and dense's measured peak.\n\n"
        + table(["model", "budget MiB", "dense at this batch exceeds it", "chosen (policy @ batch)",
                 "predicted peak MiB", "measured peak MiB (training)", "prediction error", "within budget",
                 "process peak MiB (start to end)", "ru_maxrss MiB (incl. shutdown)", "val acc", "vs dense"], rows)
        + f"\n\nEvery budgeted run that trained stayed within its budget: {'yes' if all_within else 'NO'} "
        f"({len(budgeted)} runs; {len(refused)} refused before training: no candidate's prediction, or measured "
        f"step, fit). "
        f"Dense at the requested batch exceeds every budget: {'yes' if dense_over else 'no'}. "
        f"Largest prediction error {worst:.1%} "
        "(target 10%).\n\n\"Within budget\" holds when both the training epochs' peak and the process's peak from "
        "start to end (loading, planning, training, validation, checkpoints; tracked across every peak reset) "
        "are at most the budget. `ru_maxrss` is what the parent (or `/usr/bin/time`) sees: it also covers the "
        "interpreter's shutdown after the last line ran, which with torch 2.14 adds about 125 MiB on its own "
        "(`python -c 'import torch'` peaks at 632 MiB on exit, 508 MiB while running, on this machine).\n\nThe resnet18 accuracies are training from scratch on 480 images (no ImageNet weights "
        "offline), so they compare policies, not the model; zoo:cnn's are transfer from digits.\n"
    )
    write_results("finetune_budget", "edgetorch finetune --memory-budget: budgets kept, predictions, accuracy",
                  body, {"source": source, "fractions": FRACTIONS, "epochs": EPOCHS, "results": results,
                         "largest_prediction_error": worst, "all_within_budget": all_within,
                         "refused": len(refused)})


if __name__ == "__main__":
    main()
