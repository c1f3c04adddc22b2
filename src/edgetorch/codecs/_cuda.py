"""Which kernels the codecs use on a GPU: Triton (``_triton``) when it imports, torch ops otherwise.

Triton comes with torch's CUDA builds, so on a CUDA machine it is normally there; the torch-ops
path (``bitmap.pack_torch`` and friends) stays as the reference and the fallback, with host
syncs (boolean indexing, ``nonzero``) the kernels avoid. ``EDGETORCH_NO_TRITON=1``, set before
edgetorch is imported, chooses torch ops. ``triton`` is imported on first use, never by
``import edgetorch``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator

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
        _triton.pack_bitmap(torch.zeros(16, dtype=torch.int32, device="cuda"), 0)  # checks direct launches too
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


def gpu_path(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the GPU code path: the codecs' kernels, and policies that never read a
    value back to the host in the forward."""
    return t.is_cuda or _emulated


def untracked(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels read it: detached only if autograd tracks it. The engine hands the
    codecs detached tensors, and on a GPU host each torch call (a detach included) costs
    microseconds for every saved tensor of every step."""
    return t.detach() if t.requires_grad else t


_emulated = False


@contextlib.contextmanager
def emulate_gpu_path() -> Iterator[None]:
    """Run the GPU code path on CPU tensors: every tensor takes the Triton kernels (through
    Triton's interpreter, so ``TRITON_INTERPRET=1`` must be set before they are first imported)
    and the policies' GPU branches. For tests on machines without a GPU: what the GPU path reads
    back to the host, and how many kernels it launches, can be counted on the CPU.
    """
    from . import _backend

    # The table is the codecs' and the policies' only question (the policies ask its CPU entry
    # only off the GPU path, after ``gpu_path``).
    global _emulated
    cpu, _emulated = _backend.CPU, True
    _backend.CPU = _backend.triton()  # CPU tensors to the Triton column
    try:
        yield
    finally:
        _emulated, _backend.CPU = False, cpu
