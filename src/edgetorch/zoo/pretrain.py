"""Reproducible pretraining of the zoo models, cached as safetensors plus a JSON record.

Recipe: AdamW with a one-cycle learning-rate schedule, cross-entropy, no augmentation, full
batches only (the last partial batch of each epoch is dropped; the loop is
:func:`edgetorch.training.train_epochs`), evaluated on the whole test split. Besides the zoo's own
models, torchvision's ``resnet18`` and ``mobilenet_v2`` (``num_classes=10``, unchanged RGB stem)
have Fashion-MNIST recipes at 32 px, the grey image repeated over the three input channels
(:func:`edgetorch.zoo.registry.with_channels`): the models the reduction benchmark compares on.
Model init and batch order come from ``config.seed`` (the caller's global RNG state is left
untouched). Same seed, torch version and thread count give the same weights on CPU.

Cache layout, under ``cache_dir() / "zoo"``: ``{model}-{dataset}-{key}.safetensors`` and
``.json``, where ``key`` hashes the whole config and the model's parameter layout, so changing
any hyperparameter or the architecture trains a new model rather than reusing a stale one.
The JSON (config, test accuracy, train time, torch version, SHA-256 of the weights) is
written last: a checkpoint without it counts as absent.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from .._checks import check_choice, check_positive_int
from .._status import Notice
from ..data import dataset_info, load_dataset
from ..training import Loop, Watch, evaluate_accuracy, one_cycle_adamw, supervised, train_epochs, seeded
from ..training.cache import CachedModel, cached_model
from ..weights import CheckpointError
from .registry import ZOO_MODELS, build_model, input_channels, takes_image_size, with_channels

log = logging.getLogger(__name__)
_FORMAT_VERSION = 1
#: torchvision models with a pretraining recipe, named by their model spec.
TORCHVISION_TRAINED = ("torchvision:resnet18", "torchvision:mobilenet_v2")


@dataclass(frozen=True)
class PretrainConfig:
    """Everything that determines a pretrained zoo model.

    Attributes:
        model: zoo model name (``"cnn"``, ``"plaincnn"`` or ``"mlp"``), or a spec of
            :data:`TORCHVISION_TRAINED`.
        dataset: dataset name accepted by :func:`edgetorch.data.load_dataset`.
        epochs: passes over the training subset.
        lr: peak learning rate of the one-cycle schedule.
        batch_size: samples per step.
        seed: seeds model init and batch order.
        train_limit: train on the first ``train_limit`` training samples (``None``: all).
        image_size: images are resized to this (28 lets digits feed the same models).
        weight_decay: AdamW decoupled weight decay.
    """

    model: str = "cnn"
    dataset: str = "fashion-mnist"
    epochs: int = 2
    lr: float = 3e-3
    batch_size: int = 128
    seed: int = 0
    train_limit: int | None = None
    image_size: int = 28
    weight_decay: float = 1e-4

    def __post_init__(self) -> None:
        check_choice("zoo model", self.model, (*ZOO_MODELS, *TORCHVISION_TRAINED))
        # Canonical dataset name, so "Fashion_MNIST" and "fashion-mnist" share one cache entry.
        object.__setattr__(self, "dataset", dataset_info(self.dataset).name)
        for name in ("epochs", "batch_size", "image_size"):
            check_positive_int(name, getattr(self, name))
        if self.train_limit is not None and (
            isinstance(self.train_limit, bool)
            or not isinstance(self.train_limit, int)
            or self.train_limit < self.batch_size
        ):
            raise ValueError(
                f"train_limit must be None or an int >= batch_size ({self.batch_size}), "
                f"got {self.train_limit!r}"
            )
        if not (self.lr > 0 and self.weight_decay >= 0):
            raise ValueError(
                f"need lr > 0 and weight_decay >= 0, got {self.lr}, {self.weight_decay}"
            )


# Tuned so each Fashion-MNIST run takes a few minutes on 2 CPU cores; digits takes seconds.
# The torchvision models see a training subset at 32 px for one epoch (resnet18: 12,800 images,
# 84.1% test accuracy in 632 s on one thread of the 2-core machine at load average 9; two threads
# there were 5x slower, oversubscribed). Train them with OMP_NUM_THREADS=1 on a shared machine.
RECIPES: dict[tuple[str, str], PretrainConfig] = {
    ("cnn", "fashion-mnist"): PretrainConfig("cnn", "fashion-mnist", epochs=1),
    ("plaincnn", "fashion-mnist"): PretrainConfig("plaincnn", "fashion-mnist", epochs=3),
    ("mlp", "fashion-mnist"): PretrainConfig("mlp", "fashion-mnist", epochs=10),
    ("cnn", "digits"): PretrainConfig("cnn", "digits", epochs=6, batch_size=64),
    ("plaincnn", "digits"): PretrainConfig("plaincnn", "digits", epochs=10, batch_size=64),
    ("mlp", "digits"): PretrainConfig("mlp", "digits", epochs=20, batch_size=64),
    ("torchvision:resnet18", "fashion-mnist"): PretrainConfig(
        "torchvision:resnet18", "fashion-mnist", epochs=1, train_limit=12800, image_size=32),
    ("torchvision:mobilenet_v2", "fashion-mnist"): PretrainConfig(
        "torchvision:mobilenet_v2", "fashion-mnist", epochs=1, train_limit=25600, image_size=32),
    # Transfer sources for Fashion-MNIST, as ("cnn", "digits") is (bench/block_plan_transfer.py).
    ("torchvision:resnet18", "digits"): PretrainConfig("torchvision:resnet18", "digits", epochs=10, batch_size=64,
                                                       image_size=32),
    ("torchvision:mobilenet_v2", "digits"): PretrainConfig("torchvision:mobilenet_v2", "digits", epochs=10,
                                                           batch_size=64, image_size=32),
}


def default_config(model: str = "cnn", dataset: str = "fashion-mnist") -> PretrainConfig:
    """The tuned recipe for a zoo model on a dataset.

    Args:
        model: zoo model name.
        dataset: dataset name.

    Returns:
        The recipe's config.

    Raises:
        ValueError: no recipe for this pair (the message lists the available ones).
    """
    pair = (model, dataset_info(dataset).name)
    if pair not in RECIPES:
        available = ", ".join(f"{m}/{d}" for m, d in RECIPES)
        raise ValueError(f"no pretraining recipe for {model}/{dataset}; available: {available}")
    return RECIPES[pair]


def build_zoo_model(config: PretrainConfig) -> nn.Module:
    """A freshly initialised zoo model shaped for ``config``'s dataset and image size.

    Args:
        config: the pretraining config.

    Returns:
        The untrained model (init from the current global RNG).
    """
    num_classes = dataset_info(config.dataset).num_classes
    if config.model in TORCHVISION_TRAINED:
        return build_model(config.model, num_classes=num_classes)
    sized = {"image_size": config.image_size} if takes_image_size(config.model) else {}
    return ZOO_MODELS[config.model](num_classes=num_classes, **sized)


def _cache_entry(config: PretrainConfig, cache: str | Path | None) -> CachedModel:
    # The architecture's parameter names and shapes go into the key with the config, so a
    # change to a zoo model's definition never meets a cached checkpoint of the old one.
    # Built on the meta device: no memory, no init work, no draw from the caller's RNG.
    with torch.device("meta"):
        model = build_zoo_model(config)
    layout = [(k, list(v.shape)) for k, v in model.state_dict().items()]
    name = config.model.replace(":", "-")  # torchvision:resnet18: no colon in a file name
    return cached_model("zoo", f"{name}-{config.dataset}", [dataclasses.asdict(config), layout], cache)


def checkpoint_paths(config: PretrainConfig, cache: str | Path | None = None) -> tuple[Path, Path]:
    """Where ``config``'s checkpoint lives.

    Args:
        config: the pretraining config.
        cache: cache root; ``None`` means :func:`edgetorch.data.cache_dir`.

    Returns:
        ``(weights_path, metadata_path)`` (``.safetensors`` and ``.json``).
    """
    entry = _cache_entry(config, cache)
    return entry.weights, entry.record


class _TimeLeft(Watch):
    """Says, about every tenth of a pretraining run's steps, how long it has left: measured on this
    machine as it trains, since a recipe's time differs tenfold between machines (resnet18's took
    632 s on one loaded core; the digits ones take seconds)."""

    def __init__(self, label: str, epochs: int, notice: Notice) -> None:
        self.label, self.epochs, self.notice = label, epochs, notice
        self.start, self.next_tenth = time.perf_counter(), 1

    def step_done(self, epoch: int, step: int, steps: int, loss: float, images_per_second: float) -> None:
        done, total = (epoch - 1) * steps + step, self.epochs * steps  # full batches only: steps is fixed
        if done * 10 < self.next_tenth * total or done == total:
            return
        self.next_tenth = done * 10 // total + 1
        left = (time.perf_counter() - self.start) / done * (total - done)
        self.notice(f"pretraining {self.label}: step {done:,} of {total:,}, about {_minutes(left)} left")


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def pretrain(
    config: PretrainConfig, cache: str | Path | None = None, data_root: str | Path | None = None,
    *, notice: Notice | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train a zoo model per ``config``, evaluate it, and write it to the cache (overwriting).

    Args:
        config: the recipe.
        cache: cache root; ``None`` means :func:`edgetorch.data.cache_dir`.
        data_root: Fashion-MNIST location (see :func:`edgetorch.data.load_dataset`).
        notice: called with a line as training starts (what it trains on, where it is cached)
            and about every tenth of its steps (the time left, as measured so far).

    Returns:
        ``(model, metadata)``: the trained model in eval mode and the record written as JSON.

    Raises:
        ValueError: ``data_root`` given for digits, or the training subset is smaller than a batch.
        DatasetNotFoundError: Fashion-MNIST files not found.
    """
    train = load_dataset(
        config.dataset, "train", root=data_root, size=config.image_size, limit=config.train_limit
    )
    test = load_dataset(config.dataset, "test", root=data_root, size=config.image_size)
    label = f"{config.model} on {config.dataset}"
    if notice is not None:
        notice(f"pretraining {label} once ({config.epochs} epoch(s) over {len(train):,} images at "
               f"{config.image_size} px; later runs load it from {_cache_entry(config, cache).weights.parent})")
    # The seed fixes the model init; the caller's RNG is left as it was.
    with seeded(config.seed):
        model = build_zoo_model(config)
        # A grey dataset feeds an RGB model (torchvision) the same image in every channel.
        channels = input_channels(model)
        train, test = (TensorDataset(with_channels(d.tensors[0], channels), d.tensors[1]) for d in (train, test))
        start, cpu_start = time.perf_counter(), time.process_time()
        loop = Loop(config.epochs, config.batch_size, config.seed)
        optimizer, schedule = one_cycle_adamw(model, loop, len(train), config.lr, config.weight_decay)
        model.train()
        watch = Watch() if notice is None else _TimeLeft(label, config.epochs, notice)
        run = train_epochs(model, train, loop, supervised(model), optimizer, schedule, watch=watch, label=label)
        final_loss = run.losses[-1]
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    accuracy = evaluate_accuracy(model, test)
    model.eval()
    metadata = _cache_entry(config, cache).write(model, {
        "format": _FORMAT_VERSION,
        "config": dataclasses.asdict(config),
        "test_accuracy": accuracy,
        "test_samples": len(test),
        "train_samples": len(train),
        "final_train_loss": final_loss,
        "train_seconds": round(seconds, 2),
        # CPU time of all threads: less sensitive than wall time to other load on the machine.
        "train_cpu_seconds": round(cpu_seconds, 2),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
    })
    log.info("%s/%s: test accuracy %.4f after %.1f s",
             config.model, config.dataset, accuracy, seconds)  # fmt: skip
    return model, metadata


def load_pretrained(
    config: PretrainConfig, cache: str | Path | None = None
) -> tuple[nn.Module, dict[str, Any]] | None:
    """Load ``config``'s cached checkpoint, verifying it.

    Args:
        config: the pretraining config.
        cache: cache root; ``None`` means :func:`edgetorch.data.cache_dir`.

    Returns:
        ``(model, metadata)`` with the model in eval mode, or ``None`` when no complete
        checkpoint (weights and JSON) is cached.

    Raises:
        CheckpointError: the cached files are corrupted, or belong to another config or model.
    """
    entry = _cache_entry(config, cache)
    with torch.random.fork_rng(devices=[]):  # init is overwritten; keep the caller's RNG as is
        model = build_zoo_model(config)
    metadata = entry.read(model)
    if metadata is None:
        return None
    if metadata.get("config") != dataclasses.asdict(config):
        raise CheckpointError(f"{entry.record}: records config {metadata.get('config')}, expected {config}")
    return model.eval(), metadata


def pretrained(
    name: str = "cnn",
    dataset: str = "fashion-mnist",
    config: PretrainConfig | None = None,
    cache: str | Path | None = None,
    data_root: str | Path | None = None,
    retrain: bool = False,
    *,
    notice: Notice | None = None,
) -> nn.Module:
    """A pretrained zoo model, from the cache or trained now (then cached).

    Args:
        name: zoo model name (``"cnn"``, ``"plaincnn"`` or ``"mlp"``).
        dataset: ``"fashion-mnist"`` or ``"digits"``.
        config: a custom recipe for the same model and dataset; ``None`` uses
            :func:`default_config`.
        cache: cache root; ``None`` means ``$EDGETORCH_CACHE`` or ``~/.cache/edgetorch``.
        data_root: Fashion-MNIST location, used only when training.
        retrain: train even when a cached checkpoint exists (and overwrite it).
        notice: told when training starts and how long it has left (see :func:`pretrain`);
            a cached model loads without a word.

    Returns:
        The model in eval mode.

    Raises:
        ValueError: no recipe for ``name``/``dataset``, or ``config`` is for another pair.
        CheckpointError: a cached checkpoint exists but fails verification.
    """
    if config is None:
        config = default_config(name, dataset)
    elif (config.model, config.dataset) != (name, dataset_info(dataset).name):
        raise ValueError(
            f"config is for {config.model}/{config.dataset} but {name}/{dataset} was requested"
        )
    if not retrain:
        cached = load_pretrained(config, cache)
        if cached is not None:
            return cached[0]
    return pretrain(config, cache, data_root, notice=notice)[0]
