"""Polite clients of a deployed tail server: concurrent keep-alive load with latency percentiles,
and the server's own counters read from ``/metrics``.

Point them at your own deployment to see what it sustains end to end (a reverse proxy in front
changes both); :mod:`edgetorch.split.probe` has the hostile clients. Every client here speaks
through httpx; the address and token come in a :class:`Target`.

Every answer is read raw, at most :data:`MAX_ANSWER_BYTES` of it, and whole within one deadline
(:func:`exchange`): a probe is pointed at servers that may be broken or hostile, and one that
answers without end must not make it allocate without end, nor one that answers a byte at a time
make it wait without end. A longer or later answer is an :class:`AnswerError` (a counted error
under load).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from ..errors import EdgetorchError

# The longest answer a client here reads. A batch-1 /infer answer is about 22 bytes a class (a
# 21,841-class ImageNet-21k tail: ~0.5 MB), /metrics and GET / a few KB.
MAX_ANSWER_BYTES = 4 << 20
# The largest payload the probe builds from a server's own GET / claims (the fuzzer batches up to 8
# of them): a server states its shape and its limit, so both could be hostile.
MAX_PROBE_PAYLOAD_BYTES = 16 << 20
# Asked of every server: the cap is on the bytes that arrive, so a compressed answer could not be
# checked against it until inflated. A body that comes compressed anyway is not JSON: an error.
_IDENTITY = {"accept-encoding": "identity"}


class AnswerError(EdgetorchError, ValueError):
    """A server's answer that the probe clients cannot use: longer than :data:`MAX_ANSWER_BYTES`,
    an error status where a 200 was needed, or not the body a tail server sends.

    Args:
        message: what was wrong, and what is accepted.
        kind: the short name reports count it under (a status code, ``"answer over N bytes"``, ...).
    """

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Target:
    """A tail server to probe.

    Args:
        host: its address (a name or an IPv4/IPv6 literal).
        port: its port.
        token: the bearer token it requires, if any (sent as ``Authorization: Bearer <token>``).
        server_pid: the server's process id when it runs on this machine: the hostile phases then
            record its RSS peaks, and the phase of clients that never read can run (it watches
            the process's sockets). ``None`` for a remote server.

    Example:
        >>> Target.from_url("http://127.0.0.1:8000", token="s3cret").auth
        'Bearer s3cret'
    """

    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    server_pid: int | None = None

    @classmethod
    def from_url(cls, url: str, token: str | None = None, server_pid: int | None = None) -> Target:
        """The target at ``url`` (``http://host[:port]``; the raw-socket clients speak plain HTTP).

        Raises:
            ValueError: ``url`` is not an ``http://`` URL with a host.
        """
        parsed = httpx.URL(url)
        if parsed.scheme != "http" or not parsed.host:
            raise ValueError(f"a probe target must be an http://host[:port] URL, got {url!r} (https is not "
                             "accepted: probe the plain-HTTP address behind the TLS terminator, or the proxy's own)")
        return cls(parsed.host, parsed.port or 80, token, server_pid)

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:8000``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def auth(self) -> str | None:
        """The ``Authorization`` header value, or ``None`` without a token."""
        return None if self.token is None else f"Bearer {self.token}"

    @property
    def headers(self) -> dict[str, str]:
        """The headers every polite client here sends: no compression, and the token if there is one."""
        return {**_IDENTITY, **({"authorization": self.auth} if self.token else {})}


async def _read_capped(answer: httpx.Response, limit: int) -> bytes:
    """The body of a streamed answer as it arrived, at most ``limit`` bytes (reading stops at the
    chunk that passes it: an :class:`AnswerError`). No deadline of its own: :func:`exchange` sets it."""
    body = bytearray()
    async for chunk in answer.aiter_raw():
        body += chunk
        if len(body) > limit:
            raise AnswerError(f"{answer.request.method} {answer.request.url.path} answered more than {limit:,} bytes "
                              f"(status {answer.status_code}); the probe reads at most that", f"answer over {limit:,} bytes")
    return bytes(body)


async def exchange(client: httpx.AsyncClient, method: str, path: str, timeout_s: float,
                   **request: Any) -> tuple[int, bytes]:
    """``method path`` on ``client``, and its answer read whole within ``timeout_s`` of sending.

    One deadline for the request and every byte of its answer: httpx's own timeout limits each
    read, not the whole, so under it a server that sends a byte every 29 s holds a 30 s guard for
    as long as the answer is (up to :data:`MAX_ANSWER_BYTES` reads). Make ``client`` with
    ``timeout=None``: this deadline is then the only one, and every late answer is counted alike.

    Args:
        client: the client to send on (its base URL and headers apply).
        method: e.g. ``"GET"``.
        path: e.g. ``"/health"``.
        timeout_s: seconds for the request and its whole answer.
        **request: passed to ``client.stream`` (e.g. ``content=``).

    Returns:
        (status code, body): at most :data:`MAX_ANSWER_BYTES` of body, as it arrived.

    Raises:
        httpx.HTTPError: the server could not be reached or broke the connection.
        AnswerError: the body is longer than :data:`MAX_ANSWER_BYTES`, or the answer was not whole
            within ``timeout_s`` (``kind``: ``"no whole answer within N s"``).

    Example:
        >>> async with httpx.AsyncClient(base_url=url, timeout=None) as client:  # doctest: +SKIP
        ...     status, body = await exchange(client, "GET", "/health", 10.0)
    """
    async def whole() -> tuple[int, bytes]:
        async with client.stream(method, path, **request) as answer:
            return answer.status_code, await _read_capped(answer, MAX_ANSWER_BYTES)

    try:
        return await asyncio.wait_for(whole(), timeout_s)
    except asyncio.TimeoutError:
        raise AnswerError(f"{method} {path} was not answered in full within {timeout_s:g} s (the probe's deadline "
                          "for a request and its whole answer, however steadily the bytes come)",
                          f"no whole answer within {timeout_s:g} s") from None


async def _get(target: Target, path: str, timeout_s: float) -> tuple[int, bytes]:
    async with httpx.AsyncClient(base_url=target.url, timeout=None, headers=target.headers) as client:
        return await exchange(client, "GET", path, timeout_s)


def get(target: Target, path: str, timeout_s: float = 30.0) -> tuple[int, bytes]:
    """``GET path`` (with the target's token): the status and the body, at most
    :data:`MAX_ANSWER_BYTES` of it, whole within ``timeout_s``.

    Args:
        target: the server.
        path: e.g. ``"/"`` or ``"/health"``.
        timeout_s: seconds for the request and its whole answer (connecting included).

    Returns:
        (status code, body).

    Raises:
        httpx.HTTPError: the server could not be reached or broke the connection.
        AnswerError: the body is longer than :data:`MAX_ANSWER_BYTES`, or the answer was not whole
            within ``timeout_s``.

    Example:
        >>> status, body = get(Target.from_url(url), "/")  # doctest: +SKIP
        >>> json.loads(body)["bottleneck_shape"]  # doctest: +SKIP
        [12, 12, 12]
    """
    return asyncio.run(_get(target, path, timeout_s))


@dataclass(frozen=True)
class LoadConfig:
    """``clients`` concurrent clients, each sending ``requests`` back to back over one keep-alive
    connection; a request whose answer is not whole within ``timeout_s`` of sending it is a
    counted error (``"no whole answer within N s"``)."""

    clients: int = 32
    requests: int = 100
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.clients < 1 or self.requests < 1 or not self.timeout_s > 0:
            raise ValueError(f"LoadConfig needs clients >= 1, requests >= 1 and timeout_s > 0, got {self}")


@dataclass
class LoadResult:
    """What :func:`run_load` measured. Errors: any answer but a 200 with one row of logits and
    the server's timing, or a transport failure; ``errors_by_kind`` counts them by status code,
    transport error or what was wrong with the answer. Latencies are client-side round trips, in
    milliseconds; ``server_p50_ms`` is the median of the server's own decode + tail time."""

    clients: int
    requests_per_client: int
    requests: int
    errors: int
    wall_s: float
    server_p50_ms: float | None
    throughput_rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    errors_by_kind: dict[str, int]


def _server_seconds(status: int, body: bytes) -> float:
    """The server's decode + tail seconds from a batch-1 ``/infer`` answer.

    Raises:
        AnswerError: not a 200, or not ``{"logits": [one row], "timing": {stage: seconds}}``.
    """
    if status != 200:
        raise AnswerError(f"POST /infer answered {status}: {body[:200]!r}", str(status))
    try:
        answer = json.loads(body)
        if len(answer["logits"]) != 1:
            raise ValueError(f"{len(answer['logits'])} rows of logits")
        return sum(float(seconds) for seconds in answer["timing"].values())
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as err:  # UnicodeDecodeError: a ValueError
        raise AnswerError(f"POST /infer answered 200 but not with one row of logits and the timing "
                          f"({type(err).__name__}: {err}): {body[:200]!r}", "200 not the expected JSON") from None


async def _one_client(target: Target, payload: bytes, config: LoadConfig) -> tuple[list[float], list[float], list[str]]:
    latencies, server_times, errors = [], [], []
    headers = {"content-type": "application/octet-stream", **target.headers}
    async with httpx.AsyncClient(base_url=target.url, timeout=None, headers=headers) as client:
        for _ in range(config.requests):
            start = time.perf_counter()
            try:
                status, body = await exchange(client, "POST", "/infer", config.timeout_s, content=payload)
                server_times.append(_server_seconds(status, body))
            except httpx.HTTPError as err:
                errors.append(type(err).__name__)
            except AnswerError as err:
                errors.append(err.kind)
            latencies.append(time.perf_counter() - start)
    return latencies, server_times, errors


async def _load(target: Target, payload: bytes, config: LoadConfig) -> LoadResult:
    start = time.perf_counter()
    results = await asyncio.gather(*(_one_client(target, payload, config) for _ in range(config.clients)))
    wall = time.perf_counter() - start
    latencies = np.array([t for lat, _, _ in results for t in lat])
    server = np.array([t for _, times, _ in results for t in times])
    errors = collections.Counter(kind for _, _, kinds in results for kind in kinds)
    return LoadResult(config.clients, config.requests, int(latencies.size), sum(errors.values()), wall,
                      float(np.median(server) * 1e3) if server.size else None, latencies.size / wall,
                      *(float(np.percentile(latencies, q) * 1e3) for q in (50, 90, 99)), float(latencies.max() * 1e3),
                      dict(sorted(errors.items())))


def run_load(target: Target, payload: bytes, config: LoadConfig = LoadConfig()) -> LoadResult:
    """Concurrent clients sending ``payload`` to ``POST /infer`` back to back, one keep-alive
    connection each.

    Args:
        target: the server.
        payload: one batch-1 request body (:func:`edgetorch.split.payload.encode` of a bottleneck
            of the server's shape, ``GET /`` tells it).
        config: how many clients and requests.

    Returns:
        A :class:`LoadResult`: error count, throughput and latency percentiles.

    Example:
        >>> body = encode(torch.randn(1, *httpx.get(url + "/").json()["bottleneck_shape"]))  # doctest: +SKIP
        >>> run_load(Target.from_url(url), body, LoadConfig(clients=2, requests=5)).errors  # doctest: +SKIP
        0
    """
    return asyncio.run(_load(target, payload, config))


def read_metrics(text: str) -> dict[str, float]:
    """The samples of a Prometheus text exposition, by their name and labels.

    Example:
        >>> read_metrics('# TYPE x counter\\nx{code="200"} 3\\n')
        {'x{code="200"}': 3.0}
    """
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _label(sample: str, name: str) -> str:
    return sample.split(f'{name}="', 1)[1].split('"', 1)[0]


def metrics_totals(target: Target, timeout_s: float = 30.0) -> dict:
    """The server's own counters from ``GET /metrics``: answered requests, errors by status code,
    dropped connections by reason and inferences run.

    Args:
        target: the server (its token, if it has one, opens ``/metrics``).
        timeout_s: seconds for the request and its whole answer.

    Returns:
        ``{"requests": n, "errors_by_code": {code: n}, "connections_dropped": {reason: n},
        "inferences": n}``; the last two only when the server reported them.

    Raises:
        httpx.HTTPError: the server could not be reached.
        AnswerError: it answered other than 200 (a wrong or missing token: 401), more than
            :data:`MAX_ANSWER_BYTES`, not whole within ``timeout_s``, or not with the counters of
            an edgetorch split server.
    """
    status, body = get(target, "/metrics", timeout_s)
    if status != 200:
        raise AnswerError(f"GET /metrics answered {status}, not 200: {body[:200]!r} (a server with a token "
                          "needs it for /metrics: Target(token=...))", str(status))
    totals: dict = {"requests": 0, "errors_by_code": {}}
    try:
        for sample, value in read_metrics(body.decode()).items():
            if sample.startswith("edgetorch_split_requests_total"):
                totals["requests"] += int(value)
            elif sample.startswith("edgetorch_split_errors_total"):
                totals["errors_by_code"][_label(sample, "code")] = int(value)
            elif sample.startswith("edgetorch_split_connections_dropped_total"):
                totals.setdefault("connections_dropped", {})[_label(sample, "reason")] = int(value)
            elif sample.startswith("edgetorch_split_inference_seconds_count"):
                totals["inferences"] = int(value)
    except (ValueError, IndexError, OverflowError) as err:  # UnicodeDecodeError is a ValueError
        raise AnswerError(f"GET /metrics answered 200 but not with a Prometheus text exposition of an edgetorch "
                          f"split server ({type(err).__name__}: {err}): {body[:200]!r}", "200 not the metrics") from None
    return totals
