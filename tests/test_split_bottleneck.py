"""Bottleneck injection: shapes for every accepted architecture, exact head/tail split, weight reuse."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from edgetorch.split.bottleneck import (
    ACCEPTED_ARCHS,
    BottleneckModel,
    decompose,
    detect_arch,
    inject_autoencoder,
    inject_bottleneck,
    split,
)
from edgetorch.zoo import build_model, load_weights, save_weights
from edgetorch.zoo.weights import CheckpointError

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
