"""Weight files someone else made (`finetune --weights`, `read_weights`): tiny crafted files that asked for
gigabytes are refused within a memory bound, with CheckpointError, before anything is sized from them."""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile

import pytest
import torch
from typer.testing import CliRunner

from _bounded import run_children
from edgetorch.cli import app
from edgetorch.zoo import CheckpointError, read_weights


def _safetensors(header: dict, payload: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + payload


def _empty_classifier(path):
    """88 bytes: resnet18's classifier with 10**9 rows of 0 columns (it asked for a 2 TB Linear)."""
    path.write_bytes(_safetensors({"fc.weight": {"dtype": "F32", "shape": [10**9, 0], "data_offsets": [0, 0]}}))
    return path


def _stride_zero(path):
    """A 512-float storage seen as [10**6, 512] (expand): about 3 KB on disk, 2 GB once copied."""
    torch.save({"fc.weight": torch.zeros(1, 512).expand(10**6, 512), "fc.bias": torch.zeros(10**6)[:1].expand(10**6)},
               path)
    return path


def _deflated(path):
    """torch.save's own entries, rewritten deflate-compressed: 64 MiB of zeros in well under 1 MB."""
    buffer = io.BytesIO()
    torch.save({"fc.weight": torch.zeros(16 << 20)}, buffer)
    with zipfile.ZipFile(buffer) as stored, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as deflated:
        for entry in stored.infolist():
            deflated.writestr(entry.filename, stored.read(entry))
    assert path.stat().st_size < 1 << 20
    return path


def _legacy(path):
    torch.save({"fc.weight": torch.zeros(2, 2)}, path, _use_new_zipfile_serialization=False)
    return path


CASES = {
    "empty-classifier": ("w.safetensors", _empty_classifier, "fc.weight (file [1000000000, 0], model [1000, 512])"),
    "stride-zero": ("w.pt", _stride_zero, "is a view into a smaller storage"),
    "deflated": ("w.pt", _deflated, "holds compressed entries"),
    "legacy": ("w.pt", _legacy, "not a zip-format PyTorch file"),
    "fifo": ("w.safetensors", lambda p: (os.mkfifo(p), p)[1], "not a regular file"),
    "directory": ("w.pt", lambda p: (p.mkdir(), p)[1], "is a directory"),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case's `finetune --weights` start, in one fresh process (its peak reset before each)."""
    root = tmp_path_factory.mktemp("crafted")
    bodies = {}
    for case, (name, make, _) in CASES.items():
        (root / case).mkdir()
        path = make(root / case / name)
        bodies[case] = f"torch.manual_seed(0); edgetorch.finetune.start_model('torchvision:resnet18', 3, {str(path)!r})"
    return run_children(bodies, warm="edgetorch.finetune.start_model('torchvision:resnet18', 3)")


@pytest.mark.parametrize("case", CASES)
def test_a_crafted_weight_file_is_refused_within_the_memory_bound(outcomes, case):
    outcomes[case].refused_with("CheckpointError", CASES[case][2])


def test_real_torch_files_with_views_still_load(tmp_path):
    """A state dict holding a non-contiguous view of a larger storage is an honest file: it loads."""
    base = torch.arange(12.0).reshape(3, 4)
    torch.save({"t": base.t(), "row": base[1]}, tmp_path / "w.pt")
    state = read_weights(tmp_path / "w.pt")
    assert torch.equal(state["t"], base.t()) and torch.equal(state["row"], base[1])


def test_the_cli_prints_the_refusal_without_a_traceback(tmp_path):
    weights = _empty_classifier(tmp_path / "w.safetensors")
    (tmp_path / "photos" / "a").mkdir(parents=True)
    result = CliRunner().invoke(app, ["finetune", "--model", "torchvision:resnet18", "--weights", str(weights),
                                      "--data", str(tmp_path / "photos"), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "does not match ResNet" in " ".join(result.output.replace("│", " ").split())


def test_a_deflated_file_is_refused_by_read_weights_too(tmp_path):
    with pytest.raises(CheckpointError, match="torch.save writes them uncompressed"):
        read_weights(_deflated(tmp_path / "w.pt"))


def test_a_pickled_whole_model_is_refused_in_a_sentence_that_says_what_to_save(tmp_path):
    """torch's refusal runs to 20 lines of advice to unpickle; the message names the class and the fix."""
    path = tmp_path / "whole.pt"
    torch.save(torch.nn.Sequential(torch.nn.Linear(2, 2)), path)
    with pytest.raises(CheckpointError) as refused:
        read_weights(path)
    message = str(refused.value)
    assert "a pickled torch.nn.modules.container.Sequential object" in message
    assert "torch.save(model.state_dict(), path)" in message and "\n" not in message and "\x1b" not in message
