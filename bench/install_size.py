"""What `pip install edgetorch` adds to a device beyond torch, torchvision and numpy, and what each extra adds.

Each set is installed with pip into an empty ``--target`` folder (from the package registry, the
way a user's pip resolves it), then measured on disk; torch, torchvision, numpy and Pillow (a
torchvision dependency) are left out of every count, since a device has them for PyTorch itself.
edgetorch's own wheel (built here, with its compiled codecs) is counted in the core. "0.1.0's core"
is the dependency list before the extras split (issue 28, item 10), for comparison.

Run: python bench/install_size.py   (about 2 minutes; needs the package registry)
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from _common import log, table, write_results

ROOT = Path(__file__).resolve().parent.parent
#: What a device already has for PyTorch: never counted (names as installed folders start).
PYTORCH_ITSELF = {"torch", "torchvision", "numpy", "pillow", "triton", "sympy", "mpmath", "networkx", "jinja2",
                  "markupsafe", "filelock", "fsspec", "typing_extensions", "setuptools"}
BEFORE_SPLIT = ["psutil>=5.9", "typer>=0.9", "rich>=13", "matplotlib>=3.7", "safetensors>=0.4", "scikit-learn>=1.3",
                "scipy>=1.10", "fastapi>=0.110", "uvicorn>=0.27", "httpx>=0.27"]
TARGET_MIB = 40


def _is_pytorch_itself(entry: Path) -> bool:
    # "torch", "torch-2.14.1.dist-info", "numpy.libs", "nvidia_cudnn_cu13-..." but not "torch_pruning".
    base = re.split(r"[-.]", entry.name.lower())[0]
    return base in PYTORCH_ITSELF or base.startswith(("nvidia", "cuda"))


def _size(folder: Path) -> tuple[int, list[str]]:
    counted = [entry for entry in folder.iterdir() if not _is_pytorch_itself(entry) and entry.name != "bin"]
    total = sum(f.stat().st_size for entry in counted for f in ([entry] if entry.is_file() else entry.rglob("*"))
                if f.is_file() and not f.is_symlink())
    packages = sorted(e.name.split("-")[0] for e in counted if e.name.endswith(".dist-info"))
    return total, packages


def _install(requirements: list[str], into: Path) -> None:
    # torch, torchvision and numpy are what the device already has: never resolved here.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-warn-conflicts", "--target", str(into),
                    *requirements], check=True)


def _without_pytorch(requirements: list[str]) -> list[str]:
    return [r for r in requirements if not r.lower().startswith(("torch>", "torch=", "torchvision", "numpy"))]


def main() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core, extras = _without_pytorch(project["dependencies"]), project["optional-dependencies"]
    rows, data = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        wheel_dir = Path(tmp) / "wheel"
        log("building edgetorch's wheel")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheel_dir), str(ROOT)],
                       check=True)
        wheel = next(wheel_dir.glob("edgetorch-*.whl"))
        sets = {"core (pip install edgetorch)": [str(wheel), *core],
                "0.1.0's core, before the extras": [str(wheel), *BEFORE_SPLIT]}
        for extra in ("plot", "data", "reduce", "server", "onnx"):
            sets[f"extra [{extra}] alone"] = _without_pytorch(extras[extra])
        for label, requirements in sets.items():
            into = Path(tmp) / str(len(data))
            log(f"installing {label}")
            # edgetorch's own wheel without its dependencies: they are the rest of the list.
            if requirements and requirements[0] == str(wheel):
                _install(["--no-deps", requirements[0]], into)
                requirements = requirements[1:]
            _install(requirements, into)
            size, packages = _size(into)
            data[label] = {"bytes": size, "packages": packages}
            rows.append([label, f"{size / 2**20:,.1f}", str(len(packages)), ", ".join(packages)])
        native = next(p for p in (Path(tmp) / "0" / "edgetorch" / "codecs").glob("_native*.so"))
        data["native_extension_bytes"] = native.stat().st_size
    core_mib = data["core (pip install edgetorch)"]["bytes"] / 2**20
    body = (table(["install", "MiB on disk beyond torch, torchvision, numpy", "packages", "which"], rows, right=[1, 2])
            + f"\n\nThe core adds {core_mib:,.1f} MiB (target: at most {TARGET_MIB} MiB): "
            + ("met" if core_mib <= TARGET_MIB else "MISSED")
            + f". edgetorch's compiled codecs take {data['native_extension_bytes'] / 2**20:,.2f} MiB of it (stripped)."
            + "\n\nPillow and torch's own dependencies (sympy, networkx, jinja2, filelock, fsspec, triton and the CUDA "
            "libraries of a CUDA build) come with torch and torchvision and are left out of every row.")
    write_results("install_size", "Install size: the core and each extra", body,
                  {"sets": data, "target_mib": TARGET_MIB, "core_mib": core_mib})


if __name__ == "__main__":
    main()
