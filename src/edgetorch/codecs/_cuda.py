"""Which kernels the codecs use on a GPU: Triton (``_triton``) when it imports, torch ops otherwise.

Triton comes with torch's CUDA builds, so on a CUDA machine it is normally there; the torch-ops
path (``bitmap.pack_torch`` and friends) stays as the reference and the fallback, with host
syncs (boolean indexing, ``nonzero``) the kernels avoid. ``EDGETORCH_NO_TRITON=1``, set before
edgetorch is imported, chooses torch ops. ``triton`` is imported on first use, never by
``import edgetorch``.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

_FORCED_OFF = os.environ.get("EDGETORCH_NO_TRITON", "").strip() not in ("", "0")


@functools.cache
def _load():
    if _FORCED_OFF:
        return None
    try:
        from . import _triton

        # One tiny launch: Triton builds its launcher with a C compiler and needs a GPU it can
        # generate code for (compute capability 7.0+); either can fail only when first used.
        _triton.pack_bitmap(torch.zeros(16, dtype=torch.int32, device="cuda"), 0)
    except Exception as exc:  # noqa: BLE001 - any failure means: use torch ops
        warnings.warn(
            f"edgetorch's Triton codec kernels are not available ({type(exc).__name__}: {exc}); on "
            "CUDA the bitmap, top-k and mask codecs use torch ops, which give the same bytes but "
            "synchronise with the host on every tensor and run several times slower. Install "
            "triton (it ships with torch's CUDA wheels) to fix it; EDGETORCH_NO_TRITON=1 chooses "
            "torch ops without this warning.",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    return _triton


def kernels(t: torch.Tensor):
    """The Triton kernel module for a CUDA tensor ``t``, or None (CPU tensors, or no Triton)."""
    return _load() if t.is_cuda else None
