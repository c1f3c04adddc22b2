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

import torch
import torch.nn.functional as F
from _common import log, machine_line, table, write_results
from _workloads import minilm_batch, photo_batch, random_model, step_times

import edgetorch
from edgetorch.measure import machine_description
from edgetorch.measure.timing import interleave

MODELS = {"vit_b_16": "torchvision:vit_b_16", "deit_tiny": "timm.models:deit_tiny_patch16_224",
          "swin_t": "torchvision:swin_t"}
SETTINGS = ["sparsity=0.9", "sparsity=0.97", "sparsity=0.9,scope=all"]
ROWS = ("token", "sample")
BATCH, RESOLUTION, MINILM_SEQ = 4, 224, 128  # quantized_memory.py's
TIMING_ROUNDS = 9  # two configurations only: more rounds, so a shared machine's load evens out


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
    out = {"step_seconds": step_times(model, x, y, timed, TIMING_ROUNDS)}
    for setting in SETTINGS:
        for rows in ROWS:
            torch.manual_seed(0)  # the same dropout / stochastic depth draws for every spec
            fid = edgetorch.gradient_fidelity(model, (x, y), spec(setting, rows), loss_fn=F.cross_entropy)
            out[spec(setting, rows)] = summary(fid)
            log(f"{name} {spec(setting, rows)}: mean cosine {out[spec(setting, rows)]['mean_cosine']:.5f}")
    return out


CODEC_SHAPES = [(BATCH, 197, 768), (BATCH, 197, 3072), (8, 128, 384)]  # vit_b_16's Linear inputs; MiniLM's


def codec_times(shape: tuple[int, int, int], repeats: int = 15) -> dict:
    """Fastest ``pack_topk`` at 90% of a ``(batch, tokens, features)`` input as token rows and as
    sample rows, and the gather that per-sample rows cost in a token-major layout."""
    from edgetorch.codecs.topk import pack_topk

    b, t, d = shape
    x = torch.randn(b, t, d, generator=torch.Generator().manual_seed(0))
    jobs = {"token": lambda: pack_topk(x.view(b * t, d), 0.9), "sample": lambda: pack_topk(x.view(b, t * d), 0.9),
            "gather": lambda: x.view(t, b, d).transpose(0, 1).reshape(b, -1)}
    return {k: min(ts) for k, ts in interleave(jobs, repeats).items()}


def main() -> None:
    log(machine_line(machine_description()))
    results = {}
    x, y = photo_batch(BATCH, RESOLUTION), torch.arange(BATCH) % 10
    for name, model_spec in MODELS.items():
        torch.manual_seed(0)
        model = random_model(model_spec)
        results[name] = study(name, model, x, y, log)
        del model
    model, ids, labels = minilm_batch(MINILM_SEQ)
    results["MiniLM-L6"] = study("MiniLM-L6", model, ids, labels, log)

    codec = {"x".join(map(str, shape)): codec_times(shape) for shape in CODEC_SHAPES}
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
        "",
        "The top-k codec alone (C kernels, one thread, fastest of 15 interleaved), on a (batch, tokens, features) "
        "input at sparsity 0.9: a selection per long sample row is cheaper than one per short token row, and "
        "gathering a token-major layout's samples costs a copy:",
        "",
        table(["(batch, tokens, features)", "token rows ms", "sample rows ms", "gather ms"],
              [[k, f"{v['token'] * 1e3:.2f}", f"{v['sample'] * 1e3:.2f}", f"{v['gather'] * 1e3:.2f}"]
               for k, v in codec.items()]),
    ])
    write_results("backrazor_rows", "Back Razor rows: top-k per token or per sample", body,
                  {"batch": BATCH, "resolution": RESOLUTION, "settings": SETTINGS, "results": results,
                   "wins": wins, "codec_seconds": codec})


if __name__ == "__main__":
    main()
