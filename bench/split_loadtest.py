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

The process raises its soft open-file limit to what phases 2, 4 and 5 hold (the server process
inherits it). Run: ``.venv/bin/python bench/split_loadtest.py [--fuzz-requests 10000]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import resource
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import httpx
import numpy as np
import psutil
import torch

from _common import table, write_results
from edgetorch.split.bottleneck import inject_bottleneck
from edgetorch.split.export import save
from edgetorch.split.payload import encode, payload_size
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

SERVER = """
import sys, uvicorn
from edgetorch.split.protocol import uvicorn_config
from edgetorch.split.server import ServerConfig, app_from_dir
timeout = float(sys.argv[3])
config = ServerConfig(token=sys.argv[4], header_timeout_s=timeout, read_timeout_s=timeout, write_timeout_s=timeout)
app = app_from_dir(sys.argv[1], config)
uvicorn.Server(uvicorn_config(app, "127.0.0.1", int(sys.argv[2]), log_level="warning", access_log=False)).run()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_up(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the server process exited")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("the server did not come up")


# --- 1. load -----------------------------------------------------------------------------------

async def one_client(url: str, body: bytes, requests: int) -> tuple[list[float], list[float], int]:
    latencies, server_times, errors = [], [], 0
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 headers={"content-type": "application/octet-stream", "authorization": AUTH}) as client:
        for _ in range(requests):
            start = time.perf_counter()
            try:
                answer = await client.post("/infer", content=body)
                ok = answer.status_code == 200 and len(answer.json()["logits"]) == 1
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - start)
            errors += not ok
            if ok:
                server_times.append(sum(answer.json()["timing"].values()))
    return latencies, server_times, errors


async def run_load(url: str, body: bytes, clients: int, requests: int) -> dict:
    start = time.perf_counter()
    results = await asyncio.gather(*(one_client(url, body, requests) for _ in range(clients)))
    wall = time.perf_counter() - start
    latencies = np.array([t for lat, _, _ in results for t in lat])
    server = np.array([t for _, times, _ in results for t in times])
    return {"clients": clients, "requests_per_client": requests, "requests": int(latencies.size),
            "errors": int(sum(e for _, _, e in results)), "wall_s": wall,
            "server_p50_ms": float(np.median(server) * 1e3) if server.size else None,
            "throughput_rps": latencies.size / wall,
            **{f"p{q}_ms": float(np.percentile(latencies, q) * 1e3) for q in (50, 90, 99)},
            "max_ms": float(latencies.max() * 1e3)}


# --- 2. stalled connections ---------------------------------------------------------------------

def _status_of(raw: bytes) -> int | None:
    try:
        return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else None
    except (IndexError, ValueError):
        return None


async def run_stall(url: str, port: int, body: bytes, count: int, timeout_s: float, rss: RssSampler) -> dict:
    """Open ``count`` stalled connections at once while polling /health; time each one's closing."""
    partial_headers = b"POST /infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/oc"
    partial_body = (b"POST /infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                    b"Authorization: " + AUTH.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
                    + body[:len(body) // 2])
    held = {"now": 0, "max": 0}
    done = asyncio.Event()

    async def stalled(i: int) -> dict:
        kind = "partial body" if i % 2 else "partial headers"
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as err:
            return {"kind": kind, "error": f"connect: {err}"}
        writer.write(partial_body if i % 2 else partial_headers)
        await writer.drain()
        sent = time.perf_counter()
        held["now"] += 1
        held["max"] = max(held["max"], held["now"])
        try:
            raw = await asyncio.wait_for(reader.read(), timeout_s + 60)  # until the server closes
            closed_after = time.perf_counter() - sent
        except (asyncio.TimeoutError, OSError):
            raw, closed_after = b"", None
        held["now"] -= 1
        writer.close()
        return {"kind": kind, "closed_after_s": closed_after, "status": _status_of(raw)}

    async def poll_health() -> list[dict]:
        polls = []
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            while not done.is_set():
                start = time.perf_counter()
                try:
                    status = (await client.get("/health")).status_code
                except httpx.HTTPError as err:
                    status = type(err).__name__
                polls.append({"status": status, "latency_s": time.perf_counter() - start, "held": held["now"]})
                await asyncio.sleep(0.1)
        return polls

    rss.start_peak()
    poller = asyncio.create_task(poll_health())
    start = time.perf_counter()
    results = await asyncio.gather(*(stalled(i) for i in range(count)))
    wall = time.perf_counter() - start
    done.set()
    polls = await poller
    peak_rss = rss.stop_peak()
    closed = np.array([r["closed_after_s"] for r in results if r.get("closed_after_s") is not None])
    while_held = [p for p in polls if p["held"] > 0]
    by_kind = {}
    for kind in ("partial headers", "partial body"):
        mine = [r for r in results if r["kind"] == kind]
        times = [r["closed_after_s"] for r in mine if r.get("closed_after_s") is not None]
        by_kind[kind] = {"connections": len(mine), "closed": len(times),
                         "answered_408": sum(r.get("status") == 408 for r in mine),
                         "closed_after_s_median": float(np.median(times)) if times else None,
                         "closed_after_s_max": float(max(times)) if times else None}
    ok_polls = [p for p in while_held if p["status"] == 200]
    return {"connections": count, "timeout_s": timeout_s, "wall_s": wall,
            "connect_errors": sum("error" in r for r in results),
            "closed": int(closed.size), "answered_408": sum(r.get("status") == 408 for r in results),
            "closed_after_s_min": float(closed.min()) if closed.size else None,
            "closed_after_s_median": float(np.median(closed)) if closed.size else None,
            "closed_after_s_max": float(closed.max()) if closed.size else None,
            "closed_within_timeout_plus_1s": int((closed <= timeout_s + 1.0).sum()),
            "max_held_at_once": held["max"], "by_kind": by_kind,
            "health_polls_while_held": len(while_held), "health_ok_while_held": len(ok_polls),
            "health_max_held_during_an_ok_poll": max((p["held"] for p in ok_polls), default=0),
            "health_p50_ms": float(np.median([p["latency_s"] for p in ok_polls]) * 1e3) if ok_polls else None,
            "health_max_ms": float(max(p["latency_s"] for p in ok_polls) * 1e3) if ok_polls else None,
            "peak_rss_bytes": peak_rss}


# --- 3. fuzz ------------------------------------------------------------------------------------

def _reseal(blob: bytes) -> bytes:
    """Recompute a payload's CRC, as an encoder that lies on purpose would."""
    if len(blob) < 13:
        return blob
    crc = zlib.crc32(blob[13:], zlib.crc32(blob[:9]))
    return blob[:9] + struct.pack("<I", crc) + blob[13:]


class Fuzzer:
    """Seeded generator of raw HTTP requests, most of them close enough to valid to reach the
    payload checks and the model, the rest probing the HTTP parser, routing and limits."""

    def __init__(self, seed: int, shape: tuple[int, ...], limit: int):
        self.rng, self.shape, self.limit = random.Random(seed), shape, limit
        self.generator = torch.Generator().manual_seed(seed)

    def pick(self, common: list, rare: list, rare_share: float = 0.2):
        return self.rng.choice(rare) if self.rng.random() < rare_share else self.rng.choice(common)

    def text(self, size: int, alphabet: str = "") -> str:
        chars = alphabet or "".join(chr(c) for c in range(0x21, 0x7F))
        return "".join(self.rng.choice(chars) for _ in range(self.rng.randint(0, size)))

    def payload(self) -> tuple[str, bytes]:
        rng = self.rng
        batch = rng.choice([1, 1, 2, 4, 8])
        scale = rng.choice([1.0, 1.0, 1e-30, 1e10, 1e30, 3e38])
        x = (torch.rand(batch, *self.shape, generator=self.generator) * 2 - 1) * scale
        try:
            valid = encode(x, per_sample=rng.random() < 0.8)
        except ValueError:
            valid = encode(torch.zeros(1, *self.shape))
        kind = rng.choice(["valid", "valid", "valid", "mutated", "resealed", "truncated", "wrong shape",
                           "huge batch", "extreme scale", "garbage", "empty"])
        if kind == "valid":
            return kind, valid
        if kind in ("mutated", "resealed"):
            blob = bytearray(valid)
            for _ in range(rng.randint(1, 6)):
                blob[rng.randrange(len(blob))] = rng.randrange(256)
            return kind, _reseal(bytes(blob)) if kind == "resealed" else bytes(blob)
        if kind == "truncated":
            return kind, valid[:rng.randrange(len(valid))]
        if kind == "wrong shape":
            dims = [rng.randint(1, 6) for _ in range(rng.randint(1, 5))]
            return kind, encode(torch.randn(*dims, generator=self.generator))
        if kind == "huge batch":  # a header declaring a batch far over the limit, CRC valid
            return kind, _reseal(valid[:13] + struct.pack("<I", rng.choice([1025, 2**20, 2**32 - 1])) + valid[17:])
        if kind == "extreme scale":  # first scale replaced: 3e38 overflows float32 on decode
            at = 13 + 4 * (1 + len(self.shape))
            return kind, _reseal(valid[:at] + struct.pack("<f", rng.choice([3e38, 1e30, float("inf"), -1.0]))
                                 + valid[at + 4:])
        if kind == "garbage":
            return kind, bytes(rng.randrange(256) for _ in range(rng.randint(1, 3000)))
        return kind, b""

    def request(self) -> tuple[str, bytes, bool]:
        """One request: (kind, raw bytes, whether it declares more body than it sends)."""
        rng = self.rng
        method = self.pick(["POST"], ["GET", "PUT", "DELETE", "HEAD", "OPTIONS", "post", "P@ST", "", "BREW",
                                      "X" * 300])
        target = self.pick(["/infer"], ["/", "/health", "/metrics", "/docs", "/openapi.json", "/infer/", "*",
                                        "http://127.0.0.1/infer", "/infer?x=" + self.text(20), "/%ff%00",
                                        "/" + self.text(40), "/" + "a" * 20000, "/../../etc/passwd"])
        version = self.pick(["HTTP/1.1"], ["HTTP/1.0", "HTTP/2", "HTTP/9.9", "HTCPCP/1.0", ""], 0.05)
        kind, body = self.payload()
        headers = [("Host", "127.0.0.1")] if rng.random() < 0.95 else []
        headers.append(("Content-Type", self.pick(
            ["application/octet-stream", "APPLICATION/OCTET-STREAM", "application/octet-stream; q=1"],
            ["text/plain", "application/json", "", "application/octet-stream;;", self.text(30)])))
        auth = self.pick([AUTH, "bearer " + TOKEN], ["Bearer wrong", "Basic dXNlcjpwYXNz", "Bearer", "",
                                                      AUTH + " extra", self.text(40)])
        if auth is not None and rng.random() < 0.97:
            headers.append(("Authorization", auth))
        lying = False
        framing = self.pick(["length"], ["chunked", "none", "short", "huge", "bad", "twice", "long"], 0.15)
        if framing == "length":
            headers.append(("Content-Length", str(len(body))))
        elif framing == "chunked":
            headers.append(("Transfer-Encoding", "chunked"))
            body = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:500], body[500:]) if part) + b"0\r\n\r\n"
            if rng.random() < 0.3:  # broken chunk framing
                body = body.replace(b"\r\n", b"\n", 1)
        elif framing == "short":
            headers.append(("Content-Length", str(max(len(body) - rng.randint(1, 10), 0))))
        elif framing == "huge":
            headers.append(("Content-Length", rng.choice(["99999999999", str(self.limit + 1), "1" * 40])))
            body = body[:100]
        elif framing == "bad":
            headers.append(("Content-Length", rng.choice(["-1", "abc", "1e3", "", "0x10", "\u00b2"])))
        elif framing == "twice":
            headers += [("Content-Length", str(len(body))), ("Content-Length", str(len(body) + 1))]
        elif framing == "long":  # declares more than it sends: only the body deadline ends it
            headers.append(("Content-Length", str(len(body) + rng.randint(1, 100))))
            lying = True
        for _ in range(rng.choice([0, 0, 1, 3])):
            headers.append(rng.choice([("X-" + self.text(10, "abcdefghij"), self.text(50)),
                                       ("Bad Name", "x"), ("X-Fold", "a\r\n b"), ("X-Nul", "a\x00b"),
                                       ("X-Long", "v" * rng.choice([100, 20000]))]))
        if rng.random() < 0.8:
            headers.append(("Connection", "close"))
        head = f"{method} {target} {version}\r\n".encode("latin-1") + b"".join(
            f"{name}: {value}\r\n".encode("latin-1", "replace") for name, value in headers)
        return kind, head + b"\r\n" + body, lying


async def fuzz_one(port: int, raw: bytes, wait_s: float) -> str:
    """Send one raw request and return the answer's status code (or why there is none)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    except (OSError, asyncio.TimeoutError) as err:
        return f"connect failed ({type(err).__name__})"
    try:
        writer.write(raw)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait_s)
        status = _status_of(head)
        return str(status) if status is not None else "unparseable answer"
    except asyncio.IncompleteReadError as err:
        return "closed without an answer" if not err.partial else "unparseable answer"
    except asyncio.TimeoutError:
        return "no answer in time"
    except (OSError, asyncio.LimitOverrunError) as err:
        return f"transport error ({type(err).__name__})"
    finally:
        writer.close()


async def run_fuzz(port: int, fuzzer: Fuzzer, count: int, timeout_s: float) -> dict:
    statuses: collections.Counter = collections.Counter()
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    server_errors = []
    queue = [fuzzer.request() for _ in range(count)]
    lying = sum(request[2] for request in queue)
    position = 0

    async def worker() -> None:
        nonlocal position
        while position < len(queue):
            kind, raw, _ = queue[position]
            position += 1
            status = await fuzz_one(port, raw, timeout_s + 10)
            statuses[status] += 1
            by_kind[kind][status] += 1
            if status.isdigit() and int(status) >= 500:
                server_errors.append({"status": status, "request_head": raw[:300].decode("latin-1")})

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(FUZZ_CONCURRENCY)))
    wall = time.perf_counter() - start
    answered_5xx = sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500)
    return {"requests": count, "concurrency": FUZZ_CONCURRENCY, "wall_s": wall, "declaring_more_body_than_sent": lying,
            "statuses": dict(sorted(statuses.items())), "answers_5xx": answered_5xx,
            "by_payload_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
            "first_5xx": server_errors[:10]}


# --- 4. idle connections over the connection cap -------------------------------------------------

async def health_once(port: int, wait_s: float) -> dict:
    """One ``GET /health`` on a new connection: its status, whether the body is JSON, the latency."""
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), wait_s)
    except (OSError, asyncio.TimeoutError) as err:
        return {"status": f"connect failed ({type(err).__name__})", "json": False, "latency_s": None}
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), wait_s)  # until the server closes
        status = _status_of(raw)
        try:
            json.loads(raw.partition(b"\r\n\r\n")[2])
            is_json = True
        except ValueError:
            is_json = False
        return {"status": str(status) if status is not None else "no answer", "json": is_json,
                "latency_s": time.perf_counter() - start}
    except asyncio.TimeoutError:
        return {"status": "no answer in time", "json": False, "latency_s": None}
    except OSError as err:
        return {"status": f"transport error ({type(err).__name__})", "json": False, "latency_s": None}
    finally:
        writer.close()


def summarise_polls(polls: list[dict]) -> dict:
    latencies = [p["latency_s"] for p in polls if p["status"] == "200"]
    return {"polls": len(polls), "ok": len(latencies), "statuses": dict(collections.Counter(p["status"] for p in polls)),
            "errors_with_json_body": sum(p["json"] for p in polls if p["status"] != "200" and p["latency_s"] is not None),
            "errors_answered": sum(p["status"] != "200" and p["latency_s"] is not None for p in polls),
            "p50_ms": float(np.median(latencies) * 1e3) if latencies else None,
            "max_ms": float(max(latencies) * 1e3) if latencies else None}


async def run_connection_cap(port: int, count: int, polls: int, timeout_s: float, rss: RssSampler) -> dict:
    """``count`` idle connections (half silent, half half a request line), then /health polled on new
    connections while they are held; how each idle one ended."""
    held = {"now": 0}

    async def idle(i: int) -> dict:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as err:
            return {"status": f"connect failed ({type(err).__name__})"}
        if i % 2:
            writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        held["now"] += 1
        try:
            raw = await asyncio.wait_for(reader.read(), timeout_s + 30)
            status, is_json = _status_of(raw), raw.partition(b"\r\n\r\n")[2][:1] == b"{"
            outcome = f"{status} {'JSON' if is_json else 'not JSON'}" if status else "closed without an answer"
        except asyncio.TimeoutError:
            outcome = "still open"
        except OSError as err:
            outcome = f"transport error ({type(err).__name__})"
        held["now"] -= 1
        writer.close()
        return {"status": outcome}

    rss.start_peak()
    tasks = [asyncio.create_task(idle(i)) for i in range(count)]
    while held["now"] + sum(t.done() for t in tasks) < count:  # every one connected (or failed)
        await asyncio.sleep(0.05)
    opened = held["now"]
    results = []
    for _ in range(polls):
        results.append({**await health_once(port, 30), "held": held["now"]})
        await asyncio.sleep(0.1)
    ends = collections.Counter(r["status"] for r in await asyncio.gather(*tasks))
    return {"connections": count, "held_when_polling_began": opened, "health": summarise_polls(results),
            "health_min_held_during_a_poll": min(r["held"] for r in results),
            "idle_connections_ended": dict(sorted(ends.items())), "peak_rss_bytes": rss.stop_peak()}


# --- 5. pipelining flood ------------------------------------------------------------------------

async def run_pipelining(port: int, count: int, depth: int, window_s: float) -> dict:
    """``count`` connections each writing ``depth`` pipelined ``GET /`` at once and reading the
    answers, while /health is polled every 0.25 s on new connections; the flood is stopped after
    ``window_s`` if the server has not ended it."""
    request = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * depth
    live = {"now": 0}
    done = asyncio.Event()

    async def flood() -> dict:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as err:
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

    async def poll() -> list[dict]:
        polls = []
        while not done.is_set():
            polls.append({**await health_once(port, window_s), "flooding": live["now"]})
            await asyncio.sleep(0.25)
        return polls

    start = time.perf_counter()
    poller = asyncio.create_task(poll())
    floods = [asyncio.create_task(flood()) for _ in range(count)]
    _, pending = await asyncio.wait(floods, timeout=window_s)
    for task in pending:
        task.cancel()
    results = [r if isinstance(r, dict) else {"answers": 0, "end": "window over"}
               for r in await asyncio.gather(*floods, return_exceptions=True)]
    wall = time.perf_counter() - start
    done.set()
    polls = await poller
    answers = [r["answers"] for r in results]
    during = [p for p in polls if p["flooding"] > 0]
    return {"connections": count, "pipelined_per_connection": depth, "window_s": window_s, "wall_s": wall,
            "ended_by_server_within_window": not pending, "answers_total": int(sum(answers)),
            "answers_per_connection_max": int(max(answers)), "answers_per_connection_median": float(np.median(answers)),
            "ends": dict(collections.Counter(r["end"] for r in results)),
            "health_during_flood": summarise_polls(during)}


# --- 6. clients that do not read ----------------------------------------------------------------

def held_by_server(pid: int, port: int, client_ports: set[int]) -> set[int]:
    """The client ports whose connection the server process still holds a socket for."""
    return {c.raddr.port for c in psutil.Process(pid).net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.raddr and c.raddr.port in client_ports}


async def run_slow_readers(port: int, pid: int, body: bytes, answer_bytes: int, count: int, window_s: float,
                           rss: RssSampler) -> dict:
    """``count`` connections that each send one request whose answer is larger than loopback's
    socket buffers take, and never read: when did the server let go of each (its socket gone from
    the server process), counted from the first byte of its answer (seen with select, not read)?

    Polled every 0.1 s. All clients send at once: the server renders each JSON answer in a worker
    thread (rendering them on the event loop, about 0.2 s each, delayed the deadline timers by
    whole renders: the last of 30 was dropped at 7.35 s). Observation ends ``window_s`` after the
    last answer began.
    """
    loop = asyncio.get_running_loop()
    request = (b"POST /infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
               b"Authorization: " + AUTH.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    rss.start_peak()
    sockets: list[socket.socket] = []
    answering, seen, closed = {}, set(), {}
    guard = time.perf_counter() + count * 30 + window_s  # a hang guard for a server that never answers
    while len(closed) < count and time.perf_counter() < guard:
        while len(sockets) < count:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the smallest window, set before connecting
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, request)
            sockets.append(sock)
        readable = select.select(sockets, [], [], 0)[0]  # the answer began to arrive (nothing is read)
        held = held_by_server(pid, port, {sock.getsockname()[1] for sock in sockets})
        now = time.perf_counter()
        for sock in readable:
            answering.setdefault(sock.getsockname()[1], now)
        seen |= held
        for client_port in (seen - held) & set(answering) - set(closed):  # seen held first: not yet accepted is not gone
            closed[client_port] = now - answering[client_port]
        if len(answering) == count and now - max(answering.values()) > window_s:
            break
        await asyncio.sleep(0.1)
    peak = rss.stop_peak()
    for sock in sockets:
        sock.close()
    times = sorted(closed.values())
    return {"connections": count, "window_s": window_s, "answer_bytes": answer_bytes, "answers_begun": len(answering),
            "closed": len(times), "held_at_end_of_window": count - len(times),
            "closed_after_s_median": float(np.median(times)) if times else None,
            "closed_after_s_max": times[-1] if times else None, "peak_rss_bytes": peak}


# --- RSS ---------------------------------------------------------------------------------------

class RssSampler:
    """RSS of the server process now, and its peak over a window (sampled every 50 ms)."""

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


def metrics_totals(url: str) -> dict:
    text = httpx.get(url + "/metrics", headers={"authorization": AUTH}, timeout=30).text
    totals: dict = {"requests": 0, "errors_by_code": {}}
    for line in text.splitlines():
        if line.startswith("edgetorch_split_requests_total"):
            totals["requests"] += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("edgetorch_split_errors_total"):
            code = line.split('code="', 1)[1].split('"', 1)[0]
            totals["errors_by_code"][code] = int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("edgetorch_split_connections_dropped_total"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            totals.setdefault("connections_dropped", {})[reason] = int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("edgetorch_split_inference_seconds_count"):
            totals["inferences"] = int(float(line.rsplit(" ", 1)[1]))
    return totals


def raise_fd_limit(needed: int) -> None:
    """Raise this process's soft open-file limit to ``needed`` (the server process inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise SystemExit(f"this benchmark holds {needed} sockets per process and the hard open-file limit is "
                             f"{hard}: raise it (ulimit -Hn) or pass smaller --idle / --pipeliners")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def start_server(artifacts: str, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-c", SERVER, artifacts, str(port), str(TIMEOUT_S), TOKEN])
    try:
        wait_until_up(f"http://127.0.0.1:{port}", server)
    except RuntimeError:
        server.terminate()
        raise
    return server


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=30)


def slow_reader_phase(artifacts: str, count: int) -> tuple[dict, dict]:
    """Phase 6, on its own server: a tail with WIDE_CLASSES logits, so one answer outgrows the
    socket buffers (the main model's largest answer does not)."""
    torch.manual_seed(0)
    wide = inject_bottleneck(build_model(ARCH, num_classes=WIDE_CLASSES), CHANNELS, "sp2").eval()
    manifest = save(wide, artifacts, RESOLUTION)
    body = encode(torch.randn(WIDE_BATCH, *manifest.bottleneck_shape))
    port = free_port()
    server = start_server(artifacts, port)
    try:
        url = f"http://127.0.0.1:{port}"
        answer = httpx.post(url + "/infer", content=body, timeout=120,
                            headers={"content-type": "application/octet-stream", "authorization": AUTH})
        answer.raise_for_status()
        slow = asyncio.run(run_slow_readers(port, server.pid, body, len(answer.content), count, 4 * TIMEOUT_S,
                                            RssSampler(server.pid)))
        slow["health_after"] = httpx.get(url + "/health", timeout=10).status_code
        return slow, metrics_totals(url)
    finally:
        stop(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz-requests", type=int, default=10_000)
    parser.add_argument("--stalled", type=int, default=STALLED)
    parser.add_argument("--idle", type=int, default=IDLE)
    parser.add_argument("--pipeliners", type=int, default=PIPELINERS)
    args = parser.parse_args()
    raise_fd_limit(max(args.stalled, args.idle, args.pipeliners) + 1024)
    torch.manual_seed(0)
    student = inject_bottleneck(build_model(ARCH, num_classes=10), CHANNELS, "sp2").eval()
    with tempfile.TemporaryDirectory() as artifacts, tempfile.TemporaryDirectory() as wide_artifacts:
        manifest = save(student, artifacts, RESOLUTION)
        shape = tuple(manifest.bottleneck_shape)
        body = encode(torch.randn(1, *shape))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(artifacts, port)
        try:
            rss = RssSampler(server.pid)
            asyncio.run(run_load(url, body, 1, 3))  # warm-up, not recorded
            memory = {"start": rss.now()}
            runs = [asyncio.run(run_load(url, body, c, m)) for c, m in LOADS]
            memory["after_load"] = rss.now()
            stall = asyncio.run(run_stall(url, port, body, args.stalled, TIMEOUT_S, rss))
            memory["peak_while_stalled"] = stall["peak_rss_bytes"]
            time.sleep(1.0)
            memory["after_stall"] = rss.now()
            fuzz = asyncio.run(run_fuzz(port, Fuzzer(0, shape, payload_size((64, *shape))), args.fuzz_requests, TIMEOUT_S))
            memory["after_fuzz"] = rss.now()
            health_after = httpx.get(url + "/health", timeout=10).status_code
            cap = asyncio.run(run_connection_cap(port, args.idle, 20, TIMEOUT_S, rss))
            memory["peak_with_idle_connections"] = cap["peak_rss_bytes"]
            pipelining = asyncio.run(run_pipelining(port, args.pipeliners, PIPELINED, PIPELINING_WINDOW_S))
            time.sleep(1.0)
            memory["after_pipelining"] = rss.now()
            server_counts = metrics_totals(url)
        finally:
            stop(server)
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
            stall["closed"] == stall["connections"] and stall["closed_after_s_max"] is not None
            and stall["closed_after_s_max"] <= stall["timeout_s"] + 1.0,
            f"{stall['closed']}/{stall['connections']} closed, the slowest {stall['closed_after_s_max']:.2f} s after "
            f"its last byte (deadline {stall['timeout_s']:g} s; 1 s allowed for closing 1,000 at once)"),
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
