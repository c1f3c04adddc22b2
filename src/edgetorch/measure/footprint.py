"""What ``import edgetorch`` and the first codec call cost a fresh process: resident memory and time.

A device with 2-4 GiB has little room for libraries: the first bitmap pack once loaded numba and
llvmlite, about 120 MiB, as much as the pack saved. This measures that cost the way a user meets it,
in a new interpreter that has imported only torch.
"""

from __future__ import annotations

import json
import subprocess
import sys

_FIRST_CALL = """
import json, time
from pathlib import Path

def rss():
    return next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmRSS:"))

import torch
x = torch.relu(torch.randn(1000))
base = rss()
start = time.perf_counter()
import edgetorch
imported = time.perf_counter()
y = edgetorch.pack_bitmap(x).unpack()
done = time.perf_counter()
assert torch.equal(y, x)
from edgetorch.codecs import _cpu_kernels
print(json.dumps({"rss_delta_bytes": rss() - base, "import_seconds": imported - start,
                  "first_call_seconds": done - imported, "native": _cpu_kernels.NATIVE}))
"""


def first_call_footprint(env: dict[str, str] | None = None) -> dict:
    """RSS added by ``import edgetorch`` plus one ``pack_bitmap``/``unpack``, over ``import torch``.

    Runs in a fresh interpreter (Linux: reads ``/proc/self/status``).

    Args:
        env: the child's environment (default: this process's).

    Returns:
        ``{"rss_delta_bytes", "import_seconds", "first_call_seconds", "native"}``.

    Example:
        >>> first_call_footprint()["rss_delta_bytes"] < 10 * 2**20
        True
    """
    done = subprocess.run([sys.executable, "-c", _FIRST_CALL], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the footprint worker failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
