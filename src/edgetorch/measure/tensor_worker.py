"""Fresh-process worker: measured memory of one tensor held dense, then held only bitmap-packed.

Run through :func:`edgetorch.measure.run_fresh` (which pins glibc's mmap threshold so freed
tensors leave the process): ``run_fresh("edgetorch.measure.tensor_worker", payload)`` with
``payload = {"shape": [16, 64, 56, 56], "nonzero_fraction": 0.25, "seed": 0}``.

Everything a first call loads (numba kernels, torch thread pools) is warmed up on a small tensor
before the baseline is taken, so the deltas hold only the tensor and its packed form.
"""

from __future__ import annotations

import gc
import json
import math
import sys

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


def _snapshot() -> tuple[int, int]:
    gc.collect()
    uss = uss_bytes()
    return (uss if uss is not None else -1), rss_bytes()


def measure_tensor(shape: tuple[int, ...], nonzero_fraction: float, seed: int = 0) -> dict:
    """Process memory of holding a tensor dense, and of holding only its packed form.

    Args:
        shape: tensor shape (float32).
        nonzero_fraction: share of non-zero elements, in [0, 1].
        seed: seed of the tensor's content.

    Returns:
        Bytes: ``dense_uss``/``dense_rss`` (growth while the dense tensor is held),
        ``packed_uss``/``packed_rss`` (growth once the dense tensor is deleted and only the
        packed form remains), ``pack_peak_rss`` (peak growth while packing, when both
        coexist), and the packed form's own accounting ``packed_nbytes`` and ``nnz``.
        -1 where the platform reports no USS or cannot reset the peak.
    """
    small = pack_bitmap(_sparse_tensor((2, 3, 32, 32), 0.5, seed))
    small.unpack()
    del small

    base_uss, base_rss = _snapshot()
    x = _sparse_tensor(shape, nonzero_fraction, seed)
    dense_uss, dense_rss = _snapshot()
    peak_resettable = reset_peak_rss()
    peak_base = rss_bytes()
    packed = pack_bitmap(x)
    pack_peak = peak_rss_bytes() - peak_base if peak_resettable else -1
    del x
    packed_uss, packed_rss = _snapshot()
    return {
        "dense_uss": dense_uss - base_uss if base_uss >= 0 else -1,
        "dense_rss": dense_rss - base_rss,
        "packed_uss": packed_uss - base_uss if base_uss >= 0 else -1,
        "packed_rss": packed_rss - base_rss,
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
