"""Fresh-process worker: measured memory of one tensor held dense, then held only bitmap-packed.

Run through :func:`edgetorch.measure.run_fresh` (which pins glibc's mmap threshold so freed
tensors leave the process): ``run_fresh("edgetorch.measure.tensor_worker", payload)`` with
``payload = {"shape": [16, 64, 56, 56], "nonzero_fraction": 0.25, "seed": 0}``.

Everything a first call loads (the codec extension, its worker threads) is warmed up on another
tensor before the baseline is taken, so the deltas hold only the tensor and its packed form.
"""

from __future__ import annotations

import gc
import json
import math
import sys
from pathlib import Path

import torch

from edgetorch.codecs import pack_bitmap
from edgetorch.measure.process import peak_rss_bytes, reset_peak_rss, rss_bytes, uss_bytes


def _sparse_tensor(shape: tuple[int, ...], nonzero_fraction: float, seed: int) -> torch.Tensor:
    """A float32 tensor with exactly ``floor(nonzero_fraction * numel)`` non-zeros at random places.

    Args:
        shape: tensor shape.
        nonzero_fraction: share of non-zero elements, in [0, 1].
        seed: seed of the positions and values.

    Returns:
        The tensor; non-zero values are positive, like a ReLU output.
    """
    if not 0.0 <= nonzero_fraction <= 1.0:
        raise ValueError(f"nonzero_fraction must be in [0, 1], got {nonzero_fraction!r}")
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    nnz = int(nonzero_fraction * n)
    x = torch.zeros(n)
    x[torch.randperm(n, generator=g)[:nnz]] = torch.rand(nnz, generator=g) + 0.01
    return x.view(shape)


def _anon_bytes() -> int | None:
    """Anonymous memory mapped in (Linux): unlike USS, blind to library pages being reclaimed."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _snapshot() -> dict[str, int | None]:
    gc.collect()
    return {"uss": uss_bytes(), "rss": rss_bytes(), "anon": _anon_bytes()}


def _growth(now: dict[str, int | None], base: dict[str, int | None], prefix: str) -> dict[str, int]:
    return {
        f"{prefix}_{kind}": now[kind] - base[kind] if base[kind] is not None else -1
        for kind in ("uss", "rss", "anon")
    }


def measure_tensor(shape: tuple[int, ...], nonzero_fraction: float, seed: int = 0) -> dict:
    """Process memory of holding a tensor dense, and of holding only its packed form.

    Args:
        shape: tensor shape (float32).
        nonzero_fraction: share of non-zero elements, in [0, 1].
        seed: seed of the tensor's content.

    Returns:
        Bytes: ``dense_{uss,rss,anon}`` (growth while the dense tensor is held),
        ``packed_{uss,rss,anon}`` (growth once the dense tensor is deleted and only the packed
        form remains), ``pack_peak_rss`` (peak growth while packing, when both coexist), and
        the packed form's own accounting ``packed_nbytes`` and ``nnz``. USS is the paper's
        measure; under memory pressure the kernel may drop this process's clean library pages,
        which lowers USS but not ``anon``. -1 where the platform does not report a quantity.
    """
    # Big enough that the codec starts its worker threads: their stacks are not the tensor's.
    warm = pack_bitmap(_sparse_tensor((16, 64, 32, 32), 0.5, seed))
    warm.unpack()
    del warm

    base = _snapshot()
    x = _sparse_tensor(shape, nonzero_fraction, seed)
    dense = _snapshot()
    peak_resettable = reset_peak_rss()
    peak_base = rss_bytes()
    packed = pack_bitmap(x)
    pack_peak = peak_rss_bytes() - peak_base if peak_resettable else -1
    del x
    return {
        **_growth(dense, base, "dense"),
        **_growth(_snapshot(), base, "packed"),
        "pack_peak_rss": pack_peak,
        "packed_nbytes": packed.nbytes,
        "nnz": packed.nnz,
    }


def main() -> None:
    """Read the payload as JSON from stdin, print the result as one JSON line."""
    payload = json.loads(sys.stdin.read())
    shape = tuple(payload["shape"])
    print(json.dumps(measure_tensor(shape, payload["nonzero_fraction"], payload.get("seed", 0))))


if __name__ == "__main__":
    main()
