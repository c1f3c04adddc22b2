"""Run a loader on a crafted input in a fresh process and report what it raised and how much memory it took.

In-process peak RSS only ever rises, so an earlier test's peak hides what a later one allocates;
a fresh child, its peak reset after the imports, measures the loader alone. The timeout only catches hangs (a FIFO that
blocks a reader forever): no assertion depends on how fast the machine is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass

MEMORY_BOUND = 256 << 20  # what a crafted input may cost above the process at rest (issue 24)
HANG_GUARD_S = 300
LOG_ENV = "EDGETORCH_HOSTILE_LOG"  # when set, each case's outcome is appended to this file

_CHILD = """
import json, sys, time, traceback
import torch, edgetorch, edgetorch.split, edgetorch.split.export, edgetorch.zoo, edgetorch.finetune
from edgetorch.measure.process import peak_rss_bytes, reset_peak_rss, rss_bytes
{warm}
results = {{}}
for name, body in json.loads(sys.stdin.read()).items():
    rest = rss_bytes()  # at rest: imports done, and the loader warmed up on a valid input
    reset_peak_rss()  # imports and earlier cases peaked above the resident set at rest
    error, start = None, time.perf_counter()
    try:
        exec(body)
    except BaseException as exc:
        error = {{"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
                 "traceback": traceback.format_exc()}}
    results[name] = {{"error": error, "growth": peak_rss_bytes() - rest, "seconds": time.perf_counter() - start}}
print(json.dumps(results))
"""


@dataclass
class Outcome:
    """What a loader did with a crafted input in a child process."""

    error: dict | None  # type, mro (class names), message, traceback; None when it returned
    growth: int  # peak RSS above the process at rest, bytes
    seconds: float  # recorded for bench/hostile_inputs.py, never asserted (machines are shared)

    def refused_with(self, error_type: str, match: str = "") -> None:
        """Assert a clean refusal: ``error_type`` (by class name, or a base of it), its message
        containing ``match``, within :data:`MEMORY_BOUND`."""
        assert self.error is not None, "the loader accepted the crafted input"
        assert error_type in self.error["mro"], self.error["traceback"]
        assert match in self.error["message"], self.error["message"]
        assert self.growth < MEMORY_BOUND, f"{self.growth / 2**20:.0f} MiB above the process at rest"


def run_children(cases: dict[str, str], warm: str = "") -> dict[str, Outcome]:
    """Run each case's ``body`` (Python statements) in one fresh interpreter with torch and edgetorch
    imported, after ``warm`` (the same loader on a valid input: its one-time imports and set-up are
    the process at rest, not a crafted input's cost); the peak is reset before each case."""
    code = _CHILD.format(warm=textwrap.dedent(warm).strip())
    bodies = {name: textwrap.dedent(body).strip() for name, body in cases.items()}
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(bodies), capture_output=True, text=True,
                          timeout=HANG_GUARD_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(done.stdout.strip().splitlines()[-1])
    if os.environ.get(LOG_ENV):  # one line per case, for bench/hostile_inputs.py
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(os.environ[LOG_ENV], "a") as log:
            for name, record in records.items():
                log.write(json.dumps({"case": test if len(records) == 1 else f"{test.split('[')[0]}[{name}]",
                                      "error": (record["error"] or {}).get("type"), "growth": record["growth"],
                                      "seconds": record["seconds"]}) + "\n")
    return {name: Outcome(r["error"], r["growth"], r["seconds"]) for name, r in records.items()}


def run_child(body: str, warm: str = "") -> Outcome:
    """One case (see :func:`run_children`)."""
    return run_children({"case": body}, warm)["case"]


def raised_without_hanging(call: Callable[[], object], blocked: str, release: Callable[[], None] | None = None,
                           guard_s: float = 60) -> BaseException | None:
    """What ``call()`` raised (None if it returned), run in a thread so a hang fails the test, not the suite.

    Args:
        call: the loader call.
        blocked: the failure message if it is still running after ``guard_s`` (a hang guard only:
            a refusal takes milliseconds).
        release: unblocks a hung call (opens the FIFO's other end) so its thread can end.
    """
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001  (reported to the main thread)
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(guard_s)
    if worker.is_alive():
        if release is not None:
            release()
            worker.join(guard_s)
        raise AssertionError(blocked)
    return outcome[0]
