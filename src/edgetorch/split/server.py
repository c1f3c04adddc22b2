"""The edge server: an ASGI app that runs the tail on bottleneck payloads.

Why FastAPI on an ASGI server (uvicorn): ASGI is the standard Python web-server interface, so the
same app runs under ``uvicorn --workers N``, gunicorn with uvicorn workers, or behind Ray Serve's
FastAPI ingress without changes; FastAPI gives request routing without code of our own, and runs
the (blocking) tail in its thread pool so the event loop keeps accepting.

Endpoints:

* ``GET /health``: liveness, always open, ``{"status": "ok"}``; answered on the event loop, so it
  answers while the tail is busy and while stalled connections are held, and exempt from the cap
  on running requests, so it answers at the connection cap too.
* ``GET /``: model info (arch, channels, bottleneck shape, limits); open, as before.
* ``POST /infer``: body ``application/octet-stream`` = a :func:`edgetorch.split.payload.encode`
  payload of a [N, *bottleneck_shape] tensor; answers ``{"logits": [[...], ...], "timing": {...}}``.
* ``GET /metrics``: Prometheus text format: ``edgetorch_split_requests_total{path, code}``,
  ``edgetorch_split_errors_total{code}``, ``edgetorch_split_connections_dropped_total{reason}`` and
  the ``edgetorch_split_inference_seconds`` histogram (decode + tail of answered requests). It needs the token when one is set: it reveals how much
  traffic the server takes and how long each inference runs, which is nobody's business but the
  operator's, and Prometheus sends a bearer token with ``authorization: {credentials: ...}`` in
  its scrape config. ``/health`` stays open because liveness probes rarely can.
* ``/docs``, ``/redoc``, ``/openapi.json``: only without a token; with one they are off (404), so a
  protected server does not describe itself to whoever asks.

Every refused request gets a JSON ``{"error": {"code": <int>, "type": "<name>", "message": "..."}}``
(FastAPI's own 404 and 405 included) and the server keeps serving:

====  ========================  =====================================================================
code  type                      when
====  ========================  =====================================================================
400   bad_request               malformed HTTP (from the protocol), or a Content-Length that is not a number
400   malformed_payload         the body is not a valid payload (the codec's message says why)
400   websocket_not_supported   a WebSocket handshake (this server speaks plain HTTP only)
401   unauthorized              missing or wrong ``Authorization: Bearer <token>`` (scheme case-insensitive)
404   not_found                 no such path (or docs with a token set; a trailing slash is not redirected)
405   method_not_allowed        e.g. ``GET /infer``
408   request_timeout           headers not complete within ``header_timeout_s``, or the body within
                                ``read_timeout_s``; the connection is closed
413   payload_too_large         body over ``max_payload_bytes`` (declared or streamed), or a batch over
                                ``max_batch`` (checked from the payload header, before decoding)
415   unsupported_media_type    content type other than ``application/octet-stream`` (case-insensitive)
431   request_header_fields_    request line and headers over ``max_header_bytes`` (400 while they are
      too_large                 still arriving, from the protocol layer)
422   shape_mismatch            a valid payload of another shape than the tail's bottleneck
422   non_finite_output         the tail's logits are inf or NaN for this (finite) payload
500   internal_error            a genuine server bug (the tail raised on a payload that passed every
                                check): logged once with its traceback, never sent to the client
503   over_capacity             ``max_connections`` requests already running (``GET /health`` is let
                                through), or this connection had waited longest for a complete request
                                when a new one arrived at the cap (an idle keep-alive one is closed
                                without a word); the connection is closed
====  ========================  =====================================================================

Two limits close a connection with no answer to what is left on it: a client that does not read
what it is sent is dropped ``write_timeout_s`` after its socket stops taking bytes (no answer could
reach it), and a client that queues requests ahead of its answers is closed after the answer to the
``max_pipelined``-th of them in a row (it resends the rest on a new connection). ``/metrics`` counts
both, and evictions, in ``edgetorch_split_connections_dropped_total{reason}``.

A client that hangs up mid-request is logged as one INFO line, not a traceback, and counted in
``/metrics`` under code 499 (nginx's "client closed request"; nothing is sent). Refusals that
leave part of the request body unread close the connection, so a refused client cannot keep it
busy by sending the rest slowly.

Limits that need the HTTP protocol layer (the header and write deadlines, idle connections, the
connection and pipelining caps, the header size, WebSocket off) are set by
:func:`edgetorch.split.protocol.uvicorn_config`; :func:`~edgetorch.split.protocol.serve_in_background`
and ``edgetorch split serve`` use it. Running the app with plain ``uvicorn module:app`` keeps the
app's own limits (body deadline, sizes, batch) but none of those.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from torch import nn

from .._checks import check_positive_int
from .artifact import load_code_tables, load_part
from .coded import CodeTables
from ..tail_defaults import HEADER_TIMEOUT_S, KEEP_ALIVE_S, MAX_BATCH, MAX_CONNECTIONS, READ_TIMEOUT_S, WRITE_TIMEOUT_S
from .manifest import SplitManifest, check_artifact_id
from .metrics import Metrics
from .payload import PayloadError, decode, payload_size, read_header

CONTENT_TYPE = "application/octet-stream"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
logger = logging.getLogger(__name__)
# Short names for the "type" field of error bodies, by status code (handlers may be more precise).
_ERROR_TYPES = {400: "bad_request", 401: "unauthorized", 404: "not_found",
                405: "method_not_allowed", 408: "request_timeout", 413: "payload_too_large",
                415: "unsupported_media_type", 422: "unprocessable", 500: "internal_error"}


@dataclass(frozen=True)
class ServerConfig:
    """Server limits and access.

    Attributes:
        max_payload_bytes: larger request bodies are refused with 413 before being read in full.
            Default: a batch of 64 bottlenecks (set from the manifest when ``None``).
        token: if set, ``/infer`` and ``/metrics`` need ``Authorization: Bearer <token>``
            (``/health`` and ``/`` stay open; the API docs are off).
        max_batch: payloads with more samples are refused with 413 before decoding (the tail is
            an eager module with no batch guard of its own).
        header_timeout_s: a connection must deliver a complete request line and headers within
            this many seconds of opening (or of starting its next request), else 408 and close.
        read_timeout_s: the whole body of ``POST /infer`` must arrive within this many seconds of
            its headers, else 408 and close. One deadline, not one per chunk, so a client cannot
            hold the request by sending a byte at a time.
        keep_alive_s: an idle keep-alive connection is closed after this many seconds.
        write_timeout_s: once a client's socket stops taking the answer (the kernel's buffers are
            full: the client does not read), what the server has left to send must be taken within
            this many seconds, else the connection is dropped. One deadline per stall, not pushed
            back by a trickle of reads.
        max_connections: the open connections one server keeps. A connection beyond it closes the
            oldest one that is waiting for a request (a 503 if it had begun one); requests running
            at once beyond it get 503, except ``GET /health``. The process's file-descriptor limit
            caps it too (``ulimit -n``).
        max_pipelined: requests a client may send ahead of its answers, in a row, on one
            connection; after answering that many the server closes it (the client resends the
            rest on a new connection, as HTTP/1.1 clients do), so one connection cannot queue an
            unbounded amount of work.
        max_header_bytes: a request line plus headers above this size gets 431 (400 from h11 while
            they are still incomplete, which also bounds the memory an unfinished request holds).
        expect_artifact_id: serve only the artifact with this id (``edgetorch split export``
            prints it): another one put in the directory, even one signed with the same key, is
            refused at load (:func:`app_from_dir`, and each Ray replica).

    Example:
        >>> ServerConfig(token="s3cret", read_timeout_s=5.0).max_batch
        1024
    """

    max_payload_bytes: int | None = None
    token: str | None = None
    max_batch: int = MAX_BATCH
    header_timeout_s: float = HEADER_TIMEOUT_S
    read_timeout_s: float = READ_TIMEOUT_S
    keep_alive_s: float = KEEP_ALIVE_S
    write_timeout_s: float = WRITE_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    max_pipelined: int = 16
    max_header_bytes: int = 16 * 1024
    expect_artifact_id: str | None = None

    def __post_init__(self) -> None:
        if self.expect_artifact_id is not None:
            check_artifact_id(self.expect_artifact_id)
        for name in ("max_batch", "max_connections", "max_pipelined", "max_header_bytes"):
            check_positive_int(f"ServerConfig.{name}", getattr(self, name))
        if self.max_payload_bytes is not None and (not isinstance(self.max_payload_bytes, int)
                                                   or self.max_payload_bytes < 1):
            raise ValueError(f"ServerConfig.max_payload_bytes must be None or an integer >= 1, "
                             f"got {self.max_payload_bytes!r}")
        for name in ("header_timeout_s", "read_timeout_s", "keep_alive_s", "write_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ServerConfig.{name} must be a finite number of seconds > 0, got {value!r}")
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ValueError("ServerConfig.token must be a non-empty string without whitespace "
                             "(it is sent as `Authorization: Bearer <token>`)")


class _Refused(Exception):
    """A request the server refuses: becomes a JSON error with ``status``."""

    def __init__(self, status: int, kind: str, message: str, close: bool = False,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.headers = dict(headers or {})
        if close:
            self.headers["connection"] = "close"


def error_body(status: int, kind: str | None, message: str) -> dict:
    """The JSON body of every refusal: ``{"error": {"code", "type", "message"}}``."""
    return {"error": {"code": status, "type": kind or _ERROR_TYPES.get(status, "error"), "message": message}}


def error_response(status: int, kind: str | None, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, kind, message), status_code=status, headers=headers)


class _Guard:
    """The outermost of the app's own middleware: counts every answer, turns any escaped exception into one logged
    500 without a traceback on the wire, and closes connections whose request body was left unread.

    A pure ASGI middleware (not BaseHTTPMiddleware) so it sees the real ``send`` and ``receive``.
    """

    def __init__(self, app: Any, metrics: Metrics, paths: frozenset[str], max_header_bytes: int):
        self.app, self.metrics, self.paths, self.max_header_bytes = app, metrics, paths, max_header_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw_headers = scope.get("headers") or []
        # h11's limit only bounds headers still incomplete in its buffer; a larger block that
        # arrives in one read is parsed whole, so the app measures what it was given.
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
            len(name) + len(value) + 4 for name, value in raw_headers)
        if size > self.max_header_bytes:
            response = error_response(431, "request_header_fields_too_large",
                              f"request line and headers of {size} bytes exceed the limit of "
                              f"{self.max_header_bytes} bytes", {"connection": "close"})
            await response(scope, receive, send)
            self.metrics.record_request("(headers)", 431)
            return
        headers = dict(raw_headers)
        if b"websocket" in headers.get(b"upgrade", b"").lower():
            # uvicorn_config turns WebSocket off (the connection would leave the deadlines of our
            # HTTP protocol), so the handshake arrives as plain HTTP: refuse it in the usual shape.
            response = error_response(400, "websocket_not_supported", "this server has no WebSocket endpoints; it "
                              "answers HTTP: GET /, GET /health, GET /metrics and POST /infer")
            await response(scope, receive, send)
            self.metrics.record_request("(websocket)", 400)
            return
        body_left = b"transfer-encoding" in headers or headers.get(b"content-length", b"0").strip() not in (b"0", b"")
        state = {"status": None, "body_left": body_left}

        async def tracking_receive() -> dict:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                state["body_left"] = False
            return message

        async def tracking_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                if state["body_left"] and not any(k.lower() == b"connection" for k, _ in message.get("headers", [])):
                    # Part of the body is still on its way: reading it only to discard it would let
                    # a refused client hold the connection, so close it after this answer.
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, tracking_receive, tracking_send)
        except Exception:
            logger.exception("internal error while answering %s %s", scope.get("method"), scope.get("path"))
            if state["status"] is None:
                response = error_response(500, None, "internal server error; it is logged on the server",
                                  {"connection": "close"})
                await response(scope, tracking_receive, tracking_send)
        finally:
            if state["status"] is not None:
                path = scope.get("path", "")
                self.metrics.record_request(path if path in self.paths else "other", state["status"])


def _parse_bearer(value: str) -> str | None:
    """The credentials of an ``Authorization: Bearer <token>`` header; the scheme is
    case-insensitive (RFC 7235 section 2.1), the token is not."""
    scheme, _, credentials = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credentials.strip()


def create_app(tail: nn.Module, manifest: SplitManifest, config: ServerConfig = ServerConfig(),
               tables: CodeTables | None = None) -> FastAPI:
    """Build the ASGI app serving ``tail``.

    Args:
        tail: the server-side module (bottleneck -> logits), in eval mode.
        manifest: the artifact's manifest, or any object with ``arch, channels, split_point,
            bottleneck_shape, num_classes, payload_format``.
        config: limits and token; kept as ``app.state.server_config`` for
            :func:`edgetorch.split.protocol.uvicorn_config`.
        tables: the artifact's code tables (:func:`~edgetorch.split.artifact.load_code_tables`),
            required where ``manifest.coded``: entropy-coded payloads decode with them (8-bit
            payloads are accepted too, as a client sends where they are smaller).

    Returns:
        A FastAPI app; run it with ``uvicorn.Server(uvicorn_config(app)).run()`` or test it with
        ``TestClient(app)``.

    Example:
        >>> tail, manifest = load_part("artifacts", "tail")  # doctest: +SKIP
        >>> uvicorn.Server(uvicorn_config(create_app(tail, manifest), port=8000)).run()  # doctest: +SKIP
    """
    bottleneck_shape = tuple(int(d) for d in manifest.bottleneck_shape)
    if getattr(manifest, "coded", False) and tables is None:
        raise ValueError("this artifact's payloads are entropy-coded: pass its code tables "
                         "(load_code_tables(artifact_dir, manifest), or app_from_dir)")
    # a coded payload is never larger than the 8-bit one (encode sends the smaller)
    limit = config.max_payload_bytes or payload_size((64, *bottleneck_shape))
    most_values = config.max_batch * math.prod(bottleneck_shape)  # what a coded payload may claim
    docs = config.token is None  # a protected server does not describe itself to strangers
    # redirect_slashes off: its 307 for "/health/" copied the client's Host header into Location;
    # a trailing slash is a JSON 404 like any other unknown path.
    app = FastAPI(title="edgetorch split tail server", redirect_slashes=False, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    metrics = Metrics()
    app.state.server_config, app.state.metrics = config, metrics
    paths = {"/", "/health", "/infer", "/metrics"}
    if docs:
        paths |= {"/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"}
    app.add_middleware(_Guard, metrics=metrics, paths=frozenset(paths), max_header_bytes=config.max_header_bytes)

    @app.exception_handler(_Refused)
    async def refused(request: Request, exc: _Refused) -> JSONResponse:
        return error_response(exc.status, exc.kind, exc.message, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such path {request.url.path!r}; this server has GET /, GET /health, "
                        "GET /metrics and POST /infer",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, None, message, dict(exc.headers or {}))

    @app.exception_handler(ClientDisconnect)
    async def disconnected(request: Request, exc: ClientDisconnect) -> Response:
        # Clients hang up all the time (timeouts, cancelled requests): one quiet line, no traceback.
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        logger.info("%s disconnected before its %s %s request was complete", client, request.method, request.url.path)
        # Nobody reads this answer (the server drops writes to a closed connection); 499 is the
        # code nginx logs for "client closed request", so /metrics counts these apart from errors.
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_request", "; ".join(str(e.get("msg", e)) for e in exc.errors()) or "invalid request")

    def authorise(request: Request) -> None:
        if config.token is None:
            return
        given = _parse_bearer(request.headers.get("authorization", "")) or ""
        # compare_digest: time independent of where the strings differ (it still reveals the length).
        if not hmac.compare_digest(given.encode(), config.token.encode()):
            raise _Refused(401, None, "missing or wrong bearer token (send `Authorization: Bearer <token>`)",
                           headers={"www-authenticate": 'Bearer realm="edgetorch"'})

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/")
    async def info() -> dict:
        return {"status": "ok", "arch": manifest.arch, "channels": manifest.channels,
                "split_point": manifest.split_point, "bottleneck_shape": list(bottleneck_shape),
                "num_classes": manifest.num_classes, "payload_format": manifest.payload_format,
                "max_payload_bytes": limit, "max_batch": config.max_batch, "auth": config.token is not None}

    @app.get("/metrics")
    async def metrics_text(request: Request) -> Response:
        authorise(request)
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.post("/infer")
    async def infer(request: Request) -> JSONResponse:
        authorise(request)
        content_type = request.headers.get("content-type", "").split(";")[0].strip()
        if content_type.lower() != CONTENT_TYPE:  # media types are case-insensitive (RFC 9110 8.3.1)
            raise _Refused(415, None, f"content type must be {CONTENT_TYPE}, got {content_type or 'none'!r}")
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isascii() or not declared.strip().isdigit():  # "²".isdigit() is True
                raise _Refused(400, None, f"Content-Length must be a non-negative integer, got {declared!r}")
            if int(declared) > limit:
                raise _Refused(413, None, f"payload of {declared} bytes exceeds the limit of {limit} bytes")
        body = await _read_body(request, limit, config.read_timeout_s)
        start = time.perf_counter()
        try:
            header = read_header(body, tables)
            if tuple(header.shape[1:]) != bottleneck_shape:
                raise _Refused(422, "shape_mismatch",
                               f"payload shape {list(header.shape)} does not match this model's bottleneck "
                               f"[N, {', '.join(map(str, bottleneck_shape))}]")
            if header.shape[0] > config.max_batch:
                raise _Refused(413, "batch_too_large",
                               f"batch of {header.shape[0]} exceeds this server's limit of {config.max_batch} samples")
            bottleneck = decode(body, max_bytes=limit, tables=tables, max_numel=most_values)
        except PayloadError as exc:
            raise _Refused(400, "malformed_payload", f"malformed payload: {exc}") from None
        decoded = time.perf_counter()
        try:
            logits = await run_in_threadpool(_run_tail, tail, bottleneck.float())
        except Exception:
            # The payload passed every check, so this is the server's fault: log it once with its
            # traceback, and tell the client only that it happened.
            logger.exception("the tail raised on a valid payload of shape %s", list(bottleneck.shape))
            raise _Refused(500, "internal_error", "the model failed on this payload; the error is logged "
                                                  "on the server") from None
        done = time.perf_counter()
        if not bool(torch.isfinite(logits).all()):
            raise _Refused(422, "non_finite_output",
                           f"the model's logits are not finite (inf or NaN) for this payload: its values reach "
                           f"{float(bottleneck.abs().max()):.3g}, far outside what the model was trained on; "
                           "accepted: payloads whose logits are finite")
        metrics.observe_inference(done - start)
        # Rendered in a worker thread: a 1,024-sample answer is megabytes of JSON, and rendering it
        # on the event loop (0.2 s for 6.6 MB) held up every other connection's deadlines and /health.
        body = await run_in_threadpool(_render_answer, logits, decoded - start, done - decoded)
        return Response(body, media_type="application/json")

    return app


def _render_answer(logits: torch.Tensor, decode_s: float, tail_s: float) -> bytes:
    """The /infer answer as JSON bytes, as JSONResponse renders it (the logits are finite)."""
    return json.dumps({"logits": logits.tolist(), "timing": {"decode_s": decode_s, "tail_s": tail_s}},
                      ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """Read the request body within one deadline and one size limit.

    Raises:
        _Refused: 413 over ``limit`` (even when Content-Length lies or is absent), 408 when the
            body has not arrived within ``timeout_s``; both close the connection.
        ClientDisconnect: the client hung up (answered by the caller's handler).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    body = bytearray()
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), max(deadline - loop.time(), 0.0))
        except asyncio.TimeoutError:
            raise _Refused(408, None, f"the request body did not arrive within {timeout_s:g} s "
                                      f"({len(body)} bytes received)", close=True) from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        body += message.get("body", b"")
        if len(body) > limit:
            raise _Refused(413, None, f"payload exceeds the limit of {limit} bytes", close=True)
        if not message.get("more_body", False):
            return bytes(body)


def _run_tail(tail: nn.Module, bottleneck: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return tail(bottleneck)


def app_from_dir(artifact_dir: str | Path, config: ServerConfig = ServerConfig(),
                 key: bytes | str | None = None) -> FastAPI:
    """Load a verified tail from an artifact directory and build the app (see :func:`create_app`).

    Args:
        artifact_dir: a directory written by :func:`~edgetorch.split.save`.
        config: limits and token.
        key: the HMAC key, if the artifact was signed.
    """
    tail, manifest = load_part(artifact_dir, "tail", key, expect_id=config.expect_artifact_id)
    return create_app(tail, manifest, config, load_code_tables(artifact_dir, manifest))
