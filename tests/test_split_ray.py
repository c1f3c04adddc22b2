"""The split tail behind Ray Serve (edgetorch.split.ray_app).

The end-to-end test runs Ray only inside a fresh network namespace that has nothing but loopback
(``unshare -rn``): Ray starts its internal services on the node's address whatever HTTP host it
is given, so outside such a namespace it would listen on the machine's network. The child process
in the namespace is this file run as a script: it calls :func:`edgetorch.split.ray_app.run` (what
``edgetorch split serve --ray`` calls) with 2 replicas, sends requests to 127.0.0.1 from a thread,
then stops it with SIGTERM, and writes what it saw as JSON for the test to check.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from edgetorch.split.server import ServerConfig

TOKEN = "ray-test-token"
OCTET = {"content-type": "application/octet-stream"}
AUTH = {**OCTET, "authorization": f"Bearer {TOKEN}"}
REPLICAS = 2
LATENCY_REQUESTS = 30

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray Serve is not installed (pip install 'edgetorch[ray]')")


def _unshare_works() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    try:
        done = subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    import torchvision

    import edgetorch.split as es

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("ray_artifact") / "r18_c2"
    es.save(es.inject_bottleneck(torchvision.models.resnet18(num_classes=10), 2), out, 32)
    return out


def _bottleneck_shape(artifact: Path) -> list[int]:
    return json.loads((artifact / "manifest.json").read_text())["bottleneck_shape"]


def _in_process_logits(artifact: Path, config: ServerConfig, bodies: list[bytes]) -> list:
    """The plain app's answers, with one torch thread like a Ray replica with num_cpus=1 (Ray sets
    its OMP_NUM_THREADS), so both run the same kernels and the logits can be compared exactly."""
    from fastapi.testclient import TestClient

    from edgetorch.split.server import app_from_dir

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with TestClient(app_from_dir(artifact, config)) as client:
            answers = [client.post("/infer", content=body, headers=AUTH) for body in bodies]
    finally:
        torch.set_num_threads(threads)
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return [a.json()["logits"] for a in answers]


# --- without a running Ray -------------------------------------------------------------------------------------


def test_missing_ray_names_the_extra(monkeypatch, tmp_path):
    from edgetorch.split import ray_app as module

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"edgetorch\[ray\]"):
        module.ray_app(tmp_path)


@pytest.mark.parametrize("kwargs", [{"replicas": 0}, {"replicas": True}, {"replicas": 1.5},
                                    {"num_cpus": -1}, {"num_cpus": float("nan")}])
def test_arguments_are_checked(kwargs, tmp_path):
    from edgetorch.split.ray_app import ray_app

    with pytest.raises(ValueError):
        ray_app(tmp_path, **kwargs)


def test_config_must_be_a_server_config(tmp_path):
    from edgetorch.split.ray_app import ray_app

    with pytest.raises(TypeError, match="ServerConfig"):
        ray_app(tmp_path, {"token": "x"})


@needs_ray
def test_start_refuses_a_broken_artifact_before_starting_ray(artifact, tmp_path, monkeypatch):
    import ray

    from edgetorch.split import SplitArtifactError
    from edgetorch.split.ray_app import start

    def never(*args, **kwargs):
        raise AssertionError("Ray must not start for an artifact that does not load")

    monkeypatch.setattr(ray, "init", never)
    broken = tmp_path / "broken"
    shutil.copytree(artifact, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["num_classes"] = 11
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SplitArtifactError):
        start(broken, replicas=2)
    assert not ray.is_initialized()


@needs_ray
@pytest.mark.filterwarnings("ignore:coroutine .*__del__' was never awaited:RuntimeWarning")
def test_deployment_pickles_and_builds_the_app_where_it_is_unpickled(artifact):
    """The issue's failure was pickling: what Ray ships to a replica must pickle, and the app must
    be built on the unpickling side. Checked with Ray's own cloudpickle, without starting Ray."""
    import ray
    from fastapi.testclient import TestClient
    from ray import cloudpickle

    from edgetorch.split import encode
    from edgetorch.split.ray_app import ray_app

    config = ServerConfig(token=TOKEN, max_batch=8)
    application = ray_app(artifact, config, replicas=REPLICAS)
    deployment = getattr(application, "_bound_deployment", None)
    if deployment is None:
        pytest.skip("this Ray version does not expose Application._bound_deployment")
    assert deployment.num_replicas == REPLICAS and not ray.is_initialized()
    shipped = cloudpickle.dumps(deployment.func_or_class)
    assert b"safetensors" not in shipped and len(shipped) < 200_000  # a path and a config, not weights

    replica_class = cloudpickle.loads(shipped)
    replica = replica_class.__new__(replica_class)
    asyncio.run(replica.__init__())  # what a replica does: calls the builder, which loads the artifact
    body = encode(torch.randn(3, *_bottleneck_shape(artifact)))
    with TestClient(replica.app) as client:
        answer = client.post("/infer", content=body, headers=AUTH)
        assert answer.status_code == 200
        assert client.post("/infer", content=body, headers=OCTET).status_code == 401
        assert client.post("/infer", content=encode(torch.randn(9, *_bottleneck_shape(artifact))),
                           headers=AUTH).status_code == 413  # the config crossed too
    assert answer.json()["logits"] == _in_process_logits(artifact, config, [body])[0]


# --- a real Ray Serve, inside a loopback-only network namespace ------------------------------------------------


@needs_ray
@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.skipif(not _unshare_works(),
                    reason="`unshare -rn` (a user + network namespace with only loopback) is not permitted "
                           "here, and Ray must not run outside one in tests: it listens on the node's address")
def test_two_replicas_behind_ray_serve_answer_like_the_app(artifact, tmp_path):
    from edgetorch.split import encode

    shape = _bottleneck_shape(artifact)
    torch.manual_seed(1)
    bodies = [encode(torch.randn(batch, *shape)) for batch in (1, 4, 16)]
    expected = _in_process_logits(artifact, ServerConfig(token=TOKEN), bodies)

    spec = tmp_path / "spec.json"
    result = tmp_path / "result.json"
    ray_tmp = tempfile.mkdtemp(prefix="etray", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    spec.write_text(json.dumps({"artifact": str(artifact), "result": str(result), "ray_tmp": ray_tmp,
                                "bodies": [base64.b64encode(b).decode() for b in bodies],
                                "latency_body": base64.b64encode(encode(torch.randn(1, *shape))).decode()}))
    env = {**os.environ, "HOME": str(tmp_path / "home"), "RAY_USAGE_STATS_ENABLED": "0",
           # Ray Serve gives its HTTP proxy 5 s to report ready and kills it after three misses: on a
           # machine busy with other work (two CPU-bound processes beside the suite) it missed, and
           # the proxy was killed before it served. The test checks answers, not Ray's start-up speed.
           **{f"RAY_SERVE_PROXY_{name}": "120" for name in ("READY_CHECK_TIMEOUT_S", "HEALTH_CHECK_TIMEOUT_S",
                                                            "HEALTH_CHECK_PERIOD_S", "GRACEFUL_SHUTDOWN_TIMEOUT_S")}}
    try:
        done = subprocess.run(["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0" "$1" "$2"',
                               sys.executable, __file__, str(spec)],
                              env=env, capture_output=True, text=True, timeout=400)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result.exists(), f"the child wrote no result (rc {done.returncode}):\n{done.stderr[-6000:]}"
    seen = json.loads(result.read_text())
    assert not seen.get("error"), seen["error"] + "\n" + done.stderr[-6000:]

    assert seen["interfaces"] == ["lo"] and seen["node_ip"] == "127.0.0.1"
    assert all(address.startswith("127.") or address == "0.0.0.0" for address in seen["listening"]), seen["listening"]
    assert seen["replica_states"] == {"RUNNING": REPLICAS}
    assert seen["health"] == {"status": "ok"}
    assert seen["statuses"] == [200] * len(bodies)
    assert seen["logits"] == expected  # exactly what the in-process app answers
    assert seen["no_token"] == [401, "unauthorized"]
    assert seen["junk"] == [400, "malformed_payload"]
    # both replicas answered /infer, and their own counters add up to every 200 sent
    assert len(seen["replicas_answering"]) == REPLICAS and 0 not in seen["replicas_answering"]
    assert sum(seen["replicas_answering"]) == len(bodies) + LATENCY_REQUESTS
    assert seen["run_returned"] and not seen["ray_alive_after"]
    print(f"\nRay Serve, {REPLICAS} replicas: start-up {seen['startup_s']:.1f} s (run() to all replicas running; "
          f"first /health 200 after {seen['first_health_s']:.1f} s); /infer batch 1 round trip over loopback: median "
          f"{seen['latency_ms']['median']:.1f} ms, p90 {seen['latency_ms']['p90']:.1f} ms over {LATENCY_REQUESTS} "
          f"requests; in-replica decode+tail median {seen['latency_ms']['server_median']:.1f} ms; "
          f"shutdown {seen['shutdown_s']:.1f} s; node address {seen['node_ip']}; listening on {seen['listening']}")


def _listening_addresses() -> list[str]:
    """The local IPv4 addresses of listening TCP sockets in this network namespace."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":
            raw = bytes.fromhex(local.split(":")[0])
            found.add(".".join(str(b) for b in reversed(raw)))
    return sorted(found)


def _child(spec_path: str) -> None:
    """Run in the namespace: serve with run(), exercise it from a thread, stop it with SIGTERM."""
    import httpx

    spec = json.loads(Path(spec_path).read_text())
    seen: dict = {"interfaces": sorted(name for _, name in socket.if_nameindex())}
    with socket.socket() as probe:  # nothing else runs in this namespace, so the port stays free
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()

    def exercise() -> None:
        try:
            with httpx.Client(base_url=url, timeout=60) as client:
                deadline = time.monotonic() + 300
                while True:
                    try:
                        health = client.get("/health")
                        if health.status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("Ray Serve did not answer /health within 300 s")
                    time.sleep(0.2)
                seen["first_health_s"] = time.perf_counter() - started
                seen["health"] = health.json()
                import ray
                from ray import serve

                from edgetorch.split.ray_app import APP_NAME, DEPLOYMENT_NAME

                # The proxy answers as soon as one replica runs; start-up ends when all of them do.
                while True:
                    status = serve.status().applications.get(APP_NAME)
                    states = status and status.deployments.get(DEPLOYMENT_NAME)
                    states = {str(getattr(k, "value", k)): v for k, v in states.replica_states.items()} if states else {}
                    if states == {"RUNNING": REPLICAS} or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                seen["startup_s"] = time.perf_counter() - started
                seen["replica_states"] = states
                seen["node_ip"] = ray.util.get_node_ip_address()
                answers = [client.post("/infer", content=base64.b64decode(b), headers=AUTH) for b in spec["bodies"]]
                seen["statuses"] = [a.status_code for a in answers]
                seen["logits"] = [a.json().get("logits") for a in answers]
                refused = client.post("/infer", content=base64.b64decode(spec["bodies"][0]), headers=OCTET)
                seen["no_token"] = [refused.status_code, refused.json()["error"]["type"]]
                junk = client.post("/infer", content=b"not a payload", headers=AUTH)
                seen["junk"] = [junk.status_code, junk.json()["error"]["type"]]
                body = base64.b64decode(spec["latency_body"])
                round_trips, server = [], []
                for _ in range(LATENCY_REQUESTS):
                    t0 = time.perf_counter()
                    answer = client.post("/infer", content=body, headers=AUTH)
                    round_trips.append(time.perf_counter() - t0)
                    assert answer.status_code == 200, answer.text
                    server.append(sum(answer.json()["timing"].values()))
                deciles = statistics.quantiles(round_trips, n=10)
                seen["latency_ms"] = {"median": 1e3 * statistics.median(round_trips), "p90": 1e3 * deciles[-1],
                                      "server_median": 1e3 * statistics.median(server)}
                # Each replica keeps its own /metrics. An odd number of /infer 200s were sent, so two
                # replicas that both answered show different counts, which must add up to that number.
                counts = set()
                for _ in range(40):
                    text = client.get("/metrics", headers=AUTH).text
                    counts.add(sum(int(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                   if line.startswith('edgetorch_split_requests_total{path="/infer",code="200"}')))
                    if len(counts) >= REPLICAS:
                        break
                seen["replicas_answering"] = sorted(counts)
                seen["listening"] = _listening_addresses()
        except BaseException as error:  # reported to the test, which fails with it
            seen["error"] = f"{type(error).__name__}: {error}"
        finally:
            seen["stop_requested"] = time.perf_counter()
            os.kill(os.getpid(), signal.SIGTERM)

    from edgetorch.split.ray_app import run

    threading.Thread(target=exercise, daemon=True).start()
    try:
        run(spec["artifact"], "127.0.0.1", port, REPLICAS, ServerConfig(token=TOKEN), num_cpus=REPLICAS,
            ray_init={"_temp_dir": spec["ray_tmp"], "object_store_memory": 100 * 2**20})
        seen["run_returned"] = True
    except BaseException as error:
        seen.setdefault("error", f"run() raised {type(error).__name__}: {error}")
    import ray

    seen["shutdown_s"] = time.perf_counter() - seen.get("stop_requested", time.perf_counter())
    seen["ray_alive_after"] = ray.is_initialized()
    Path(spec["result"]).write_text(json.dumps(seen))


if __name__ == "__main__":
    _child(sys.argv[1])
