"""Bottleneck injection: shapes for every accepted architecture, exact head/tail split, weight reuse;
the authors' released design (architecture="released") and its spec and artifact round trips."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from edgetorch.split import SplitArtifactError, load, save
from edgetorch.split.artifact import read_manifest
from edgetorch.split.bottleneck import (
    ACCEPTED_ARCHS,
    BottleneckModel,
    decompose,
    detect_arch,
    inject_autoencoder,
    inject_bottleneck,
    rebuild,
    split,
)
from edgetorch.zoo import build_model, load_weights, save_weights
from edgetorch.weights import CheckpointError

SIZE = 64  # a multiple of every design's input_multiple (at most 32)


@functools.cache
def _meta_model(arch: str) -> nn.Module:
    # Meta tensors carry shapes only: the deep architectures are shape-checked without compute.
    # Cached: injection copies what it reuses, so a shared teacher is never modified.
    with torch.device("meta"):
        return build_model(f"torchvision:{arch}", num_classes=10)


@pytest.fixture(scope="module")
def resnet18() -> nn.Module:
    torch.manual_seed(0)
    return build_model("torchvision:resnet18", num_classes=10).eval()


@pytest.mark.parametrize("arch", ACCEPTED_ARCHS)
def test_detect_arch(arch: str) -> None:
    assert detect_arch(_meta_model(arch)) == arch


def test_unsupported_architecture_lists_accepted() -> None:
    with torch.device("meta"):
        model = build_model("torchvision:resnet34")
    with pytest.raises(ValueError, match="resnet18, resnet50, resnet152, densenet121"):
        inject_bottleneck(model, 3)
    with pytest.raises(ValueError, match="accepted"):
        inject_bottleneck(nn.Linear(2, 2), 3)


@pytest.mark.parametrize("arch", ACCEPTED_ARCHS)
def test_injection_shapes(arch: str) -> None:
    teacher = _meta_model(arch)
    x = torch.empty(1, 3, SIZE, SIZE, device="meta")
    expected = [t.shape for t in decompose(teacher).taps(x)]
    for split_point, downsample in [("sp1", False), ("sp1", True), ("sp2", False), ("sp2", True)]:
        student = inject_bottleneck(teacher, 12, split_point, downsample=downsample)
        z = student.head(x)
        side = SIZE // (8 * (2 if downsample else 1)) + (split_point == "sp1")  # SP1: H/8 + 1
        assert z.shape == (1, 12, side, side)
        # The decoder reproduces the front's output shape, so the copied blocks run unchanged.
        assert [t.shape for t in student.tail.taps(z)] == expected
        assert (student.arch, student.split_point, student.channels) == (arch, split_point, 12)


@pytest.mark.parametrize("arch", ["resnet152", "resnet18", "densenet201"])
def test_split_points_have_the_papers_shapes_at_224_px(arch: str) -> None:
    """BottleFit Sec. IV-A: 12 x 29 x 29 at SP1 and 12 x 28 x 28 at SP2 for C = 12."""
    teacher = _meta_model(arch)
    x = torch.empty(1, 3, 224, 224, device="meta")
    assert inject_bottleneck(teacher, 12, "sp1").head(x).shape == (1, 12, 29, 29)
    assert inject_bottleneck(teacher, 12, "sp2").head(x).shape == (1, 12, 28, 28)


@pytest.mark.parametrize("arch", ACCEPTED_ARCHS)
def test_autoencoder_shapes(arch: str) -> None:
    teacher = _meta_model(arch)
    x = torch.empty(1, 3, SIZE, SIZE, device="meta")
    student = inject_autoencoder(teacher, 6)
    assert student.head(x).shape[1] == 6
    assert [t.shape for t in student.taps(x)] == [t.shape for t in decompose(teacher).taps(x)]
    convs = [m for m in student.bottleneck_parts()[0].modules() if isinstance(m, nn.Conv2d)]
    deconvs = [m for m in student.tail.decoder.modules() if isinstance(m, nn.ConvTranspose2d)]
    assert (len(convs), len(deconvs)) == (4, 4)


@pytest.mark.parametrize("channels", [1, 2, 3, 6, 9, 12, 40])
def test_channel_counts(resnet18: nn.Module, channels: int) -> None:
    student = inject_bottleneck(resnet18, channels)
    assert student.head(torch.zeros(1, 3, 32, 32)).shape[1] == channels


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "3"])
def test_bad_channels_rejected(resnet18: nn.Module, bad: object) -> None:
    with pytest.raises(ValueError, match="positive int"):
        inject_bottleneck(resnet18, bad)  # type: ignore[arg-type]


def test_bad_split_point_and_input_size(resnet18: nn.Module) -> None:
    with pytest.raises(ValueError, match="sp1, sp2"):
        inject_bottleneck(resnet18, 3, "sp3")
    student = inject_bottleneck(resnet18, 3, "sp2", downsample=True)
    with pytest.raises(ValueError, match="multiples of 16"):
        student.head(torch.zeros(1, 3, 40, 40))


@pytest.mark.parametrize("arch", ["resnet18", "densenet121"])
def test_decompose_is_the_teacher(arch: str) -> None:
    torch.manual_seed(0)
    teacher = build_model(f"torchvision:{arch}", num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(decompose(teacher)(x), teacher(x))


@pytest.mark.parametrize("maker", [lambda m: inject_bottleneck(m, 3, "sp1"),
                                   lambda m: inject_bottleneck(m, 3, "sp2", downsample=True),
                                   lambda m: inject_autoencoder(m, 3)])  # fmt: skip
def test_head_then_tail_equals_forward(resnet18: nn.Module, maker) -> None:
    student = maker(resnet18).eval()
    head, tail = split(student)
    assert head is student.head and tail is student.tail
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        z = head(x)
        assert torch.equal(tail(z), student(x))
        assert torch.equal(student.taps(x)[-1], student(x))


def test_teacher_is_copied_not_shared(resnet18: nn.Module) -> None:
    before = {k: v.clone() for k, v in resnet18.state_dict().items()}
    student = inject_bottleneck(resnet18, 3)
    # Reused weights start equal to the teacher's...
    assert torch.equal(student.tail.blocks["layer3"][0].conv1.weight, resnet18.layer3[0].conv1.weight)
    assert torch.equal(student.head.encoder[0].weight, resnet18.conv1.weight)
    # ...but are separate tensors: changing the student leaves the teacher as it was.
    with torch.no_grad():
        for p in student.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, before[k]) for k, v in resnet18.state_dict().items())


def test_split_rejects_other_models(resnet18: nn.Module) -> None:
    with pytest.raises(TypeError, match="BottleneckModel"):
        split(resnet18)  # type: ignore[arg-type]


def test_state_dict_round_trip_is_strict(resnet18: nn.Module, tmp_path) -> None:
    student = inject_bottleneck(resnet18, 3)
    path = tmp_path / "student.safetensors"
    save_weights(student, path)
    torch.manual_seed(1)
    fresh = inject_bottleneck(build_model("torchvision:resnet18", num_classes=10), 3)
    load_weights(fresh, path)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), student.state_dict().values()))
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load_weights(inject_bottleneck(resnet18, 12), path)
    assert isinstance(fresh, BottleneckModel)


def test_public_surface_round_trip_through_an_8bit_payload():
    import edgetorch.split as es

    assert all(hasattr(es, name) for name in es.__all__)
    torch.manual_seed(0)
    student = es.inject_bottleneck(build_model("torchvision:resnet18", num_classes=10), channels=3).eval()
    head, tail = es.split(student)
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        z = head(x)
        payload = es.encode(z)
        assert len(payload) == es.payload_size(z.shape)
        assert torch.allclose(tail(es.decode(payload)), student(x), atol=0.05)


# ----------------------------------------------------------------------------- architecture="released"

# Encoder and decoder parameters of the paper design at C = 12, recorded from the code before the
# released variant existed (commit 4ea8665): the default must build exactly these layers.
_PAPER_PARAMS = {("resnet18", "sp1", False): (12620, 97536), ("resnet18", "sp2", True): (53452, 97536),
                 ("resnet50", "sp2", False): (185164, 1208832), ("densenet121", "sp1", True): (12620, 375040),
                 ("densenet121", "sp2", False): (97356, 456960)}  # fmt: skip


def _layers(module: nn.Module) -> list[tuple]:
    """Each layer's kind and geometry: convolutions as (kind, in, out, kernel, stride, padding, bias)."""
    out: list[tuple] = []
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            kind = "deconv" if isinstance(m, nn.ConvTranspose2d) else "conv"
            out.append((kind, m.in_channels, m.out_channels, m.kernel_size[0], m.stride[0], m.padding[0],
                        m.bias is not None))  # fmt: skip
        elif isinstance(m, nn.BatchNorm2d):
            out.append(("bn", m.num_features))
        elif isinstance(m, nn.ReLU):
            out.append(("relu",))
        elif isinstance(m, nn.MaxPool2d):
            out.append(("maxpool", m.kernel_size, m.stride, m.padding))
        elif isinstance(m, nn.AvgPool2d):
            out.append(("avgpool", m.kernel_size, m.stride))
    return out


_STEM = [("conv", 3, 64, 7, 2, 3, False), ("bn", 64), ("relu",), ("maxpool", 3, 2, 1), ("bn", 64), ("relu",)]


def _decoder_of(c: int, first: tuple, target: int, pool: tuple | None) -> list[tuple]:
    layers = [("bn", c), ("relu",), first, ("bn", 512), ("relu",), ("conv", 512, 512, 2, 1, 1, False),
              ("bn", 512), ("relu",), ("conv", 512, target, 2, 1, 0, False), ("bn", target), ("relu",),
              ("conv", target, target, 2, 1, 0, False)]  # fmt: skip
    return layers + ([pool] if pool else [])


# The authors' layer lists (BottleFit custom/model.py Bottleneck4ResNet152 ver 2 and 3, split at
# bottleneck_idx 7 and 10; torchdistill Bottleneck4DenseNet, index 7), at C = 12.
_AUTHORS = {
    ("resnet152", "sp1", False): (_STEM + [("conv", 64, 12, 2, 2, 1, False)],
                                  _decoder_of(12, ("conv", 12, 512, 2, 1, 1, False), 512, ("avgpool", 2, 1))),
    ("resnet152", "sp2", True): (_STEM + [("conv", 64, 512, 2, 2, 1, False), ("bn", 512), ("relu",),
                                          ("conv", 512, 12, 2, 2, 1, False)],
                                 _decoder_of(12, ("deconv", 12, 512, 2, 2, 0, False), 512, ("avgpool", 2, 1))),
    ("densenet169", "sp1", False): (_STEM + [("conv", 64, 12, 2, 2, 1, False)],
                                    _decoder_of(12, ("conv", 12, 512, 2, 1, 1, False), 256, ("avgpool", 2, 2))),
}  # fmt: skip


@pytest.mark.parametrize("key", list(_AUTHORS), ids=["-".join(map(str, k)) for k in _AUTHORS])
def test_released_layers_are_the_authors(key: tuple) -> None:
    arch, split_point, downsample = key
    student = inject_bottleneck(_meta_model(arch), 12, split_point, downsample, architecture="released")
    encoder, decoder = _AUTHORS[key]
    assert _layers(student.head.encoder) == encoder
    assert _layers(student.tail.decoder) == decoder


@pytest.mark.parametrize("arch", ACCEPTED_ARCHS)
def test_released_structure(arch: str) -> None:
    """2x2 kernels after the stem, the 512-wide SP2 middle layer, BN + ReLU first, four decoder convs."""
    teacher = _meta_model(arch)
    for split_point, downsample in [("sp1", False), ("sp1", True), ("sp2", False), ("sp2", True)]:
        student = inject_bottleneck(teacher, 12, split_point, downsample, architecture="released")
        encoder = [layer for layer in _layers(student.head.encoder) if layer[0] == "conv"]
        decoder = _layers(student.tail.decoder)
        convs = [layer for layer in decoder if layer[0] in ("conv", "deconv")]
        assert all(layer[3] == 2 and not layer[6] for layer in encoder[1:] + convs)
        assert [layer[2] for layer in encoder[1:]] == ([12] if split_point == "sp1" else [512, 12])
        assert decoder[:2] == [("bn", 12), ("relu",)]
        assert len(convs) == 4 and convs[0][0] == ("deconv" if downsample else "conv")
        assert [layer[2] for layer in convs[:2]] == [512, 512]


@pytest.mark.parametrize("arch", ACCEPTED_ARCHS)
def test_released_shapes(arch: str) -> None:
    teacher = _meta_model(arch)
    x = torch.empty(1, 3, SIZE, SIZE, device="meta")
    expected = [t.shape for t in decompose(teacher).taps(x)]
    for split_point, downsample in [("sp1", False), ("sp1", True), ("sp2", False), ("sp2", True)]:
        student = inject_bottleneck(teacher, 12, split_point, downsample, architecture="released")
        z = student.head(x)
        # Padding 1 on a 2x2/2 conv adds one row and column, except on plain SP2 (2x2/1, no padding).
        side = SIZE // 8 if (split_point, downsample) == ("sp2", False) else SIZE // (8 * (1 + downsample)) + 1
        assert z.shape == (1, 12, side, side)
        assert [t.shape for t in student.tail.taps(z)] == expected
        assert (student.architecture, student.split_point, student.downsample) == ("released", split_point, downsample)


@pytest.mark.parametrize("arch", ["resnet152", "resnet18", "densenet201"])
def test_released_split_points_have_the_papers_shapes_at_224_px(arch: str) -> None:
    """12 x 29 x 29 at SP1 and 12 x 28 x 28 at SP2; the authors' downsampled SP2 (ver 3) is 12 x 15 x 15."""
    teacher = _meta_model(arch)
    x = torch.empty(1, 3, 224, 224, device="meta")
    assert inject_bottleneck(teacher, 12, "sp1", architecture="released").head(x).shape == (1, 12, 29, 29)
    assert inject_bottleneck(teacher, 12, "sp2", architecture="released").head(x).shape == (1, 12, 28, 28)
    assert inject_bottleneck(teacher, 12, "sp2", True, architecture="released").head(x).shape == (1, 12, 15, 15)


@pytest.mark.parametrize("key", list(_PAPER_PARAMS), ids=["-".join(map(str, k)) for k in _PAPER_PARAMS])
def test_paper_variant_is_unchanged(key: tuple) -> None:
    arch, split_point, downsample = key
    student = inject_bottleneck(_meta_model(arch), 12, split_point, downsample)
    assert student.architecture == "paper" and student.spec()["architecture"] == "paper"
    encoder, decoder = student.bottleneck_parts()
    assert (sum(p.numel() for p in encoder.parameters()), sum(p.numel() for p in decoder.parameters())) == _PAPER_PARAMS[key]
    assert [layer[3] for layer in _layers(decoder) if layer[0] == "conv"][-1] == 3  # 3x3 convs, not the released 2x2


def test_released_starts_fresh_and_leaves_the_teacher_alone(resnet18: nn.Module) -> None:
    before = {k: v.clone() for k, v in resnet18.state_dict().items()}
    student = inject_bottleneck(resnet18, 3, "sp1", architecture="released").eval()
    # The authors' student takes only the later blocks from the pretrained model, not the stem.
    assert not torch.equal(student.head.encoder[0].weight, resnet18.conv1.weight)
    assert torch.equal(student.tail.blocks["layer3"][0].conv1.weight, resnet18.layer3[0].conv1.weight)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(student.tail(student.head(x)), student(x))
    assert all(torch.equal(v, before[k]) for k, v in resnet18.state_dict().items())


def test_unknown_architecture_is_refused(resnet18: nn.Module) -> None:
    with pytest.raises(ValueError, match="accepted: paper, released"):
        inject_bottleneck(resnet18, 3, architecture="authors")


@pytest.mark.parametrize("architecture", ["paper", "released"])
@pytest.mark.parametrize("arch, split_point, downsample", [("resnet18", "sp1", False), ("resnet50", "sp2", True),
                                                            ("densenet121", "sp2", False)])  # fmt: skip
def test_spec_rebuild_round_trip(arch: str, split_point: str, downsample: bool, architecture: str) -> None:
    student = inject_bottleneck(_meta_model(arch), 6, split_point, downsample, architecture)
    spec = student.spec()
    assert spec["architecture"] == architecture
    json.loads(json.dumps(spec))  # plain JSON data
    with torch.device("meta"):
        again = rebuild(spec)
    assert again.spec() == spec
    assert {k: v.shape for k, v in again.state_dict().items()} == {k: v.shape for k, v in student.state_dict().items()}


def test_rebuild_reads_specs_from_before_the_architecture_key_and_refuses_bad_ones() -> None:
    old = {"arch": "resnet18", "channels": 3, "split_point": "sp1", "downsample": False, "num_classes": 10}
    with torch.device("meta"):
        assert rebuild(old).architecture == "paper"
        with pytest.raises(ValueError, match="accepted: paper, released"):
            rebuild({**old, "architecture": ["released"]})
        with pytest.raises(ValueError, match="autoencoder baseline has only the paper"):
            rebuild({**old, "split_point": "ae", "architecture": "released"})


@pytest.fixture(scope="module")
def released_artifact(tmp_path_factory) -> tuple[BottleneckModel, object]:
    torch.manual_seed(0)
    student = inject_bottleneck(build_model("torchvision:resnet18", num_classes=5), 3, "sp1",
                                architecture="released").eval()  # fmt: skip
    out = tmp_path_factory.mktemp("released")
    save(student, out, 32)
    return student, out


def test_released_artifact_round_trip_gives_identical_logits(released_artifact) -> None:
    student, out = released_artifact
    assert json.loads((out / "manifest.json").read_text())["model"]["architecture"] == "released"
    head, tail = load(out)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(tail(head(x)), student(x))


@pytest.mark.parametrize("architecture, match", [("paper", "weights do not fit"), (None, "weights do not fit"),
                                                 ("bogus", "cannot be built")])  # fmt: skip
def test_a_manifest_naming_another_architecture_is_refused(released_artifact, tmp_path, architecture, match) -> None:
    """Same split point and bottleneck shape (12 x 29 x 29 either way): only the weights tell them apart."""
    _, out = released_artifact
    copy = Path(shutil.copytree(out, tmp_path / "copy"))
    raw = json.loads((copy / "manifest.json").read_text())
    if architecture is None:
        del raw["model"]["architecture"]  # read as a manifest from before the key: the paper design
    else:
        raw["model"]["architecture"] = architecture
    (copy / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(SplitArtifactError, match=match):
        load(copy)


def test_split_train_and_export_carry_the_architecture(tmp_path) -> None:
    """`split train --architecture released` trains that design; `split export --trained` keeps it."""
    from typer.testing import CliRunner

    from edgetorch.cli import app

    torch.manual_seed(0)
    save_weights(build_model("torchvision:resnet18", num_classes=10), tmp_path / "teacher.safetensors")
    runner, out = CliRunner(), tmp_path / "run"
    train = ["split", "train", "--no-progress", "--teacher", "torchvision:resnet18", "--teacher-weights",
             str(tmp_path / "teacher.safetensors"), "--data", "digits", "--train-limit", "16", "--val-limit", "8",
             "--size", "32", "--channels", "2", "--split-point", "sp1", "--epochs", "1", "--batch-size", "8",
             "--out", str(out)]  # fmt: skip
    bad = runner.invoke(app, [*train, "--architecture", "authors"])
    assert bad.exit_code == 2 and "accepted: paper, released" in bad.output
    done = runner.invoke(app, [*train, "--architecture", "released"])
    assert done.exit_code == 0, done.output
    assert json.loads((out / "student.json").read_text())["model"]["architecture"] == "released"
    assert json.loads((out / "recipe.json").read_text())["architecture"] == "released"
    conflicting = runner.invoke(app, ["split", "export", "--trained", str(out), "--architecture", "paper",
                                      "--out", str(tmp_path / "a")])  # fmt: skip
    assert conflicting.exit_code == 2 and "--architecture" in conflicting.output
    exported = runner.invoke(app, ["split", "export", "--trained", str(out), "--out", str(tmp_path / "artifact")])
    assert exported.exit_code == 0, exported.output
    assert read_manifest(tmp_path / "artifact").model["architecture"] == "released"
    fresh = runner.invoke(app, ["split", "export", "--model", "torchvision:resnet18", "--channels", "2",
                                "--architecture", "released", "--random-init", "--size", "32",
                                "--out", str(tmp_path / "random")])  # fmt: skip
    assert fresh.exit_code == 0, fresh.output
    assert read_manifest(tmp_path / "random").model["architecture"] == "released"


def test_a_run_directory_from_before_the_option_resumes_as_the_paper_design(tmp_path) -> None:
    from edgetorch.split.recipe import _claim

    (tmp_path / "recipe.json").write_text(json.dumps({"channels": 2}))  # no "architecture" or "resize" key
    _claim(tmp_path, {"channels": 2, "architecture": "paper", "resize": "stretch"})
    with pytest.raises(CheckpointError, match="differs in architecture"):
        _claim(tmp_path, {"channels": 2, "architecture": "released", "resize": "stretch"})
    # Before resize was recorded every image was stretched: a folder run (now centre-cropped) starts over.
    with pytest.raises(CheckpointError, match="differs in resize"):
        _claim(tmp_path, {"channels": 2, "architecture": "paper", "resize": "center-crop"})
