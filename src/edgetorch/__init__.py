"""edgetorch: train, shrink and deploy neural networks on memory- and energy-constrained devices.

The public names below are imported on first use (PEP 562), not at ``import edgetorch``: the
package imports torch, which takes seconds, and ``edgetorch --help`` or a split device client
that needs only one subpackage should not pay for all of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    "BackRazor": "activations", "Bitmap": "activations", "CheckpointEvery": "activations",
    "Dense": "activations", "Policy": "activations", "Quantized": "activations", "compress_activations": "activations",
    "freeze_batchnorm": "activations", "parse_policy": "activations", "plan_memory": "activations",
    "GradientFidelity": "activations", "gradient_fidelity": "activations",
    "CapturedStep": "activations", "CaptureError": "activations", "capture_step": "activations",
    "BitmapTensor": "codecs", "pack_bitmap": "codecs",
    "load_dataset": "data",
    "SavedTensorLedger": "measure", "model_memory": "measure",
    "build_model": "zoo", "pretrained": "zoo",
    "InputFileError": "_files", "EdgetorchError": "errors",
}
__all__ = sorted(_EXPORTS)
_SUBPACKAGES = ("activations", "codecs", "data", "finetune", "integrations", "measure", "reduce", "split", "training", "zoo")

if TYPE_CHECKING:
    from .activations import (BackRazor, Bitmap, CapturedStep, CaptureError, CheckpointEvery, Dense, GradientFidelity,
                              Policy, Quantized, capture_step, compress_activations, freeze_batchnorm,
                              gradient_fidelity, parse_policy, plan_memory)
    from ._files import InputFileError
    from .codecs import BitmapTensor, pack_bitmap
    from .data import load_dataset
    from .errors import EdgetorchError
    from .measure import SavedTensorLedger, model_memory
    from .zoo import build_model, pretrained


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:  # `import edgetorch; edgetorch.split.load(...)`
        return importlib.import_module(f".{name}", __name__)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'edgetorch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBPACKAGES})
