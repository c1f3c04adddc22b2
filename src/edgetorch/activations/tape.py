"""Role tapes: which op saved each tensor, recorded once per model and replayed by pack order.

Which op saved a tensor, and so what its backward needs (:class:`~edgetorch.activations.roles.Need`),
is a property of the model and its input signature, not of each step. Finding it with the
dispatch mode (:class:`~edgetorch.activations.roles.OpWatch`) costs Python on every ATen op:
about 100 us per op on a GPU host, more than most ops take on the device. So the engine watches
one step, writes down per pack what it learned (a :class:`Slot`), and on later steps of the same
model gives the n-th pack the n-th slot's need without any dispatch mode.

Tapes are kept per input signature (the shapes and dtypes the model is called with, read by its
forward pre-hook before any op runs), so a last, smaller batch records a tape of its own the first
time it comes, watched from its start. Each slot also carries a guard that a pack must pass: the
same shape, dtype and autograd node type (``type(t.grad_fn)``: the op that produced the tensor,
or that saved it for an output). A step follows every tape of its signature whose slots its
packs have matched so far. A pack that matches none means the step took a path no tape holds
(data-dependent control flow): the rest of that step is stored exactly (safe for any op, if less
compact), and the model's next steps are watched until one of them records a path not yet on a
tape (at most :data:`WATCH_AFTER_MISS` steps), so each path of a branch gets a tape.

A watching mode cannot be started in the middle of a step: the op under way when a pack arrives
was dispatched before the mode existed, and the mode would see only that op's internal calls, so
a later pack could be matched to the wrong op. Hence "exact for the rest of the step".

A tape also depends on what is not in the guard: which parameters train (a frozen weight's
partner is stored as a shape, a training one's as top-k), which modules are in training mode
(batch norm's statistics) and whether autocast is on. :func:`model_state` is that key; tapes
recorded under another state are dropped.
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch import nn

from .capacity import Capacities
from .roles import Need, storage_address

MAX_TAPES = 8  # per model and state: signatures and paths seen (a last smaller batch, a branch)
WATCH_AFTER_MISS = 3  # steps watched after a step left every tape, to record the path it took


class Slot:
    """What one pack was: its guard (shape, dtype, node type) and what the engine learned of it."""

    __slots__ = ("shape", "dtype", "node", "need", "module", "param_copy")

    def __init__(self, t: torch.Tensor, need: Need, module: tuple[str, str], param_copy: bool):
        self.shape, self.dtype, self.node = t.shape, t.dtype, type(t.grad_fn)
        self.need, self.module, self.param_copy = need, module, param_copy

    def matches(self, t: torch.Tensor) -> bool:
        return self.shape == t.shape and self.dtype is t.dtype and self.node is type(t.grad_fn)

    def key(self) -> tuple:
        return (tuple(self.shape), self.dtype, self.node, self.need)


class ModelTapes:
    """The tapes of one model under its current state, newest first, each with the input
    signature it was recorded for."""

    __slots__ = ("state", "tapes", "busy", "seen", "watch", "walk", "capacities", "plans")

    def __init__(self):
        self.state: tuple | None = None
        self.tapes: list[tuple[tuple | None, list[Slot]]] = []
        self.busy = False  # a block of this model is running (a nested block watches, as before)
        self.seen = False  # a block of this model ran with module hooks (their warnings)
        self.watch = 0  # steps still to watch after one left every tape
        self.walk: tuple | None = None  # (generation, modules, parameters, buffers): see model_state
        self.capacities = Capacities()  # kept counts of packed bitmaps, by position (GPU path)
        self.plans: list = []  # what each replayed position does, per tape and policy (see .replay)

    def for_state(self, state: tuple) -> list[tuple[tuple | None, list[Slot]]]:
        """The tapes recorded under ``state``, newest first (none if the state changed)."""
        if state != self.state:
            self.state, self.tapes, self.watch, self.plans = state, [], 0, []
        return self.tapes

    def keep(self, signature: tuple | None, tape: list[Slot]) -> None:
        """Add a watched step's tape; a step that took a known path leaves the watch on."""
        keys = [slot.key() for slot in tape]
        known = [i for i, (sig, old) in enumerate(self.tapes)
                 if sig == signature and [slot.key() for slot in old] == keys]
        for i in reversed(known):
            del self.tapes[i]
        self.tapes = [(signature, tape), *self.tapes][:MAX_TAPES]
        self.watch = max(0, self.watch - 1) if known else 0

    def missed(self) -> None:
        self.watch = WATCH_AFTER_MISS


_BY_MODEL: weakref.WeakKeyDictionary[nn.Module, ModelTapes] = weakref.WeakKeyDictionary()


def tapes_of(model: nn.Module) -> ModelTapes:
    found = _BY_MODEL.get(model)
    if found is None:
        found = _BY_MODEL[model] = ModelTapes()
    return found


def forget(model: nn.Module) -> None:
    """Drop ``model``'s tapes: its next block watches every op again."""
    _BY_MODEL.pop(model, None)


def signature(leaves: list) -> tuple:
    """The input signature of a model call: shape and dtype of each tensor argument."""
    return tuple((tuple(x.shape), x.dtype) for x in leaves if isinstance(x, torch.Tensor))


# Bumped whenever any module, parameter or buffer is registered anywhere (torch's global
# registration hooks): a model's cached walk (its modules, parameters and buffers) is redone then.
_generation = 0


def _registered(*args) -> None:
    global _generation
    _generation += 1


for _hook in (nn.modules.module.register_module_module_registration_hook,
              nn.modules.module.register_module_parameter_registration_hook,
              nn.modules.module.register_module_buffer_registration_hook):
    _hook(_registered)


def model_state(model: nn.Module, tapes: ModelTapes) -> tuple[set[int], tuple]:
    """The storages of ``model``'s parameters and buffers, and what a tape's needs depend on beyond
    its guards (which parameters train, which modules are in training mode, autocast).

    Which modules, parameters and buffers the model has is walked once and kept until anything is
    registered anywhere (a walk is ~200 us for a MobileNet, 1% of a small CPU step). Their storages
    and flags are read afresh on every block, never cached: moving one submodule
    (``model.fc.half()``) keeps every identity, and a stale address reused by an activation would
    make it pass for a weight. (A parameter replaced without registration, ``del`` then plain
    assignment of a tensor, is missed until the next registration: such a tensor is then stored
    under its op's need like an activation, which costs memory, never exactness.)
    """
    walk = tapes.walk
    modules = None if walk is None or walk[0] != _generation else [ref() for ref in walk[1]]
    if modules is None or None in modules:
        modules = list(model.modules())
        params = [p for m in modules for p in m._parameters.values() if p is not None]
        buffers = [b for m in modules for b in m._buffers.values() if b is not None]
        # Modules by weak reference: the tapes live in a dict keyed weakly by the model, and a
        # strong reference to the model from its own entry would keep every model ever trained
        # alive. Parameters and buffers hold no reference to their module.
        walk = tapes.walk = (_generation, [weakref.ref(m) for m in modules], params, buffers)
    _, _, params, buffers = walk
    storages = _storages(params)
    storages.update(_storages(buffers))
    # The module types in order tell a structure apart: blocks swapped for recomputing wrappers
    # (edgetorch.activations.blocks.recomputing) at other places save other tensors at the same
    # positions, with the same shapes, so the guards alone replayed one plan's tape on another.
    # map over C getters: no Python frame per module or parameter (one walk costs ~1% of a step)
    state = (tuple(map(type, modules)), tuple(map(_TRAINING, modules)), tuple(map(_REQUIRES_GRAD, params)),
             torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu"))
    return storages, state


_TRAINING, _REQUIRES_GRAD = operator.attrgetter("training"), operator.attrgetter("requires_grad")


def _storages(tensors: list[torch.Tensor]) -> set[int]:
    """:func:`storage_address` of each tensor; where none is offset into its storage (the usual
    parameters and buffers), read as their data pointers by C calls alone."""
    if any(map(torch.Tensor.storage_offset, tensors)):
        return {storage_address(t) for t in tensors}
    return set(map(torch.Tensor.data_ptr, tensors))
