"""The paper's networks (Sec. 4), trained by the project and cached; imported by the reduce benches.

5 hidden layers 2500-2000-1500-1000-500, ReLU, softmax output (cross-entropy on logits), RMSprop
(Keras' RMSprop: rho 0.9, eps 1e-7) as in the paper, but with learning rate 0.0003: the paper's
0.003 did not train stably here (digits, batch 128: mean training loss 7.55, 2.07, 1.34, 1.18,
1.87 over the first five epochs). Fashion-MNIST trains on all 60,000 training images for 5
epochs (about 80 s per epoch on one core here; an earlier recipe of 2 epochs on 10,000 images
left the network at 61.6%, too undertrained to show what reduction costs), digits (8x8, so
M_0 = 64) on its 1,438 training images for 15 epochs, batch 128. Weights are cached as
safetensors under ``edgetorch.data.cache_dir() / "reduce"`` keyed by this recipe.

Run directly to (re)train both and print their test accuracy.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from edgetorch.data import cache_dir, load_dataset
from edgetorch.zoo import MLP, evaluate_accuracy, load_weights, save_weights

HIDDEN = (2500, 2000, 1500, 1000, 500)


@dataclass(frozen=True)
class PaperRecipe:
    dataset: str
    epochs: int
    train_limit: int | None
    lr: float = 0.0003
    rho: float = 0.9
    batch_size: int = 128
    seed: int = 0


RECIPES = {
    "digits": PaperRecipe("digits", epochs=15, train_limit=None),
    "fashion-mnist": PaperRecipe("fashion-mnist", epochs=5, train_limit=None),
}


def image_size(dataset: str) -> int:
    return 28 if dataset == "fashion-mnist" else 8


def build(dataset: str) -> MLP:
    return MLP(num_classes=10, image_size=image_size(dataset), hidden=HIDDEN)


def _train(recipe: PaperRecipe) -> tuple[MLP, float]:
    torch.manual_seed(recipe.seed)
    model = build(recipe.dataset)
    data = load_dataset(recipe.dataset, "train", limit=recipe.train_limit)
    images, labels = data.tensors
    opt = torch.optim.RMSprop(model.parameters(), lr=recipe.lr, alpha=recipe.rho, eps=1e-7)
    order = torch.Generator().manual_seed(recipe.seed)
    start = time.perf_counter()
    for epoch in range(recipe.epochs):
        perm = torch.randperm(len(labels), generator=order)
        total = 0.0
        for batch in perm.split(recipe.batch_size):
            loss = F.cross_entropy(model(images[batch]), labels[batch])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(batch)
        print(f"{recipe.dataset} epoch {epoch + 1}/{recipe.epochs}: loss {total / len(labels):.4f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    return model.eval(), time.perf_counter() - start


def paper_mlp(dataset: str, retrain: bool = False) -> tuple[MLP, dict]:
    """The trained paper network for ``dataset`` and its record (accuracy, train time, recipe)."""
    recipe = RECIPES[dataset]
    key = hashlib.sha256(json.dumps([asdict(recipe), HIDDEN]).encode()).hexdigest()[:12]
    root = cache_dir() / "reduce"
    weights, meta = root / f"paper-mlp-{dataset}-{key}.safetensors", root / f"paper-mlp-{dataset}-{key}.json"
    if meta.exists() and weights.exists() and not retrain:
        model = build(dataset)
        load_weights(model, weights)
        return model.eval(), json.loads(meta.read_text())
    model, seconds = _train(recipe)
    test = load_dataset(dataset, "test")
    record = {"recipe": asdict(recipe), "hidden": HIDDEN, "train_seconds": seconds,
              "test_accuracy": evaluate_accuracy(model, test), "test_samples": len(test)}
    root.mkdir(parents=True, exist_ok=True)
    save_weights(model, weights)
    meta.write_text(json.dumps(record, indent=2))
    return model, record


if __name__ == "__main__":
    torch.set_num_threads(2)
    for name in RECIPES:
        _, info = paper_mlp(name)
        print(name, info, flush=True)
