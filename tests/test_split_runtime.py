"""Split runtime: export/load with manifest checks, the tail server's 4xx paths, a loopback round trip."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from torch import nn

from edgetorch.split.client import SplitClient, SplitClientError, preprocess_images
from edgetorch.split.export import Preprocess, SplitArtifactError, export_split, load, load_part, read_manifest
from edgetorch.split.payload import decode, encode
from edgetorch.split.server import ServerConfig, create_app, serve_in_background


def tiny_split() -> tuple[nn.Module, nn.Module]:
    """A 3x16x16 -> 2x8x8 head and a tail to 5 logits: the runtime does not care what the model is."""
    torch.manual_seed(0)
    head = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3, stride=2, padding=1))
    tail = nn.Sequential(nn.ConvTranspose2d(2, 4, 2, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))
    return head.eval(), tail.eval()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("artifact")
    head, tail = tiny_split()
    export_split(head, tail, out, arch="test:tiny", channels=2, split_point="sp1", input_shape=(3, 16, 16))
    return out


@pytest.fixture()
def copy_of(artifact, tmp_path):
    return shutil.copytree(artifact, tmp_path / "copy")


def test_export_writes_a_manifest_and_programs_that_match_eager(artifact):
    manifest = read_manifest(artifact)
    assert (manifest.bottleneck_shape, manifest.num_classes, manifest.input_shape) == ((2, 8, 8), 5, (3, 16, 16))
    assert sorted(p.name for p in artifact.iterdir()) == ["head.pt2", "manifest.json", "tail.pt2"]
    head, tail = load(artifact)
    eager_head, eager_tail = tiny_split()
    for batch in (1, 7):  # the batch dim is dynamic
        x = torch.rand(batch, 3, 16, 16)
        with torch.inference_mode():
            assert torch.allclose(tail(head(x)), eager_tail(eager_head(x)), atol=1e-5)


def test_split_with_quantised_payload_matches_the_unsplit_model_up_to_quantisation(artifact):
    head, tail = load(artifact)
    eager_head, eager_tail = tiny_split()
    x = torch.rand(16, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        unsplit = eager_tail(eager_head(x))
        h = head(x)
        split = tail(decode(encode(h)))
    assert torch.allclose(decode(encode(h)), h, atol=float((h.amax() - h.amin()) / 255))
    assert (split - unsplit).abs().max() < 0.01 * unsplit.abs().max() + 1e-3
    assert torch.equal(split.argmax(1), unsplit.argmax(1))


@pytest.mark.parametrize("damage, match", [
    (lambda d: (d / "head.pt2").write_bytes((d / "head.pt2").read_bytes() + b"x"), "SHA-256"),
    (lambda d: (d / "tail.pt2").unlink(), "tail file tail.pt2 is missing"),
    (lambda d: (d / "manifest.json").write_text("{not json"), "not JSON"),
    (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
    (lambda d: _edit_manifest(d, manifest_version=2), "manifest_version 2"),
    (lambda d: _edit_manifest(d, channels=-1), "malformed field"),
    (lambda d: _edit_manifest(d, files={"head": {"path": "../x", "sha256": "0", "format": "torch.export"},
                                        "tail": {"path": "tail.pt2", "sha256": "0", "format": "torch.export"}}),
     "must stay inside"),
])
def test_load_refuses_damaged_artifacts(copy_of, damage, match):
    damage(copy_of)
    with pytest.raises(SplitArtifactError, match=match):
        load(copy_of)


def _edit_manifest(directory, **fields):
    path = directory / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.fixture(scope="module")
def client(artifact):
    tail, manifest = load_part(artifact, "tail")
    return TestClient(create_app(tail, manifest, ServerConfig(max_payload_bytes=2000, token="s3cret")))


AUTH = {"authorization": "Bearer s3cret", "content-type": "application/octet-stream"}


def test_health_reports_the_model(client):
    info = client.get("/").json()
    assert info["status"] == "ok" and info["bottleneck_shape"] == [2, 8, 8]
    assert (info["max_payload_bytes"], info["auth"], info["num_classes"]) == (2000, True, 5)


def test_infer_returns_the_tails_logits(client, artifact):
    tail, _ = load_part(artifact, "tail")
    body = encode(torch.randn(3, 2, 8, 8))
    answer = client.post("/infer", content=body, headers=AUTH)
    assert answer.status_code == 200
    with torch.inference_mode():
        expected = tail(decode(body))
    assert torch.allclose(torch.tensor(answer.json()["logits"]), expected, atol=1e-6)


@pytest.mark.parametrize("headers, body, status, match", [
    ({"content-type": "application/octet-stream"}, encode(torch.randn(1, 2, 8, 8)), 401, "bearer token"),
    ({**AUTH, "authorization": "Bearer wrong"}, encode(torch.randn(1, 2, 8, 8)), 401, "bearer token"),
    ({**AUTH, "content-type": "application/json"}, encode(torch.randn(1, 2, 8, 8)), 415, "content type"),
    (AUTH, encode(torch.randn(20, 2, 8, 8)), 413, "exceeds the limit of 2000"),
    (AUTH, b"garbage bytes", 400, "malformed payload: not an edgetorch"),
    (AUTH, encode(torch.randn(1, 2, 8, 8))[:-3], 400, "truncated"),
    (AUTH, encode(torch.randn(1, 3, 8, 8)), 422, r"does not match this model's bottleneck \[N, 2, 8, 8\]"),
    (AUTH, encode(torch.randn(2, 8, 8)), 422, "does not match"),
    (AUTH, b"", 400, "truncated"),
])
def test_bad_requests_get_a_4xx_json_error_and_the_server_keeps_serving(client, headers, body, status, match):
    answer = client.post("/infer", content=body, headers=headers)
    assert answer.status_code == status
    assert re.search(match, answer.json()["error"])
    assert client.post("/infer", content=encode(torch.randn(1, 2, 8, 8)), headers=AUTH).status_code == 200


def test_a_body_without_content_length_is_still_bounded(client):
    def chunks():
        for _ in range(10):
            yield b"\0" * 500
    answer = client.post("/infer", content=chunks(), headers=AUTH)  # chunked: no Content-Length
    assert answer.status_code == 413


def _png(path, seed: int, size: int = 28) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size), dtype=np.uint8)
    Image.fromarray(pixels, mode="L").save(path)
    return str(path)


def test_preprocess_resizes_and_repeats_gray_channels(tmp_path):
    batch = preprocess_images([_png(tmp_path / "a.png", 0), _png(tmp_path / "b.jpg", 1, 40)],
                              Preprocess(size=(16, 16)), in_channels=3)
    assert batch.shape == (2, 3, 16, 16) and torch.equal(batch[:, 0], batch[:, 2])
    assert 0 <= batch.min() and batch.max() <= 1
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="not a readable image"):
        preprocess_images([tmp_path / "bad.png"], Preprocess(size=(16, 16)), in_channels=3)


def test_round_trip_over_real_uvicorn_on_loopback(artifact, tmp_path):
    tail, manifest = load_part(artifact, "tail")
    images = [_png(tmp_path / f"{i}.png", i) for i in range(3)]
    with serve_in_background(create_app(tail, manifest, ServerConfig(token="t"))) as url:
        assert httpx.get(url + "/").json()["status"] == "ok"
        with SplitClient.from_dir(artifact, url, token="t") as device:
            result = device.infer_files(images)
            head, _ = load_part(artifact, "head")
            with torch.inference_mode():
                local = tail(decode(encode(head(preprocess_images(images, manifest.preprocess, 3)))))
            assert torch.allclose(result.logits, local, atol=1e-5)
            assert result.payload_bytes == 3 * 2 * 8 * 8 + 13 + 16 + 15
            assert set(result.seconds) == {"head", "encode", "network", "server", "total"}
        with SplitClient.from_dir(artifact, url, token="wrong") as device, \
                pytest.raises(SplitClientError, match="401"):
            device.infer_files(images)


def test_cli_export_then_infer_over_loopback(tmp_path):
    from typer.testing import CliRunner

    import edgetorch.cli.split  # noqa: F401  (registers `edgetorch split`)
    from edgetorch.cli import app
    from edgetorch.split.bottleneck import inject_bottleneck
    from edgetorch.zoo import build_model

    runner = CliRunner()
    out = tmp_path / "r18"
    args = ["split", "export", "--model", "torchvision:resnet18", "--channels", "3", "--resolution", "32", "--out", str(out)]
    refused = runner.invoke(app, args)
    assert refused.exit_code != 0 and "exactly one of --checkpoint" in refused.output
    torch.manual_seed(0)
    done = runner.invoke(app, [*args, "--random-init"])
    assert done.exit_code == 0, done.output
    assert read_manifest(out).bottleneck_shape == (3, 4, 4)

    # The same seed rebuilds the same student: the exported split with the 8-bit payload must
    # match the unsplit model up to quantisation.
    torch.manual_seed(0)
    student = inject_bottleneck(build_model("torchvision:resnet18", num_classes=10), 3, "sp2").eval()
    head, tail = load(out)
    x = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        unsplit, z = student(x), student.head(x)
        exact, quantised = tail(head(x)), tail(decode(encode(head(x))))
    assert torch.allclose(exact, unsplit, atol=1e-4) and torch.allclose(head(x), z, atol=1e-5)
    spread = float(unsplit.amax() - unsplit.amin())
    assert 0 < (quantised - unsplit).abs().max() < 0.05 * spread
    bad = runner.invoke(app, [*args[:-2], "--out", str(tmp_path / "x"), "--checkpoint", str(tmp_path / "none.safetensors")])
    assert bad.exit_code != 0

    images = [_png(tmp_path / f"{i}.png", i) for i in range(2)]
    tail, manifest = load_part(out, "tail")
    with serve_in_background(create_app(tail, manifest)) as url:
        answer = runner.invoke(app, ["split", "infer", str(out), *images, "--server", url])
    assert answer.exit_code == 0, answer.output
    assert "class" in answer.output and f"payload {2 * 3 * 4 * 4 + 13 + 16 + 10} bytes" in answer.output
    for stage in ("head", "encode", "network", "server", "total"):
        assert f"{stage} " in answer.output
    unreachable = runner.invoke(app, ["split", "infer", str(out), *images, "--server", "http://127.0.0.1:9"])
    assert unreachable.exit_code == 1 and "request failed" in unreachable.output


def test_cli_serve_runs_uvicorn_with_a_token_from_the_environment(artifact):
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = "import sys, edgetorch.cli.split; from edgetorch.cli import app; sys.argv[0] = 'edgetorch'; app()"
    command = [sys.executable, "-c", code, "split", "serve", str(artifact), "--port", str(port), "--token-env", "SPLIT_TOKEN"]
    missing = subprocess.run(command, capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "SPLIT_TOKEN"})
    assert missing.returncode != 0 and "SPLIT_TOKEN is not set" in missing.stdout + missing.stderr
    server = subprocess.Popen(command, env={**os.environ, "SPLIT_TOKEN": "abc"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(url + "/", timeout=1).json()["auth"] is True
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.2)
        body = encode(torch.randn(1, 2, 8, 8))
        assert httpx.post(url + "/infer", content=body, headers={"content-type": "application/octet-stream"}).status_code == 401
        ok = httpx.post(url + "/infer", content=body, headers={"content-type": "application/octet-stream",
                                                               "authorization": "Bearer abc"})
        assert ok.status_code == 200 and len(ok.json()["logits"][0]) == 5
    finally:
        server.terminate()
        server.wait(timeout=30)
