"""The user's image folders and CSVs: listing, deterministic stratified split, transforms, errors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from edgetorch.data import ImageFolderError, image_folder


def _image(path, seed: int, mode: str = "RGB", size=(40, 30)):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode=mode).save(path)
    return path


@pytest.fixture()
def tree(tmp_path):
    root = tmp_path / "photos"
    for c, name in enumerate(("cat", "dog", "emu")):
        for i in range(10 + 5 * c):
            _image(root / name / f"{i}.{'png' if i % 2 else 'jpg'}", 100 * c + i)
    (root / "cat" / "notes.txt").write_text("not an image, and not listed")
    return root


def test_a_class_tree_splits_deterministically_and_stratified(tree):
    train, val = image_folder(tree, size=32, split="train"), image_folder(tree, size=32, split="val")
    everything = image_folder(tree, size=32, split="all")
    assert train.classes == val.classes == ["cat", "dog", "emu"] and train.num_classes == 3
    assert len(everything) == 10 + 15 + 20 == len(train) + len(val)
    assert {p for p, _ in train.samples}.isdisjoint(p for p, _ in val.samples)
    assert torch.bincount(val.labels).tolist() == [2, 3, 4]  # 20% of every class
    assert [p for p, _ in image_folder(tree, size=32, split="val").samples] == [p for p, _ in val.samples]
    assert [p for p, _ in image_folder(tree, size=32, split="val", seed=1).samples] != [p for p, _ in val.samples]
    image, label = val[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label == val.samples[0][1]
    torch.manual_seed(0)
    assert not torch.equal(train[0][0], train[0][0])  # augmented: random crops and flips
    assert torch.equal(val[0][0], val[0][0])
    raw = image_folder(tree, size=16, split="val", color="gray", normalize=None)[0][0]
    assert raw.shape == (1, 16, 16) and 0 <= raw.min() and raw.max() <= 1


def test_a_csv_of_paths_and_labels(tree, tmp_path):
    rows = ["path,label"] + [f"photos/{c}/{i}.{'png' if i % 2 else 'jpg'}, {c}" for c in ("cat", "emu") for i in range(6)]
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n\n")
    data = image_folder(tmp_path / "list.csv", size=24, split="all")
    assert data.classes == ["cat", "emu"] and len(data) == 12 and data[11][0].shape == (3, 24, 24)
    (tmp_path / "bad.csv").write_text("photos/cat/0.jpg,cat,extra\n")
    with pytest.raises(ImageFolderError, match=r"bad.csv:1: expected 2 columns"):
        image_folder(tmp_path / "bad.csv")
    (tmp_path / "missing.csv").write_text("photos/cat/none.jpg,cat\nphotos/dog/0.jpg,dog\n")
    with pytest.raises(ImageFolderError, match=r"missing.csv:1: photos/cat/none.jpg is not a file"):
        image_folder(tmp_path / "missing.csv")


def test_what_cannot_make_a_dataset_is_an_error_that_says_why(tmp_path, tree, bomb_png):
    with pytest.raises(ImageFolderError, match="not a directory of class subfolders or a .csv"):
        image_folder(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageFolderError, match="no class subfolders"):
        image_folder(tmp_path / "empty")
    _image(tmp_path / "one" / "cat" / "a.png", 0)
    with pytest.raises(ImageFolderError, match=r"found 1 class\(es\) \['cat'\]; a classifier needs at least two"):
        image_folder(tmp_path / "one")
    (tmp_path / "one" / "dog").mkdir()
    with pytest.raises(ImageFolderError, match=r"class folder\(s\) \['dog'\] hold no images"):
        image_folder(tmp_path / "one")
    (tree / "dog" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(ImageFolderError, match=r"1 of 46 images cannot be read: .*broken.png"):
        image_folder(tree)
    bomb_png(tree / "emu" / "huge.png")
    with pytest.raises(ImageFolderError, match=r"2 of 47 images cannot be read: .*huge.png \(DecompressionBombError\)"):
        image_folder(tree)
    for bad, match in ((dict(split="test"), "split must be one of train, val, all"), (dict(color="cmyk"), "color"),
                       (dict(size=0), "size must be a positive int"), (dict(val_fraction=1.0), r"val_fraction must be in \[0, 1\)")):
        with pytest.raises(ImageFolderError, match=match):
            image_folder(tmp_path / "one", **bad)


def test_mixed_colour_modes_are_reported_with_counts_and_converted(tmp_path):
    root = tmp_path / "mixed"
    for i in range(3):
        _image(root / "a" / f"{i}.png", i, "RGB")
    _image(root / "b" / "0.png", 9, "L")
    _image(root / "b" / "1.png", 8, "RGBA")
    with pytest.warns(UserWarning, match=r"mixed colour modes \(RGB: 3, L: 1, RGBA: 1\); all are converted to rgb"):
        data = image_folder(root, size=8, split="all")
    assert {tuple(data[i][0].shape) for i in range(len(data))} == {(3, 8, 8)}
    (root / "b" / "0.png").unlink()
    _image(root / "b" / "0.png", 9, "RGB")
    (root / "b" / "1.png").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one mode: nothing to report
        assert image_folder(root, size=8, split="all").modes == {"RGB": 4}
