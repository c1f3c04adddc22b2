"""One name for "the images to train on": a built-in dataset or the user's folder.

Commands that train on the user's data (``edgetorch finetune``) take ``--data digits``,
``--data fashion-mnist`` or ``--data PATH`` and get the same thing back: train and validation
datasets of ``[channels, size, size]`` float images the model takes, and the class names.

One convention for every source: a 3-channel model gets ImageNet-normalised RGB (what
torchvision's pretrained weights expect), a 1-channel model gets gray pixels in [0, 1] (what
the zoo's models are trained on). Built-in images are resized (and repeated to RGB) one sample
at a time, so 60,000 Fashion-MNIST images at 224 px never exist at once (36 GB).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from .datasets import DATASETS, dataset_info, load_dataset
from .folder import IMAGENET_MEAN, IMAGENET_STD, PREPROCESSING_VERSION, image_folder_splits, preprocessing_record


@dataclass(frozen=True)
class ImageData:
    """Train and validation images of one source.

    Attributes:
        train: training samples ``(image, label)``.
        val: validation samples (a built-in's test split; a folder's held-out share).
        classes: class names; label ``i`` is ``classes[i]``.
        normalize: ``"imagenet"`` or ``None`` (pixels in [0, 1]): what a deployed model's
            inputs must go through.
        description: one line for logs, e.g. ``"photos/: 240 train, 60 val, 3 classes"``.
        skipped: ``(path, why)`` of each unreadable image a folder left out (``skip_bad_images``).
        preprocessing: the validation images' transform as data
            (:func:`~edgetorch.data.folder.preprocessing_record` for a folder).
    """

    train: Dataset
    val: Dataset
    classes: list[str]
    normalize: str | None
    description: str
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    preprocessing: dict = field(default_factory=dict)


class _Prepared(Dataset):
    """A built-in split resized (and made RGB) per sample."""

    def __init__(self, data: TensorDataset, size: int, channels: int):
        self.images, self.labels = data.tensors
        self.size, self.channels = size, channels
        self._mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self._std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self.images[index]
        if x.shape[-1] != self.size:
            x = F.interpolate(x[None], size=(self.size, self.size), mode="bilinear", align_corners=False,
                              antialias=self.size < x.shape[-1])[0].clamp_(0.0, 1.0)
        if self.channels == 3:
            x = (x.expand(3, -1, -1) - self._mean) / self._std
        return x, int(self.labels[index])


def image_data(source: str | Path, *, size: int, channels: int, val_fraction: float = 0.2, seed: int = 0,
               limit: int | None = None, skip_bad_images: bool = False) -> ImageData:
    """Resolve ``source`` to train and validation images for a model that takes ``channels`` x ``size`` x ``size``.

    Args:
        source: ``"digits"``, ``"fashion-mnist"`` or a path (a class-per-subfolder tree or a
            ``path,label`` CSV; see :func:`edgetorch.data.image_folder`).
        size: image height = width the model takes.
        channels: 1 (gray) or 3 (RGB).
        val_fraction: a folder's share of each class held out for validation.
        seed: a folder's split seed.
        limit: a built-in only: use the first ``limit`` training images (and as many test
            images, at most), for a quick run.
        skip_bad_images: a folder: decode every image first and leave out the unreadable ones
            (see :func:`edgetorch.data.image_folder`); they are in ``skipped``.

    Returns:
        An :class:`ImageData`.

    Raises:
        ValueError: channels other than 1 or 3, a bad limit, or a source that is neither a
            built-in name nor an existing path (the message lists both).
        ImageFolderError: a folder that cannot make a dataset (the message says why), or
            unreadable images without ``skip_bad_images``.
        DatasetNotFoundError: Fashion-MNIST files are not installed.

    Example:
        >>> data = image_data("digits", size=28, channels=1)
        >>> len(data.classes)
        10
    """
    if channels not in (1, 3):
        raise ValueError(f"the model takes {channels}-channel images; image sources give 1 (gray) or 3 (RGB)")
    text = str(source)
    if text.lower().replace("_", "-") in DATASETS:
        info = dataset_info(text)
        train = load_dataset(info.name, "train", limit=limit)
        test = load_dataset(info.name, "test")
        if limit is not None:
            test = TensorDataset(*(t[:limit] for t in test.tensors))
        # A built-in's arrays (gray, [0, 1]) resized whole, as _Prepared does.
        mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((), ())
        record = {"version": PREPROCESSING_VERSION, "source": f"{info.name} arrays, gray in [0, 1]",
                  "resize": [size, size], "interpolation": "bilinear", "antialias": "when shrinking",
                  "repeat_channels": channels, "mean": list(mean), "std": list(std)}
        return ImageData(_Prepared(train, size, channels), _Prepared(test, size, channels), list(info.class_names),
                         "imagenet" if channels == 3 else None,
                         f"{info.name}: {len(train)} train, {len(test)} test images, {info.num_classes} classes",
                         preprocessing=record)
    path = Path(source)
    if not path.exists():
        raise ValueError(f"data {text!r} is neither a built-in dataset ({', '.join(DATASETS)}) nor an existing "
                         "folder or .csv file")
    if limit is not None:
        raise ValueError("limit applies to the built-in datasets; a folder is used whole")
    color, normalize = ("rgb", "imagenet") if channels == 3 else ("gray", None)
    parts = image_folder_splits(path, size, ("train", "val"), val_fraction=val_fraction, seed=seed, color=color,
                                normalize=normalize, skip_bad_images=skip_bad_images)
    train, val = parts["train"], parts["val"]
    if len(val) == 0:
        raise ValueError(f"{path}: no image is held out for validation (val_fraction={val_fraction}); "
                         "raise it or add images")
    skipped = f", {len(train.skipped)} unreadable left out" if train.skipped else ""
    return ImageData(train, val, train.classes, normalize,
                     f"{path}: {len(train)} train, {len(val)} val images, {train.num_classes} classes{skipped}",
                     train.skipped, preprocessing_record(size, color, normalize))
