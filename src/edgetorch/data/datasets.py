"""One entry point for edgetorch's image datasets: :func:`load_dataset`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from . import digits, fashion_mnist


@dataclass(frozen=True)
class DatasetInfo:
    """What a dataset is, without loading it.

    Attributes:
        name: canonical name accepted by :func:`load_dataset`.
        num_classes: number of labels (``0..num_classes-1``).
        image_size: native height (= width) in pixels.
        class_names: human-readable name of each label.
    """

    name: str
    num_classes: int
    image_size: int
    class_names: tuple[str, ...]


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo("digits", 10, 8, digits.CLASS_NAMES),
    "fashion-mnist": DatasetInfo(
        "fashion-mnist", 10, fashion_mnist.IMAGE_SIZE, fashion_mnist.CLASS_NAMES
    ),
}


def dataset_info(name: str) -> DatasetInfo:
    """Look a dataset up by name (case-insensitive; ``_`` and ``-`` are interchangeable).

    Args:
        name: e.g. ``"digits"`` or ``"fashion-mnist"``.

    Returns:
        The dataset's :class:`DatasetInfo`.

    Raises:
        ValueError: unknown name; the message lists the accepted ones.
    """
    key = name.strip().lower().replace("_", "-")
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; accepted: {', '.join(DATASETS)}")
    return DATASETS[key]


def load_dataset(
    name: str,
    split: str = "train",
    root: str | Path | None = None,
    download: bool = False,
    size: int | None = None,
    limit: int | None = None,
    classes: tuple[int, ...] | None = None,
) -> TensorDataset:
    """Load a dataset split as tensors.

    Args:
        name: ``"digits"`` (scikit-learn, always available, fixed stratified split documented in
            :mod:`edgetorch.data.digits`) or ``"fashion-mnist"`` (local IDX files; see
            :func:`edgetorch.data.locate_fashion_mnist` for where they are looked for).
        split: ``"train"`` or ``"test"``.
        root: Fashion-MNIST only: directory of IDX files or torchvision-style root.
        download: Fashion-MNIST only: fetch with torchvision when no local copy is found.
        size: resize images to ``size x size`` (bilinear; antialiased when shrinking), e.g.
            ``28`` so models built for Fashion-MNIST accept digits. ``None`` keeps the native size.
        limit: keep only the first ``limit`` samples of the split (in file order; of ``classes``,
            where given).
        classes: keep only these labels, relabelled ``0..len(classes)-1`` in the order given: a
            task made of some of the dataset's classes (e.g. transfer from classes 0-4 to 5-9).

    Returns:
        A ``TensorDataset`` of ``float32`` images ``[N, 1, H, W]`` in [0, 1] and ``int64``
        labels ``[N]``.

    Raises:
        ValueError: unknown name or split, a non-positive ``size`` or ``limit``, a ``limit``
            larger than the split, ``classes`` empty, repeated or outside the dataset's labels, or
            ``root``/``download`` given for digits.
        DatasetNotFoundError: Fashion-MNIST files not found.
    """
    info = dataset_info(name)
    for arg, value in (("size", size), ("limit", limit)):
        bad_type = isinstance(value, bool) or not isinstance(value, int)
        if value is not None and (bad_type or value < 1):
            raise ValueError(f"{arg} must be a positive int or None, got {value!r}")
    if classes is not None and (not classes or len(set(classes)) != len(classes)
                                or not set(classes) <= set(range(info.num_classes))):
        raise ValueError(f"classes must be distinct labels of {info.name} (0..{info.num_classes - 1}), got {classes!r}")

    if info.name == "digits":
        if root is not None or download:
            raise ValueError(
                "root= and download= apply only to fashion-mnist; digits ships inside scikit-learn"
            )
        images, labels = digits.load_digits_arrays(split)
    else:
        images, labels = fashion_mnist.load_fashion_mnist(split, root, download)
        images = images.astype(np.float32) / 255.0

    if classes is not None:
        keep = np.isin(labels, classes)
        relabel = np.zeros(info.num_classes, dtype=labels.dtype)
        relabel[list(classes)] = np.arange(len(classes))
        images, labels = images[keep], relabel[labels[keep]]
    if limit is not None:
        if limit > len(labels):
            raise ValueError(
                f"limit={limit} exceeds the {len(labels)} samples of {info.name}/{split}"
                + (f" in classes {classes}" if classes is not None else "")
            )
        images, labels = images[:limit], labels[:limit]

    x = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)).unsqueeze(1)
    if size is not None and size != x.shape[-1]:
        x = F.interpolate(
            x, size=(size, size), mode="bilinear", align_corners=False, antialias=size < x.shape[-1]
        )
        # Bilinear weights are convex, so only float rounding can leave [0, 1]; clamp that ulp.
        x = x.clamp_(0.0, 1.0)
    return TensorDataset(x, torch.from_numpy(labels))
