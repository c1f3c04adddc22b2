"""Shared by several test modules: a small MLP and a small plain CNN with trained-looking batch
norms (the reduce tests), a decompression-bomb image file (every reader of user images), and a
folder with a model `edgetorch finetune` trained on it (the reduce and predict tests)."""

from __future__ import annotations

import gc
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

# The suite must stay fast on a busy 2-core machine, where another process holds one core.
# - OpenMP's default wait policy spins: a thread that finishes its share of an op busy-waits for
#   the other, on the core its partner needs. torch's parallel ops ran 2-7x slower (a resnet18
#   plan_memory: 28 s instead of 2 s). Passive waiting sleeps instead; thread counts are unchanged.
# - numpy's OpenBLAS (pthreads, no such setting) split each SVD of the reduce tests over 2 threads,
#   one of them waiting for the busy core: test_lowrank_on_torchvision_resnet18 took 84 s instead
#   of 9 s idle; with one thread 18 s busy. The price idle: vgg11_bn's reductions (big matrix
#   products) take 13 s -> 17 s; test_reduce_corners + test_reduce_grouped 86 s -> 90 s.
# Neither changes what a test checks. Set before torch and numpy load their libraries (which read them
# then), and inherited by the child processes the tests start. A value set by the caller is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Typer lays out its error panels by COLUMNS, so a message a test matches wraps inside the panel's
# borders at a narrow width: the tests' output does not depend on the caller's terminal. (The
# pytest-xdist workers of make test start with COLUMNS=80 and LINES=24 whatever the terminal.)
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from torch import nn  # noqa: E402

from edgetorch.zoo import MLP  # noqa: E402

# Hypothesis times examples by the wall clock twice: the 200 ms deadline per example, and the
# too_slow health check on how long examples take to generate. Both fail on a busy machine, not
# on a wrong result. Every test here already sets deadline=None; this profile is the default
# they inherit from, so a new test does too. (A test that lists its own suppress_health_check
# replaces this list: those name too_slow themselves.)
settings.register_profile("edgetorch", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("edgetorch")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what importing the test modules built (torch, torchvision, ... : half a million
    objects) out of the cyclic garbage collector: every full collection, automatic or the
    memory measurements' own ``gc.collect()`` (16 per ``plan_memory``), then skips them, which
    took about 0.2 s each. Garbage from the tests themselves is collected as before."""
    gc.collect()
    gc.freeze()


# pytest-xdist's loadfile runs each test file whole on one worker, handing the files out in collection
# order with --no-loadscope-reorder (the Makefile passes it; by default it sorts them by their number of
# tests, which put the long files of few tests last): when the longest files come last, one worker
# finishes them alone while the other idles. Longest first (summed in-worker durations, seconds)
# balances the two. Order only: no test's result depends on it.
_LONGEST_FILES = (  # make test in place, 2026-11-28: 1,372 s summed, 725 s on the wall
    "test_codec_triton.py",  # 138
    "test_readme.py",  # 120
    "test_reduce_grouped.py",  # 106
    "test_budget.py",  # 86
    "test_split_runtime.py",  # 77
    "test_split_train.py",  # 74
    "test_split_bottleneck.py",  # 74
    "test_codec_triton_engine.py",  # 56
    "test_split_attack.py",  # 54
    "test_finetune.py",  # 52
    "test_cli_profile.py",  # 50
    "test_slim_install.py",  # 50
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the longest test files first (see _LONGEST_FILES); the rest keep their order."""
    rank = {name: i for i, name in enumerate(_LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file kept


def _small_cnn(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 12, 3, padding=1, bias=False), nn.BatchNorm2d(12), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(12, 10, 1), nn.ReLU(),
        nn.Flatten(), nn.Linear(10 * 2 * 2, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 5),
    )
    with torch.no_grad():  # trained-looking batch norms: non-trivial statistics and affine
        for m in model:
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.eval()


@pytest.fixture()
def small_cnn() -> Callable[[int], nn.Sequential]:
    """The CNN builder, for tests that edit a fresh copy (seeded)."""
    return _small_cnn


@pytest.fixture(scope="module")
def cnn_and_data():
    return _small_cnn(), torch.rand(64, 3, 8, 8)


@pytest.fixture(scope="module")
def mlp_and_data():
    torch.manual_seed(0)
    model = MLP(image_size=8, hidden=(40, 30, 20)).eval()
    x = torch.rand(200, 1, 8, 8)
    return model, x


@pytest.fixture()
def bomb_png() -> Callable[[Path], Path]:
    """Writes a PNG whose header declares 30000 x 30000 pixels (in a few dozen bytes): PIL refuses
    it as a decompression bomb when it reads the header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    def write(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        header = chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0))
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\0" * 10)) + chunk(b"IEND", b""))
        return path

    return write


@pytest.fixture()
def interrupted_after_a_checkpoint(monkeypatch) -> Callable[[Callable[[], object]], None]:
    """``interrupted_after_a_checkpoint(train)`` runs ``train()`` until the training loop has written
    its first checkpoint, then stops it as Ctrl-C would; later calls train normally."""
    import edgetorch.training.checkpoint as checkpoints

    real_save = checkpoints.save

    def save_then_interrupt(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt

    def run(train: Callable[[], object]) -> None:
        monkeypatch.setattr(checkpoints, "save", save_then_interrupt)
        try:
            with pytest.raises(KeyboardInterrupt):
                train()
        finally:
            monkeypatch.setattr(checkpoints, "save", real_save)

    return run


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory) -> Path:
    """A folder of three classes, and zoo:mlp fine-tuned on it by `edgetorch finetune` (its record beside)."""
    from PIL import Image
    from typer.testing import CliRunner

    from edgetorch.cli import app
    from edgetorch.data import load_dataset
    from edgetorch.zoo import save_weights

    root = tmp_path_factory.mktemp("finetuned")
    digits = load_dataset("digits", "train", size=28)
    for label, name in enumerate(("one", "three", "two")):
        (root / "photos" / name).mkdir(parents=True)
        images = digits.tensors[0][digits.tensors[1] == (1, 3, 2)[label]][:10]
        for i, image in enumerate(images):
            Image.fromarray((image[0] * 255).round().byte().numpy()).save(root / "photos" / name / f"{i}.png")
    weights = root / "base.safetensors"
    save_weights(MLP(num_classes=10), weights)
    tuned = CliRunner().invoke(app, ["finetune", "--model", "zoo:mlp", "--weights", str(weights), "--data",
                                     str(root / "photos"), "--size", "28", "--epochs", "3", "--batch-size", "8",
                                     "--seed", "3", "--out", str(root / "run")])
    assert tuned.exit_code == 0, tuned.output
    return root
