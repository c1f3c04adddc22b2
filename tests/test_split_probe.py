"""The library's clients of a tail server (load, hostile phases, fuzzer) and `edgetorch split probe`,
each at a tiny size against a real uvicorn on loopback. Timeouts here only guard hangs."""

from __future__ import annotations

import json
import os
import re
import types

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from edgetorch.split.fuzz import Fuzzer, FuzzConfig, run_fuzz
from edgetorch.split.loadgen import LoadConfig, Target, metrics_totals, run_load
from edgetorch.split.payload import encode, payload_size
from edgetorch.split.probe import (CapConfig, PipeliningConfig, run_connection_cap, run_pipelining, run_slow_readers)
from edgetorch.split.protocol import serve_in_background
from edgetorch.split.server import ServerConfig, create_app

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
        fuzzed = run_fuzz(Target.from_url(url), SHAPE, payload_size((64, *SHAPE)), FuzzConfig(requests=200, timeout_s=DEADLINE))
    assert fuzzed.answers_5xx == 0 and not fuzzed.first_5xx
    assert sum(fuzzed.statuses.values()) == 200 and fuzzed.statuses.get("200", 0) > 0  # some reach the model
    assert sum(n for kinds in fuzzed.by_payload_kind.values() for n in kinds.values()) == 200


def test_idle_connections_over_the_cap_leave_health_answering():
    # A deadline of seconds, not DEADLINE: on a busy machine opening the 11 must not outlast it, or
    # the first ones end with a 408 before the cap evicts them.
    app, server = _serve(max_connections=8, **{**FAST, "header_timeout_s": 3.0})
    with server as url:
        cap = run_connection_cap(Target.from_url(url), CapConfig(connections=11, polls=2, timeout_s=3.0))
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
        # --deadline well past the server's: the check passes however late a busy machine closes them.
        done = _probe(url, "--token-env", "PROBE_TOKEN", "--clients", "2", "--requests", "3", "--hostile",
                      "--stalled", "6", "--fuzz", "40", "--deadline", str(HANG_GUARD_S), "--json", str(tmp_path / "p.json"),
                      env={"PROBE_TOKEN": "s3cret"})
        unauthorised = _probe(url, "--clients", "1", "--requests", "2")
    assert done.exit_code == 0, done.output
    assert "0 errors of 6" in done.output and "6 closed by the server (6 with 408)" in done.output
    assert " 0 5xx" in done.output and "FAILED" not in done.output
    record = json.loads((tmp_path / "p.json").read_text())
    assert record["load"]["requests"] == 6 and record["stall"]["connections"] == 6 and record["fuzz"]["requests"] == 40
    assert unauthorised.exit_code == 1 and "2 errors of 2" in unauthorised.output and "FAILED" in unauthorised.output
    refused = _probe("https://127.0.0.1:1")
    assert refused.exit_code == 2 and "http://host" in refused.output


def test_the_probe_command_checks_the_shape_a_server_claims_before_making_a_tensor(monkeypatch):
    import httpx

    claim = {"bottleneck_shape": [100_000, 100_000, 100_000], "max_payload_bytes": 1 << 20}
    monkeypatch.setattr(httpx, "get", lambda *a, **k: httpx.Response(200, json=claim))
    done = _probe("http://127.0.0.1:9")
    assert done.exit_code == 1 and "not 3 positive ints within the payload limit" in " ".join(done.output.split())
    monkeypatch.setattr(httpx, "get", lambda *a, **k: httpx.Response(200, text="<html>"))
    assert _probe("http://127.0.0.1:9").exit_code == 1  # not JSON: not a tail server, not a bad URL
