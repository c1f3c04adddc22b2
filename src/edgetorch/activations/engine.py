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

What a pack returns, and the region arithmetic, live in :mod:`.held`; how bitmaps are sized on a
GPU without a sync, and which positions are not looked at again, in :mod:`.capacity`; which op
saved a tensor and what its backward needs, in :mod:`.roles` and :mod:`.tape`; what a replayed
pack's slot fixes (its policy, form, or that it is held as it is), decided once, in :mod:`.replay`.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import warnings
import weakref

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten

from ..codecs import _cuda
from ..codecs.narrow import pack_narrow
from ..measure.ledger import SavedRecord, SavedTensorLedger
from .capacity import LateChecks
from .compiled import is_compiled, warn_compiled
from .forms import EXACT_FORM, SHAPE_FORM, Form
from .held import (SHAPE, Entry, Kept, Pending, Region, alias, encode_per_sample, kept_count, rows_of, sample_split,
                   span)
from .policies import Policy
from .replay import FLOATS as _FLOATS
from .replay import decide, plan_for
from .roles import EXACT, Need, OpWatch, storage_address
from .tape import Slot, model_state, signature, tapes_of

# autograd's unpack hook: every packed object answers unpack(); a C callable, no Python frame
# between autograd and it (the hook runs once per saved tensor of every backward).
_UNPACK = operator.methodcaller("unpack")


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
        # Each saved tensor's policy by the name of the module that saved it (a PerBlock plan
        # names one per block); one dict lookup per tensor, the policy itself where none is named.
        self._by_module, self._default = self.policy.by_module(self.model)
        self._checks: LateChecks | None = None
        self._uncompressed: dict[int, int] | None = None  # see _held_as_is
        self._index = 0  # the pack being stored: its position in the step
        nested = self._tapes.busy
        self._owns_tapes = not nested
        self._candidates: list[list[Slot]] | None = None  # replaying: the tapes still matched
        self._plan_tape: list[Slot] | None = None  # the tape whose plan _plan is (see .replay)
        self._plan: list = []
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
            self._exits.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack_fn, _UNPACK))
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
        elif exc[0] is None and self.saved_count and is_compiled(self.model):
            warn_compiled(self._watch is not None, self.saved_count)
        self._pack_fn = self._watch = None  # bound to this block: cycles (see __enter__)
        return False

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
        if not torch.is_grad_enabled():
            return
        self._past_custom_functions()
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if top is None or top[0] is not self._pack_fn:
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
            if torch.is_grad_enabled():
                self._past_custom_functions()

    def _past_custom_functions(self) -> None:
        """A module entered or left with gradients on runs outside any custom autograd Function's
        forward (those run with them off), so the packs that follow are not that Function's: they
        take the role of the op that saves them (a block recomputed by reentrant checkpointing
        ends in a gradient-free op, and the next block's first input was held exact before)."""
        if self._watch is not None:
            self._watch.after_grad_free_op = False

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
        if self._as_is:  # nothing to encode or record: held as PyTorch holds it (alias, inlined)
            return Kept(t if t.is_leaf else t.detach(), t._version)
        if self._undecided is not None:  # a pack before the model's call: any tape of this state
            self._candidates, self._undecided = [tape for _, tape in self._undecided], None
        if self._candidates:  # replaying: the tapes whose slots this step's packs matched so far
            candidates = self._candidates
            if len(candidates) == 1:  # the usual case: one tape, no list to build
                tape = candidates[0]
                slot = tape[index] if index < len(tape) else None
                # slot.matches(t), inlined: every pack of a steady step passes here
                live = candidates if slot is not None and slot.shape == t.shape and slot.dtype is t.dtype \
                    and slot.node is type(t.grad_fn) else None
            else:
                live = [tape for tape in candidates if index < len(tape) and tape[index].matches(t)]
                slot = live[0][index] if live else None
            if live:
                self._candidates = live
                if self.ledger is not None:
                    return self._hold(t, alias(t), slot.need, slot.module, slot.param_copy)
                # What the slot fixes, from the tape's plan (.replay); most packs end here, so
                # this part of _hold is inlined (a call per saved tensor is ~1% of the step)
                if live[0] is not self._plan_tape:
                    self._plan_tape = live[0]
                    self._plan = plan_for(self._tapes, live[0], self.policy, self._by_module, self._default,
                                          self.min_bytes)
                step = self._plan[index]
                d = t if t.is_leaf else t.detach()  # alias(t), inlined
                if step is None:
                    return Kept(d, t._version)
                return self._replay(t, d, slot, step)
            # On no tape: exact from here on (see .tape: watching cannot start mid-step).
            self._candidates, self._missed = None, True
        if self._watch is None:
            return self._hold(t, t if t.is_leaf else t.detach(), EXACT, self._stack[-1][1], False)  # alias(t)
        forced = EXACT if self._watch.after_grad_free_op else None
        pending = Pending(t, self._stack[-1][1], forced, index)
        self._watch.pending.append(pending)
        return pending

    def _resolve(self, pending: Pending, need: Need) -> None:
        t, need = pending.tensor, pending.forced or need
        param_copy = self._watch.is_param(t)
        if self._recording is not None:
            slots = self._recording
            slots.extend([None] * (pending.index + 1 - len(slots)))
            slots[pending.index] = Slot(t, need, pending.module, param_copy)
        self._index = pending.index  # the position the stored form is sized by (.capacity)
        pending.target = self._hold(t, pending.detached, need, pending.module, param_copy)
        pending.tensor = pending.detached = None

    def _replay(self, t: torch.Tensor, d: torch.Tensor, slot: Slot, step: tuple[Policy, Form]):
        """:meth:`_hold` of a replayed pack that ``step`` (its plan) says ``policy`` stores in
        ``form``, unless it is a parameter, buffer or input: its storage is looked at every step."""
        ptr = t.data_ptr() - t.storage_offset() * t.element_size()  # storage_address(t), inlined
        if ptr in self._external or ptr in self._inputs or (t.is_leaf and t.requires_grad):
            return Kept(d, t._version)
        return self._save(t, d, slot.need, slot.module, ptr, *step)

    def _hold(self, t: torch.Tensor, d: torch.Tensor, need: Need, module: tuple[str, str], param_copy: bool):
        """Store ``t`` (``d``: its alias made at autograd level, see :func:`alias`) for ``need``.

        ``param_copy``: autocast's low-precision copy of a weight (the dispatch mode saw it made).
        """
        # Without roles (Bitmap) every pack comes here: no call that can be saved is made (a
        # ledger row only with a ledger, storage_address inlined)
        ptr = t.data_ptr() - t.storage_offset() * t.element_size()
        if ptr in self._external or ptr in self._inputs or (t.is_leaf and t.requires_grad):
            if self.ledger is not None:
                self._record(t, module, "external", 0, 0, 0, need)
            return Kept(d, t._version)
        step = decide(t.dtype, t.shape, param_copy, need, self._by_module.get(module[0], self._default), self.min_bytes)
        if step is None:
            if self.ledger is not None:
                nbytes = t.numel() * t.element_size()
                self._record(t, module, "dense", nbytes, nbytes, t.numel(), need)
            return Kept(d, t._version)
        if not self._roles and self._held_as_is().get(self._index) == t.numel():
            # Did not compress at this position before (.capacity): held as it is, with no entry.
            # Without roles every pack takes the one form, so no later pack of this storage
            # could want another form that the dense copy would have served; and no ledger.
            return Kept(d, t._version)
        return self._save(t, d, need, module, ptr, *step)

    def _held_as_is(self) -> dict[int, int]:
        """Positions of this model, input signature and policy whose exact form did not compress."""
        if self._uncompressed is None:
            self._uncompressed = self._tapes.capacities.held_as_is(self._signature, self.policy)
        return self._uncompressed

    def _flush(self) -> None:
        if self._watch is not None:
            self._watch.flush()

    def _save(self, t: torch.Tensor, d: torch.Tensor, need: Need, module: tuple[str, str], ptr: int, policy: Policy,
              form: Form):
        lo, hi = span(t)
        key = (ptr, t.dtype)
        for ref in self._table.get(key, ()):
            entry = ref()
            if entry is not None and entry.covers(t, lo, hi):
                if entry.serves(form, policy.covers):
                    self._record(t, module, "shared", 0, 0, 0, need, form)
                else:
                    self._encode(entry, t, d, need, form, module, 0, policy)
                return entry.view_of(t, form)
        # Dense enough: store the storage region, so later views of it can share the entry;
        # a sparse view of a big storage (every third row, say) stores only its own elements.
        entry = Entry(t, lo, hi, gathered=hi - lo > 2 * t.numel())
        self._encode(entry, t, d, need, form, module, (hi - lo if entry.gathered is None else t.numel()) * t.element_size(),
                     policy)
        self._table.setdefault(key, []).append(weakref.ref(entry))
        return entry.view_of(t, form)

    def _encode(self, entry: Entry, t, d, need: Need, form: Form, module, dense_bytes: int, policy: Policy) -> None:
        """Add ``form`` to ``entry``; ``dense_bytes`` is what plain PyTorch holds (0 if shared)."""
        if entry.gathered is not None:
            region, rows = d.reshape(-1), (t.shape[0] if t.dim() else 1)
        elif entry.hi - entry.lo == t.numel() and t.is_contiguous():
            # Most saved tensors: t is its whole region, held in its own shape (on a GPU host every
            # torch call, a view included, costs microseconds, for each of a step's saved tensors)
            region, rows = d, ((t.shape[0] or 1) if t.dim() else 1)  # rows_of(t, entry), inlined
        else:
            region, rows = torch.as_strided(d, (entry.hi - entry.lo,), (1,), entry.lo), rows_of(t, entry)
        if form is SHAPE_FORM:
            rep = SHAPE
        else:
            floating = region.dtype in _FLOATS
            split = policy.per_sample(form) and sample_split(t, entry, self._batch, module[1] == "MultiheadAttention")
            if not floating:
                rep = pack_narrow(region, need.bound)
            elif split:
                rep = encode_per_sample(policy, region, *split, need, form)
            elif policy.sized_by_count and _cuda.gpu_path(region):  # sized from an earlier step (.capacity)
                if self._checks is None:
                    self._checks = LateChecks(self._tapes.capacities.of(self._signature))
                rep = self._checks.encode(region.view(rows, -1), self._index, policy, need, self.ledger, entry, form)
            elif form is EXACT_FORM and dense_bytes:
                rep = self._encode_exact_once(region, rows, need, policy)
            else:
                rep = policy.encode_region(region, rows, need, form)
            region_bytes = region.numel() * region.element_size()
            if rep is None or rep.nbytes >= region_bytes:
                # Never worse than plain PyTorch: what does not compress is held as it is (a
                # gathered view as itself, so that backward sees its own strides).
                form, rep = EXACT_FORM, Region(d if entry.gathered is not None else region, d)
        superseded = entry.add(form, rep, policy.covers)
        if self.ledger is None:  # only a ledger reads the kept counts
            return
        storage = "dense" if isinstance(rep, Region) else "stored"
        # A form added to an entry already counted adds bytes, not elements.
        kept = kept_count(rep)
        numel, nnz = (region.numel(), kept) if dense_bytes else (0, 0)
        entry.records = entry.records or {}
        entry.records[form] = self._record(t, module, storage, dense_bytes, rep.nbytes, numel, need, form, nnz)
        self._supersede(entry, superseded, kept)
        if rep.nbytes:
            self.ledger.hold(rep.nbytes)
            weakref.finalize(rep, self.ledger.release, rep.nbytes)

    def _encode_exact_once(self, region: torch.Tensor, rows: int, need: Need, policy: Policy):
        """``policy``'s exact form of ``region`` (a new entry's), except where it did not compress
        at this position before: None then, without looking (.capacity); a new such position is
        noted."""
        as_is = self._held_as_is()
        if as_is.get(self._index) == region.numel():
            return None
        rep = policy.encode_region(region, rows, need, EXACT_FORM)
        if rep is None or rep.nbytes >= region.numel() * region.element_size():
            as_is[self._index] = region.numel()
        return rep

    def _supersede(self, entry: Entry, forms: list[str], nnz: int) -> None:
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

    def _record(self, t, module, storage, dense_bytes, stored_bytes, numel, need=EXACT, form=EXACT_FORM,
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
                form=form.text,
            )
        )
