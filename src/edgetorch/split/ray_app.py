"""The split tail server behind Ray Serve: N replicas, each building its own app from the artifact.

Why a builder and not the app: a FastAPI app that holds a loaded tail cannot cross Ray (Ray pickles
what it ships to replicas, and ``serve.ingress(app_from_dir(DIR))`` fails with ``cannot pickle
'ConfigModuleInstance'``). What crosses Ray here is plain data (the artifact path, a
:class:`~edgetorch.split.server.ServerConfig`, an optional key) inside a builder function that
Ray Serve calls once in each replica when it starts (``serve.ingress(builder)``, Ray Serve's
documented way to build an ASGI app in the replica). Each replica therefore loads and verifies the
artifact itself (:func:`~edgetorch.split.server.app_from_dir`): a replica never serves a tail it
did not check.

Ray is imported only when these functions are called: ``pip install 'edgetorch[ray]'``.

Example:
    >>> from edgetorch.split.ray_app import ray_app
    >>> from ray import serve  # doctest: +SKIP
    >>> serve.run(ray_app("r18_c12", replicas=2), route_prefix="/")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from .server import ServerConfig, app_from_dir

APP_NAME = "edgetorch-split"
DEPLOYMENT_NAME = "SplitTail"
_EXTRA_HINT = "pip install 'edgetorch[ray]'  (or: pip install 'ray[serve]')"


def _import_serve() -> Any:
    try:
        from ray import serve
    except ImportError as error:
        raise ImportError(f"the split server behind Ray Serve needs Ray Serve, which is not installed "
                          f"({error}); install it with: {_EXTRA_HINT}") from error
    return serve


def ray_app(artifact_dir: str | Path, config: ServerConfig = ServerConfig(), replicas: int = 1, *,
            key: bytes | str | None = None, num_cpus: float = 1.0, max_ongoing_requests: int | None = None) -> Any:
    """A Ray Serve application serving an artifact's tail from ``replicas`` replicas.

    Every replica calls :func:`~edgetorch.split.server.app_from_dir` itself when it starts, so the
    artifact is loaded and verified (hashes, manifest fields, and the HMAC when ``key`` is given)
    in each replica, and only the path, ``config`` and ``key`` are pickled by Ray. The replicas
    answer exactly as ``edgetorch split serve`` does: the same endpoints, token, error bodies and
    app-level limits (body size, batch, body deadline).

    Args:
        artifact_dir: an artifact directory written by :func:`~edgetorch.split.save`. It
            is made absolute here, and must exist at that path on every node that runs a replica.
        config: limits and token, as for ``edgetorch split serve``. Its protocol-level limits
            (header and write deadlines, connection and pipelining caps, header size, keep-alive)
            belong to the HTTP server, which under Ray is Ray's proxy: :func:`run` maps
            ``keep_alive_s`` onto it, the rest are not enforced (see ``docs/split_ray.md``).
        replicas: number of replicas (``num_replicas``), at least 1.
        key: the HMAC key of a signed artifact; each replica refuses an unsigned or altered one.
        num_cpus: CPUs Ray reserves for each replica (Ray also sets the replica's
            ``OMP_NUM_THREADS``, hence torch's thread count, from it).
        max_ongoing_requests: requests one replica takes at once before Ray queues the rest;
            ``None`` keeps Ray's default.

    Returns:
        A bound ``ray.serve`` application: run it with ``serve.run(app, route_prefix="/")``, or
        use :func:`run`.

    Raises:
        ImportError: Ray Serve is not installed (the message names the extra to install).
        ValueError: ``replicas`` or ``num_cpus`` out of range.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    if not isinstance(num_cpus, (int, float)) or not num_cpus >= 0:
        raise ValueError(f"num_cpus must be a number >= 0, got {num_cpus!r}")
    if not isinstance(config, ServerConfig):
        raise TypeError(f"config must be a ServerConfig, got {type(config).__name__}")
    serve = _import_serve()
    path = str(Path(artifact_dir).resolve())

    # A closure over plain data: Ray pickles it by value with the deployment class and calls it in
    # each replica's constructor. Nothing that holds a tensor or a module is captured.
    def build_tail_app() -> Any:
        return app_from_dir(path, config, key)

    options: dict[str, Any] = {"name": DEPLOYMENT_NAME, "num_replicas": replicas,
                               "ray_actor_options": {"num_cpus": num_cpus}}
    if max_ongoing_requests is not None:
        options["max_ongoing_requests"] = max_ongoing_requests
    deployment = serve.deployment(serve.ingress(build_tail_app)(), **options)
    return deployment.bind()


def start(artifact_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, replicas: int = 1,
          config: ServerConfig = ServerConfig(), *, key: bytes | str | None = None, num_cpus: float | None = None,
          num_cpus_per_replica: float = 1.0, ray_init: dict[str, Any] | None = None) -> Any:
    """Start a local Ray instance and Ray Serve with its HTTP proxy on ``host:port``, deploy
    :func:`ray_app` at ``/``, and return once every replica is running.

    The artifact is first loaded and verified here, in the calling process, so a broken or
    tampered artifact fails at once with :class:`~edgetorch.split.SplitArtifactError` instead of
    replicas failing one after another inside Ray.

    Args:
        artifact_dir, replicas, config, key: as for :func:`ray_app`.
        host, port: where Ray's HTTP proxy listens (``127.0.0.1`` serves loopback only).
            Ray's own services (GCS, raylet, object store, workers) listen on the node's address,
            not on ``host``: see ``docs/split_ray.md`` before running this on a networked machine.
        num_cpus: CPUs the local Ray instance may use (``None``: Ray counts the machine's).
        num_cpus_per_replica: CPUs reserved per replica.
        ray_init: more ``ray.init`` arguments (e.g. ``{"_temp_dir": "/tmp/r"}``).

    Returns:
        The deployment handle of the ingress (also usable without HTTP).
    """
    serve = _import_serve()
    _verify(artifact_dir, config, key)
    _init_ray(num_cpus, ray_init)
    return _deploy(serve, artifact_dir, host, port, replicas, config, key, num_cpus_per_replica)


def _verify(artifact_dir: str | Path, config: ServerConfig, key: bytes | str | None) -> None:
    """Load the artifact once here, so a broken one fails before Ray starts."""
    app_from_dir(Path(artifact_dir), config, key)


def _init_ray(num_cpus: float | None, ray_init: dict[str, Any] | None) -> None:
    import ray

    # Telemetry off unless the operator asked for it: a model server should not report home.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        ray.init(**{"num_cpus": num_cpus, "include_dashboard": False, **(ray_init or {})})


def _deploy(serve: Any, artifact_dir: str | Path, host: str, port: int, replicas: int, config: ServerConfig,
            key: bytes | str | None, num_cpus_per_replica: float) -> Any:
    app = ray_app(artifact_dir, config, replicas, key=key, num_cpus=num_cpus_per_replica)
    serve.start(http_options={"host": host, "port": port, "keep_alive_timeout_s": max(1, round(config.keep_alive_s))})
    return serve.run(app, name=APP_NAME, route_prefix="/")


def run(artifact_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, replicas: int = 1,
        config: ServerConfig = ServerConfig(), *, key: bytes | str | None = None, num_cpus: float | None = None,
        num_cpus_per_replica: float = 1.0, ray_init: dict[str, Any] | None = None) -> None:
    """:func:`start`, then serve until interrupted (Ctrl-C or SIGTERM), then shut Serve and Ray down.

    What ``edgetorch split serve --ray --replicas N`` calls. Arguments as for :func:`start`.
    """
    serve = _import_serve()  # first: without Ray it says how to install it
    import ray

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # Installed after ray.init, which replaces the SIGTERM handler with one that aborts the process
    # (skipping the shutdown below), and before the deployment, which takes seconds. Signal
    # handlers can only be set from the main thread.
    main = threading.current_thread() is threading.main_thread()
    original = signal.getsignal(signal.SIGTERM) if main else None
    try:
        _verify(artifact_dir, config, key)
        _init_ray(num_cpus, ray_init)
        if main:
            signal.signal(signal.SIGTERM, stop)
        _deploy(serve, artifact_dir, host, port, replicas, config, key, num_cpus_per_replica)
        print(f"serving {Path(artifact_dir)} with {replicas} Ray Serve replica(s) at http://{host}:{port}",
              flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            if ray.is_initialized():
                try:
                    serve.shutdown()
                finally:
                    ray.shutdown()
        finally:
            if main:
                signal.signal(signal.SIGTERM, original if original is not None else signal.SIG_DFL)
