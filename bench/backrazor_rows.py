"""Back Razor's rows on token models: top-k per token against per sample (the paper's code), by gradient fidelity.

A Linear layer on ``(batch, tokens, features)`` saves a ``[batch x tokens, features]`` matrix.
``BackRazor(rows="token")`` keeps the top-k of each row, so every token keeps the same share;
``rows="sample"`` keeps the top-k of all of a sample's rows together, as the published code does,
so tokens with large activations keep more. Both store the same number of values. This script
measures which keeps the weight gradients closer to plain PyTorch's, one step on the same batch
(``edgetorch.gradient_fidelity``): vit_b_16, deit_tiny and swin_t on real photo crops, MiniLM-L6
on real text. The transfer accuracies of both are in ``backrazor_transfer`` (ViT section).

Usage: python bench/backrazor_rows.py
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from _common import machine, machine_line, table, write_results
from quantized_memory import BATCH, RESOLUTION, TIMING_ROUNDS, minilm_batch, photo_batch, random_model, step_times

import edgetorch

MODELS = {"vit_b_16": "torchvision:vit_b_16", "deit_tiny": "timm.models:deit_tiny_patch16_224",
          "swin_t": "torchvision:swin_t"}
SETTINGS = ["sparsity=0.9", "sparsity=0.97", "sparsity=0.9,scope=all"]
ROWS = ("token", "sample")


def spec(setting: str, rows: str) -> str:
    return f"backrazor:{setting},rows={rows}"


def summary(fid: edgetorch.GradientFidelity) -> dict:
    """Over the parameters whose gradient the policy changed: mean and worst cosine, and the
    relative L2 error of all parameter gradients together."""
    counted = [p for p in fid.parameters if not p.negligible]
    changed = [p for p in counted if p.cosine < 1.0]
    error = math.sqrt(sum((p.relative_error * p.reference_norm) ** 2 for p in counted))
    norm = math.sqrt(sum(p.reference_norm**2 for p in counted))
    return {"changed_parameters": len(changed),
            "mean_cosine": sum(p.cosine for p in changed) / len(changed) if changed else 1.0,
            "worst_cosine": fid.worst_cosine, "worst_parameter": fid.worst_parameter,
            "relative_error": error / norm,
            "input_cosine": fid.input.cosine if fid.input is not None else None}


def study(name: str, model, x, y, log) -> dict:
    timed = [spec(SETTINGS[0], r) for r in ROWS]
    out = {"step_seconds": step_times(model, x, y, timed)}
    for setting in SETTINGS:
        for rows in ROWS:
            torch.manual_seed(0)  # the same dropout / stochastic depth draws for every spec
            fid = edgetorch.gradient_fidelity(model, (x, y), spec(setting, rows), loss_fn=F.cross_entropy)
            out[spec(setting, rows)] = summary(fid)
            log(f"{name} {spec(setting, rows)}: mean cosine {out[spec(setting, rows)]['mean_cosine']:.5f}")
    return out


def main() -> None:
    info = machine()

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    log(machine_line(info))
    results = {}
    x, y = photo_batch(BATCH), torch.arange(BATCH) % 10
    for name, model_spec in MODELS.items():
        torch.manual_seed(0)
        model = random_model(model_spec)
        results[name] = study(name, model, x, y, log)
        del model
    model, ids, labels = minilm_batch()
    results["MiniLM-L6"] = study("MiniLM-L6", model, ids, labels, log)

    rows, wins = [], {r: 0 for r in ROWS}
    for name, by_spec in results.items():
        seconds = by_spec["step_seconds"]
        time_ratio = seconds[spec(SETTINGS[0], "sample")] / seconds[spec(SETTINGS[0], "token")]
        for setting in SETTINGS:
            token, sample = (by_spec[spec(setting, r)] for r in ROWS)
            better = "sample" if sample["relative_error"] < token["relative_error"] else "token"
            wins[better] += 1
            rows.append([name, setting.replace("sparsity=", "").replace(",", ", "),
                         f"{token['mean_cosine']:.4f} / {token['worst_cosine']:.4f}",
                         f"{sample['mean_cosine']:.4f} / {sample['worst_cosine']:.4f}",
                         f"{token['relative_error']:.4f}", f"{sample['relative_error']:.4f}", better,
                         f"{time_ratio:.2f}" if setting == SETTINGS[0] else ""])
    body = "\n".join([
        f"One training step per policy against plain PyTorch on the same batch: vision models on {BATCH} crops "
        f"of real photographs at {RESOLUTION} px (random init, 10-way head), MiniLM-L6 with its real weights on "
        f"{ids.shape[0]} real paragraphs. Cosines over the parameters the policy changed (mean / worst); relative "
        "error = ||g - g_ref|| / ||g_ref|| over all parameter gradients together. Both rows settings store the "
        "same number of values. Step time: forward + backward at sparsity 0.9, the two interleaved, fastest of "
        f"{TIMING_ROUNDS}, one run (per sample gathers the rows of torch's token-major MultiheadAttention first).",
        "",
        table(["model", "sparsity", "per token: cosine mean / worst", "per sample: cosine mean / worst",
               "per token: rel. error", "per sample: rel. error", "closer", "step time sample / token"], rows),
        "",
        f"Closer to plain PyTorch: per sample in {wins['sample']} of {len(rows)} cases, per token in {wins['token']}.",
    ])
    write_results("backrazor_rows", "Back Razor rows: top-k per token or per sample", body,
                  {"batch": BATCH, "resolution": RESOLUTION, "settings": SETTINGS, "results": results,
                   "wins": wins})


if __name__ == "__main__":
    main()
