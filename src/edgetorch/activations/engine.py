"""The autograd integration: every tensor saved for backward inside the block goes through a policy.

Built on ``torch.autograd.graph.saved_tensors_hooks`` rather than custom autograd Functions, so
it works with any model unchanged and survives ``retain_graph`` (unpack never frees anything).
What the hooks alone would get wrong, and how this module handles it:

* One tensor saved by several ops (a ReLU output is also the next conv's input; Linear saves a
  view): entries are keyed by storage and version, and a later save that lies inside an
  earlier entry's memory becomes a view of it, so it is stored once.
* Parameters, buffers and the model's inputs are held by the caller anyway: encoding them
  would add a copy and free nothing, so they are passed through.
* Integer tensors are saved too, and max pooling's int64 indices take twice the bytes of its
  float32 output: policies that allow it hold them in the narrowest integer dtype (lossless).
* With hooks active PyTorch skips its in-place check; tensors kept as they are carry their
  version and are checked on unpack.
* Hooks are thread-local and only the innermost pair applies: a module that runs under
  another pair (non-reentrant checkpoint, torch.compile) is reported with a warning.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
import weakref

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten

from ..codecs import _cuda
from ..codecs.bitmap import CappedBitmapTensor
from ..codecs.narrow import WIDE_INTS, pack_narrow
from ..measure.ledger import SavedRecord, SavedTensorLedger
from .capacity import LateChecks, Wrapper, capacity
from .policies import Policy
from .roles import EXACT, Need, OpWatch, storage_address
from .tape import Slot, model_state, signature, tapes_of

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Entry:
    """One region of one storage, held in one or more stored forms.

    ``reps`` maps a form (``exact``, ``prune``, ``mask ...``, ``int8``, ``shape``) to what holds
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
        self.gathered = _geometry(t) if gathered else None
        self.reps: dict[str, object] = {}
        self.records: dict[str, int] = {}  # form -> index of its ledger row (for supersession)

    def covers(self, t: torch.Tensor, lo: int, hi: int) -> bool:
        if self.source() is None or self.version != t._version:
            return False
        if self.gathered is not None:
            return self.gathered == _geometry(t)
        return self.lo <= lo and hi <= self.hi

    def serves(self, form: str, covers) -> bool:
        """Whether a held form stands in for ``form`` (``covers(held, wanted)``, the policy's
        order); if so, ``form`` is from now on read from it."""
        if form == "shape" or form in self.reps:
            return True
        held = next((h for h in self.reps if covers(h, form)), None)
        if held is not None:
            self.reps[form] = self.reps[held]
        return held is not None

    def add(self, form: str, rep, covers) -> list[str]:
        """Hold ``rep`` for ``form``; returns the held forms it supersedes (those it covers:
        an exact form covers all), which are read from ``rep`` from now on."""
        dropped = [f for f in self.reps if f != form and covers(form, f)]
        for f in (*dropped, form):
            self.reps[f] = rep
        return dropped

    def view_of(self, t: torch.Tensor, form: str) -> _View:
        if self.gathered is not None:  # flat() returns t's own geometry
            return _View(self, t.shape, t.stride(), None, form, t.dtype, t.device)
        return _View(self, t.shape, t.stride(), t.storage_offset() - self.lo, form, t.dtype, t.device)

    def flat(self, form: str) -> torch.Tensor:
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
        source = "exact" if "exact" in self.reps else form
        rep = self.reps[source]
        if isinstance(rep, (_Region, _Decoded)):
            return rep.tensor
        dense = rep.unpack()
        if self.gathered is not None:
            dense = _restrided(dense, self.gathered)
        decoded = _Decoded(dense)
        for f, held in self.reps.items():  # the packed copy is freed here, before backward allocates
            if held is rep:
                self.reps[f] = decoded
        return dense

    def live(self) -> torch.Tensor | None:
        """A tensor sharing the saved tensor's version counter, if one is still alive."""
        region = self.reps.get("exact")
        return region.probe if isinstance(region, _Region) else self.source()


class _Region:
    """An exact form that is the saved memory itself (it did not compress): no copy.

    ``probe`` is the detached saved tensor: it shares the version counter for the in-place check.
    """

    def __init__(self, region: torch.Tensor, probe: torch.Tensor):
        self.tensor, self.probe = region, probe
        self.nbytes = region.numel() * region.element_size()
        self.nnz = region.numel()

    def unpack(self) -> torch.Tensor:
        return self.tensor


class _Decoded:
    """A form already decoded by backward, held in place of its packed copy (see ``_Entry.flat``)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _View:
    """What autograd holds for a stored tensor: an entry, a form and the tensor's geometry in it."""

    __slots__ = ("entry", "size", "stride", "offset", "form", "dtype", "device")

    def __init__(self, entry: _Entry, size, stride, offset: int, form: str, dtype, device):
        self.entry, self.size, self.stride, self.offset = entry, size, stride, offset
        self.form, self.dtype, self.device = form, dtype, device

    def unpack(self) -> torch.Tensor:
        # The stored copy is the value at save time, but a later in-place change is still a
        # bug in the caller's code that plain PyTorch would report: report it too.
        _check_version(self.entry.live(), self.entry.version)
        if self.form == "shape":  # backward reads only the shape (and the layout): zero bytes
            return _stand_in(self.size, self.stride, self.dtype, self.device)
        base = self.entry.flat(self.form)  # a decoded copy, or the kept region in place
        if self.offset is None:  # a gathered entry decodes to this view's own geometry
            return base
        if not self.offset and base.shape == self.size and base.stride() == self.stride:
            return base  # the tensor held in its own shape: no view to make (a torch call each)
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.offset)


class _Kept:
    """A tensor held as is, outside any entry; its version is checked on unpack, as PyTorch does."""

    __slots__ = ("tensor", "version")

    def __init__(self, alias: torch.Tensor, version: int):
        # An alias (see _alias): no reference back to the graph node that holds this object
        # (that cycle would outlive a graph dropped unbackwarded).
        self.tensor, self.version = alias, version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:  # most saved tensors: no call to check it
            _check_version(self.tensor, self.version)
        return self.tensor


class _Pending:
    """A pack whose op is not known yet: :class:`OpWatch` resolves it at the op's edge."""

    __slots__ = ("tensor", "detached", "module", "target", "forced", "index")

    def __init__(self, t: torch.Tensor, module: tuple[str, str], forced: Need | None, index: int):
        # Aliased here, at autograd level: an alias made later, inside the dispatch mode,
        # would not share the version counter that catches in-place changes.
        self.tensor, self.detached = t, _alias(t)
        self.module, self.target, self.forced, self.index = module, None, forced, index

    def unpack(self) -> torch.Tensor:
        if self.target is None:
            raise RuntimeError("edgetorch: a saved tensor was never resolved (engine bug)")
        return self.target.unpack()

    def release(self) -> None:
        """Hold the tensor as it is (a pack that could not be resolved, e.g. after an error)."""
        if self.target is None and self.detached is not None:
            self.target = _Kept(self.detached, self.detached._version)
        self.tensor = self.detached = None


def _alias(t: torch.Tensor) -> torch.Tensor:
    """What a pack holds for ``t``: ``t`` itself if it is a leaf, else a detached alias.

    A leaf (a parameter, the input batch, batch norm's saved statistics) has no graph node, so
    holding it makes no reference cycle, and plain PyTorch holds it so too; a detached alias
    would be one more object for the garbage collector per saved tensor (338 a step in
    mobilenet_v2). A tensor with a graph node is detached: the same storage and version counter,
    but no reference back to the node that holds the pack (a cycle through C++ that no
    collector could free).
    """
    return t if t.is_leaf else t.detach()


def _check_version(t: torch.Tensor | None, version: int) -> None:
    """Raise as plain PyTorch would when a saved tensor was modified in place after saving."""
    if t is not None and t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
            f"expected version {version} instead (detected by edgetorch, whose hooks replace "
            "PyTorch's own check)."
        )


class compress_activations(contextlib.ContextDecorator):
    """Store what autograd saves for backward under ``policy`` while the block runs.

    Run the forward pass inside the block; backward runs after it as usual. Also usable as a
    decorator on a function that runs the forward pass.

    Args:
        model: the module whose forward runs in the block. Its parameters, buffers and inputs
            are never re-encoded; its submodules name the ledger rows.
        policy: e.g. :class:`edgetorch.Bitmap` (BitTrain) or :class:`edgetorch.Dense`.
        min_bytes: tensors smaller than this stay as they are (encoding them saves nothing).
        ledger: a :class:`edgetorch.SavedTensorLedger` to fill with one row per saved tensor.
        keep: further tensors the caller holds (inputs not passed through ``model``'s call);
            like the model's own inputs they are never re-encoded.

    Example:
        >>> with edgetorch.compress_activations(model, edgetorch.Bitmap()):
        ...     loss = criterion(model(x), y)
        >>> loss.backward()  # gradients bit-identical to plain PyTorch
    """

    def __init__(
        self,
        model: nn.Module,
        policy: Policy,
        *,
        min_bytes: int = 4096,
        ledger: SavedTensorLedger | None = None,
        keep: tuple[torch.Tensor, ...] = (),
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(policy, Policy):
            raise TypeError(
                f"policy must be an edgetorch Policy (Bitmap(), Dense(), ...), got {policy!r}; "
                "use edgetorch.parse_policy('bitmap:threshold=0.01') to build one from a string"
            )
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int, got {min_bytes!r}")
        self.model, self.policy, self.min_bytes, self.ledger = model, policy, min_bytes, ledger
        self._keep = {storage_address(t) for t in keep}
        self.saved_count = 0

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> compress_activations:
        self._check_can_act()
        # One bound object, so the hook on top can be recognised. Made here and dropped at exit:
        # held from __init__ on, it made the block a reference cycle that kept the model (and
        # what the block held) alive until the garbage collector ran, which freed it in the middle
        # of a later step's forward (a negative forward increase was measured on an H100).
        self._pack_fn = self._pack
        self._tapes = tapes_of(self.model)
        # A policy that stores nothing in another form, with nothing to record: each pack is held
        # as plain PyTorch would hold it, with no dedupe or lookup (so no walk over the parameters
        # to tell them apart either: 0.1 ms a step for mobilenet_v2).
        self._as_is = not self.policy.encodes and self.ledger is None
        storages, state = (set(), None) if self._as_is else model_state(self.model, self._tapes)
        self._external = storages | self._keep
        self._inputs: set[int] = set()
        self._batch: int | None = None  # the model input's first extent: samples, for per-sample rows
        self._table: dict[tuple, list[weakref.ref]] = {}
        self._root = ("", type(self.model).__name__)
        self._stack: list[tuple] = [(id(self.model), self._root)]
        self._forward_with_grad = False
        self._warned: set[str] = set()
        self._thread = threading.get_ident()
        self._exits = contextlib.ExitStack()
        self._watch = None
        self._handles: list = []
        self._modules_hooked = False
        # Roles come from a tape recorded on an earlier step of this model (no dispatch mode, no
        # module hooks), else from watching this step, which records one (see .tape).
        self._roles = self.ledger is not None or self.policy.needs_roles
        # Bitmaps on the GPU path: sized from an earlier step's counts, checked late (.capacity).
        self._sized = self.policy.sized_by_count
        self._checks: LateChecks | None = None
        self._uncompressed: dict[int, int] | None = None  # see _held_as_is
        self._index = 0  # the pack being stored: its position in the step
        nested = self._tapes.busy
        self._owns_tapes = not nested
        self._candidates: list[list[Slot]] | None = None  # replaying: the tapes still matched
        self._undecided: list | None = None  # tapes to choose from by the input signature
        self._signature: tuple | None = None
        self._recording: list[Slot | None] | None = None
        self._missed = False
        try:
            if self._roles and not nested:
                tapes = self._tapes.for_state(state)
                if tapes and not self._tapes.watch:
                    self._undecided = tapes
                else:
                    self._watch_and_record()
            elif self._roles:
                self._start_watching()
            elif not self._tapes.seen or nested:
                self._hook_modules()
            self._exits.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack_fn, self._unpack))
        except BaseException:
            self._exits.close()
            self._unhook()
            raise
        self._tapes.busy = True
        # Registered last: nothing after it can fail and leave it behind.
        self._handles.append(self.model.register_forward_pre_hook(self._note_inputs, with_kwargs=True))
        return self

    def _hook_modules(self) -> None:
        """Name each pack's module: two process-wide module hooks instead of two per module
        (registering and removing ~250 handles for a ResNet cost 0.4 ms per step, 4% of an 11 ms
        GPU step). They fire for every module on every thread, so they keep to this model and this
        thread. Only watched steps (and a model's first block, for the warnings) pay for them."""
        if self._modules_hooked:
            return
        self._tapes.seen = self._modules_hooked = True
        self._names = {id(m): (name, type(m).__name__) for name, m in self.model.named_modules()}
        self._handles += [register_module_forward_pre_hook(self._enter_module),
                          register_module_forward_hook(self._leave_module, always_call=True)]

    def _start_watching(self) -> None:
        """Push the dispatch mode that tells each pack's op, and the module hooks."""
        # Deferred packs must be resolved even if the forward raises, or they would hold their
        # tensors: the flush is registered before the mode, so it runs after it.
        self._exits.callback(self._flush)
        self._watch = self._exits.enter_context(OpWatch(self._resolve, self._is_external))
        self._hook_modules()

    def _watch_and_record(self) -> None:
        """Watch this step and keep what it learns as a tape."""
        self._recording = []
        self._start_watching()

    def _unhook(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __exit__(self, *exc) -> bool:
        try:
            self._exits.close()
        finally:  # process-wide hooks must never outlive the block, even if the flush raised
            self._unhook()
            self._table.clear()
            self._checks = None  # the tensors stored hold it until their counts are looked at
            if self._owns_tapes:
                self._tapes.busy = False
        recorded = self._recording
        if exc[0] is None and recorded and all(slot is not None for slot in recorded):
            self._tapes.keep(self._signature, recorded)
        elif self._missed:
            self._tapes.missed()
        if exc[0] is None and self._forward_with_grad and self.saved_count == 0:
            warnings.warn(
                "compress_activations saw no saved tensor although the model ran with gradients "
                "enabled: the forward ran under torch.compile or inside another "
                "saved_tensors_hooks context, so nothing was compressed.",
                stacklevel=2,
            )
        elif exc[0] is None and self.saved_count and _is_compiled(self.model):
            self._warn_compiled()
        self._pack_fn = self._watch = None  # bound to this block: cycles (see __enter__)
        return False

    def _warn_compiled(self) -> None:
        """Say what happened to a torch.compile'd model, which depends on the dispatch mode.

        Measured on torch 2.14 (tests/test_engine_corners.py checks it on the installed torch):
        with the dispatch mode that tells op roles (BackRazor, or any policy with a ledger),
        dynamo runs the model eagerly, so compression works and compile is lost. Without it,
        the compiled graph runs and the tensors it saves reach the hooks as one opaque
        autograd Function's: they are stored losslessly, without per-op roles.
        """
        if self._watch is not None:
            what = ("its activations were compressed, but the model ran eagerly: torch.compile "
                    "falls back to eager under the dispatch mode edgetorch uses to tell each op's "
                    "role (BackRazor, or any policy with a ledger), so compile's speed is lost")
        else:
            what = ("the compiled graph ran and the tensors it saves for backward were compressed "
                    "losslessly as one opaque function's, without per-op roles or deduplication")
        warnings.warn(
            f"compress_activations got a torch.compile'd model ({self.saved_count} saved tensors "
            f"seen, torch {torch.__version__}): {what}. Pass the uncompiled module for the "
            "documented behaviour.",
            stacklevel=3,
        )

    def _check_can_act(self) -> None:
        if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
            warnings.warn(
                "compress_activations entered inside another saved_tensors_hooks context "
                "(a non-reentrant checkpoint or another tool): only the innermost hooks apply, "
                "so the outer ones will not see tensors saved in this block.",
                stacklevel=3,
            )

    # -- module hooks -------------------------------------------------------------------------
    def _note_inputs(self, module, args, kwargs):
        leaves, _ = tree_flatten((args, kwargs))
        if self.saved_count == 0 and self._signature is None:
            self._signature = signature(leaves)
        if self._undecided is not None and self.saved_count == 0:
            # Before the forward's first op: replay a tape of this input signature, or watch the
            # whole step (the mode starts cleanly here, between ops).
            tapes = [tape for sig, tape in self._undecided if sig == self._signature]
            self._undecided = None
            if tapes:
                self._candidates = tapes
            else:
                self._watch_and_record()
        self._inputs = {storage_address(x) for x in leaves if isinstance(x, torch.Tensor)}
        self._batch = next((x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim()), None)
        self._forward_with_grad |= torch.is_grad_enabled()

    def _enter_module(self, module, args) -> None:
        info = self._names.get(id(module))
        if info is None or threading.get_ident() != self._thread:
            return
        self._stack.append((id(module), info))
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if torch.is_grad_enabled() and (top is None or top[0] is not self._pack_fn):
            self._warn_once(
                f"module {info[0] or '<root>'} ({info[1]}) runs under another "
                "saved_tensors_hooks context (non-reentrant torch.utils.checkpoint, "
                "torch.compile or another tool): the tensors it saves are not compressed. "
                "Use edgetorch.CheckpointEvery or use_reentrant=True checkpointing."
            )

    def _leave_module(self, module, args, output) -> None:
        # A module entered before the hooks were registered (watching began at the model's
        # pre-hook, inside the root's call) was never pushed.
        if self._stack[-1][0] == id(module) and len(self._stack) > 1 and threading.get_ident() == self._thread:
            self._stack.pop()

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=4)

    # -- saved tensor hooks -------------------------------------------------------------------
    def _is_external(self, t: torch.Tensor) -> bool:
        return storage_address(t) in self._external

    def _pack(self, t: torch.Tensor):
        index = self._index = self.saved_count
        self.saved_count = index + 1
        if self._as_is:  # nothing to encode or record: held as PyTorch holds it (_alias, inlined)
            return _Kept(t if t.is_leaf else t.detach(), t._version)
        if self._undecided is not None:  # a pack before the model's call: any tape of this state
            self._candidates, self._undecided = [tape for _, tape in self._undecided], None
        if self._candidates:  # replaying: the tapes whose slots this step's packs matched so far
            candidates = self._candidates
            if len(candidates) == 1:  # the usual case: one tape, no list to build
                tape = candidates[0]
                live = candidates if index < len(tape) and tape[index].matches(t) else None
            else:
                live = [tape for tape in candidates if index < len(tape) and tape[index].matches(t)]
            if live:
                self._candidates = live
                slot = live[0][index]
                return self._hold(t, _alias(t), slot.need, slot.module, slot.param_copy)
            # On no tape: exact from here on (see .tape: watching cannot start mid-step).
            self._candidates, self._missed = None, True
        if self._watch is None:
            return self._hold(t, _alias(t), EXACT, self._stack[-1][1], False)
        forced = EXACT if self._watch.after_grad_free_op else None
        pending = _Pending(t, self._stack[-1][1], forced, index)
        self._watch.pending.append(pending)
        return pending

    def _resolve(self, pending: _Pending, need: Need) -> None:
        t, need = pending.tensor, pending.forced or need
        param_copy = self._watch.is_param(t)
        if self._recording is not None:
            slots = self._recording
            slots.extend([None] * (pending.index + 1 - len(slots)))
            slots[pending.index] = Slot(t, need, pending.module, param_copy)
        self._index = pending.index  # the position the stored form is sized by (.capacity)
        pending.target = self._hold(t, pending.detached, need, pending.module, param_copy)
        pending.tensor = pending.detached = None

    def _hold(self, t: torch.Tensor, d: torch.Tensor, need: Need, module: tuple[str, str], param_copy: bool):
        """Store ``t`` (``d``: its alias made at autograd level, see :func:`_alias`) for ``need``.

        ``param_copy``: autocast's low-precision copy of a weight (the dispatch mode saw it made).
        """
        ptr = storage_address(t)
        if ptr in self._external or ptr in self._inputs or (t.is_leaf and t.requires_grad):
            self._record(t, module, "external", 0, 0, 0, need)
            return _Kept(d, t._version)
        if param_copy:
            # autocast's low-precision copy of a weight: autograd holds it in plain PyTorch too
            # (so it is counted), but it has no activation sparsity to find
            nbytes = t.numel() * t.element_size()
            self._record(t, module, "dense", nbytes, nbytes, t.numel(), need)
            return _Kept(d, t._version)
        nbytes = t.numel() * t.element_size()
        narrowable = t.dtype in WIDE_INTS and self.policy.narrows_integers
        if (t.dtype not in _FLOATS and not narrowable) or nbytes < self.min_bytes:
            self._record(t, module, "dense", nbytes, nbytes, t.numel(), need)
            return _Kept(d, t._version)
        if not self._roles and self._held_as_is().get(self._index) == t.numel():
            # Did not compress at this position before (.capacity): held as it is, with no entry.
            # Without roles every pack takes the one form, so no later pack of this storage
            # could want another form that the dense copy would have served; and no ledger.
            return _Kept(d, t._version)
        return self._save(t, d, need, module, ptr)

    def _held_as_is(self) -> dict[int, int]:
        """Positions of this model, input signature and policy whose exact form did not compress."""
        if self._uncompressed is None:
            self._uncompressed = self._tapes.capacities.held_as_is(self._signature, self.policy)
        return self._uncompressed

    def _flush(self) -> None:
        if self._watch is not None:
            self._watch.flush()

    def _save(self, t: torch.Tensor, d: torch.Tensor, need: Need, module: tuple[str, str], ptr: int):
        form = self.policy.form(need) if t.dtype in _FLOATS else "exact"  # integers: never pruned
        lo, hi = _span(t)
        key = (ptr, t.dtype)
        for ref in self._table.get(key, ()):
            entry = ref()
            if entry is not None and entry.covers(t, lo, hi):
                if entry.serves(form, self.policy.covers):
                    self._record(t, module, "shared", 0, 0, 0, need, form)
                else:
                    self._encode(entry, t, d, need, form, module, dense_bytes=0)
                return entry.view_of(t, form)
        # Dense enough: store the storage region, so later views of it can share the entry;
        # a sparse view of a big storage (every third row, say) stores only its own elements.
        entry = _Entry(t, lo, hi, gathered=hi - lo > 2 * t.numel())
        self._encode(entry, t, d, need, form, module, dense_bytes=(hi - lo if entry.gathered is None else t.numel()) * t.element_size())
        self._table.setdefault(key, []).append(weakref.ref(entry))
        return entry.view_of(t, form)

    def _encode(self, entry: _Entry, t, d, need: Need, form: str, module, dense_bytes: int) -> None:
        """Add ``form`` to ``entry``; ``dense_bytes`` is what plain PyTorch holds (0 if shared)."""
        if entry.gathered is not None:
            region, rows = d.reshape(-1), (t.shape[0] if t.dim() else 1)
        elif entry.hi - entry.lo == t.numel() and t.is_contiguous():
            # Most saved tensors: t is its whole region, held in its own shape (on a GPU host every
            # torch call, a view included, costs microseconds, for each of a step's saved tensors)
            region, rows = d, _rows(t, entry)
        else:
            region, rows = torch.as_strided(d, (entry.hi - entry.lo,), (1,), entry.lo), _rows(t, entry)
        if form == "shape":
            rep = _SHAPE
        else:
            floating = region.dtype in _FLOATS
            split = self.policy.per_sample(form) and _sample_split(t, entry, self._batch, module[1] == "MultiheadAttention")
            if not floating:
                rep = pack_narrow(region, need.bound)
            elif split:
                rep = _encode_per_sample(self.policy, region, *split, need)
            elif self._sized and _cuda.gpu_path(region):
                rep = self._encode_sized(region.view(rows, -1), need, entry, form)
            else:
                rep = self._encode_exact_once(region, rows, need, form, dense_bytes)
            region_bytes = region.numel() * region.element_size()
            if rep is None or rep.nbytes >= region_bytes:
                # Never worse than plain PyTorch: what does not compress is held as it is (a
                # gathered view as itself, so that backward sees its own strides).
                form, rep = "exact", _Region(d if entry.gathered is not None else region, d)
        superseded = entry.add(form, rep, self.policy.covers)
        storage = "dense" if isinstance(rep, _Region) else "stored"
        # A form added to an entry already counted adds bytes, not elements.
        if self.ledger is None:  # only a ledger reads the kept counts
            return
        kept = _kept_count(rep)
        numel, nnz = (region.numel(), kept) if dense_bytes else (0, 0)
        entry.records[form] = self._record(t, module, storage, dense_bytes, rep.nbytes, numel, need, form, nnz)
        self._supersede(entry, superseded, kept)
        if rep.nbytes:
            self.ledger.hold(rep.nbytes)
            weakref.finalize(rep, self.ledger.release, rep.nbytes)

    def _encode_exact_once(self, region: torch.Tensor, rows: int, need: Need, form: str, dense_bytes: int):
        """``policy.encode`` of ``region``, except where its exact form did not compress at this
        position before: None then, without looking (.capacity); a new such position is noted."""
        as_is = self._held_as_is() if form == "exact" and dense_bytes else None
        if as_is is not None and as_is.get(self._index) == region.numel():
            return None
        rep = self.policy.encode(region.view(rows, -1), need)
        if as_is is not None and (rep is None or rep.nbytes >= region.numel() * region.element_size()):
            as_is[self._index] = region.numel()
        return rep

    def _encode_sized(self, x: torch.Tensor, need: Need, entry: _Entry, form: str):
        """Encode ``x`` into value slots sized from the count kept at this position of an earlier
        step, with no host sync; its count is checked later (see .capacity). Where none was seen,
        exactly, reading its count (one sync), which sizes the next step's."""
        if self._checks is None:
            self._checks = LateChecks(self._tapes.capacities.of(self._signature))
        counts = self._checks.counts
        slots = capacity(counts, self._index, x.numel())
        if slots is None:
            rep = self.policy.encode(x, need)
            counts[self._index] = (x.numel(), x.numel() if rep is None else rep.nnz)
            return rep
        rep = self.policy.encode(x, need, capacity=slots)
        if not isinstance(rep, CappedBitmapTensor):
            return rep
        repack = _Repack(self.policy, need, self.ledger, entry, form)
        return self._checks.track(rep, x, self._index, repack)

    def _supersede(self, entry: _Entry, forms: list[str], nnz: int) -> None:
        """Zero the stored bytes of ledger rows whose forms an exact form replaced.

        A log-softmax output stored pruned (for its own backward, under ``scope="all"``) and
        then saved exactly by the loss holds only the exact copy; counting both made GPT-2's
        ledger exceed dense (1.075x). The first row keeps the tensor's elements and takes the
        exact form's kept count.
        """
        for form in forms:
            index = entry.records.pop(form, None)
            if index is None:
                continue
            self.ledger.supersede(index, nnz)

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        return packed.unpack()

    def _record(self, t, module, storage, dense_bytes, stored_bytes, numel, need=EXACT, form="exact",
                nnz=None) -> int | None:
        if self.ledger is None:
            return None
        return self.ledger.add(
            SavedRecord(
                module=module[0],
                module_type=module[1],
                op=need.op,
                shape=tuple(t.shape),
                dtype=str(t.dtype).removeprefix("torch."),
                storage=storage,
                dense_bytes=dense_bytes,
                stored_bytes=stored_bytes,
                numel=numel,
                nnz=numel if nnz is None else nnz,
                form=form,
            )
        )


class _Repack:
    """Store a tensor exactly after its capped bitmap overflowed (rare: see .capacity), and
    restate its ledger row."""

    __slots__ = ("policy", "need", "ledger", "entry", "form")

    def __init__(self, policy: Policy, need: Need, ledger: SavedTensorLedger | None, entry: _Entry, form: str):
        self.policy, self.need, self.ledger, self.form = policy, need, ledger, form
        self.entry = weakref.ref(entry)  # an entry holds what holds this: no cycle

    def __call__(self, source: torch.Tensor, held) -> object:
        rep = self.policy.encode(source, self.need)  # exact size: one sync
        rep = _Region(source, source) if rep is None else rep
        entry = self.entry()
        index = None if entry is None or self.ledger is None else entry.records.get(self.form)
        if index is not None:
            self.ledger.restate(index, rep.nbytes, "dense" if isinstance(rep, _Region) else "stored")
            self.ledger.hold(rep.nbytes - held.nbytes)
            weakref.finalize(held, self.ledger.release, rep.nbytes - held.nbytes)
        return rep


def _kept_count(rep) -> int | torch.Tensor:
    """The values ``rep`` kept, as a device tensor where counting them would sync with the host
    (the ledger reads it after the step)."""
    lazy = getattr(type(rep), "lazy_nnz", None)
    return rep.lazy_nnz if lazy is not None else rep.nnz


class _Shape:
    """The form of a tensor whose values backward never reads: nothing is held."""

    nbytes = 0
    nnz = 0


_SHAPE = _Shape()


def _is_compiled(model: nn.Module) -> bool:
    return type(model).__name__ == "OptimizedModule"


def _rows(t: torch.Tensor, entry: _Entry) -> int:
    """Rows for per-row codecs: the extent of ``t``'s outermost dimension in memory.

    For a batch-first tensor, or a transposed view of one, that is the batch: one row per sample.
    """
    if t.dim() == 0:
        return 1
    # Row-major: the first dimension has the largest stride (ties go to the first dimension too).
    outer = 0 if t.is_contiguous() else max(range(t.dim()), key=lambda d: (t.stride(d), -d))
    n = t.shape[outer]
    return n if n > 0 and (entry.hi - entry.lo) % n == 0 else 1


def _sample_split(t: torch.Tensor, entry: _Entry, batch: int | None,
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


def _encode_per_sample(policy, region: torch.Tensor, shape: tuple[int, ...], position: int, need: Need):
    """Encode ``region`` (in memory order, ``shape``) one row per sample, the samples at
    ``position``: in place when they are outermost, else from a copy that gathers them."""
    if position == 0:
        return policy.encode(region.view(shape[0], -1), need)
    moved = region.view(shape).movedim(position, 0)
    rep = policy.encode(moved.reshape(shape[position], -1), need)
    return None if rep is None else _SampleMajor(rep, tuple(moved.shape), position)


class _SampleMajor(Wrapper):
    """A form encoded from a copy with the samples gathered outermost; decodes to the region's
    own order (one more copy at decode, the price of per-sample rows in a token-major layout)."""

    __slots__ = ("shape", "position")

    def __init__(self, rep, shape: tuple[int, ...], position: int):
        self.rep, self.shape, self.position = rep, shape, position

    @property
    def lazy_nnz(self) -> int | torch.Tensor:
        return _kept_count(self.rep)

    def unpack(self) -> torch.Tensor:
        return self.rep.unpack().reshape(self.shape).movedim(0, self.position).reshape(-1)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Element range [lo, hi) of the storage that ``t`` touches."""
    lo = t.storage_offset()
    if t.is_contiguous():  # most saved tensors: no walk over the strides
        return lo, lo + t.numel()
    if t.numel() == 0:
        return lo, lo
    return lo, lo + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _geometry(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset())


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _restrided(dense: torch.Tensor, geometry: tuple) -> torch.Tensor:
    """``dense`` (row-major values) copied into a tensor with the saved tensor's own strides."""
    shape, stride, _ = geometry
    if 0 in stride:  # an expanded view: its strides cannot be written through; keep row-major
        return dense.view(shape)
    out = torch.empty_strided(shape, stride, dtype=dense.dtype, device=dense.device)
    return out.copy_(dense.view(shape))


def _stand_in(size, stride, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``size`` for a backward that reads no values, laid out like the saved one.

    Row-major: a zero expanded to the size, which allocates nothing. Any other layout: an
    uninitialised tensor with those strides, because kernels pick their path by layout (a frozen
    batch norm's backward on a channels-last input computed different bits from a row-major
    stand-in). Its pages are never written, so on the CPU they never become resident.
    """
    if tuple(stride) == _contiguous_strides(size) or math.prod(size) <= 1:
        return torch.zeros((), dtype=dtype, device=device).expand(size)
    return torch.empty_strided(size, stride, dtype=dtype, device=device)
