"""A seeded fuzzer of raw HTTP requests to a tail server, and the phase that sends them.

Most requests are close enough to valid to reach the payload checks and the model (methods,
targets, versions, headers, framing and payloads each mostly right); the rest probe the HTTP
parser, routing and limits. The stream depends only on the seed, the bottleneck shape, the size
limit, the host and the token, so a run is reproducible request for request. A server should
answer every one with a status under 500 (or close it).
"""

from __future__ import annotations

import asyncio
import collections
import random
import struct
import time
import zlib
from dataclasses import dataclass

import torch

from ..tail_defaults import READ_TIMEOUT_S
from .loadgen import Target
from .payload import _CRC_AT, _STEPS_CRC_AT, STEPS_VERSION, encode
from .wire import MAX_RAW_ANSWER_BYTES, connect, status_of


def reseal(blob: bytes) -> bytes:
    """``blob`` with its payload CRC recomputed, as an encoder that lies on purpose would (a
    blob shorter than the fixed header is returned as it is). Version 3 keeps its CRC at bytes 6..9."""
    at = _STEPS_CRC_AT if len(blob) > 4 and blob[4] == STEPS_VERSION else _CRC_AT
    if len(blob) < at + 4:
        return blob
    crc = zlib.crc32(blob[at + 4:], zlib.crc32(blob[:at]))
    return blob[:at] + struct.pack("<I", crc) + blob[at + 4:]


class Fuzzer:
    """Seeded generator of raw HTTP requests, most of them close enough to valid to reach the
    payload checks and the model, the rest probing the HTTP parser, routing and limits.

    Args:
        seed: seeds both the choices and the payload tensors.
        shape: the server's bottleneck shape (without the batch).
        limit: the server's request size limit (some requests declare one byte more).
        host: the ``Host`` header most requests send.
        token: the bearer token most requests send (any placeholder for a server without one).

    Example:
        >>> fuzzer = Fuzzer(0, (12, 12, 12), payload_size((64, 12, 12, 12)))
        >>> kind, raw, lying = fuzzer.request()
    """

    def __init__(self, seed: int, shape: tuple[int, ...], limit: int, host: str = "127.0.0.1",
                 token: str = "edgetorch-probe"):
        self.rng, self.shape, self.limit = random.Random(seed), shape, limit
        self.generator = torch.Generator().manual_seed(seed)
        self.host, self.token = host, token

    def pick(self, common: list, rare: list, rare_share: float = 0.2):
        return self.rng.choice(rare) if self.rng.random() < rare_share else self.rng.choice(common)

    def text(self, size: int, alphabet: str = "") -> str:
        chars = alphabet or "".join(chr(c) for c in range(0x21, 0x7F))
        return "".join(self.rng.choice(chars) for _ in range(self.rng.randint(0, size)))

    def payload(self) -> tuple[str, bytes]:
        """One request body and what kind it is (valid, mutated, resealed, truncated, ...)."""
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
            return kind, reseal(bytes(blob)) if kind == "resealed" else bytes(blob)
        if kind == "truncated":
            return kind, valid[:rng.randrange(len(valid))]
        if kind == "wrong shape":
            dims = [rng.randint(1, 6) for _ in range(rng.randint(1, 5))]
            return kind, encode(torch.randn(*dims, generator=self.generator))
        if kind == "huge batch":  # a header declaring a batch far over the limit, CRC valid
            return kind, reseal(valid[:13] + struct.pack("<I", rng.choice([1025, 2**20, 2**32 - 1])) + valid[17:])
        if kind == "extreme scale":  # first scale replaced: 3e38 overflows float32 on decode
            at = 13 + 4 * (1 + len(self.shape))
            return kind, reseal(valid[:at] + struct.pack("<f", rng.choice([3e38, 1e30, float("inf"), -1.0]))
                                + valid[at + 4:])
        if kind == "garbage":
            return kind, bytes(rng.randrange(256) for _ in range(rng.randint(1, 3000)))
        return kind, b""

    def request(self) -> tuple[str, bytes, bool]:
        """One request: (kind of payload, raw bytes, whether it declares more body than it sends)."""
        rng = self.rng
        auth_value = f"Bearer {self.token}"
        method = self.pick(["POST"], ["GET", "PUT", "DELETE", "HEAD", "OPTIONS", "post", "P@ST", "", "BREW",
                                      "X" * 300])
        target = self.pick(["/infer"], ["/", "/health", "/metrics", "/docs", "/openapi.json", "/infer/", "*",
                                        f"http://{self.host}/infer", "/infer?x=" + self.text(20), "/%ff%00",
                                        "/" + self.text(40), "/" + "a" * 20000, "/../../etc/passwd"])
        version = self.pick(["HTTP/1.1"], ["HTTP/1.0", "HTTP/2", "HTTP/9.9", "HTCPCP/1.0", ""], 0.05)
        kind, body = self.payload()
        headers = [("Host", self.host)] if rng.random() < 0.95 else []
        headers.append(("Content-Type", self.pick(
            ["application/octet-stream", "APPLICATION/OCTET-STREAM", "application/octet-stream; q=1"],
            ["text/plain", "application/json", "", "application/octet-stream;;", self.text(30)])))
        auth = self.pick([auth_value, "bearer " + self.token], ["Bearer wrong", "Basic dXNlcjpwYXNz", "Bearer", "",
                                                                auth_value + " extra", self.text(40)])
        if rng.random() < 0.97:
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


async def fuzz_one(target: Target, raw: bytes, wait_s: float) -> str:
    """Send one raw request on a new connection; the answer's status code (or why there is none).
    Only the answer's head is read, at most :data:`~edgetorch.split.wire.MAX_RAW_ANSWER_BYTES` of it.
    Sending the request and reading that head have ``wait_s`` together: a server that reads
    nothing of a large request holds it no longer than one that never answers."""
    try:
        reader, writer = await connect(target)
    except (OSError, asyncio.TimeoutError) as err:
        return f"connect failed ({type(err).__name__})"

    async def send_and_read_head() -> bytes:
        writer.write(raw)
        await writer.drain()
        return await reader.readuntil(b"\r\n\r\n")

    try:
        head = await asyncio.wait_for(send_and_read_head(), wait_s)
        status = status_of(head)
        return str(status) if status is not None else "unparseable answer"
    except asyncio.IncompleteReadError as err:
        return "closed without an answer" if not err.partial else "unparseable answer"
    except asyncio.TimeoutError:
        return "no answer in time"
    except asyncio.LimitOverrunError:  # the reader's buffer limit, which is the cap
        return f"answer head over {MAX_RAW_ANSWER_BYTES:,} bytes"
    except OSError as err:
        return f"transport error ({type(err).__name__})"
    finally:
        writer.close()


@dataclass(frozen=True)
class FuzzConfig:
    """``requests`` fuzzed requests from seed ``seed``, ``concurrency`` at a time, one connection
    each; ``read_timeout_s`` is the server's body deadline (``ServerConfig.read_timeout_s``, whose
    default it is): each answer is waited for 10 s beyond it, as a request that declares more body
    than it sends is answered only then."""

    requests: int = 10_000
    seed: int = 0
    concurrency: int = 32
    read_timeout_s: float = READ_TIMEOUT_S


@dataclass
class FuzzResult:
    """Answers by status (or why there was none), overall and by kind of payload; the answers of
    500 or more, and the first ten such requests' heads."""

    requests: int
    concurrency: int
    wall_s: float
    declaring_more_body_than_sent: int
    statuses: dict[str, int]
    answers_5xx: int
    by_payload_kind: dict[str, dict[str, int]]
    first_5xx: list[dict]


async def _fuzz(target: Target, fuzzer: Fuzzer, config: FuzzConfig) -> FuzzResult:
    statuses: collections.Counter = collections.Counter()
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    server_errors = []
    queue = [fuzzer.request() for _ in range(config.requests)]
    lying = sum(request[2] for request in queue)
    position = 0

    async def worker() -> None:
        nonlocal position
        while position < len(queue):
            kind, raw, _ = queue[position]
            position += 1
            status = await fuzz_one(target, raw, config.read_timeout_s + 10)
            statuses[status] += 1
            by_kind[kind][status] += 1
            if status.isdigit() and int(status) >= 500:
                server_errors.append({"status": status, "request_head": raw[:300].decode("latin-1")})

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(config.concurrency)))
    wall = time.perf_counter() - start
    answered_5xx = sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500)
    return FuzzResult(config.requests, config.concurrency, wall, lying, dict(sorted(statuses.items())), answered_5xx,
                      {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())}, server_errors[:10])


def run_fuzz(target: Target, shape: tuple[int, ...], limit: int, config: FuzzConfig = FuzzConfig()) -> FuzzResult:
    """Send ``config.requests`` requests from a :class:`Fuzzer` seeded with ``config.seed``.

    Args:
        target: the server (its host and token go into the requests).
        shape: its bottleneck shape (``GET /`` tells it).
        limit: its request size limit in bytes.
        config: how many, how many at a time, the seed and the body deadline.

    Returns:
        A :class:`FuzzResult`; ``answers_5xx`` should be 0.

    Example:
        >>> run_fuzz(Target.from_url(url), (12, 12, 12), 1 << 20, FuzzConfig(requests=200)).answers_5xx  # doctest: +SKIP
        0
    """
    fuzzer = Fuzzer(config.seed, shape, limit, target.host, target.token or "edgetorch-probe")
    return asyncio.run(_fuzz(target, fuzzer, config))
