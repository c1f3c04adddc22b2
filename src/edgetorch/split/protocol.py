"""The HTTP protocol layer of the split server: what needs the connection rather than the app.

:func:`uvicorn_config` sets the header and write deadlines, idle connections, the connection and
pipelining caps, the header size and WebSocket off, answering protocol-level refusals in the same
JSON as the app (:mod:`edgetorch.split.server`, whose docstring lists every answer);
:func:`serve_in_background` runs an app under those settings in a thread.
"""

from __future__ import annotations

import asyncio
import contextvars
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


# The connection a request arrived on, for the request's ASGI call (see _protocol_class).
_CONNECTION: contextvars.ContextVar[Any] = contextvars.ContextVar("edgetorch_split_connection")


class _Connections:
    """What the connections of one server share (all on its one event loop): the open ones, those
    waiting for their client (insertion-ordered: the first has waited longest), and how many
    requests the app is running."""

    def __init__(self) -> None:
        self.open: set[Any] = set()
        self.waiting: dict[Any, None] = {}
        self.running = 0


class _Admission:
    """The ASGI layer of the protocol: tells each request's connection when the request starts and
    when its answer has gone out, and caps the requests running at once (beyond ``limit``, a JSON 503).

    ``GET /health`` is let through the cap: the event loop answers it at no cost, and an
    orchestrator that cannot reach it restarts a server that is only busy.
    """

    def __init__(self, app: Any, limit: int, connections: _Connections, metrics: Metrics | None):
        self.app, self.limit, self.connections, self.metrics = app, limit, connections, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan: no connection
            await self.app(scope, receive, send)
            return
        connection = _CONNECTION.get(None)
        if connection is None:
            raise RuntimeError("this request did not arrive through the connection class of uvicorn_config (or "
                               "uvicorn ran it in a fresh context), so no header deadline can follow it")
        if not connection.request_started():
            # Its connection was answered (408 or 503) and closed in the loop turn that completed
            # this request: nothing more may follow that answer. Returning only once the client is
            # gone keeps uvicorn from writing a 500 for a request that never answered.
            while (await receive())["type"] != "http.disconnect":
                pass
            return
        send = connection.tracked(send)
        if scope["method"] == "GET" and scope["path"] == "/health":
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
    """The asyncio protocol of one server's connections: uvicorn's h11 protocol inside, the header
    and write deadlines, the connection and pipelining caps and JSON protocol-level errors around it.

    uvicorn (0.54) times out idle keep-alive connections only after an answer: a connection that
    opens and sends nothing, or half a request line, is held forever, and so are slowloris clients.
    One deadline is armed whenever the connection waits for a request's line and headers (from the
    moment it opens, and again when a new request's first bytes end a keep-alive idle period); it
    is not pushed back by further bytes, so dripping headers does not help. While the app runs a
    request, the app's own body deadline applies instead; between requests, uvicorn's keep-alive.

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

    What each of these rests on, so that a uvicorn upgrade cannot switch one off unseen: the
    deadlines and caps live in this wrapper, not in a subclass, and see uvicorn only through
    interfaces it must keep. The event loop calls this object's asyncio protocol methods
    (``connection_made``, ``data_received``, ``pause_writing``, ...), which arm the timers and then
    hand on to uvicorn's protocol; the ASGI layer (:class:`_Admission`) disarms the header deadline
    when the app is called for a request. The request finds its connection in a context variable:
    asyncio runs a task in a copy of the context it was created in, and uvicorn creates a request's
    task inside this ``data_received`` (or inside the previous request's task, when pipelined). A
    change that broke that link would make every request fail loudly, never leave a deadline
    unarmed. Idle keep-alive connections are uvicorn's documented ``timeout_keep_alive``; the
    pipelining cap is a ``connection: close`` on the answer, which HTTP/1.1 servers honour.

    The one uvicorn internal left is the answer to unparseable HTTP: uvicorn has no public hook for
    it, and ``send_400_response`` is where it writes its text/plain 400. Were that method renamed,
    clients would get uvicorn's 400 (still a 400, and closed), and the tests of JSON on the wire fail.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    cap = config.max_connections
    evicted_answer = _raw_error(503, "over_capacity", f"the server holds its limit of {cap} connections and "
                                                      "closed this one, which had waited longest for a complete request")

    def count(what: str, status: int) -> None:
        if metrics is not None:
            metrics.record_request(what, status)

    def dropped(reason: str) -> None:
        if metrics is not None:
            metrics.record_drop(reason)

    class JsonErrorsH11Protocol(H11Protocol):
        """uvicorn's h11 protocol, answering unparseable HTTP in the app's JSON shape (the 400 is
        written on the connection that read the bytes, so nothing of uvicorn's state is touched)."""

        def send_400_response(self, msg: str) -> None:
            if _CONNECTION.get()._close(_BAD_REQUEST_ANSWER):
                count("(headers)", 400)

    class Connection(asyncio.Protocol):
        """One client connection (:func:`_protocol_class` says what it adds, and what each part rests on)."""

        def __init__(self, **uvicorn_arguments: Any) -> None:
            self.http = JsonErrorsH11Protocol(**uvicorn_arguments)
            self.loop = asyncio.get_running_loop()
            self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
            self.idle = False  # answered, and no byte since: uvicorn's keep-alive timer covers it
            self.closed = False  # closed by this class: no request may answer after that
            self.pipelined = 0  # requests in a row that were already waiting when the previous answer went out
            self.deadline: asyncio.TimerHandle | None = None
            self.write_deadline: asyncio.TimerHandle | None = None

        # -- the asyncio protocol: what the event loop calls, handed on to uvicorn's protocol ----

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]
            self.http.connection_made(transport)
            # A high-water mark of 0: pause_writing comes as soon as the socket refuses a byte, and
            # resume_writing only once every byte has left, which is what the write deadline measures.
            self.transport.set_write_buffer_limits(high=0)
            connections.open.add(self)
            self._wait_for_headers()
            while len(connections.open) > cap:
                oldest = next((c for c in connections.waiting if c is not self), None)
                if oldest is None:  # every other one is running a request: this one stays, for /health
                    break
                oldest._evict()

        def data_received(self, data: bytes) -> None:
            if self.idle:  # a new request's first bytes end the keep-alive idle period
                self.idle = False
                self._wait_for_headers()
            token = _CONNECTION.set(self)  # the request task uvicorn creates in here inherits it
            try:
                self.http.data_received(data)
            finally:
                _CONNECTION.reset(token)

        def eof_received(self) -> bool | None:
            return self.http.eof_received()

        def pause_writing(self) -> None:
            self.http.pause_writing()
            if self.write_deadline is None:
                self.write_deadline = self.loop.call_later(config.write_timeout_s, self._write_expired)

        def resume_writing(self) -> None:
            self.http.resume_writing()
            self._cancel_write()

        def connection_lost(self, exc: Exception | None) -> None:
            self._leave()
            self._cancel_write()
            self.http.connection_lost(exc)

        # -- what the ASGI layer tells it ----------------------------------------------------------

        def request_started(self) -> bool:
            """A request's headers are complete and the app is called: False if this connection
            was already answered and closed (its deadline or an eviction came first)."""
            if self.closed:
                return False
            self.pipelined = self.pipelined + 1 if self.idle else 0
            self.idle = False
            self._cancel()
            connections.waiting.pop(self, None)
            return True

        def tracked(self, send: Any) -> Any:
            """``send`` for this request: closes the connection after the answer that reaches the
            pipelining cap, and marks the connection idle once the answer has gone out."""

            async def tracked_send(message: dict) -> None:
                headers = message.get("headers", [])
                if (message["type"] == "http.response.start" and self.pipelined >= config.max_pipelined
                        and not any(name.lower() == b"connection" for name, _ in headers)):
                    # The client resends whatever it had queued on a new connection (RFC 9112, 9.3.2).
                    dropped("pipelined")
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    self._answered()

            return tracked_send

        # -- deadlines and closing -----------------------------------------------------------------

        def _answered(self) -> None:
            if not self.transport.is_closing():
                self.idle = True  # uvicorn armed its keep-alive timer when the answer went out
                connections.waiting.setdefault(self, None)

        def _wait_for_headers(self) -> None:
            # setdefault keeps its place: bytes dripping in do not make it younger
            connections.waiting.setdefault(self, None)
            self._cancel()
            self.deadline = self.loop.call_later(config.header_timeout_s, self._headers_expired)

        def _headers_expired(self) -> None:
            self.deadline = None
            if self._close(_TIMEOUT_ANSWER):
                count("(headers)", 408)

        def _evict(self) -> None:
            idle = self.idle  # an idle keep-alive connection is closed without a word
            if self._close(None if idle else evicted_answer):
                dropped("evicted")
                if not idle:
                    count("(capacity)", 503)

        def _write_expired(self) -> None:
            self.write_deadline = None
            dropped("write_timeout")
            self.transport.abort()  # close() would wait for the unread bytes to leave first

        def _close(self, answer: bytes | None) -> bool:
            """Close the connection, saying ``answer`` first; False if it was closing already."""
            self._leave()
            if self.transport.is_closing():
                return False
            self.closed = True
            if answer is not None:
                self.transport.write(answer)
            self.transport.close()
            return True

        def _leave(self) -> None:
            self._cancel()
            connections.open.discard(self)
            connections.waiting.pop(self, None)

        def _cancel(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _cancel_write(self) -> None:
            if self.write_deadline is not None:
                self.write_deadline.cancel()
                self.write_deadline = None

    return Connection


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
        and JSON 400/408/503s (our connection protocol around uvicorn's h11 one), the
        running-request cap (a wrapper around ``app``), keep-alive timeout, header size limit,
        WebSocket off and no ``server`` header. uvicorn's own ``limit_concurrency`` stays off: it
        answers text/plain 503s, and ``/health`` with them.

    Raises:
        ValueError: ``reset_contextvars=True`` in ``overrides``: it runs each request in a fresh
            context, where it cannot find the connection whose header deadline it must end.

    Example:
        >>> import uvicorn
        >>> app = create_app(tail, manifest, ServerConfig(read_timeout_s=10))  # doctest: +SKIP
        >>> uvicorn.Server(uvicorn_config(app, "0.0.0.0", 8000)).run()  # doctest: +SKIP
    """
    import uvicorn

    if overrides.get("reset_contextvars"):
        raise ValueError("uvicorn_config cannot take reset_contextvars=True: a request run in a fresh context cannot "
                         "find its connection, whose header deadline it ends; accepted: False (uvicorn's default)")
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
