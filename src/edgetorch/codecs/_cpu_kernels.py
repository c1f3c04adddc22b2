"""CPU kernels for bitmap packing (placeholder: torch ops until the native kernel lands)."""

from __future__ import annotations

import torch

from .bitmap import pack_torch, unpack_torch


def pack(bits: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pack_torch(bits, limit)


def unpack(bitmap: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    return unpack_torch(bitmap, values, numel)
