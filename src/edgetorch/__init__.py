"""edgetorch: train, shrink and deploy neural networks on memory- and energy-constrained devices."""

from .activations import Bitmap, CheckpointEvery, Dense, Policy, compress_activations, parse_policy
from .codecs import BitmapTensor, pack_bitmap
from .measure import SavedTensorLedger, model_memory

__all__ = [
    "Bitmap",
    "BitmapTensor",
    "CheckpointEvery",
    "Dense",
    "Policy",
    "SavedTensorLedger",
    "compress_activations",
    "model_memory",
    "pack_bitmap",
    "parse_policy",
]
__version__ = "0.1.0"
