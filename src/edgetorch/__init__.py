"""edgetorch: train, shrink and deploy neural networks on memory- and energy-constrained devices."""

from .activations import (
    BackRazor,
    Bitmap,
    CheckpointEvery,
    Dense,
    Policy,
    compress_activations,
    freeze_batchnorm,
    parse_policy,
)
from .codecs import BitmapTensor, pack_bitmap
from .data import load_dataset
from .measure import SavedTensorLedger, model_memory
from .zoo import build_model, pretrained

__all__ = [
    "BackRazor",
    "Bitmap",
    "BitmapTensor",
    "CheckpointEvery",
    "Dense",
    "Policy",
    "SavedTensorLedger",
    "build_model",
    "compress_activations",
    "freeze_batchnorm",
    "load_dataset",
    "model_memory",
    "pack_bitmap",
    "parse_policy",
    "pretrained",
]
__version__ = "0.1.0"
