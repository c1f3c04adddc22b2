"""What one call of a callable does, counted: calls of a patched function (and their time), host syncs, GPU kernels
and the host's launch calls (``torch.profiler``), and the CUDA caching allocator's peak.

The device counts are CUDA facts: off CUDA they are ``None`` (not measured), never 0.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .timing import synchronize, wall_time

# The host-side CUDA API calls that launch work (a CUDA graph replay is one launch).
LAUNCH_CALLS = ("LaunchKernel", "GraphLaunch", "LaunchCooperativeKernel")


def _cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


@dataclass
class CallCount:
    """Calls counted so far (read it while the counting block is open or after it closed)."""

    count: int = 0
    seconds: float = 0.0  # wall-clock seconds inside the calls (a recursive call is in its caller's too)


@contextmanager
def count_calls(owner: object, name: str) -> Iterator[CallCount]:
    """Count and time the calls of ``owner.name`` (a function of a module, or a method defined on a
    class) while the block runs; the attribute is put back when it ends.

    Args:
        owner: the module or class that holds the function.
        name: its attribute name.

    Returns:
        A context manager that yields the running :class:`CallCount`.

    Raises:
        AttributeError: ``owner`` has no attribute ``name``.

    Example:
        >>> import math
        >>> with count_calls(math, "sqrt") as calls:
        ...     _ = [math.sqrt(4.0) for _ in range(3)]
        >>> calls.count
        3
    """
    original = getattr(owner, name)
    own = vars(owner).get(name)  # restored as it was found (an inherited method: deleted again)
    counted = CallCount()

    def counting(*args, **kwargs):
        counted.count += 1
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            counted.seconds += time.perf_counter() - start

    setattr(owner, name, counting)
    try:
        yield counted
    finally:
        if own is None:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


def count_host_syncs(fn: Callable[[], object], device: torch.device | str) -> int | None:
    """Host syncs one call of ``fn`` makes: the warnings of ``torch.cuda.set_sync_debug_mode("warn")``,
    one per synchronizing call (a device value read on the host, ``nonzero``, a blocking copy).

    Waits the debug mode does not see (``Event.synchronize``, ``Stream.synchronize``) are not in it:
    a caller that makes such waits counts them itself. The device is synchronized after the call,
    and the debug mode the caller had (``"error"`` in a test that forbids syncs) is put back.

    Args:
        fn: the call to watch.
        device: where its work runs.

    Returns:
        The count; ``None`` off CUDA, where ``fn`` is not called.

    Example:
        >>> count_host_syncs(lambda: None, "cpu") is None
        True
    """
    if not _cuda(device):
        return None
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    synchronize(device)
    return sum("synchroniz" in str(w.message) for w in caught)


@dataclass(frozen=True)
class KernelProfile:
    """One call under ``torch.profiler``. Device counts are ``None`` off CUDA."""

    wall_s: float  # wall time of the call, on CUDA the profiler's overhead included
    kernel_ns: float | None  # nanoseconds, the sum of its GPU kernels' durations (memcpy/memset not included)
    kernels: int | None  # GPU kernel events
    copies: int | None  # memcpy and memset events on the device
    launch_calls: int | None  # the host's kernel and graph launch API calls

    @property
    def on_stream(self) -> int | None:
        """Kernels plus copies: everything the call put on the device's stream."""
        return None if self.kernels is None else self.kernels + self.copies


def _duration_ns(event) -> int:
    if hasattr(event, "duration_ns"):
        return event.duration_ns()
    return int(1000 * event.duration_us())


def kernel_profile(fn: Callable[[], object], device: torch.device | str) -> KernelProfile:
    """Run ``fn`` once under ``torch.profiler`` and count what it ran on the device.

    Only CUDA activity is recorded: kernels, memcpy/memset and the runtime and driver API calls
    (the launches, which CUPTI reports without the CPU activity), without an event per ATen op,
    which would slow the profiled call and the counting. The device is synchronized before the
    call and, inside the timed span, after it. Off CUDA there is nothing of the device to count,
    so the call is not profiled at all: its wall time is :func:`~edgetorch.measure.timing.wall_time`'s.

    Args:
        fn: the call to profile.
        device: where its work runs.

    Returns:
        The call's :class:`KernelProfile`.

    Example:
        >>> kernel_profile(lambda: torch.ones(4).sum(), "cpu").kernels is None
        True
    """
    from torch.profiler import ProfilerActivity, profile

    if not _cuda(device):
        # The CPU activity would only add an event per op to the time; none of it would be reported.
        return KernelProfile(wall_time(fn), None, None, None, None)
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        synchronize(device)
        wall = time.perf_counter() - start
    kernels = copies = launches = kernel_ns = 0
    results = getattr(prof.profiler, "kineto_results", None)
    if results is not None:  # the raw events: no FunctionEvent tree to build
        events = [(e.name(), e.device_type(), _duration_ns(e)) for e in results.events()]
    else:
        events = [(e.name, e.device_type, 1000 * e.time_range.elapsed_us()) for e in prof.events()]
    for name, device_type, ns in events:
        if device_type == torch.autograd.DeviceType.CUDA:
            if name.startswith(("Memcpy", "Memset")):
                copies += 1
            else:
                kernels += 1
                kernel_ns += ns
        elif any(k in name for k in LAUNCH_CALLS):
            launches += 1
    return KernelProfile(wall, kernel_ns, kernels, copies, launches)


@dataclass(frozen=True)
class AllocatorPeak:
    """The CUDA caching allocator around one call, in bytes."""

    before: int  # allocated when the call began
    peak: int  # the most allocated at once during it

    @property
    def increase(self) -> int:
        """What the call added at its peak over what was allocated before it."""
        return self.peak - self.before


def allocator_peak(fn: Callable[[], object], device: torch.device | str) -> AllocatorPeak | None:
    """The CUDA caching allocator's peak during one call of ``fn``.

    The device is synchronized and the allocator's peak reset before the call, and synchronized
    after it; blocks held in the cache but not allocated are not counted.

    Args:
        fn: the call to measure.
        device: where its work runs.

    Returns:
        What was allocated before and at the peak; ``None`` off CUDA (``fn`` still runs once).

    Example:
        >>> allocator_peak(lambda: None, "cpu") is None
        True
    """
    if not _cuda(device):
        fn()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return AllocatorPeak(before, torch.cuda.max_memory_allocated(device))


@dataclass(frozen=True)
class FunctionTime:
    """One Python function's share of a :func:`host_profile`d call (``cProfile``'s row for it)."""

    file: str
    line: int
    name: str
    calls: int  # all its calls, recursive ones included
    self_s: float  # seconds in the function itself
    cumulative_s: float  # seconds in it and what it called


@dataclass(frozen=True)
class HostProfile:
    """One call under ``cProfile``: where the calling thread's Python time went."""

    total_s: float  # the sum of every function's self time (profiler overhead included)
    functions: list[FunctionTime]  # most self time first


def host_profile(fn: Callable[[], object], device: torch.device | str | None = None) -> HostProfile:
    """Run ``fn`` once under ``cProfile`` and list its Python functions by self time.

    cProfile slows every Python call, so read shares, not absolute times; it sees the calling
    thread only (on CUDA, backward's hooks run on autograd's device thread and are not in it).
    The device is synchronized before the call and, while profiling, after it.

    Args:
        fn: the call to profile.
        device: where its work runs; ``None`` or a CPU: no synchronization.

    Returns:
        The call's :class:`HostProfile`.

    Example:
        >>> host_profile(lambda: sorted(range(100))).total_s >= 0.0
        True
    """
    import cProfile
    import pstats

    synchronize(device)
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    synchronize(device)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, self, cumulative, callers)
    functions = [FunctionTime(f, line, name, v[0], v[2], v[3]) for (f, line, name), v in stats.items()]
    return HostProfile(sum(v[2] for v in stats.values()), sorted(functions, key=lambda t: -t.self_s))
