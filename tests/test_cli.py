"""The root command: start-up without torch, --version, and the lazy top-level package."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_help_and_version_never_import_torch():
    # Importing torch takes seconds; `edgetorch --help` must answer in well under 0.5 s.
    code = ("import sys; from typer.testing import CliRunner; from edgetorch.cli import app; "
            "r = CliRunner(); h = r.invoke(app, ['--help']); s = r.invoke(app, ['split', 'export', '--help']); "
            "v = r.invoke(app, ['--version']); "
            "print(h.exit_code, s.exit_code, v.exit_code, v.output.strip(), 'torch' in sys.modules)")
    assert _run(code).split() == ["0", "0", "0", "edgetorch", "0.1.0", "False"]


def test_public_names_load_on_first_use():
    code = ("import sys, edgetorch; print('torch' in sys.modules); "
            "from edgetorch import Bitmap, build_model; print(Bitmap.__name__, 'Bitmap' in dir(edgetorch)); "
            "print(sorted(edgetorch.__all__) == edgetorch.__all__ and all(hasattr(edgetorch, n) for n in edgetorch.__all__))")
    assert _run(code).split() == ["False", "Bitmap", "True", "True"]
    assert _run("import edgetorch; print(edgetorch.split.load.__name__)").strip() == "load"
    missing = subprocess.run([sys.executable, "-c", "import edgetorch; edgetorch.nope"], capture_output=True, text=True)
    assert "has no attribute 'nope'" in missing.stderr
