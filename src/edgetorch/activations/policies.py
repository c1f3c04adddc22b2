"""Policies: how each tensor autograd saves for backward is stored. Subclass :class:`Policy` to add one."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..codecs import FLOAT_DTYPES, pack_bitmap
from ..codecs.bitmap import BitmapTensor, zero_limit_bits


class Policy:
    """Base class: decide the stored form of one saved floating-point tensor.

    The engine (:func:`edgetorch.compress_activations`) has already left parameters, buffers,
    model inputs, integer/bool and tiny tensors alone, and removed duplicates; a policy only
    sees tensors worth encoding. ``encode`` returns an object with ``.nbytes`` and
    ``.unpack()``, or None to keep the tensor as it is.
    """

    name = "policy"

    def encode(self, t: torch.Tensor) -> BitmapTensor | None:
        raise NotImplementedError

    def spec(self) -> str:
        """The string :func:`parse_policy` turns back into this policy."""
        args = ",".join(
            f"{f.name}={_fmt(getattr(self, f.name))}"
            for f in fields(self)
            if getattr(self, f.name) != f.default
        )
        return f"{self.name}:{args}" if args else self.name


@dataclass(frozen=True)
class Dense(Policy):
    """Plain PyTorch: keep every saved tensor as is (the baseline; still fills the ledger)."""

    name = "dense"

    def encode(self, t: torch.Tensor) -> None:
        return None


@dataclass(frozen=True)
class Bitmap(Policy):
    """BitTrain: bitmap of non-zeros + packed values (Hosny et al., SEC'21).

    Args:
        threshold: activation pruning: saved values with ``|v| <= threshold`` are stored as 0
            (the paper's Fig. 9/10). 0 is lossless.
        value_dtype: store the values as ``torch.float16`` / ``torch.bfloat16`` (the paper's
            Fig. 8); None keeps each tensor's own dtype.

    Example:
        >>> with edgetorch.compress_activations(model, edgetorch.Bitmap(threshold=0.01)):
        ...     loss = criterion(model(x), y)
        >>> loss.backward()
    """

    name = "bitmap"
    threshold: float = 0.0
    value_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        zero_limit_bits(torch.float32, self.threshold)  # validates the threshold
        if self.value_dtype is not None and self.value_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"value_dtype must be None or one of {', '.join(map(str, FLOAT_DTYPES))}; "
                f"got {self.value_dtype!r}"
            )

    def encode(self, t: torch.Tensor) -> BitmapTensor | None:
        if not self._worth_packing(t):
            return None
        return pack_bitmap(t, self.threshold, self.value_dtype)

    def _worth_packing(self, t: torch.Tensor) -> bool:
        """Estimate from a strided sample whether the bitmap form is smaller than ``t``.

        A conv output feeding batch norm has no zeros; packing it only to find it does not
        shrink costs two passes over the tensor, which is half the packing time in a ResNet.
        A tensor kept dense is never less exact than its packed form (with a threshold it is
        simply not pruned), so a wrong estimate costs memory, never correctness.
        """
        flat = t.reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLE)]
        kept = (~(sample.abs() <= self.threshold)).float().mean().item()  # NaN counts as kept
        value_bytes = (self.value_dtype or t.dtype).itemsize
        return value_bytes * kept + 1 / 8 < _WORTHWHILE * t.element_size()


_SAMPLE = 4096  # elements looked at to estimate the kept fraction
_WORTHWHILE = 0.97  # pack when the estimate is at least 3% below dense (sampling error ~1.5%)

POLICIES: dict[str, type[Policy]] = {"dense": Dense, "bitmap": Bitmap}
_DTYPE_NAMES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64}


def parse_policy(spec: str) -> Policy:
    """Build a policy from ``name`` or ``name:key=value,key=value`` (the CLI's ``--policy``).

    Args:
        spec: e.g. ``dense``, ``bitmap``, ``bitmap:threshold=0.01``,
            ``bitmap:threshold=0.05,value_dtype=float16``.

    Returns:
        The policy object.

    Raises:
        ValueError: unknown policy or argument name, or a malformed value; the message lists
            what is accepted.
    """
    name, _, arg_text = spec.strip().partition(":")
    cls = POLICIES.get(name.strip().lower())
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; accepted: {', '.join(POLICIES)}")
    accepted = {f.name: f for f in fields(cls)}
    kwargs = {}
    for item in filter(None, (a.strip() for a in arg_text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in accepted:
            raise ValueError(
                f"bad argument {item!r} for policy {name!r}; accepted: "
                + (", ".join(f"{k}=..." for k in accepted) or "no arguments")
            )
        kwargs[key] = _parse_value(key, value.strip())
    return cls(**kwargs)


def _parse_value(key: str, value: str):
    if key.endswith("dtype"):
        if value.lower() in ("none", ""):
            return None
        if value.lower() not in _DTYPE_NAMES:
            raise ValueError(f"{key}={value!r}: accepted dtypes are {', '.join(_DTYPE_NAMES)}")
        return _DTYPE_NAMES[value.lower()]
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} is not a number") from None


def _fmt(v) -> str:
    return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else str(v)
