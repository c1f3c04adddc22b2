"""Wall time of a callable: once, per call over a batch of calls, or interleaved with other variants.

On a shared machine load comes and goes, so a timing is only comparable with one taken beside it:
variants are measured in one run, interleaved repeat by repeat (optionally in an order rotated
per round, so that none always runs first), and compared by ratios: the median of per-round
ratios, and the ratio of minima (contention only adds time, so the minimum is the least disturbed).
Work queued on a CUDA device is waited for where a device is given, outside the timed span.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")
Variants = Mapping[str, Callable[[], object]] | Sequence[tuple[str, Callable[[], object]]]


def _cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def synchronize(device: torch.device | str | None) -> None:
    """Wait until ``device`` has run the work queued on it (CUDA); nothing for a CPU or ``None``.

    Args:
        device: the device a timed callable runs on, or ``None`` for host-only work.

    Example:
        >>> synchronize("cpu")  # nothing to wait for
    """
    if _cuda(device):
        torch.cuda.synchronize(device)


def wall_time(fn: Callable[[], object], device: torch.device | str | None = None) -> float:
    """Seconds one call of ``fn`` takes on the wall clock (``time.perf_counter``).

    With a CUDA ``device`` the device is synchronized before the clock starts (earlier work is not
    counted) and before it stops (the call's kernels are).

    Args:
        fn: the call to time; its result is discarded.
        device: where ``fn``'s work runs; ``None`` or a CPU: no synchronization.

    Returns:
        The elapsed seconds.

    Example:
        >>> wall_time(lambda: sum(range(1000))) >= 0.0
        True
    """
    cuda = _cuda(device)  # decided before the clock starts: nothing but the call (and its wait) is timed
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def event_time(fn: Callable[[], object], device: torch.device | str) -> float:
    """Seconds one call of ``fn`` keeps a CUDA device busy, from CUDA events around it.

    The events are recorded on ``device``'s current stream (not the current device's: a caller
    timing work on ``cuda:1`` need not make it current) and time it from the call's first kernel to
    its last, not the host's Python; off CUDA this is :func:`wall_time` without synchronization.

    Args:
        fn: the call to time.
        device: where ``fn``'s work runs.

    Returns:
        The elapsed seconds.

    Example:
        >>> event_time(lambda: None, "cpu") >= 0.0
        True
    """
    if not _cuda(device):
        return wall_time(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream(device)
    torch.cuda.synchronize(device)
    start.record(stream)
    fn()
    end.record(stream)
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3


@dataclass(frozen=True)
class CallCost:
    """The mean cost of one call over a batch of consecutive calls."""

    wall_s: float  # wall-clock seconds per call
    thread_s: float  # the calling thread's CPU seconds per call: what other processes do not inflate


def per_call(fn: Callable[[], object], calls: int, *, warmup: int = 0,
             device: torch.device | str | None = None) -> CallCost:
    """Time ``calls`` consecutive calls of ``fn`` as one batch; the cost of one call, on the host.

    For calls too short to time one by one (microseconds). With a CUDA ``device`` the device is
    synchronized before the batch and after it, but the clocks stop before that last wait: the
    result is what the host spends issuing the calls, not the device's time to run them.

    Args:
        fn: the call to time.
        calls: calls in the batch (at least 1).
        warmup: untimed calls first (caches, lazily loaded kernels).
        device: where ``fn``'s work runs; ``None`` or a CPU: no synchronization.

    Returns:
        Wall and thread CPU seconds per call.

    Raises:
        ValueError: ``calls`` is below 1.

    Example:
        >>> per_call(lambda: None, 100).wall_s >= 0.0
        True
    """
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    synchronize(device)
    return CallCost(wall / calls, cpu / calls)


def rotation(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` rotated left by ``round_index`` (modulo their number): the order of one round in which
    no item always runs first.

    Args:
        items: the variants in their given order.
        round_index: which round (0 keeps the given order).

    Returns:
        The rotated list.

    Example:
        >>> rotation(["a", "b", "c"], 4)
        ['b', 'c', 'a']
    """
    k = round_index % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def interleave(variants: Variants, repeats: int, *, rotate: bool = False,
               measure: Callable[[Callable[[], object]], R] = wall_time,
               each_round: Callable[[int, dict[str, list[R]]], None] | None = None) -> dict[str, list[R]]:
    """Measure every variant once per round, ``repeats`` rounds: load on the machine hits them alike.

    Args:
        variants: name -> callable, or (name, callable) pairs, in the order a round runs them; a
            name given more than once collects the measurements of all its entries (a baseline run
            beside each variant).
        repeats: rounds.
        rotate: rotate the order by one variant per round (:func:`rotation`).
        measure: what one measurement of a callable is: :func:`wall_time` (default), another timer
            such as ``lambda fn: event_time(fn, device)`` or ``lambda fn: per_call(fn, 100)``, or
            ``lambda fn: fn()`` where each callable times itself and returns its seconds.
        each_round: called after every round with its index and the measurements so far (progress).

    Returns:
        name -> the measurements, in round order.

    Example:
        >>> times = interleave({"list": lambda: list(range(100)), "tuple": lambda: tuple(range(100))}, 5)
        >>> [len(v) for v in times.values()]
        [5, 5]
    """
    pairs = list(variants.items()) if isinstance(variants, Mapping) else list(variants)
    times: dict[str, list[R]] = {name: [] for name, _ in pairs}
    for r in range(repeats):
        for name, fn in rotation(pairs, r) if rotate else pairs:
            times[name].append(measure(fn))
        if each_round is not None:
            each_round(r, times)
    return times


def interleave_rounds(phases: Sequence[tuple[Variants, int]], **options) -> dict[str, list]:
    """:func:`interleave` for phases run one after another, each with its own variants and repeats
    (a variant that would disturb the others, e.g. by growing the heap, measured in a phase of its own).

    Args:
        phases: (variants, repeats) in the order they run; names must differ between phases.
        **options: passed to every :func:`interleave` (``rotate``, ``measure``, ``each_round``).

    Returns:
        name -> the measurements, every phase's variants in one mapping.

    Raises:
        ValueError: a name appears in two phases.

    Example:
        >>> times = interleave_rounds([({"a": lambda: None}, 3), ({"b": lambda: None}, 1)])
        >>> {k: len(v) for k, v in times.items()}
        {'a': 3, 'b': 1}
    """
    times: dict[str, list] = {}
    for variants, repeats in phases:
        measured = interleave(variants, repeats, **options)
        if times.keys() & measured.keys():
            raise ValueError(f"a name is measured in two phases: {sorted(times.keys() & measured.keys())}")
        times |= measured
    return times


def within(context: Callable[[], object], fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` made to run inside a fresh ``context()`` on every call (a setting under test, timed with it).

    Args:
        context: a factory of context managers, e.g. a ``contextlib.contextmanager`` function.
        fn: the call.

    Returns:
        A callable that enters ``context()``, calls ``fn`` and returns its result.

    Example:
        >>> import contextlib
        >>> within(contextlib.nullcontext, lambda: 3)()
        3
    """
    def run() -> T:
        with context():
            return fn()
    return run


@dataclass(frozen=True)
class Ratios:
    """A variant's measurements against a baseline measured in the same rounds."""

    median_paired: float  # the median over rounds of variant / baseline of the same round
    of_minima: float  # the least-disturbed estimate: min(variant) / min(baseline)


def ratios(times: Sequence[float], baseline: Sequence[float]) -> Ratios:
    """Compare a variant's per-round measurements with the baseline's of the same rounds.

    Args:
        times: the variant's measurements, one per round.
        baseline: the baseline's, one per round, in the same order.

    Returns:
        The median paired ratio and the ratio of minima.

    Raises:
        ValueError: the two have different lengths, or none.

    Example:
        >>> ratios([2.0, 3.0, 8.0], [1.0, 2.0, 2.0])
        Ratios(median_paired=2.0, of_minima=2.0)
    """
    if len(times) != len(baseline) or not times:
        raise ValueError(f"need one measurement per round for both, got {len(times)} and {len(baseline)}")
    return Ratios(statistics.median([t / b for t, b in zip(times, baseline)]), min(times) / min(baseline))
