"""The split tail server under malformed, hostile and slow clients: status codes, JSON errors, auth,
metrics, timeouts on a real uvicorn on loopback, and a bounded HTTP fuzz that must never see a 5xx."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import select
import socket
import struct
import threading
import time
import types

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from edgetorch.split.fuzz import reseal
from edgetorch.split.loadgen import Target, read_metrics
from edgetorch.split.payload import encode, payload_size
from edgetorch.split.probe import StallConfig, run_stall
from edgetorch.split.protocol import serve_in_background, uvicorn_config
from edgetorch.split.server import ServerConfig, create_app
from edgetorch.split.wire import (get_once, half_request_line, parse_answers, small_window_socket, stalled_requests,
                                  status_of)

MANIFEST = types.SimpleNamespace(arch="tiny", channels=2, split_point="sp2", bottleneck_shape=(2, 4, 4),
                                 num_classes=3, payload_format="etbq-v1")
OCTET = {"content-type": "application/octet-stream"}
LOG = "edgetorch.split.server"


class Tail(nn.Module):
    """Flatten + Linear(32, 3) with all-ones weights (so huge inputs overflow), counting its calls."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 3)
        nn.init.ones_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x.flatten(1))


class Broken(nn.Module):
    def forward(self, x):
        raise RuntimeError("secret internal detail")


def client(tail=None, **config) -> TestClient:
    return TestClient(create_app(tail or Tail(), MANIFEST, ServerConfig(**config)))


def body(batch: int = 1, scale: float = 1.0, shape=(2, 4, 4)) -> bytes:
    return encode(torch.randn(batch, *shape) * scale)


def assert_error(response: httpx.Response, status: int, kind: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    assert re.fullmatch(r"[a-z_]+", error["type"])
    if kind is not None:
        assert error["type"] == kind
    assert "Traceback" not in response.text
    return error


def test_a_valid_payload_gets_logits_and_timings():
    tail = Tail()
    answer = client(tail).post("/infer", content=body(3), headers=OCTET)
    assert answer.status_code == 200
    assert len(answer.json()["logits"]) == 3 and len(answer.json()["logits"][0]) == 3
    assert set(answer.json()["timing"]) == {"decode_s", "tail_s"} and tail.calls == 1


@pytest.mark.parametrize("content_type", ["APPLICATION/OCTET-STREAM", "Application/Octet-Stream; charset=binary",
                                          " application/octet-stream "])
def test_media_type_is_case_insensitive(content_type):
    assert client().post("/infer", content=body(), headers={"content-type": content_type}).status_code == 200


@pytest.mark.parametrize("authorization, status", [
    ("Bearer s3cret", 200), ("bearer s3cret", 200), ("BEARER  s3cret ", 200),
    (None, 401), ("Bearer wrong", 401), ("Bearer S3CRET", 401), ("Basic s3cret", 401), ("s3cret", 401),
    ("Bearer", 401), ("Bearer s3cret extra", 401), ("", 401),
])
def test_bearer_scheme_is_case_insensitive_and_the_token_is_not(authorization, status):
    headers = {**OCTET, **({"authorization": authorization} if authorization is not None else {})}
    answer = client(token="s3cret").post("/infer", content=body(), headers=headers)
    if status == 401:
        assert_error(answer, 401, "unauthorized")
        assert answer.headers["www-authenticate"].startswith("Bearer")
    else:
        assert answer.status_code == 200


def _resealed(blob: bytes, offset: int, value: bytes) -> bytes:
    return reseal(blob[:offset] + value + blob[offset + len(value):])


@pytest.mark.parametrize("method, path, headers, content, status, kind", [
    ("GET", "/nowhere", {}, None, 404, "not_found"),
    ("GET", "/infer", {}, None, 405, "method_not_allowed"),
    ("DELETE", "/health", {}, None, 405, "method_not_allowed"),
    ("POST", "/infer", {"content-type": "text/plain"}, body(), 415, "unsupported_media_type"),
    ("POST", "/infer", {}, body(), 415, "unsupported_media_type"),
    ("POST", "/infer", {**OCTET, "content-length": "99999999999999999999"}, body(), 413, "payload_too_large"),
    ("POST", "/infer", {**OCTET, "content-length": "abc"}, body(), 400, "bad_request"),
    ("POST", "/infer", {**OCTET, "content-length": "\u00b2".encode("latin-1")}, body(), 400, "bad_request"),  # "²".isdigit()
    ("POST", "/infer", OCTET, b"not a payload", 400, "malformed_payload"),
    ("POST", "/infer", OCTET, body()[:-1], 400, "malformed_payload"),
    ("POST", "/infer", OCTET, b"", 400, "malformed_payload"),
    ("POST", "/infer", OCTET, body(shape=(3, 4, 4)), 422, "shape_mismatch"),
    ("POST", "/infer", OCTET, encode(torch.randn(32)), 422, "shape_mismatch"),
    # A CRC-valid payload whose scale would dequantise to inf: the codec refuses it, not the tail.
    ("POST", "/infer", OCTET, _resealed(body(), 29, struct.pack("<f", 3e38)), 400, "malformed_payload"),
    ("POST", "/infer", OCTET, _resealed(_resealed(body(), 7, b"\x02"), 29, struct.pack("<f", 1e5)), 400,
     "malformed_payload"),
], ids=lambda v: f"{len(v)}B" if isinstance(v, bytes) else None)
def test_every_malformed_request_gets_a_structured_4xx(method, path, headers, content, status, kind):
    tail = Tail()
    assert_error(client(tail).request(method, path, headers=headers, content=content), status, kind)
    assert tail.calls == 0


def test_a_body_over_the_limit_is_refused_while_streaming_and_closes_the_connection():
    chunks = iter([body(1)] * 100)  # chunked: no Content-Length to refuse up front
    answer = client(max_payload_bytes=1000).post("/infer", content=chunks, headers=OCTET)
    assert_error(answer, 413, "payload_too_large")
    assert answer.headers["connection"] == "close"


def test_batch_over_the_limit_is_refused_before_decoding_or_running_the_model():
    tail = Tail()
    app = client(tail, max_batch=4, max_payload_bytes=payload_size((64, 2, 4, 4)))
    assert app.post("/infer", content=body(4), headers=OCTET).status_code == 200
    error = assert_error(app.post("/infer", content=body(5), headers=OCTET), 413, "batch_too_large")
    assert "batch of 5" in error["message"] and "limit of 4" in error["message"]
    assert tail.calls == 1
    # The default (1024) holds even when the byte limit is raised far above it.
    big = client(tail, max_payload_bytes=payload_size((1100, 2, 4, 4)))
    assert_error(big.post("/infer", content=body(1025), headers=OCTET), 413, "batch_too_large")
    assert tail.calls == 1


def test_non_finite_logits_are_a_clear_422():
    # Every value near float32's max: the all-ones Linear sums 32 of them to inf.
    answer = client().post("/infer", content=encode(torch.full((1, 2, 4, 4), 3e38)), headers=OCTET)
    error = assert_error(answer, 422, "non_finite_output")
    assert "not finite" in error["message"] and "accepted" in error["message"]


def test_a_failing_tail_is_a_500_logged_once_without_leaking_the_error(caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    answer = client(Broken()).post("/infer", content=body(), headers=OCTET)
    assert_error(answer, 500, "internal_error")
    assert "secret internal detail" not in answer.text
    records = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(records) == 1 and records[0].exc_info is not None
    assert "secret internal detail" in str(records[0].exc_info[1])


def test_docs_are_off_with_a_token_and_health_stays_open():
    protected, open_ = client(token="t"), client()
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_error(protected.get(path), 404, "not_found")
        assert open_.get(path).status_code == 200
    assert protected.get("/health").json() == {"status": "ok"}
    info = protected.get("/").json()
    assert info["bottleneck_shape"] == [2, 4, 4] and info["auth"] is True and info["max_batch"] == 1024


def test_metrics_count_requests_errors_and_inference_latency_and_need_the_token():
    app = client(token="t")
    auth = {**OCTET, "authorization": "Bearer t"}
    for _ in range(3):
        assert app.post("/infer", content=body(), headers=auth).status_code == 200
    app.post("/infer", content=b"junk", headers=auth)
    app.post("/infer", content=body(), headers=OCTET)
    app.get("/nowhere/123")
    app.get("/health")
    assert_error(app.get("/metrics"), 401)
    answer = app.get("/metrics", headers=auth)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    values = read_metrics(answer.text)
    assert values['edgetorch_split_requests_total{path="/infer",code="200"}'] == 3
    assert values['edgetorch_split_requests_total{path="/infer",code="400"}'] == 1
    assert values['edgetorch_split_requests_total{path="/infer",code="401"}'] == 1
    assert values['edgetorch_split_requests_total{path="other",code="404"}'] == 1  # unknown paths share a label
    assert values['edgetorch_split_requests_total{path="/health",code="200"}'] == 1
    assert values['edgetorch_split_requests_total{path="/metrics",code="401"}'] == 1
    assert values['edgetorch_split_errors_total{code="401"}'] == 2
    assert values["edgetorch_split_inference_seconds_count"] == 3
    assert values['edgetorch_split_inference_seconds_bucket{le="+Inf"}'] == 3
    buckets = [v for k, v in values.items() if k.startswith("edgetorch_split_inference_seconds_bucket")]
    assert buckets == sorted(buckets) and 0 < values["edgetorch_split_inference_seconds_sum"] < 60
    assert "# TYPE edgetorch_split_inference_seconds histogram" in answer.text
    assert client().get("/metrics").status_code == 200  # no token: open like everything else


def test_a_client_that_hangs_up_mid_body_is_one_quiet_log_line(caplog):
    caplog.set_level(logging.DEBUG, logger=LOG)
    app = create_app(Tail(), MANIFEST)
    messages = iter([{"type": "http.request", "body": b"ETBQ", "more_body": True}, {"type": "http.disconnect"}])
    sent = []

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/infer", "raw_path": b"/infer", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/octet-stream"), (b"content-length", b"100")],
             "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    records = [r for r in caplog.records if r.name == LOG]
    assert len(records) == 1 and records[0].levelno == logging.INFO and records[0].exc_info is None
    assert "disconnected" in records[0].getMessage() and "127.0.0.1:5555" in records[0].getMessage()


@pytest.mark.parametrize("field, value", [
    ("max_batch", 0), ("max_batch", 1.5), ("max_connections", -1), ("read_timeout_s", 0),
    ("header_timeout_s", float("inf")), ("keep_alive_s", -1.0), ("write_timeout_s", 0), ("max_pipelined", 0),
    ("max_payload_bytes", 0), ("token", ""), ("token", "a b"),
])
def test_server_config_refuses_impossible_limits(field, value):
    with pytest.raises(ValueError, match=f"ServerConfig.{field}"):
        ServerConfig(**{field: value})


def test_uvicorn_config_carries_the_protocol_limits():
    app = create_app(Tail(), MANIFEST, ServerConfig(keep_alive_s=3, max_header_bytes=4096))
    settings = uvicorn_config(app, port=0)
    assert (settings.timeout_keep_alive, settings.h11_max_incomplete_event_size) == (3, 4096)
    # uvicorn's own connection cap answers text/plain 503s, /health included; ours replaces it.
    assert settings.limit_concurrency is None and settings.ws == "none"
    assert settings.host == "127.0.0.1" and settings.server_header is False


def test_uvicorn_config_refuses_fresh_contexts_per_request():
    # A request run in a fresh context cannot find its connection, whose header deadline it ends.
    with pytest.raises(ValueError, match="reset_contextvars"):
        uvicorn_config(create_app(Tail(), MANIFEST), port=0, reset_contextvars=True)


# --- A real uvicorn on loopback: timeouts, stalled connections, errors on the wire. ---------------

TIMEOUT = 0.5
FAST = ServerConfig(header_timeout_s=TIMEOUT, read_timeout_s=TIMEOUT, keep_alive_s=TIMEOUT, max_connections=200)
# Timeouts here only guard hangs: a test fails by the clock only if the machine stalls this long.
# A deadline the server must keep is checked from below (it did not close early, measured from
# before the connection opened, so a slow client cannot shorten it) and by what it sent, not by how
# soon it closed: a busy machine may close a 0.5 s deadline seconds late.
HANG_GUARD_S = 30.0
# Deadlines no test reaches: what closes a connection here is the server's own decision.
PATIENT = ServerConfig(header_timeout_s=2 * HANG_GUARD_S, read_timeout_s=2 * HANG_GUARD_S,
                       keep_alive_s=2 * HANG_GUARD_S)


@pytest.fixture(scope="module")
def server():
    with serve_in_background(create_app(Tail(), MANIFEST, FAST)) as url:
        yield url, int(url.rsplit(":", 1)[1])


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S)
    return sock


def _read_until_closed(sock: socket.socket, limit_s: float = HANG_GUARD_S) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def _json_body(raw: bytes) -> dict:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


@pytest.mark.parametrize("sent", [
    b"",  # opens and says nothing
    b"POST /infer HTTP/1.1\r\nHost: x\r\n",  # half the headers
    b"GET /health HTT",  # half the request line
])
def test_a_stalled_request_is_answered_408_and_closed_within_the_header_timeout(server, sent):
    opened = time.monotonic()
    with _connect(server[1]) as sock:
        sock.sendall(sent)
        raw, _ = _read_until_closed(sock)  # the header timeout closes it; the hang guard catches a server that never does
    assert time.monotonic() - opened >= TIMEOUT * 0.8  # not before the deadline
    assert status_of(raw) == 408 and _json_body(raw)["error"]["type"] == "request_timeout"


# One byte every 50 ms, for up to HANG_GUARD_S: a server whose deadline restarted with each byte
# would let the whole request line and headers arrive (and only time out after the last byte).
DRIPPED = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * int(HANG_GUARD_S / 0.05)


def _drip(sock: socket.socket) -> int:
    """Send DRIPPED a byte at a time until the server says something; how many bytes went."""
    for sent, byte in enumerate(DRIPPED):
        # Stop once the server has answered: writing into a closed connection draws a reset
        # that could discard its answer before we read it.
        if select.select([sock], [], [], 0)[0]:
            return sent
        sock.sendall(bytes([byte]))
        time.sleep(0.05)
    return len(DRIPPED)


def test_dripping_headers_do_not_push_the_deadline_back(server):
    with _connect(server[1]) as sock:
        sent = _drip(sock)
        raw, _ = _read_until_closed(sock)
    assert status_of(raw) == 408 and sent < len(DRIPPED), f"the server answered after {sent} of {len(DRIPPED)} bytes"


def test_a_keep_alive_connections_next_request_gets_the_header_deadline_too():
    # The deadline moves from uvicorn's keep-alive timer back to the header deadline when the next
    # request's first byte arrives; a keep-alive past the hang guard means only the latter can close it.
    config = ServerConfig(header_timeout_s=TIMEOUT, keep_alive_s=2 * HANG_GUARD_S)
    with serve_in_background(create_app(Tail(), MANIFEST, config)) as url, _connect(int(url.rsplit(":", 1)[1])) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = _read_answer(sock)
        sent = _drip(sock)
        raw, _ = _read_until_closed(sock)
    assert status_of(first) == 200 and status_of(raw) == 408 and _json_body(raw)["error"]["type"] == "request_timeout"
    assert sent < len(DRIPPED), f"the server answered after {sent} of {len(DRIPPED)} bytes"


def test_a_stalled_body_is_answered_408_and_closed_within_the_read_timeout(server):
    opened = time.monotonic()
    with _connect(server[1]) as sock:
        sock.sendall(b"POST /infer HTTP/1.1\r\nHost: x\r\ncontent-type: application/octet-stream\r\n"
                     b"content-length: 100\r\n\r\nETBQ")
        raw, _ = _read_until_closed(sock)
    assert time.monotonic() - opened >= TIMEOUT * 0.8
    assert status_of(raw) == 408 and "did not arrive within" in _json_body(raw)["error"]["message"]


def _stall(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that stop halfway as the probe's do: in the headers, or in the body of a POST /infer."""
    stalled = []
    for i in range(count):
        sock = _connect(port)
        sock.sendall(stalled_requests(Target("127.0.0.1", port), body())[i % 2])
        stalled.append(sock)
    return stalled


def test_health_answers_while_stalled_connections_are_held():
    # Deadlines past the hang guard: the stalled connections are certainly still held when /health answers.
    with serve_in_background(create_app(Tail(), MANIFEST, PATIENT)) as url:
        stalled = _stall(int(url.rsplit(":", 1)[1]), 60)
        try:
            assert httpx.get(url + "/health", timeout=HANG_GUARD_S).status_code == 200
            assert not select.select(stalled, [], [], 0)[0]  # answered while every stalled one was still held
        finally:
            for sock in stalled:
                sock.close()


def test_many_stalled_connections_are_all_answered_408_and_closed(server):
    opened = time.monotonic()
    stalled = run_stall(Target("127.0.0.1", server[1]), body(), StallConfig(60, header_timeout_s=TIMEOUT, read_timeout_s=TIMEOUT))
    assert stalled.closed == stalled.answered_408 == 60 and stalled.connect_errors == 0
    assert {kind: (k["connections"], k["answered_408"]) for kind, k in stalled.by_kind.items()} == {
        "partial headers": (30, 30), "partial body": (30, 30)}
    assert time.monotonic() - opened >= TIMEOUT * 0.8


def test_an_idle_keep_alive_connection_is_closed(server):
    opened = time.monotonic()
    with _connect(server[1]) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw, _ = _read_until_closed(sock)
    assert status_of(raw) == 200 and len(parse_answers(raw)) == 1
    assert time.monotonic() - opened >= TIMEOUT * 0.8  # kept open for the keep-alive, then closed


@pytest.mark.parametrize("request_bytes", [
    b"NOT HTTP AT ALL\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Without Colon\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000,  # still incomplete past max_header_bytes
    b"POST /infer HTTP/1.1\r\nHost: x\r\ncontent-length: -5\r\n\r\n",
])
def test_malformed_http_gets_a_json_400(server, request_bytes):
    with _connect(server[1]) as sock:
        sock.sendall(request_bytes)
        raw, _ = _read_until_closed(sock)
    assert status_of(raw) == 400 and _json_body(raw)["error"]["code"] == 400


def test_headers_over_the_limit_that_arrive_complete_get_a_json_431(server):
    with _connect(server[1]) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        raw, _ = _read_until_closed(sock)
    assert status_of(raw) == 431 and _json_body(raw)["error"]["type"] == "request_header_fields_too_large"


def test_a_refusal_with_the_body_still_coming_closes_the_connection():
    # On a server whose deadlines are past the hang guard, a connection that closes at all was
    # closed by the refusal: not after the rest of the body, nor by a timeout.
    with serve_in_background(create_app(Tail(), MANIFEST, PATIENT)) as url, _connect(int(url.rsplit(":", 1)[1])) as sock:
        sock.sendall(b"POST /infer HTTP/1.1\r\nHost: x\r\ncontent-type: application/octet-stream\r\n"
                     b"content-length: 99999999\r\n\r\nETBQ")
        raw, _ = _read_until_closed(sock)
    assert status_of(raw) == 413


def test_a_client_hanging_up_over_tcp_logs_one_line(server, caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    with _connect(server[1]) as sock:
        sock.sendall(b"POST /infer HTTP/1.1\r\nHost: x\r\ncontent-type: application/octet-stream\r\n"
                     b"content-length: 100\r\n\r\nETBQ")
        time.sleep(0.1)
    _wait_for(lambda: [r for r in caplog.records if r.name == LOG], "the hang-up's log line")
    records = [r for r in caplog.records if r.name == LOG]
    assert len(records) == 1 and records[0].levelno == logging.INFO and records[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("request_bytes, status, kind", [
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "bad_request"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000, 400, "bad_request"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431, "request_header_fields_too_large"),
    (b"GET /health HTTP/1.1\r\nHost: x", 408, "request_timeout"),
    (b"POST /infer HTTP/1.1\r\nHost: x\r\ncontent-type: application/octet-stream\r\ncontent-length: 99999999\r\n\r\n",
     413, "payload_too_large"),
    (b"GET /health/ HTTP/1.1\r\nHost: evil.example\r\n\r\n", 404, "not_found"),  # no redirect to Host
    (b"PUT /health HTTP/1.1\r\nHost: x\r\ncontent-length: 0\r\n\r\n", 405, "method_not_allowed"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n", 400, "websocket_not_supported"),
], ids=["garbage", "headers-incomplete", "headers-complete", "timeout", "too-large", "trailing-slash", "method",
        "websocket"])
def test_every_error_on_the_wire_is_json(server, request_bytes, status, kind):
    with _connect(server[1]) as sock:
        sock.sendall(request_bytes)
        raw, _ = _read_until_closed(sock, HANG_GUARD_S)  # the keep-alive, header or refusal close ends each
    (got, head, answer), = parse_answers(raw)
    assert got == status and b"content-type: application/json" in head.lower()
    assert b"\r\nlocation:" not in head.lower()
    error = json.loads(answer)["error"]
    assert error["code"] == status and error["type"] == kind and error["message"]


# --- Pressure: clients that do not read, connection floods, pipelining floods. -------------------
# Each waits for an event (a counter, an answer, a closed socket); timeouts here only guard hangs.


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: {what} did not happen within {HANG_GUARD_S:g} s")
        time.sleep(0.01)


def _read_answer(sock: socket.socket) -> bytes:
    """One complete answer from a connection that stays open."""
    raw = b""
    while not parse_answers(raw):
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {raw!r}"
        raw += chunk
    return raw


def _get(port: int, path: str = "/health") -> tuple[int, dict]:
    reply = asyncio.run(get_once(Target("127.0.0.1", port), HANG_GUARD_S, path))
    (status, _, answer), = parse_answers(reply.raw)
    return status, json.loads(answer)


class WideTail(nn.Module):
    """4,096 logits a sample: a batch of 64 is a ~5 MB JSON answer, more than loopback's socket
    buffers take (about 1.6 MB with the smallest receive buffer)."""

    def forward(self, x):
        return x.flatten(1)[:, :1].expand(-1, 4096) * torch.linspace(-1, 1, 4096)


def test_a_client_that_does_not_read_is_dropped_at_the_write_deadline():
    app = create_app(WideTail(), MANIFEST, ServerConfig(write_timeout_s=0.2))
    with serve_in_background(app) as url:
        port = int(url.rsplit(":", 1)[1])
        sock = small_window_socket()
        sock.connect(("127.0.0.1", port))
        with sock:
            payload = body(64)
            sock.sendall(b"POST /infer HTTP/1.1\r\nHost: x\r\ncontent-type: application/octet-stream\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
            dropped = app.state.metrics.dropped
            _wait_for(lambda: dropped.get("write_timeout") == 1, "the write deadline")
            try:
                raw, _ = _read_until_closed(sock, HANG_GUARD_S)
            except ConnectionResetError:
                raw = b""
        assert not parse_answers(raw)  # the server gave up on the answer: it never arrived whole
        assert _get(port) == (200, {"status": "ok"})


def test_health_answers_with_the_connection_cap_full_of_idle_connections():
    cap = 8
    config = ServerConfig(max_connections=cap, header_timeout_s=HANG_GUARD_S, keep_alive_s=HANG_GUARD_S)
    app = create_app(Tail(), MANIFEST, config)
    with serve_in_background(app) as url:
        port = int(url.rsplit(":", 1)[1])
        keep_alive = _connect(port)  # the oldest: one answered request, then idle
        keep_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        _read_answer(keep_alive)
        idle = [_connect(port) for _ in range(cap + 3)]
        for i, sock in enumerate(idle):
            sock.sendall(half_request_line(Target("127.0.0.1", port)) if i % 2 else b"")  # half a request, or nothing
        # 1 + 11 + this one = 13 over a cap of 8: each newcomer closed the one that had waited longest.
        assert _get(port) == (200, {"status": "ok"})
        evicted, kept = idle[:4], idle[4:]
        assert not select.select(kept, [], [], 0)[0]  # still open, nothing said
        assert _read_until_closed(keep_alive, HANG_GUARD_S)[0] == b""  # an idle keep-alive connection is just closed
        for i, sock in enumerate(evicted):  # one that had begun (or not yet begun) a request is told why
            try:
                (status, _, answer), = parse_answers(_read_until_closed(sock, HANG_GUARD_S)[0])
            except ConnectionResetError:
                # Half a request sent after the server had closed the socket: TCP answers those bytes
                # with a reset, which can discard the 503 before the client reads it. Only the ones
                # that sent nothing are sure to read it.
                assert i % 2, "a connection that sent nothing was reset instead of told why"
                continue
            assert status == 503 and json.loads(answer)["error"]["type"] == "over_capacity"
        assert app.state.metrics.dropped == {"evicted": 5}
        for sock in [keep_alive, *idle]:
            sock.close()


class _Wire(asyncio.Transport):
    """A transport that keeps what the server writes, so a test can drive connections by hand
    within one turn of the event loop (a socket cannot make two events land in the same turn)."""

    def __init__(self, protocol: asyncio.Protocol):
        super().__init__()
        self.protocol, self.written, self.closing = protocol, b"", False
        protocol.connection_made(self)

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def get_extra_info(self, name: str, default=None):
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_a_request_completed_as_its_connection_is_evicted_gets_only_the_503():
    # The app learns of a request one loop turn after its last header byte; a connection evicted
    # (or timed out) in between has its answer already and must not get a second one.
    from uvicorn.server import ServerState

    app = create_app(Tail(), MANIFEST, ServerConfig(max_connections=1))
    settings = uvicorn_config(app, port=0, log_level="warning", access_log=False)
    settings.load()

    async def one_turn() -> bytes:
        state = ServerState()
        connection = functools.partial(settings.http_protocol_class, config=settings, server_state=state, app_state={})
        first = _Wire(connection())
        first.protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # complete: its task is queued
        second = _Wire(connection())  # over the cap of 1: evicts the first, which waits for its app call
        while state.tasks:  # the request's task, then the loop turns until it has ended
            await asyncio.sleep(0.01)
        second.close()
        return first.written

    (status, _, answer), = parse_answers(asyncio.run(asyncio.wait_for(one_turn(), HANG_GUARD_S)))
    assert status == 503 and json.loads(answer)["error"]["type"] == "over_capacity"
    assert app.state.metrics.dropped == {"evicted": 1}


class BlockingTail(Tail):
    """Holds every call until released, so requests stay running for as long as a test needs."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Semaphore(0), threading.Event()

    def forward(self, x):
        self.entered.release()
        assert self.release.wait(HANG_GUARD_S), "hang guard: the test never released the tail"
        return super().forward(x)


def test_requests_beyond_the_running_cap_get_a_json_503_and_health_still_answers():
    tail = BlockingTail()
    with serve_in_background(create_app(tail, MANIFEST, ServerConfig(max_connections=2))) as url:
        port = int(url.rsplit(":", 1)[1])
        running = [_connect(port) for _ in range(2)]
        try:
            for sock in running:
                payload = body()
                sock.sendall(b"POST /infer HTTP/1.1\r\nHost: x\r\ncontent-type: application/octet-stream\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
            for _ in running:
                assert tail.entered.acquire(timeout=HANG_GUARD_S), "hang guard: the tail was not called"
            status, answer = _get(port, "/")
            assert status == 503 and answer["error"]["type"] == "over_capacity"
            assert _get(port) == (200, {"status": "ok"})
        finally:
            tail.release.set()
        for sock in running:
            (status, _, _), = parse_answers(_read_until_closed(sock, HANG_GUARD_S)[0])
            assert status == 200
            sock.close()


def test_a_pipelining_flood_is_cut_at_the_cap_and_health_still_answers():
    app = create_app(Tail(), MANIFEST, ServerConfig(max_pipelined=4, keep_alive_s=HANG_GUARD_S))
    with serve_in_background(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with _connect(port) as flood:
            flood.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 200)  # one write: all queued at once
            raw, _ = _read_until_closed(flood, HANG_GUARD_S)
        answers = parse_answers(raw)
        assert len(answers) == 1 + 4 and {status for status, _, _ in answers} == {200}
        assert app.state.metrics.dropped == {"pipelined": 1}
        assert _get(port) == (200, {"status": "ok"})
        with _connect(port) as polite:  # one request at a time, each after its answer: never cut
            for _ in range(12):
                polite.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                assert status_of(_read_answer(polite)) == 200
        assert app.state.metrics.dropped == {"pipelined": 1}


# --- Bounded HTTP fuzz against the in-process app: never a 5xx. --------------------------------

_TOKEN = "fuzz-token"
_FUZZ_TAIL = Tail()
_FUZZ_APPS = {
    token: TestClient(create_app(_FUZZ_TAIL, MANIFEST, ServerConfig(token=token, max_batch=8,
                                                                     max_payload_bytes=payload_size((16, 2, 4, 4)))))
    for token in (None, _TOKEN)
}
_SAFE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)


def _payloads():
    valid = st.builds(lambda b, s, p: encode((torch.rand(b, 2, 4, 4) * 2 - 1) * s, p), st.integers(1, 12),
                      st.sampled_from([1.0, 1e-30, 1e20, 3e36, 3e38]), st.booleans())
    other_shape = st.builds(lambda shape: encode(torch.randn(*shape)),
                            st.lists(st.integers(1, 5), min_size=1, max_size=5))

    def mutate(blob, edits, cut, reseal):
        blob = bytearray(blob)
        for offset, value in edits:
            blob[offset % len(blob)] = value
        blob = bytes(blob[:cut % (len(blob) + 1)])
        return _resealed(blob, 0, blob[:13]) if reseal and len(blob) >= 13 else blob

    mutated = st.builds(mutate, valid, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
                        st.integers(0, 10**6), st.booleans())
    huge_shape = st.builds(lambda dims: _resealed(body(1)[:13] + struct.pack("<4I", *dims) + body(1)[29:], 8, b"\x04"),
                           st.tuples(*[st.integers(1, 2**32 - 1)] * 4))
    return st.one_of(valid, other_shape, mutated, huge_shape, st.binary(max_size=600), st.just(b""))


def _mostly(draw, common: list, rare: st.SearchStrategy, rare_one_in: int = 5):
    """One of ``common`` most of the time, else anything ``rare`` makes: most fuzzed requests get
    far enough to reach the payload checks and the model, the rest probe routing and parsing."""
    return draw(rare) if draw(st.integers(1, rare_one_in)) == 1 else draw(st.sampled_from(common))


@st.composite
def _requests(draw):
    # A generated path never starts "//": the test client would read "//::" as a host and port (a
    # client-side InvalidURL, not a server answer); "//infer" stays among the sampled paths.
    method = _mostly(draw, ["POST"], st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE"])
                     | st.text(st.characters(min_codepoint=65, max_codepoint=90), min_size=1, max_size=8))
    path = _mostly(draw, ["/infer"], st.sampled_from(["/", "/health", "/metrics", "/docs", "/openapi.json", "/redoc",
                                                      "/infer/", "//infer", "/infer?x=1", "/%00", "/../infer"])
                   | st.text(_SAFE, max_size=30).map(lambda t: "/" + t.replace("#", "").replace("?", "").lstrip("/")))
    headers = {}
    content_type = _mostly(draw, ["application/octet-stream", "APPLICATION/OCTET-STREAM", "application/octet-stream; x=y"],
                           st.sampled_from([None, "application/json", "text/plain", "", ";", "application/octet-stream;;;"])
                           | st.text(_SAFE, max_size=40))
    if content_type is not None:
        headers["content-type"] = content_type
    authorization = _mostly(draw, [f"Bearer {_TOKEN}", f"bearer {_TOKEN}"],
                            st.sampled_from([None, "Bearer", "Bearer wrong", "Basic Zm9vOmJhcg==", "", " ",
                                             f"Bearer {_TOKEN} {_TOKEN}"]) | st.text(_SAFE, max_size=40))
    if authorization is not None:
        headers["authorization"] = authorization
    if draw(st.integers(1, 4)) == 1:  # a lying, huge or malformed Content-Length
        headers["content-length"] = draw(st.sampled_from(["0", "1", "-1", "abc", "1e3", " 12 ", "99999999999999999999"])
                                         | st.integers(0, 10**7).map(str))
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=10))
        headers.setdefault("x-" + name, draw(st.text(_SAFE, max_size=30)))
    return method, path, headers, draw(_payloads()), draw(st.sampled_from(list(_FUZZ_APPS)))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_requests())
def test_fuzzed_requests_never_get_a_5xx(request):
    method, path, headers, content, token = request
    answer = _FUZZ_APPS[token].request(method, path, headers=headers, content=content)
    assert answer.status_code < 500, (answer.status_code, answer.text)
    if answer.status_code >= 400 and method != "HEAD":
        error = answer.json()["error"]
        assert error["code"] == answer.status_code and "Traceback" not in answer.text


def test_split_serve_defaults_are_the_servers():
    """The CLI's option defaults and ServerConfig's come from one dependency-free module
    (edgetorch.tail_defaults): a default `split serve` is a default ServerConfig."""
    import inspect

    from edgetorch.cli.split import serve
    from edgetorch.split.server import ServerConfig

    options = {name: p.default.default for name, p in inspect.signature(serve).parameters.items()}
    config = ServerConfig()
    assert (options["header_timeout"], options["read_timeout"], options["keep_alive"], options["write_timeout"],
            options["max_connections"], options["max_batch"]) == (
        config.header_timeout_s, config.read_timeout_s, config.keep_alive_s, config.write_timeout_s,
        config.max_connections, config.max_batch)


def test_split_serve_ray_without_ray_says_how_to_install_it(monkeypatch, tmp_path):
    import sys

    from typer.testing import CliRunner

    from edgetorch.cli import app

    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    result = CliRunner().invoke(app, ["split", "serve", str(tmp_path), "--ray"])
    text = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and "pip install 'edgetorch[ray]'" in text, text
