"""Entropy-coded payloads (format version 2, edgetorch.split.coded): the same tensor as version 1 in
fewer bytes, pinned bytes, and a decoder that refuses every malformed or mismatched payload within
bounded memory."""

from __future__ import annotations

import random
import struct
import tracemalloc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from _coded_fuzz import fuzz_decoder

from edgetorch.split.coded import CodeTables, fit_code_tables
from edgetorch.split.fuzz import reseal
from edgetorch.split.payload import MAX_CODED_NUMEL, PayloadError, decode, encode, payload_size, quantize, read_header

torch.manual_seed(0)
TRAIN = torch.relu(torch.randn(32, 3, 6, 6))
TABLES = fit_code_tables(quantize(TRAIN)[0])
SMALL = torch.zeros(2, 1, 32)  # [2, 1, 32]: one channel, mostly zeros
SMALL[0, 0, 3], SMALL[0, 0, 9], SMALL[1, 0, 5] = 1.0, 2.0, 3.0


def test_golden_bytes():
    # Version 1's header with version 2, then coding 1 (rANS), the tables' digest, and the words.
    tables = CodeTables(torch.tensor([[64] + [1] * 255]))
    assert tables.digest.hex() == "69d1093a"
    blob = encode(SMALL, tables=tables)
    assert blob.hex() == (
        "455442510201010103351dc54d020000000100000020000000"  # magic, v2, mode, dtypes, ndim 3, CRC, shape
        "8180003c00" "c1c0403c00"  # (scale, zero point) per sample
        "01" "69d1093a"  # coding, digest
        "0b2716b0b6d4ffc13e0d16b97fedb302")  # four rANS words
    assert len(blob) == 56 and len(encode(SMALL)) == 99
    assert torch.equal(decode(blob, tables=tables), decode(encode(SMALL)))


def test_digest_pins_the_counts():
    assert TABLES.digest == CodeTables(TABLES.counts.copy()).digest
    other = TABLES.counts.copy()
    other[0, 0] += 1
    assert CodeTables(other).digest != TABLES.digest


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 4), channels=st.integers(1, 5), spatial=st.sampled_from([(), (1,), (3, 5), (2, 2, 2)]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       per_sample=st.booleans(), relu=st.booleans(), seed=st.integers(0, 2**31))
def test_decodes_to_exactly_version_1s_tensor(batch, channels, spatial, dtype, per_sample, relu, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, *spatial, generator=g, dtype=torch.float64)
    x = (x.relu() if relu else x).to(dtype)
    # tables fitted on other data: codes never seen still code (at a high cost)
    fitted_on = torch.randint(0, 3, (2, channels, 4), generator=g, dtype=torch.uint8)
    tables = fit_code_tables(fitted_on)
    blob = encode(x, per_sample, tables=tables)
    header = read_header(blob)
    assert (header.shape, header.dtype) == (x.shape, dtype) and len(blob) <= payload_size(x.shape, per_sample)
    # version 1 where the coded stream would be no smaller (codes unlike the fitted ones)
    assert header.version == 1 or header.table_digest == tables.digest
    y = decode(blob, tables=tables)
    assert y.dtype == dtype and torch.equal(y, decode(encode(x, per_sample)))


def test_codes_unlike_the_fitted_ones_go_as_version_1_when_that_is_smaller():
    rare = fit_code_tables(torch.zeros(4, 3, 2, dtype=torch.uint8))  # only code 0 seen: others cost ~24 bits
    x = torch.rand(2, 3, 6, 6) + 1  # no zeros: every code is a rare one
    blob = encode(x, tables=rare)
    assert read_header(blob).version == 1 and blob == encode(x)
    assert torch.equal(decode(blob, tables=rare), decode(blob))


def test_fewer_bytes_than_version_1_on_codes_like_the_fitted_ones():
    x = torch.relu(torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(1)))
    assert len(encode(x, tables=TABLES)) < 0.8 * len(encode(x))
    zeros = torch.zeros(8, 3, 6, 6)  # every code is the table's most likely one
    assert len(encode(zeros, tables=TABLES)) < 0.25 * len(encode(zeros))


def test_tables_round_trip_through_safetensors_and_refuse_bad_counts():
    loaded = CodeTables.from_tensors(load(save(TABLES.to_tensors())))
    assert loaded.digest == TABLES.digest and loaded.channels == 3
    with pytest.raises(PayloadError, match=r"\[channels, 256\] array"):
        CodeTables(torch.zeros(3, 255, dtype=torch.int64))
    with pytest.raises(PayloadError, match="1..4096 channels"):
        CodeTables(torch.zeros(0, 256, dtype=torch.int64))
    with pytest.raises(PayloadError, match="integer counts"):
        CodeTables(torch.zeros(2, 256))
    with pytest.raises(PayloadError, match="0..2\\*\\*53"):
        CodeTables(torch.full((2, 256), -1))
    with pytest.raises(PayloadError, match="a tensor named 'code_counts'"):
        CodeTables.from_tensors({"code_counts": TABLES.to_tensors()["code_counts"], "x": torch.zeros(1)})
    with pytest.raises(PayloadError, match="must be 2-D int64"):
        CodeTables.from_tensors({"code_counts": torch.zeros(3, 256, dtype=torch.int32)})
    with pytest.raises(PayloadError, match=r"uint8 codes \[N, C, ...\], got torch.float32"):
        fit_code_tables(TRAIN)


def test_mismatched_tables_and_shapes_are_refused_with_the_fix():
    x = torch.relu(torch.randn(2, 3, 6, 6))
    blob = encode(x, tables=TABLES)
    with pytest.raises(PayloadError, match="decodes only with the code tables it was coded with"):
        decode(blob)
    other = fit_code_tables(quantize(torch.relu(torch.randn(4, 3, 6, 6)))[0])
    with pytest.raises(PayloadError, match="use the same artifact on both sides"):
        decode(blob, tables=other)
    with pytest.raises(PayloadError, match="the code tables cover 3 channels"):
        encode(torch.randn(2, 4, 6), tables=TABLES)
    with pytest.raises(PayloadError, match="the code tables cover 3 channels"):
        encode(torch.randn(6), tables=TABLES)
    with pytest.raises(PayloadError, match="claims 216 elements, above the limit of 100"):
        decode(blob, tables=TABLES, max_numel=100)
    assert MAX_CODED_NUMEL == 2**24


def _words_at(blob: bytes) -> int:
    return read_header(blob).header_bytes


@pytest.mark.parametrize("edit, match", [
    (lambda b: b[:-1], "CRC"),
    (lambda b: reseal(b[:-1]), "not a multiple of 4"),
    (lambda b: reseal(b + b"\1\0\0\0"), "does not hold exactly the codes"),
    (lambda b: reseal(b + b"\0\0\0\0"), "not rANS data"),
    (lambda b: reseal(b[:-4]), "does not hold exactly the codes|not rANS data"),
    (lambda b: b[:-2] + bytes([b[-2] ^ 1]) + b[-1:], "CRC-32"),
    (lambda b: reseal(b[:_words_at(b) - 5] + b"\x07" + b[_words_at(b) - 4:]), "unknown coding 7"),
    (lambda b: b[:_words_at(b) - 1], "cannot hold a version-2 header"),
])
def test_malformed_streams_are_payload_errors(edit, match):
    blob = encode(torch.relu(torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(3))), tables=TABLES)
    with pytest.raises(PayloadError, match=match):
        decode(edit(blob), tables=TABLES)


def test_a_payload_claiming_a_huge_shape_is_refused_before_decoding():
    blob = encode(torch.zeros(1, 3, 2), per_sample=False, tables=TABLES)
    huge = reseal(blob[:13] + struct.pack("<3I", 2**20, 3, 2**12) + blob[25:])  # 12.9e9 elements claimed
    tracemalloc.start()
    with pytest.raises(PayloadError, match="above the limit"):
        decode(huge, tables=TABLES)
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()


@pytest.mark.slow  # 10,000 payloads: about 10 s
def test_ten_thousand_fuzzed_payloads_decode_finite_or_are_payload_errors():
    """Issue 27's hostile-input target: byte flips, cuts, extensions and spliced words, each
    resealed so it passes the CRC (as a lying encoder's would) and reaches the stream checks."""
    rng = random.Random(27)
    g = torch.Generator().manual_seed(27)
    valid = [encode(torch.relu(torch.randn(rng.randint(1, 4), 3, rng.randint(1, 8), 5, generator=g)) * 10 ** rng.uniform(-3, 3),
                    rng.random() < 0.8, tables=TABLES) for _ in range(50)]
    outcomes = fuzz_decoder(valid, TABLES, rng)
    assert outcomes["refused"] > 5000 and outcomes["decoded"] > 0, outcomes


# --- in a split artifact: export writes the tables, the client codes with them, the server decodes --------


@pytest.fixture(scope="module")
def coded_artifact(tmp_path_factory):
    import torchvision

    from edgetorch.split import inject_bottleneck, save
    from edgetorch.split.bottleneck import split

    torch.manual_seed(0)
    student = inject_bottleneck(torchvision.models.resnet18(num_classes=5), 3, "sp2").eval()
    head, _ = split(student)
    with torch.no_grad():
        tables = fit_code_tables(quantize(head(torch.rand(64, 3, 64, 64)))[0])
    out = tmp_path_factory.mktemp("coded")
    manifest = save(student, out, 64, code_tables=tables)
    return out, manifest, tables, student


def test_an_artifact_carries_its_tables_and_its_client_and_server_code_with_them(coded_artifact):
    from edgetorch.split.artifact import load_code_tables, load_deployed, load_part
    from edgetorch.split.client import SplitClient
    from edgetorch.split.protocol import serve_in_background
    from edgetorch.split.server import create_app

    out, manifest, tables, student = coded_artifact
    assert manifest.coded and manifest.payload_format["version"] == 2 and "code_tables" in manifest.files
    assert (out / "code_tables.safetensors").is_file() and load_code_tables(out, manifest).digest == tables.digest
    deployed, _ = load_deployed(out)
    x = torch.rand(3, 3, 64, 64)
    with torch.no_grad():
        expected = student.tail(decode(encode(student.head(x))))  # version 1's path: the same tensor
        assert torch.equal(deployed(x), expected)
    tail, manifest = load_part(out, "tail")
    with pytest.raises(ValueError, match="entropy-coded: pass its code tables"):
        create_app(tail, manifest)
    with serve_in_background(create_app(tail, manifest, tables=load_code_tables(out, manifest))) as url:
        with SplitClient.from_dir(out, url) as client:
            answer = client.infer(x)
            assert torch.allclose(answer.logits, expected, atol=1e-5)
            sent = encode(client.head(x), tables=tables)
            assert read_header(sent).version == 2 and len(sent) < payload_size((3, *manifest.bottleneck_shape))
            other = fit_code_tables(torch.zeros(1, 3, 1, dtype=torch.uint8))
            refused = client._http.post("/infer", content=encode(torch.zeros(1, *manifest.bottleneck_shape), tables=other))
            assert refused.status_code == 400 and "use the same artifact on both sides" in refused.text
        head, _ = load_part(out, "head")
        with pytest.raises(ValueError, match="entropy-coded: pass its code tables"):
            SplitClient(head, manifest, url)


def _tables_damage(kind: str):
    import json

    from safetensors.torch import save_file

    from _tamper import edit_manifest, rehash

    def damage(d):
        if kind == "missing":
            (d / "code_tables.safetensors").unlink()
        elif kind == "changed":
            (d / "code_tables.safetensors").write_bytes((d / "code_tables.safetensors").read_bytes() + b" ")
        elif kind == "channels":
            save_file({"code_counts": torch.ones(5, 256, dtype=torch.int64)}, d / "code_tables.safetensors")
            rehash(d)
        elif kind == "negative":
            save_file({"code_counts": -torch.ones(3, 256, dtype=torch.int64)}, d / "code_tables.safetensors")
            rehash(d)
        elif kind == "unlisted":
            edit_manifest(d, lambda m: m["files"].pop("code_tables"))
        elif kind == "plain format":
            edit_manifest(d, lambda m: m.update(payload_format={"magic": "ETBQ", "version": 1, "per_sample": True}))
        elif kind == "unknown format":
            edit_manifest(d, lambda m: m["payload_format"].update(coding="huffman"))
        json.loads((d / "manifest.json").read_text())
    return damage


@pytest.mark.parametrize("kind, match", [
    ("missing", "code_tables.safetensors is missing"),
    ("changed", "SHA-256 does not match"),
    ("channels", "tables for 5 channels; the bottleneck has 3"),
    ("negative", "every code count must be in 0..2\\*\\*53"),
    ("unlisted", "needs code_tables in files"),
    ("plain format", "needs code_tables in files, and only it may list them"),
    ("unknown format", "payload format .* is none of"),
])
def test_damaged_or_mismatched_tables_are_refused_on_load(coded_artifact, tmp_path, kind, match):
    import shutil

    from edgetorch.split.artifact import load_deployed
    from edgetorch.split.manifest import SplitArtifactError

    copy = shutil.copytree(coded_artifact[0], tmp_path / "copy")
    _tables_damage(kind)(copy)
    with pytest.raises(SplitArtifactError, match=match):
        load_deployed(copy)


def test_export_refuses_tables_for_another_bottleneck(coded_artifact, tmp_path):
    from edgetorch.split import save

    with pytest.raises(ValueError, match="the code tables cover 4 channels; this bottleneck has 3"):
        save(coded_artifact[3], tmp_path / "x", 64, code_tables=fit_code_tables(torch.zeros(1, 4, 1, dtype=torch.uint8)))
