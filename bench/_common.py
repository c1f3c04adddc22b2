"""Shared by the bench scripts: machine record, markdown tables, writing docs/results/NAME.{json,md}.

Every benchmark states where and when it ran, so a number is never read without its machine.
This module only defines helpers; running it does nothing.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from edgetorch.measure import machine_description

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "docs" / "results"
MIB = 2.0**20


def source_state() -> dict:
    """The commit measured, and library files that differed from it (the tree is shared and edited)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    # A copy of the tree sent to a lent GPU machine carries a stale .git (the session's first
    # commit): there BENCH_COMMIT names the commit the tree really is, and git is not asked.
    named = os.environ.get("BENCH_COMMIT")
    if named:
        return {"commit": named, "commit_from": "BENCH_COMMIT", "uncommitted_library_files": None}  # not checked
    return {
        "commit": git("rev-parse", "HEAD") or None,
        "uncommitted_library_files": git("status", "--porcelain", "--", "src").splitlines(),
    }


def revision_src(revision: str, into: str | Path) -> Path:
    """The library (``src``) of git ``revision``, extracted under ``into``: an older library to measure
    beside this one, in a process whose ``PYTHONPATH`` is the path returned."""
    archive = subprocess.run(["git", "archive", revision, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return Path(into) / "src"


def commit_text(source: dict) -> str:
    """A :func:`source_state` record for a results page: the short commit and whether the tree differed."""
    changes = source.get("uncommitted_library_files")
    state = (" (commit named by BENCH_COMMIT; uncommitted changes not checked)" if changes is None
             else " (with uncommitted library changes, listed in the JSON)" if changes else "")
    return f"{str(source['commit'])[:10]}{state}"


def machine_line(info: dict) -> str:
    """One human-readable line describing ``info`` (an ``edgetorch.measure.machine_description()`` record)."""
    gib = info["memory_bytes"] / 2**30
    gpu = f"GPU {info['cuda_device']}; " if info.get("cuda_device") else ""
    return (
        f"{gpu}{info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch threads), "
        f"{gib:.1f} GiB RAM; torch {info['torch']}, torchvision {info['torchvision']}, codecs: {info['codec_kernels']}, "
        f"Python {info['python']}"
    )


def log(message: str) -> None:
    """A progress line with the wall-clock time, flushed at once (benches run for minutes)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def mib(nbytes: float) -> str:
    """Bytes as MiB with two decimals (the unit of every memory table)."""
    return f"{nbytes / MIB:.2f}"


def pct(fraction: float) -> str:
    """A fraction as a percentage with one decimal."""
    return f"{100 * fraction:.1f}%"


def against_clone(times: dict[str, list[float]]) -> dict:
    """Interleaved timings of a codec bench as its JSON cell: median and minimum seconds of every
    variant, and clone's median over each other variant's (above 1: faster than copying the tensor)."""
    median = {name: statistics.median(ts) for name, ts in times.items()}
    return {"seconds": median, "min_seconds": {name: min(ts) for name, ts in times.items()},
            "ratio_to_clone": {k: median["clone"] / s for k, s in median.items() if k != "clone"}}


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], right: Sequence[int] = ()) -> str:
    """A GitHub markdown table; cells are rendered with ``str``, the columns numbered in ``right`` right-aligned."""
    rule = "|" + "".join("---:|" if i in right else "---|" for i in range(len(headers)))
    lines = ["| " + " | ".join(headers) + " |", rule]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(name: str, title: str, body: str, data: dict, script: str | None = None,
                  machine: str | None = None) -> tuple[Path, Path]:
    """Write ``docs/results/NAME.json`` and ``NAME.md`` and print the markdown.

    Args:
        name: file stem, also recorded as ``benchmark`` in the JSON.
        title: the markdown heading.
        body: markdown below the machine line (tables and notes).
        data: the raw results; machine, date and torch version are added to it.
        script: the command that wrote them, where it is not ``bench/NAME.py``.
        machine: where the numbers were measured, when not on this machine (results assembled
            here from another machine's output); replaces the machine line and record.

    Returns:
        The JSON and markdown paths.
    """
    info = machine_description() if machine is None else {"measured_on": machine}
    date = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    json_path, md_path = RESULTS_DIR / f"{name}.json", RESULTS_DIR / f"{name}.md"
    source = source_state()
    record = {"benchmark": name, "date": date, "machine": info, "source": source, **data}
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    markdown = (
        f"# {title}\n\n"
        f"Machine: {machine_line(info) if machine is None else machine}. Date: {date}. "
        f"Produced by `{script or f'bench/{name}.py'}` at commit {commit_text(source)}"
        f"; raw numbers in `{name}.json`.\n\n{body.strip()}\n"
    )
    md_path.write_text(markdown)
    print(markdown)
    return json_path, md_path


def timed_step(module: torch.nn.Module, scope, x: torch.Tensor, y: torch.Tensor, optimizer) -> float:
    """One forward (inside ``scope``), backward and optimizer step; returns its wall-clock seconds."""
    start = time.perf_counter()
    with scope:
        loss = torch.nn.functional.cross_entropy(module(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start
