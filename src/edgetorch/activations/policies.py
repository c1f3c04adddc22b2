"""Policies: how each tensor autograd saves for backward is stored. Subclass :class:`Policy` to add one."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..codecs import FLOAT_DTYPES, _backend, _cuda, pack_bitmap
from ..codecs.bitmap import (BitmapTensor, CappedBitmapTensor, pack_bitmap_capped, pack_bitmap_if_smaller,
                             zero_limit_bits)
from ..codecs.mask import mask_checked
from ..codecs.quantized import check_bits, pack_quantized_sided, quantize_checked, quantize_values
from ..codecs.topk import check_sparsity, pack_topk
from .forms import EXACT_FORM, PRUNE_FORM, SHAPE_FORM, Form, FormKind, mask_form, quantized_form
from .roles import EXACT, UNKNOWN_OP, Need, NeedKind


#: Every policy by name, for :func:`parse_policy`: each subclass of :class:`Policy` with a
#: ``name`` of its own adds itself.
POLICIES: dict[str, type[Policy]] = {}


class Policy:
    """Base class: decide the stored form of one saved floating-point tensor.

    The engine (:func:`edgetorch.compress_activations`) has already left parameters, buffers,
    model inputs, integer/bool and tiny tensors alone (integers are narrowed losslessly when
    ``narrows_integers`` is set), and removed duplicates; a policy only sees float tensors worth encoding, as ``[rows, n]`` (one row per sample for batch-first
    tensors). ``encode`` returns an object with ``.nbytes``, ``.nnz`` and ``.unpack()``, or
    None to keep the tensor as it is.

    A policy that treats tensors differently by what backward needs of them sets
    ``needs_roles``; the engine then tells it, per tensor, the :class:`~edgetorch.activations.roles.Need`
    of the op that saved it, and ``form(need)`` gives the stored :class:`~edgetorch.activations.forms.Form`
    (tensors saved by several ops are stored once per distinct form).

    A subclass with its own ``name`` is registered under it: :func:`parse_policy` and
    ``--policy`` then accept ``name:key=value,...`` for its dataclass fields.
    """

    name = "policy"
    needs_roles = False
    # Whether the engine may hold int16/int32/int64 saved tensors (max-pool indices) in the
    # narrowest integer dtype that holds their values (lossless; see edgetorch.codecs.narrow).
    narrows_integers = False
    # Whether ``encode`` ever stores a tensor in another form. A policy that never does (Dense)
    # has nothing to dedupe or look up: with no ledger the engine holds each pack as it is.
    encodes = True
    # Whether ``encode`` takes ``capacity=``: on the GPU path the stored size depends on the data
    # (a bitmap's kept count), and the engine sizes it from the count kept at the same position of
    # an earlier step instead of reading it back (see edgetorch.activations.capacity).
    sized_by_count = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a policy of its own, not a variant that inherits a name
            key = cls.name.strip().lower()  # as parse_policy looks it up
            if POLICIES.get(key, cls) is not cls:
                raise ValueError(f"policy name {key!r} is taken by {POLICIES[key].__qualname__}; give "
                                 f"{cls.__qualname__} a name of its own")
            POLICIES[key] = cls
        # A subclass that overrides ``encode`` (say, of BackRazor) must see every tensor there,
        # as ``[rows, n]``, not through the shortcut it inherited (the engine calls encode_region).
        if "encode" in cls.__dict__ and "encode_region" not in cls.__dict__:
            cls.encode_region = Policy.encode_region

    def encode(self, t: torch.Tensor, need: Need = EXACT):
        raise NotImplementedError

    def encode_region(self, t: torch.Tensor, rows: int, need: Need, form: Form):
        """``encode(t.view(rows, -1), need)`` of a contiguous ``t`` of any shape, where the caller
        already has ``form = self.form(need)``: the engine's call for every tensor it stores (but
        a GPU's count-sized bitmaps). It computes each saved tensor's form once, to deduplicate,
        and the built-in policies take it rather than work it out again, and pass ``rows`` to
        codecs that read ``t`` in place and decode to its shape: no view at pack or unpack (Python
        and torch calls per saved tensor are a small step's cost: issue 23), the same bytes. The
        default makes the ``[rows, n]`` view and calls ``encode``; so does a subclass that
        overrides ``encode`` alone."""
        return self.encode(t.view(rows, -1), need)

    def form(self, need: Need) -> Form:
        """The stored form for ``need``; the default stores every tensor one (exact) way."""
        return EXACT_FORM

    def by_module(self, model: torch.nn.Module) -> tuple[dict[str, Policy], Policy]:
        """The policy of each tensor by the qualified name of the module that saved it, and the
        policy of the tensors saved by modules not named there. Every tensor takes this policy; a
        plan with a policy per block (:class:`edgetorch.activations.blocks.PerBlock`) names the
        modules of each block."""
        return {}, self

    def per_sample(self, form: Form) -> bool:
        """Whether ``encode`` should see form ``form`` of a tensor as one row per sample even
        where the saved tensor's rows are tokens (the engine then regroups them); by default
        rows are the saved tensor's outermost dimension in memory."""
        return False

    def covers(self, held: Form, wanted: Form) -> bool:
        """Whether a tensor held in form ``held`` may serve an op that wants form ``wanted``
        (then it is stored once, in ``held``). An exact form serves every need."""
        return held is wanted or held is EXACT_FORM

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
    encodes = False

    def encode(self, t: torch.Tensor, need: Need = EXACT) -> None:
        return None


@dataclass(frozen=True)
class Bitmap(Policy):
    """BitTrain: bitmap of non-zeros + packed values (Hosny et al., SEC'21).

    Args:
        threshold: activation pruning: saved values with ``|v| <= threshold`` are stored as 0
            (the paper's Fig. 9/10). 0 is lossless.
        value_dtype: store the values as ``torch.float16`` / ``torch.bfloat16`` (the paper's
            Fig. 8); None keeps each tensor's own dtype.

    Example (training under it: :func:`edgetorch.compress_activations`):
        >>> policy = edgetorch.Bitmap(threshold=0.01)  # activation pruning at 0.01
        >>> policy.spec()  # the same policy as parse_policy and ``edgetorch profile --policy`` take it
        'bitmap:threshold=0.01'
    """

    name = "bitmap"
    narrows_integers = True
    sized_by_count = True
    threshold: float = 0.0
    value_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        zero_limit_bits(torch.float32, self.threshold)  # validates the threshold
        if not math.isfinite(self.threshold):
            # Every saved value would be dropped: gradients of everything but the last layers
            # are silently zero (31 of resnet's 32 were measured so).
            raise ValueError(f"threshold must be finite: {self.threshold!r} drops every saved value and zeroes "
                             "the gradients; use a small threshold such as 0.01, or 0 for lossless")
        if self.value_dtype is not None and self.value_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"value_dtype must be None or one of {', '.join(map(str, FLOAT_DTYPES))}; "
                f"got {self.value_dtype!r}"
            )

    def encode(self, t: torch.Tensor, need: Need = EXACT, capacity: int | None = None
               ) -> BitmapTensor | CappedBitmapTensor | None:
        """``t`` as a bitmap, or None where that is not smaller. ``capacity`` (GPU path only):
        pack into that many value slots without a host sync, or None if that many would not be
        smaller; the caller checks :meth:`CappedBitmapTensor.overflowed` later."""
        limit = int(_WORTHWHILE * t.numel() * t.element_size())
        if capacity is not None and _cuda.gpu_path(t):
            value_bytes = (self.value_dtype or t.dtype).itemsize
            if (t.numel() + 7) // 8 + capacity * value_bytes >= limit:
                return None
            return pack_bitmap_capped(t, capacity, self.threshold, self.value_dtype)
        if _cuda.gpu_path(t) or (t.numel() <= _COUNT_FIRST and t.is_cpu and _backend.CPU.pack_bitmap is not None):
            # On a GPU packing reads the kept count back once anyway (to size the values); the
            # decision uses that exact count instead of a sample, which would be a second sync.
            # On a CPU, up to _COUNT_FIRST elements, packing's counting pass costs less than
            # the sample's torch calls (measured: 2.1 against 6.8 us at 49k float32 elements).
            return pack_bitmap_if_smaller(t, self.threshold, self.value_dtype, limit)
        if not self._worth_packing(t):
            return None
        return pack_bitmap(t, self.threshold, self.value_dtype)

    def encode_region(self, t: torch.Tensor, rows: int, need: Need, form: Form):
        return self.encode(t, need)  # a bitmap's bytes are row-major whatever the shape

    def _worth_packing(self, t: torch.Tensor) -> bool:
        """Estimate from a strided sample whether the bitmap form is smaller than ``t``.

        A conv output feeding batch norm has no zeros; packing it only to find it does not
        shrink costs two passes over the tensor, which is half the packing time in a ResNet.
        A tensor kept dense is never less exact than its packed form (with a threshold it is
        simply not pruned), so a wrong estimate costs memory, never correctness.
        """
        flat = t.reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLE)]
        if self.threshold == 0:  # lossless: one counting op (NaN is not zero, -0.0 is)
            kept = int(torch.count_nonzero(sample)) / max(1, sample.numel())
        else:
            kept = (~(sample.abs() <= self.threshold)).float().mean().item()  # NaN counts as kept
        value_bytes = (self.value_dtype or t.dtype).itemsize
        return value_bytes * kept + 1 / 8 < _WORTHWHILE * t.element_size()


_SAMPLE = 4096  # elements looked at to estimate the kept fraction
# Elements up to which the C extension's counting pass decides on a CPU instead of a sample:
# it writes the bitmap packing needs anyway, and costs what the estimate does at about 200k
# (7.7 against 7.3 us, float32, one thread; 241 against 10 us at 1.6M).
_COUNT_FIRST = 1 << 17
_WORTHWHILE = 0.97  # pack when the estimate is at least 3% below dense (sampling error ~1.5%)
_SCOPES = ("weights", "all")
_ROWS = ("token", "sample")  # what one top-k selection spans (BackRazor.rows)
_QUANTIZED = {"int8": 8, "int4": 4, "int2": 2}  # the words for quantized storage in BackRazor
# Elements per min/step pair when a policy quantizes: 64, not the codec's 128, costs 1/64 of a
# float32 more (0.281x at 8 bits) and was what took MiniLM-L6's worst gradient cosine of a
# parameter Back Razor leaves exact (a query bias) from 0.982 to 0.991 at 8 bits: transformer
# activations have outlier channels whose range sets the step of every value in their group.
POLICY_GROUP = 64


@dataclass(frozen=True)
class Quantized(Policy):
    """Every saved float tensor at ``bits`` bits, with a min and step per group of ``group``
    elements (:func:`edgetorch.codecs.pack_quantized`): the ActNN / GACT-style baseline, and
    BitTrain's float16 option generalised. Lossy everywhere (batch-norm, GELU, softmax and
    attention inputs included) except where backward reads only a sign pattern: ReLU, ReLU6,
    leaky ReLU and hardsigmoid keep their exact 1-bit mask, as in ActNN, since rounding a small
    positive output to 0 closes its gradient (resnet50's input-gradient cosine was 0.92 at 8 bits
    with quantized ReLU outputs), and a mask is smaller than any code; hardswish's copy keeps the
    piece of each value exact; tensors saved by no ATen op (checkpointing, custom autograd
    Functions) stay lossless. See :func:`edgetorch.gradient_fidelity` for how far
    gradients move.

    Args:
        bits: 8, 4 or 2.
        group: elements per min/step pair, a multiple of 8 (default 64; smaller: more exact, more bytes).
        stochastic: round stochastically (unbiased gradients in expectation), drawing each
            tensor's seed from torch's global generator (so ``torch.manual_seed`` repeats it).

    Example (training under it: :func:`edgetorch.compress_activations`):
        >>> edgetorch.parse_policy("quantized:bits=4,stochastic=true")  # the string form
        Quantized(bits=4, group=64, stochastic=True)
    """

    name = "quantized"
    needs_roles = True
    narrows_integers = True
    bits: int = 8
    group: int = POLICY_GROUP
    stochastic: bool = False

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 8 or self.group % 8:
            raise ValueError(f"group must be a positive multiple of 8, e.g. 64 or 128; got {self.group!r}")
        if not isinstance(self.stochastic, bool):
            raise ValueError(f"stochastic must be true or false; got {self.stochastic!r}")

    def form(self, need: Need) -> Form:
        if need.kind is NeedKind.MASK or need.kind is NeedKind.SHAPE:
            return _exact_form(need)
        if need.op == UNKNOWN_OP:
            # Saved by no ATen op the engine saw: a custom autograd Function, or checkpointing's
            # segment inputs, whose rounding the recomputed forward would carry through a whole
            # segment (resnet50 with checkpointed stages: input-gradient cosine 0.987 at 8 bits).
            return EXACT_FORM
        return quantized_form(self.bits, need.kinks)

    def encode(self, t: torch.Tensor, need: Need = EXACT):
        # Named, not self.encode_region: a subclass that overrides encode routes that back here.
        return Quantized.encode_region(self, t, t.shape[0] if t.dim() else 1, need, self.form(need))

    def encode_region(self, t: torch.Tensor, rows: int, need: Need, form: Form):
        kind = form.kind
        if kind is FormKind.MASK:
            return _mask(t, need)
        if kind is FormKind.EXACT:
            return _lossless(t)
        return _quantize(t, need, rows, self.bits, self.group, self.stochastic)


def _exact_form(need: Need) -> Form:
    """The form of a need stored exactly for what backward reads of it: a 1-bit mask of the
    interval, nothing but the shape, every value, or (Back Razor) a top-k copy."""
    if need.kind is NeedKind.MASK:
        return mask_form(need.low, need.high)
    return _FORM_OF_NEED[need.kind]


_FORM_OF_NEED = {NeedKind.EXACT: EXACT_FORM, NeedKind.PRUNE: PRUNE_FORM, NeedKind.SHAPE: SHAPE_FORM}


def _quantize(t: torch.Tensor, need: Need, rows: int, bits: int, group: int = POLICY_GROUP, stochastic: bool = False):
    # The seed comes from the CPU generator even for a CUDA tensor: no device sync.
    seed = int(torch.randint(0, 2**32, (), dtype=torch.int64)) if stochastic else None
    if need.kinks is not None:
        return pack_quantized_sided(t, bits, *need.kinks, group=group, rows=rows, seed=seed)
    # bits and group were checked when the policy was made; rows divides t's elements (engine)
    return quantize_checked(t, bits, group, rows if t.numel() else 0, seed)


def _mask(t: torch.Tensor, need: Need):
    # the interval and stand-ins come from .roles, which makes only valid ones (of floats)
    return mask_checked(t, need.low, need.high, need.inside, need.outside)


@dataclass(frozen=True)
class BackRazor(Policy):
    """Back Razor: the forward stays dense; saved copies that feed only a weight gradient keep
    their top-k magnitudes per sample, as bitmap + values (Jiang et al., NeurIPS'22).

    What each op's backward reads decides what is stored (see
    :mod:`edgetorch.activations.roles`): inputs of Conv/Linear/matmul with a parameter are
    pruned; ReLU, ReLU6 and leaky ReLU keep an exact 1-bit mask; pooling keeps only the shape;
    everything else (GELU, softmax, LayerNorm, attention, training-mode batch norm) is stored
    losslessly (as a bitmap on CPU; as it is on a GPU, where probing it for zeros would cost a
    host sync per tensor). Input gradients therefore equal plain PyTorch's wherever no batch norm trains.

    Args:
        sparsity: fraction of each sample's values dropped, in [0, 1). A sample that already
            has more exact zeros keeps all its non-zeros (effective sparsity
            max(natural, requested)).
        value_dtype: store kept values as ``torch.float16`` / ``torch.bfloat16``; None keeps
            each tensor's dtype. Exact forms are never rounded.
        scope: ``"weights"`` (default) prunes only what feeds weight gradients; ``"all"`` also
            prunes the saved inputs/outputs of GELU, softmax, LayerNorm and attention, as the
            paper does for ViTs: less memory, approximate input gradients.
        exact: how the tensors kept exact by default are stored when their backward tolerates
            rounding (GELU/SiLU, LayerNorm, softmax and attention inputs, training batch norm's
            input: :attr:`~edgetorch.activations.roles.Need.quantizable`): None losslessly, or
            ``"int8"`` / ``"int4"`` / ``"int2"`` quantized (8 bits: 0.28x of float32). ReLU keeps
            its exact 1-bit mask; fused attention's q, k and logsumexp stay lossless.
        values: ``"int8"`` (or int4/int2) stores the kept top-k values themselves quantized, the
            paper's "Back Razor + Mesa" row; None keeps them in ``value_dtype``.
        rows: what one top-k selection spans when a layer flattens samples into rows (a Linear
            on ``(batch, tokens, features)`` saves a ``[batch x tokens, features]`` matrix):
            ``"sample"`` (default, as the paper's code) keeps the top-k of all of a sample's rows
            together, ``"token"`` of each row. The two tie on gradient fidelity
            (``bench/backrazor_rows.py``) and ViT transfer accuracy (``bench/backrazor_transfer.py``);
            the selection is cheaper per sample. Batch-first tensors (a CNN's) are per sample
            either way.

    Example:
        >>> with edgetorch.compress_activations(model, edgetorch.BackRazor(0.9)):
        ...     loss = criterion(model(x), y)
        >>> loss.backward()  # forward exact; weight gradients from the pruned copies
    """

    name = "backrazor"
    needs_roles = True
    narrows_integers = True
    sparsity: float = 0.9
    value_dtype: torch.dtype | None = None
    scope: str = "weights"
    exact: str | None = None
    values: str | None = None
    rows: str = "sample"

    def __post_init__(self) -> None:
        check_sparsity(self.sparsity)
        if self.value_dtype is not None and self.value_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"value_dtype must be None or one of {', '.join(map(str, FLOAT_DTYPES))}; "
                f"got {self.value_dtype!r}"
            )
        if self.scope not in _SCOPES:
            raise ValueError(f"scope must be one of {', '.join(_SCOPES)}; got {self.scope!r}")
        if self.rows not in _ROWS:
            raise ValueError(f"rows must be one of {', '.join(_ROWS)}; got {self.rows!r}")
        for key in ("exact", "values"):
            if getattr(self, key) is not None and getattr(self, key) not in _QUANTIZED:
                raise ValueError(f"{key} must be None or one of {', '.join(_QUANTIZED)}; got {getattr(self, key)!r}")
        if self.values is not None and self.value_dtype is not None:
            raise ValueError(f"give values={self.values!r} or value_dtype={_fmt(self.value_dtype)}, not both: "
                             "both say how the kept values are stored")

    def spec(self) -> str:
        """Always names the sparsity (``backrazor:sparsity=0.9``), the number every table needs."""
        rest = super().spec().partition(":")[2]
        rest = ",".join(a for a in rest.split(",") if a and not a.startswith("sparsity="))
        return f"backrazor:sparsity={self.sparsity:g}" + (f",{rest}" if rest else "")

    def form(self, need: Need) -> Form:
        if need.kind is NeedKind.EXACT and need.prunable and self.scope == "all":
            return PRUNE_FORM
        if self.exact is not None and need.quantizable:
            return quantized_form(_QUANTIZED[self.exact], need.kinks)
        return _exact_form(need)

    def per_sample(self, form: Form) -> bool:
        return form is PRUNE_FORM and self.rows == "sample"

    def covers(self, held: Form, wanted: Form) -> bool:
        """A quantized copy also serves the weight gradients that want a top-k copy: it is more
        exact, and already held (the attention output that the next Linear also saves; a
        top-k copy beside it cost ViT's out-projection a gradient cosine of 0.56). A sided copy
        does not: it keeps only the piece of each value outside the kinks."""
        return super().covers(held, wanted) or (
            wanted is PRUNE_FORM and held.kind is FormKind.QUANTIZED and held.interval is None)

    def encode(self, t: torch.Tensor, need: Need = EXACT):
        # Named, not self.encode_region: a subclass that overrides encode routes that back here.
        return BackRazor.encode_region(self, t, t.shape[0] if t.dim() else 1, need, self.form(need))

    def encode_region(self, t: torch.Tensor, rows: int, need: Need, form: Form):
        if form is PRUNE_FORM:
            kept = pack_topk(t, self.sparsity, rows=rows, value_dtype=self.value_dtype)
            return kept if self.values is None else quantize_values(kept, _QUANTIZED[self.values])
        if form.kind is FormKind.MASK:
            return _mask(t, need)
        if form.kind is FormKind.QUANTIZED:
            return _quantize(t, need, rows, form.bits)
        return _lossless(t)


def _lossless(t: torch.Tensor) -> BitmapTensor | None:
    """An exact form: the bitmap when it is smaller on CPU, else the tensor as it is."""
    if _cuda.gpu_path(t):
        # Finding out whether a bitmap would be smaller takes a host sync per tensor, which
        # stalls a GPU forward; what is kept exact (batch-norm, GELU and softmax inputs) has no
        # zeros to find, so on a GPU it is held as it is.
        return None
    return _LOSSLESS.encode(t)


_LOSSLESS = Bitmap()

def _fmt(v) -> str:
    return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else str(v)
