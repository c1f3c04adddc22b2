"""What :class:`~edgetorch.activations.compress_activations` says about a ``torch.compile``'d model."""

from __future__ import annotations

import warnings

import torch
from torch import nn


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is the wrapper ``torch.compile`` returns for a module."""
    return type(model).__name__ == "OptimizedModule"


def warn_compiled(watched: bool, saved_count: int) -> None:
    """Say what happened to a torch.compile'd model, which depends on the dispatch mode.

    Measured on torch 2.14 (tests/test_engine_corners.py checks it on the installed torch):
    with the dispatch mode that tells op roles (``watched``: BackRazor, or any policy with a
    ledger), dynamo runs the model eagerly, so compression works and compile is lost. Without
    it, the compiled graph runs and the tensors it saves reach the hooks as one opaque autograd
    Function's: they are stored losslessly, without per-op roles.

    Args:
        watched: whether the block ran the role dispatch mode.
        saved_count: the tensors the block saw saved.
    """
    if watched:
        what = ("its activations were compressed, but the model ran eagerly: torch.compile "
                "falls back to eager under the dispatch mode edgetorch uses to tell each op's "
                "role (BackRazor, or any policy with a ledger), so compile's speed is lost")
    else:
        what = ("the compiled graph ran and the tensors it saves for backward were compressed "
                "losslessly as one opaque function's, without per-op roles or deduplication")
    warnings.warn(
        f"compress_activations got a torch.compile'd model ({saved_count} saved tensors "
        f"seen, torch {torch.__version__}): {what}. Pass the uncompiled module for the "
        "documented behaviour.",
        stacklevel=3,
    )
