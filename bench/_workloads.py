"""Inputs and measurements several benches share: real photographs, real text for MiniLM-L6, the
saved-bytes sweep of a few steps, interleaved step timing. Only helpers; running it does nothing.

These are benchmark workloads (this repository's README as text, scikit-learn's two sample
photographs), not something a user of the library needs; the models and data a user would use
live in the library (``edgetorch.zoo.minilm``, ``edgetorch.data``).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import edgetorch
from edgetorch.activations.step import forward_backward, parse_training_policy
from edgetorch.measure import Totals
from edgetorch.measure.timing import interleave, wall_time
from edgetorch.zoo.minilm import MiniLMClassifier, minilm_path

README_PARAGRAPHS = 8


def photo_batch(n: int, resolution: int) -> torch.Tensor:
    """``n`` crops of scikit-learn's two sample photographs (427x640), ImageNet-normalised."""
    from sklearn.datasets import load_sample_images

    photos = [torch.from_numpy(np.array(p)).permute(2, 0, 1).float() / 255 for p in load_sample_images().images]
    crops = []
    for i in range(n):
        photo = photos[i % len(photos)]
        h, w = photo.shape[1:]
        k = i // len(photos)  # crops spread along the diagonal
        top = (h - resolution) * k // max(1, (n - 1) // len(photos))
        left = (w - resolution) * k // max(1, (n - 1) // len(photos))
        crops.append(photo[:, top : top + resolution, left : left + resolution])
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    return (torch.stack(crops) - mean) / std


def minilm_inputs(tokenizer, seq: int) -> dict:
    """Real English text: the first long paragraphs of this repository's README (at the commit measured).

    Only files inside the repository are read, so the bench runs from any checkout (the README has
    far more than README_PARAGRAPHS paragraphs of over 40 words; an earlier version also appended a
    file from outside the repository that the first paragraphs never reached).
    """
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.split()) > 40][:README_PARAGRAPHS]
    return tokenizer(paragraphs, padding="max_length", truncation=True, max_length=seq, return_tensors="pt")


def minilm_batch(seq: int) -> tuple[MiniLMClassifier, torch.Tensor, torch.Tensor]:
    """MiniLM-L6 with a seed-0 2-way head, in train mode, and the README paragraphs at ``seq`` tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    ids = minilm_inputs(tokenizer, seq)["input_ids"]
    torch.manual_seed(0)
    model = MiniLMClassifier(tokenizer.pad_token_id).train()
    return model, ids, torch.arange(ids.shape[0]) % 2


def ledger_totals(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], policy: edgetorch.Policy
) -> dict:
    """Saved-tensor bytes of one train-mode forward (plus the loss) per batch, averaged.

    The ledger is complete once the forward ends; the backward that follows is there to free
    the graph: a graph dropped without backward keeps the tensors the engine holds as they
    are alive (a reference cycle through the saved-tensor hooks), so memory would grow.
    """
    total = Totals()
    for x, y in batches:
        ledger = edgetorch.SavedTensorLedger()
        torch.manual_seed(0)  # same dropout masks under every policy
        with edgetorch.compress_activations(model, policy, ledger=ledger):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        total += ledger.total()
    n = len(batches)
    return {
        "dense_bytes": total.dense_bytes / n,
        "stored_bytes": total.stored_bytes / n,
        "sparsity": total.sparsity,
    }


def step_times(model: nn.Module, x: torch.Tensor, y: torch.Tensor, specs: list[str], rounds: int) -> dict[str, float]:
    """Fastest of ``rounds`` forward+backward steps per spec, interleaved (order rotated each round)
    so load on a shared machine hits every configuration alike."""
    def step(spec: str) -> float:
        model.zero_grad(set_to_none=True)  # outside the timed span
        return wall_time(lambda: forward_backward(model, x, y, parse_training_policy(spec), F.cross_entropy))

    forward_backward(model, x, y, parse_training_policy(specs[0]), F.cross_entropy)  # warm-up
    times = interleave({s: partial(step, s) for s in specs}, rounds, rotate=True, measure=lambda fn: fn())
    model.zero_grad(set_to_none=True)
    return {s: min(t) for s, t in times.items()}


def random_model(spec: str, num_classes: int = 10) -> nn.Module:
    """``spec`` at random init in train mode, with zero-initialised heads drawn at random (a
    zero head blocks every gradient a fidelity comparison reads)."""
    return edgetorch.zoo.redraw_zero_weights(edgetorch.build_model(spec, num_classes=num_classes).train())
