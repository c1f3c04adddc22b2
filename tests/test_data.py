"""Datasets: IDX parsing, Fashion-MNIST search order and errors, digits split and resizing."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from edgetorch.data import (
    DatasetNotFoundError,
    IDXFormatError,
    dataset_info,
    fashion_mnist,
    load_dataset,
    load_fashion_mnist,
    locate_fashion_mnist,
    parse_idx,
    read_idx,
)

_CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}
_STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode an array as IDX (big-endian), independently of the reader under test."""
    header = struct.pack(">BBBB", 0, 0, _CODES[array.dtype.type], array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def fake_fashion(directory: Path, gz: bool = False, n_train: int = 6, n_test: int = 4, seed: int = 0):
    """Write four small Fashion-MNIST-shaped IDX files; return the arrays written."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        suffix = ".gz" if gz else ""
        write_idx(directory / (_STEMS[split][0] + suffix), images, gz)
        write_idx(directory / (_STEMS[split][1] + suffix), labels, gz)
        arrays[split] = (images, labels)
    return arrays


@pytest.fixture
def no_debian(tmp_path, monkeypatch):
    """Point the Debian location at an empty path so tests do not see a real install."""
    missing = tmp_path / "no-debian"
    monkeypatch.setattr(fashion_mnist, "DEBIAN_FASHION_MNIST_DIR", missing)
    return missing


# --- IDX parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(_CODES))
@pytest.mark.parametrize("gz", [False, True])
def test_idx_roundtrip_every_dtype(tmp_path, dtype, gz):
    array = (np.arange(2 * 3 * 5) - 7).astype(dtype).reshape(2, 3, 5)
    out = read_idx(write_idx(tmp_path / "a.idx", array, gz))
    assert out.dtype == np.dtype(dtype).newbyteorder("=")
    np.testing.assert_array_equal(out, array)
    out[0, 0, 0] = 1  # the result is writable


def test_gzip_detected_from_content_not_name(tmp_path):
    array = np.arange(10, dtype=np.uint8)
    assert read_idx(write_idx(tmp_path / "plain-name", array, gz=True)).tolist() == list(range(10))


def _header(code=0x08, ndim=1, dims=(3,)):
    return struct.pack(">BBBB", 0, 0, code, ndim) + struct.pack(f">{len(dims)}I", *dims)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"\x00\x00", "too short"),
        (b"\x01\x00\x08\x01" + struct.pack(">I", 1) + b"\x00", "bad IDX magic"),
        (_header(code=0x0A) + b"\x00" * 3, "unknown IDX dtype code 0x0A"),
        (_header(ndim=0, dims=()), "0 dimensions"),
        (_header(ndim=3, dims=(3,)), "header declares 3 dimensions"),
        (_header(dims=(3,)) + b"\x00\x00", "needs 3 data bytes, file has 2"),
        (_header(dims=(3,)) + b"\x00" * 4, "needs 3 data bytes, file has 4"),
        (_header(code=0x0C, dims=(2,)) + b"\x00" * 4, "needs 8 data bytes"),
    ],
)
def test_malformed_idx_is_reported(data, fragment):
    with pytest.raises(IDXFormatError, match=fragment):
        parse_idx(data)


def test_dtype_error_lists_accepted_codes():
    with pytest.raises(IDXFormatError, match=r"accepted: 0x08 \(uint8\).*0x0E \(float64\)"):
        parse_idx(_header(code=0x07) + b"\x00" * 3)


def test_corrupt_and_truncated_gzip(tmp_path):
    good = gzip.compress(idx_bytes(np.arange(100, dtype=np.uint8)))
    (tmp_path / "trunc").write_bytes(good[: len(good) // 2])
    (tmp_path / "garbage").write_bytes(good[:10] + b"\xff" * 20)
    for name in ("trunc", "garbage"):
        with pytest.raises(IDXFormatError, match="corrupt gzip"):
            read_idx(tmp_path / name)


# --- Fashion-MNIST location and validation ---------------------------------------------------


@pytest.mark.parametrize("gz", [False, True])
def test_fashion_from_explicit_directory(tmp_path, no_debian, gz):
    arrays = fake_fashion(tmp_path / "fm", gz=gz)
    for split, (images, labels) in arrays.items():
        ds = load_dataset("fashion-mnist", split, root=tmp_path / "fm")
        x, y = ds.tensors
        assert x.shape == (len(labels), 1, 28, 28) and x.dtype == torch.float32
        assert y.dtype == torch.int64
        torch.testing.assert_close(x[:, 0], torch.from_numpy(images).float() / 255)
        assert y.tolist() == labels.tolist()


def test_fashion_from_torchvision_root(tmp_path, no_debian):
    arrays = fake_fashion(tmp_path / "tv" / "FashionMNIST" / "raw")
    assert locate_fashion_mnist(tmp_path / "tv") == tmp_path / "tv" / "FashionMNIST" / "raw"
    _, labels = load_fashion_mnist("test", root=tmp_path / "tv")
    assert labels.tolist() == arrays["test"][1].tolist()


def test_raw_file_preferred_over_gz(tmp_path, no_debian):
    raw = fake_fashion(tmp_path / "fm", gz=False, seed=1)
    fake_fashion(tmp_path / "fm", gz=True, seed=2)
    _, labels = load_fashion_mnist("train", root=tmp_path / "fm")
    assert labels.tolist() == raw["train"][1].tolist()


def test_debian_location_used_without_root(tmp_path, monkeypatch):
    arrays = fake_fashion(tmp_path / "deb", gz=True)
    monkeypatch.setattr(fashion_mnist, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "deb")
    assert load_dataset("fashion-mnist", "test").tensors[1].tolist() == arrays["test"][1].tolist()


def test_none_found_error_names_all_three_options(tmp_path, no_debian):
    (tmp_path / "partial").mkdir()
    write_idx(tmp_path / "partial" / "train-images-idx3-ubyte", np.zeros((1, 28, 28), np.uint8))
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("fashion-mnist", root=tmp_path / "partial")
    message = str(info.value)
    for fragment in (
        "pass root=",
        "FashionMNIST/raw",
        "apt-get install dataset-fashion-mnist",
        "download=True",
        str(no_debian),
        "missing train-labels-idx1-ubyte",
        "download not attempted",
    ):
        assert fragment in message
    assert "missing train-images-idx3-ubyte" not in message


def test_download_failure_is_reported(tmp_path, no_debian, monkeypatch):
    def offline(target):
        raise OSError("network unreachable")

    monkeypatch.setattr(fashion_mnist, "_download", offline)
    with pytest.raises(DatasetNotFoundError, match="failed: network unreachable"):
        locate_fashion_mnist(tmp_path / "dl", download=True)


def test_download_only_when_asked_and_into_root(tmp_path, no_debian, monkeypatch):
    targets = []

    def fake_download(target):
        targets.append(target)
        fake_fashion(target / "FashionMNIST" / "raw", gz=True)

    monkeypatch.setattr(fashion_mnist, "_download", fake_download)
    with pytest.raises(DatasetNotFoundError):
        locate_fashion_mnist(tmp_path / "dl")
    assert targets == []
    found = locate_fashion_mnist(tmp_path / "dl", download=True)
    assert targets == [tmp_path / "dl"] and found == tmp_path / "dl" / "FashionMNIST" / "raw"


def test_download_without_root_goes_to_cache(tmp_path, no_debian, monkeypatch):
    monkeypatch.setenv("EDGETORCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        fashion_mnist, "_download", lambda t: fake_fashion(t / "FashionMNIST" / "raw")
    )
    assert locate_fashion_mnist(download=True) == tmp_path / "cache" / "datasets" / "FashionMNIST" / "raw"


@pytest.mark.parametrize(
    ("images", "labels", "fragment"),
    [
        (np.zeros((2, 27, 28), np.uint8), np.zeros(2, np.uint8), r"of shape \[N, 28, 28\]"),
        (np.zeros((2, 28, 28), np.int16), np.zeros(2, np.uint8), "expected uint8 images"),
        (np.zeros((2, 28, 28), np.uint8), np.zeros(3, np.uint8), "expected 2 uint8 labels"),
        (np.zeros((2, 28, 28), np.uint8), np.array([0, 10], np.uint8), "label 10 out of range"),
    ],
)
def test_wrong_content_is_rejected(tmp_path, no_debian, images, labels, fragment):
    fake_fashion(tmp_path / "fm")
    write_idx(tmp_path / "fm" / "t10k-images-idx3-ubyte", images)
    write_idx(tmp_path / "fm" / "t10k-labels-idx1-ubyte", labels)
    with pytest.raises(ValueError, match=fragment):
        load_fashion_mnist("test", root=tmp_path / "fm")


def test_malformed_file_in_dataset_raises(tmp_path, no_debian):
    fake_fashion(tmp_path / "fm")
    (tmp_path / "fm" / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x09")
    with pytest.raises(IDXFormatError, match="needs 9 data bytes"):
        load_fashion_mnist("test", root=tmp_path / "fm")


# --- digits and the common entry point -------------------------------------------------------


def test_digits_split_shapes_ranges_and_determinism():
    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    assert train.tensors[0].shape == (1438, 1, 8, 8) and test.tensors[0].shape == (359, 1, 8, 8)
    for ds in (train, test):
        x, y = ds.tensors
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.min() == 0 and x.max() == 1
        assert set(torch.unique(x * 16).tolist()) <= set(range(17))  # 16 grey levels + black
        assert torch.bincount(y, minlength=10).min() >= 35  # stratified: every class in both
    again = load_dataset("digits", "test")
    assert torch.equal(again.tensors[0], test.tensors[0]) and torch.equal(again.tensors[1], test.tensors[1])


def test_digits_splits_partition_the_dataset():
    from sklearn.datasets import load_digits

    everything = (load_digits().images / 16).astype(np.float32)
    all_rows = sorted(r.tobytes() for r in everything)
    split_rows = sorted(
        r.numpy().tobytes() for s in ("train", "test") for r in load_dataset("digits", s).tensors[0][:, 0]
    )
    assert split_rows == all_rows


def test_classes_keep_those_labels_relabelled_in_the_order_given_and_limit_counts_within_them():
    x, y = load_dataset("digits", "test").tensors
    keep = (y == 7) | (y == 2)
    sub_x, sub_y = load_dataset("digits", "test", classes=(7, 2)).tensors
    assert torch.equal(sub_x, x[keep]) and sub_y.dtype == torch.int64
    assert sub_y.tolist() == [0 if label == 7 else 1 for label in y[keep].tolist()]
    first = load_dataset("digits", "test", classes=(7, 2), limit=5).tensors
    assert torch.equal(first[0], sub_x[:5]) and torch.equal(first[1], sub_y[:5])
    for bad in ((), (1, 1), (10,), (-1,)):
        with pytest.raises(ValueError, match="classes must be distinct labels of digits"):
            load_dataset("digits", "test", classes=bad)
    with pytest.raises(ValueError, match="in classes"):
        load_dataset("digits", "test", classes=(7,), limit=1000)


def test_digits_resized_for_28x28_models_and_limit():
    x, y = load_dataset("digits", "train", size=28, limit=50).tensors
    assert x.shape == (50, 1, 28, 28) and y.shape == (50,)
    assert x.min() >= 0 and x.max() <= 1
    small = load_dataset("digits", "train", limit=50).tensors[0]
    assert torch.equal(y, load_dataset("digits", "train", limit=50).tensors[1])
    assert torch.allclose(x.mean((2, 3)), small.mean((2, 3)), atol=0.05)  # same content, finer grid


def test_names_are_normalised():
    assert dataset_info("Fashion_MNIST").name == "fashion-mnist"
    assert dataset_info("digits").num_classes == 10


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"name": "cifar10"}, "unknown dataset 'cifar10'; accepted: digits, fashion-mnist"),
        ({"name": "digits", "split": "val"}, "unknown split 'val'; accepted: train, test"),
        ({"name": "digits", "limit": 0}, "limit must be a positive int"),
        ({"name": "digits", "size": 2.5}, "size must be a positive int"),
        ({"name": "digits", "split": "test", "limit": 400}, "exceeds the 359 samples"),
        ({"name": "digits", "root": "/tmp"}, "apply only to fashion-mnist"),
    ],
)
def test_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_dataset(**kwargs)


@pytest.mark.skipif(
    not Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz").exists(),
    reason="Debian package dataset-fashion-mnist not installed",
)
def test_real_fashion_mnist_from_debian():
    x, y = load_dataset("fashion-mnist", "test").tensors
    assert x.shape == (10000, 1, 28, 28) and x.min() == 0 and x.max() == 1
    assert torch.bincount(y).tolist() == [1000] * 10
    assert load_dataset("fashion-mnist", "train", limit=10).tensors[0].shape == (10, 1, 28, 28)


def test_a_gzip_bomb_inflates_only_to_the_limit(tmp_path, monkeypatch):
    """gzip.decompress has no limit: 1 MB of gzip inflated to 1 GiB. The stream is cut at the limit."""
    import edgetorch.data.idx as idx

    monkeypatch.setattr(idx, "MAX_IDX_BYTES", 1 << 20)
    path = tmp_path / "bomb-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.zeros(4 << 20, dtype=np.uint8))))
    assert path.stat().st_size < 32 << 10
    with pytest.raises(IDXFormatError, match="inflates past the 1048576-byte limit"):
        read_idx(path)


def test_an_idx_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "train-images-idx3-ubyte")
    with pytest.raises(IDXFormatError, match="not a regular file"):
        read_idx(tmp_path / "train-images-idx3-ubyte")
