"""How one tensor is stored: exact byte accounting, lossless and lossy codecs, CPU and GPU paths."""

from .bitmap import FLOAT_DTYPES, BitmapTensor, pack_bitmap
from .protocol import HeldTensor
from .quantized import (QuantizedTensor, QuantizedValues, SidedQuantizedTensor, pack_quantized, pack_quantized_sided,
                        quantize_values)

__all__ = ["BitmapTensor", "FLOAT_DTYPES", "HeldTensor", "QuantizedTensor", "QuantizedValues", "SidedQuantizedTensor",
           "pack_bitmap", "pack_quantized", "pack_quantized_sided", "quantize_values"]
