"""The layer-reduction paper's networks (Sec. 4), trained by edgetorch and cached.

Five hidden layers 2500-2000-1500-1000-500, ReLU, softmax output (cross entropy on logits),
trained with RMSprop (Keras' RMSprop: rho 0.9, eps 1e-7) as in the paper, but with learning rate
0.0003: the paper's 0.003 did not train stably here (digits, batch 128: mean training loss 7.55,
2.07, 1.34, 1.18, 1.87 over the first five epochs). Fashion-MNIST trains on all 60,000 training
images for 5 epochs (an earlier recipe of 2 epochs on 10,000 images left the network at 61.6%, too
undertrained to show what reduction costs), digits (8x8, so M_0 = 64) on its 1,438 training
images for 15 epochs, batch 128; the last partial batch of an epoch is trained on, as Keras does.
Weights are cached (:func:`edgetorch.training.cache.cached_model`) under ``"reduce"`` keyed by the
recipe and the hidden widths.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data import dataset_info, load_dataset
from ..training import LastBatch, Loop, evaluate_accuracy, supervised, train_epochs, seeded
from ..training.cache import cached_model
from .models import MLP

#: The hidden widths of the paper's network.
PAPER_HIDDEN = (2500, 2000, 1500, 1000, 500)


@dataclass(frozen=True)
class PaperRecipe:
    """How a paper network is trained.

    Attributes:
        dataset: ``"digits"`` (8x8 images) or ``"fashion-mnist"`` (28x28).
        epochs: passes over the training split.
        lr: RMSprop's learning rate.
        rho: RMSprop's smoothing constant (Keras' name; torch's ``alpha``).
        batch_size: samples per step.
        seed: the initialisation and the batch order.
    """

    dataset: str
    epochs: int
    lr: float = 0.0003
    rho: float = 0.9
    batch_size: int = 128
    seed: int = 0


#: The recipes the reduce benchmarks use, by dataset.
PAPER_RECIPES = {
    "digits": PaperRecipe("digits", epochs=15),
    "fashion-mnist": PaperRecipe("fashion-mnist", epochs=5),
}


def paper_image_size(dataset: str) -> int:
    """The input height and width of ``dataset``'s paper network (28 for Fashion-MNIST, 8 for digits)."""
    return 28 if dataset_info(dataset).name == "fashion-mnist" else 8


def build_paper_mlp(dataset: str) -> MLP:
    """The untrained paper network for ``dataset`` (initialised from the global RNG)."""
    return MLP(num_classes=dataset_info(dataset).num_classes, image_size=paper_image_size(dataset),
               hidden=PAPER_HIDDEN)  # fmt: skip


def paper_mlp(dataset: str, cache: str | Path | None = None) -> tuple[MLP, dict[str, Any]]:
    """The trained paper network for ``dataset`` and its record (recipe, train time, test accuracy).

    Args:
        dataset: a key of :data:`PAPER_RECIPES`.
        cache: cache root; ``None`` means :func:`edgetorch.data.cache_dir`.

    Returns:
        ``(model, record)``: the model in eval mode, from the cache or trained now (then cached).

    Raises:
        KeyError: no recipe for ``dataset``.
        CheckpointError: a cached model fails its SHA-256 check.

    Example:
        >>> model, record = paper_mlp("digits")  # doctest: +SKIP
        >>> record["test_accuracy"]  # doctest: +SKIP
    """
    recipe = PAPER_RECIPES[dataset]
    entry = cached_model("reduce", f"paper-mlp-{dataset}", [dataclasses.asdict(recipe), PAPER_HIDDEN], cache)
    with seeded(recipe.seed):  # the recipe's seed fixes the init; the caller's RNG stays
        model = build_paper_mlp(dataset)
        record = entry.read(model)
        if record is not None:
            return model.eval(), record
        train = load_dataset(dataset, "train")
        loop = Loop(recipe.epochs, recipe.batch_size, recipe.seed, last_batch=LastBatch.KEEP)
        optimizer = torch.optim.RMSprop(model.parameters(), lr=recipe.lr, alpha=recipe.rho, eps=1e-7)
        start = time.perf_counter()
        train_epochs(model.train(), train, loop, supervised(model), optimizer, label=f"paper MLP/{dataset}")
        seconds = time.perf_counter() - start
    test = load_dataset(dataset, "test")
    record = {"recipe": dataclasses.asdict(recipe), "hidden": PAPER_HIDDEN, "train_seconds": seconds,
              "test_accuracy": evaluate_accuracy(model, test), "test_samples": len(test)}
    return model.eval(), entry.write(model, record)
