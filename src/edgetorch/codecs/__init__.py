"""How one tensor is stored: exact byte accounting, lossless and lossy codecs, CPU and GPU paths."""

from .bitmap import FLOAT_DTYPES, BitmapTensor, pack_bitmap
from .quantized import QuantizedTensor, QuantizedValues, pack_quantized, quantize_values

__all__ = ["BitmapTensor", "FLOAT_DTYPES", "QuantizedTensor", "QuantizedValues", "pack_bitmap", "pack_quantized",
           "quantize_values"]
