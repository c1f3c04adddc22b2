"""Lossless bitmaps on a GPU with one host sync a step instead of one per tensor.

A bitmap's size depends on its data: packing it exactly needs the kept count on the host before
its values can be allocated, which is a sync per packed tensor (32-142 a step were measured on an
H200; each stalls the queue the host was filling). Instead, on a steady-state step:

1. The n-th tensor a block packs gets ``capacity = count x MARGIN + SLACK`` value slots, where
   ``count`` is what the n-th tensor of an earlier step of the same model and input signature
   kept (:class:`Capacities`). It is packed into them by
   :func:`~edgetorch.codecs.bitmap.pack_bitmap_capped` (one launch, no sync; the true count stays
   on the device).
2. Its true count is copied to pinned host memory behind a CUDA event, and the tensor it was packed
   from is held until the host has seen that count (:class:`LateChecks`). A count that fit frees
   the source: the capped copy is exact. An overflow (more kept than slots) is re-packed exactly
   from the held source, with the one sync that costs: that takes a count that rose more than
   ``MARGIN`` since the step it was sized from.
3. Counts are looked at without waiting each time a later tensor is packed (``Event.query``).
   The sources held meanwhile are bounded by :data:`HOLD_BYTES`: above it the host waits for the
   oldest count. That wait is for a point the GPU has queued work beyond (the packs made since),
   so the device keeps running while the host waits: a bound on how far the host runs ahead, not
   a drain. What is still unseen when backward first reads a capped tensor is settled then, with
   one wait for the newest count: the step's one sync.

The first step of a signature (and a tensor whose size changed) has no count to go by and is packed
exactly, one sync each, as before. A position whose last count made the bitmap no smaller than
dense is held as it is without looking again (a convolution output feeding batch norm has no zeros
to find; looking would cost a sync): its count is taken again when the model's tapes are dropped
(:func:`edgetorch.activations.tape.forget`) or its input signature changes.

The same holds on a CPU, where looking costs a counting pass and the engine's bookkeeping for the
tensor instead of a sync (mobilenet_v2 at batch 2: 98 of the 120 tensors a step tried were batch
norm inputs that never compress): :meth:`Capacities.held_as_is`. A position that would compress
later is then held dense, which costs memory, never exactness.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from ..codecs.bitmap import CappedBitmapTensor
from .held import Region, Wrapper

if TYPE_CHECKING:
    from ..measure.ledger import SavedTensorLedger
    from .held import Entry
    from .forms import Form
    from .policies import Policy
    from .roles import Need

MARGIN = 1.05  # slots per kept value of the last count: room for drift between steps (more: re-packed)
SLACK = 1024  # slots beyond the margin: a small tensor's count moves by more than 5% of itself
HOLD_BYTES = 128 << 20  # sources held for their counts, at most, before the host waits for one
MAX_SIGNATURES = 8  # input signatures whose counts a model keeps (as tape.MAX_TAPES)

_waits = 0  # host waits for a count, process-wide (read by tests and benches: host_waits())


def host_waits() -> int:
    """Times the host has waited for a kept count so far in this process (each settle or bound)."""
    return _waits


class Capacities:
    """What the n-th packed tensor of a step kept the last time, per input signature, and the value
    slots that gives the next one; and, on any device, the positions whose exact form did not
    compress (held as they are from then on, without looking again: see the module docstring)."""

    __slots__ = ("_by_signature", "_as_is")

    def __init__(self):
        self._by_signature: dict[tuple | None, dict[int, tuple[int, int]]] = {}
        self._as_is: dict[tuple, dict[int, int]] = {}

    def of(self, signature: tuple | None) -> dict[int, tuple[int, int]]:
        """The counts seen for ``signature``: pack index -> (elements, kept)."""
        return _newest(self._by_signature, signature)

    def held_as_is(self, signature: tuple | None, policy: object) -> dict[int, int]:
        """Pack index -> elements, for the tensors whose exact form ``policy`` found no smaller
        than dense at that position of a step of ``signature`` (keyed by policy too: a threshold
        or a narrower value type can make a position compress that another policy could not)."""
        try:
            return _newest(self._as_is, (signature, policy))
        except TypeError:  # a policy with an unhashable field: remembered for this object only
            return _newest(self._as_is, (signature, type(policy), id(policy)))


def _newest(by_key: dict, key) -> dict:
    """``by_key[key]``, made empty if missing; the oldest key goes beyond MAX_SIGNATURES."""
    found = by_key.get(key)
    if found is None:
        if len(by_key) >= MAX_SIGNATURES:
            by_key.pop(next(iter(by_key)))
        found = by_key[key] = {}
    return found


def capacity(counts: dict[int, tuple[int, int]], index: int, numel: int) -> int | None:
    """Value slots for pack ``index`` of ``numel`` elements, or None when none was seen there."""
    seen = counts.get(index)
    if seen is None or seen[0] != numel:
        return None
    return min(numel, int(seen[1] * MARGIN) + SLACK)


class Unchecked(Wrapper):
    """A capped bitmap whose kept count the host may not have seen: reading it settles its block's
    counts first, and it then reads what holds the tensor (the capped copy, or the exact re-pack
    after an overflow)."""

    __slots__ = ("count", "checks")

    def __init__(self, rep, checks: LateChecks):
        self.rep, self.count, self.checks = rep, rep.count, checks

    @property
    def lazy_nnz(self) -> torch.Tensor:
        """The true kept count as a device tensor, overflowed or not: what a ledger records."""
        return self.count

    def unpack(self) -> torch.Tensor:
        self.checks.settle()
        return self.rep.unpack()


class _Check:
    __slots__ = ("held", "source", "index", "host", "slot", "seq", "event", "repack")


class LateChecks:
    """One block's capped packs whose counts the host has not looked at yet.

    The packs of a block are assumed to run on one CUDA stream (the forward's): a count that
    arrived implies every earlier one did.

    Args:
        counts: where the counts seen are written (the model's, for its next steps).
    """

    def __init__(self, counts: dict[int, tuple[int, int]]):
        self.counts = counts
        self._queue: collections.deque[_Check] = collections.deque()
        self._held = 0  # bytes of sources held
        self._lock = threading.Lock()  # backward (another thread) settles while nothing else runs
        self._slots: torch.Tensor | None = None  # the current block of host slots counts are copied to
        self._host = None  # the same memory as a numpy array
        self._used = 0
        self._seq = 0  # checks tracked so far
        self._reached = 0  # checks whose counts are known to be on the host

    def encode(self, x: torch.Tensor, index: int, policy: Policy, need: Need, ledger: SavedTensorLedger | None,
               entry: Entry, form: Form):
        """``policy.encode(x, need)`` (pack ``index`` of the block, stored in ``entry`` as ``form``)
        into value slots sized from the count kept at this position of an earlier step, with no
        host sync; its count is checked later. Where none was seen, exactly, reading its count (one
        sync), which sizes the next step's."""
        slots = capacity(self.counts, index, x.numel())
        if slots is None:
            rep = policy.encode(x, need)
            self.counts[index] = (x.numel(), x.numel() if rep is None else rep.nnz)
            return rep
        rep = policy.encode(x, need, capacity=slots)
        if not isinstance(rep, CappedBitmapTensor):
            return rep
        return self.track(rep, x, index, Repack(policy, need, ledger, entry, form))

    def track(self, rep, source: torch.Tensor, index: int, repack) -> Unchecked:
        """Hold ``source`` until ``rep``'s count is seen; ``repack(source, held)`` re-packs it
        exactly after an overflow and returns what holds it then.

        Returns:
            What the entry holds: it reads ``rep`` once the count fit, the re-pack if it did not.
        """
        held = Unchecked(rep, self)
        check = _Check()
        # The entry holds ``held`` and ``held`` holds these checks: a weak reference back keeps
        # that from being a cycle (which would hold the sources until the garbage collector ran).
        check.held, check.source, check.index, check.repack = weakref.ref(held), source, index, repack
        with self._lock:
            # Earlier counts that arrived are looked at before this one is queued: this one's
            # entry does not hold it yet (its ledger row is written after this returns), so a
            # re-pack now could not restate the row. An idle GPU's count can arrive at once.
            while self._queue and self._arrived(self._queue[0]):
                self._check_first()
            check.host, check.slot = self._copy(rep.count)
            # Recorded after the copy: when it has passed, the count is in host memory.
            check.event = torch.cuda.Event() if rep.count.is_cuda else None
            if check.event is not None:
                check.event.record()
            self._seq += 1
            check.seq = self._seq
            self._queue.append(check)
            self._held += source.numel() * source.element_size()
            while self._held > HOLD_BYTES and len(self._queue) > 1:
                self._wait(self._queue[0])
                self._check_first()
        return held

    def settle(self) -> None:
        """Look at every count, waiting once for the newest (the step's one sync)."""
        if not self._queue:
            return
        with self._lock:
            if self._queue:
                self._wait(self._queue[-1])  # every earlier count arrived before it
                while self._queue:
                    self._check_first()

    def _arrived(self, check: _Check) -> bool:
        if check.seq <= self._reached:
            return True
        if check.event is not None and check.event.query():
            self._reached = check.seq
            return True
        return False  # an emulated GPU (CPU tensors) is always behind until waited for

    def _wait(self, check: _Check) -> None:
        global _waits
        if not self._arrived(check):
            _waits += 1
            if check.event is not None:
                check.event.synchronize()
            self._reached = check.seq

    def _check_first(self) -> None:
        check = self._queue.popleft()
        self._held -= check.source.numel() * check.source.element_size()
        count = int(check.host[check.slot])
        held = check.held()
        if held is not None:  # else autograd dropped the tensor: nothing to repair, still a count
            rep = held.rep
            if count > rep.values.numel():  # more kept than slots: the capped copy lost values
                held.rep = check.repack(check.source, held)
            self.counts[check.index] = (rep.numel, count)
        check.source = check.repack = None

    def _copy(self, count: torch.Tensor):
        """Copy ``count`` to a host slot without waiting (pinned memory on CUDA); returns the slots
        (a numpy view: reading it is no torch op) and the slot's index."""
        if self._host is None or self._used == len(self._host):
            # A new block of slots; earlier checks keep the block they were copied to.
            self._slots = torch.empty(256, dtype=torch.int64, pin_memory=count.is_cuda)
            self._host, self._used = self._slots.numpy(), 0
        slot = self._used
        self._used += 1
        self._slots[slot : slot + 1].copy_(count, non_blocking=count.is_cuda)
        return self._host, slot


class Repack:
    """Store a tensor exactly after its capped bitmap overflowed (rare: see the module docstring), and
    restate its ledger row."""

    __slots__ = ("policy", "need", "ledger", "entry", "form")

    def __init__(self, policy: Policy, need: Need, ledger: SavedTensorLedger | None, entry: Entry, form: Form):
        self.policy, self.need, self.ledger, self.form = policy, need, ledger, form
        self.entry = weakref.ref(entry)  # an entry holds what holds this: no cycle

    def __call__(self, source: torch.Tensor, held) -> object:
        rep = self.policy.encode(source, self.need)  # exact size: one sync
        rep = Region(source, source) if rep is None else rep
        entry = self.entry()
        index = None if entry is None or self.ledger is None else entry.records.get(self.form)
        if index is not None:
            self.ledger.restate(index, rep.nbytes, "dense" if isinstance(rep, Region) else "stored")
            self.ledger.hold(rep.nbytes - held.nbytes)
            weakref.finalize(held, self.ledger.release, rep.nbytes - held.nbytes)
        return rep
