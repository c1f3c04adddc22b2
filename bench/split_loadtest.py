"""Load, stall, fuzz and flood test of the split tail server on loopback.

The server (uvicorn, one worker, in its own process as it would be deployed, with a bearer token
and 5 s header, body and write deadlines) serves the tail of a resnet18 split at SP2 with C = 12 at
96 px (random weights: the time of a dense CNN does not depend on them). Phases, in order:

1. load: N concurrent clients x M batch-1 requests each, back to back over one keep-alive
   connection per client (1 x 30, then the target 32 x 100). Errors = any non-200 or transport
   failure; latency percentiles are client-side round trips.
2. stall: 1,000 connections opened at once, half sending a partial request line and headers, half
   complete headers and half a body, then nothing. Recorded: how long after its last byte the
   server closed each one (and whether it answered 408), and /health polled throughout.
3. fuzz: >= 10,000 requests from a seeded random generator written to raw sockets (methods,
   targets, HTTP versions, headers, Content-Length lies, chunked bodies, valid, mutated, resealed,
   truncated and wrong-shape payloads, garbage), 32 at a time. Recorded: status codes; the target
   is 0 answers of 500 or more.
4. connection cap: 2,100 idle connections (over the default cap of 2,048) opened at once, then
   /health polled on new connections while they are held.
5. pipelining flood: 2,100 connections each writing 3,000 ``GET /`` at once and reading the
   answers, /health polled throughout. Recorded: answers per connection, when the flood ended.
6. clients that do not read: on a second server whose tail answers ~6 MB (10,000 classes, batch
   32), 30 clients with the smallest receive buffer send one request each and never read.
   Recorded: when the server let go of each (its socket gone from the server process).
7. RSS of the server process before and after each phase (and peaks while connections are held).

The clients are the library's (``edgetorch.split.loadgen``, ``probe`` and ``fuzz``; ``edgetorch
split probe URL`` runs them against any server): this script starts the server, chooses the sizes
and writes docs/results/split_loadtest.{json,md}. The process raises its soft open-file limit to
what phases 2, 4 and 5 hold (the server process inherits it). Run:
``.venv/bin/python bench/split_loadtest.py [--fuzz-requests 10000]``
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict

import httpx
import torch

from _common import table, write_results
from edgetorch.split.bottleneck import inject_bottleneck
from edgetorch.split.export import save
from edgetorch.split.fuzz import FuzzConfig, run_fuzz
from edgetorch.split.loadgen import LoadConfig, metrics_totals, run_load
from edgetorch.split.local_server import OpenFileLimitError, raise_open_file_limit, serve_in_process
from edgetorch.split.payload import encode, payload_size
from edgetorch.split.probe import (CapConfig, PipeliningConfig, RssSampler, StallConfig, run_connection_cap,
                                   run_pipelining, run_slow_readers, run_stall)
from edgetorch.split.server import ServerConfig
from edgetorch.zoo import build_model

ARCH, CHANNELS, RESOLUTION = "torchvision:resnet18", 12, 96
LOADS = ((1, 30), (32, 100))  # (clients, requests per client)
STALLED = 1000
TIMEOUT_S = 5.0  # the server's header, body and write deadlines in this benchmark
SLOW_READERS, WIDE_CLASSES, WIDE_BATCH = 30, 10_000, 32  # answers of ~6 MB: more than loopback buffers take
DEFAULTS = ServerConfig()
IDLE = 2100  # over the default connection cap of 2,048
PIPELINERS, PIPELINED = 2100, 3000
PIPELINING_WINDOW_S = 60.0
FUZZ_CONCURRENCY = 32
TOKEN = "loadtest-token"
AUTH = f"Bearer {TOKEN}"

def slow_reader_phase(artifacts: str, count: int) -> tuple[dict, dict]:
    """Phase 6, on its own server: a tail with WIDE_CLASSES logits, so one answer outgrows the
    socket buffers (the main model's largest answer does not)."""
    torch.manual_seed(0)
    wide = inject_bottleneck(build_model(ARCH, num_classes=WIDE_CLASSES), CHANNELS, "sp2").eval()
    manifest = save(wide, artifacts, RESOLUTION)
    body = encode(torch.randn(WIDE_BATCH, *manifest.bottleneck_shape))
    with serve_in_process(artifacts, TOKEN, TIMEOUT_S) as target:
        answer = httpx.post(target.url + "/infer", content=body, timeout=120,
                            headers={"content-type": "application/octet-stream", "authorization": AUTH})
        answer.raise_for_status()
        slow = asdict(run_slow_readers(target, body, len(answer.content), count, 4 * TIMEOUT_S))
        slow["health_after"] = httpx.get(target.url + "/health", timeout=10).status_code
        return slow, metrics_totals(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz-requests", type=int, default=10_000)
    parser.add_argument("--stalled", type=int, default=STALLED)
    parser.add_argument("--idle", type=int, default=IDLE)
    parser.add_argument("--pipeliners", type=int, default=PIPELINERS)
    args = parser.parse_args()
    try:
        raise_open_file_limit(max(args.stalled, args.idle, args.pipeliners) + 1024)
    except OpenFileLimitError as e:
        raise SystemExit(f"{e} or pass smaller --idle / --pipeliners") from None
    torch.manual_seed(0)
    student = inject_bottleneck(build_model(ARCH, num_classes=10), CHANNELS, "sp2").eval()
    with tempfile.TemporaryDirectory() as artifacts, tempfile.TemporaryDirectory() as wide_artifacts:
        manifest = save(student, artifacts, RESOLUTION)
        shape = tuple(manifest.bottleneck_shape)
        body = encode(torch.randn(1, *shape))
        with serve_in_process(artifacts, TOKEN, TIMEOUT_S) as target:
            rss = RssSampler(target.server_pid)
            run_load(target, body, LoadConfig(1, 3))  # warm-up, not recorded
            memory = {"start": rss.now()}
            runs = [asdict(run_load(target, body, LoadConfig(c, m))) for c, m in LOADS]
            memory["after_load"] = rss.now()
            stall = asdict(run_stall(target, body, StallConfig(args.stalled, TIMEOUT_S, TIMEOUT_S)))
            memory["peak_while_stalled"] = stall["peak_rss_bytes"]
            time.sleep(1.0)
            memory["after_stall"] = rss.now()
            limit = payload_size((64, *shape))
            fuzz = asdict(run_fuzz(target, shape, limit, FuzzConfig(args.fuzz_requests, 0, FUZZ_CONCURRENCY, TIMEOUT_S)))
            memory["after_fuzz"] = rss.now()
            health_after = httpx.get(target.url + "/health", timeout=10).status_code
            cap = asdict(run_connection_cap(target, CapConfig(args.idle, 20, TIMEOUT_S)))
            memory["peak_with_idle_connections"] = cap["peak_rss_bytes"]
            pipelining = asdict(run_pipelining(target, PipeliningConfig(args.pipeliners, PIPELINED, PIPELINING_WINDOW_S)))
            time.sleep(1.0)
            memory["after_pipelining"] = rss.now()
            server_counts = metrics_totals(target)
        slow, slow_counts = slow_reader_phase(wide_artifacts, SLOW_READERS)
    write_report(manifest, body, runs, stall, fuzz, memory, health_after, server_counts, slow, slow_counts, cap,
                 pipelining)


def write_report(manifest, body: bytes, runs: list[dict], stall: dict, fuzz: dict, memory: dict,
                 health_after: int, server_counts: dict, slow: dict, slow_counts: dict, cap: dict,
                 pipelining: dict) -> None:
    main_run = next(r for r in runs if (r["clients"], r["requests_per_client"]) == LOADS[-1])
    targets = {
        "0 errors at 32 x 100": (main_run["errors"] == 0, f"{main_run['errors']} errors of {main_run['requests']}"),
        "stalled connections closed within the timeout": (
            stall["closed_within_deadline_plus_1s"] == stall["connections"],
            f"{stall['closed']}/{stall['connections']} closed, the slowest {stall['closed_after_s_max'] or float('nan'):.2f} s "
            f"after its last byte (deadline {TIMEOUT_S:g} s; 1 s allowed for closing 1,000 at once)"),
        "/health answers while they are held": (
            stall["health_polls_while_held"] > 0 and stall["health_ok_while_held"] == stall["health_polls_while_held"],
            f"{stall['health_ok_while_held']}/{stall['health_polls_while_held']} polls answered 200, with up to "
            f"{stall['health_max_held_during_an_ok_poll']} stalled connections held"),
        "0 5xx over >= 10,000 fuzzed requests": (
            fuzz["answers_5xx"] == 0 and fuzz["requests"] >= 10_000,
            f"{fuzz['answers_5xx']} answers >= 500 of {fuzz['requests']:,} requests"),
        "clients that do not read are dropped at the write deadline": (
            slow["closed"] == slow["connections"] and slow["closed_after_s_max"] <= TIMEOUT_S + 1.0,
            f"{slow['closed']}/{slow['connections']} dropped, the last {slow['closed_after_s_max'] or float('nan'):.2f} s "
            f"after its answer began (deadline {TIMEOUT_S:g} s; 1 s allowed for polling)"),
        f"/health answers with {cap['connections']:,} idle connections (cap {DEFAULTS.max_connections:,})": (
            cap["health"]["ok"] == cap["health"]["polls"],
            f"{cap['health']['ok']}/{cap['health']['polls']} polls answered 200 with at least "
            f"{cap['health_min_held_during_a_poll']:,} idle connections held"),
        f"a pipelining flood is cut at 1 + {DEFAULTS.max_pipelined} answers and /health answers during it": (
            pipelining["answers_per_connection_max"] <= 1 + DEFAULTS.max_pipelined and pipelining["health_during_flood"]["polls"] > 0
            and pipelining["health_during_flood"]["ok"] == pipelining["health_during_flood"]["polls"],
            f"at most {pipelining['answers_per_connection_max']} answers a connection; "
            f"{pipelining['health_during_flood']['ok']}/{pipelining['health_during_flood']['polls']} polls answered 200"),
    }
    load_rows = [(r["clients"], r["requests_per_client"], r["requests"], r["errors"], f"{r['throughput_rps']:.1f}",
                  f"{r['p50_ms']:.1f}", f"{r['p90_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['max_ms']:.1f}",
                  f"{r['server_p50_ms']:.1f}") for r in runs]
    stall_rows = [(kind, k["connections"], k["closed"], k["answered_408"], f"{k['closed_after_s_median']:.2f}",
                   f"{k['closed_after_s_max']:.2f}") for kind, k in stall["by_kind"].items()]
    fuzz_rows = [(status, f"{n:,}") for status, n in fuzz["statuses"].items()]
    mib = 2.0**20
    memory_rows = [(phase.replace("_", " "), f"{value / mib:.1f}") for phase, value in memory.items()]
    target_rows = [(name, "met" if ok else "**missed**", detail) for name, (ok, detail) in targets.items()]
    body_md = (
        f"Tail of {ARCH} split at SP2, C = {CHANNELS}, {RESOLUTION} px input (bottleneck "
        f"{list(manifest.bottleneck_shape)}, payload {len(body):,} bytes per request, batch 1), served by one "
        f"uvicorn worker in a separate process on 127.0.0.1 with a bearer token and {TIMEOUT_S:g} s header, "
        "body and write deadlines (`ServerConfig(header_timeout_s=5, read_timeout_s=5, write_timeout_s=5)`, other "
        f"limits at their defaults, among them `max_connections={DEFAULTS.max_connections}` and "
        f"`max_pipelined={DEFAULTS.max_pipelined}`, run through `uvicorn_config`). Clients are asyncio connections in this process. The machine is shared "
        "with other jobs, so latencies vary run to run; the error counts are the results that must hold.\n\n"
        "## Targets\n\n" + table(["target", "result", "measured"], target_rows)
        + "\n\n## Load: concurrent clients, back-to-back requests\n\n"
        + table(["clients", "requests/client", "requests", "errors", "throughput req/s", "p50 ms", "p90 ms",
                 "p99 ms", "max ms", "server p50 ms (decode + tail)"], load_rows)
        + "\n\nOne uvicorn worker: each request's tail runs in FastAPI's thread pool, so concurrent requests "
        "share the machine's cores and latency grows with the number of clients while throughput stays about "
        "flat; scale out with more worker processes.\n\n"
        f"## {stall['connections']:,} stalled connections\n\n"
        f"All opened at once ({stall['wall_s']:.1f} s until the last was closed; at most {stall['max_held_at_once']:,} "
        f"held at the same time; {stall['connect_errors']} failed to connect). 'closed after' is measured from "
        "the connection's last byte to the server closing it.\n\n"
        + table(["stalled with", "connections", "closed by the server", "answered 408", "closed after, median s",
                 "closed after, max s"], stall_rows)
        + f"\n\n/health, polled every 0.1 s while they were held: {stall['health_ok_while_held']}/"
        f"{stall['health_polls_while_held']} answered 200, median {stall['health_p50_ms'] or float('nan'):.1f} ms, "
        f"slowest {stall['health_max_ms'] or float('nan'):.1f} ms.\n\n"
        f"## Fuzz: {fuzz['requests']:,} raw requests\n\n"
        f"Seeded random requests, {fuzz['concurrency']} at a time, one connection each ({fuzz['wall_s']:.1f} s): "
        "methods, targets and HTTP versions, header names and values (folded, NUL, 20 KB), content types, "
        "bearer tokens, framing (Content-Length correct, short, huge, malformed, twice; chunked, broken "
        "chunks), and bodies (valid, mutated, mutated with the CRC recomputed, truncated, other shapes, batch "
        "headers over the limit, scales that overflow, garbage, empty). "
        f"{fuzz['declaring_more_body_than_sent']} of them declare more body than they send and are answered "
        "only by the body deadline. Answers by status:\n\n"
        + table(["status", "requests"], fuzz_rows)
        + f"\n\nAnswers of 500 or more: **{fuzz['answers_5xx']}**. /health after the fuzz: {health_after}.\n\n"
        f"## {cap['connections']:,} idle connections over the connection cap\n\n"
        f"All opened at once (half silent, half half a request line; {cap['held_when_polling_began']:,} held when "
        f"polling began), then /health polled {cap['health']['polls']} times, 0.1 s apart, each on a new "
        f"connection: {cap['health']['ok']}/{cap['health']['polls']} answered 200 (median "
        f"{cap['health']['p50_ms'] or float('nan'):.1f} ms, slowest {cap['health']['max_ms'] or float('nan'):.1f} ms; "
        f"statuses {json.dumps(cap['health']['statuses'])}). A connection beyond the cap closes the one that has "
        "waited longest for a request, so the idle flood pushed out its own oldest members. How the idle "
        f"connections ended: {json.dumps(cap['idle_connections_ended'])} (408: the header deadline).\n\n"
        f"## Pipelining flood: {pipelining['connections']:,} connections x {pipelining['pipelined_per_connection']:,} "
        "`GET /`\n\n"
        "Each connection writes all its requests at once and reads the answers; /health is polled every 0.25 s on "
        f"new connections. The server ended the flood {pipelining['wall_s']:.1f} s after it began "
        f"({'within' if pipelining['ended_by_server_within_window'] else '**not** within'} the "
        f"{pipelining['window_s']:g} s window): {pipelining['answers_total']:,} answers in all, at most "
        f"{pipelining['answers_per_connection_max']} a connection (the first request and {DEFAULTS.max_pipelined} "
        f"pipelined); ends: "
        f"{json.dumps(pipelining['ends'])}. /health during the flood: {pipelining['health_during_flood']['ok']}/"
        f"{pipelining['health_during_flood']['polls']} answered 200, median "
        f"{pipelining['health_during_flood']['p50_ms'] or float('nan'):.0f} ms, slowest "
        f"{pipelining['health_during_flood']['max_ms'] or float('nan'):.0f} ms: one event loop answers each "
        "flooding connection's next request in turn, and a new connection waits for a few of those rounds.\n\n"
        f"## {slow['connections']} clients that do not read\n\n"
        f"On a second server whose tail has {WIDE_CLASSES:,} classes: each client sends one batch-{WIDE_BATCH} "
        f"request (answer {slow['answer_bytes']:,} bytes, more than loopback's socket buffers take) with the "
        "smallest receive buffer and never reads, all at once (the server renders each JSON answer in a worker "
        "thread; rendered on the event loop, about 0.2 s each, they delayed the deadline timers by whole renders "
        "and the last of 30 was dropped at 7.35 s). The server let go of "
        f"{slow['closed']}/{slow['connections']} (their sockets gone from its process) a median "
        f"{slow['closed_after_s_median'] or float('nan'):.2f} s and at most {slow['closed_after_s_max'] or float('nan'):.2f} s "
        f"after each answer began to arrive, polled every 0.1 s ({slow['held_at_end_of_window']} still held "
        f"{slow['window_s']:g} s after the last answer began); "
        f"its RSS peaked at {slow['peak_rss_bytes'] / mib:.0f} MiB with their answers buffered. /health after: "
        f"{slow['health_after']}; the server counted {json.dumps(slow_counts.get('connections_dropped', {}))} "
        "dropped connections.\n\n"
        "## Server counters\n\n"
        f"The main server's own /metrics counted {server_counts['requests']:,} answered requests over the whole run "
        f"(errors by code: {json.dumps(server_counts['errors_by_code'])}; connections dropped by reason: "
        f"{json.dumps(server_counts.get('connections_dropped', {}))}).\n\n"
        "## Server memory (RSS, MiB)\n\n" + table(["when", "RSS MiB"], memory_rows)
    )
    write_results("split_loadtest", "Split runtime: tail server load, stall, fuzz and flood test on loopback", body_md,
                  {"arch": ARCH, "channels": CHANNELS, "resolution": RESOLUTION, "payload_bytes": len(body),
                   "timeout_s": TIMEOUT_S, "runs": runs, "stall": stall, "fuzz": fuzz, "rss_bytes": memory,
                   "health_after_fuzz": health_after, "server_metrics": server_counts, "connection_cap": cap,
                   "pipelining": pipelining, "slow_readers": slow, "slow_reader_server_metrics": slow_counts,
                   "targets": {name: {"met": ok, "measured": detail} for name, (ok, detail) in targets.items()}})
    if not all(ok for ok, _ in targets.values()):
        raise SystemExit("a target was missed; see docs/results/split_loadtest.md")


if __name__ == "__main__":
    main()
