"""Policy specs: the strings ``--policy`` and :func:`parse_policy` take (``name:key=value,...``)."""

from __future__ import annotations

from dataclasses import fields

import torch

from .blocks import PerBlock, Recompute
from .policies import POLICIES, Dense, Policy

_DTYPE_NAMES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64}


def parse_policy(spec: str) -> Policy:
    """Build a policy from ``name`` or ``name:key=value,key=value`` (the CLI's ``--policy``).

    Args:
        spec: e.g. ``dense``, ``bitmap``, ``bitmap:threshold=0.01``,
            ``bitmap:threshold=0.05,value_dtype=float16``, ``backrazor:sparsity=0.9``,
            ``backrazor:sparsity=0.95,scope=all``, ``backrazor:sparsity=0.9,exact=int8``,
            ``backrazor:sparsity=0.9,rows=token``,
            ``backrazor:sparsity=0.8,exact=int8,values=int8``, ``quantized:bits=4``,
            ``quantized:bits=8,group=64,stochastic=true``; a plan per block as
            :meth:`PerBlock.spec <edgetorch.activations.blocks.PerBlock.spec>` writes it:
            ``per-block(layer1.0=bitmap; layer2.0=recompute(bitmap); default=dense)``.

    Returns:
        The policy object.

    Raises:
        ValueError: unknown policy or argument name, or a malformed value; the message lists
            what is accepted.
    """
    if spec.strip().lower().startswith(PER_BLOCK):
        return _parse_per_block(spec.strip())
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


PER_BLOCK, RECOMPUTE = "per-block", "recompute"
_PER_BLOCK_FORMAT = ("a per-block plan is written per-block(BLOCK=POLICY; ...; default=POLICY), POLICY a policy "
                     "spec or recompute(POLICY), e.g. per-block(layer1.0=bitmap; layer2.0=recompute(bitmap); default=dense)")


def _parse_per_block(text: str) -> PerBlock:
    # Items are split on ';': a policy's own arguments are split on ',' (backrazor:sparsity=0.9,exact=int8).
    inner = text[len(PER_BLOCK):].strip()
    if not (inner.startswith("(") and inner.endswith(")")):
        raise ValueError(f"{text!r}: {_PER_BLOCK_FORMAT}")
    blocks, default = [], Dense()
    for item in filter(None, (i.strip() for i in inner[1:-1].split(";"))):
        name, eq, policy = (part.strip() for part in item.partition("="))
        if not eq or not name or not policy:
            raise ValueError(f"bad item {item!r} in {text!r}: {_PER_BLOCK_FORMAT}")
        recompute = policy.lower().startswith(RECOMPUTE + "(") and policy.endswith(")")
        form = Recompute(parse_policy(policy[len(RECOMPUTE) + 1 : -1])) if recompute else parse_policy(policy)
        if name == "default":
            default = form  # a Recompute here is refused by PerBlock, with its reason
        else:
            blocks.append((name, form))
    return PerBlock(tuple(blocks), default)


def _parse_value(key: str, value: str):
    if key in ("scope", "rows"):
        return value
    if key in ("exact", "values"):
        return None if value.lower() in ("none", "lossless", "") else value.lower()
    if key == "stochastic":
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"stochastic={value!r}: accepted are true or false")
        return value.lower() in ("true", "1")
    if key in ("bits", "group"):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a whole number") from None
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
