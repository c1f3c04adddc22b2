"""edgetorch: train, shrink and deploy neural networks on memory- and energy-constrained devices."""

from .activations import Bitmap, CheckpointEvery, Dense, Policy, compress_activations, parse_policy
from .codecs import BitmapTensor, pack_bitmap
from .data import load_dataset
from .measure import SavedTensorLedger, model_memory
from .zoo import build_model, pretrained

__all__ = [
    "Bitmap",
    "BitmapTensor",
    "CheckpointEvery",
    "Dense",
    "Policy",
    "SavedTensorLedger",
    "build_model",
    "compress_activations",
    "load_dataset",
    "model_memory",
    "pack_bitmap",
    "parse_policy",
    "pretrained",
]
__version__ = "0.1.0"
