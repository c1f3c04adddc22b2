"""A tail server in its own process on this machine, as it would be deployed, for the clients of
:mod:`edgetorch.split.loadgen`, :mod:`~edgetorch.split.probe` and :mod:`~edgetorch.split.fuzz`.

A server in a thread of the measuring process (:func:`edgetorch.split.protocol.serve_in_background`)
shares its interpreter, its memory and its open-file limit with the clients; one in its own process
has its own RSS to sample (:class:`edgetorch.split.probe.RssSampler`) and its own sockets to watch
(:func:`edgetorch.split.probe.run_slow_readers`). The child inherits this process's environment and
resource limits: raise the open-file limit (:func:`raise_open_file_limit`) before starting it if the
clients will hold many connections.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from ..errors import EdgetorchError
from .loadgen import AnswerError, Target, get

_SERVER = """
import os, sys, uvicorn
from edgetorch.split.protocol import uvicorn_config
from edgetorch.split.server import ServerConfig, app_from_dir
timeout = float(sys.argv[3])
config = ServerConfig(token=os.environ.pop("EDGETORCH_SPLIT_TOKEN"), header_timeout_s=timeout, read_timeout_s=timeout, write_timeout_s=timeout)
app = app_from_dir(sys.argv[1], config)
uvicorn.Server(uvicorn_config(app, "127.0.0.1", int(sys.argv[2]), log_level="warning", access_log=False)).run()
"""


class ServerStartError(EdgetorchError, RuntimeError):
    """The server process exited, or did not answer ``/health``, before it was up."""


class OpenFileLimitError(EdgetorchError, OSError):
    """The hard open-file limit is below the file descriptors one process needs."""


def raise_open_file_limit(needed: int) -> None:
    """Raise this process's soft open-file limit to ``needed`` where it is lower (a server started
    afterwards inherits it).

    Args:
        needed: the file descriptors one process will hold, sockets included.

    Raises:
        OpenFileLimitError: the hard limit is lower than ``needed``; only an administrator can raise it.

    Example:
        >>> raise_open_file_limit(4096)  # before serve_in_process, for 3,000 held connections  # doctest: +SKIP
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise OpenFileLimitError(f"{needed} open files are needed per process and the hard open-file limit is "
                                     f"{hard}: raise it (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_up(target: Target, process: subprocess.Popen, startup_s: float) -> None:
    """Poll ``/health`` until it answers 200, sleeping 0.05 s, then twice as long each time (up to
    1 s): a server that answers 503 while it loads is not asked hundreds of times a second.

    Raises:
        ServerStartError: the process exited, or no 200 came within ``startup_s`` (the last
            answer or error is named).
    """
    deadline = time.monotonic() + startup_s
    pause = 0.05
    while True:
        if process.poll() is not None:
            raise ServerStartError(f"the server process exited with code {process.returncode} before it was up")
        try:
            status, _ = get(target, "/health", timeout_s=1.0)
            if status == 200:
                return
            last = f"it answered {status}"
        except (httpx.HTTPError, AnswerError) as err:
            last = f"{type(err).__name__}: {err}"
        left = deadline - time.monotonic()
        if left <= 0:
            raise ServerStartError(f"the server did not answer {target.url}/health with 200 within {startup_s:g} s "
                                   f"(last try: {last})")
        time.sleep(min(pause, left))
        pause = min(2 * pause, 1.0)


@contextmanager
def serve_in_process(artifacts: str | Path, token: str, timeout_s: float, startup_s: float = 120.0) -> Iterator[Target]:
    """Serve the exported tail in ``artifacts`` (uvicorn, one worker) in a new process on a free
    loopback port for the ``with`` block; the process is terminated at its end.

    Args:
        artifacts: a directory written by :func:`edgetorch.split.export.save`.
        token: the bearer token the server requires.
        timeout_s: the server's header, body and write deadlines (``ServerConfig``'s
            ``header_timeout_s``, ``read_timeout_s`` and ``write_timeout_s``); every other setting
            is ``ServerConfig``'s default.
        startup_s: how long to wait for ``/health`` to answer 200.

    Yields:
        The server as a :class:`~edgetorch.split.loadgen.Target`, with its process id.

    Raises:
        ServerStartError: the process exited or did not answer within ``startup_s``.

    Example:
        >>> with serve_in_process("artifacts", "s3cret", 5.0) as target:  # doctest: +SKIP
        ...     run_load(target, body, LoadConfig(32, 100))
    """
    port = _free_port()
    # The token goes by environment: a command line is readable by every user in the process list.
    process = subprocess.Popen([sys.executable, "-c", _SERVER, str(artifacts), str(port), str(timeout_s)],
                               env={**os.environ, "EDGETORCH_SPLIT_TOKEN": token})
    target = Target("127.0.0.1", port, token, process.pid)
    try:
        _wait_until_up(target, process, startup_s)
        yield target
    finally:
        process.terminate()
        process.wait(timeout=30)
