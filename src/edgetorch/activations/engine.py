"""The autograd integration: every tensor saved for backward inside the block goes through a policy.

Built on ``torch.autograd.graph.saved_tensors_hooks`` rather than custom autograd Functions, so
it works with any model unchanged and survives ``retain_graph`` (unpack never frees anything).
What the hooks alone would get wrong, and how this module handles it:

* One tensor saved by several ops (a ReLU output is also the next conv's input; Linear saves a
  view): entries are keyed by storage and version, and a later save that lies inside an
  earlier entry's memory becomes a view of it, so it is stored once.
* Parameters, buffers and the model's inputs are held by the caller anyway: encoding them
  would add a copy and free nothing, so they are passed through.
* With hooks active PyTorch skips its in-place check; tensors kept as they are carry their
  version and are checked on unpack.
* Hooks are thread-local and only the innermost pair applies: a module that runs under
  another pair (non-reentrant checkpoint, torch.compile) is reported with a warning.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..measure.ledger import SavedRecord, SavedTensorLedger
from .policies import Policy

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Entry:
    """One region of one storage, held in the policy's stored form (or kept as is)."""

    __slots__ = (
        "source", "version", "lo", "hi", "gathered", "stored", "_dense", "_held", "_pending",
        "__weakref__",
    )

    def __init__(self, t: torch.Tensor, lo: int, hi: int, gathered: bool, stored):
        self.source = weakref.ref(t)
        self.version = t._version
        self.lo, self.hi = lo, hi  # element range of the storage this entry covers
        # gathered: holds only t's own elements, row-major (t was a sparse view of its storage)
        self.gathered = _geometry(t) if gathered else None
        self.stored = stored  # None: kept as is (it did not compress), nothing to share
        self._dense = None
        self._held = None
        self._pending = 0  # views handed to autograd that have not been unpacked yet

    def covers(self, t: torch.Tensor, lo: int, hi: int) -> bool:
        if self.source() is None or self.version != t._version:
            return False
        if self.gathered is not None:
            return self.gathered == _geometry(t)
        return self.lo <= lo and hi <= self.hi

    def view_of(self, t: torch.Tensor) -> _View:
        self._pending += 1
        if self.gathered is not None:
            return _View(self, t.shape, _contiguous_strides(t.shape), 0)
        return _View(self, t.shape, t.stride(), t.storage_offset() - self.lo)

    def flat(self) -> torch.Tensor:
        """The region as a dense 1-D tensor, decoded once for all the ops that saved it.

        A ReLU output is unpacked by the next convolution's backward and then, right after,
        by the ReLU's own: the decoded tensor is held until every view handed out has been
        unpacked (plain PyTorch holds it that long too), then only weakly, so that repeated
        unpacking under retain_graph still works without keeping anything alive.
        """
        dense = self._held if self._held is not None else (self._dense and self._dense())
        if dense is None:
            dense = self.stored.unpack()
            self._dense = weakref.ref(dense)
        self._pending -= 1
        self._held = dense if self._pending > 0 else None
        return dense


class _View:
    """What autograd holds for a stored tensor: an entry plus the tensor's geometry in it."""

    __slots__ = ("entry", "size", "stride", "offset")

    def __init__(self, entry: _Entry, size, stride, offset: int):
        self.entry, self.size, self.stride, self.offset = entry, size, stride, offset

    def unpack(self) -> torch.Tensor:
        # The stored copy is the value at save time, but a later in-place change is still a
        # bug in the caller's code that plain PyTorch would report: report it too.
        _check_version(self.entry.source(), self.entry.version)
        return self.entry.flat().as_strided(self.size, self.stride, self.offset)


class _Kept:
    """A tensor held as is; its version is checked on unpack, as PyTorch does without hooks."""

    __slots__ = ("tensor", "version", "entry")

    def __init__(self, t: torch.Tensor, entry: _Entry | None = None):
        # Detached: the same storage and version counter, but no reference back to the graph
        # node that holds this object (that cycle would outlive a graph dropped unbackwarded).
        self.tensor, self.version = t.detach(), t._version
        self.entry = entry  # keeps the ledger's count of live bytes until autograd drops it

    def unpack(self) -> torch.Tensor:
        _check_version(self.tensor, self.version)
        return self.tensor


def _check_version(t: torch.Tensor | None, version: int) -> None:
    """Raise as plain PyTorch would when a saved tensor was modified in place after saving."""
    if t is not None and t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
            f"expected version {version} instead (detected by edgetorch, whose hooks replace "
            "PyTorch's own check)."
        )


class _OpTracker(TorchFunctionMode):
    """Remembers the outermost torch function running, to name the op that saves a tensor."""

    def __init__(self):
        super().__init__()
        self.current = "?"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        previous, self.current = self.current, getattr(func, "__name__", str(func))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = previous


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
        self._keep = {t.untyped_storage().data_ptr() for t in keep}
        self.saved_count = 0
        self._pack_fn = self._pack  # one bound object, so the hook on top can be recognised

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> compress_activations:
        self._check_can_act()
        self._external = {
            t.untyped_storage().data_ptr()
            for t in (*self.model.parameters(), *self.model.buffers())
        } | self._keep
        self._inputs: set[int] = set()
        self._table: dict[tuple, list[weakref.ref]] = {}
        self._stack: list[tuple[str, str]] = [("", type(self.model).__name__)]
        self._forward_with_grad = False
        self._warned: set[str] = set()
        self._handles = [self.model.register_forward_pre_hook(self._note_inputs, with_kwargs=True)]
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter_module(name)))
            self._handles.append(module.register_forward_hook(self._leave_module, always_call=True))
        self._exits = contextlib.ExitStack()
        if self.ledger is not None:
            self._ops = self._exits.enter_context(_OpTracker())
        self._exits.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack_fn, self._unpack))
        return self

    def __exit__(self, *exc) -> bool:
        self._exits.close()
        for h in self._handles:
            h.remove()
        self._table.clear()
        if exc[0] is None and self._forward_with_grad and self.saved_count == 0:
            warnings.warn(
                "compress_activations saw no saved tensor although the model ran with gradients "
                "enabled: the forward ran under torch.compile or inside another "
                "saved_tensors_hooks context, so nothing was compressed.",
                stacklevel=2,
            )
        return False

    def _check_can_act(self) -> None:
        if type(self.model).__name__ == "OptimizedModule":
            warnings.warn(
                "compress_activations got a torch.compile'd model: saved-tensor hooks are "
                "disabled while compiled code runs, so activations will not be compressed. "
                "Pass the uncompiled module.",
                stacklevel=3,
            )
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
        self._inputs = {x.untyped_storage().data_ptr() for x in leaves if isinstance(x, torch.Tensor)}
        self._forward_with_grad |= torch.is_grad_enabled()

    def _enter_module(self, name: str):
        def hook(module, args):
            self._stack.append((name, type(module).__name__))
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if torch.is_grad_enabled() and (top is None or top[0] is not self._pack_fn):
                self._warn_once(
                    f"module {name or '<root>'} ({type(module).__name__}) runs under another "
                    "saved_tensors_hooks context (non-reentrant torch.utils.checkpoint, "
                    "torch.compile or another tool): the tensors it saves are not compressed. "
                    "Use edgetorch.CheckpointEvery or use_reentrant=True checkpointing."
                )

        return hook

    def _leave_module(self, module, args, output):
        self._stack.pop()

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=4)

    # -- saved tensor hooks -------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        self.saved_count += 1
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._external or ptr in self._inputs or (t.is_leaf and t.requires_grad):
            self._record(t, "external", 0, 0, 0)
            return _Kept(t)
        nbytes = t.numel() * t.element_size()
        if t.dtype not in _FLOATS or nbytes < self.min_bytes:
            self._record(t, "dense", nbytes, nbytes, t.numel())
            return _Kept(t)
        lo, hi = _span(t)
        key = (ptr, t.dtype)
        for ref in self._table.get(key, ()):
            entry = ref()
            if entry is not None and entry.covers(t, lo, hi):
                self._record(t, "shared", 0, 0, 0)
                return _Kept(t, entry) if entry.stored is None else entry.view_of(t)
        return self._store(t, key, lo, hi)

    def _store(self, t: torch.Tensor, key: tuple, lo: int, hi: int):
        # Dense enough: store the storage region, so later views of it can share the entry;
        # a sparse view of a big storage (every third row, say) stores only its own elements.
        gathered = hi - lo > 2 * t.numel()
        d = t.detach()
        region = d.reshape(-1) if gathered else torch.as_strided(d, (hi - lo,), (1,), lo)
        dense_bytes = region.numel() * region.element_size()
        stored = self.policy.encode(region)
        if stored is None or stored.nbytes >= dense_bytes:
            # Never worse than plain PyTorch: a tensor that does not compress stays as it is.
            entry = _Entry(t, lo, hi, gathered, None)
            held = dense_bytes
            self._record(t, "dense", dense_bytes, held, region.numel())
            result = _Kept(t, entry)
        else:
            entry = _Entry(t, lo, hi, gathered, stored)
            held = stored.nbytes
            self._record(t, "stored", dense_bytes, held, region.numel(), stored.nnz)
            result = entry.view_of(t)
        if self.ledger is not None:
            self.ledger.hold(held)
            weakref.finalize(entry, self.ledger.release, held)
        self._table.setdefault(key, []).append(weakref.ref(entry))
        return result

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        return packed.unpack()

    def _record(self, t, storage, dense_bytes, stored_bytes, numel, nnz=None) -> None:
        if self.ledger is None:
            return
        module, module_type = self._stack[-1]
        self.ledger.add(
            SavedRecord(
                module=module,
                module_type=module_type,
                op=self._ops.current,
                shape=tuple(t.shape),
                dtype=str(t.dtype).removeprefix("torch."),
                storage=storage,
                dense_bytes=dense_bytes,
                stored_bytes=stored_bytes,
                numel=numel,
                nnz=numel if nnz is None else nnz,
            )
        )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Element range [lo, hi) of the storage that ``t`` touches."""
    lo = t.storage_offset()
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
