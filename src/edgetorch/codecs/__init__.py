"""How one tensor is stored: exact byte accounting, lossless and lossy codecs, CPU and GPU paths."""

from .bitmap import FLOAT_DTYPES, BitmapTensor, pack_bitmap

__all__ = ["BitmapTensor", "FLOAT_DTYPES", "pack_bitmap"]
