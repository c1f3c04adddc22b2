"""Load test of the split tail server on loopback: N concurrent clients x M requests each.

The server (uvicorn, one worker, in its own process as it would be deployed) serves the tail of a
resnet18 split at SP2 with C = 12 at 96 px (random weights: the time of a dense CNN does not depend
on them). Each client sends batch-1 8-bit payloads back to back over one keep-alive connection.
Recorded: errors (any non-200 or transport failure), throughput, and latency percentiles.

Run: ``.venv/bin/python bench/split_loadtest.py``
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import torch

from _common import table, write_results
from edgetorch.split.bottleneck import inject_bottleneck
from edgetorch.split.export import export_model
from edgetorch.split.payload import encode
from edgetorch.zoo import build_model

ARCH, CHANNELS, RESOLUTION = "torchvision:resnet18", 12, 96
LOADS = ((1, 30), (4, 15), (16, 5), (1, 30))  # (clients, requests per client); 1 again: drift check

SERVER = """
import sys, uvicorn
from edgetorch.split.server import app_from_dir
uvicorn.run(app_from_dir(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
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
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("the server did not come up")


async def one_client(url: str, body: bytes, requests: int) -> tuple[list[float], list[float], int]:
    latencies, server_times, errors = [], [], 0
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 headers={"content-type": "application/octet-stream"}) as client:
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
            **{f"p{q}_ms": float(np.percentile(latencies, q) * 1e3) for q in (50, 90, 95, 99)},
            "max_ms": float(latencies.max() * 1e3)}


def main() -> None:
    torch.manual_seed(0)
    student = inject_bottleneck(build_model(ARCH, num_classes=10), CHANNELS, "sp2").eval()
    with tempfile.TemporaryDirectory() as artifacts:
        manifest = export_model(student, artifacts, RESOLUTION)
        body = encode(torch.randn(1, *manifest.bottleneck_shape))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-c", SERVER, artifacts, str(port)])
        try:
            wait_until_up(url, server)
            asyncio.run(run_load(url, body, 1, 3))  # warm-up, not recorded
            runs = [asyncio.run(run_load(url, body, c, m)) for c, m in LOADS]
        finally:
            server.terminate()
            server.wait(timeout=30)
    rows = [(r["clients"], r["requests_per_client"], r["requests"], r["errors"], f"{r['throughput_rps']:.1f}",
             f"{r['p50_ms']:.1f}", f"{r['p90_ms']:.1f}", f"{r['p95_ms']:.1f}", f"{r['p99_ms']:.1f}",
             f"{r['max_ms']:.1f}", f"{r['server_p50_ms']:.1f}") for r in runs]
    body_md = (
        f"Tail of {ARCH} split at SP2, C = {CHANNELS}, {RESOLUTION} px input (bottleneck "
        f"{list(manifest.bottleneck_shape)}, payload {len(body):,} bytes per request, batch 1), served by "
        "one uvicorn worker in a separate process on 127.0.0.1; clients are asyncio httpx connections "
        "in this process sending back to back. The machine is shared with other jobs, so absolute "
        "numbers vary run to run; the error count is the result that must hold.\n\n"
        + table(["clients", "requests/client", "requests", "errors", "throughput req/s", "p50 ms",
                 "p90 ms", "p95 ms", "p99 ms", "max ms", "server p50 ms (decode + tail)"], rows)
        + "\n\nThe last row repeats the first, so the difference between them is drift of the shared "
        "machine's load during the run; latency minus the server's own time is the HTTP and client overhead. "
        "One uvicorn worker: FastAPI runs each request's tail in its thread pool, so concurrent "
        "requests share the machine's cores; scale out with `uvicorn --workers` or more server processes."
    )
    write_results("split_loadtest", "Split runtime: tail server load test on loopback", body_md,
                  {"arch": ARCH, "channels": CHANNELS, "resolution": RESOLUTION,
                   "payload_bytes": len(body), "runs": runs})
    if any(r["errors"] for r in runs):
        raise SystemExit("the load test saw errors")


if __name__ == "__main__":
    main()
