"""The user's image folders and CSVs: listing, deterministic stratified split, transforms, errors,
and the files that once crashed or hung a run (damaged images, FIFOs, symlink loops, bombs, CSVs)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from edgetorch.data import ImageFolderError, image_folder, image_folder_splits


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
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n\n", encoding="utf-8-sig")  # as Excel writes it
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
    with pytest.raises(ImageFolderError, match=r"class\(es\) \['dog'\] hold no images"):
        image_folder(tmp_path / "one")
    (tree / "dog" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(ImageFolderError, match=r"1 of 46 images cannot be read: .*broken.png: not a readable image"):
        image_folder(tree)
    bomb_png(tree / "emu" / "huge.png")
    with pytest.raises(ImageFolderError, match=r"2 of 47 images cannot be read: .*huge.png: .*decompression bomb"):
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


def _truncated(path, fmt: str):
    """A real image with the second half of its file cut off: the header is intact."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, format=fmt)
    path.write_bytes(buffer.getvalue()[: buffer.tell() // 2])


def test_damaged_data_behind_an_intact_header_fails_when_used_or_is_skipped(tree):
    _truncated(tree / "cat" / "cut.jpg", "JPEG")
    _truncated(tree / "dog" / "cut.png", "PNG")
    data = image_folder(tree, size=16, split="all")  # the headers are intact: listed
    for name in ("cut.jpg", "cut.png"):
        index = next(i for i, (path, _) in enumerate(data.samples) if path.name == name)
        with pytest.raises(ImageFolderError, match=rf"{name}: not a readable image \(image file is truncated.*"
                                                   r"accepted: complete JPEG, PNG.*skip_bad_images=True"):
            data[index]
    with pytest.warns(UserWarning, match=r"left out 2 of 47 images that cannot be read \(skip_bad_images\): "
                                         r".*cut.jpg: not a readable image \(image file is truncated"):
        parts = image_folder_splits(tree, 16, ("train", "val", "all"), skip_bad_images=True)
    assert len(parts["all"]) == 45 == len(parts["train"]) + len(parts["val"])  # the length training sees
    assert [path.name for path, _ in parts["val"].skipped] == ["cut.jpg", "cut.png"]
    assert not {"cut.jpg", "cut.png"} & {path.name for path, _ in parts["all"].samples}


def test_files_that_are_no_image_are_listed_in_one_error_or_skipped(tree):
    (tree / "cat" / "empty.png").write_bytes(b"")
    (tree / "emu" / "text.png").write_text("hello, these are not pixels")
    with pytest.raises(ImageFolderError, match=r"2 of 47 images cannot be read: .*empty.png: not a readable image "
                                               r".*text.png: not a readable image .*Accepted: complete JPEG.*"
                                               r"--skip-bad-images"):
        image_folder(tree)
    with pytest.warns(UserWarning, match="left out 2 of 47"):
        data = image_folder(tree, split="all", skip_bad_images=True)
    assert len(data) == 45 and len(data.skipped) == 2
    for path in tree.glob("emu/*"):  # what is left of a class after skipping must still be an image
        if path.name != "text.png":
            path.unlink()
    with pytest.warns(UserWarning, match="left out"), \
            pytest.raises(ImageFolderError, match=r"class\(es\) \['emu'\] hold no readable images \(2 were left out\)"):
        image_folder(tree, skip_bad_images=True)


def test_a_decompression_bomb_is_refused_from_its_header_without_decoding(tree, bomb_png, monkeypatch):
    bomb_png(tree / "cat" / "bomb.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # PIL's own check off: edgetorch's limit must hold
    decode = ImageFile.ImageFile.load

    def load(image):
        assert image.size != (30000, 30000), "the bomb's pixels were decoded"
        return decode(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    bomb = r"bomb.png: not a readable image \(its header declares 30000 x 30000 = 900,000,000 pixels, over the 89,478,485"
    with pytest.raises(ImageFolderError, match=bomb):
        image_folder(tree)
    with pytest.warns(UserWarning, match="left out 1 of 46 .*" + bomb):
        assert len(image_folder(tree, split="all", skip_bad_images=True)) == 45


def test_file_size_and_listing_limits(tree, monkeypatch):
    import edgetorch.data.images as images

    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 100)
    with pytest.raises(ImageFolderError, match=r"45 of 45 images cannot be read: .* over the 100-byte limit"):
        image_folder(tree)
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 1 << 20)
    monkeypatch.setattr(images, "MAX_LISTED", 40)
    with pytest.raises(ImageFolderError, match="over 40 files and folders in all"):
        image_folder(tree)


_SCAN = """
import json, sys, warnings
from edgetorch.data import ImageFolderError, image_folder
found = {}
try:
    image_folder(sys.argv[1], size=8, split="all")
except ImageFolderError as exc:
    found["error"] = str(exc)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    data = image_folder(sys.argv[1], size=8, split="all", skip_bad_images=True)
found.update(warnings=[str(w.message) for w in caught], samples=len(data), skipped=[str(p) for p, _ in data.skipped])
print(json.dumps(found))
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and symlinks")
def test_a_fifo_and_symlink_loops_neither_hang_nor_list_twice(tree):
    os.mkfifo(tree / "cat" / "pipe.png")  # opening it for reading blocked until a writer came
    for name in ("a", "b"):  # two links to "." made the walk branch for ever
        (tree / "dog" / name).symlink_to(".", target_is_directory=True)
    (tree / "emu" / "up").symlink_to("..", target_is_directory=True)  # the root: every class again
    # In a subprocess, so a hang fails this test (the timeout only detects one) instead of the suite.
    done = subprocess.run([sys.executable, "-c", _SCAN, str(tree)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert "1 of 46 images cannot be read" in found["error"]
    assert "pipe.png is not a regular file (a FIFO, device or socket)" in found["error"]
    assert any("3 folder(s) lead to a folder already listed" in w and "dog/a" in w for w in found["warnings"])
    assert found["samples"] == 45 and [p.rsplit("/", 1)[1] for p in found["skipped"]] == ["pipe.png"]


def test_a_csv_that_is_not_path_label_text_is_an_error_with_its_line(tree, tmp_path, monkeypatch):
    good = "path,label\nphotos/cat/0.jpg,cat\n"
    for name, data, message in (
            ("long.csv", good + "photos/dog/0.jpg," + "x" * 200_000 + "\n",
             r"long.csv:3: not a CSV row \(field larger than field limit \(131072\)\)"),
            ("nul.csv", good + "photos/dog/0.jpg,d\0g\n", r"nul.csv:3: a NUL byte"),
            ("latin.csv", (good + "photos/dog/0.jpg,chien\n").encode() + "photos/dog/1.png,ch\xe9vre\n".encode("latin-1"),
             r"latin.csv:4: not UTF-8 text \(invalid continuation byte at byte \d+\); a UTF-8 CSV")):
        (tmp_path / name).write_bytes(data if isinstance(data, bytes) else data.encode())
        with pytest.raises(ImageFolderError, match=message):
            image_folder(tmp_path / name)
    import edgetorch.data.folder as folder

    monkeypatch.setattr(folder, "MAX_CSV_BYTES", 10)
    with pytest.raises(ImageFolderError, match=r"nul.csv is \d+ bytes, over the 10-byte limit for a path,label CSV"):
        image_folder(tmp_path / "nul.csv")


def test_an_image_too_elongated_to_resize_is_refused_by_name_not_resized(tmp_path):
    """The decode limit counts pixels, not shape: a 1 x 100,000 strip passes it, and the evaluation
    resize (short side 32 at size 28) would have made 3.2 million pixels of it before cropping.
    finetune/predict's transform and split's centre-crop preprocessing refuse it, naming the file."""
    from PIL import Image

    from edgetorch.data import image_files
    from edgetorch.data.folder import ImageFolderError
    from edgetorch.split.client import preprocess_images
    from edgetorch.split.manifest import Preprocess
    from edgetorch import InputFileError

    strip = tmp_path / "strip.png"
    Image.new("L", (100_000, 1)).save(strip)
    with pytest.raises(ImageFolderError, match=r"strip\.png: its 100000 x 1 pixels .* accepted: a long side at most"):
        image_files([strip], 28, color="gray")[0]
    with pytest.raises(InputFileError, match=r"strip\.png: its 100000 x 1 pixels"):
        preprocess_images([strip], Preprocess((28, 28), "gray", resize="center-crop"), 3)
    wide = tmp_path / "wide.png"  # an ordinary panorama is still taken
    Image.new("L", (3000, 300)).save(wide)
    assert image_files([wide], 28, color="gray")[0][0].shape == (1, 28, 28)
