"""edgetorch: train, shrink and deploy neural networks on memory- and energy-constrained devices."""

from .codecs import BitmapTensor, pack_bitmap

__all__ = ["BitmapTensor", "pack_bitmap"]
__version__ = "0.1.0"
