"""The user's own images: a class-per-subfolder tree or a CSV of ``path,label`` rows.

The tree follows torchvision's ``ImageFolder`` conventions (one subfolder per class, classes
sorted by name, files filtered by image extension, listed in the same order). What is added
here is what a fine-tuning run needs before it starts: every image's header is read once, so an
unreadable file, an empty folder or a single class is an error that names the files, not an
exception in the middle of epoch 3; mixed colour modes are reported with counts (they are all
converted to the requested ``color``); and the train/validation split is deterministic and
stratified, so the same folder and seed always give the same validation set.

Files are listed and read through :mod:`edgetorch.data.images`: each real folder is entered once
(symlink loops end), FIFOs and other non-regular files are refused, and files and pixel counts
have limits. A header can be intact while the data after it is not (a truncated JPEG or PNG), so
an image is fully decoded when it is used, and one that fails raises
:class:`ImageFolderError` naming it. With ``skip_bad_images=True`` every image is decoded once
while listing instead, and the unreadable ones (named with the reason in a warning and in
``skipped``) are left out before the split, so the dataset's length is what training sees.

Example:
    >>> train = image_folder("photos", size=224, split="train")  # doctest: +SKIP
    >>> val = image_folder("photos", size=224, split="val")  # doctest: +SKIP
    >>> image, label = train[0]; train.classes  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import io
import os
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .._files import InputFileError, read_bytes
from .images import ACCEPTED, IMAGE_EXTENSIONS, MAX_IMAGE_PIXELS, MAX_LISTED, list_images, read_image

SPLITS = ("train", "val", "all")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# Eval transform: resize the short side to size * 256/224, then centre-crop (the torchvision
# reference recipe), so a model sees the same framing at every size.
_RESIZE_RATIO = 256 / 224
#: The version of :func:`preprocessing_record`'s fields (a change to them makes a new version).
PREPROCESSING_VERSION = 1
MAX_CSV_BYTES = 256 << 20  # MAX_LISTED rows of ~130 characters each
# The end of every "cannot be read" message: what to do about it.
SKIP_HINT = ("or pass skip_bad_images=True (edgetorch finetune / split train: --skip-bad-images) to leave out "
             "every image that cannot be read")


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
        skipped: ``(path, why)`` of every image of the whole source left out as unreadable
            (only with ``skip_bad_images=True``; otherwise empty).
    """

    def __init__(self, samples: list[tuple[Path, int]], classes: list[str], transform, size: int, color: str,
                 modes: Counter, skipped: list[tuple[Path, str]]):
        self.samples, self.classes, self.size, self.color, self.modes = samples, classes, size, color, modes
        self.skipped = skipped
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
        """The image, fully decoded and transformed, and its label.

        Raises:
            ImageFolderError: the file is unreadable (truncated, corrupt, or changed since it was
                listed); the message names it.
        """
        path, label = self.samples[index]
        try:
            image = read_image(path, error=ImageFolderError)
        except ImageFolderError as exc:
            raise ImageFolderError(f"{exc}. Remove or replace it, {SKIP_HINT} (every image is then decoded "
                                   "once before training)") from None
        try:
            return self._transform(image.convert("RGB" if self.color == "rgb" else "L")), label
        except ElongatedImageError as exc:  # the file's shape, not a bug
            raise ImageFolderError(f"{path}: {exc}. Remove or replace it, {SKIP_HINT}") from None


def image_folder(root: str | Path, size: int = 224, split: str = "train", *, val_fraction: float = 0.2,
                 seed: int = 0, color: str = "rgb", normalize: str | None = "imagenet",
                 augment: bool | None = None, skip_bad_images: bool = False) -> ImageFolderDataset:
    """A classification dataset from a folder tree or a CSV file.

    Args:
        root: a directory with one subfolder per class (``root/cat/1.jpg``, also in nested
            folders; folder symlinks are followed, each real folder once), or a ``.csv`` file of
            ``path,label`` rows (UTF-8; paths relative to the CSV's folder; a header row is
            allowed).
        size: output height = width.
        split: ``"train"``, ``"val"`` (``val_fraction`` of every class, at least one image of
            each class with two or more) or ``"all"``.
        val_fraction: share of each class held out for validation, in [0, 1).
        seed: the split's seed; the same folder and seed always give the same split.
        color: ``"rgb"`` or ``"gray"``; every image is converted to it.
        normalize: ``"imagenet"`` (the mean/std torchvision's pretrained weights expect) or
            ``None`` (pixels in [0, 1]).
        augment: random resized crops and horizontal flips; default: on for ``"train"`` only.
        skip_bad_images: decode every image while listing and leave out the unreadable ones
            (truncated, corrupt, not an image, a FIFO, over the size limits) before the split,
            with a warning naming them; they are in ``skipped``. Default: an unreadable header is
            an error here, and damaged data after an intact header an error when the image is used.

    Returns:
        An :class:`ImageFolderDataset` of float32 ``[C, size, size]`` images and int labels.

    Raises:
        ImageFolderError: a missing or empty source, unreadable images (listed), fewer than two
            classes, a malformed CSV, or a bad argument.

    Example:
        >>> data = image_folder("photos", size=160, split="val", color="rgb")  # doctest: +SKIP
    """
    return image_folder_splits(root, size, (split,), val_fraction=val_fraction, seed=seed, color=color,
                               normalize=normalize, augment=augment, skip_bad_images=skip_bad_images)[split]


def image_files(paths: Sequence[str | Path], size: int, *, color: str = "rgb",
                normalize: str | None = "imagenet") -> ImageFolderDataset:
    """Images to classify, preprocessed as a folder's validation split is (resize, centre crop,
    normalisation): what a trained model saw of its held-out images.

    Args:
        paths: image files, or folders whose images (recursively, in sorted order) are taken.
        size: output height = width.
        color: ``"rgb"`` or ``"gray"``.
        normalize: ``"imagenet"`` or ``None``.

    Returns:
        An :class:`ImageFolderDataset` with no classes; every label is -1.

    Raises:
        ImageFolderError: a path that does not exist, or no image among them.

    Example:
        >>> images = image_files(["photos/cat/1.jpg", "more/"], 224)  # doctest: +SKIP
    """
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += list_images([path], error=ImageFolderError)[0][0]
        elif path.exists() or path.is_symlink():
            files.append(path)
        else:
            raise ImageFolderError(f"{path}: no such file or folder")
    if not files:
        raise ImageFolderError(f"no image files among {', '.join(map(str, paths))}; accepted: {ACCEPTED}")
    return ImageFolderDataset([(f, -1) for f in files], [], _transform(size, color, normalize, False), size, color,
                              Counter(), [])


def image_folder_splits(root: str | Path, size: int = 224, splits: tuple[str, ...] = ("train", "val"), *,
                        val_fraction: float = 0.2, seed: int = 0, color: str = "rgb",
                        normalize: str | None = "imagenet", augment: bool | None = None,
                        skip_bad_images: bool = False) -> dict[str, ImageFolderDataset]:
    """Several splits of one source, listed and checked once (see :func:`image_folder` for the arguments).

    With ``skip_bad_images`` the check decodes every image, so a train and a validation split
    made by two :func:`image_folder` calls would decode each image twice.

    Returns:
        ``{split: dataset}`` for each of ``splits``.

    Example:
        >>> parts = image_folder_splits("photos", 160, ("train", "val"))  # doctest: +SKIP
    """
    for split in splits:
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
    _check_classes(samples, classes, source, "images")
    modes, bad = _check_images(samples, decode=skip_bad_images)
    if bad:
        shown = _first_few([why for _, why in bad], "; ")
        if not skip_bad_images:
            raise ImageFolderError(f"{source}: {len(bad)} of {len(samples)} images cannot be read: {shown}. "
                                   f"Accepted: {ACCEPTED}. Remove or replace them, {SKIP_HINT}")
        warnings.warn(f"{source}: left out {len(bad)} of {len(samples)} images that cannot be read "
                      f"(skip_bad_images): {shown}", stacklevel=3)
        unreadable = {path for path, _ in bad}
        samples = [sample for sample in samples if sample[0] not in unreadable]
        _check_classes(samples, classes, source, f"readable images ({len(bad)} were left out)")
    if len(modes) > 1:
        counts = ", ".join(f"{mode}: {n}" for mode, n in modes.most_common())
        warnings.warn(f"{source}: images have mixed colour modes ({counts}); all are converted to {color}",
                      stacklevel=3)
    val = _validation_indices([label for _, label in samples], val_fraction, seed)
    parts = {}
    for split in splits:
        chosen = (samples if split == "all"
                  else [s for i, s in enumerate(samples) if (i in val) == (split == "val")])
        transform = _transform(size, color, normalize, split == "train" if augment is None else augment)
        parts[split] = ImageFolderDataset(chosen, classes, transform, size, color, modes, bad)
    return parts


def _from_tree(root: Path) -> tuple[list[tuple[Path, int]], list[str]]:
    try:
        with os.scandir(root) as entries:
            classes = sorted(entry.name for entry in entries if entry.is_dir())
    except OSError as exc:
        raise ImageFolderError(f"{root}: cannot be listed ({exc.strerror})") from None
    if not classes:
        raise ImageFolderError(f"{root}: no class subfolders (expected root/<class>/<image>)")
    files, not_followed = list_images([root / name for name in classes], error=ImageFolderError, outside=[root])
    if not_followed:
        warnings.warn(f"{root}: {len(not_followed)} folder(s) lead to a folder already listed (a symlink loop, or "
                      f"a second path to the same images) and were not entered again: "
                      f"{_first_few(list(map(str, not_followed)), ', ')}", stacklevel=4)
    samples = [(path, label) for label, paths in enumerate(files) for path in paths]
    if not samples:
        raise ImageFolderError(f"{root}: the class subfolders hold no images with the extensions "
                               f"{', '.join(IMAGE_EXTENSIONS)}")
    return samples, classes


def _from_csv(path: Path) -> tuple[list[tuple[Path, int]], list[str]]:
    data = read_bytes(path, MAX_CSV_BYTES, error=ImageFolderError,
                      why=" for a path,label CSV (it is read whole); list fewer images")
    nul = data.find(b"\0")
    if nul >= 0:  # csv reads NUL as text since Python 3.11; no path or label holds one
        raise ImageFolderError(f"{path}:{_line(data, nul)}: a NUL byte; a CSV of "
                               "path,label text rows is expected")
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (Excel writes one) is not part of the first path
    except UnicodeDecodeError as exc:
        raise ImageFolderError(f"{path}:{_line(data, exc.start)}: not UTF-8 text ({exc.reason} at "
                               f"byte {exc.start}); a UTF-8 CSV of path,label rows is expected") from None
    rows = []
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        for row in reader:
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != 2:
                raise ImageFolderError(f"{path}:{reader.line_num}: expected 2 columns path,label, got {len(row)}")
            if len(rows) == MAX_LISTED:
                raise ImageFolderError(f"{path}: over {MAX_LISTED:,} rows; an image listing holds no more "
                                       "(train on a part of them)")
            rows.append((reader.line_num, row[0].strip(), row[1].strip()))
    except csv.Error as exc:  # a field over csv.field_size_limit(), an unclosed quote, ...
        raise ImageFolderError(f"{path}:{reader.line_num}: not a CSV row ({exc}); path,label rows are expected, "
                               f"each field at most {csv.field_size_limit():,} characters") from None
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


def _first_few(items: list[str], separator: str) -> str:
    """The first five of ``items`` joined, and how many more there are."""
    return separator.join(items[:5]) + (f"{separator}and {len(items) - 5} more" if len(items) > 5 else "")


def _line(data: bytes, offset: int) -> int:
    """The 1-based line of byte ``offset``."""
    return data.count(b"\n", 0, offset) + 1


def _check_classes(samples: list[tuple[Path, int]], classes: list[str], source: Path, what: str) -> None:
    """At least two classes, each with at least one of ``samples``."""
    if len(classes) < 2:
        raise ImageFolderError(f"{source}: found {len(classes)} class(es) {classes}; a classifier needs at least "
                               "two (one subfolder, or one label, per class)")
    empty = sorted(set(classes) - {classes[label] for _, label in samples})
    if empty:
        raise ImageFolderError(f"{source}: class(es) {empty} hold no {what}; remove them or add images")


def _check_images(samples: list[tuple[Path, int]], decode: bool) -> tuple[Counter, list[tuple[Path, str]]]:
    """Read every image's header (cheap), or decode it whole: the modes seen, counted, and the
    unreadable files with why (the suffix saying what is accepted is left to the caller's message)."""
    modes: Counter = Counter()
    bad = []
    for path, _ in samples:
        try:
            modes[read_image(path, error=ImageFolderError, header_only=not decode).mode] += 1
        except ImageFolderError as exc:
            bad.append((path, str(exc).removesuffix(f"; accepted: {ACCEPTED}")))
    return modes, bad


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


def preprocessing_record(size: int, color: str, normalize: str | None) -> dict:
    """A folder's evaluation transform (a validation split, :func:`image_files`) as data, complete
    enough to reproduce it exactly elsewhere (a deployment, another framework).

    Args:
        size: output height = width.
        color: ``"rgb"`` or ``"gray"``.
        normalize: ``"imagenet"`` or ``None``.

    Returns:
        ``{"version": 1, "mode", "resize_short_side", "resize", "center_crop", "crop_offset",
        "scale", "mean", "std"}``: decode and convert to PIL ``mode``; resize the 8-bit image with
        Pillow's bilinear filter so its short side is ``resize_short_side`` and its long side
        ``int(resize_short_side * long / short)``; crop ``center_crop`` = [height, width] at
        ``round((side - crop) / 2)`` from the top and left; multiply the 8-bit pixels by ``scale``;
        subtract ``mean`` and divide by ``std`` per channel (none: empty).
    """
    mean, std = _normalisation(color, normalize)
    # torchvision's v2 Resize and CenterCrop act on the PIL image here (ToImage comes after them):
    # Pillow's filter on 8-bit pixels, which differs from torch's antialiased resize of a float
    # tensor by up to 4.5/255.
    return {"version": PREPROCESSING_VERSION, "mode": "RGB" if color == "rgb" else "L",
            "resize_short_side": round(size * _RESIZE_RATIO), "resize": "Pillow Image.resize, BILINEAR, 8-bit",
            "center_crop": [size, size], "crop_offset": "round((side - crop) / 2)", "scale": 1 / 255,
            "mean": list(mean), "std": list(std)}


def _normalisation(color: str, normalize: str | None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if normalize != "imagenet":
        return (), ()
    return (IMAGENET_MEAN, IMAGENET_STD) if color == "rgb" else ((0.449,), (0.226,))


def normalisation_name(color: str, mean: tuple[float, ...], std: tuple[float, ...]) -> str | None:
    """What ``(mean, std)`` is called in a record: ``"imagenet"`` (this module's, for ``color``),
    None where it changes nothing (mean 0, std 1), else ``"custom"``."""
    if (tuple(mean), tuple(std)) == _normalisation(color, "imagenet"):
        return "imagenet"
    return None if all(m == 0 for m in mean) and all(s == 1 for s in std) else "custom"


def evaluation_transform(size: int, color: str, normalize: str | None):
    """The transform a validation split applies to a PIL image (what :func:`preprocessing_record`
    describes): to a float32 ``[C, size, size]`` tensor. ``split`` artifacts with
    ``resize="center-crop"`` use it on the device.

    Example:
        >>> pixels = evaluation_transform(96, "rgb", "imagenet")(read_image("cat.jpg").convert("RGB"))  # doctest: +SKIP
    """
    return _transform(size, color, normalize, False)


def _transform(size: int, color: str, normalize: str | None, augment: bool):
    from torchvision.transforms import v2

    short = round(size * _RESIZE_RATIO)
    steps = ([v2.RandomResizedCrop(size, scale=(0.35, 1.0), antialias=True), v2.RandomHorizontalFlip()]
             if augment else [_ShortSideLimit(short), v2.Resize(short, antialias=True), v2.CenterCrop(size)])
    steps += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    mean, std = _normalisation(color, normalize)
    if mean:
        steps.append(v2.Normalize(mean, std))
    return v2.Compose(steps)


class ElongatedImageError(ImageFolderError):
    """An image whose evaluation resize would exceed MAX_IMAGE_PIXELS (see :class:`_ShortSideLimit`)."""


class _ShortSideLimit:
    """Refuses an image whose short side resized to ``short`` would exceed MAX_IMAGE_PIXELS: the
    decode limit counts pixels, not shape, so a 1-pixel-high strip of 89 million pixels (a small
    PNG) passes it and would be resized to 256 x 22.9 billion pixels at 224 px (~69 GB of 8-bit
    RGB) before the centre crop kept 224 x 224 of it."""

    def __init__(self, short: int):
        self.short = short

    def __call__(self, image):
        width, height = image.size
        if self.short * self.short * max(width, height) > MAX_IMAGE_PIXELS * min(width, height):
            raise ElongatedImageError(f"its {width} x {height} pixels resized to a short side of {self.short} would be over "
                             f"{MAX_IMAGE_PIXELS:,} pixels; accepted: a long side at most "
                             f"{MAX_IMAGE_PIXELS // self.short**2:,} times the short side")
        return image
