"""Polite clients of a deployed tail server: concurrent keep-alive load with latency percentiles,
and the server's own counters read from ``/metrics``.

Point them at your own deployment to see what it sustains end to end (a reverse proxy in front
changes both); :mod:`edgetorch.split.probe` has the hostile clients. Every client here speaks
through httpx; the address and token come in a :class:`Target`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import numpy as np


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


@dataclass(frozen=True)
class LoadConfig:
    """``clients`` concurrent clients, each sending ``requests`` back to back over one keep-alive
    connection; ``timeout_s`` guards each request against a hang."""

    clients: int = 32
    requests: int = 100
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.clients < 1 or self.requests < 1 or not self.timeout_s > 0:
            raise ValueError(f"LoadConfig needs clients >= 1, requests >= 1 and timeout_s > 0, got {self}")


@dataclass
class LoadResult:
    """What :func:`run_load` measured. Errors: any answer but a 200 with one row of logits per
    sample, or a transport failure. Latencies are client-side round trips, in milliseconds;
    ``server_p50_ms`` is the median of the server's own decode + tail time."""

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


async def _one_client(target: Target, payload: bytes, config: LoadConfig) -> tuple[list[float], list[float], int]:
    latencies, server_times, errors = [], [], 0
    headers = {"content-type": "application/octet-stream", **({"authorization": target.auth} if target.token else {})}
    async with httpx.AsyncClient(base_url=target.url, timeout=config.timeout_s, headers=headers) as client:
        for _ in range(config.requests):
            start = time.perf_counter()
            try:
                answer = await client.post("/infer", content=payload)
                ok = answer.status_code == 200 and len(answer.json()["logits"]) == 1
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - start)
            errors += not ok
            if ok:
                server_times.append(sum(answer.json()["timing"].values()))
    return latencies, server_times, errors


async def _load(target: Target, payload: bytes, config: LoadConfig) -> LoadResult:
    start = time.perf_counter()
    results = await asyncio.gather(*(_one_client(target, payload, config) for _ in range(config.clients)))
    wall = time.perf_counter() - start
    latencies = np.array([t for lat, _, _ in results for t in lat])
    server = np.array([t for _, times, _ in results for t in times])
    return LoadResult(config.clients, config.requests, int(latencies.size), int(sum(e for _, _, e in results)), wall,
                      float(np.median(server) * 1e3) if server.size else None, latencies.size / wall,
                      *(float(np.percentile(latencies, q) * 1e3) for q in (50, 90, 99)), float(latencies.max() * 1e3))


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
        timeout_s: hang guard of the request.

    Returns:
        ``{"requests": n, "errors_by_code": {code: n}, "connections_dropped": {reason: n},
        "inferences": n}``; the last two only when the server reported them.

    Raises:
        httpx.HTTPError: the server could not be reached.
    """
    headers = {"authorization": target.auth} if target.token else {}
    samples = read_metrics(httpx.get(target.url + "/metrics", headers=headers, timeout=timeout_s).text)
    totals: dict = {"requests": 0, "errors_by_code": {}}
    for sample, value in samples.items():
        if sample.startswith("edgetorch_split_requests_total"):
            totals["requests"] += int(value)
        elif sample.startswith("edgetorch_split_errors_total"):
            totals["errors_by_code"][_label(sample, "code")] = int(value)
        elif sample.startswith("edgetorch_split_connections_dropped_total"):
            totals.setdefault("connections_dropped", {})[_label(sample, "reason")] = int(value)
        elif sample.startswith("edgetorch_split_inference_seconds_count"):
            totals["inferences"] = int(value)
    return totals
