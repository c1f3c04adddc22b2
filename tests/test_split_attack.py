"""Attacks on the split artifact loader by someone who controls every byte of the directory.

Each test plants one attack and asserts the safe outcome: a ``SplitArtifactError`` that says what
was wrong (never another exception type, a hang, a large allocation or code from the artifact).
The artifact is a tiny ResNet-18 student at 32 px; ONNX heads are built by hand with ``onnx``.
"""

from __future__ import annotations

import hmac
import io
import json
import os
import pickle
import re
import resource
import shutil
import stat
import struct
from pathlib import Path

import httpx
import pytest
from _bounded import MEMORY_BOUND, raised_without_hanging, run_child, run_children
from _tamper import edit_manifest, rehash
import torch
import torchvision
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgetorch.split import SplitArtifactError, inject_bottleneck, load, save
from edgetorch.split import artifact as artifact_files
from edgetorch.split import onnx_head
from edgetorch.split.artifact import load_part, read_manifest
from edgetorch.split.manifest import SplitManifest, manifest_hmac
from edgetorch.split.onnx_head import load_onnx_head

KEY = "0123456789abcdef-attack-key"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("artifact")
    save(inject_bottleneck(torchvision.models.resnet18(num_classes=5), 2, "sp2"), out, 32)
    return out


@pytest.fixture(scope="module")
def signed(tmp_path_factory, artifact):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("signed")
    save(inject_bottleneck(torchvision.models.resnet18(num_classes=5), 2, "sp2"), out, 32, key=KEY)
    return out


@pytest.fixture()
def copy_of(artifact, tmp_path):
    return shutil.copytree(artifact, tmp_path / "copy")


def _put(directory: Path, name: str, data: bytes) -> None:
    (directory / name).unlink(missing_ok=True)
    (directory / name).write_bytes(data)
    rehash(directory)


def _refused(directory: Path, match: str | None, loader=load) -> SplitArtifactError:
    with pytest.raises(SplitArtifactError, match=match) as info:
        loader(directory)
    return info.value


# --------------------------------------------------------------------------------------------
# Pickles: nothing in an artifact is ever unpickled


class _Plant:
    """Unpickling this creates a file: the shape of an attack that runs code at load."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.touch, (self.sentinel,))


def _no_unpickling(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("an artifact load reached an unpickling loader")

    for target, name in ((torch, "load"), (torch.export, "load"), (torch.jit, "load"), (pickle, "loads"),
                         (pickle, "load"), (pickle, "Unpickler")):
        monkeypatch.setattr(target, name, refuse)


def test_the_plant_is_live(tmp_path):
    """Control: the planted pickle does run code when something unpickles it."""
    sentinel = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"w": _Plant(sentinel)}, buffer)
    torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert sentinel.exists()


@pytest.mark.parametrize("plant", ["beside", "as_weights", "in_metadata", "as_v1", "as_onnx", "in_onnx_metadata"])
def test_planted_pickles_never_run_and_no_unpickler_is_called(copy_of, tmp_path, monkeypatch, plant):
    sentinel = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"weight": _Plant(sentinel)}, buffer)
    blob = buffer.getvalue()
    _no_unpickling(monkeypatch)
    if plant == "beside":  # loader must ignore every name but its own
        for name in ("head.pt", "tail.pth", "pytorch_model.bin", "head.pt2", "tail.pt2", "model.pkl"):
            (copy_of / name).write_bytes(blob)
        head, tail = load(copy_of)
        assert tail(head(torch.rand(1, 3, 32, 32))).shape == (1, 5)
    elif plant == "as_weights":
        _put(copy_of, "head.safetensors", blob)
        _put(copy_of, "tail.safetensors", blob)
        _refused(copy_of, "not a safetensors file")
    elif plant == "in_metadata":  # metadata is str -> str and never interpreted
        from safetensors.torch import load as st_load, save as st_save

        tensors = st_load((copy_of / "head.safetensors").read_bytes())
        _put(copy_of, "head.safetensors", st_save(tensors, metadata={"pickle": blob.hex(), "p2": blob.decode("latin1")}))
        head, _ = load_part(copy_of, "head")
        assert head(torch.rand(1, 3, 32, 32)).shape == (1, 2, 4, 4)
    elif plant == "as_v1":  # the old torch.export format, whose loader unpickles
        (copy_of / "head.pt2").write_bytes(blob)
        (copy_of / "tail.pt2").write_bytes(blob)
        edit_manifest(copy_of, lambda m: m.update(manifest_version=1))
        _refused(copy_of, "no longer read. Export again")
    elif plant == "as_onnx":
        pytest.importorskip("onnxruntime")
        _refused(_with_onnx(copy_of, blob), "not an ONNX model|does not load in onnxruntime", load_onnx_head)
    else:  # a pickle in the model's doc string and metadata: data, never interpreted
        onnx = pytest.importorskip("onnx")
        pytest.importorskip("onnxruntime")
        model = onnx.load_from_string(_onnx_head())
        model.doc_string = blob.decode("latin1")
        model.metadata_props.add(key="pickle", value=blob.hex())
        head, _ = load_onnx_head(_with_onnx(copy_of, model.SerializeToString()))
        assert head(torch.rand(1, 3, 32, 32)).shape == (1, 2, 4, 4)
    assert not sentinel.exists()


# --------------------------------------------------------------------------------------------
# safetensors headers


def _st(header: dict | None, data: bytes = b"", *, raw: bytes | None = None, length: int | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def _from_head(artifact: Path, change) -> bytes:
    from safetensors.torch import load as st_load, save as st_save

    tensors = st_load((artifact / "head.safetensors").read_bytes())
    return st_save(change(tensors))


def _first_float(tensors) -> str:
    return next(k for k, v in tensors.items() if v.is_floating_point() and v.dim() > 1)


def _set(tensors, name, value):
    tensors[name] = tensors[name].fill_(value)
    return tensors


_F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}

SAFETENSORS_ATTACKS = {
    "header length 2**63": (lambda a: struct.pack("<Q", 2**63) + (a / "head.safetensors").read_bytes()[8:],
                            "header too large"),
    "header length past the end": (lambda a: _st(None, raw=b"{}", length=10**6), "invalid header length"),
    "header length 0": (lambda a: _st(None, raw=b"", length=0), "not a safetensors file"),
    "overlapping offsets": (lambda a: _st({"a": _F32x2, "b": _F32x2}, bytes(8)), "invalid offset"),
    "offsets past the data": (lambda a: _st({"a": {**_F32x2, "data_offsets": [0, 64]}}, bytes(8)), "not a safetensors"),
    "gap in the data": (lambda a: _st({"a": {**_F32x2, "data_offsets": [8, 16]}}, bytes(16)), "invalid offset"),
    "shape/offset mismatch": (lambda a: _st({"a": {**_F32x2, "shape": [3]}}, bytes(8)), "invalid shape"),
    "shape overflow": (lambda a: _st({"a": {**_F32x2, "shape": [2**32, 2**32]}}, bytes(8)), "overflow"),
    "zero-size with a 10**18 dim": (lambda a: _st({"a": {"dtype": "F32", "shape": [0, 10**18, 10**18],
                                                         "data_offsets": [0, 0]}}), "not a safetensors"),
    "duplicate keys": (lambda a: _st(None, bytes(16), raw=b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                                                        b'"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}'),
                       "invalid offset"),
    "non-UTF-8 header": (lambda a: _st(None, bytes(8), raw=b'{"a\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
                         "invalid UTF-8"),
    "deeply nested header": (lambda a: _st(None, raw=b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
                             "invalid JSON"),
    "unknown dtype": (lambda a: _st({"a": {**_F32x2, "dtype": "XYZ"}}, bytes(8)), "unknown variant"),
    # These dtypes parse in safetensors but have no torch dtype: safetensors.torch raised KeyError.
    "F4 zero-size (was KeyError)": (lambda a: _st({"a": {"dtype": "F4", "shape": [0], "data_offsets": [0, 0]}}),
                                    "not a safetensors file .*F4"),
    "F8_E8M0 zero-size (was KeyError)": (lambda a: _st({"a": {"dtype": "F8_E8M0", "shape": [0],
                                                              "data_offsets": [0, 0]}}), "F8_E8M0"),
    "extra tensor": (lambda a: _from_head(a, lambda t: {**t, "evil": torch.zeros(1)}), r"unexpected \['evil'\]"),
    "missing tensor": (lambda a: _from_head(a, lambda t: {k: v for k, v in t.items() if k != _first_float(t)}),
                       r"missing \['encoder"),
    "dtype mismatch": (lambda a: _from_head(a, lambda t: {k: v.double() if v.is_floating_point() else v
                                                          for k, v in t.items()}), "float64 .* needs torch.float32"),
    "shape mismatch": (lambda a: _from_head(a, lambda t: {k: v.flatten() if v.dim() > 1 else v for k, v in t.items()}),
                       "the model needs torch.float32"),
    "NaN weight": (lambda a: _from_head(a, lambda t: _set(t, _first_float(t), float("nan"))), "holds inf or NaN"),
    "inf weight": (lambda a: _from_head(a, lambda t: _set(t, _first_float(t), float("-inf"))), "holds inf or NaN"),
}


@pytest.mark.parametrize("attack", SAFETENSORS_ATTACKS)
def test_safetensors_header_attacks_are_refused(artifact, copy_of, attack):
    make, match = SAFETENSORS_ATTACKS[attack]
    _put(copy_of, "head.safetensors", make(artifact))
    _refused(copy_of, match)


def test_finite_weights_that_give_nan_are_caught_at_inference(artifact, copy_of):
    """Finite weights can still produce NaN (a negative BatchNorm variance): loading cannot tell,
    but the client refuses to encode a non-finite bottleneck and the server refuses to answer
    non-finite logits, each with its own error instead of sending or returning NaN."""
    from fastapi.testclient import TestClient
    from safetensors.torch import load as st_load, save as st_save

    from edgetorch.split.payload import PayloadError, encode
    from edgetorch.split.server import ServerConfig, create_app

    for part in ("head", "tail"):
        tensors = st_load((artifact / f"{part}.safetensors").read_bytes())
        for name in tensors:
            if name.endswith("running_var"):
                tensors[name].fill_(-1.0)
        _put(copy_of, f"{part}.safetensors", st_save(tensors))
    head, tail = load(copy_of)
    bottleneck = head(torch.rand(2, 3, 32, 32))
    assert not torch.isfinite(bottleneck).all()
    with pytest.raises(PayloadError):
        encode(bottleneck)
    app = create_app(tail, read_manifest(copy_of), ServerConfig())
    answer = TestClient(app).post("/infer", content=encode(torch.rand(2, 2, 4, 4)),
                                  headers={"content-type": "application/octet-stream"})
    assert answer.status_code == 422 and answer.json()["error"]["type"] == "non_finite_output", answer.text


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(dtype=st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "U8", "BOOL", "F4", "F6_E2M3", "F8_E8M0",
                              "F8_E4M3", "C64", "U64"]),
       shape=st.lists(st.integers(0, 2**40), max_size=4), start=st.integers(0, 64), end=st.integers(0, 64),
       size=st.integers(0, 64), name=st.text(max_size=4))
def test_fuzzed_safetensors_headers_only_raise_split_artifact_error(artifact, tmp_path_factory, dtype, shape,
                                                                    start, end, size, name):
    directory = tmp_path_factory.mktemp("fuzz")
    os.link(artifact / "tail.safetensors", directory / "tail.safetensors")
    (directory / "manifest.json").write_bytes((artifact / "manifest.json").read_bytes())
    _put(directory, "head.safetensors", _st({name: {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}},
                                            bytes(size)))
    _refused(directory, None, lambda d: load_part(d, "head"))


# --------------------------------------------------------------------------------------------
# manifest.json


def _huge_int(d: Path) -> None:
    path = d / "manifest.json"
    path.write_text(path.read_text().replace('"num_classes": 5', '"num_classes": ' + "9" * 5000, 1))


def _resolution(d: Path, px: int) -> None:
    edit_manifest(d, lambda m: (m.update(input_shape=[3, px, px]), m["preprocess"].update(size=[px, px])))


MANIFEST_ATTACKS = {
    "deeply nested": (lambda d: (d / "manifest.json").write_text("[" * 100_000 + "]" * 100_000), "not JSON"),
    "nested in a field": (lambda d: edit_manifest(d, lambda m: m["model"].update(x="@")) or (d / "manifest.json").write_text(
        (d / "manifest.json").read_text().replace('"@"', "[" * 50_000 + "]" * 50_000)), "not JSON"),
    # Python refuses to parse an int of > 4300 digits with a plain ValueError, not JSONDecodeError.
    "5000-digit integer (was ValueError)": (_huge_int, "not JSON .*4300 digits"),
    "over 1 MiB": (lambda d: (d / "manifest.json").write_text(" " * (2 << 20) + "{}"), "over the 1048576-byte limit"),
    "not UTF-8": (lambda d: (d / "manifest.json").write_bytes(b"\xff\xfe" + (d / "manifest.json").read_bytes()),
                  "not JSON"),
    "a list": (lambda d: (d / "manifest.json").write_text("[]"), "must hold a JSON object"),
    "10**30 channels": (lambda d: edit_manifest(d, lambda m: m["model"].update(channels=10**30)), "cannot be built"),
    "10**30 px": (lambda d: _resolution(d, 10**30), "at most 4096 px"),
    "10**30 input channels": (lambda d: edit_manifest(d, lambda m: m.update(input_shape=[10**30, 32, 32])), "cannot be built"),
    "10**30 classes": (lambda d: edit_manifest(d, lambda m: m["model"].update(num_classes=10**30)), "num_classes must be"),
    "negative channels": (lambda d: edit_manifest(d, lambda m: m["model"].update(channels=-2)), "cannot be built"),
    "zero classes": (lambda d: edit_manifest(d, lambda m: m.update(num_classes=0)), "positive integer"),
    "float shape": (lambda d: edit_manifest(d, lambda m: m.update(bottleneck_shape=[2, 4.0, 4])), "positive integer"),
    "bool channels": (lambda d: edit_manifest(d, lambda m: m["model"].update(channels=True)), "cannot be built"),
    "string channels": (lambda d: edit_manifest(d, lambda m: m["model"].update(channels="2")), "cannot be built"),
    "NaN mean": (lambda d: edit_manifest(d, lambda m: m["preprocess"].update(mean=[float("nan")])), "mean must be finite"),
    "unknown arch": (lambda d: edit_manifest(d, lambda m: m["model"].update(arch="__import__('os')")), "unknown arch"),
    "unknown split point": (lambda d: edit_manifest(d, lambda m: m["model"].update(split_point="sp9")), "cannot be built"),
    "unknown architecture": (lambda d: edit_manifest(d, lambda m: m["model"].update(architecture="x")), "cannot be built"),
    "another format": (lambda d: edit_manifest(d, lambda m: m.update(format="torch-export")), "is not supported"),
    "version 4": (lambda d: edit_manifest(d, lambda m: m.update(manifest_version=4)), "version 4 is not supported"),
    # 2.0 == 2 and True == 1 in Python: a float or bool version used to be taken for 2 (or 1).
    "version 2.0 (was accepted)": (lambda d: edit_manifest(d, lambda m: m.update(manifest_version=2.0)), "version 2.0 is not"),
    "version true": (lambda d: edit_manifest(d, lambda m: m.update(manifest_version=True)), "version True is not"),
    "path traversal": (lambda d: edit_manifest(d, lambda m: m["files"]["tail"].update(path="../tail.safetensors")),
                       "tail must be tail.safetensors"),
    "absolute path": (lambda d: edit_manifest(d, lambda m: m["files"]["tail"].update(path="/etc/passwd")),
                      "tail must be tail.safetensors"),
    "NUL in path": (lambda d: edit_manifest(d, lambda m: m["files"]["head"].update(path="head.safetensors\x00.x")),
                    "head must be head.safetensors"),
    "look-alike path": (lambda d: edit_manifest(d, lambda m: m["files"]["head"].update(path="head\u2024safetensors")),
                        "head must be head.safetensors"),
    "fullwidth path": (lambda d: edit_manifest(d, lambda m: m["files"]["head"].update(path="ｈｅａｄ.safetensors")),
                       "head must be head.safetensors"),
    "another format name": (lambda d: edit_manifest(d, lambda m: m["files"]["head"].update(format="pickle")),
                            "head must be head.safetensors"),
    "extra part": (lambda d: edit_manifest(d, lambda m: m["files"].update(evil={"path": "x", "sha256": "", "format": "x"})),
                   "files must list head and tail"),
    # compare_digest raises TypeError for str with non-ASCII characters.
    "non-ASCII sha256 (was TypeError)": (lambda d: edit_manifest(d, lambda m: m["files"]["head"].update(sha256="é" * 64)),
                                         "SHA-256 does not match"),
    "lone surrogate sha256": (lambda d: edit_manifest(d, lambda m: m["files"]["head"].update(sha256="\ud800" * 64)),
                              "malformed field .*surrogates not allowed"),
    # A lone surrogate cannot be printed: `split infer` died with UnicodeEncodeError on the names.
    "lone surrogate class name": (lambda d: edit_manifest(d, lambda m: m.update(class_names=["a", "b", "c", "d", "\ud800"])),
                                  "malformed field .*surrogates not allowed"),
    "class names of another count": (lambda d: edit_manifest(d, lambda m: m.update(class_names=["a"])), "class_names must be"),
    "unknown field": (lambda d: edit_manifest(d, lambda m: m.update(code="print(1)")), "missing or unknown"),
}


@pytest.mark.parametrize("attack", MANIFEST_ATTACKS)
def test_manifest_attacks_are_refused(copy_of, attack):
    make, match = MANIFEST_ATTACKS[attack]
    make(copy_of)
    raised = raised_without_hanging(lambda: load(copy_of), f"load still running on {attack!r}")
    assert isinstance(raised, SplitArtifactError) and re.search(match, str(raised)), raised


# --------------------------------------------------------------------------------------------
# The file system: links, special files, sizes, files that change while read


def _outside(d: Path, name: str) -> Path:
    target = d.parent / f"outside-{name}"
    shutil.move(d / name, target)
    return target


@pytest.mark.parametrize("name", ["manifest.json", "head.safetensors", "tail.safetensors"])
def test_symlinks_are_refused_even_to_the_right_bytes(copy_of, name):
    (copy_of / name).symlink_to(_outside(copy_of, name))
    _refused(copy_of, "symlinks are refused")


def test_a_hardlink_is_an_ordinary_file_whose_hash_must_match(copy_of, tmp_path):
    """A hard link cannot be told from the file itself: it loads only if its bytes are the ones
    the manifest hashes, so a link to any other file (e.g. a secret) is refused without its
    content appearing in the message."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-VALUE")
    os.link(_outside(copy_of, "head.safetensors"), copy_of / "head.safetensors")
    load(copy_of)
    (copy_of / "tail.safetensors").unlink()
    os.link(secret, copy_of / "tail.safetensors")
    error = _refused(copy_of, "SHA-256 does not match")
    assert "TOP-SECRET" not in str(error)


@pytest.mark.parametrize("name", ["manifest.json", "head.safetensors"])
def test_a_directory_instead_of_a_file_is_refused(copy_of, name):
    """fdopen raised IsADirectoryError before the regular-file check ran."""
    (copy_of / name).unlink()
    (copy_of / name).mkdir()
    _refused(copy_of, "is not a regular file")


@pytest.mark.parametrize("name", ["manifest.json", "head.safetensors", "tail.safetensors"])
def test_a_fifo_does_not_hang_the_loader(copy_of, name):
    """Opening a FIFO for reading blocks until a writer comes: the loader hung forever."""
    (copy_of / name).unlink()
    os.mkfifo(copy_of / name)
    raised = raised_without_hanging(lambda: load(copy_of), f"load blocked on a FIFO named {name}",
                                    release=lambda: os.close(os.open(copy_of / name, os.O_WRONLY | os.O_NONBLOCK)))
    assert isinstance(raised, SplitArtifactError) and "not a regular file" in str(raised), raised


def test_a_device_node_is_refused(copy_of):
    (copy_of / "head.safetensors").unlink()
    try:
        os.mknod(copy_of / "head.safetensors", stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null
    except (PermissionError, OSError):
        pytest.skip("cannot create a device node here (needs CAP_MKNOD)")
    _refused(copy_of, "not a regular file")


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _bytes_read() -> int:
    """Bytes this process has read so far (read(2) and friends, from any file; Linux's rchar)."""
    return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])


@pytest.mark.parametrize("name", ["head.safetensors", "tail.safetensors", "head.onnx"])
def test_a_sparse_terabyte_file_is_refused_before_it_is_read(copy_of, name):
    """The weight files had no size limit: a 1 TB sparse file (no disk used) was read whole,
    MemoryError at best. Now a file is refused when larger than the manifest's model needs."""
    if name == "head.onnx":
        edit_manifest(copy_of, lambda m: m["files"].update(head_onnx={"path": "head.onnx", "format": "onnx", "sha256": "0"}))
    with open(copy_of / name, "ab") as f:
        f.truncate(1 << 40)
    before, read_before = _max_rss_bytes(), _bytes_read()

    def refuse() -> None:
        _refused(copy_of, r"1099511627776 bytes, over the \d+-byte limit for this manifest's model", read_manifest)
        if name != "head.onnx":
            _refused(copy_of, "over the", load)

    failed = raised_without_hanging(refuse, f"still reading the sparse {name}")
    assert failed is None, failed
    # Read: the manifest and at most the valid parts (85 MB for the ONNX case), not the terabyte.
    assert _max_rss_bytes() - before < 64 << 20 and _bytes_read() - read_before < MEMORY_BOUND


def test_a_manifest_declaring_a_huge_model_allocates_nothing_before_refusing(copy_of):
    """A 10**6-class tail is 2 GB of float32; the manifest says so, the file is 0.5 MB. The layers
    are built on the meta device, so the refusal comes without allocating them."""
    edit_manifest(copy_of, lambda m: (m["model"].update(num_classes=10**6), m.update(num_classes=10**6)))
    before = _max_rss_bytes()
    _refused(copy_of, r"tail weight classifier.2.* needs torch.float32 \[1000000")
    edit_manifest(copy_of, lambda m: (m["model"].update(num_classes=5, channels=10**6), m.update(
        num_classes=5, bottleneck_shape=[10**6, 4, 4])))  # a 2.3 GB head
    _refused(copy_of, r"needs 2308187152 bytes of weights, over the 2147483648 an artifact part may have")
    assert _max_rss_bytes() - before < 64 << 20


def _warm_load(artifact: Path, onnx: Path | None = None) -> str:
    """The child's warm-up: the same loader on the valid artifact."""
    if onnx is not None:
        return f"edgetorch.split.load_onnx_head({str(onnx)!r})[0](torch.rand(1, 3, 32, 32))"
    return f"edgetorch.split.artifact.load_part({str(artifact)!r}, 'tail')"


def test_manifests_claiming_huge_parts_are_refused_in_bounded_memory(copy_of, artifact, tmp_path):
    """channels = 10**9 raised the allowed file size to ~2 TB and the reader allocated it up front
    (MemoryError from `split serve`): the manifest's claims now meet a fixed limit before any file is
    read. Within the limit (resnet18 with 200,000 classes: a 0.4 GB tail) the bytes are hashed in
    chunks before they are held: a sparse file of that size beside an unsigned manifest cost 2.5 GB
    RSS before. One fresh process, its peak reset before each case."""
    bodies, expected = {}, {}
    for channels in (10**6, 10**9):
        directory = shutil.copytree(copy_of, tmp_path / str(channels))
        edit_manifest(directory, lambda m: (m["model"].update(channels=channels),
                                            m.update(bottleneck_shape=[channels, 4, 4])))
        (directory / "tail.safetensors").unlink()  # nothing is read: a missing file is not even noticed
        bodies[f"channels={channels}"] = f"edgetorch.split.artifact.load_part({str(directory)!r}, 'tail')"
        expected[f"channels={channels}"] = "bytes of weights, over the 2147483648 an artifact part may have"
    edit_manifest(copy_of, lambda m: (m["model"].update(num_classes=200_000), m.update(num_classes=200_000,
                                                                                        class_names=None)))
    limit = artifact_files._size_limit(artifact_files.skeleton(read_manifest_unchecked(copy_of)), "tail")
    assert limit > MEMORY_BOUND  # holding the file would fail the bound
    with open(copy_of / "tail.safetensors", "wb") as f:
        f.truncate(limit)  # sparse: no disk, all zeros
    bodies["sparse tail"] = f"edgetorch.split.artifact.load_part({str(copy_of)!r}, 'tail')"
    expected["sparse tail"] = "SHA-256 does not match the manifest"
    for case, outcome in run_children(bodies, warm=_warm_load(artifact)).items():
        outcome.refused_with("SplitArtifactError", expected[case])


def read_manifest_unchecked(directory: Path) -> SplitManifest:
    return SplitManifest.from_json((directory / "manifest.json").read_text())


@pytest.mark.parametrize("name", ["\x1b[31mred", "two\nlines", "\u202eevil", "tab\there", "nul\x00"],
                         ids=["ansi", "newline", "bidi-override", "tab", "nul"])
def test_class_names_with_control_characters_are_refused(copy_of, name):
    """Names are printed on the device's terminal: an ANSI escape went out raw, a newline forged lines."""
    edit_manifest(copy_of, lambda m: m.update(class_names=[name, "b", "c", "d", "e"]))
    _refused(copy_of, "holds the control character U\\+00|holds the control character U\\+202E")


def test_each_file_is_opened_once_and_parsed_from_the_hashed_bytes(copy_of, monkeypatch, artifact):
    """TOCTOU: swap every file right after it is opened; the load uses what was hashed."""
    opened: dict[str, int] = {}
    junk = (artifact / "tail.safetensors").read_bytes()

    def swap(path):
        opened[path.name] = opened.get(path.name, 0) + 1
        path.unlink()
        path.write_bytes(junk if path.suffix == ".safetensors" else b"{}")  # a swapped file on disk

    def read_then_swap(path, *args, **kwargs):
        data = real_read(path, *args, **kwargs)
        swap(path)
        return data

    def open_then_swap(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        swap(path)
        return f

    real_read, real_open = artifact_files.read_bytes, artifact_files.open_regular
    monkeypatch.setattr(artifact_files, "read_bytes", read_then_swap)
    monkeypatch.setattr(artifact_files, "open_regular", open_then_swap)
    head, tail = load(copy_of)
    assert opened == {"manifest.json": 1, "head.safetensors": 1, "tail.safetensors": 1}
    monkeypatch.undo()
    reference_head, reference_tail = load(artifact)
    x = torch.rand(2, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(tail(head(x)), reference_tail(reference_head(x)))


def test_a_file_rewritten_in_place_between_hash_and_read_is_refused(copy_of, monkeypatch):
    """The bytes are hashed in chunks, then read and hashed again: what is parsed is what was hashed."""
    real_check = artifact_files._check_digest

    def check_then_rewrite(path, digest, entry):
        real_check(path, digest, entry)
        with open(path, "r+b") as f:  # same inode: the open descriptor sees the new bytes
            f.seek(100)
            f.write(b"tampered")

    monkeypatch.setattr(artifact_files, "_check_digest", check_then_rewrite)
    _refused(copy_of, "SHA-256 does not match the manifest")


def test_a_file_that_grows_after_its_size_is_checked_is_still_capped(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(bytes(4096))
    real_fstat = os.fstat

    def fstat_before_growth(fd):  # what fstat saw before the attacker appended
        info = real_fstat(fd)
        return os.stat_result((info.st_mode, info.st_ino, info.st_dev, info.st_nlink, info.st_uid, info.st_gid,
                               10, int(info.st_atime), int(info.st_mtime), int(info.st_ctime)))

    monkeypatch.setattr(os, "fstat", fstat_before_growth)
    with pytest.raises(SplitArtifactError, match="grew past the 100-byte limit"):
        artifact_files.read_bytes(path, 100, error=SplitArtifactError)


# --------------------------------------------------------------------------------------------
# HMAC


def _sign_as(directory: Path, key: str) -> None:
    from dataclasses import replace

    manifest = replace(SplitManifest.from_json((directory / "manifest.json").read_text()), signature=None)
    (directory / "manifest.json").write_text(
        replace(manifest, signature=manifest_hmac(manifest, key)).to_json())


@pytest.mark.parametrize("signature, match", [
    (None, "not signed, but a key was given"),
    ("", "does not match this key"),
    ("00", "does not match this key"),
    ("zz" * 32, "does not match this key"),
    ("é" * 64, "does not match this key"),  # compare_digest raised TypeError (non-ASCII str)
    ("\ud800" * 64, "malformed field .*surrogates not allowed"),
    ("A" * 10_000, "does not match this key"),
], ids=["missing", "empty", "short", "not-hex", "non-ascii", "lone-surrogate", "10k-chars"])
def test_bad_signatures_are_refused(signed, tmp_path, signature, match):
    directory = shutil.copytree(signed, tmp_path / "s")
    edit_manifest(directory, lambda m: m.update(signature=signature))
    _refused(directory, match, lambda d: load(d, key=KEY))


def test_a_signed_artifact_with_swapped_or_altered_files_is_refused(signed, tmp_path):
    directory = shutil.copytree(signed, tmp_path / "s")
    head, tail = (directory / "head.safetensors").read_bytes(), (directory / "tail.safetensors").read_bytes()
    (directory / "head.safetensors").write_bytes(tail)
    (directory / "tail.safetensors").write_bytes(head)
    _refused(directory, "SHA-256 does not match|do not fit", lambda d: load(d, key=KEY))  # hashes left alone
    rehash(directory)  # hashes fixed, signature not: only the key can tell
    _refused(directory, "does not match this key", lambda d: load(d, key=KEY))
    _sign_as(directory, "another-key-of-16-bytes-or-more")  # re-signed with the attacker's own key
    _refused(directory, "does not match this key", lambda d: load(d, key=KEY))


def test_the_signature_is_compared_in_constant_time(signed, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    manifest = read_manifest(signed, key=KEY)
    assert any(manifest.signature.encode() in pair for pair in calls)  # the signature went through it
    assert all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in calls)


def test_a_short_key_is_refused_as_a_caller_error(signed):
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load(signed, key="short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load(signed, key=b"")


def test_reformatting_a_signed_manifest_keeps_its_meaning_and_its_signature(signed, tmp_path):
    """The HMAC covers the parsed fields (canonical JSON), so whitespace and key order are free,
    but no value can change."""
    directory = shutil.copytree(signed, tmp_path / "s")
    raw = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps(dict(reversed(list(raw.items())))))
    load(directory, key=KEY)
    edit_manifest(directory, lambda m: m.update(class_names=list("abcde")))
    _refused(directory, "does not match this key", lambda d: load(d, key=KEY))


# --------------------------------------------------------------------------------------------
# ONNX heads (built by hand: a 1x1 convolution to 2 channels and an average pool that give the
# manifest's [2, 4, 4], operators a bottleneck head uses)


def _onnx_head(*, pool: int = 8, declared: list | None = None, extra_nodes=(), extra_inits=(),
               final: str = "bottleneck", domain: str | None = None, px: int = 32, symbolic_input: bool = False) -> bytes:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    image = helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, "h", "w"] if symbolic_input
                                          else ["batch", 3, px, px])
    out = helper.make_tensor_value_info("bottleneck", TensorProto.FLOAT, declared or ["batch", 2, px // pool, px // pool])
    inits = [numpy_helper.from_array(np.ones((2, 3, 1, 1), np.float32), "w1x1"),
             numpy_helper.from_array(np.ones((2, 2, 1, 1), np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["image", "w1x1"], ["sliced"], kernel_shape=[1, 1]),
             helper.make_node("AveragePool", ["sliced"], [final], kernel_shape=[pool] * 2, strides=[pool] * 2),
             *extra_nodes]
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(helper.make_graph(nodes, "head", [image], [out], initializer=[*inits, *extra_inits]),
                              opset_imports=opsets)
    model.ir_version = 8
    return model.SerializeToString()


def _external(name: str, location: str):
    from onnx import TensorProto

    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[2, 4, 4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", "128")):
        tensor.external_data.add(key=key, value=value)
    return tensor


def _int64s(name: str, values: list[int]):
    import numpy as np
    from onnx import numpy_helper

    return numpy_helper.from_array(np.array(values, np.int64), name)


def _add(name: str) -> list:
    from onnx import helper

    return [helper.make_node("Add", ["pooled", name], ["bottleneck"])]


def _external_in_subgraph():
    from onnx import TensorProto, helper, numpy_helper
    import numpy as np

    def branch(tag):
        value = helper.make_tensor_value_info(f"v{tag}", TensorProto.FLOAT, [2, 4, 4])
        return helper.make_graph([helper.make_node("Constant", [], [f"v{tag}"], value=_external(f"c{tag}", "/etc/passwd"))],
                                 f"b{tag}", [], [value])

    cond = numpy_helper.from_array(np.array(True), "cond")
    node = helper.make_node("If", ["cond"], ["w"], then_branch=branch(1), else_branch=branch(2))
    return _onnx_head(final="pooled", extra_nodes=[node, *_add("w")], extra_inits=[cond])


def _onnx_attacks():
    from onnx import TensorProto, helper

    huge = TensorProto(name="huge", data_type=TensorProto.FLOAT, dims=[10**9], raw_data=bytes(16))  # 4 GB declared
    return {
        "external initializer": (lambda: _onnx_head(final="pooled", extra_nodes=_add("w"),
                                                    extra_inits=[_external("w", "/etc/passwd")]), "external data"),
        # Only initializers were checked: a Constant node's value or a subgraph slipped through
        # (onnxruntime 1.32 then refuses it itself, older versions read the file).
        "external Constant value": (lambda: _onnx_head(final="pooled", extra_nodes=[
            helper.make_node("Constant", [], ["w"], value=_external("w", "secret.bin")), *_add("w")]), "external data"),
        "external data in an If branch": (_external_in_subgraph, "external data"),
        "custom op domain": (lambda: _onnx_head(final="pooled", domain="com.attacker", extra_nodes=[
            helper.make_node("Evil", ["pooled"], ["bottleneck"], domain="com.attacker")]), "uses operator com.attacker.Evil"),
        "huge declared initializer": (lambda: _onnx_head(final="pooled", extra_inits=[huge], extra_nodes=[
            helper.make_node("ReduceSum", ["huge"], ["total"], keepdims=0), *_add("total")]),
            "uses operator ai.onnx.ReduceSum"),
        # 500 bytes that allocated 2 GB at inference before the operator allowlist.
        "ConstantOfShape bomb": (lambda: _onnx_head(final="pooled", extra_inits=[_int64s("shape", [2**29])], extra_nodes=[
            helper.make_node("ConstantOfShape", ["shape"], ["big"]), *_add("big")]), "uses operator ai.onnx.ConstantOfShape"),
        "huge pads": (lambda: _onnx_head(final="pooled", extra_nodes=[
            helper.make_node("MaxPool", ["pooled"], ["bottleneck"], kernel_shape=[1, 1], pads=[10**6] * 4)]),
            r"pads \[1000000, 1000000, 1000000, 1000000\] exceeds 64"),
        "output shape not the manifest's": (lambda: _onnx_head(pool=4), r"one output \[N, 2, 4, 4\]"),
        "input shape not the manifest's": (lambda: _onnx_head(px=64, pool=16), r"one input \[N, 3, 32, 32\]"),
        "junk": (lambda: b"\x08\x07junk" * 8, "not an ONNX model"),
        # 2,342 bytes that reached 3.5 GB for one 32 px image: each padded conv grows the map by 128 px.
        "padded conv chain": (lambda: _onnx_head(final="pooled", extra_nodes=_padded_chain(40)),
                              r"values per image, over the \d+ that 3x this manifest's own head computes"),
        "120 padded convs": (lambda: _onnx_head(final="pooled", extra_nodes=_padded_chain(120)), "values per image"),
        # 5 MB of weights that peaked at 1.67 GB: a 1x1 conv of the image to 250,000 channels and back.
        "wide conv": (lambda: _onnx_head(final="pooled", extra_inits=[_ones("wide", (250_000, 3, 1, 1)),
                                                                      _ones("narrow", (2, 250_000, 1, 1))], extra_nodes=[
            helper.make_node("Conv", ["image", "wide"], ["wider"], kernel_shape=[1, 1]),
            helper.make_node("Conv", ["wider", "narrow"], ["back"], kernel_shape=[1, 1]),
            helper.make_node("AveragePool", ["back"], ["small"], kernel_shape=[8, 8], strides=[8, 8]),
            *_add("small")]), "values per image"),
        "symbolic input dims": (lambda: _onnx_head(symbolic_input=True), r"one input \[N, 3, 32, 32\]"),
        "too many nodes": (lambda: _onnx_head(final="i1000", extra_nodes=[
            helper.make_node("Identity", [f"i{k}" if k else "pooled"], [f"i{k + 1}" if k < 999 else "bottleneck"])
            for k in range(1000)]), "1002 nodes; a bottleneck head has at most 1000"),
    }


def _ones(name: str, shape: tuple[int, ...]):
    import numpy as np
    from onnx import numpy_helper

    return numpy_helper.from_array(np.ones(shape, np.float32), name)


def _padded_chain(count: int) -> list:
    """``count`` 1x1 convs on the 2-channel pooled map, each padded by 64 on every side, then pooled
    back to the manifest's [2, 4, 4] (the output check alone caught this only after running)."""
    from onnx import helper

    nodes, name = [], "pooled"
    for k in range(count):
        nodes.append(helper.make_node("Conv", [name, "w2"], [f"c{k}"], kernel_shape=[1, 1], pads=[64] * 4))
        name = f"c{k}"
    side, pools = 4 + 128 * count, []
    while side > 4:  # windows of at most 64, as the window check allows
        stride = 64 if side // 64 >= 4 else side // 4
        side //= stride
        pools.append(helper.make_node("MaxPool", [name], [name := f"p{len(pools)}"], kernel_shape=[stride] * 2,
                                      strides=[stride] * 2))
    return [*nodes, *pools, helper.make_node("Identity", [name], ["bottleneck"])]


def _with_onnx(directory: Path, blob: bytes) -> Path:
    (directory / "head.onnx").write_bytes(blob)
    edit_manifest(directory, lambda m: m["files"].update(head_onnx={"path": "head.onnx", "format": "onnx", "sha256": ""}))
    rehash(directory)
    return directory


def test_a_well_formed_onnx_head_loads(copy_of):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    head, _ = load_onnx_head(_with_onnx(copy_of, _onnx_head()))
    assert head(torch.rand(3, 3, 32, 32)).shape == (3, 2, 4, 4)


@pytest.mark.parametrize("attack", ["external initializer", "external Constant value", "external data in an If branch",
                                    "custom op domain", "huge declared initializer", "ConstantOfShape bomb", "huge pads",
                                    "output shape not the manifest's", "input shape not the manifest's", "junk",
                                    "padded conv chain", "120 padded convs", "wide conv", "symbolic input dims",
                                    "too many nodes"])
def test_onnx_attacks_are_refused(copy_of, attack):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    make, match = _onnx_attacks()[attack]
    _refused(_with_onnx(copy_of, make()), match, load_onnx_head)


def test_the_padded_conv_head_is_refused_before_it_runs_within_the_memory_bound(copy_of, artifact, tmp_path):
    """The 2,342-byte head that reached 3.5 GB RSS: refused at load, measured in a fresh process."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    make, _ = _onnx_attacks()["padded conv chain"]
    blob = make()
    assert len(blob) < 4096
    valid = _with_onnx(shutil.copytree(artifact, tmp_path / "valid"), _onnx_head())
    directory = _with_onnx(copy_of, blob)
    run_child(warm=_warm_load(artifact, valid), body=f"""
        head, _ = edgetorch.split.load_onnx_head({str(directory)!r})
        head(torch.rand(1, 3, 32, 32))
    """).refused_with("SplitArtifactError", "values per image")


def test_an_onnx_head_whose_output_is_not_the_manifests_is_refused_when_run():
    """Dims that shape inference leaves symbolic cannot be checked at load: each output is."""
    pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    session = onnxruntime.InferenceSession(_onnx_head(pool=4, declared=["batch", "c", "h", "w"]),
                                           providers=["CPUExecutionProvider"])
    head = onnx_head.OnnxHead(session, (3, 32, 32), (2, 4, 4))
    with pytest.raises(SplitArtifactError, match=r"gave \[1, 2, 8, 8\], the manifest's bottleneck is \[1, 2, 4, 4\]"):
        head(torch.rand(1, 3, 32, 32))


# --------------------------------------------------------------------------------------------
# The client reading a server's answer


@pytest.mark.parametrize("body", [b"<html>proxy</html>", b"[]", b'{"logits": "x"}', b'{"logits": [[1, 2], [3]]}',
                                  b'{"logits": [[0, 0, 0, 0, 0]], "timing": null}', b'{"logits": [[0, 0, 0, 0, 0]]}',
                                  b'{"logits": [[0, 0, 0, 0, 0]], "timing": {"decode_s": "x", "tail_s": 0}}'],
                         ids=["html", "list", "string-logits", "ragged", "null-timing", "no-timing", "string-time"])
def test_a_200_that_is_not_the_servers_json_is_a_client_error(artifact, body):
    """These raised KeyError/TypeError/JSONDecodeError: a traceback from `split infer`."""
    from edgetorch.split.client import SplitClient, SplitClientError

    client = SplitClient.from_dir(artifact, "http://server.invalid")
    client._http = httpx.Client(base_url="http://server.invalid",
                                transport=httpx.MockTransport(lambda request: httpx.Response(200, content=body)))
    with client, pytest.raises(SplitClientError, match="server answered 200 but not with"):
        client.infer(torch.rand(1, 3, 32, 32))


# --------------------------------------------------------------------------------------------
# Pinning an artifact by its id


def test_a_pinned_artifact_refuses_another_validly_signed_one(signed, tmp_path):
    """The HMAC proves who signed an artifact, not which one: a server given an older or other
    artifact signed with the same key loaded it. Its id (the manifest's SHA-256) pins it."""
    pinned = read_manifest(signed, KEY).artifact_id
    assert len(pinned) == 64 and load(signed, KEY, expect_id=pinned)
    torch.manual_seed(1)
    other = tmp_path / "other"
    save(inject_bottleneck(torchvision.models.resnet18(num_classes=5), 2, "sp2"), other, 32, key=KEY)
    load(other, KEY)  # validly signed with the same key
    for loader in (lambda d: load(d, KEY, expect_id=pinned), lambda d: load_part(d, "tail", KEY, expect_id=pinned),
                   lambda d: read_manifest(d, expect_id=pinned)):
        _refused(other, f"is artifact {read_manifest(other).artifact_id}, not the expected {pinned}", loader)


def test_the_server_and_client_take_the_pin(signed):
    from edgetorch.split.client import SplitClient
    from edgetorch.split.server import ServerConfig, app_from_dir

    pinned = read_manifest(signed).artifact_id
    app_from_dir(signed, ServerConfig(expect_artifact_id=pinned), KEY)
    SplitClient.from_dir(signed, "http://server.invalid", key=KEY, expect_id=pinned).close()
    wrong = "0" * 64
    with pytest.raises(SplitArtifactError, match="not the expected 0000"):
        app_from_dir(signed, ServerConfig(expect_artifact_id=wrong), KEY)
    with pytest.raises(SplitArtifactError, match="not the expected 0000"):
        SplitClient.from_dir(signed, "http://server.invalid", key=KEY, expect_id=wrong)


@pytest.mark.parametrize("bad", ["", "abc", "G" * 64, "A" * 64, 7])
def test_a_malformed_pin_is_a_caller_error(signed, bad):
    from edgetorch.split.server import ServerConfig

    with pytest.raises(ValueError, match="64 lowercase hex digits"):
        ServerConfig(expect_artifact_id=bad)
    with pytest.raises(ValueError, match="64 lowercase hex digits"):
        load(signed, expect_id=bad)


def test_the_cli_prints_the_id_and_refuses_another_artifact(artifact, tmp_path):
    from typer.testing import CliRunner

    from edgetorch.cli import app

    runner = CliRunner()
    out = tmp_path / "exported"
    exported = runner.invoke(app, ["split", "export", "--model", "torchvision:resnet18", "--channels", "2",
                                   "--num-classes", "5", "--size", "32", "--random-init", "--out", str(out)])
    assert exported.exit_code == 0, exported.output
    assert f"artifact id {read_manifest(out).artifact_id}" in exported.output
    for command in (["split", "serve", str(artifact)], ["split", "infer", str(artifact), "x.png", "--server",
                                                         "http://server.invalid"]):
        refused = runner.invoke(app, [*command, "--expect-id", read_manifest(out).artifact_id])
        assert refused.exit_code == 2 and "not the expected" in refused.output and "Traceback" not in refused.output
