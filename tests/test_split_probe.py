"""The library's clients of a tail server (load, hostile phases, fuzzer) and `edgetorch split probe`,
each at a tiny size against a real uvicorn on loopback, and against fake servers on loopback that
answer what a broken or hostile one would. Timeouts here only guard hangs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import struct
import threading
import types
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from edgetorch.split.fuzz import Fuzzer, FuzzConfig, fuzz_one, run_fuzz
from edgetorch.split.loadgen import MAX_ANSWER_BYTES, AnswerError, LoadConfig, Target, get, metrics_totals, run_load
from edgetorch.split.payload import encode, payload_size
from edgetorch.split.probe import (CapConfig, PipeliningConfig, StallConfig, run_connection_cap, run_pipelining,
                                   run_slow_readers, run_stall)
from edgetorch.split.protocol import serve_in_background
from edgetorch.split.server import ServerConfig, create_app
from edgetorch.split.wire import MAX_RAW_ANSWER_BYTES, get_once

SHAPE = (2, 4, 4)
MANIFEST = types.SimpleNamespace(arch="tiny", channels=2, split_point="sp2", bottleneck_shape=SHAPE, num_classes=3,
                                 payload_format="etbq-v1")
DEADLINE = 0.5
HANG_GUARD_S = 30.0
FAST = dict(header_timeout_s=DEADLINE, read_timeout_s=DEADLINE, keep_alive_s=DEADLINE, write_timeout_s=DEADLINE)


class Wide(nn.Module):
    """4,096 logits a sample: a batch of 64 answers ~5 MB, more than loopback's socket buffers take."""

    def forward(self, x):
        return x.flatten(1)[:, :1].expand(-1, 4096) * torch.linspace(-1, 1, 4096)


def _serve(tail: nn.Module | None = None, **config):
    app = create_app(tail or nn.Sequential(nn.Flatten(), nn.Linear(32, 3)), MANIFEST, ServerConfig(**config))
    return app, serve_in_background(app)


def _payload(batch: int = 1) -> bytes:
    return encode(torch.randn(batch, *SHAPE))


def test_a_target_is_read_from_an_http_url():
    target = Target.from_url("http://10.0.0.5:8123", token="t0k")
    assert (target.host, target.port, target.auth, target.url) == ("10.0.0.5", 8123, "Bearer t0k", "http://10.0.0.5:8123")
    assert Target.from_url("http://[::1]:9").url == "http://[::1]:9" and Target.from_url("http://host").port == 80
    for url in ("https://10.0.0.5:8123", "10.0.0.5:8123", "ftp://x"):
        with pytest.raises(ValueError, match="http://host"):
            Target.from_url(url)


def test_the_fuzzer_is_seeded_and_its_length_lies_are_flagged():
    limit = payload_size((64, *SHAPE))
    first, again, other = (Fuzzer(seed, SHAPE, limit) for seed in (0, 0, 1))
    stream = [first.request() for _ in range(60)]
    assert stream == [again.request() for _ in range(60)]
    assert stream != [other.request() for _ in range(60)]
    lies = [raw for _, raw, lying in stream if lying]
    assert lies  # 60 requests hold a few
    for raw in lies:
        head, _, sent = raw.partition(b"\r\n\r\n")
        declared = int(re.findall(rb"\r\nContent-Length: (\d+)", head)[-1])
        assert declared > len(sent)


def test_load_counts_errors_and_orders_its_percentiles():
    app, server = _serve(token="s3cret")
    with server as url:
        good = run_load(Target.from_url(url, "s3cret"), _payload(), LoadConfig(clients=2, requests=5))
        refused = run_load(Target.from_url(url, "wrong"), _payload(), LoadConfig(clients=1, requests=3))
        totals = metrics_totals(Target.from_url(url, "s3cret"))
    assert (good.requests, good.errors, refused.errors) == (10, 0, 3)
    assert good.p50_ms <= good.p90_ms <= good.p99_ms <= good.max_ms and good.server_p50_ms is not None
    assert totals["requests"] == 13 and totals["errors_by_code"] == {"401": 3} and totals["inferences"] == 10


def test_fuzzed_requests_over_the_wire_never_get_a_5xx():
    app, server = _serve(**FAST)
    with server as url:
        fuzzed = run_fuzz(Target.from_url(url), SHAPE, payload_size((64, *SHAPE)), FuzzConfig(requests=200, read_timeout_s=DEADLINE))
    assert fuzzed.answers_5xx == 0 and not fuzzed.first_5xx
    assert sum(fuzzed.statuses.values()) == 200 and fuzzed.statuses.get("200", 0) > 0  # some reach the model
    assert sum(n for kinds in fuzzed.by_payload_kind.values() for n in kinds.values()) == 200


def test_idle_connections_over_the_cap_leave_health_answering():
    # A deadline of seconds, not DEADLINE: on a busy machine opening the 11 must not outlast it, or
    # the first ones end with a 408 before the cap evicts them.
    app, server = _serve(max_connections=8, **{**FAST, "header_timeout_s": 3.0})
    with server as url:
        cap = run_connection_cap(Target.from_url(url), CapConfig(connections=11, polls=2, header_timeout_s=3.0))
    assert cap.health.ok == cap.health.polls == 2
    assert sum(cap.idle_connections_ended.values()) == 11 and "still open" not in cap.idle_connections_ended
    assert app.state.metrics.dropped["evicted"] >= 3  # 11 (and the polls) over a cap of 8


def test_a_pipelining_flood_is_cut_at_the_cap():
    app, server = _serve(max_pipelined=4, keep_alive_s=HANG_GUARD_S)
    with server as url:
        flood = run_pipelining(Target.from_url(url), PipeliningConfig(connections=2, depth=100, window_s=HANG_GUARD_S))
    assert flood.ended_by_server_within_window and flood.ends == {"closed by the server": 2}
    assert (flood.answers_per_connection_max, flood.answers_total) == (5, 10)
    assert app.state.metrics.dropped == {"pipelined": 2}


def test_clients_that_do_not_read_are_let_go_and_need_the_server_pid():
    app, server = _serve(Wide(), write_timeout_s=0.2)
    with server as url:
        with pytest.raises(ValueError, match="server_pid"):
            run_slow_readers(Target.from_url(url), _payload(64), 0, 2, HANG_GUARD_S)
        # The phase ends once both are let go: the window only guards a server that never does.
        slow = run_slow_readers(Target.from_url(url, server_pid=os.getpid()), _payload(64), 0, 2, HANG_GUARD_S)
    assert (slow.answers_begun, slow.closed, slow.held_at_end_of_window) == (2, 2, 0)
    assert app.state.metrics.dropped == {"write_timeout": 2} and slow.peak_rss_bytes > 0


def _probe(*args: str, env: dict | None = None):
    import edgetorch.cli.split  # noqa: F401
    from edgetorch.cli import app

    return CliRunner().invoke(app, ["split", "probe", *args], env=env)


def test_the_probe_command_prints_each_phase_and_fails_on_errors(tmp_path):
    # Keep-alive well past any pause a busy machine makes between a client's requests (a connection
    # closed under the load phase counts as an error); the stall phase still meets the 0.5 s deadline.
    app, server = _serve(token="s3cret", **{**FAST, "keep_alive_s": HANG_GUARD_S})
    with server as url:
        # Deadlines well past the server's: the check passes however late a busy machine closes them.
        done = _probe(url, "--token-env", "PROBE_TOKEN", "--clients", "2", "--requests", "3", "--hostile",
                      "--stalled", "6", "--fuzz", "40", "--header-deadline", str(HANG_GUARD_S), "--read-deadline",
                      str(2 * HANG_GUARD_S), "--json", str(tmp_path / "p.json"), env={"PROBE_TOKEN": "s3cret"})
        unauthorised = _probe(url, "--clients", "1", "--requests", "2")
    assert done.exit_code == 0, done.output
    assert "0 errors of 6" in done.output and "6 closed by the server (6 with 408)" in done.output
    assert " 0 5xx" in done.output and "FAILED" not in done.output
    record = json.loads((tmp_path / "p.json").read_text())
    assert record["load"]["requests"] == 6 and record["stall"]["connections"] == 6 and record["fuzz"]["requests"] == 40
    assert {kind: k["deadline_s"] for kind, k in record["stall"]["by_kind"].items()} == {
        "partial headers": HANG_GUARD_S, "partial body": 2 * HANG_GUARD_S}
    assert unauthorised.exit_code == 1 and "2 errors of 2" in unauthorised.output and "FAILED" in unauthorised.output
    assert '{"401": 2}' in unauthorised.output
    refused = _probe("https://127.0.0.1:1")
    assert refused.exit_code == 2 and "http://host" in refused.output


def test_the_probe_command_checks_the_shape_a_server_claims_before_making_a_tensor():
    claim = {"bottleneck_shape": [100_000, 100_000, 100_000], "max_payload_bytes": 1 << 20}
    with _fake_server(_answer(200, json.dumps(claim).encode())) as (target, _):
        done = _probe(target.url)
    assert done.exit_code == 1 and "not 3 positive ints within the payload limit" in " ".join(done.output.split())
    # the limit is the server's word too: a huge one does not let a 4 TB tensor through
    claim = {"bottleneck_shape": [10_000, 10_000, 10_000], "max_payload_bytes": 10**13}
    with _fake_server(_answer(200, json.dumps(claim).encode())) as (target, _):
        done = _probe(target.url)
    assert isinstance(done.exception, SystemExit) and "not 3 positive ints within the payload limit" in " ".join(done.output.split())
    for body in (b'{"bottleneck_shape": [2, 2, 2], "max_payload_bytes": Infinity}', b"[" * 200_000):
        with _fake_server(_answer(200, body)) as (target, _):
            done = _probe(target.url)
        assert done.exit_code == 1 and isinstance(done.exception, SystemExit)  # a clear failure, not a traceback
    with _fake_server(_answer(200, b"<html>", "text/html")) as (target, _):
        assert _probe(target.url).exit_code == 1  # not JSON: not a tail server, not a bad URL


def test_the_probe_command_replaces_deadline_with_the_header_and_read_deadlines():
    refused = _probe("http://127.0.0.1:9", "--hostile", "--deadline", "10")
    assert refused.exit_code == 2
    said = " ".join(refused.output.split())
    assert "--header-deadline" in said and "--read-deadline" in said


def test_body_stalls_are_held_to_the_read_deadline_and_header_stalls_to_the_header_deadline():
    # The server's body deadline (5 s) is past the header deadline given + 1 s (3 + 1): checked
    # against the header deadline, as the probe once did, every body stall would fail. The
    # header stalls close at 0.5 s, 3.5 s inside theirs, however busy the machine.
    app, server = _serve(**{**FAST, "read_timeout_s": 5.0})
    with server as url:
        stall = run_stall(Target.from_url(url), _payload(), StallConfig(4, header_timeout_s=3.0, read_timeout_s=HANG_GUARD_S))
    headers, body = stall.by_kind["partial headers"], stall.by_kind["partial body"]
    assert (headers["deadline_s"], body["deadline_s"]) == (3.0, HANG_GUARD_S)
    assert body["closed_after_s_median"] > 3.0 + 1.0  # the server cannot close them before its 5 s
    assert stall.closed_within_deadline_plus_1s == stall.closed == stall.answered_408 == 4


# --- servers that answer badly ---------------------------------------------------------------------

def _answer(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    return (b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, content_type.encode(), len(body)) + body)


def _drain(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while conn.recv(65536):
            pass


@contextlib.contextmanager
def _serving(handle: Callable[[socket.socket, threading.Event], None],
             receive_buffer: int | None = None) -> Iterator[tuple[Target, list]]:
    """A server on 127.0.0.1 that runs ``handle(connection, closing)`` in a thread of its own for
    every connection it accepts; ``closing`` is set when the ``with`` block ends. ``receive_buffer``
    sets the accepted sockets' SO_RCVBUF (on the listener, so the window they advertise is small
    from the start). Yields its target and the list of connections it accepted."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list = []
    closing = threading.Event()

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener was shut down
                return
            accepted.append(conn)
            threading.Thread(target=handle, args=(conn, closing), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield Target("127.0.0.1", listener.getsockname()[1]), accepted
    finally:
        closing.set()
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()


def _fake_server(*parts: bytes, pause_s: float = 0.0) -> contextlib.AbstractContextManager[tuple[Target, list]]:
    """A server on 127.0.0.1 that writes ``parts`` to every connection as soon as it accepts it,
    ``pause_s`` apart (whatever the client sends, read meanwhile and ignored), then closes. Yields
    its target and the list of connections it accepted."""

    def answer_one(conn: socket.socket, closing: threading.Event) -> None:
        with conn, contextlib.suppress(OSError):  # a client that stopped reading resets the connection
            conn.settimeout(HANG_GUARD_S)
            reader = threading.Thread(target=_drain, args=(conn,), daemon=True)
            reader.start()
            for i, part in enumerate(parts):
                if i and closing.wait(pause_s):
                    return
                conn.sendall(part)
            conn.shutdown(socket.SHUT_WR)
            reader.join(HANG_GUARD_S)  # until the client closes: its request is read, so no reset

    return _serving(answer_one)


def _trickling_server() -> contextlib.AbstractContextManager[tuple[Target, list]]:
    """A fake server that sends the head of a 200 at once, then its 40-byte body a byte every
    0.1 s: each read comes well inside DEADLINE (no per-read timeout fires), the whole answer 4 s
    after the head."""
    body = b" " * 40
    head = _answer(200, body, "text/plain")[:-len(body)]
    return _fake_server(head, *(body[i:i + 1] for i in range(len(body))), pause_s=0.1)


def test_an_answer_trickled_in_is_held_to_one_deadline_for_the_whole():
    late = f"no whole answer within {DEADLINE:g} s"
    with _trickling_server() as (target, _):
        with pytest.raises(AnswerError, match="not answered in full") as raised:
            get(target, "/", timeout_s=DEADLINE)
        assert raised.value.kind == late
        with pytest.raises(AnswerError, match="not answered in full"):
            metrics_totals(target, timeout_s=DEADLINE)
        load = run_load(target, _payload(), LoadConfig(clients=2, requests=2, timeout_s=DEADLINE))
    assert (load.requests, load.errors, load.errors_by_kind) == (4, 4, {late: 4})


def _reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    conn.close()


def _reset_once_sent_to(conn: socket.socket, closing: threading.Event) -> None:
    """A handler for :func:`_serving` that reads nothing and resets the connection as soon as its
    first byte arrives: the client has connected and begun to send."""
    conn.settimeout(HANG_GUARD_S)
    with contextlib.suppress(OSError):
        conn.recv(1, socket.MSG_PEEK)
    _reset(conn)


def _hold_unread(conn: socket.socket, closing: threading.Event) -> None:
    """A handler for :func:`_serving` that reads nothing and resets the connection when the server
    closes (a hang guard later at most)."""
    closing.wait(HANG_GUARD_S)
    _reset(conn)


# More than a client's send buffer (4 MiB at most by default) and a 4 KiB receive window take: a
# client sending it to a server that reads nothing is still sending when the server resets or
# gives up, however fast the machine.
UNSENDABLE = 16 << 20


def test_a_server_that_resets_connections_as_they_send_fails_them_not_the_stall_phase():
    # The two stalled in the body are still sending half of a 2 * UNSENDABLE payload when the reset
    # comes; the two stalled in the headers have sent theirs and are reset while they wait.
    with _serving(_reset_once_sent_to, receive_buffer=4096) as (target, _):
        stall = run_stall(target, bytes(2 * UNSENDABLE), StallConfig(4, HANG_GUARD_S, HANG_GUARD_S))
    assert (stall.connections, stall.connect_errors, stall.send_errors, stall.closed) == (4, 0, 2, 0)


def test_fuzzing_a_server_that_reads_nothing_of_a_large_request_gives_up_at_the_answer_deadline():
    request = b"POST /infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % UNSENDABLE + bytes(UNSENDABLE)
    with _serving(_hold_unread, receive_buffer=4096) as (target, _):
        assert asyncio.run(fuzz_one(target, request, DEADLINE)) == "no answer in time"


def test_the_raw_clients_read_at_most_their_cap_and_say_so():
    endless = _answer(200, b"x" * (4 * MAX_RAW_ANSWER_BYTES), "text/plain")
    with _fake_server(endless) as (target, _):
        reply = asyncio.run(get_once(target, HANG_GUARD_S))
        stall = run_stall(target, _payload(), StallConfig(4, HANG_GUARD_S, HANG_GUARD_S))
        cap = run_connection_cap(target, CapConfig(connections=3, polls=1, header_timeout_s=HANG_GUARD_S))
    over = f"answer over {MAX_RAW_ANSWER_BYTES:,} bytes"
    assert reply.status == over and reply.latency_s is None
    assert (stall.answers_over_cap, stall.closed, stall.closed_within_deadline_plus_1s, stall.connect_errors) == (4, 0, 0, 0)
    assert cap.idle_connections_ended == {over: 3} and cap.health.statuses == {over: 1}
    with _fake_server(b"HTTP/1.1 200 OK\r\nx-long: " + b"v" * (2 * MAX_RAW_ANSWER_BYTES)) as (target, _):
        head = asyncio.run(fuzz_one(target, b"GET / HTTP/1.1\r\n\r\n", HANG_GUARD_S))
    assert head == f"answer head over {MAX_RAW_ANSWER_BYTES:,} bytes"


@pytest.mark.parametrize("answer, kind", [
    (_answer(200, b"<html>a proxy's page</html>", "text/html"), "200 not the expected JSON"),
    (_answer(200, b'{"logits": [[1, 2], [3, 4]], "timing": {}}'), "200 not the expected JSON"),
    (_answer(200, b'{"logits": [[1, 2]], "timing": {"tail_s": "soon"}}'), "200 not the expected JSON"),
    (_answer(200, b"[" * (MAX_ANSWER_BYTES + 1)), f"answer over {MAX_ANSWER_BYTES:,} bytes"),
    (_answer(503, b'{"error": "busy"}'), "503"),
], ids=["html", "two-rows", "bad-timing", "over-cap", "503"])
def test_load_counts_a_bad_answer_as_an_error_by_kind(answer, kind):
    with _fake_server(answer) as (target, _):
        load = run_load(target, _payload(), LoadConfig(clients=2, requests=2, timeout_s=HANG_GUARD_S))
    assert (load.requests, load.errors, load.errors_by_kind, load.server_p50_ms) == (4, 4, {kind: 4}, None)


def test_metrics_totals_refuses_an_error_status_an_unreadable_and_an_overlong_answer():
    cases = [(_answer(401, b'{"error": "unauthorized"}'), "answered 401"),
             (_answer(200, b"<html>", "text/plain"), "not with a Prometheus text exposition"),
             (_answer(200, b"x 1\n" * (MAX_ANSWER_BYTES // 4 + 1), "text/plain"), f"more than {MAX_ANSWER_BYTES:,} bytes")]
    for answer, said in cases:
        with _fake_server(answer) as (target, _):
            with pytest.raises(AnswerError, match=said):
                metrics_totals(target, timeout_s=HANG_GUARD_S)


def test_the_probe_command_fails_on_an_overlong_or_error_answer_to_get_root():
    for answer, said in [(_answer(200, b" " * (MAX_ANSWER_BYTES + 1)), "more than"), (_answer(404, b"{}"), "answered 404")]:
        with _fake_server(answer) as (target, _):
            done = _probe(target.url)
        assert done.exit_code == 1 and said in " ".join(done.output.split())


def test_waiting_for_a_local_server_backs_off_and_gives_up_at_its_deadline(monkeypatch):
    from edgetorch.split import local_server

    clock = {"now": 0.0, "reads": 0}

    def monotonic() -> float:
        clock["reads"] += 1
        assert clock["reads"] < 1000, "polled /health without sleeping"
        return clock["now"]

    sleeps = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock["now"] += seconds

    monkeypatch.setattr(local_server, "time", types.SimpleNamespace(monotonic=monotonic, sleep=sleep))
    alive = types.SimpleNamespace(poll=lambda: None, returncode=None)
    with _fake_server(_answer(503, b'{"status": "loading"}')) as (target, accepted):
        with pytest.raises(local_server.ServerStartError, match=r"within 5 s \(last try: it answered 503\)"):
            local_server._wait_until_up(target, alive, 5.0)
    assert sleeps[:5] == [0.05, 0.1, 0.2, 0.4, 0.8] and max(sleeps) == 1.0
    assert sum(sleeps) == pytest.approx(5.0) and len(accepted) == len(sleeps) + 1
