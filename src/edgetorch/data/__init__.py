"""Datasets: Fashion-MNIST from local IDX files, scikit-learn digits as the embedded default, and
the user's own image folders (:func:`image_folder`)."""

from .cache import CACHE_ENV, cache_dir
from .datasets import DATASETS, DatasetInfo, dataset_info, load_dataset
from .digits import load_digits_arrays
from .folder import ImageFolderDataset, ImageFolderError, image_files, image_folder, image_folder_splits
from .sources import ImageData, image_data
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
    "ImageData",
    "ImageFolderDataset",
    "ImageFolderError",
    "cache_dir",
    "dataset_info",
    "image_data",
    "image_files",
    "image_folder",
    "image_folder_splits",
    "load_dataset",
    "load_digits_arrays",
    "load_fashion_mnist",
    "locate_fashion_mnist",
    "parse_idx",
    "read_idx",
]
