"""The measurement harness (edgetorch.measure.timing and .counters): what runs, how often and in what
order, and what is counted. Nothing here reads a clock's value: a busy machine passes alike."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgetorch.measure import counters
from edgetorch.measure.counters import allocator_peak, count_calls, count_host_syncs, host_profile, kernel_profile
from edgetorch.measure.timing import (event_time, interleave, interleave_rounds, per_call, ratios, rotation,
                                      wall_time, within)


class Log:
    """Callables that record their name in one shared log when called."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, name: str):
        return lambda: self.calls.append(name)


def test_timers_call_once():
    log = Log()
    wall_time(log("wall"))
    wall_time(log("wall cpu"), "cpu")
    event_time(log("event"), "cpu")
    assert log.calls == ["wall", "wall cpu", "event"]


def test_per_call_runs_the_warmup_then_the_batch():
    log = Log()
    per_call(log("x"), 7, warmup=3)
    assert log.calls == ["x"] * 10
    with pytest.raises(ValueError, match="calls must be at least 1"):
        per_call(log("x"), 0)


def test_rotation():
    assert rotation(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotation(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert rotation(("a", "b", "c"), 5) == ["c", "a", "b"]
    assert rotation([], 3) == []


def test_interleave_runs_each_variant_once_per_round_in_order():
    log = Log()
    times = interleave({"a": log("a"), "b": log("b"), "c": log("c")}, 3)
    assert log.calls == ["a", "b", "c"] * 3
    assert list(times) == ["a", "b", "c"] and all(len(v) == 3 for v in times.values())


def test_interleave_rotated_and_each_round():
    log, rounds = Log(), []
    interleave({"a": log("a"), "b": log("b"), "c": log("c")}, 3, rotate=True,
               each_round=lambda r, times: rounds.append((r, {k: len(v) for k, v in times.items()})))
    assert log.calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert rounds == [(r, {"a": r + 1, "b": r + 1, "c": r + 1}) for r in range(3)]


def test_interleave_collects_a_repeated_name_and_what_measure_returns():
    counter = iter(range(100))
    # a baseline beside each variant; measure: each callable returns its own measurement
    pairs = [("base", lambda: next(counter)), ("x", lambda: next(counter)),
             ("base", lambda: next(counter)), ("y", lambda: next(counter))]
    times = interleave(pairs, 2, measure=lambda fn: fn())
    assert times == {"base": [0, 2, 4, 6], "x": [1, 5], "y": [3, 7]}


def test_interleave_rounds_runs_phases_one_after_another():
    log = Log()
    times = interleave_rounds([({"a": log("a"), "b": log("b")}, 2), ({"c": log("c")}, 1)])
    assert log.calls == ["a", "b", "a", "b", "c"]
    assert {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2, "c": 1}
    with pytest.raises(ValueError, match="two phases"):
        interleave_rounds([({"a": log("a")}, 1), ({"a": log("a")}, 1)])


def test_within_enters_a_fresh_context_per_call():
    entered = []

    @contextlib.contextmanager
    def setting():
        entered.append("enter")
        yield
        entered.append("exit")

    run = within(setting, lambda: len(entered))
    assert [run() for _ in range(3)] == [1, 3, 5]
    assert entered == ["enter", "exit"] * 3


def test_ratios_pair_rounds_and_take_minima():
    r = ratios([2.0, 9.0, 3.0], [1.0, 3.0, 1.0])
    assert r.median_paired == 3.0 and r.of_minima == 2.0
    with pytest.raises(ValueError, match="one measurement per round"):
        ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        ratios([], [])


def test_count_calls_counts_and_restores_a_module_function():
    original = math.sqrt
    with count_calls(math, "sqrt") as calls:
        values = [math.sqrt(x) for x in (1.0, 4.0, 9.0, 16.0)]
        assert calls.count == 4
    assert values == [1.0, 2.0, 3.0, 4.0]
    assert math.sqrt is original
    math.sqrt(25.0)
    assert calls.count == 4  # no longer counting


def test_count_calls_sums_the_seconds_inside_the_calls(monkeypatch):
    clock = iter([10.0, 10.5, 20.0, 21.0])  # start and end of each of two calls
    monkeypatch.setattr(counters.time, "perf_counter", lambda: next(clock))
    with count_calls(math, "sqrt") as calls:
        math.sqrt(4.0), math.sqrt(9.0)
    assert calls.count == 2 and calls.seconds == 1.5


def test_count_calls_on_methods_restores_through_an_error():
    class Base:
        def f(self, x):
            return x + 1

    class Child(Base):
        pass

    with pytest.raises(RuntimeError), count_calls(Child, "f") as calls:
        assert [Child().f(i) for i in range(3)] == [1, 2, 3]
        raise RuntimeError("inside")
    assert calls.count == 3
    assert "f" not in vars(Child) and Child.f is Base.f  # the inherited method is inherited again
    with count_calls(Base, "f") as calls:
        Child().f(0)
    assert calls.count == 1 and vars(Base)["f"] is Base.f


class Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_count_calls_counts_dispatched_ops():
    a, b = torch.ones(3), torch.ones(3)
    with count_calls(Ops, "__torch_dispatch__") as calls, Ops():
        for _ in range(4):
            (a + b).mul(2).sum()  # add, mul, sum: three ATen ops
    assert calls.count == 12


def test_device_counts_are_none_off_cuda():
    log = Log()
    assert count_host_syncs(log("syncs"), "cpu") is None  # not run: nothing to count
    profile = kernel_profile(log("profile"), torch.device("cpu"))
    assert (profile.kernels, profile.copies, profile.launch_calls, profile.kernel_ns, profile.on_stream) == (None,) * 5
    assert allocator_peak(log("peak"), "cpu") is None
    assert log.calls == ["profile", "peak"]


def test_kernel_profile_off_cuda_runs_no_profiler(monkeypatch):
    import torch.profiler

    def refused(*args, **kwargs):
        raise AssertionError("profiled a call that has no device activity to report")

    monkeypatch.setattr(torch.profiler, "profile", refused)
    log = Log()
    assert kernel_profile(log("profile"), "cpu").wall_s >= 0.0 and log.calls == ["profile"]


def test_count_host_syncs_puts_back_the_callers_debug_mode(monkeypatch):
    import edgetorch.measure.counters as counters

    modes = ["error"]  # a caller's test that forbids syncs, around a count
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: {"warn": 1, "error": 2}[modes[-1]])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: modes.append(
        {1: "warn", 2: "error"}.get(mode, mode)))
    monkeypatch.setattr(counters, "synchronize", lambda device: None)  # no GPU needed to check the bookkeeping
    assert count_host_syncs(lambda: None, "cuda") == 0
    assert modes == ["error", "warn", "error"]


def test_event_time_records_on_the_given_devices_stream(monkeypatch):
    recorded = []

    class Event:
        def __init__(self, enable_timing: bool):
            assert enable_timing

        def record(self, stream=None):
            recorded.append(stream)

        def elapsed_time(self, end) -> float:
            return 2.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert event_time(lambda: None, "cuda:1") == 2e-3
    assert recorded == ["stream of cuda:1"] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_counts_syncs_kernels_launches_and_peak():
    x = torch.zeros(1024, device="cuda")
    x.add_(1)  # warm
    torch.cuda.set_sync_debug_mode("warn")
    assert count_host_syncs(lambda: [x[0].item() for _ in range(3)], "cuda") == 3
    assert torch.cuda.get_sync_debug_mode() == 1  # the mode it found, not the default
    torch.cuda.set_sync_debug_mode("default")
    assert count_host_syncs(lambda: x.add_(1), "cuda") == 0
    profile = kernel_profile(lambda: [x.add_(1) for _ in range(5)], "cuda")
    assert profile.kernels == 5 and profile.launch_calls == 5 and profile.copies == 0
    peak = allocator_peak(lambda: torch.empty(2**20, device="cuda"), "cuda")
    assert peak.increase >= 2**22


def test_host_profile_lists_the_calls_functions_by_self_time():
    def leaf():
        return sum(range(50))

    def outer():
        return [leaf() for _ in range(7)]

    profile = host_profile(outer)
    by_name = {f.name: f for f in profile.functions}
    assert by_name["leaf"].calls == 7 and by_name["outer"].calls == 1
    assert by_name["outer"].cumulative_s >= by_name["leaf"].cumulative_s
    selfs = [f.self_s for f in profile.functions]
    assert selfs == sorted(selfs, reverse=True)
    assert profile.total_s == pytest.approx(sum(selfs))
