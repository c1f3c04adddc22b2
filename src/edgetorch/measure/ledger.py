"""The saved-tensor ledger: what autograd keeps for backward, per module and op, in exact bytes.

These are accounting numbers (tensor storage sizes), the paper's "theoretical" column. They are
not process memory: allocator slack, the Python heap and library code come on top. See
:mod:`edgetorch.measure.process` for measured numbers; report both, side by side.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn


@dataclass(frozen=True)
class SavedRecord:
    """One tensor handed to autograd's pack hook.

    Attributes:
        module: qualified name of the innermost module running when it was saved ("" = root).
        module_type: that module's class name.
        op: the ATen op that saved it (e.g. ``convolution``, ``relu_``, ``native_batch_norm``;
            ``?`` when it was saved outside any op, as by a custom autograd Function).
        shape: logical shape of the saved tensor.
        dtype: its dtype, as a string.
        storage: how it is held: ``stored`` (encoded by the policy), ``shared`` (same memory as
            an earlier record: counted once), ``dense`` (kept as is, e.g. tiny or integer),
            ``external`` (a parameter, buffer or model input: held by the caller anyway).
        dense_bytes: bytes plain PyTorch holds for it (0 for shared and external records).
        stored_bytes: bytes held under the policy (0 for shared and external records).
        numel: elements held (0 for shared and external records).
        nnz: values the codec kept (``numel`` when held dense).
        form: what was stored: ``exact``, ``prune`` (top-k values), ``mask ...`` (one bit per
            element), ``shape`` (nothing: backward never reads the values).
        replaced_bytes: a ``superseded`` row's stored bytes before a later exact copy of the
            tensor replaced its form (0 for every other row): who caused what a step holds.
    """

    module: str
    module_type: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    storage: str
    dense_bytes: int
    stored_bytes: int
    numel: int
    nnz: int
    form: str = "exact"
    replaced_bytes: int = 0


@dataclass(frozen=True)
class Totals:
    """Aggregated ledger rows."""

    count: int = 0
    dense_bytes: int = 0
    stored_bytes: int = 0
    numel: int = 0
    nnz: int = 0

    @property
    def sparsity(self) -> float:
        """Fraction of held elements not stored as values (0 when nothing is held)."""
        return 1.0 - self.nnz / self.numel if self.numel else 0.0

    def __add__(self, other: Totals) -> Totals:
        return Totals(*(a + b for a, b in zip(_fields(self), _fields(other))))

    def to_dict(self) -> dict:
        return {**asdict(self), "sparsity": self.sparsity}


def _fields(t: Totals) -> tuple[int, ...]:
    return (t.count, t.dense_bytes, t.stored_bytes, t.numel, t.nnz)


@dataclass
class SavedTensorLedger:
    """Collects :class:`SavedRecord` rows and tracks the live stored bytes over time.

    ``peak_live_bytes`` is the most saved-tensor memory held at any instant (forward and
    backward, including recomputation under checkpointing), which is what bounds memory.

    Example:
        >>> ledger = SavedTensorLedger()
        >>> with edgetorch.compress_activations(model, edgetorch.Bitmap(), ledger=ledger):
        ...     loss = model(x).sum()
        >>> ledger.total().stored_bytes <= ledger.total().dense_bytes
        True
    """

    _rows: list[SavedRecord] = field(default_factory=list)
    live_bytes: int = 0
    peak_live_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def records(self) -> list[SavedRecord]:
        """The rows, with every kept count read (on a GPU, one host sync for all of them)."""
        counted = [i for i, r in enumerate(self._rows) if isinstance(r.nnz, torch.Tensor)]
        if counted:
            counts = [self._rows[i].nnz.sum() for i in counted]
            values = torch.stack([c.to(counts[0].device) for c in counts]).tolist()
            for i, value in zip(counted, values):
                self._rows[i] = replace(self._rows[i], nnz=int(value))
        return self._rows

    def add(self, record: SavedRecord) -> int:
        """Append ``record`` and return its index. Its ``nnz`` may be a device tensor of counts
        (summed): a codec's kept count, read only when :attr:`records` is, so that recording
        makes no host sync during a GPU forward."""
        self._rows.append(record)
        return len(self._rows) - 1

    def supersede(self, index: int, nnz: int | torch.Tensor) -> None:
        """Row ``index``'s stored form was replaced by an exact one that keeps ``nnz`` values
        (no host sync): it holds no bytes of its own now, and a row with elements takes ``nnz``."""
        row = self._rows[index]
        self._rows[index] = replace(row, stored_bytes=0, storage="superseded", nnz=nnz if row.numel else 0,
                                    replaced_bytes=row.stored_bytes)

    def restate(self, index: int, stored_bytes: int, storage: str) -> None:
        """Row ``index``'s tensor was stored again, now in ``stored_bytes`` as ``storage``
        (a capped bitmap re-packed exactly after its value slots overflowed)."""
        self._rows[index] = replace(self._rows[index], stored_bytes=stored_bytes, storage=storage)

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` of saved-tensor memory as live (called when it is stored)."""
        with self._lock:
            self.live_bytes += nbytes
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def release(self, nbytes: int) -> None:
        """Count ``nbytes`` as freed (called when autograd drops what was stored)."""
        with self._lock:
            self.live_bytes -= nbytes

    def total(self) -> Totals:
        return self._group(lambda r: "total").get("total", Totals())

    def by_module(self) -> dict[str, Totals]:
        return self._group(lambda r: r.module or "<root>")

    def by_module_type(self) -> dict[str, Totals]:
        return self._group(lambda r: r.module_type)

    def by_op(self) -> dict[str, Totals]:
        return self._group(lambda r: r.op)

    def by_form(self) -> dict[str, Totals]:
        return self._group(lambda r: r.form)

    def _group(self, key) -> dict[str, Totals]:
        groups: dict[str, Totals] = defaultdict(Totals)
        for r in self.records:
            groups[key(r)] += Totals(1, r.dense_bytes, r.stored_bytes, r.numel, r.nnz)
        return dict(groups)

    def to_dict(self) -> dict:
        """JSON-ready summary: totals, per op, per module type, peak live bytes."""
        return {
            "total": self.total().to_dict(),
            "peak_live_bytes": self.peak_live_bytes,
            "by_op": {k: v.to_dict() for k, v in self.by_op().items()},
            "by_form": {k: v.to_dict() for k, v in self.by_form().items()},
            "by_module_type": {k: v.to_dict() for k, v in self.by_module_type().items()},
        }


def tensor_bytes(tensors) -> int:
    """Bytes of the given tensors' elements (each distinct storage counted once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.numel() * t.element_size()
    return total


def model_memory(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, buffers, gradients and optimizer state (the rest of the paper's Fig. 1b).

    Args:
        model: the module being trained.
        optimizer: its optimizer, after at least one step (state is created lazily).

    Returns:
        ``{"parameter_bytes", "buffer_bytes", "gradient_bytes", "optimizer_state_bytes"}``.
    """
    params = list(model.parameters())
    state = []
    if optimizer is not None:
        for s in optimizer.state.values():
            state.extend(v for v in s.values() if isinstance(v, torch.Tensor))
    return {
        "parameter_bytes": tensor_bytes(params),
        "buffer_bytes": tensor_bytes(model.buffers()),
        "gradient_bytes": tensor_bytes(p.grad for p in params),
        "optimizer_state_bytes": tensor_bytes(state),
    }
