"""Fashion-MNIST (Xiao et al., 2017) from its four IDX files: 60k train / 10k test, 28x28 grey.

Search order, first complete location wins:

1. ``root`` given by the caller: the directory itself, or a torchvision-style root holding
   ``FashionMNIST/raw/``;
2. the Debian package location (``apt-get install dataset-fashion-mnist``);
3. only with ``download=True``: torchvision's downloader into ``root`` (or
   ``<cache>/datasets`` without one), then its ``FashionMNIST/raw/``.

Each file may be raw or gzip-compressed (``name`` or ``name.gz``); the raw one is preferred.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import EdgetorchError
from .cache import cache_dir
from .idx import read_idx

DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASS_NAMES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IMAGE_SIZE = 28


class DatasetNotFoundError(EdgetorchError, FileNotFoundError):
    """No location holds the dataset files; the message lists what was tried and the options."""


def _find(directory: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def _missing(directory: Path) -> list[str]:
    stems = [stem for pair in _FILES.values() for stem in pair]
    return [stem for stem in stems if _find(directory, stem) is None]


def _download(target: Path) -> None:
    from torchvision.datasets import FashionMNIST

    # Constructing the dataset with download=True fetches and unpacks all four files.
    FashionMNIST(root=str(target), train=True, download=True)


def locate_fashion_mnist(root: str | Path | None = None, download: bool = False) -> Path:
    """Find (or, with ``download=True``, fetch) a directory holding all four Fashion-MNIST files.

    Args:
        root: a directory with the four IDX files, or a torchvision-style root containing
            ``FashionMNIST/raw/``; also the download target.
        download: fetch with torchvision when no local copy is found (needs network access).

    Returns:
        The directory holding the four files.

    Raises:
        DatasetNotFoundError: no location is complete; the message names every place tried
            and the three ways to provide the data.
    """
    candidates = []
    if root is not None:
        root = Path(root).expanduser()
        candidates += [root, root / "FashionMNIST" / "raw"]
    # Read the module attribute at call time so tests (and users) can point it elsewhere.
    candidates.append(DEBIAN_FASHION_MNIST_DIR)
    tried = []
    for directory in candidates:
        missing = _missing(directory)
        if not missing:
            return directory
        why = "missing " + ", ".join(missing) if directory.is_dir() else "no such directory"
        tried.append(f"{directory} ({why})")

    if download:
        target = root if root is not None else cache_dir() / "datasets"
        try:
            _download(target)
        # urllib errors are OSErrors; torchvision raises RuntimeError when every mirror failed.
        except (OSError, RuntimeError) as exc:
            tried.append(f"download into {target} failed: {exc}")
        else:
            raw = target / "FashionMNIST" / "raw"
            if not _missing(raw):
                return raw
            tried.append(f"download into {target} finished but {raw} is incomplete")
    else:
        tried.append("download not attempted (download=False)")

    raise DatasetNotFoundError(
        "Fashion-MNIST IDX files not found. Tried: "
        + "; ".join(tried)
        + ". Provide them in one of three ways: (1) pass root=DIR, a directory holding "
        "train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz] "
        "and t10k-labels-idx1-ubyte[.gz], or a torchvision root containing FashionMNIST/raw/; "
        f"(2) install the Debian package (apt-get install dataset-fashion-mnist, files under "
        f"{DEBIAN_FASHION_MNIST_DIR}); (3) pass download=True on a machine with network access."
    )


def load_fashion_mnist(
    split: str, root: str | Path | None = None, download: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Load one split of Fashion-MNIST as arrays.

    Args:
        split: ``"train"`` (60,000 images) or ``"test"`` (10,000 images).
        root: see :func:`locate_fashion_mnist`.
        download: see :func:`locate_fashion_mnist`.

    Returns:
        ``(images, labels)``: ``uint8`` ``[N, 28, 28]`` and ``int64`` ``[N]`` in ``0..9``.

    Raises:
        ValueError: unknown split, or files whose shapes or labels are not Fashion-MNIST's.
        DatasetNotFoundError: see :func:`locate_fashion_mnist`.
        IDXFormatError: a file is not well-formed IDX.
    """
    if split not in _FILES:
        raise ValueError(f"unknown split {split!r}; accepted: {', '.join(_FILES)}")
    directory = locate_fashion_mnist(root, download)
    image_path, label_path = (_find(directory, stem) for stem in _FILES[split])
    images, labels = read_idx(image_path), read_idx(label_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (IMAGE_SIZE,) * 2:
        raise ValueError(
            f"{image_path}: expected uint8 images of shape [N, {IMAGE_SIZE}, {IMAGE_SIZE}], "
            f"got {images.dtype} {list(images.shape)}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1 or len(labels) != len(images):
        raise ValueError(
            f"{label_path}: expected {len(images)} uint8 labels (one per image), "
            f"got {labels.dtype} {list(labels.shape)}"
        )
    if len(labels) and labels.max() >= len(CLASS_NAMES):
        raise ValueError(
            f"{label_path}: label {int(labels.max())} out of range; "
            f"accepted 0..{len(CLASS_NAMES) - 1}"
        )
    return images, labels.astype(np.int64)
