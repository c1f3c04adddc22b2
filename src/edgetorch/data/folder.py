"""The user's own images: a class-per-subfolder tree or a CSV of ``path,label`` rows.

The tree follows torchvision's ``ImageFolder`` conventions (one subfolder per class, classes
sorted by name, files filtered by image extension), and uses its ``find_classes`` and
``make_dataset`` to list them. What is added here is what a fine-tuning run needs before it
starts: every image's header is read once, so an unreadable file, an empty folder or a single
class is an error that names the files, not an exception in the middle of epoch 3; mixed colour
modes are reported with counts (they are all converted to the requested ``color``); and the
train/validation split is deterministic and stratified, so the same folder and seed always give
the same validation set.

Example:
    >>> train = image_folder("photos", size=224, split="train")  # doctest: +SKIP
    >>> val = image_folder("photos", size=224, split="val")  # doctest: +SKIP
    >>> image, label = train[0]; train.classes  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .._files import InputFileError

SPLITS = ("train", "val", "all")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# Eval transform: resize the short side to size * 256/224, then centre-crop (the torchvision
# reference recipe), so a model sees the same framing at every size.
_RESIZE_RATIO = 256 / 224


class ImageFolderError(InputFileError):
    """An image folder or CSV that cannot make a classification dataset (the message says why)."""


class ImageFolderDataset(Dataset):
    """Images listed once, decoded on access.

    Attributes:
        samples: ``(path, label)`` pairs of this split, in a fixed order.
        classes: class names; label ``i`` is ``classes[i]``.
        size: the height = width images come out at.
        color: ``"rgb"`` (3 channels) or ``"gray"`` (1).
        modes: how many images of the whole source had each PIL mode (before conversion).
    """

    def __init__(self, samples: list[tuple[Path, int]], classes: list[str], transform, size: int, color: str,
                 modes: Counter):
        self.samples, self.classes, self.size, self.color, self.modes = samples, classes, size, color, modes
        self._transform = transform

    @property
    def num_classes(self) -> int:
        """Number of classes (labels are ``0..num_classes-1``)."""
        return len(self.classes)

    @property
    def labels(self) -> torch.Tensor:
        """Every sample's label, int64 ``[N]``."""
        return torch.tensor([label for _, label in self.samples], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as image:
            image = image.convert("RGB" if self.color == "rgb" else "L")
        return self._transform(image), label


def image_folder(root: str | Path, size: int = 224, split: str = "train", *, val_fraction: float = 0.2,
                 seed: int = 0, color: str = "rgb", normalize: str | None = "imagenet",
                 augment: bool | None = None) -> ImageFolderDataset:
    """A classification dataset from a folder tree or a CSV file.

    Args:
        root: a directory with one subfolder per class (``root/cat/1.jpg``), or a ``.csv`` file
            of ``path,label`` rows (paths relative to the CSV's folder; a header row is allowed).
        size: output height = width.
        split: ``"train"``, ``"val"`` (``val_fraction`` of every class, at least one image of
            each class with two or more) or ``"all"``.
        val_fraction: share of each class held out for validation, in [0, 1).
        seed: the split's seed; the same folder and seed always give the same split.
        color: ``"rgb"`` or ``"gray"``; every image is converted to it.
        normalize: ``"imagenet"`` (the mean/std torchvision's pretrained weights expect) or
            ``None`` (pixels in [0, 1]).
        augment: random resized crops and horizontal flips; default: on for ``"train"`` only.

    Returns:
        An :class:`ImageFolderDataset` of float32 ``[C, size, size]`` images and int labels.

    Raises:
        ImageFolderError: a missing or empty source, unreadable images (listed), fewer than two
            classes, a malformed CSV, or a bad argument.

    Example:
        >>> data = image_folder("photos", size=160, split="val", color="rgb")  # doctest: +SKIP
    """
    if split not in SPLITS:
        raise ImageFolderError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if color not in ("rgb", "gray"):
        raise ImageFolderError(f"color must be 'rgb' or 'gray', got {color!r}")
    if normalize not in ("imagenet", None):
        raise ImageFolderError(f"normalize must be 'imagenet' or None, got {normalize!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ImageFolderError(f"size must be a positive int, got {size!r}")
    if not 0 <= val_fraction < 1:
        raise ImageFolderError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    source = Path(root)
    if source.is_file() and source.suffix.lower() == ".csv":
        samples, classes = _from_csv(source)
    elif source.is_dir():
        samples, classes = _from_tree(source)
    else:
        raise ImageFolderError(f"{source}: not a directory of class subfolders or a .csv file of path,label rows")
    if len(classes) < 2:
        raise ImageFolderError(f"{source}: found {len(classes)} class(es) {classes}; a classifier needs at least "
                               "two (one subfolder, or one label, per class)")
    modes = _check_readable(samples, source)
    if len(modes) > 1:
        counts = ", ".join(f"{mode}: {n}" for mode, n in modes.most_common())
        warnings.warn(f"{source}: images have mixed colour modes ({counts}); all are converted to {color}",
                      stacklevel=2)
    if split != "all":
        val = _validation_indices([label for _, label in samples], val_fraction, seed)
        samples = [s for i, s in enumerate(samples) if (i in val) == (split == "val")]
    return ImageFolderDataset(samples, classes, _transform(size, color, normalize,
                                                           split == "train" if augment is None else augment),
                              size, color, modes)


def _from_tree(root: Path) -> tuple[list[tuple[Path, int]], list[str]]:
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    try:
        classes, class_to_index = find_classes(str(root))
    except FileNotFoundError:
        raise ImageFolderError(f"{root}: no class subfolders (expected root/<class>/<image>)") from None
    found = make_dataset(str(root), class_to_index, extensions=IMG_EXTENSIONS, allow_empty=True)
    if not found:
        raise ImageFolderError(f"{root}: the class subfolders hold no images with the extensions "
                               f"{', '.join(IMG_EXTENSIONS)}")
    empty = sorted(set(classes) - {classes[label] for _, label in found})
    if empty:
        raise ImageFolderError(f"{root}: class folder(s) {empty} hold no images; remove them or add images")
    return [(Path(path), label) for path, label in found], classes


def _from_csv(path: Path) -> tuple[list[tuple[Path, int]], list[str]]:
    rows = []
    with open(path, newline="") as f:
        for number, row in enumerate(csv.reader(f), 1):
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != 2:
                raise ImageFolderError(f"{path}:{number}: expected 2 columns path,label, got {len(row)}")
            rows.append((number, row[0].strip(), row[1].strip()))
    if rows and rows[0][1].lower() == "path" and rows[0][2].lower() == "label":
        rows = rows[1:]
    if not rows:
        raise ImageFolderError(f"{path}: no path,label rows")
    classes = sorted({label for _, _, label in rows})
    index = {name: i for i, name in enumerate(classes)}
    samples = []
    for number, file, label in rows:
        image = (path.parent / file) if not Path(file).is_absolute() else Path(file)
        if not image.is_file():
            raise ImageFolderError(f"{path}:{number}: {file} is not a file (paths are relative to the CSV's folder)")
        samples.append((image, index[label]))
    return samples, classes


def _check_readable(samples: list[tuple[Path, int]], source: Path) -> Counter:
    """Open every image's header (cheap: no pixels are decoded); the modes seen, counted."""
    from PIL import Image, UnidentifiedImageError

    modes: Counter = Counter()
    bad = []
    for path, _ in samples:
        try:
            with Image.open(path) as image:
                modes[image.mode] += 1
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
            bad.append(f"{path} ({type(exc).__name__})")
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ImageFolderError(f"{source}: {len(bad)} of {len(samples)} images cannot be read: {shown}. "
                               "Remove or replace them")
    return modes


def _validation_indices(labels: list[int], fraction: float, seed: int) -> set[int]:
    """Per class, a seeded shuffle's first round(fraction * n) images (>= 1 when n >= 2 and fraction > 0)."""
    rng = np.random.default_rng(seed)
    chosen: set[int] = set()
    by_class: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        by_class.setdefault(label, []).append(i)
    for label in sorted(by_class):
        members = by_class[label]
        count = round(fraction * len(members))
        if fraction > 0 and len(members) >= 2:
            count = min(max(count, 1), len(members) - 1)  # each class keeps a training image
        chosen.update(members[i] for i in rng.permutation(len(members))[:count])
    return chosen


def _transform(size: int, color: str, normalize: str | None, augment: bool):
    from torchvision.transforms import v2

    steps = ([v2.RandomResizedCrop(size, scale=(0.35, 1.0), antialias=True), v2.RandomHorizontalFlip()]
             if augment else [v2.Resize(round(size * _RESIZE_RATIO), antialias=True), v2.CenterCrop(size)])
    steps += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    if normalize == "imagenet":
        mean, std = (IMAGENET_MEAN, IMAGENET_STD) if color == "rgb" else ((0.449,), (0.226,))
        steps.append(v2.Normalize(mean, std))
    return v2.Compose(steps)
