"""scikit-learn's handwritten digits (UCI optdigits test part): 1,797 real 8x8 images, 10 classes.

It ships inside scikit-learn, so it is always available. Pixels are counts 0..16 (16 grey
levels plus black); they are divided by 16 to lie in [0, 1].

The dataset has no official train/test split. edgetorch's split is stratified and fixed: within
each class, the samples are shuffled with ``numpy.random.default_rng(DIGITS_SPLIT_SEED)`` (one
generator, classes in order 0..9) and the first ``round(DIGITS_TEST_FRACTION * count)`` go to
test. That gives 1,438 train and 359 test images, both in the original sample order.
"""

from __future__ import annotations

import numpy as np

DIGITS_SPLIT_SEED = 0
DIGITS_TEST_FRACTION = 0.2
CLASS_NAMES = tuple(str(d) for d in range(10))
_LEVELS = 16


def _test_mask(labels: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(DIGITS_SPLIT_SEED)
    mask = np.zeros(len(labels), dtype=bool)
    for cls in range(len(CLASS_NAMES)):
        members = np.flatnonzero(labels == cls)
        chosen = rng.permutation(members)[: round(DIGITS_TEST_FRACTION * len(members))]
        mask[chosen] = True
    return mask


def load_digits_arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
    """Load one split of the digits dataset as arrays.

    Args:
        split: ``"train"`` or ``"test"`` (the fixed split described in this module).

    Returns:
        ``(images, labels)``: ``float32`` ``[N, 8, 8]`` in [0, 1] and ``int64`` ``[N]`` in ``0..9``.

    Raises:
        ValueError: unknown split.
    """
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; accepted: train, test")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images / _LEVELS).astype(np.float32)
    labels = bunch.target.astype(np.int64)
    keep = _test_mask(labels)
    if split == "train":
        keep = ~keep
    return images[keep], labels[keep]
