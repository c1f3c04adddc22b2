"""What each op's backward needs of the tensors it saves, and which op saved a tensor.

Back Razor may prune a saved tensor only where that cannot change an input gradient. Per ATen op
(the level at which autograd saves), this module says what backward reads:

========================================  ======================  ============================
op (ATen)                                 saved tensor            need
========================================  ======================  ============================
convolution, mm, addmm, bmm, baddbmm,     an activation operand   ``prune`` when every other
mul                                       whose partner is a      operand is a parameter
                                          parameter               (it feeds only the weight
                                                                  gradient); ``shape`` when that
                                                                  parameter is frozen
same ops                                  activation x activation ``exact`` (prunable):
                                                                  attention scores, gating
relu, relu\\_                              output                  ``mask`` v > 0
hardtanh, hardtanh\\_ (ReLU6)              input / output          ``mask`` min < v < max
leaky_relu, leaky_relu\\_                  input / output          ``mask`` v > 0 (sign)
max/avg/adaptive pooling                  input                   ``shape`` (values unused)
native_batch_norm, training               input                   ``exact``
native_batch_norm, eval statistics        input                   ``shape`` if frozen
                                                                  (weight too), else ``exact``
native_layer_norm, native_group_norm      input                   ``exact`` (prunable)
gelu, silu, elu, softplus, mish           input                   ``exact`` (prunable)
hardswish                                 input                   ``exact`` (prunable); a
                                                                  rounded copy keeps each value's
                                                                  side of its kinks at -3, 3
hardsigmoid                               input                   ``mask`` -3 < v < 3
sigmoid, tanh, softmax, log_softmax       output                  ``exact`` (prunable)
fused attention (SDPA flash / efficient   v, output               ``exact`` (prunable)
/ cuDNN)                                  q, k, logsumexp         ``exact``
anything else                             any                     ``exact``
========================================  ======================  ============================

"prunable": exact by default; ``BackRazor(scope="all")`` prunes it too, as the paper does for
ViTs, making input gradients approximate. ``BackRazor(exact="int8")`` stores every prunable
tensor, training batch norm's input and fused attention's q and k quantized instead
(:attr:`Need.quantizable`). Fused attention's q, k and logsumexp are never pruned: its backward
recomputes the probabilities as exp(q k^T * scale - logsumexp), and a pruned operand that no
longer matches the saved logsumexp makes that exponent blow up (relative weight-gradient errors of
2000x were measured before this rule). Rounded q and k move each score by at most a few steps,
and the logsumexp stays exact.

Identifying the op: autograd packs an op's inputs right before the op reaches the dispatcher
below it, and its outputs right after; :class:`OpWatch`, a dispatch mode, sees those edges and
hands each pending pack its need. A tensor saved by a custom ``autograd.Function`` is packed at
the end of ``apply``, outside any op, right after the gradient-free ops of its forward, and is
marked ``exact`` (so is any pack that follows an op run under ``no_grad``: safe, if less compact).
"""

from __future__ import annotations

import enum
import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


UNKNOWN_OP = "?"  # saved by no ATen op the engine saw (a custom autograd Function, checkpointing)


class NeedKind(enum.Enum):
    """How much of a saved tensor an op's backward reads."""

    EXACT = "exact"  # every value
    PRUNE = "prune"  # feeds only a weight gradient: each sample's top-k magnitudes are enough
    MASK = "mask"  # only whether each value lies in an interval
    SHAPE = "shape"  # only its shape: the values are never read


@dataclass(frozen=True)
class Need:
    """What backward reads of one saved tensor.

    Attributes:
        kind: the :class:`NeedKind`: every value, a top-k copy, a mask of ``(low, high)``, or
            only the shape.
        low, high: the interval of a ``mask`` need.
        inside, outside: stand-in values a mask reads back (see :func:`edgetorch.codecs.mask.pack_mask`).
        prunable: an ``exact`` need that ``BackRazor(scope="all")`` prunes anyway.
        rounds: an ``exact`` need that tolerates rounding but not pruning (:attr:`quantizable`).
        kinks: ``(low, high)`` where backward's slope jumps (hardswish's -3 and 3): a rounded copy
            must keep exact which piece each value was on: below, inside ``(low, high)`` or above
            (:func:`edgetorch.codecs.pack_quantized_sided`).
        op: the ATen op that saved the tensor, for the ledger.
        bound: for an integer tensor, a known bound on its values (max pooling's indices lie in
            [0, plane size)), so it can be narrowed without reading its range back.
    """

    kind: NeedKind
    low: float = 0.0
    high: float = math.inf
    inside: float = 1.0
    outside: float = 0.0
    prunable: bool = False
    op: str = UNKNOWN_OP
    bound: int | None = None
    rounds: bool = False
    kinks: tuple[float, float] | None = None

    @property
    def quantizable(self) -> bool:
        """An ``exact`` need whose backward tolerates rounding, which ``BackRazor(exact="int8")``
        stores at 8 bits: every prunable one, and those that tolerate rounding but not pruning
        (``rounds``: a training batch norm's input, fused attention's q and k). Never the
        logsumexp of fused attention, nor the tensors of ops this module does not know."""
        return self.kind is NeedKind.EXACT and (self.prunable or self.rounds)


EXACT = Need(NeedKind.EXACT)

_BILINEAR = {"convolution", "mm", "addmm", "bmm", "baddbmm", "mul"}
_POOLS = {
    "max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices",
    "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_avg_pool1d",
}
_BATCH_NORMS = {
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "cudnn_batch_norm", "miopen_batch_norm",
}
_SMOOTH = ("gelu", "silu", "elu", "softplus", "mish", "hardswish")
# hardswish's slope jumps at -3 and 3 (0 | x/3 + 1/2 | 1): rounding must not move a value across.
_KINKS = {"hardswish": (-3.0, 3.0), "hardswish_": (-3.0, 3.0)}
# In-place variants too (torchvision builds EfficientNet's SiLU with inplace=True): autograd saves
# a clone of the input made just before the op, resolved with the op's own need.
_PRUNABLE_INPUTS = {"native_layer_norm", "native_group_norm", *_SMOOTH, *(f"{op}_" for op in _SMOOTH)}
_PRUNABLE_OUTPUTS = {"sigmoid", "tanh", "sigmoid_", "tanh_", "_softmax", "_safe_softmax", "_log_softmax"}
_ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
}
# Ops that save some of their outputs, and which: a pack right after one of them may be one.
_SAVED_OUTPUTS = {
    "relu": (0,), "relu_": (0,), "hardtanh_": (0,), "leaky_relu_": (0,),
    "native_batch_norm": (1, 2), "native_layer_norm": (1, 2), "native_group_norm": (1, 2),
    "max_pool2d_with_indices": (1,), "max_pool3d_with_indices": (1,),
    **{op: (0,) for op in _PRUNABLE_OUTPUTS}, **{op: (0, 1) for op in _ATTENTION},
    # An in-place op whose backward reads its original input saves a clone made just before.
    "clone": (0,),
}


_ALIASES = {torch.ops.aten.detach.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default}


def _name(func) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among an op's arguments (nested lists, tuples and dicts), in order.

    ATen arguments nest only in lists and tuples (and the kwargs dict), so a plain walk does what
    pytree's flatten does at a quarter of its cost, which was the largest share of the dispatch
    mode's time per op.
    """
    found: list[torch.Tensor] = []
    _collect(values, found)
    return found


def _collect(value, found: list) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, found)


def _arg(args: tuple, kwargs: dict, index: int, key: str, default):
    return args[index] if len(args) > index else kwargs.get(key, default)


def input_need(op: str, t: torch.Tensor, args: tuple, kwargs: dict, is_param: Callable) -> Need:
    """What backward of ``op`` (called with ``args``) needs of its input ``t``."""
    if op in _BILINEAR:
        others = [a for a in _tensors((args, kwargs)) if not _same(a, t) and a.dim() > 0]
        if others and all(is_param(a) for a in others):
            trains = any(a.requires_grad for a in others)
            return Need(NeedKind.PRUNE if trains else NeedKind.SHAPE, op=op)
        return Need(NeedKind.EXACT, prunable=True, op=op)  # attention scores, gating: input gradients
    if op in ("hardtanh", "hardtanh_"):
        low, high = float(_arg(args, kwargs, 1, "min_val", -1.0)), float(_arg(args, kwargs, 2, "max_val", 1.0))
        return _interval(low, high, op)
    if op in ("leaky_relu", "leaky_relu_"):
        return Need(NeedKind.MASK, 0.0, math.inf, 1.0, -1.0, op=op)
    if op in _POOLS:
        return Need(NeedKind.SHAPE, op=op)
    if op in _BATCH_NORMS and _same(args[0], t):
        weight = _arg(args, kwargs, 1, "weight", None)
        training = op != "_native_batch_norm_legit_no_training" and _arg(args, kwargs, 5, "training", True)
        if training or (weight is not None and weight.requires_grad):
            # Batch statistics' gradients read every input value; so does the affine weight's
            # gradient through (x - mean) / std, which top-k of x does not approximate (rounding
            # each value by a small step does).
            return Need(NeedKind.EXACT, op=op, rounds=True)
        return Need(NeedKind.SHAPE, op=op)  # frozen: grad_input = grad * weight / std reads no x
    if op in _ATTENTION:
        # Fused backward recomputes the probabilities as exp(q k^T * scale - logsumexp) with the
        # forward's logsumexp: a pruned q or k no longer matches it and the exponent can blow
        # up. Only v (argument 2 of every fused kernel) may be pruned. Rounding q and k by a
        # small step moves each score by a bounded amount, so exp() moves by a bounded factor.
        return Need(NeedKind.EXACT, prunable=len(args) > 2 and _same(args[2], t), op=op, rounds=True)
    if op in ("hardsigmoid", "hardsigmoid_"):  # slope 1/6 inside (-3, 3), 0 outside: a mask is exact
        return _interval(-3.0, 3.0, op)
    if op in _PRUNABLE_INPUTS:
        return Need(NeedKind.EXACT, prunable=True, op=op, kinks=_KINKS.get(op))
    return Need(NeedKind.EXACT, op=op)


def output_need(op: str, index: int, args: tuple, kwargs: dict) -> Need:
    """What backward of ``op`` needs of its output number ``index``, which it saved."""
    if op.startswith("max_pool") and index == 1 and args:  # flat positions in one input plane
        dims = 3 if op.startswith("max_pool3d") else 2
        return Need(NeedKind.EXACT, op=op, bound=math.prod(args[0].shape[-dims:]) - 1)
    if op in ("relu", "relu_"):
        return Need(NeedKind.MASK, 0.0, math.inf, 1.0, 0.0, op=op)
    if op == "hardtanh_":
        return _interval(float(_arg(args, kwargs, 1, "min_val", -1.0)),
                         float(_arg(args, kwargs, 2, "max_val", 1.0)), op)
    if op == "leaky_relu_":
        return Need(NeedKind.MASK, 0.0, math.inf, 1.0, -1.0, op=op)
    if op in _PRUNABLE_OUTPUTS or (op in _ATTENTION and index == 0):  # attention: not its logsumexp
        return Need(NeedKind.EXACT, prunable=True, op=op)
    return Need(NeedKind.EXACT, op=op)


def _interval(low: float, high: float, op: str) -> Need:
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        return Need(NeedKind.EXACT, op=op)
    return Need(NeedKind.MASK, low, high, (low + high) / 2, low, op=op)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same memory: one storage, same offset, shape and strides (a view of itself counts)."""
    if a is b:
        return True
    if a.dtype != b.dtype:  # a same-size view as another dtype is other values
        return False
    # One address read per tensor: equal first-element addresses of live tensors mean one
    # storage at one offset (an empty tensor has no memory to share).
    return a.data_ptr() == b.data_ptr() and a.numel() > 0 and a.shape == b.shape and a.stride() == b.stride()


def storage_address(t: torch.Tensor) -> int:
    """Address of the storage that ``t`` views: what tells saved tensors, parameters and inputs apart.

    Computed from ``t``'s own pointer: ``t.untyped_storage()`` creates a Python storage object
    that stays alive as long as the storage does, one more object for the garbage collector per
    saved activation (224 a step in mobilenet_v2), whose full collections then came more often.
    """
    return t.data_ptr() - t.storage_offset() * t.element_size()


class OpWatch(TorchDispatchMode):
    """Assigns each pending pack the :class:`Need` of the op that saved it.

    Args:
        resolve: called as ``resolve(pending, need)`` once the op is known; ``pending.tensor``
            is the tensor autograd packed.
        is_param: whether a tensor is a parameter or buffer of the model (or a view of one).
    """

    def __init__(self, resolve: Callable, is_param: Callable):
        super().__init__()
        self.resolve, self._is_model_param = resolve, is_param
        self.pending: list = []
        self._last: tuple | None = None  # (op, args, kwargs, saved outputs) of the op just run
        # Under autocast a convolution or Linear reads a cast copy of its weight, made inside the
        # autocast dispatch: storage -> the copy, for copies of parameters (see is_param).
        self._casts: dict[int, weakref.ref] = {}
        self.after_grad_free_op = False  # see __torch_dispatch__

    def is_param(self, t: torch.Tensor) -> bool:
        """A parameter or buffer of the model, a view of one, or autocast's cast copy of one."""
        if self._is_model_param(t):
            return True
        ref = self._casts.get(storage_address(t))
        if ref is not None and ref() is not None:
            return True
        # A copy autocast cached before this block began (one cache per outermost autocast
        # region, so every micro-batch after the first reuses it): its node leads to the weight.
        node = (t if t._base is None else t._base).grad_fn  # Linear saves weight.t(), a view
        if node is not None and node.name() == "ToCopyBackward0" and node.next_functions:
            source = getattr(node.next_functions[0][0], "variable", None)
            return source is not None and self._is_model_param(source)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "is_view", False) or func in _ALIASES:
            # Views save nothing and sit between an op and the packs of its outputs (the
            # engine's own detach runs inside the pack hook): they are no edge.
            return func(*args, **kwargs)
        op = _name(func)
        if self.pending:
            self.flush(op, args, kwargs)
        # A custom autograd.Function's forward runs with gradients off, and its saved tensors
        # are packed right after it returns, outside any op (torch >= 2.x calls apply from C,
        # so no Python frame marks them): a pack that follows a gradient-free op is one of those.
        self.after_grad_free_op = not torch.is_grad_enabled()
        out = func(*args, **kwargs)
        if op == "_to_copy" and args and self.is_param(args[0]):
            # Casts made by autocast; a cast the model makes itself is tracked alike, since a
            # parameter's copy is still parameter-valued (its other operand feeds weight grads).
            self._casts[storage_address(out)] = weakref.ref(out)
        if op in _SAVED_OUTPUTS and not self.after_grad_free_op:  # with gradients off it saved nothing
            outs = out if isinstance(out, (tuple, list)) else (out,)
            saved = [(i, outs[i]) for i in _SAVED_OUTPUTS[op] if i < len(outs) and isinstance(outs[i], torch.Tensor)]
            self._last = (op, args, kwargs, saved)
        else:
            self._last = None
        return out

    def flush(self, op: str | None = None, args: tuple = (), kwargs: dict | None = None) -> None:
        """Resolve the pending packs, in order: outputs of the op just run, then inputs of ``op``."""
        pending, self.pending = self.pending, []
        kwargs = kwargs or {}
        outputs = list(self._last[3]) if self._last is not None else []
        inputs = _tensors((args, kwargs)) if op is not None else []
        try:
            for done, p in enumerate(pending):
                t, need = p.tensor, EXACT
                match = next((k for k, (_, o) in enumerate(outputs) if _same(o, t)), None)
                if match is not None:
                    index = outputs.pop(match)[0]  # each output is saved once; a second pack is an input
                    if self._last[0] != "clone":
                        need = output_need(self._last[0], index, self._last[1], self._last[2])
                    elif op is not None and op.endswith("_") and args:
                        need = input_need(op, args[0], args, kwargs, self.is_param)
                elif any(_same(a, t) for a in inputs):
                    need = input_need(op, t, args, kwargs, self.is_param)
                self.resolve(p, need)
        except BaseException:
            # A failed encode (out of memory, say) must not leave packs holding their tensors:
            # each would tie its graph into a cycle the garbage collector cannot break.
            for p in pending[done:]:
                p.release()
            raise
        finally:
            self._last = None
