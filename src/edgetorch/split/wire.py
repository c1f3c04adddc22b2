"""HTTP/1.1 on raw sockets, for the probes of a tail server: the bytes their clients send, one
``GET`` on a new connection, and reading the answers that come back.

A raw socket sends what an HTTP library would refuse to (half a request, a lying length, a
pipelined flood) and sees exactly what the server wrote, so :mod:`edgetorch.split.probe` and
:mod:`edgetorch.split.fuzz` build on these.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import socket
import time
from dataclasses import dataclass

import numpy as np

from .loadgen import AnswerError, Target

# The most a raw-socket client here reads from one connection. They expect /health or a short JSON
# refusal (408, 503), a few hundred bytes, and the hostile phases hold thousands of connections at
# once: a server that answers without end may cost each of them this much, no more.
MAX_RAW_ANSWER_BYTES = 64 << 10
# How long a raw-socket client waits to connect. Thousands opened at once queue for the server's
# accept, and a SYN the kernel dropped is sent again only after 1, 3, then 7 s.
CONNECT_TIMEOUT_S = 30.0


async def connect(target: Target, timeout_s: float = CONNECT_TIMEOUT_S) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A new connection to ``target``; its reader's buffer holds at most :data:`MAX_RAW_ANSWER_BYTES`
    (``readuntil`` raises ``asyncio.LimitOverrunError`` past it).

    Raises:
        OSError: it was refused or failed.
        asyncio.TimeoutError: it was not accepted within ``timeout_s``.
    """
    opening = asyncio.open_connection(target.host, target.port, limit=MAX_RAW_ANSWER_BYTES)
    return await asyncio.wait_for(opening, timeout_s)


async def read_until_closed(reader: asyncio.StreamReader, limit: int = MAX_RAW_ANSWER_BYTES) -> bytes:
    """Everything the server sends on a connection until it closes it, at most ``limit`` bytes.

    Raises:
        AnswerError: it sent more than ``limit`` bytes (reading stops there; ``kind`` says so).

    Example:
        >>> raw = await asyncio.wait_for(read_until_closed(reader), 30)  # doctest: +SKIP
    """
    raw = bytearray()
    while chunk := await reader.read(limit + 1 - len(raw)):
        raw += chunk
        if len(raw) > limit:
            raise AnswerError(f"the server sent more than {limit:,} bytes on one connection; a probe client reads "
                              "at most that", f"answer over {limit:,} bytes")
    return bytes(raw)


def status_of(raw: bytes) -> int | None:
    """The status code of the HTTP answer ``raw`` begins with, or ``None`` if it is not one."""
    try:
        return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else None
    except (IndexError, ValueError):
        return None


def parse_answers(raw: bytes) -> list[tuple[int | None, bytes, bytes]]:
    """The complete answers in ``raw`` as (status, head, body); a cut-off last one is left out.

    Example:
        >>> parse_answers(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\n{}HTTP/1.1 408")
        [(200, b'HTTP/1.1 200 OK\\r\\ncontent-length: 2', b'{}')]
    """
    answers = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        length = re.search(rb"\r\ncontent-length: *(\d+)", head, re.IGNORECASE)
        if not sep or length is None or len(rest) < int(length[1]):
            break
        answers.append((status_of(head), head, rest[:int(length[1])]))
        raw = rest[int(length[1]):]
    return answers


def stalled_requests(target: Target, payload: bytes) -> tuple[bytes, bytes]:
    """The two ways :func:`run_stall` stops halfway: (partial request line and headers, complete
    headers of a ``POST /infer`` and half of ``payload``)."""
    headers = b"POST /infer HTTP/1.1\r\nHost: " + target.host.encode() + b"\r\nContent-Type: application/oc"
    return headers, infer_head(target, len(payload)) + payload[:len(payload) // 2]


def infer_head(target: Target, length: int) -> bytes:
    """The request line and headers of a ``POST /infer`` of ``length`` payload bytes (with the
    target's token, if it has one)."""
    auth = b"" if target.token is None else b"Authorization: " + target.auth.encode() + b"\r\n"
    return (b"POST /infer HTTP/1.1\r\nHost: " + target.host.encode() + b"\r\nContent-Type: application/octet-stream\r\n"
            + auth + b"Content-Length: %d\r\n\r\n" % length)


def half_request_line(target: Target) -> bytes:
    """A request line and a header with no blank line after: a request that never completes."""
    return b"GET / HTTP/1.1\r\nHost: " + target.host.encode() + b"\r\n"


def small_window_socket() -> socket.socket:
    """An unconnected TCP socket with the kernel's smallest receive buffer (set before connecting,
    so the window it advertises stays small): a client that reads nothing holds little."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    return sock


@dataclass
class Reply:
    """One ``GET`` on a new connection: its status (or why there is none), everything the server
    sent until it closed, and the round trip (``None`` without an answer)."""

    status: str
    raw: bytes
    latency_s: float | None


async def get_once(target: Target, wait_s: float, path: str = "/health") -> Reply:
    """``GET path`` on a new connection with ``Connection: close``; read until the server closes
    (at most :data:`MAX_RAW_ANSWER_BYTES`: a longer answer's status is ``"answer over N bytes"``).

    Example:
        >>> asyncio.run(get_once(Target.from_url(url), 10)).status  # doctest: +SKIP
        '200'
    """
    start = time.perf_counter()
    try:
        reader, writer = await connect(target, wait_s)
    except (OSError, asyncio.TimeoutError) as err:
        return Reply(f"connect failed ({type(err).__name__})", b"", None)
    try:
        writer.write(b"GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (path.encode(), target.host.encode()))
        raw = await asyncio.wait_for(read_until_closed(reader), wait_s)
        status = status_of(raw)
        return Reply(str(status) if status is not None else "no answer", raw, time.perf_counter() - start)
    except asyncio.TimeoutError:
        return Reply("no answer in time", b"", None)
    except AnswerError as err:
        return Reply(err.kind, b"", None)
    except OSError as err:
        return Reply(f"transport error ({type(err).__name__})", b"", None)
    finally:
        writer.close()


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw.partition(b"\r\n\r\n")[2])
        return True
    except ValueError:
        return False


@dataclass
class PollSummary:
    """``/health`` polls on new connections: how many, how many answered 200, their statuses,
    the errors answered (with a JSON body) and the 200s' median and slowest round trips."""

    polls: int
    ok: int
    statuses: dict[str, int]
    errors_with_json_body: int
    errors_answered: int
    p50_ms: float | None
    max_ms: float | None

    @classmethod
    def of(cls, replies: list[Reply]) -> PollSummary:
        latencies = [r.latency_s for r in replies if r.status == "200"]
        errors = [r for r in replies if r.status != "200" and r.latency_s is not None]
        return cls(len(replies), len(latencies), dict(collections.Counter(r.status for r in replies)),
                   sum(_is_json(r.raw) for r in errors), len(errors),
                   float(np.median(latencies) * 1e3) if latencies else None,
                   float(max(latencies) * 1e3) if latencies else None)


