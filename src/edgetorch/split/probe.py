"""Hostile clients of a deployed tail server, on raw sockets: what its deadlines and caps hold end
to end.

Each phase opens many connections at once and records how the server ended them: connections
that stall halfway through a request (:func:`run_stall`), idle connections over the connection
cap (:func:`run_connection_cap`), a pipelining flood (:func:`run_pipelining`) and clients that
never read a large answer (:func:`run_slow_readers`). A reverse proxy in front of the server can
undo its deadlines (by buffering a slow request, or holding idle connections itself): run these
against the address your devices use. :mod:`edgetorch.split.fuzz` sends malformed requests and
:mod:`edgetorch.split.loadgen` the polite load.

Timeouts here are hang guards; what a phase reports is what the server did and when.
"""

from __future__ import annotations

import asyncio
import collections
import select
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np
import psutil

from ..tail_defaults import HEADER_TIMEOUT_S, READ_TIMEOUT_S
from .loadgen import AnswerError, Target, exchange
from .wire import (CONNECT_TIMEOUT_S, PollSummary, Reply, connect, get_once, half_request_line, infer_head,
                   read_until_closed, small_window_socket, stalled_requests, status_of)


class RssSampler:
    """RSS of a process now, and its peak over a window (sampled every 50 ms in a thread).

    Example:
        >>> rss = RssSampler(server.pid)  # doctest: +SKIP
        >>> rss.start_peak(); ...; peak_bytes = rss.stop_peak()  # doctest: +SKIP
    """

    def __init__(self, pid: int):
        self.process = psutil.Process(pid)
        self._peak, self._stop, self._thread = 0, threading.Event(), None

    def now(self) -> int:
        return self.process.memory_info().rss

    def start_peak(self) -> None:
        self._peak, self._stop = self.now(), threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.05):
                self._peak = max(self._peak, self.now())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop_peak(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self._peak, self.now())


# Seconds a /health poll and its whole answer may take while a phase holds the server: a hang guard.
HEALTH_WAIT_S = 30.0


def _peak_sampler(target: Target) -> RssSampler | None:
    return None if target.server_pid is None else RssSampler(target.server_pid)


# --- stalled connections ---------------------------------------------------------------------------

@dataclass(frozen=True)
class StallConfig:
    """``connections`` opened at once, alternately stalled in the headers and in the body, and the
    server's deadlines for each (``ServerConfig``'s, whose defaults these are):
    ``header_timeout_s`` for the request line and headers, ``read_timeout_s`` for the body. Each
    connection is waited for up to 60 s beyond its own deadline."""

    connections: int = 1000
    header_timeout_s: float = HEADER_TIMEOUT_S
    read_timeout_s: float = READ_TIMEOUT_S

    def deadline_s(self, kind: str) -> float:
        """The deadline of one way of stalling, ``"partial headers"`` or ``"partial body"``."""
        return self.header_timeout_s if kind == "partial headers" else self.read_timeout_s


# The two ways a connection stalls, alternately: in the request line and headers, in the body.
_STALLS = ("partial headers", "partial body")


@dataclass
class StallResult:
    """When the server closed each stalled connection, from its last byte, whether it answered
    408, and how many it closed within their own deadline + 1 s (``by_kind``: the same per way of
    stalling, with that deadline); ``connect_errors`` and ``send_errors``: connections that could
    not be opened, or that failed (a reset) before their half request was sent;
    ``answers_over_cap``: connections that sent more than a probe reads
    (:data:`~edgetorch.split.wire.MAX_RAW_ANSWER_BYTES`), not counted as closed; ``/health``
    polled every 0.1 s meanwhile; ``peak_rss_bytes`` with a ``server_pid``."""

    connections: int
    header_timeout_s: float
    read_timeout_s: float
    wall_s: float
    connect_errors: int
    send_errors: int
    closed: int
    answered_408: int
    answers_over_cap: int
    closed_after_s_min: float | None
    closed_after_s_median: float | None
    closed_after_s_max: float | None
    closed_within_deadline_plus_1s: int
    max_held_at_once: int
    by_kind: dict[str, dict]
    health_polls_while_held: int
    health_ok_while_held: int
    health_max_held_during_an_ok_poll: int
    health_p50_ms: float | None
    health_max_ms: float | None
    peak_rss_bytes: int | None = None


def _closing_times(results: list[dict], deadline_s: float) -> dict:
    times = [r["closed_after_s"] for r in results if r.get("closed_after_s") is not None]
    return {"connections": len(results), "deadline_s": deadline_s, "closed": len(times),
            "closed_within_deadline_plus_1s": sum(t <= deadline_s + 1.0 for t in times),
            "answered_408": sum(r.get("status") == 408 for r in results),
            "closed_after_s_median": float(np.median(times)) if times else None,
            "closed_after_s_max": float(max(times)) if times else None}


async def _stall(target: Target, payload: bytes, config: StallConfig, rss: RssSampler | None) -> StallResult:
    sent_bytes = dict(zip(_STALLS, stalled_requests(target, payload)))
    held = {"now": 0, "max": 0}
    done = asyncio.Event()

    async def stalled(i: int) -> dict:
        kind = _STALLS[i % 2]
        try:
            reader, writer = await connect(target)
        except (OSError, asyncio.TimeoutError) as err:
            return {"kind": kind, "error": f"connect: {type(err).__name__} {err}"}
        sent = time.perf_counter()  # before the write: a late resume after drain() must not shorten a close
        try:  # a server may reset a connection as soon as it accepts it: one failed connection, not the phase
            writer.write(sent_bytes[kind])
            await writer.drain()
        except OSError as err:
            writer.close()
            return {"kind": kind, "error": f"send: {type(err).__name__} {err}"}
        held["now"] += 1
        held["max"] = max(held["max"], held["now"])
        result = {"kind": kind, "closed_after_s": None, "status": None}
        try:
            raw = await asyncio.wait_for(read_until_closed(reader), config.deadline_s(kind) + 60)
            result.update(closed_after_s=time.perf_counter() - sent, status=status_of(raw))
        except AnswerError:
            result["over_cap"] = True
        except (asyncio.TimeoutError, OSError):
            pass
        held["now"] -= 1
        writer.close()
        return result

    async def poll_health() -> list[dict]:
        polls = []
        async with httpx.AsyncClient(base_url=target.url, timeout=None, headers=target.headers) as client:
            while not done.is_set():
                start = time.perf_counter()
                try:
                    status, _ = await exchange(client, "GET", "/health", HEALTH_WAIT_S)
                except httpx.HTTPError as err:
                    status = type(err).__name__
                except AnswerError as err:
                    status = err.kind
                polls.append({"status": status, "latency_s": time.perf_counter() - start, "held": held["now"]})
                await asyncio.sleep(0.1)
        return polls

    if rss:
        rss.start_peak()
    poller = asyncio.create_task(poll_health())
    start = time.perf_counter()
    try:
        results = await asyncio.gather(*(stalled(i) for i in range(config.connections)))
        wall = time.perf_counter() - start
    finally:  # however the phase ends, the poller and the sampler's thread end with it
        done.set()
        peak_rss = rss.stop_peak() if rss else None
    polls = await poller
    closed = np.array([r["closed_after_s"] for r in results if r.get("closed_after_s") is not None])
    while_held = [p for p in polls if p["held"] > 0]
    by_kind = {kind: _closing_times([r for r in results if r["kind"] == kind], config.deadline_s(kind))
               for kind in _STALLS}
    ok_polls = [p for p in while_held if p["status"] == 200]
    errors = collections.Counter(r["error"].partition(":")[0] for r in results if "error" in r)  # connect, send
    return StallResult(
        config.connections, config.header_timeout_s, config.read_timeout_s, wall, errors["connect"], errors["send"],
        int(closed.size), sum(r.get("status") == 408 for r in results), sum("over_cap" in r for r in results),
        float(closed.min()) if closed.size else None, float(np.median(closed)) if closed.size else None,
        float(closed.max()) if closed.size else None,
        sum(k["closed_within_deadline_plus_1s"] for k in by_kind.values()), held["max"], by_kind, len(while_held),
        len(ok_polls), max((p["held"] for p in ok_polls), default=0),
        float(np.median([p["latency_s"] for p in ok_polls]) * 1e3) if ok_polls else None,
        float(max(p["latency_s"] for p in ok_polls) * 1e3) if ok_polls else None, peak_rss)


def run_stall(target: Target, payload: bytes, config: StallConfig = StallConfig()) -> StallResult:
    """Open ``config.connections`` connections at once that stop halfway (half in the request
    line and headers, half in the body of a ``POST /infer``) while polling ``/health``; time how
    long after its last byte the server closed each.

    Args:
        target: the server.
        payload: a valid request body, half of which the body-stalled connections send.
        config: how many connections, and the deadlines the server is expected to keep.

    Returns:
        A :class:`StallResult`.

    Example:
        >>> run_stall(Target.from_url(url), body, StallConfig(20, header_timeout_s=5, read_timeout_s=5)).answered_408  # doctest: +SKIP
        20
    """
    return asyncio.run(_stall(target, payload, config, _peak_sampler(target)))


# --- idle connections over the connection cap --------------------------------------------------------

@dataclass(frozen=True)
class CapConfig:
    """``connections`` idle connections (half silent, half half a request line), then ``polls``
    ``/health`` polls 0.1 s apart on new connections; ``header_timeout_s`` is the server's header
    deadline (``ServerConfig.header_timeout_s``, whose default it is): each idle one is waited for
    up to 30 s beyond it."""

    connections: int = 2100
    polls: int = 20
    header_timeout_s: float = HEADER_TIMEOUT_S


@dataclass
class CapResult:
    """How ``/health`` answered while the idle connections were held, and how each one ended."""

    connections: int
    held_when_polling_began: int
    health: PollSummary
    health_min_held_during_a_poll: int
    idle_connections_ended: dict[str, int]
    peak_rss_bytes: int | None = None


async def _connection_cap(target: Target, config: CapConfig, rss: RssSampler | None) -> CapResult:
    held = {"now": 0}

    async def idle(i: int) -> dict:
        try:
            reader, writer = await connect(target)
        except (OSError, asyncio.TimeoutError) as err:
            return {"status": f"connect failed ({type(err).__name__})"}
        if i % 2:
            writer.write(half_request_line(target))
        held["now"] += 1
        try:
            raw = await asyncio.wait_for(read_until_closed(reader), config.header_timeout_s + 30)
            status, is_json = status_of(raw), raw.partition(b"\r\n\r\n")[2][:1] == b"{"
            outcome = f"{status} {'JSON' if is_json else 'not JSON'}" if status else "closed without an answer"
        except asyncio.TimeoutError:
            outcome = "still open"
        except AnswerError as err:
            outcome = err.kind
        except OSError as err:
            outcome = f"transport error ({type(err).__name__})"
        held["now"] -= 1
        writer.close()
        return {"status": outcome}

    if rss:
        rss.start_peak()
    tasks = [asyncio.create_task(idle(i)) for i in range(config.connections)]
    while held["now"] + sum(t.done() for t in tasks) < config.connections:  # every one connected (or failed)
        await asyncio.sleep(0.05)
    opened = held["now"]
    replies, held_then = [], []
    for _ in range(config.polls):
        replies.append(await get_once(target, HEALTH_WAIT_S))
        held_then.append(held["now"])
        await asyncio.sleep(0.1)
    ends = collections.Counter(r["status"] for r in await asyncio.gather(*tasks))
    return CapResult(config.connections, opened, PollSummary.of(replies), min(held_then), dict(sorted(ends.items())),
                     rss.stop_peak() if rss else None)


def run_connection_cap(target: Target, config: CapConfig = CapConfig()) -> CapResult:
    """Open ``config.connections`` idle connections at once (more than the server's cap, to
    check it), then poll ``/health`` on new connections while they are held.

    Returns:
        A :class:`CapResult`: the polls, and how each idle connection ended (e.g. ``"408 JSON"``,
        ``"503 JSON"``, ``"closed without an answer"``, ``"answer over 65,536 bytes"``).

    Example:
        >>> run_connection_cap(Target.from_url(url), CapConfig(connections=50, polls=3)).health.ok  # doctest: +SKIP
        3
    """
    return asyncio.run(_connection_cap(target, config, _peak_sampler(target)))


# --- pipelining flood --------------------------------------------------------------------------

@dataclass(frozen=True)
class PipeliningConfig:
    """``connections`` connections each writing ``depth`` pipelined ``GET /`` at once; the flood
    is stopped ``window_s`` after it began if the server has not ended it."""

    connections: int = 2100
    depth: int = 3000
    window_s: float = 60.0


@dataclass
class PipeliningResult:
    """Answers each flooding connection got (heads counted), how each ended, and ``/health``
    polled every 0.25 s on new connections during the flood."""

    connections: int
    pipelined_per_connection: int
    window_s: float
    wall_s: float
    ended_by_server_within_window: bool
    answers_total: int
    answers_per_connection_max: int
    answers_per_connection_median: float
    ends: dict[str, int]
    health_during_flood: PollSummary


async def _pipelining(target: Target, config: PipeliningConfig) -> PipeliningResult:
    request = b"GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % target.host.encode() * config.depth
    live = {"now": 0}
    done = asyncio.Event()

    async def flood() -> dict:
        try:
            reader, writer = await connect(target)
        except (OSError, asyncio.TimeoutError) as err:
            return {"answers": 0, "end": f"connect failed ({type(err).__name__})"}
        live["now"] += 1
        answers, tail, end = 0, b"", "window over"
        try:
            writer.write(request)
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    end = "closed by the server"
                    break
                answers += (tail + chunk).count(b"HTTP/1.1 ")  # answer heads; tail: one cut at a chunk edge
                tail = chunk[-8:]
        except OSError as err:
            end = f"closed by the server ({type(err).__name__})"
        except asyncio.CancelledError:
            pass
        finally:
            live["now"] -= 1
            writer.close()
        return {"answers": answers, "end": end}

    async def poll() -> list[tuple[Reply, int]]:
        polls = []
        while not done.is_set():
            polls.append((await get_once(target, config.window_s), live["now"]))
            await asyncio.sleep(0.25)
        return polls

    start = time.perf_counter()
    poller = asyncio.create_task(poll())
    floods = [asyncio.create_task(flood()) for _ in range(config.connections)]
    _, pending = await asyncio.wait(floods, timeout=config.window_s)
    for task in pending:
        task.cancel()
    results = [r if isinstance(r, dict) else {"answers": 0, "end": "window over"}
               for r in await asyncio.gather(*floods, return_exceptions=True)]
    wall = time.perf_counter() - start
    done.set()
    during = [reply for reply, flooding in await poller if flooding > 0]
    answers = [r["answers"] for r in results]
    return PipeliningResult(config.connections, config.depth, config.window_s, wall, not pending, int(sum(answers)),
                            int(max(answers)), float(np.median(answers)),
                            dict(collections.Counter(r["end"] for r in results)), PollSummary.of(during))


def run_pipelining(target: Target, config: PipeliningConfig = PipeliningConfig()) -> PipeliningResult:
    """Flood the server with pipelined requests from many connections while polling ``/health``.

    Returns:
        A :class:`PipeliningResult`; a server that caps pipelining answers each connection at
        most 1 + its cap times before closing it.

    Example:
        >>> run_pipelining(Target.from_url(url), PipeliningConfig(10, 200, 30)).answers_per_connection_max  # doctest: +SKIP
        17
    """
    return asyncio.run(_pipelining(target, config))


# --- clients that do not read ---------------------------------------------------------------------

@dataclass
class SlowReaderResult:
    """When the server let go of each client that did not read (its socket gone from the server
    process), from the first byte of its answer."""

    connections: int
    window_s: float
    answer_bytes: int
    answers_begun: int
    closed: int
    held_at_end_of_window: int
    closed_after_s_median: float | None
    closed_after_s_max: float | None
    peak_rss_bytes: int | None = None


def _held_by_server(pid: int, port: int, client_ports: set[int]) -> set[int]:
    """The client ports whose connection the server process still holds a socket for."""
    return {c.raddr.port for c in psutil.Process(pid).net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.raddr and c.raddr.port in client_ports}


async def _slow_readers(target: Target, payload: bytes, answer_bytes: int, count: int, window_s: float,
                        rss: RssSampler) -> SlowReaderResult:
    loop = asyncio.get_running_loop()
    request = infer_head(target, len(payload)) + payload
    rss.start_peak()
    sockets: list[socket.socket] = []
    answering, closed = {}, {}
    guard = time.perf_counter() + count * 30 + window_s  # a hang guard for a server that never answers
    try:
        while len(closed) < count and time.perf_counter() < guard:
            while len(sockets) < count:
                sock = small_window_socket()
                sock.setblocking(False)
                sockets.append(sock)  # closed below, connected or not
                await asyncio.wait_for(loop.sock_connect(sock, (target.host, target.port)), CONNECT_TIMEOUT_S)
                await loop.sock_sendall(sock, request)
            readable = select.select(sockets, [], [], 0)[0]  # the answer began to arrive (nothing is read)
            held = _held_by_server(target.server_pid, target.port, {sock.getsockname()[1] for sock in sockets})
            now = time.perf_counter()
            for sock in readable:
                answering.setdefault(sock.getsockname()[1], now)
            # Gone: answered, and no longer held. An answer that began proves the server accepted the
            # connection (not yet accepted is not gone). Requiring it also to have been seen held missed
            # clients that a busy machine accepted, answered, timed out and closed between two polls (a
            # CI run of 2026-11-27 counted one as still held).
            for client_port in set(answering) - held - set(closed):
                closed[client_port] = now - answering[client_port]
            if len(answering) == count and now - max(answering.values()) > window_s:
                break
            await asyncio.sleep(0.1)
    finally:
        peak = rss.stop_peak()
        for sock in sockets:
            sock.close()
    times = sorted(closed.values())
    return SlowReaderResult(count, window_s, answer_bytes, len(answering), len(times), count - len(times),
                            float(np.median(times)) if times else None, times[-1] if times else None, peak)


def run_slow_readers(target: Target, payload: bytes, answer_bytes: int, count: int, window_s: float) -> SlowReaderResult:
    """``count`` clients with the smallest receive buffer each send one request whose answer is
    larger than loopback's socket buffers take, all at once, and never read: when did the server
    let go of each? Polled every 0.1 s until ``window_s`` after the last answer began.

    Args:
        target: the server; it must run on this machine (``server_pid`` set): only its own
            socket table shows that it let go of a client that reads nothing.
        payload: the request body; its answer must outgrow the socket buffers (a wide tail, a batch).
        answer_bytes: that answer's size, as recorded.
        count: clients.
        window_s: how long to watch after the last answer began.

    Returns:
        A :class:`SlowReaderResult`.

    Raises:
        ValueError: ``target.server_pid`` is not set.
        OSError: a client could not connect (``asyncio.TimeoutError``: not within
            :data:`~edgetorch.split.wire.CONNECT_TIMEOUT_S`).

    Example:
        >>> run_slow_readers(Target("127.0.0.1", port, server_pid=pid), body, size, 3, 20).closed  # doctest: +SKIP
        3
    """
    if target.server_pid is None:
        raise ValueError("run_slow_readers needs Target.server_pid: only the server process's own sockets show "
                         "when it let go of a client that reads nothing; run it on the server's machine")
    return asyncio.run(_slow_readers(target, payload, answer_bytes, count, window_s, RssSampler(target.server_pid)))
