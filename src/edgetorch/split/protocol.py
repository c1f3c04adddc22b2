"""The HTTP protocol layer of the split server: what needs uvicorn's h11 protocol rather than the app.

:func:`uvicorn_config` sets the header and write deadlines, idle connections, the connection and
pipelining caps, the header size and WebSocket off, answering protocol-level refusals in the same
JSON as the app (:mod:`edgetorch.split.server`, whose docstring lists every answer);
:func:`serve_in_background` runs an app under those settings in a thread.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI

from .metrics import Metrics
from .server import ServerConfig, error_body, error_response


def _raw_error(status: int, kind: str | None, message: str) -> bytes:
    """A whole JSON error answer that closes the connection, written by the protocol layer where
    no request has reached the app."""
    body = json.dumps(error_body(status, kind, message)).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (status, HTTPStatus(status).phrase.encode(), len(body), body))


_TIMEOUT_ANSWER = _raw_error(408, None, "the request line and headers did not arrive in time")
_BAD_REQUEST_ANSWER = _raw_error(400, None, "malformed HTTP request (or request line and headers over the size limit)")


class _Connections:
    """What the protocol instances of one server share (all on its one event loop): the open
    connections, those waiting for their client (insertion-ordered: the first has waited longest),
    and how many requests the app is running."""

    def __init__(self) -> None:
        self.open: set[Any] = set()
        self.waiting: dict[Any, None] = {}
        self.running = 0


class _Admission:
    """The request cap in front of the app: beyond ``limit`` requests running at once, a JSON 503.

    ``GET /health`` is let through: the event loop answers it at no cost, and an orchestrator that
    cannot reach it restarts a server that is only busy.
    """

    def __init__(self, app: Any, limit: int, connections: _Connections, metrics: Metrics | None):
        self.app, self.limit, self.connections, self.metrics = app, limit, connections, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (scope["method"] == "GET" and scope["path"] == "/health"):
            await self.app(scope, receive, send)
            return
        if self.connections.running >= self.limit:
            response = error_response(503, "over_capacity", f"the server is running its limit of {self.limit} requests; "
                                                    "try again shortly", {"connection": "close", "retry-after": "1"})
            await response(scope, receive, send)
            if self.metrics is not None:
                self.metrics.record_request("(capacity)", 503)
            return
        self.connections.running += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.connections.running -= 1


def _protocol_class(config: ServerConfig, metrics: Metrics | None, connections: _Connections) -> type:
    """uvicorn's h11 protocol plus header and write deadlines, the connection and pipelining caps,
    and JSON protocol-level errors.

    uvicorn (0.54) times out idle keep-alive connections only after a response: a connection that
    opens and sends nothing, or half a request line, is held forever, and so are slowloris clients.
    This subclass arms one deadline whenever the connection waits for the client outside a running
    request (from the moment it opens, and again when a new request's first bytes end a keep-alive
    idle period); it is not pushed back by further bytes, so dripping headers does not help. While
    the app runs a request, the app's own body deadline applies instead.

    uvicorn also waits forever for a client that does not read: its answer waits for the socket to
    drain, and closing waits for the same. The write deadline starts when the socket first refuses
    bytes (``pause_writing``) and ends only when all of them have left (``resume_writing``), so a
    trickle of reads does not extend it; when it passes, the connection is aborted, since no answer
    can reach that client.

    Why the connection cap evicts: uvicorn's cap answered every request 503 while the connections
    were over it, so 2,100 idle connections kept ``/health`` failing until the header deadline
    closed them. A reserve of slots for ``/health`` fills up the same way (a flood is never a fixed
    size), and a stored health answer still needs an accepted connection and a parsed request. So a
    connection beyond the cap closes the one that has waited longest for a request: an idle flood
    then pushes out its own oldest members, no connection with a request in progress is touched,
    and a closed keep-alive connection costs its client only a reconnect.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    timeout, cap = config.header_timeout_s, config.max_connections
    evicted_answer = _raw_error(503, "over_capacity", f"the server holds its limit of {cap} connections and "
                                                      "closed this one, which had waited longest for a complete request")

    def dropped(reason: str) -> None:
        if metrics is not None:
            metrics.record_drop(reason)

    class DeadlineH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _write_deadline: asyncio.TimerHandle | None = None
        _pipelined = 0  # requests in a row that were already waiting when the previous answer went out

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            # A high-water mark of 0: pause_writing comes as soon as the socket refuses a byte, and
            # resume_writing only once every byte has left, which is what the write deadline measures.
            transport.set_write_buffer_limits(high=0)
            connections.open.add(self)
            self._watch()
            while len(connections.open) > cap:
                oldest = next((c for c in connections.waiting if c is not self), None)
                if oldest is None:  # every other one is running a request: this one stays, for /health
                    break
                oldest._evict()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            if self._pipelined >= config.max_pipelined and not self.transport.is_closing():
                # The client resends whatever it had queued on a new connection (RFC 9112, 9.3.2).
                dropped("pipelined")
                self.transport.close()
            super().on_response_complete()
            # A request that runs already was complete in the buffer when this answer was sent.
            self._pipelined = self._pipelined + 1 if self._in_app() else 0
            self._watch()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_deadline is None:
                self._write_deadline = self.loop.call_later(config.write_timeout_s, self._write_expired)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel_write()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            self._cancel_write()
            connections.open.discard(self)
            connections.waiting.pop(self, None)
            super().connection_lost(exc)

        def _cancel(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _cancel_write(self) -> None:
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None

        def _in_app(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _watch(self) -> None:
            in_app, closing = self._in_app(), self.transport.is_closing()
            if in_app or closing:
                connections.waiting.pop(self, None)
            else:  # setdefault keeps its place: bytes dripping in do not make it younger
                connections.waiting.setdefault(self, None)
            idle = self.timeout_keep_alive_task is not None  # uvicorn's keep-alive timer covers it
            if in_app or idle or closing:
                self._cancel()
            elif self._deadline is None:
                self._deadline = self.loop.call_later(timeout, self._expired)

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self.conn.our_state is h11.IDLE:  # no answer started for this request: say why we close
                self.transport.write(_TIMEOUT_ANSWER)
                if metrics is not None:
                    metrics.record_request("(headers)", 408)
            self.transport.close()

        def _evict(self) -> None:
            connections.open.discard(self)
            connections.waiting.pop(self, None)
            dropped("evicted")
            if self.timeout_keep_alive_task is None:  # it had begun a request, or not yet: say why
                self.transport.write(evicted_answer)
                if metrics is not None:
                    metrics.record_request("(capacity)", 503)
            self.transport.close()

        def _write_expired(self) -> None:
            self._write_deadline = None
            dropped("write_timeout")
            self.transport.abort()  # close() would wait for the unread bytes to leave first

        def send_400_response(self, msg: str) -> None:
            # uvicorn answers unparseable HTTP with text/plain; keep every 4xx in the same JSON shape.
            self.transport.write(_BAD_REQUEST_ANSWER)
            if metrics is not None:
                metrics.record_request("(headers)", 400)
            self.transport.close()

    return DeadlineH11Protocol


def uvicorn_config(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, config: ServerConfig | None = None,
                   **overrides: Any) -> Any:
    """The uvicorn settings that enforce ``config``'s protocol-level limits, in one place.

    Args:
        app: the app from :func:`create_app`.
        host: address to bind (the default serves loopback only).
        port: port to bind.
        config: defaults to the one the app was built with (``app.state.server_config``).
        **overrides: other :class:`uvicorn.Config` arguments (``log_level``, ``workers``, ...).

    Returns:
        A :class:`uvicorn.Config`: header and write deadlines, the connection and pipelining caps
        and JSON 400/408/503s (our h11 protocol subclass), the running-request cap (a wrapper
        around ``app``), keep-alive timeout, header size limit, WebSocket off and no ``server``
        header. uvicorn's own ``limit_concurrency`` stays off: it answers text/plain 503s, and
        ``/health`` with them.

    Example:
        >>> import uvicorn
        >>> app = create_app(tail, manifest, ServerConfig(read_timeout_s=10))  # doctest: +SKIP
        >>> uvicorn.Server(uvicorn_config(app, "0.0.0.0", 8000)).run()  # doctest: +SKIP
    """
    import uvicorn

    config = config or getattr(app.state, "server_config", None) or ServerConfig()
    metrics, connections = getattr(app.state, "metrics", None), _Connections()
    settings = {"log_level": "info", "server_header": False, **overrides}
    # ws="none": a WebSocket connection would leave this protocol and its deadlines; the app
    # refuses the handshake with a JSON 400 instead.
    return uvicorn.Config(_Admission(app, config.max_connections, connections, metrics), host=host, port=port,
                          http=_protocol_class(config, metrics, connections), ws="none",
                          timeout_keep_alive=config.keep_alive_s,
                          h11_max_incomplete_event_size=config.max_header_bytes, **settings)


@contextmanager
def serve_in_background(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run ``app`` under uvicorn (with :func:`uvicorn_config`) in a daemon thread for the ``with``
    block; yields its base URL.

    ``port=0`` binds a free port (the socket is bound here, so there is no race for it). Used by
    the demo, the tests and the CLI's tests; ``edgetorch split serve`` runs uvicorn in the foreground.

    Example:
        >>> with serve_in_background(app) as url:  # doctest: +SKIP
        ...     httpx.get(url + "/health").json()["status"]
        'ok'
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn_config(app, host, sock.getsockname()[1], log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background uvicorn server did not start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
