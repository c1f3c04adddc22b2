"""Datasets: Fashion-MNIST from local IDX files, scikit-learn digits as the embedded default."""

from .cache import CACHE_ENV, cache_dir
from .datasets import DATASETS, DatasetInfo, dataset_info, load_dataset
from .digits import load_digits_arrays
from .fashion_mnist import (
    DEBIAN_FASHION_MNIST_DIR,
    DatasetNotFoundError,
    load_fashion_mnist,
    locate_fashion_mnist,
)
from .idx import IDXFormatError, parse_idx, read_idx

__all__ = [
    "CACHE_ENV",
    "DATASETS",
    "DEBIAN_FASHION_MNIST_DIR",
    "DatasetInfo",
    "DatasetNotFoundError",
    "IDXFormatError",
    "cache_dir",
    "dataset_info",
    "load_dataset",
    "load_digits_arrays",
    "load_fashion_mnist",
    "locate_fashion_mnist",
    "parse_idx",
    "read_idx",
]
