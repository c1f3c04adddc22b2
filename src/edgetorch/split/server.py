"""The edge server: an ASGI app that runs the tail on bottleneck payloads.

Why FastAPI on an ASGI server (uvicorn): ASGI is the standard Python web-server interface, so the
same app runs under ``uvicorn --workers N``, gunicorn with uvicorn workers, or behind Ray Serve's
FastAPI ingress without changes; FastAPI gives JSON errors and request routing without code of
our own, and runs the (blocking) tail in its thread pool so the event loop keeps accepting.

Endpoints:

* ``GET /``: health and model info (arch, channels, bottleneck shape, limits).
* ``POST /infer``: body ``application/octet-stream`` = a :func:`edgetorch.split.payload.encode`
  payload of a [N, *bottleneck_shape] tensor; answers ``{"logits": [[...], ...], "timing": {...}}``.

Every bad request gets a 4xx JSON ``{"error": "..."}`` and the server keeps serving: 401 missing or
wrong bearer token, 411/413 missing or over-limit size, 415 wrong content type, 400 malformed
payload, 422 a valid payload of the wrong shape.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from torch import nn

from .export import SplitManifest, load_part
from .payload import PayloadError, decode, payload_size

CONTENT_TYPE = "application/octet-stream"


@dataclass(frozen=True)
class ServerConfig:
    """Server limits and access.

    Attributes:
        max_payload_bytes: larger request bodies are refused with 413 before being read in full.
            Default: a batch of 64 bottlenecks (set from the manifest when ``None``).
        token: if set, requests need ``Authorization: Bearer <token>`` (health stays open).
    """

    max_payload_bytes: int | None = None
    token: str | None = None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(tail: nn.Module, manifest: SplitManifest, config: ServerConfig = ServerConfig()) -> FastAPI:
    """Build the ASGI app serving ``tail``.

    Args:
        tail: the server-side module (bottleneck -> logits), in eval mode (an exported program is).
        manifest: the artifact's manifest (bottleneck shape, model info).
        config: limits and token.

    Returns:
        A FastAPI app; run it with ``uvicorn.run(app, ...)`` or test it with ``TestClient(app)``.

    Example:
        >>> tail, manifest = load_part("artifacts", "tail")  # doctest: +SKIP
        >>> uvicorn.run(create_app(tail, manifest), host="127.0.0.1", port=8000)  # doctest: +SKIP
    """
    limit = config.max_payload_bytes or payload_size((64, *manifest.bottleneck_shape))
    app = FastAPI(title="edgetorch split tail server")

    def authorised(request: Request) -> bool:
        if config.token is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {config.token}".encode())

    @app.get("/")
    def health() -> dict:
        return {"status": "ok", "arch": manifest.arch, "channels": manifest.channels,
                "split_point": manifest.split_point, "bottleneck_shape": list(manifest.bottleneck_shape),
                "num_classes": manifest.num_classes, "payload_format": manifest.payload_format,
                "max_payload_bytes": limit, "auth": config.token is not None}

    @app.post("/infer")
    async def infer(request: Request) -> JSONResponse:
        if not authorised(request):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        content_type = request.headers.get("content-type", "").split(";")[0].strip()
        if content_type != CONTENT_TYPE:
            return _error(415, f"content type must be {CONTENT_TYPE}, got {content_type or 'none'!r}")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return _error(413, f"payload of {declared} bytes exceeds the limit of {limit} bytes")
        body = bytearray()
        async for chunk in request.stream():  # bounded even when Content-Length lies or is absent
            body += chunk
            if len(body) > limit:
                return _error(413, f"payload exceeds the limit of {limit} bytes")
        start = time.perf_counter()
        try:
            bottleneck = decode(bytes(body), max_bytes=limit)
        except PayloadError as exc:
            return _error(400, f"malformed payload: {exc}")
        if tuple(bottleneck.shape[1:]) != manifest.bottleneck_shape:
            return _error(422, f"payload shape {list(bottleneck.shape)} does not match this model's "
                               f"bottleneck [N, {', '.join(map(str, manifest.bottleneck_shape))}]")
        decoded = time.perf_counter()
        logits = await run_in_threadpool(_run_tail, tail, bottleneck.float())
        done = time.perf_counter()
        return JSONResponse({"logits": logits.tolist(),
                             "timing": {"decode_s": decoded - start, "tail_s": done - decoded}})

    return app


def _run_tail(tail: nn.Module, bottleneck: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return tail(bottleneck)


def app_from_dir(artifact_dir: str | Path, config: ServerConfig = ServerConfig()) -> FastAPI:
    """Load a verified tail from an artifact directory and build the app (see :func:`create_app`)."""
    tail, manifest = load_part(artifact_dir, "tail")
    return create_app(tail, manifest, config)


@contextmanager
def serve_in_background(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run ``app`` under uvicorn in a daemon thread for the ``with`` block; yields its base URL.

    ``port=0`` binds a free port (the socket is bound here, so there is no race for it). Used by
    the demo, the load test and the tests; ``edgetorch split serve`` runs uvicorn in the foreground.

    Example:
        >>> with serve_in_background(app) as url:  # doctest: +SKIP
        ...     httpx.get(url).json()["status"]
        'ok'
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background uvicorn server did not start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
