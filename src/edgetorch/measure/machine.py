"""The record of where a measurement ran, stored next to every number edgetorch reports."""

from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path

import psutil
import torch


def machine_description() -> dict:
    """CPU, cores, memory, load, library versions, how the codec kernels were built, and date.

    Returns:
        A JSON-ready dict. The load average is recorded because the machines results come
        from may be shared; timings are only compared as ratios within one run.
    """
    import numpy
    import torchvision

    from ..codecs._cpu_kernels import build_description

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next(
            (line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")),
            cpu,
        )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_bytes": psutil.virtual_memory().total,
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torchvision": torchvision.__version__,
        "codec_kernels": build_description(),
        "numpy": numpy.__version__,
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
