"""Split artifacts (safetensors + manifest): export, verified load, tampering, signing, ONNX head;
the device client; a loopback round trip through the CLI."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from _tamper import edit_manifest, rehash
import torch
import torchvision
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from edgetorch.split import SplitArtifactError, save, inject_bottleneck, load, load_onnx_head
from edgetorch.split.client import SplitClient, SplitClientError, preprocess_images
from edgetorch.split.artifact import load_part, read_manifest
from edgetorch.split.manifest import Preprocess
from edgetorch.split.payload import decode, encode
from edgetorch.split.protocol import serve_in_background
from edgetorch.split.server import ServerConfig, create_app

KEY = "0123456789abcdef-test-key"


def student(seed: int = 0):
    torch.manual_seed(seed)
    return inject_bottleneck(torchvision.models.resnet18(num_classes=5), 2, "sp2")


@pytest.fixture(scope="module")
def model():
    return student()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, model):
    out = tmp_path_factory.mktemp("artifact")
    save(model, out, 32)
    return out


@pytest.fixture(scope="module")
def signed(tmp_path_factory, model):
    out = tmp_path_factory.mktemp("signed")
    save(model, out, 32, key=KEY)
    return out


@pytest.fixture()
def copy_of(artifact, tmp_path):
    return shutil.copytree(artifact, tmp_path / "copy")


def test_export_writes_safetensors_and_a_manifest_and_the_loaded_split_is_the_model(artifact, model):
    manifest = read_manifest(artifact)
    assert (manifest.bottleneck_shape, manifest.num_classes, manifest.input_shape) == ((2, 4, 4), 5, (3, 32, 32))
    assert (manifest.arch, manifest.channels, manifest.split_point) == ("torchvision:resnet18", 2, "sp2")
    assert sorted(p.name for p in artifact.iterdir()) == ["head.safetensors", "manifest.json", "tail.safetensors"]
    assert model.training  # export leaves the model's mode as it was
    head, tail = load(artifact)
    model.eval()
    try:
        for batch in (1, 7):
            x = torch.rand(batch, 3, 32, 32)
            with torch.inference_mode():
                assert torch.equal(tail(head(x)), model(x))
    finally:
        model.train()


def test_split_with_quantised_payload_matches_the_unsplit_model_up_to_quantisation(artifact, model):
    head, tail = load(artifact)
    x = torch.rand(16, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        unsplit = tail(head(x))
        h = head(x)
        split = tail(decode(encode(h)))
    assert torch.allclose(decode(encode(h)), h, atol=float((h.amax() - h.amin()) / 255) + 1e-6)
    assert (split - unsplit).abs().max() < 0.02 * (unsplit.amax() - unsplit.amin())


def test_a_loaded_head_refuses_another_input_size_and_names_both(artifact):
    head, tail = load(artifact)
    with pytest.raises(ValueError, match=r"exported for inputs \[N, 3, 32, 32\], got \[1, 3, 224, 224\].*resize"):
        head(torch.rand(1, 3, 224, 224))
    with pytest.raises(ValueError, match=r"exported for inputs \[N, 2, 4, 4\]"):
        tail(torch.rand(1, 2, 8, 8))


def _edit_manifest(directory: Path, **fields) -> None:
    path = directory / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _swap_files(d: Path) -> None:
    head, tail = (d / "head.safetensors").read_bytes(), (d / "tail.safetensors").read_bytes()
    (d / "head.safetensors").write_bytes(tail)
    (d / "tail.safetensors").write_bytes(head)
    rehash(d)


def _with_nan(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "head.safetensors")
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name][0] = float("nan")
    save_file(tensors, d / "head.safetensors")
    rehash(d)


def _symlinked_tail(d: Path) -> None:
    outside = d.parent / "elsewhere.safetensors"
    shutil.move(d / "tail.safetensors", outside)
    (d / "tail.safetensors").symlink_to(outside)


@pytest.mark.parametrize("damage, match", [
    (lambda d: (d / "head.safetensors").write_bytes((d / "head.safetensors").read_bytes() + b"x"), "SHA-256"),
    (lambda d: (d / "tail.safetensors").unlink(), "tail.safetensors is missing"),
    (lambda d: (d / "manifest.json").write_text("{not json"), "not JSON"),
    (lambda d: (d / "manifest.json").unlink(), "manifest.json is missing"),
    (lambda d: _edit_manifest(d, manifest_version=1), "no longer read. Export again"),
    (lambda d: _edit_manifest(d, manifest_version=4), "version 4 is not supported"),
    (lambda d: _edit_manifest(d, extra=1), r"\['extra'\] are missing or unknown"),
    (lambda d: edit_manifest(d, lambda m: m["model"].update(channels=-1)), "cannot be built"),
    (lambda d: edit_manifest(d, lambda m: m["model"].update(arch="os:system")), "unknown arch 'os:system'"),
    (lambda d: edit_manifest(d, lambda m: m["model"].update(channels=3)), "bottleneck_shape"),
    (lambda d: _edit_manifest(d, bottleneck_shape=[2, 10**30, 4]), "bottleneck_shape"),
    (lambda d: _edit_manifest(d, num_classes=7), "num_classes 7 is not the model's 5"),
    (lambda d: edit_manifest(d, lambda m: m["model"].update(num_classes=7)), "num_classes 5 is not the model's 7"),
    (lambda d: edit_manifest(d, lambda m: m["preprocess"].update(std=[0.0])), "std must be > 0"),
    (lambda d: edit_manifest(d, lambda m: m["preprocess"].update(mean=[0.1, 0.2])), "mean needs 1 or 3 values"),
    (lambda d: edit_manifest(d, lambda m: (m.update(input_shape=[3, 64, 64]), m["preprocess"].update(size=[64, 64]))),
     "bottleneck_shape"),
    (lambda d: _edit_manifest(d, input_shape=[3, 64, 64]), "must match preprocess.size"),
    (lambda d: edit_manifest(d, lambda m: m["files"]["head"].update(path="../x")), "head must be head.safetensors"),
    (lambda d: edit_manifest(d, lambda m: m["files"].update(extra={"path": "x", "sha256": "0", "format": "x"})),
     "files must list head and tail"),
    (_swap_files, "weights do not fit the manifest's model"),
    (lambda d: ((d / "head.safetensors").write_bytes(b"junk" * 100), rehash(d)), "not a safetensors file"),
    (_with_nan, "holds inf or NaN"),
    (_symlinked_tail, "symlinks are refused"),
])
def test_load_refuses_damaged_or_tampered_artifacts(copy_of, damage, match):
    damage(copy_of)
    with pytest.raises(SplitArtifactError, match=match):
        load(copy_of)


def test_a_device_needs_only_the_manifest_and_the_head(copy_of):
    (copy_of / "tail.safetensors").unlink()
    head, manifest = load_part(copy_of, "head")
    assert head(torch.rand(2, 3, 32, 32)).shape == (2, *manifest.bottleneck_shape)
    with pytest.raises(SplitArtifactError, match="tail.safetensors is missing"):
        load_part(copy_of, "tail")


class _Plant:
    """Unpickling this creates a file: the shape of an attack that runs code at load."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.touch, (self.sentinel,))


def test_a_planted_pickle_never_runs(copy_of, tmp_path, monkeypatch):
    sentinel = tmp_path / "pwned"
    for name in ("head.safetensors", "tail.safetensors"):
        torch.save({"weight": _Plant(sentinel)}, copy_of / name)
    rehash(copy_of)
    # The plant is live: anything that unpickles the file runs it.
    torch.load(io.BytesIO((copy_of / "head.safetensors").read_bytes()), weights_only=False)
    assert sentinel.exists()
    sentinel.unlink()
    with pytest.raises(SplitArtifactError, match="not a safetensors file"):
        load(copy_of)
    assert not sentinel.exists()


def test_loading_never_reaches_an_unpickler(artifact, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an artifact load reached an unpickling loader")

    for target, name in ((torch, "load"), (torch.export, "load"), (torch.jit, "load"), (pickle, "loads"),
                         (pickle, "load"), (pickle, "Unpickler")):
        monkeypatch.setattr(target, name, refuse)
    head, tail = load(artifact)
    assert tail(head(torch.rand(1, 3, 32, 32))).shape == (1, 5)


def test_a_signed_artifact_loads_only_with_its_key(signed, artifact, tmp_path):
    assert read_manifest(signed, key=KEY).signature is not None
    head, _ = load_part(signed, "head", key=KEY)
    load(signed)  # without a key the hashes still guard against corruption
    with pytest.raises(SplitArtifactError, match="does not match this key"):
        load(signed, key=KEY + "x")
    with pytest.raises(SplitArtifactError, match="not signed, but a key was given"):
        load(artifact, key=KEY)
    tampered = shutil.copytree(signed, tmp_path / "tampered")
    _with_nan(tampered)  # new weights, hashes recomputed: only the signature can tell
    with pytest.raises(SplitArtifactError, match="does not match this key"):
        load(tampered, key=KEY)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load(signed, key="short")


def test_a_version_2_artifact_loads_as_it_was_signed_and_stretches_images(signed, tmp_path):
    """Manifest version 3 added preprocess.resize. A version 2 artifact (written by 0.1/0.2, its
    HMAC over the version 2 body) still loads with its key and the same artifact id, and its
    images are stretched, the only resize it knew."""
    import hashlib
    import hmac

    old = shutil.copytree(signed, tmp_path / "v2")
    raw = json.loads((old / "manifest.json").read_text())
    assert raw["manifest_version"] == 3 and raw["preprocess"].pop("resize") == "stretch"
    raw["manifest_version"] = 2
    body = json.dumps({k: v for k, v in raw.items() if k != "signature"}, sort_keys=True, separators=(",", ":"))
    raw["signature"] = hmac.new(KEY.encode(), body.encode(), hashlib.sha256).hexdigest()
    (old / "manifest.json").write_text(json.dumps(raw))
    manifest = read_manifest(old, key=KEY)
    assert (manifest.manifest_version, manifest.preprocess.resize) == (2, "stretch")
    assert manifest.artifact_id == hashlib.sha256(body.encode()).hexdigest()
    load(old, key=KEY)
    edit_manifest(old, lambda m: m["preprocess"].update(resize="stretch"))  # not a field of version 2
    with pytest.raises(SplitArtifactError, match="preprocess needs exactly size, color, mean, std"):
        read_manifest(old)
    current = shutil.copytree(signed, tmp_path / "v3")
    edit_manifest(current, lambda m: m["preprocess"].pop("resize"))
    with pytest.raises(SplitArtifactError, match="preprocess needs exactly size, color, mean, std, resize"):
        read_manifest(current)
    edit_manifest(current, lambda m: m["preprocess"].update(resize="fill"))
    with pytest.raises(SplitArtifactError, match="resize must be one of center-crop, stretch, got 'fill'"):
        read_manifest(current)


def test_export_refuses_what_it_cannot_write_faithfully(model, tmp_path):
    with pytest.raises(ValueError, match="multiple of 8"):
        save(model, tmp_path / "a", 36)
    with pytest.raises(TypeError, match="BottleneckModel"):
        save(torchvision.models.resnet18(), tmp_path / "a", 32)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SplitArtifactError, match="is a file"):
        save(model, tmp_path / "file", 32)
    with pytest.raises(ValueError, match="std must be > 0"):
        save(model, tmp_path / "a", 32, Preprocess(size=(32, 32), std=(0.0,)))


def test_export_replaces_a_planted_symlink_instead_of_writing_through_it(model, tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("keep me")
    (out / "tail.safetensors").symlink_to(victim)
    save(model, out, 32)
    assert victim.read_text() == "keep me" and not (out / "tail.safetensors").is_symlink()


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 2**40) | st.floats(allow_nan=True) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                     max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.lists(st.sampled_from(["model", "arch", "channels", "split_point", "downsample", "num_classes",
                                      "input_shape", "bottleneck_shape", "preprocess", "size", "mean", "std",
                                      "color", "files", "head", "tail", "path", "sha256", "payload_format", "class_names",
                                      "signature", 0, 1, 2]), min_size=1, max_size=3),
       value=_JSON)
def test_fuzzed_manifests_load_consistently_or_raise_split_artifact_error(artifact, tmp_path_factory, path, value):
    """Whatever a manifest says, load either returns a split consistent with it or refuses it."""
    directory = tmp_path_factory.mktemp("fuzz")
    raw = json.loads((artifact / "manifest.json").read_text())
    node = raw
    for step in path[:-1]:
        if isinstance(node, dict) and step in node or isinstance(node, list) and isinstance(step, int) and step < len(node):
            node = node[step]
    last = path[-1]
    if isinstance(node, dict) and isinstance(last, str):
        node[last] = value
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        node[last] = value
    for name in ("head.safetensors", "tail.safetensors"):
        os.link(artifact / name, directory / name)
    (directory / "manifest.json").write_text(json.dumps(raw))
    try:
        head, tail = load(directory)
    except SplitArtifactError:
        return
    manifest = read_manifest(directory)
    logits = tail(head(torch.zeros(2, *manifest.input_shape)))
    assert logits.shape == (2, manifest.num_classes)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_weight_files_load_or_raise_split_artifact_error(artifact, tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("bytes")
    for name in ("manifest.json", "tail.safetensors"):
        os.link(artifact / name, directory / name)
    blob = bytearray((artifact / "head.safetensors").read_bytes())
    header = int.from_bytes(blob[:8], "little") + 8  # mostly mutate the JSON header, where parsing happens
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, header + 64))
        blob[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[:data.draw(st.integers(0, len(blob)))]
    (directory / "head.safetensors").write_bytes(bytes(blob))
    (directory / "manifest.json").unlink()  # a linked file: rewrite a copy, not the shared original
    (directory / "manifest.json").write_bytes((artifact / "manifest.json").read_bytes())
    rehash(directory)
    try:
        head, _ = load_part(directory, "head")
    except SplitArtifactError:
        return
    assert torch.isfinite(head(torch.zeros(1, 3, 32, 32))).all()


def _png(path, seed: int, size: int = 28) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size), dtype=np.uint8)
    Image.fromarray(pixels, mode="L").save(path)
    return str(path)


def test_preprocess_resizes_and_repeats_gray_channels(tmp_path, bomb_png):
    batch = preprocess_images([_png(tmp_path / "a.png", 0), _png(tmp_path / "b.jpg", 1, 40)],
                              Preprocess(size=(16, 16)), in_channels=3)
    assert batch.shape == (2, 3, 16, 16) and torch.equal(batch[:, 0], batch[:, 2])
    assert 0 <= batch.min() and batch.max() <= 1
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="not a readable image"):
        preprocess_images([tmp_path / "bad.png"], Preprocess(size=(16, 16)), in_channels=3)
    with pytest.raises(ValueError, match="not a readable image .*decompression bomb"):
        preprocess_images([bomb_png(tmp_path / "huge.png")], Preprocess(size=(16, 16)), in_channels=3)


def test_onnx_head_matches_the_torch_head_and_serves_the_client(model, tmp_path):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    out = tmp_path / "onnx"
    manifest = save(model, out, 32, onnx=True, key=KEY)
    assert manifest.files["head_onnx"]["path"] == "head.onnx"
    onnx_head, _ = load_onnx_head(out, key=KEY)
    head, tail = load(out, key=KEY)
    x = torch.rand(3, 3, 32, 32)
    with torch.inference_mode():
        assert torch.allclose(onnx_head(x), head(x), atol=1e-4)
    with pytest.raises(ValueError, match=r"exported for inputs \[N, 3, 32, 32\]"):
        onnx_head(torch.rand(1, 3, 64, 64))
    images = [_png(tmp_path / f"{i}.png", i) for i in range(2)]
    with serve_in_background(create_app(tail, manifest)) as url, \
            SplitClient.from_dir(out, url, key=KEY, runtime="onnx") as device:
        result = device.infer_files(images)
    with torch.inference_mode():
        local = tail(decode(encode(head(preprocess_images(images, manifest.preprocess, 3)))))
    assert torch.equal(torch.tensor(result.predictions), local.argmax(1))
    (out / "head.onnx").write_bytes((out / "head.onnx").read_bytes()[:-1])
    with pytest.raises(SplitArtifactError, match="SHA-256"):
        load_onnx_head(out, key=KEY)
    save(model, out, 32)  # without --onnx the old head.onnx goes, so the manifest tells the truth
    assert not (out / "head.onnx").exists()
    with pytest.raises(SplitArtifactError, match="no head.onnx"):
        load_onnx_head(out)


def test_round_trip_over_real_uvicorn_on_loopback(artifact, tmp_path):
    tail, manifest = load_part(artifact, "tail")
    images = [_png(tmp_path / f"{i}.png", i) for i in range(3)]
    with serve_in_background(create_app(tail, manifest, ServerConfig(token="t"))) as url:
        with SplitClient.from_dir(artifact, url, token="t") as device:
            result = device.infer_files(images)
            head, _ = load_part(artifact, "head")
            with torch.inference_mode():
                local = tail(decode(encode(head(preprocess_images(images, manifest.preprocess, 3)))))
            assert torch.allclose(result.logits, local, atol=1e-5)
            assert result.payload_bytes == 3 * 2 * 4 * 4 + 13 + 16 + 15
            assert set(result.seconds) == {"head", "encode", "network", "server", "total"}
        with SplitClient.from_dir(artifact, url, token="wrong") as device, \
                pytest.raises(SplitClientError, match="401"):
            device.infer_files(images)


def _said(result) -> str:
    """A CLI result's output on one line: the error box wraps long messages anywhere."""
    return " ".join(result.output.replace("│", " ").split())


def test_cli_export_then_infer_over_loopback(tmp_path):
    from typer.testing import CliRunner

    import edgetorch.cli.split  # noqa: F401  (registers `edgetorch split`)
    from edgetorch.cli import app

    runner = CliRunner()
    out = tmp_path / "r18"
    args = ["split", "export", "--model", "torchvision:resnet18", "--channels", "3", "--size", "32",
            "--num-classes", "5", "--out", str(out)]
    refused = runner.invoke(app, args)
    assert refused.exit_code != 0 and "exactly one of --checkpoint" in _said(refused)
    from edgetorch.zoo import save_weights

    trained = inject_bottleneck(torchvision.models.resnet18(num_classes=5), 3, "sp2")
    save_weights(trained, tmp_path / "student.safetensors")
    done = runner.invoke(app, [*args, "--checkpoint", str(tmp_path / "student.safetensors")],
                         env={"SPLIT_KEY": KEY})
    assert done.exit_code == 0, done.output
    assert read_manifest(out).bottleneck_shape == (3, 4, 4)
    head, tail = load(out)
    x = torch.rand(4, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(tail(head(x)), trained.eval()(x))
    bad = runner.invoke(app, [*args[:-2], "--out", str(tmp_path / "x"), "--checkpoint", str(tmp_path / "none.safetensors")])
    assert bad.exit_code != 0

    signed = tmp_path / "signed"
    no_key = runner.invoke(app, [*args[:-1], str(signed), "--random-init", "--key-env", "SPLIT_KEY"], env={})
    assert no_key.exit_code == 2 and "SPLIT_KEY is not set" in _said(no_key)
    names = runner.invoke(app, [*args[:-1], str(signed), "--random-init", "--class-names", "a,b"])
    assert names.exit_code == 2 and "class_names must be 5 non-empty strings" in _said(names)
    done = runner.invoke(app, [*args[:-1], str(signed), "--random-init", "--key-env", "SPLIT_KEY",
                               "--class-names", "tee, trouser, pullover, dress, coat"], env={"SPLIT_KEY": KEY})
    assert done.exit_code == 0, done.output
    assert read_manifest(signed).class_names == ("tee", "trouser", "pullover", "dress", "coat")

    images = [_png(tmp_path / f"{i}.png", i) for i in range(2)]
    tail, manifest = load_part(signed, "tail", key=KEY)
    with serve_in_background(create_app(tail, manifest)) as url:
        answer = runner.invoke(app, ["split", "infer", str(signed), *images, "--server", url, "--key-env", "SPLIT_KEY"],
                               env={"SPLIT_KEY": KEY})
        assert answer.exit_code == 0, answer.output
        said = _said(answer)  # "0.png: coat 21.3%, tee 20.4%, dress 20.0%" per image
        assert len(re.findall(r"\.png: (?:\w+ \d+\.\d%, ){2}\w+ \d+\.\d%", said)) == 2, said
        assert f"payload {2 * 3 * 4 * 4 + 13 + 16 + 10} bytes" in said
        for stage in ("head", "encode", "network", "server", "total"):
            assert f"{stage} " in said
        wrong = runner.invoke(app, ["split", "infer", str(signed), *images, "--server", url, "--key-env", "SPLIT_KEY"],
                              env={"SPLIT_KEY": KEY + "x"})
        assert wrong.exit_code == 2 and "does not match this key" in _said(wrong)
    unreachable = runner.invoke(app, ["split", "infer", str(out), *images, "--server", "http://127.0.0.1:9"])
    assert unreachable.exit_code == 1 and "request failed" in _said(unreachable)


def test_cli_export_defaults_to_224_px(tmp_path):
    from typer.testing import CliRunner

    import edgetorch.cli.split  # noqa: F401
    from edgetorch.cli import app

    out = tmp_path / "default"
    done = CliRunner().invoke(app, ["split", "export", "--model", "torchvision:resnet18", "--channels", "2",
                                    "--random-init", "--out", str(out)])
    assert done.exit_code == 0, done.output
    assert read_manifest(out).input_shape == (3, 224, 224)


def test_cli_serve_runs_uvicorn_with_a_token_and_key_from_the_environment(signed):
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = "import sys, edgetorch.cli.split; from edgetorch.cli import app; sys.argv[0] = 'edgetorch'; app()"
    command = [sys.executable, "-c", code, "split", "serve", str(signed), "--port", str(port),
               "--token-env", "SPLIT_TOKEN", "--key-env", "SPLIT_KEY", "--max-batch", "4", "--read-timeout", "5"]
    clean = {k: v for k, v in os.environ.items() if k not in ("SPLIT_TOKEN", "SPLIT_KEY")}
    missing = subprocess.run(command, capture_output=True, text=True, env={**clean, "SPLIT_KEY": KEY})
    assert missing.returncode != 0 and "SPLIT_TOKEN is not set" in missing.stdout + missing.stderr
    wrong_key = subprocess.run(command, capture_output=True, text=True,
                               env={**clean, "SPLIT_KEY": KEY + "x", "SPLIT_TOKEN": "abc"})
    assert wrong_key.returncode == 2 and "does not match this key" in wrong_key.stdout + wrong_key.stderr
    server = subprocess.Popen(command, env={**clean, "SPLIT_TOKEN": "abc", "SPLIT_KEY": KEY},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.2)
        body = encode(torch.randn(1, 2, 4, 4))
        with httpx.Client(timeout=60) as http:  # a hang guard: httpx's default 5 s is a clock a busy machine can beat
            assert http.post(url + "/infer", content=body, headers={"content-type": "application/octet-stream"}
                             ).status_code == 401
            ok = http.post(url + "/infer", content=body, headers={"content-type": "application/octet-stream",
                                                                  "authorization": "Bearer abc"})
            assert ok.status_code == 200 and len(ok.json()["logits"][0]) == 5
            too_many = http.post(url + "/infer", content=encode(torch.randn(5, 2, 4, 4)),
                                 headers={"content-type": "application/octet-stream", "authorization": "Bearer abc"})
            assert too_many.status_code == 413 and http.get(url + "/health").json()["status"] == "ok"
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_server_limit_above_1024_serves_such_batches_instead_of_a_500(artifact):
    """The loaded tail has no batch cap of its own: the server's --max-batch is the one limit."""
    from fastapi.testclient import TestClient

    tail, manifest = load_part(artifact, "tail")
    app = create_app(tail, manifest, ServerConfig(max_batch=2048, max_payload_bytes=10**6))
    answer = TestClient(app).post("/infer", content=encode(torch.randn(1100, 2, 4, 4)),
                                  headers={"content-type": "application/octet-stream"})
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["logits"]) == 1100


def test_raise_open_file_limit_raises_only_a_lower_soft_limit_and_names_a_hard_limit_too_low(monkeypatch):
    import resource

    from edgetorch.split import local_server

    limits, calls = {"now": (1024, 4096)}, []
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: calls.append((which, value)))
    local_server.raise_open_file_limit(3000)
    local_server.raise_open_file_limit(1000)  # already enough: left alone
    assert calls == [(resource.RLIMIT_NOFILE, (3000, 4096))]
    limits["now"] = (1024, resource.RLIM_INFINITY)
    local_server.raise_open_file_limit(100_000)
    assert calls[-1] == (resource.RLIMIT_NOFILE, (100_000, resource.RLIM_INFINITY))
    limits["now"] = (1024, 2048)
    with pytest.raises(local_server.OpenFileLimitError, match="3000 open files are needed .* hard open-file limit is 2048"):
        local_server.raise_open_file_limit(3000)
    assert len(calls) == 2


def test_serve_in_process_serves_the_tail_in_its_own_process_until_the_block_ends(artifact, tmp_path):
    import psutil

    from edgetorch.split.local_server import ServerStartError, serve_in_process

    body = encode(torch.randn(1, 2, 4, 4))
    headers = {"content-type": "application/octet-stream"}
    with serve_in_process(artifact, "abc", 5.0) as target:
        assert target.server_pid != os.getpid() and target.host == "127.0.0.1"
        with httpx.Client(base_url=target.url, timeout=60) as http:
            assert http.post("/infer", content=body, headers=headers).status_code == 401
            ok = http.post("/infer", content=body, headers={**headers, "authorization": target.auth})
            assert ok.status_code == 200 and len(ok.json()["logits"][0]) == 5
    assert not psutil.pid_exists(target.server_pid) or psutil.Process(target.server_pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(ServerStartError, match="exited with code"):
        with serve_in_process(tmp_path / "missing", "abc", 5.0):
            pass
