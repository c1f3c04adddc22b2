"""The teacher for BottleFit experiments: a torchvision classifier trained here on upsampled RGB images.

No ImageNet weights are available offline, so edgetorch trains its own teacher: a torchvision
architecture (default resnet18) on Fashion-MNIST resized to ``image_size`` and repeated to 3
channels, with cross entropy and Adam (:func:`edgetorch.split.train.train_stage`). The result is
cached under ``cache_dir() / "split"`` as ``teacher-{arch}-{dataset}-{size}px-{key}.safetensors``
plus a ``.json`` record (config, test accuracy, SHA-256), where ``key`` hashes the config
(:func:`edgetorch.training.cache.cached_model`); an interrupted training resumes from its
per-epoch checkpoint in the ``-{key}.ckpt`` directory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..data import dataset_info, load_dataset
from ..training import evaluate_accuracy, seeded
from ..training.cache import CachedModel, cached_model
from ..zoo import build_model
from .bottleneck import ACCEPTED_ARCHS
from .train import StageConfig, train_stage


def load_rgb(dataset: str, split: str, size: int, limit: int | None = None,
             device: str | torch.device = "cpu") -> TensorDataset:  # fmt: skip
    """A grayscale dataset resized to ``size`` and repeated to 3 channels (what a torchvision model takes).

    Args:
        dataset: a name accepted by :func:`edgetorch.data.load_dataset`.
        split: ``"train"`` or ``"test"``.
        size: output height and width.
        limit: keep the first ``limit`` samples.
        device: where the tensors live (a GPU run keeps its training set there: gathering a batch
            on the CPU and copying it over would bound the step time).

    Returns:
        ``TensorDataset`` of ``[N, 3, size, size]`` images in [0, 1] (an expanded view: the
        three channels share memory) and labels.
    """
    images, labels = load_dataset(dataset, split, size=size, limit=limit).tensors
    # Moved before expanding: the device copy holds one channel, not three.
    return TensorDataset(images.to(device).expand(-1, 3, -1, -1), labels.to(device))


@dataclass(frozen=True)
class TeacherConfig:
    """What determines a trained teacher.

    Attributes:
        arch: torchvision architecture, one of :data:`~edgetorch.split.bottleneck.ACCEPTED_ARCHS`.
        dataset: dataset name (its class count sets the classifier's outputs).
        image_size: input height and width.
        train_limit: train on the first ``train_limit`` training images (``None``: all).
        stage: the training stage (cross entropy, all parameters trainable).
        seed: seeds the weight initialisation.
    """

    arch: str = "resnet18"
    dataset: str = "fashion-mnist"
    image_size: int = 48
    # Sized to train in minutes on 2 shared CPU cores (see docs/split.md for the scale used).
    train_limit: int | None = 8_000
    stage: StageConfig = StageConfig(loss="ce", trainable="all", epochs=2, optimizer="adam", lr=1e-3,
                                     lr_step=1, batch_size=64)  # fmt: skip
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ACCEPTED_ARCHS:
            raise ValueError(f"unknown teacher arch {self.arch!r}; accepted: {', '.join(ACCEPTED_ARCHS)}")
        if (self.stage.loss, self.stage.trainable) != ("ce", "all"):
            raise ValueError(f"a teacher trains with loss='ce', trainable='all', got {self.stage}")
        object.__setattr__(self, "dataset", dataset_info(self.dataset).name)


def teacher_paths(config: TeacherConfig, cache: str | Path | None = None) -> tuple[Path, Path]:
    """``(weights, metadata)`` paths of ``config``'s cached teacher.

    Args:
        config: the teacher config.
        cache: cache root; ``None`` means :func:`edgetorch.data.cache_dir`.

    Returns:
        The ``.safetensors`` and ``.json`` paths.
    """
    entry = _cache_entry(config, cache)
    return entry.weights, entry.record


def _cache_entry(config: TeacherConfig, cache: str | Path | None) -> CachedModel:
    # "loop": 2 since BottleFit stages run the one training loop (another batch order than before):
    # a teacher cached by the earlier loop is not taken for one this version would train.
    return cached_model("split", f"teacher-{config.arch}-{config.dataset}-{config.image_size}px",
                        {**dataclasses.asdict(config), "stage": config.stage.identity(), "loop": 2}, cache)


def _build(config: TeacherConfig) -> nn.Module:
    with seeded(config.seed):  # the seed fixes the init; the caller's RNG is untouched
        return build_model(f"torchvision:{config.arch}", num_classes=dataset_info(config.dataset).num_classes)


def train_teacher(config: TeacherConfig = TeacherConfig(), cache: str | Path | None = None,
                  progress: bool = True, device: str | torch.device = "cpu") -> tuple[nn.Module, dict[str, Any]]:  # fmt: skip
    """The teacher for ``config``: loaded from the cache, or trained, evaluated and cached.

    Args:
        config: the teacher config.
        cache: cache root; ``None`` means :func:`edgetorch.data.cache_dir`.
        progress: show progress bars while training.
        device: where the teacher is trained and returned (the cache key does not depend on it).

    Returns:
        ``(model, metadata)``: the teacher on ``device`` in eval mode and its JSON record (with
        ``test_accuracy`` on the whole test split).

    Raises:
        CheckpointError: a cached teacher fails its SHA-256 check or does not fit the model.

    Example:
        >>> model, meta = train_teacher()  # doctest: +SKIP
        >>> meta["test_accuracy"]  # doctest: +SKIP
    """
    entry = _cache_entry(config, cache)
    model = _build(config).to(device)
    metadata = entry.read(model)
    if metadata is not None:
        return model.eval(), metadata
    train = load_rgb(config.dataset, "train", config.image_size, config.train_limit, device)
    history = train_stage(model, train, config.stage, checkpoint_dir=entry.weights.with_suffix(".ckpt"),
                          progress=progress)  # fmt: skip
    test = load_rgb(config.dataset, "test", config.image_size)
    metadata = entry.write(model, {"config": dataclasses.asdict(config), "test_accuracy": evaluate_accuracy(model, test),
                                   "test_samples": len(test), "train_samples": len(train), "loss_history": history,
                                   "torch_version": torch.__version__})  # fmt: skip
    return model.eval(), metadata
