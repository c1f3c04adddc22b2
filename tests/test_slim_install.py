"""A core install (no extras) runs what a device does, and a command that needs an extra says which.

Issue 28, item 10: `pip install edgetorch` pulled scipy, matplotlib, scikit-learn and a web server
(327 MiB beyond torch). The extras' packages are hidden from a child process here, as if never
installed (imports fail, ``importlib.util.find_spec`` finds nothing), and the device's jobs run in
it: fine-tune a folder under a memory budget, export a split head, run the client against a
server. The install's size is measured by ``bench/install_size.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from edgetorch._extras import EXTRAS

# Run as the child's first code: every module of an extra is absent.
HIDE_EXTRAS = f"""
import builtins, importlib.util, sys
hidden = {sorted(EXTRAS)!r}
real_import, real_find_spec = builtins.__import__, importlib.util.find_spec
def absent(name):
    return name.split(".")[0] in hidden
def hiding_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and absent(name):
        raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
    return real_import(name, globals, locals, fromlist, level)
def hiding_find_spec(name, package=None):
    return None if absent(name) else real_find_spec(name, package)
builtins.__import__, importlib.util.find_spec = hiding_import, hiding_find_spec
from edgetorch.cli import app
app(sys.argv[1:], prog_name="edgetorch")
"""


def _core(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE_EXTRAS, *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "200", **(env or {})})


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    generator = torch.Generator().manual_seed(0)
    for name in ("cat", "dog"):
        (folder / name).mkdir()
        for i in range(6):
            pixels = torch.randint(0, 256, (40, 40, 3), generator=generator, dtype=torch.uint8)
            Image.fromarray(pixels.numpy()).save(folder / name / f"{i}.png")
    return folder


@pytest.mark.slow  # three commands in fresh processes, each importing torch
def test_a_device_fine_tunes_exports_a_head_and_infers_with_no_extra_installed(photos, tmp_path):
    from edgetorch.split.artifact import load_part
    from edgetorch.split.protocol import serve_in_background
    from edgetorch.split.server import create_app
    from edgetorch.zoo import build_model, save_weights

    save_weights(build_model("zoo:cnn"), tmp_path / "cnn.safetensors")
    tuned = _core("finetune", "--model", "zoo:cnn", "--weights", tmp_path / "cnn.safetensors", "--data", photos,
                  "--size", "28", "--epochs", "1", "--batch-size", "4", "--memory-budget", "8GiB",
                  "--policy", "dense", "--policy", "bitmap", "--out", tmp_path / "run")  # two candidates: the same path
    assert tuned.returncode == 0, tuned.stdout + tuned.stderr
    assert (tmp_path / "run" / "model.safetensors").is_file() and "within the budget" in tuned.stdout

    exported = _core("split", "export", "--model", "torchvision:resnet18", "--channels", "3", "--random-init",
                     "--size", "32", "--num-classes", "2", "--out", tmp_path / "artifact")
    assert exported.returncode == 0, exported.stdout + exported.stderr

    tail, manifest = load_part(tmp_path / "artifact", "tail")
    with serve_in_background(create_app(tail, manifest)) as url:  # the server: this process, every extra
        answered = _core("split", "infer", tmp_path / "artifact", photos / "cat" / "0.png", "--server", url)
    assert answered.returncode == 0, answered.stdout + answered.stderr
    assert "0.png:" in answered.stdout and "payload" in answered.stdout


@pytest.mark.parametrize("args, hint", [
    (["reduce", "--model", "zoo:mlp", "--alpha", "0.5"], "pip install 'edgetorch[reduce]'"),
    (["finetune", "--model", "zoo:cnn", "--data", "digits", "--epochs", "1"], "pip install 'edgetorch[data]'"),
    (["split", "serve", "artifact"], "pip install 'edgetorch[server]'"),
    (["profile", "--model", "zoo:cnn", "--plot", "plot.png"], "pip install 'edgetorch[plot]'"),
])
def test_a_command_that_needs_an_extra_names_it_without_a_traceback(args, hint, tmp_path):
    if args[:2] == ["split", "serve"]:
        from edgetorch.split.export import save
        from edgetorch.split.bottleneck import inject_bottleneck
        from edgetorch.zoo import build_model

        save(inject_bottleneck(build_model("torchvision:resnet18", num_classes=2), 3, "sp2"), tmp_path / "artifact", 32)
    refused = subprocess.run([sys.executable, "-c", HIDE_EXTRAS, *args], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path, env={**os.environ, "COLUMNS": "200", "EDGETORCH_CACHE": str(tmp_path)})
    said = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode in (1, 2) and hint in said and "Traceback" not in said, said
