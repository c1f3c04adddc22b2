"""Inputs and measurements several benches share: real photographs, real text for MiniLM-L6, the
saved-bytes sweep of a few steps, interleaved step timing, a model stepped under every configuration
of a step-time bench. Only helpers; running it does nothing.

These are benchmark workloads (this repository's README as text, scikit-learn's two sample
photographs), not something a user of the library needs; the models and data a user would use
live in the library (``edgetorch.zoo.minilm``, ``edgetorch.data``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from _common import timed_step
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


class StepBench:
    """One torchvision model (random init, train mode), its SGD-with-momentum optimizer and a pool of
    random batches, shared by every configuration of a step-time bench: each configuration steps a
    model that has been stepped many times before (what per-model caching in the library relies on)."""

    def __init__(self, arch: str, resolution: int, batch: int, classes: int, pool: int = 1, seed: int = 0):
        torch.manual_seed(seed)
        self.model: nn.Module = torchvision.models.get_model(arch, weights=None, num_classes=classes).train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.batches = [(torch.randn(batch, 3, resolution, resolution), torch.randint(0, classes, (batch,)))
                        for _ in range(pool)]  # fmt: skip
        self.steps = 0
        self.scope: contextlib.AbstractContextManager | None = None

    def step(self, policy: edgetorch.Policy | Callable[[], contextlib.AbstractContextManager] | None,
             ledger: edgetorch.SavedTensorLedger | None = None) -> float:
        """One forward on the next batch of the pool, then backward and SGD step; its seconds (``timed_step``).

        ``policy``: an edgetorch policy (the forward inside ``compress_activations``, with ``ledger``),
        a factory of another context (e.g. bare ``saved_tensors_hooks``), or None: plain PyTorch. The
        context is kept as ``self.scope`` (``compress_activations``' ``saved_count``).
        """
        x, y = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        self.scope = (edgetorch.compress_activations(self.model, policy, ledger=ledger)
                      if isinstance(policy, edgetorch.Policy) else contextlib.nullcontext() if policy is None
                      else policy())  # fmt: skip
        return timed_step(self.model, self.scope, x, y, self.optimizer)

    def block(self, policy, steps: int) -> float:
        """Seconds per step over ``steps`` consecutive :meth:`step` calls, timed as one block."""
        start = time.perf_counter()
        for _ in range(steps):
            self.step(policy)
        return (time.perf_counter() - start) / steps


def deit_tiny_96(num_classes: int = 1000) -> nn.Module:
    """timm's deit_tiny_patch16_224 built for 96 px images (36 patches of 16 px), at random init: the
    transfer bench's ViT as ``edgetorch finetune --model _workloads:deit_tiny_96`` (bench/ on the
    path). 224 px has 196 patches a picture; the position embeddings are sized when the model is
    built, so the size is the factory's (a model spec takes no arguments)."""
    from timm.models import deit_tiny_patch16_224

    return deit_tiny_patch16_224(num_classes=num_classes, img_size=96)
