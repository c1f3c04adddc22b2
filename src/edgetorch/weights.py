"""Safe model weight files: safetensors, or PyTorch files loaded with ``weights_only=True``.

Nothing here unpickles arbitrary objects. Loading is strict: every key the model expects must
be present with the same shape, and no extra keys are accepted; the error names the offending
keys rather than leaving a model half loaded.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors, load_file, save_file
from torch import nn

from ._files import InputFileError, open_regular, read_torch

SAFETENSORS_SUFFIX = ".safetensors"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_SHOWN = 5  # how many offending keys an error lists
MAX_WEIGHTS_BYTES = 8 << 30  # a weight file larger than this is refused before it is read


class CheckpointError(InputFileError):
    """A weight file is unreadable, corrupted, or does not match the model it is loaded into."""


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (streamed, so large files are not read into memory).

    Args:
        path: file to hash.

    Returns:
        The 64-character lowercase hex digest.
    """
    digest = hashlib.sha256()
    with open_regular(path, MAX_WEIGHTS_BYTES, error=CheckpointError) as f:  # a FIFO would block open()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_weights(model: nn.Module, path: str | Path) -> str:
    """Write ``model.state_dict()`` as safetensors, atomically (temp file, then rename).

    Args:
        model: the model to save (tensors are copied to CPU, contiguous).
        path: destination, normally ending in ``.safetensors``.

    Returns:
        The SHA-256 of the written file, for integrity checks on reload.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    # A unique temp name per process so concurrent writers never interleave bytes.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(state, str(tmp))
    digest = file_sha256(tmp)
    os.replace(tmp, path)
    return digest


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == SAFETENSORS_SUFFIX:
        # The header's offsets are checked against the file by safetensors, so a tensor can
        # claim no more bytes than the file has; open_regular refuses FIFOs and oversized files.
        open_regular(path, MAX_WEIGHTS_BYTES, error=CheckpointError).close()
        try:
            state = load_file(str(path))
        except (SafetensorError, OSError, KeyError) as exc:  # KeyError: a dtype torch lacks (F4, ...)
            raise CheckpointError(f"{path}: not a safetensors file ({exc})") from None
    elif path.suffix in TORCH_SUFFIXES:
        state = _torch_state(path)
    else:
        accepted = ", ".join((SAFETENSORS_SUFFIX, *TORCH_SUFFIXES))
        raise CheckpointError(f"{path}: unknown weight file suffix {path.suffix!r}; accepted: {accepted}")
    for name, tensor in state.items():
        # A tensor whose elements overlap in a smaller storage (stride 0, as from expand) is a few
        # bytes in the file but as large as its shape says once copied: a 1.6 KB file cost 2.7 GB.
        if tensor.numel() * tensor.element_size() > tensor.untyped_storage().nbytes():
            raise CheckpointError(f"{path}: tensor {name} {list(tensor.shape)} is a view into a smaller "
                                  "storage (overlapping elements); weight files must hold every element")
    return state


def _torch_state(path: Path) -> dict[str, torch.Tensor]:
    state = read_torch(path, MAX_WEIGHTS_BYTES, error=CheckpointError)
    if not isinstance(state, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in state.items()):
        raise CheckpointError(f"{path}: expected a state dict (str -> tensor mapping)")
    return dict(state)


def _listed(keys: list[str]) -> str:
    more = f" (+{len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a weight file's tensors without loading them into a model.

    Args:
        path: a ``.safetensors`` file, or a ``.pt``/``.pth``/``.bin`` state dict (read with
            ``torch.load(weights_only=True)``).

    Returns:
        The state dict.

    Raises:
        CheckpointError: no such file (or a directory), or an unreadable file.
    """
    path = Path(path)
    if path.is_dir() or not path.exists():  # other non-files (a FIFO) are refused by open_regular
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise CheckpointError(
            f"weight file {path} {what} (a local .safetensors/.pt/.pth/.bin file is "
            "expected; named pretrained weights are never downloaded)"
        )
    return _read_state(path)


def load_weights(model: nn.Module, path: str | Path, state: Mapping[str, torch.Tensor] | None = None,
                 assign: bool = False) -> nn.Module:
    """Load a weight file into ``model`` with a strict key and shape check.

    Args:
        model: the model to fill (modified in place).
        path: a ``.safetensors`` file, or a ``.pt``/``.pth``/``.bin`` state dict (read with
            ``torch.load(weights_only=True)``).
        state: the file's tensors when already read with :func:`read_weights` (``path`` then
            only names it in errors).
        assign: put the file's tensors in the model instead of copying them into its own (a
            model built on the meta device has none); the dtypes must then match too, since
            nothing converts them.

    Returns:
        ``model``, for chaining.

    Raises:
        CheckpointError: no such file (or a directory), unreadable file, or missing / unexpected keys or shape
            (with ``assign``, dtype) mismatches (the message names them).
    """
    path = Path(path)
    state = read_weights(path) if state is None else state
    expected = model.state_dict()
    problems = []
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [
        f"{k} (file {list(state[k].shape)}, model {list(v.shape)})"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    retyped = [f"{k} (file {state[k].dtype}, model {v.dtype})" for k, v in expected.items()
               if assign and k in state and state[k].dtype != v.dtype]
    if missing:
        problems.append("missing keys: " + _listed(missing))
    if unexpected:
        problems.append("unexpected keys: " + _listed(unexpected))
    if mismatched:
        problems.append("shape mismatch: " + _listed(mismatched))
    if retyped:
        problems.append("dtype mismatch: " + _listed(retyped))
    if problems:
        raise CheckpointError(
            f"{path} does not match {type(model).__name__}: " + "; ".join(problems)
        )
    model.load_state_dict(state, strict=True, assign=assign)
    return model


def tensors_from_bytes(data: bytes, path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file already read (within a size limit, with :mod:`edgetorch._files`).

    Args:
        data: the file's bytes.
        path: names the file in errors.

    Raises:
        CheckpointError: not a safetensors file.
    """
    try:
        return load_safetensors(data)
    # KeyError: safetensors.torch has no torch dtype for some dtypes its parser accepts (F4,
    # F6_E2M3, F8_E8M0), e.g. in a zero-element tensor.
    except (SafetensorError, ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"{path}: not a safetensors file ({exc})") from None
