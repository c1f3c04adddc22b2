"""What a replayed pack does, decided once per tape position and policy rather than per step.

On a replayed step (see :mod:`.tape`) the n-th pack has passed the n-th slot's guard: its shape,
dtype and node type are the slot's. So everything the engine decides from those, from the op's
need and from the module that saved it is the same on every step: which policy stores it, in
which form, and whether it is held as it is (a weight's autocast copy, an integer a policy does
not narrow, a tensor under ``min_bytes``). A :class:`Plan` holds those answers per position,
made on the first replayed step of a tape under a policy and reused by every later one, so a
steady-state pack pays a list lookup for them instead of a dozen attribute reads, a dict lookup
and the policy's ``form`` call (issue 23: mobilenet_v2 saves 458 tensors in a ~16 ms CPU step,
so every microsecond per saved tensor is ~3% of the step).

Only what the guard fixes is planned. Whether a tensor is a parameter, a buffer or an input (its
storage), whether it shares memory with an earlier pack, and whether its position compressed
before are looked at on every step, as on a watched one. A plan serves blocks without a ledger:
with one, every pack is recorded on the engine's full path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..codecs.narrow import WIDE_INTS
from .forms import EXACT_FORM

if TYPE_CHECKING:
    from .forms import Form
    from .policies import Policy
    from .roles import Need
    from .tape import ModelTapes, Slot

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_PLANS = 16  # per model: tapes times policies (a bench alternates several on one model)


class Plan:
    """Per position of one tape, under one policy table and ``min_bytes``: None where the pack is
    held as it is whatever its storage, else ``(policy, form)`` of a candidate for encoding."""

    __slots__ = ("tape", "policy", "by_module", "min_bytes", "steps")

    def __init__(self, tape: list[Slot], policy: Policy, by_module: dict[str, Policy], default: Policy,
                 min_bytes: int):
        self.tape, self.policy, self.by_module, self.min_bytes = tape, policy, by_module, min_bytes
        self.steps: list[tuple[Policy, Form] | None] = [
            decide(slot.dtype, slot.shape, slot.param_copy, slot.need, by_module.get(slot.module[0], default),
                   min_bytes) for slot in tape]

    def serves(self, tape: list[Slot], policy: Policy, by_module: dict[str, Policy], min_bytes: int) -> bool:
        # Policies are frozen dataclasses: a loop that builds an equal one each step (the README's
        # `compress_activations(model, BackRazor(0.9))`) is served by the same plan.
        return (self.tape is tape and (self.policy is policy or self.policy == policy)
                and self.min_bytes == min_bytes and self.by_module == by_module)


def decide(dtype: torch.dtype, shape: torch.Size, param_copy: bool, need: Need, policy: Policy,
           min_bytes: int) -> tuple[Policy, Form] | None:
    """The engine's checks of a pack (not a parameter, buffer or input) that depend only on what a
    slot fixes: None where it is held as it is, else the policy and form that store it.

    Held as it is: autocast's low-precision copy of a weight (``param_copy``: autograd holds it in
    plain PyTorch too, and it has no activation sparsity to find), an integer tensor ``policy``
    does not narrow, and a tensor under ``min_bytes`` (encoding it saves nothing)."""
    floating = dtype in FLOATS
    if param_copy or (not floating and not (dtype in WIDE_INTS and policy.narrows_integers)) \
            or shape.numel() * dtype.itemsize < min_bytes:
        return None
    return policy, (policy.form(need) if floating else EXACT_FORM)  # integers: never pruned


def plan_for(tapes: ModelTapes, tape: list[Slot], policy: Policy, by_module: dict[str, Policy], default: Policy,
             min_bytes: int) -> list[tuple[Policy, Form] | None]:
    """The steps of ``tape`` under ``policy`` (``by_module`` and ``default``: its table for this
    model, see :meth:`~edgetorch.activations.policies.Policy.by_module`), made once and kept with
    the model's tapes (dropped with them when the model's state changes)."""
    plans = tapes.plans
    for plan in plans:
        if plan.serves(tape, policy, by_module, min_bytes):
            return plan.steps
    plan = Plan(tape, policy, by_module, default, min_bytes)
    plans.insert(0, plan)
    del plans[MAX_PLANS:]
    return plan.steps
