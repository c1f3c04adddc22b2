"""What autograd holds for one saved tensor inside :class:`~edgetorch.activations.compress_activations`.

A pack returns one of these, and autograd hands it back to unpack in backward:

* :class:`Kept`: the tensor as it is (a parameter, a tiny tensor, a position that does not
  compress), with its version for the in-place check PyTorch skips under hooks;
* :class:`View`: a tensor's geometry in an :class:`Entry`, which holds one region of one storage
  in one or more stored forms (exact, pruned, quantized, a mask) and decodes each once;
* :class:`Pending`: a pack whose op the role watcher has not seen yet (first steps only).

Also here: the region and row arithmetic the engine encodes by (:func:`span`, :func:`rows_of`,
:func:`sample_split`), and the stand-ins backward gets for shapes whose values it never reads.
"""

from __future__ import annotations

import math
import weakref

import torch

from .forms import EXACT_FORM, SHAPE_FORM, Form
from .roles import Need


class Entry:
    """One region of one storage, held in one or more stored forms.

    ``reps`` maps a :class:`~edgetorch.activations.forms.Form` (exact, prune, a mask, int8, shape) to what holds
    it: a codec object with ``.nbytes`` and ``.unpack()``. A form the policy ranks above another
    (an ``exact`` form above all; under Back Razor a quantized form above ``prune``) serves its
    views too: adding it drops the other's copy, and the other form then maps to it.
    """

    __slots__ = (
        "source", "version", "lo", "hi", "gathered", "reps", "records", "__weakref__",
    )

    def __init__(self, t: torch.Tensor, lo: int, hi: int, gathered: bool):
        self.source = weakref.ref(t)
        self.version = t._version
        self.lo, self.hi = lo, hi  # element range of the storage this entry covers
        # gathered: holds only t's own elements, row-major (t was a sparse view of its storage)
        self.gathered = geometry(t) if gathered else None
        self.reps: dict[Form, object] = {}
        # form -> index of its ledger row (for supersession); made by the first row (a ledger)
        self.records: dict[Form, int] | None = None

    def covers(self, t: torch.Tensor, lo: int, hi: int) -> bool:
        if self.source() is None or self.version != t._version:
            return False
        if self.gathered is not None:
            return self.gathered == geometry(t)
        return self.lo <= lo and hi <= self.hi

    def serves(self, form: Form, covers) -> bool:
        """Whether a held form stands in for ``form`` (``covers(held, wanted)``, the policy's
        order); if so, ``form`` is from now on read from it."""
        if form is SHAPE_FORM or form in self.reps:
            return True
        held = next((h for h in self.reps if covers(h, form)), None)
        if held is not None:
            self.reps[form] = self.reps[held]
        return held is not None

    def add(self, form: Form, rep, covers) -> list[Form]:
        """Hold ``rep`` for ``form``; returns the held forms it supersedes (those it covers:
        an exact form covers all), which are read from ``rep`` from now on."""
        if not self.reps:  # a new entry (most): nothing to supersede
            self.reps[form] = rep
            return []
        dropped = [f for f in self.reps if f != form and covers(form, f)]
        for f in (*dropped, form):
            self.reps[f] = rep
        return dropped

    def view_of(self, t: torch.Tensor, form: Form) -> View:
        # Only a shape's stand-in needs the device (t.device makes an object: one per saved tensor)
        device = t.device if form is SHAPE_FORM else None
        if self.gathered is not None:  # flat() returns t's own geometry
            return View(self, t.shape, t.stride(), None, form, t.dtype, device)
        return View(self, t.shape, t.stride(), t.storage_offset() - self.lo, form, t.dtype, device)

    def flat(self, form: Form) -> torch.Tensor:
        """The region in ``form`` as a dense tensor, decoded once for all the ops that saved it.

        The first decode replaces the packed form: a ReLU output read by the next convolution's
        backward and then by its own is decoded once, and from then on only the decoded tensor
        is held, which is what plain PyTorch holds all along. Holding the packed copy until the
        last reader would put both in memory at once (zoo CNN, batch 256: the step's peak rose
        10 MiB above dense while its forward held 22 MiB less). A retained graph or a repeated
        unpack reads the decoded tensor again; it is freed with the entry, when autograd drops
        the last view. A gathered entry decodes to the saved tensor's own strides: backward
        kernels choose their path by layout, and a row-major stand-in for a channel slice of a
        channels-last tensor changed depthwise convolution gradients in the last bits.
        """
        source = EXACT_FORM if EXACT_FORM in self.reps else form
        rep = self.reps[source]
        if isinstance(rep, (Region, Decoded)):
            return rep.tensor
        dense = rep.unpack()
        if self.gathered is not None:
            dense = restrided(dense, self.gathered)
        decoded = Decoded(dense)
        for f, held in self.reps.items():  # the packed copy is freed here, before backward allocates
            if held is rep:
                self.reps[f] = decoded
        return dense

    def live(self) -> torch.Tensor | None:
        """A tensor sharing the saved tensor's version counter, if one is still alive."""
        region = self.reps.get(EXACT_FORM)
        return region.probe if isinstance(region, Region) else self.source()


class Region:
    """An exact form that is the saved memory itself (it did not compress): no copy.

    ``probe`` is the detached saved tensor: it shares the version counter for the in-place check.
    """

    def __init__(self, region: torch.Tensor, probe: torch.Tensor):
        self.tensor, self.probe = region, probe
        self.nbytes = region.numel() * region.element_size()
        self.nnz = region.numel()

    def unpack(self) -> torch.Tensor:
        return self.tensor


class Decoded:
    """A form already decoded by backward, held in place of its packed copy (see ``Entry.flat``)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class View:
    """What autograd holds for a stored tensor: an entry, a form and the tensor's geometry in it."""

    __slots__ = ("entry", "size", "stride", "offset", "form", "dtype", "device")

    def __init__(self, entry: Entry, size, stride, offset: int, form: Form, dtype, device):
        self.entry, self.size, self.stride, self.offset = entry, size, stride, offset
        self.form, self.dtype, self.device = form, dtype, device

    def unpack(self) -> torch.Tensor:
        # The stored copy is the value at save time, but a later in-place change is still a
        # bug in the caller's code that plain PyTorch would report: report it too.
        entry = self.entry
        live = entry.live()
        if live is not None and live._version != entry.version:  # most: no call to check it
            check_version(live, entry.version)
        if self.form is SHAPE_FORM:  # backward reads only the shape (and the layout): zero bytes
            return stand_in(self.size, self.stride, self.dtype, self.device)
        base = entry.flat(self.form)  # a decoded copy, or the kept region in place
        if self.offset is None:  # a gathered entry decodes to this view's own geometry
            return base
        if not self.offset and base.shape == self.size and base.stride() == self.stride:
            return base  # the tensor held in its own shape: no view to make (a torch call each)
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.offset)


class Kept:
    """A tensor held as is, outside any entry; its version is checked on unpack, as PyTorch does."""

    __slots__ = ("tensor", "version")

    def __init__(self, alias: torch.Tensor, version: int):
        # An alias (see alias): no reference back to the graph node that holds this object
        # (that cycle would outlive a graph dropped unbackwarded).
        self.tensor, self.version = alias, version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:  # most saved tensors: no call to check it
            check_version(self.tensor, self.version)
        return self.tensor


class Pending:
    """A pack whose op is not known yet: :class:`OpWatch` resolves it at the op's edge."""

    __slots__ = ("tensor", "detached", "module", "target", "forced", "index")

    def __init__(self, t: torch.Tensor, module: tuple[str, str], forced: Need | None, index: int):
        # Aliased here, at autograd level: an alias made later, inside the dispatch mode,
        # would not share the version counter that catches in-place changes.
        self.tensor, self.detached = t, alias(t)
        self.module, self.target, self.forced, self.index = module, None, forced, index

    def unpack(self) -> torch.Tensor:
        if self.target is None:
            raise RuntimeError("edgetorch: a saved tensor was never resolved (engine bug)")
        return self.target.unpack()

    def release(self) -> None:
        """Hold the tensor as it is (a pack that could not be resolved, e.g. after an error)."""
        if self.target is None and self.detached is not None:
            self.target = Kept(self.detached, self.detached._version)
        self.tensor = self.detached = None


def alias(t: torch.Tensor) -> torch.Tensor:
    """What a pack holds for ``t``: ``t`` itself if it is a leaf, else a detached alias.

    A leaf (a parameter, the input batch, batch norm's saved statistics) has no graph node, so
    holding it makes no reference cycle, and plain PyTorch holds it so too; a detached alias
    would be one more object for the garbage collector per saved tensor (338 a step in
    mobilenet_v2). A tensor with a graph node is detached: the same storage and version counter,
    but no reference back to the node that holds the pack (a cycle through C++ that no
    collector could free).
    """
    return t if t.is_leaf else t.detach()


def check_version(t: torch.Tensor | None, version: int) -> None:
    """Raise as plain PyTorch would when a saved tensor was modified in place after saving."""
    if t is not None and t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
            f"expected version {version} instead (detected by edgetorch, whose hooks replace "
            "PyTorch's own check)."
        )


def kept_count(rep) -> int | torch.Tensor:
    """The values ``rep`` kept, as a device tensor where counting them would sync with the host
    (the ledger reads it after the step).

    ``lazy_nnz`` is the protocol's one optional member (:mod:`edgetorch.codecs.protocol`): it is
    looked up on the class, so the property runs only where it exists.
    """
    lazy = getattr(type(rep), "lazy_nnz", None)
    return rep.lazy_nnz if lazy is not None else rep.nnz


class Shape:
    """The form of a tensor whose values backward never reads: nothing is held."""

    nbytes = 0
    nnz = 0


SHAPE = Shape()


def rows_of(t: torch.Tensor, entry: Entry) -> int:
    """Rows for per-row codecs: the extent of ``t``'s outermost dimension in memory.

    For a batch-first tensor, or a transposed view of one, that is the batch: one row per sample.
    """
    if t.dim() == 0:
        return 1
    # Row-major: the first dimension has the largest stride (ties go to the first dimension too).
    outer = 0 if t.is_contiguous() else max(range(t.dim()), key=lambda d: (t.stride(d), -d))
    n = t.shape[outer]
    return n if n > 0 and (entry.hi - entry.lo) % n == 0 else 1


def sample_split(t: torch.Tensor, entry: Entry, batch: int | None,
                  token_major: bool) -> tuple[tuple[int, ...], int] | None:
    """The region of ``t`` as a shape in memory order and the position of the sample dimension
    in it, for a policy that selects per sample; None where the layout does not say.

    A Linear on ``(batch, tokens, features)`` saves a ``[batch x tokens, features]`` matrix
    (samples outermost); torch's ``nn.MultiheadAttention`` computes in ``(tokens, batch,
    features)`` order (``token_major``), so there a sample's rows are every ``batch``-th row.
    A dimension of the batch's extent further in (fused attention's q, k, v laid out
    ``(tokens, batch x heads, ...)``) is taken as the samples.
    """
    if not batch or entry.gathered is not None or entry.hi - entry.lo != t.numel() or entry.lo != t.storage_offset():
        return None
    if batch == 1:  # one sample: one row, whatever the layout
        return (1, t.numel()), 0
    dims = sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: -t.stride(d))
    shape = [t.shape[d] for d in dims]
    if not shape:
        return None
    if shape[0] == batch:
        return tuple(shape), 0
    if shape[0] % batch == 0:
        outer = (shape[0] // batch, batch) if token_major else (batch, shape[0] // batch)
        return (*outer, *shape[1:]), int(token_major)
    if batch in shape:
        return tuple(shape), shape.index(batch)
    return None


def encode_per_sample(policy, region: torch.Tensor, shape: tuple[int, ...], position: int, need: Need, form: Form):
    """Encode ``region`` (in memory order, ``shape``) in ``form`` one row per sample, the samples
    at ``position``: in place when they are outermost, else from a copy that gathers them."""
    if position == 0:
        return policy.encode_region(region, shape[0], need, form)
    moved = region.view(shape).movedim(position, 0)
    rep = policy.encode_region(moved.reshape(shape[position], -1), shape[position], need, form)
    return None if rep is None else SampleMajor(rep, tuple(moved.shape), position)


class Wrapper:
    """A stored form that holds another (``rep``) and answers for its bytes and kept values."""

    __slots__ = ("rep", "__weakref__")

    @property
    def nbytes(self) -> int:
        return self.rep.nbytes

    @property
    def nnz(self) -> int:
        return self.rep.nnz


class SampleMajor(Wrapper):
    """A form encoded from a copy with the samples gathered outermost; decodes to the region's
    own order (one more copy at decode, the price of per-sample rows in a token-major layout)."""

    __slots__ = ("shape", "position")

    def __init__(self, rep, shape: tuple[int, ...], position: int):
        self.rep, self.shape, self.position = rep, shape, position

    @property
    def lazy_nnz(self) -> int | torch.Tensor:
        return kept_count(self.rep)

    def unpack(self) -> torch.Tensor:
        return self.rep.unpack().reshape(self.shape).movedim(0, self.position).reshape(-1)


def span(t: torch.Tensor) -> tuple[int, int]:
    """Element range [lo, hi) of the storage that ``t`` touches."""
    lo = t.storage_offset()
    if t.is_contiguous():  # most saved tensors: no walk over the strides
        return lo, lo + t.numel()
    if t.numel() == 0:
        return lo, lo
    return lo, lo + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def geometry(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset())


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def restrided(dense: torch.Tensor, geometry: tuple) -> torch.Tensor:
    """``dense`` (row-major values) copied into a tensor with the saved tensor's own strides."""
    shape, stride, _ = geometry
    if 0 in stride:  # an expanded view: its strides cannot be written through; keep row-major
        return dense.view(shape)
    out = torch.empty_strided(shape, stride, dtype=dense.dtype, device=dense.device)
    return out.copy_(dense.view(shape))


def stand_in(size, stride, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``size`` for a backward that reads no values, laid out like the saved one.

    Row-major: a zero expanded to the size, which allocates nothing. Any other layout: an
    uninitialised tensor with those strides, because kernels pick their path by layout (a frozen
    batch norm's backward on a channels-last input computed different bits from a row-major
    stand-in). Its pages are never written, so on the CPU they never become resident.
    """
    if tuple(stride) == contiguous_strides(size) or math.prod(size) <= 1:
        return torch.zeros((), dtype=dtype, device=device).expand(size)
    return torch.empty_strided(size, stride, dtype=dtype, device=device)
