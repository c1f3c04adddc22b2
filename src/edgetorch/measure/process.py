"""Measured process memory: what the operating system (or the CUDA allocator) says, not formulas.

On Linux the peak resident set (VmHWM) can be reset by writing ``5`` to ``/proc/self/clear_refs``,
so one step's peak can be read without the import-time peak hiding it. USS (memory unique to the
process, freed if it exited) is the paper's measure; it comes from psutil (``/proc/self/smaps``).

glibc keeps freed heap memory mapped once its mmap threshold has adapted upward, which makes
RSS lag behind what is live. :data:`HONEST_MALLOC_ENV` pins the threshold so every large tensor
is its own mapping and RSS follows live memory; :func:`run_fresh` starts workers with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil

HONEST_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return psutil.Process().memory_info().rss


def uss_bytes() -> int | None:
    """Current unique set size of this process, or None where the platform does not report it."""
    try:
        return psutil.Process().memory_full_info().uss
    except (psutil.AccessDenied, AttributeError):
        return None


def peak_rss_bytes() -> int:
    """Peak resident set size since process start or the last :func:`reset_peak_rss`."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


_peak_before_resets = 0  # the largest VmHWM a reset has discarded, for process_peak_rss_bytes


def reset_peak_rss() -> bool:
    """Reset the peak RSS counter (Linux only). Returns False where it cannot be reset.

    The peak it discards is kept for :func:`process_peak_rss_bytes`.
    """
    global _peak_before_resets
    _peak_before_resets = max(_peak_before_resets, peak_rss_bytes())
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def process_peak_rss_bytes() -> int:
    """Peak resident set size since the process started, across every :func:`reset_peak_rss`.

    What ``/usr/bin/time`` or a cgroup limit sees, up to now. (They also see interpreter
    shutdown, which with torch 2.14 alone raises the peak by about 125 MiB on Linux, after any
    code could measure it: ``python -c "import torch"`` peaks at 632 MiB on exit against 508 MiB
    while running, measured on the project's 2-core machine.)
    """
    return max(_peak_before_resets, peak_rss_bytes())


def held_bytes(device) -> int:
    """What a step's peak is measured against, now: the CUDA allocator's allocated bytes on a GPU
    (host RSS says nothing about GPU memory), resident memory on the CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return rss_bytes()


_cuda_peak_before_resets: dict[int, int] = {}  # by GPU index: what reset_peak discarded, for process_peak_bytes


def _gpu(device) -> int:
    import torch

    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def reset_peak(device) -> None:
    """Start a new peak for :func:`peak_bytes` (the CUDA allocator's, or VmHWM on the CPU).

    The peak it discards is kept for :func:`process_peak_bytes`.
    """
    if device.type == "cuda":
        import torch

        gpu = _gpu(device)
        _cuda_peak_before_resets[gpu] = max(_cuda_peak_before_resets.get(gpu, 0), torch.cuda.max_memory_allocated(gpu))
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def process_peak_bytes(device) -> int:
    """The peak since the process started (or :func:`restart_peaks`), across every :func:`reset_peak`,
    in the unit of :func:`held_bytes`: the CUDA allocator's allocated bytes on a GPU, resident memory
    on the CPU (:func:`process_peak_rss_bytes`). What a run is held to when a budget covers it whole,
    planning included.
    """
    if device.type == "cuda":
        return max(_cuda_peak_before_resets.get(_gpu(device), 0), peak_bytes(device))
    return process_peak_rss_bytes()


def restart_peaks(device) -> None:
    """Forget every peak so far: :func:`process_peak_bytes` counts from now. For several independent
    runs measured one after another in one process, each after freeing what the last one held (on a
    CPU, memory the allocator keeps mapped still counts; a fresh process is the cleaner measure there).
    """
    global _peak_before_resets
    if device.type == "cuda":
        import torch

        _cuda_peak_before_resets.pop(_gpu(device), None)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _peak_before_resets = 0
        reset_peak_rss()


def peak_bytes(device) -> int:
    """The peak since :func:`reset_peak`, in the unit of :func:`held_bytes`."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


def peak_kind(device) -> str:
    """What :func:`peak_bytes` reads: ``"cuda_max_allocated"`` or ``"peak_rss"``."""
    return "cuda_max_allocated" if device.type == "cuda" else "peak_rss"


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers, from glibc's malloc.h


def _glibc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None or not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def honest_malloc() -> bool:
    """In this process, what :data:`HONEST_MALLOC_ENV` does for a fresh one: large allocations get
    their own mappings and freed heap is returned, so RSS follows live memory from now on.

    For measuring in a process that is already running (the memory planner), where the
    environment variables come too late: glibc reads them at start-up, ``mallopt`` changes the
    same settings at any time. Then :func:`release_freed` before each measurement.

    Returns:
        False where the C library is not glibc (the settings do not exist; RSS may lag).
    """
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(HONEST_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]))
                and libc.mallopt(_M_TRIM_THRESHOLD, int(HONEST_MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"])))


@contextlib.contextmanager
def frozen_old_objects() -> Iterator[None]:
    """Within the block, a garbage collection scans only the objects created in it.

    One full collection first, then ``gc.freeze()``: what is alive then (torch's and the caller's
    objects) is left out of every collection until the block ends. The memory planner collects
    before each of its ~40 measured steps: planning ``zoo:cnn`` at batch 4 with the default
    policies in a process that imported the CLI (336,000 objects) took 13.7-16.8 s, 12.0-12.5 s of
    it collecting, and 1.8-2.0 s with this, 0.3 s collecting (idle 2-core machine, two runs each,
    alternated). Cyclic garbage among the frozen objects waits for the block's end; garbage created in
    the block is collected as usual. A caller that froze objects itself keeps them frozen (the block
    then freezes nothing).

    Example:
        >>> with frozen_old_objects():
        ...     release_freed()  # fast: only what the block created is scanned
    """
    import gc

    if gc.get_freeze_count():  # someone else's freeze: unfreezing at the end would undo it
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def release_freed() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``), so the
    next RSS reading starts from what is live."""
    import gc

    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def run_fresh(module: str, payload: dict, timeout: float | None = None) -> dict:
    """Run ``python -m module`` in a fresh interpreter, feeding ``payload`` as JSON on stdin
    (for a path ending in ``.py``, ``python SCRIPT --worker``: a script's own worker mode).

    The worker prints one JSON object as its last line of stdout; that object is returned.
    A fresh process is the only honest way to compare peaks: allocator caches, imported
    libraries and an earlier policy's peak would otherwise leak into the next measurement.

    Raises:
        RuntimeError: the worker failed; the message carries its stderr.
    """
    env = {**os.environ, **HONEST_MALLOC_ENV}
    proc = subprocess.run(
        [sys.executable, module, "--worker"] if module.endswith(".py") else [sys.executable, "-m", module],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker {module} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if not lines:
        raise RuntimeError(f"worker {module} printed no result; stderr:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])
