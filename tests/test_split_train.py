"""BottleFit training: losses against hand computations, frozen parts, GHND progress, exact resume;
the recipe end to end through `edgetorch split train` on a real image folder."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from edgetorch import InputFileError
from edgetorch.cli import app
from edgetorch.split.bottleneck import inject_autoencoder, inject_bottleneck
from edgetorch.split.losses import ghnd_loss, kd_loss
from edgetorch.split.payload import decode, encode, payload_size
from edgetorch.split.bottlefit import BottleFitConfig
from edgetorch.split.evaluate import evaluate_split, file_offload
from edgetorch.split.recipe import NORMALISATIONS
from edgetorch.split.teacher import TeacherConfig, load_rgb, teacher_paths, train_teacher
import edgetorch.training.checkpoint as checkpoint_module
from edgetorch.split.train import StageConfig, stage_progress, train_stage
from edgetorch.zoo import CheckpointError, build_model, evaluate_accuracy, save_weights

SIZE = 16  # tiny inputs keep the tests fast; 16 is a multiple of every input_multiple used here


@pytest.fixture(scope="module")
def teacher() -> nn.Module:
    torch.manual_seed(0)
    model = build_model("torchvision:resnet18", num_classes=4)
    # Non-trivial running statistics, so a BN update would show.
    with torch.no_grad():
        model.train()
        model(torch.rand(16, 3, SIZE, SIZE))
    return model.eval()


@pytest.fixture(scope="module")
def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(16, 3, SIZE, SIZE, generator=gen), torch.randint(0, 4, (16,), generator=gen))


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], module: nn.Module) -> set[str]:
    return {k for k, v in module.state_dict().items() if not torch.equal(v, before[k])}


def test_kd_loss_matches_hand_computation() -> None:
    s = torch.tensor([[2.0, 0.0, -1.0]])
    t = torch.tensor([[1.0, 1.0, 0.0]])
    y = torch.tensor([0])
    tau, alpha = 2.0, 0.3
    ce = -math.log(math.exp(2) / (math.exp(2) + 1 + math.exp(-1)))
    zs = [math.exp(v / tau) for v in (2.0, 0.0, -1.0)]
    zt = [math.exp(v / tau) for v in (1.0, 1.0, 0.0)]
    q = [v / sum(zs) for v in zs]
    p = [v / sum(zt) for v in zt]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    expected = alpha * ce + (1 - alpha) * tau**2 * kl
    assert kd_loss(s, t, y, alpha, tau).item() == pytest.approx(expected, rel=1e-6)
    # The paper's setting (alpha 0.5, tau 1) against plain PyTorch.
    ref = 0.5 * F.cross_entropy(s, y) + 0.5 * F.kl_div(F.log_softmax(s, 1), F.softmax(t, 1), reduction="batchmean")
    assert torch.allclose(kd_loss(s, t, y), ref)


def test_losses_reject_bad_arguments() -> None:
    z = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="alpha"):
        kd_loss(z, z, torch.tensor([0]), alpha=1.5)
    with pytest.raises(ValueError, match="does not match"):
        ghnd_loss([torch.zeros(2)], [torch.zeros(3)])
    with pytest.raises(ValueError, match="equally many"):
        ghnd_loss([z], [])


def test_ghnd_sums_mse_over_taps() -> None:
    a, b = torch.randn(2, 3, 4, 4), torch.randn(2, 5)
    ta, tb = torch.randn(2, 3, 4, 4), torch.randn(2, 5)
    assert torch.allclose(ghnd_loss([a, b], [ta, tb]), ((a - ta) ** 2).mean() + ((b - tb) ** 2).mean())


def test_stage_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="accepted: ce, kd, hnd, ghnd"):
        StageConfig(loss="mse")
    with pytest.raises(ValueError, match="epochs"):
        StageConfig(epochs=0)
    with pytest.raises(ValueError, match="lr_step"):
        StageConfig(lr_step=0)
    with pytest.raises(ValueError, match="weight_decay"):
        StageConfig(weight_decay=-1.0)


@pytest.mark.parametrize("optimizer, weight_decay, expected", [("sgd", None, 5e-4), ("adam", None, 0.0),
                                                               ("sgd", 0.0, 0.0), ("adam", 1e-4, 1e-4)])
def test_weight_decay_follows_the_authors_code_unless_given(teacher, data, monkeypatch, optimizer, weight_decay,
                                                            expected) -> None:
    import edgetorch.split.train as train_module

    seen = []
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer]

    class Spy(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self.defaults["weight_decay"])

    monkeypatch.setattr(train_module.torch.optim, cls.__name__, Spy)
    student = inject_bottleneck(teacher, 2)
    train_stage(student, data, StageConfig(loss="kd", trainable="tail", optimizer=optimizer, epochs=1,
                                           batch_size=8, weight_decay=weight_decay), teacher=teacher, progress=False)
    assert seen == [expected]


def test_ghnd_trains_only_the_bottleneck_and_loss_decreases(teacher: nn.Module, data: TensorDataset) -> None:
    torch.manual_seed(0)
    student = inject_bottleneck(teacher, 2, "sp2")
    before, teacher_before = _state(student), _state(teacher)
    config = StageConfig(loss="ghnd", trainable="bottleneck", epochs=4, batch_size=8, lr=3e-3)
    history = train_stage(student, data, config, teacher=teacher, progress=False)
    assert history[-1] < history[0]
    changed = _changed(before, student)
    # Frozen blocks and classifier: parameters and BN running statistics unchanged.
    assert changed and all(k.startswith(("head.encoder", "tail.decoder")) for k in changed)
    assert any(k.endswith("running_mean") and k.startswith("head.") for k in changed)
    assert not _changed(teacher_before, teacher)
    assert all(p.requires_grad for p in student.parameters()) and not student.training


def test_frozen_encoder_stage(teacher: nn.Module, data: TensorDataset) -> None:
    student = inject_bottleneck(teacher, 3, "sp2", downsample=True)
    before = _state(student)
    config = StageConfig(loss="kd", trainable="tail", epochs=1, batch_size=8, optimizer="sgd", lr=1e-2)
    train_stage(student, data, config, teacher=teacher, progress=False)
    changed = _changed(before, student)
    assert changed and all(k.startswith("tail.") for k in changed)


def test_autoencoder_trains_only_ae_layers(teacher: nn.Module, data: TensorDataset) -> None:
    student = inject_autoencoder(teacher, 3)
    before = _state(student)
    train_stage(student, data, StageConfig(loss="hnd", batch_size=8), teacher=teacher, progress=False)
    changed = _changed(before, student)
    assert changed and all(k.startswith(("head.encoder.1", "tail.decoder")) for k in changed)


def test_requirements_are_checked(teacher: nn.Module, data: TensorDataset) -> None:
    with pytest.raises(ValueError, match="needs the teacher"):
        train_stage(inject_bottleneck(teacher, 3), data, StageConfig(loss="ghnd"), progress=False)
    with pytest.raises(ValueError, match="needs a BottleneckModel"):
        train_stage(teacher, data, StageConfig(loss="hnd"), teacher=teacher, progress=False)
    with pytest.raises(ValueError, match="less than one batch"):
        train_stage(teacher, data, StageConfig(loss="ce", trainable="all", batch_size=64), progress=False)


def test_resume_continues_exactly(teacher: nn.Module, data: TensorDataset, tmp_path,
                                   interrupted_after_a_checkpoint) -> None:
    def fresh() -> nn.Module:
        torch.manual_seed(1)
        return inject_bottleneck(teacher, 2, "sp1")

    config = StageConfig(loss="ce", trainable="tail", epochs=2, batch_size=8, optimizer="sgd", lr=1e-2, lr_step=1)
    straight = fresh()
    history = train_stage(straight, data, config, progress=False)

    # Crash right after the first epoch's checkpoint, then resume with a freshly built model.
    interrupted_after_a_checkpoint(lambda: train_stage(fresh(), data, config, checkpoint_dir=tmp_path, progress=False))
    resumed = fresh()
    assert train_stage(resumed, data, config, checkpoint_dir=tmp_path, progress=False) == history
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), straight.state_dict().values()))
    # A finished stage resumed again trains nothing and changes nothing.
    again = fresh()
    assert train_stage(again, data, config, checkpoint_dir=tmp_path, progress=False) == history
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), straight.state_dict().values()))


def test_checkpoint_mismatches_fail_loudly(teacher: nn.Module, data: TensorDataset, tmp_path) -> None:
    config = StageConfig(loss="ce", trainable="tail", epochs=1, batch_size=8, optimizer="sgd")
    train_stage(inject_bottleneck(teacher, 2), data, config, checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(CheckpointError, match="shape mismatch"):
        train_stage(inject_bottleneck(teacher, 3), data, config, checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(CheckpointError, match=r"another run \(stage.lr: 0.001 -> 0.5\)"):
        train_stage(inject_bottleneck(teacher, 2), data, dataclasses.replace(config, lr=0.5),
                    checkpoint_dir=tmp_path, progress=False)  # fmt: skip
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="differs"):
        train_stage(inject_bottleneck(teacher, 2), data, config, checkpoint_dir=tmp_path, progress=False)


def test_teacher_is_trained_once_then_cached(tmp_path) -> None:
    config = TeacherConfig(arch="resnet18", dataset="digits", image_size=16, train_limit=64,
                           stage=StageConfig(loss="ce", trainable="all", epochs=1, batch_size=32))  # fmt: skip
    model, meta = train_teacher(config, cache=tmp_path, progress=False)
    assert 0.0 <= meta["test_accuracy"] <= 1.0 and meta["train_samples"] == 64
    weights, _ = teacher_paths(config, tmp_path)
    assert weights.is_file()
    cached, meta2 = train_teacher(config, cache=tmp_path, progress=False)
    assert meta2 == meta
    assert all(torch.equal(a, b) for a, b in zip(cached.state_dict().values(), model.state_dict().values()))
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(CheckpointError, match="SHA-256"):
        train_teacher(config, cache=tmp_path, progress=False)
    with pytest.raises(ValueError, match="accepted"):
        TeacherConfig(arch="vgg11")


def test_load_rgb_repeats_channels() -> None:
    images, labels = load_rgb("digits", "test", 16, limit=5).tensors
    assert images.shape == (5, 3, 16, 16) and torch.equal(images[:, 0], images[:, 2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_stage_trains_on_cuda_from_cpu_data_and_checkpoints_load_on_the_cpu(teacher, data, tmp_path):
    student = inject_bottleneck(teacher, 3, "sp2").cuda()
    config = StageConfig(loss="ghnd", trainable="bottleneck", batch_size=8)
    history = train_stage(student, data, config, teacher=copy.deepcopy(teacher).cuda(), checkpoint_dir=tmp_path,
                          progress=False)  # fmt: skip
    assert len(history) == 1 and math.isfinite(history[0])
    assert all(p.device.type == "cuda" for p in student.parameters())
    # The checkpoint holds CPU tensors: a CPU student resumes from it as finished.
    cpu_student = inject_bottleneck(teacher, 3, "sp2")
    assert train_stage(cpu_student, data, config, teacher=teacher, checkpoint_dir=tmp_path, progress=False) == history
    x = data.tensors[0][:4]
    torch.testing.assert_close(cpu_student.eval()(x), student.eval()(x.cuda()).cpu(), rtol=1e-3, atol=1e-3)


def test_stage_progress_records_each_epochs_time(teacher, data, tmp_path) -> None:
    assert stage_progress(tmp_path) is None
    config = StageConfig(loss="ce", trainable="tail", epochs=2, batch_size=8, optimizer="sgd")
    history = train_stage(inject_bottleneck(teacher, 2), data, config, checkpoint_dir=tmp_path, progress=False)
    done = stage_progress(tmp_path)
    assert done["epoch"] == 2 and done["history"] == history
    assert len(done["epoch_seconds"]) == 2 and all(s > 0 for s in done["epoch_seconds"])


def test_a_diverged_loss_stops_the_stage_with_a_clear_error(teacher, data) -> None:
    images, labels = data.tensors
    broken = TensorDataset(torch.full_like(images, float("nan")), labels)
    with pytest.raises(FloatingPointError, match="loss is nan at epoch 1, step 1.*lower the learning rate"):
        train_stage(inject_bottleneck(teacher, 2), broken, StageConfig(loss="ce", trainable="tail", batch_size=8),
                    progress=False)  # fmt: skip


# ----------------------------------------------------------------------------- the recipe and `split train`


def test_bottlefit_config_builds_the_papers_stages() -> None:
    (name1, first), (name2, second) = BottleFitConfig(stage2="kd", freeze_encoder=True, epochs=10).stages()
    assert (name1, first.loss, first.trainable, first.optimizer, first.lr_step) == ("stage1-ghnd", "ghnd", "bottleneck",
                                                                                     "adam", 5)
    assert (name2, second.loss, second.trainable, second.optimizer) == ("stage2-kd-fe", "kd", "tail", "sgd")
    assert [n for n, _ in BottleFitConfig(stage2="ft").stages()] == ["stage1-ghnd", "stage2-ft"]
    assert [n for n, _ in BottleFitConfig(stage2=None).stages()] == ["stage1-ghnd"]
    with pytest.raises(ValueError, match="accepted: ft, kd"):
        BottleFitConfig(stage2="ce")
    with pytest.raises(ValueError, match="epochs"):
        BottleFitConfig(epochs=0)


@pytest.mark.parametrize("color, normalize", [("rgb", "imagenet"), ("gray", "none")])
def test_png_offload_is_lossless_and_the_8_bit_path_is_the_payloads(teacher, color, normalize) -> None:
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (12, 1 if color == "gray" else 3, SIZE, SIZE), generator=gen)
    mean, std = NORMALISATIONS[normalize]
    m, s = torch.tensor(mean).view(1, -1, 1, 1), torch.tensor(std).view(1, -1, 1, 1)
    images = ((pixels.float() / 255).expand(-1, 3, -1, -1) - m) / s
    val = TensorDataset(images, torch.randint(0, 4, (12,), generator=gen))
    files = file_offload(teacher, val, color, mean, std, jpeg_qualities=(50,), batch_size=5)
    assert files["png"].accuracy == evaluate_accuracy(teacher, val)  # the decoded PNG is the input, exactly
    assert set(files) == {"png", "jpeg50"} and all(f.mean_bytes > 0 for f in files.values())
    student = inject_bottleneck(teacher, 2)
    result = evaluate_split(student, val, batch_size=5)
    with torch.inference_mode():
        z = student.eval().head(images)
        expected = (student.tail(decode(encode(z))).argmax(1) == val.tensors[1]).float().mean().item()
    assert result.quantized_accuracy == pytest.approx(expected)
    assert result.payload_bytes == len(encode(z[:1])) and result.bottleneck_shape == (2, 2, 2)


CLASSES = ("cross", "disc", "stripes")  # sorted: a folder's classes are in name order


def _draw(name: str, index: int, rng: np.random.Generator) -> Image.Image:
    """A small picture of class ``name``: a shape of its kind on a noisy background (sizes vary)."""
    from PIL import ImageDraw

    width, height = 36 + 2 * index, 40 - index
    image = Image.fromarray(rng.integers(0, 90, (height, width, 3), dtype=np.uint8))
    draw, colour = ImageDraw.Draw(image), tuple(int(v) for v in rng.integers(150, 256, 3))
    if name == "disc":
        draw.ellipse((6, 6, width - 6, height - 6), fill=colour)
    elif name == "cross":
        draw.line((0, 0, width, height), fill=colour, width=5)
        draw.line((0, height, width, 0), fill=colour, width=5)
    else:
        for y in range(0, height, 8):
            draw.rectangle((0, y, width, y + 3), fill=colour)
    return image


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """A real image folder: 3 classes x 12 PNG and JPEG files of several sizes."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for name in CLASSES:
        (root / name).mkdir()
        for i in range(12):
            _draw(name, i, rng).save(root / name / f"{i}.{'jpg' if i % 4 == 0 else 'png'}")
    return root


@pytest.fixture(scope="module")
def teacher_file(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("teacher") / "teacher.safetensors"
    save_weights(build_model("torchvision:resnet18", num_classes=len(CLASSES)), path)
    return path


def _said(result) -> str:
    """A CLI result's output on one line: the error box wraps long messages anywhere."""
    return " ".join(result.output.replace("│", " ").split())


def _train_args(teacher_file: Path, photos: Path, out: Path, **change: str | None) -> list[str]:
    options = {"--teacher": "torchvision:resnet18", "--teacher-weights": str(teacher_file), "--data": str(photos),
               "--size": "32", "--channels": "2", "--epochs": "2", "--batch-size": "8", "--val-fraction": "0.25",
               "--out": str(out), **change}  # fmt: skip
    return ["split", "train", "--no-progress", *(x for k, v in options.items() if v is not None for x in (k, v))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, teacher_file, photos):
    """One finished `split train` run: (run directory, CLI result)."""
    out = tmp_path_factory.mktemp("run") / "c2"
    extra = {"--json": str(out.parent / "log.json"), "--plot": str(out.parent / "loss.png")}
    result = CliRunner().invoke(app, _train_args(teacher_file, photos, out, **extra))
    assert result.exit_code == 0, result.output
    return out, result


def test_split_train_then_export_serve_and_infer_a_real_image(trained, photos, tmp_path) -> None:
    import shlex

    from edgetorch.split.artifact import load_code_tables, load_part, read_manifest
    from edgetorch.split.protocol import serve_in_background
    from edgetorch.split.server import create_app

    out, result = trained
    record = json.loads((out / "student.json").read_text())
    assert json.loads((out.parent / "log.json").read_text()) == record
    assert (out.parent / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert [s["name"] for s in record["stages"]] == ["stage1-ghnd", "stage2-ft"]
    assert all(len(s["loss_history"]) == 2 and s["seconds"] > 0 for s in record["stages"])
    evaluation = record["evaluation"]
    assert evaluation["val_images"] == 9  # 25% of each class's 12 images
    assert 0 <= evaluation["teacher_accuracy"] <= 1 and 0 <= evaluation["student"]["quantized_accuracy"] <= 1
    assert evaluation["student"]["payload_bytes"] == payload_size((1, 2, 4, 4))
    assert evaluation["offload"]["png"]["mean_bytes"] > evaluation["student"]["payload_bytes"]
    coded = evaluation["student"]["coded_payload_bytes"]  # real payloads, each never above the 8-bit one
    assert 0 < coded["mean"] <= coded["p90"] <= coded["largest"] <= evaluation["student"]["payload_bytes"]
    said = _said(result)
    assert "student, entropy-coded payload (deployed" in said and "teacher on JPEG q90 files" in said

    # The export command the run printed, as printed.
    command = shlex.split(result.output.split("export it with:")[1].strip())
    assert command[:3] == ["edgetorch", "split", "export"]
    runner = CliRunner()
    exported = runner.invoke(app, [*command[1:], "--json", str(out / "export.json")])
    assert exported.exit_code == 0, exported.output
    artifact = out / "artifact"
    manifest = read_manifest(artifact)
    assert json.loads((out / "export.json").read_text())["manifest"]["num_classes"] == len(CLASSES)
    assert manifest.class_names == CLASSES and manifest.input_shape == (3, 32, 32)
    assert (manifest.preprocess.color, manifest.preprocess.mean) == ("rgb", NORMALISATIONS["imagenet"][0])
    assert manifest.coded and "entropy-coded payloads" in _said(exported)  # the run's tables, in the artifact

    image = photos / "cross" / "1.png"
    tail, manifest = load_part(artifact, "tail")
    with serve_in_background(create_app(tail, manifest, tables=load_code_tables(artifact, manifest))) as url:
        answer = runner.invoke(app, ["split", "infer", str(artifact), str(image), "--server", url, "--top-k", "1",
                                     "--json", str(out / "infer.json")])
    assert answer.exit_code == 0, answer.output
    predicted = re.search(r"1\.png: (\w+) \d+\.\d%", _said(answer))
    assert predicted and predicted.group(1) in CLASSES, answer.output
    record = json.loads((out / "infer.json").read_text())
    assert record["images"][0]["top"][0]["class"] == predicted.group(1) and record["payload_bytes"] > 0


def test_a_split_artifact_predicts_validates_and_exports_its_head(trained, photos, tmp_path) -> None:
    """predict/val run the head and tail here through the 8-bit payload, on the manifest's
    preprocessing: the same numbers as the two sides by hand; export writes the head (the device's
    part) for onnxruntime and ExecuTorch, checked against PyTorch."""
    from edgetorch.split.artifact import load
    from edgetorch.split.client import preprocess_images
    from edgetorch.split.manifest import Preprocess

    runner = CliRunner()
    artifact = tmp_path / "artifact"
    exported = runner.invoke(app, ["split", "export", "--trained", str(trained[0]), "--out", str(artifact)])
    assert exported.exit_code == 0, exported.output
    images = sorted(photos.glob("*/*"))
    shown = runner.invoke(app, ["predict", str(artifact), *map(str, images), "--top-k", "1", "--json",
                                str(tmp_path / "p.json")])
    assert shown.exit_code == 0, shown.output
    head, tail = load(artifact)
    x = preprocess_images(images, Preprocess((32, 32), "rgb", *NORMALISATIONS["imagenet"], resize="center-crop"), 3)
    with torch.inference_mode():
        probabilities = tail(decode(encode(head(x)))).softmax(1)
    written = json.loads((tmp_path / "p.json").read_text())["predictions"]
    assert [p["top"][0]["class"] for p in written] == [CLASSES[i] for i in probabilities.argmax(1).tolist()]
    assert [p["top"][0]["probability"] for p in written] == pytest.approx(probabilities.max(1).values.tolist(),
                                                                           abs=1e-6)
    checked = runner.invoke(app, ["val", str(artifact), "--data", str(photos), "--json", str(tmp_path / "v.json")])
    assert checked.exit_code == 0, checked.output
    labels = torch.tensor([CLASSES.index(p.parent.name) for p in images])
    assert json.loads((tmp_path / "v.json").read_text())["top1"] == pytest.approx(
        (probabilities.argmax(1) == labels).float().mean().item())

    onnxruntime = pytest.importorskip("onnxruntime")
    with torch.inference_mode():
        bottleneck = head(x)
    done = runner.invoke(app, ["export", str(artifact), "--format", "onnx", "--out", str(tmp_path / "head.onnx")])
    assert done.exit_code == 0, done.output
    record = json.loads((tmp_path / "head.onnx.json").read_text())
    assert record["output"].startswith("bottleneck [N, 2, 4, 4]") and len(record["artifact_id"]) == 64
    assert (record["normalize"], record["preprocessing"]["resize"]) == ("imagenet", "center-crop")
    session = onnxruntime.InferenceSession(str(tmp_path / "head.onnx"), providers=["CPUExecutionProvider"])
    assert (torch.from_numpy(session.run(None, {"image": x.numpy()})[0]) - bottleneck).abs().max() <= 1e-4
    runtime = pytest.importorskip("executorch.runtime")
    done = runner.invoke(app, ["export", str(artifact), "--format", "executorch", "--batch-size", "4",
                               "--out", str(tmp_path / "head.pte")])
    assert done.exit_code == 0 and "ExecuTorch's outputs within" in done.output, done.output
    method = runtime.Runtime.get().load_program(tmp_path / "head.pte").load_method("forward")
    assert (method.execute([x[:4]])[0] - bottleneck[:4]).abs().max() <= 1e-4


def _skeleton(value):
    """A JSON value's keys, in order, with every leaf None and a list as its first item's skeleton."""
    if isinstance(value, dict):
        return {key: _skeleton(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_skeleton(item) for item in value[:1]]
    return None


def test_split_train_with_a_rate_weight_exports_serves_and_infers_version_3(teacher_file, photos, tmp_path):
    from edgetorch.split.artifact import load_code_tables, load_part, read_manifest
    from edgetorch.split.protocol import serve_in_background
    from edgetorch.split.server import create_app

    runner = CliRunner()
    out = tmp_path / "rated"
    result = runner.invoke(app, _train_args(teacher_file, photos, out, **{"--rate-weight": "0.001", "--epochs": "1"}))
    assert result.exit_code == 0, result.output
    record = json.loads((out / "student.json").read_text())
    assert [s["name"] for s in record["stages"]] == ["stage1-ghnd", "stage2-ft-rate0.001-levels16"]
    assert record["stages"][1]["config"]["rate_weight"] == 0.001 and record["stages"][1]["config"]["trainable"] == "all"
    student = record["evaluation"]["student"]
    assert 0 <= student["coded_accuracy"] <= 1 and student["coded_payload_bytes"]["largest"] <= student["payload_bytes"]
    assert "fixed steps" in " ".join(result.output.split())
    refused = runner.invoke(app, [*_train_args(teacher_file, photos, tmp_path / "fe", **{"--rate-weight": "0.001"}),
                                  "--freeze-encoder"])
    assert refused.exit_code != 0 and "freeze_encoder=False" in " ".join(refused.output.split())

    exported = runner.invoke(app, ["split", "export", "--trained", str(out), "--out", str(out / "artifact")])
    assert exported.exit_code == 0, exported.output
    artifact = out / "artifact"
    manifest = read_manifest(artifact)
    assert manifest.payload_format["version"] == 3 and manifest.coded
    tables = load_code_tables(artifact, manifest)
    assert tables.steps.sample_shape == tuple(manifest.bottleneck_shape)
    tail, manifest = load_part(artifact, "tail")
    with serve_in_background(create_app(tail, manifest, tables=tables)) as url:
        answer = runner.invoke(app, ["split", "infer", str(artifact), str(photos / "cross" / "1.png"), "--server", url,
                                     "--json", str(out / "infer.json")])
    assert answer.exit_code == 0, answer.output
    sent = json.loads((out / "infer.json").read_text())["payload_bytes"]
    assert 16 < sent < payload_size((1, *manifest.bottleneck_shape))


_STAGE_RECORD = {"name": None, "config": dict.fromkeys(["loss", "trainable", "epochs", "optimizer", "lr", "momentum",
                                                        "weight_decay", "lr_step", "batch_size", "alpha", "tau", "seed", "rate_weight"]),
                 "loss_history": [None], "seconds": None, "seconds_this_run": None}
# student.json as `split train` wrote it before StudentRun (at cacdc18): keys, order and nesting;
# preprocess.resize added with manifest version 3 (a record without it was trained stretched);
# code_tables and evaluation.student.coded_payload_bytes with record version 2; rate_weight, code_levels (recipe,
# rate_weight also in stages) and
# evaluation.student.coded_accuracy with rate-aware training (issue 27; readers ignore keys they do not know).
STUDENT_RECORD = {
    "format": None, "version": None, "weights": {"path": None, "sha256": None},
    "code_tables": {"path": None, "sha256": None},
    "model": dict.fromkeys(["arch", "channels", "split_point", "downsample", "num_classes", "architecture"]),
    "resolution": None, "preprocess": {"color": None, "mean": [None], "std": [None], "resize": None},
    "class_names": [None],
    "recipe": {**dict.fromkeys(["teacher", "data", "teacher_weights", "size", "color", "normalize", "val_fraction",
                                "train_limit", "val_limit", "skip_bad_images"]),
               "bottlefit": dict.fromkeys(["channels", "split_point", "downsample", "architecture", "stage2",
                                           "freeze_encoder", "epochs", "batch_size", "lr", "seed", "rate_weight",
                                           "code_levels"])},
    "skipped_images": [], "stages": [_STAGE_RECORD],
    "evaluation": {"val_images": None, "teacher_accuracy": None,
                   "student": {"float_accuracy": None, "quantized_accuracy": None, "bottleneck_shape": [None],
                               "float32_bytes": None, "payload_bytes": None,
                               "coded_payload_bytes": {**dict.fromkeys(["mean", "median", "p90", "largest"]),
                                                       "sample": [None]},
                               "coded_accuracy": None},
                   "offload": {name: {"mean_bytes": None, "accuracy": None} for name in ("png", "jpeg90")}},
    "torch_version": None,
}  # fmt: skip


def test_student_record_keeps_its_format(trained) -> None:
    """StudentRun.to_json writes student.json key for key as the untyped record did: `split export
    --trained` and every run directory already written depend on it."""
    from edgetorch.split.student import load_trained

    out, _ = trained
    record = json.loads((out / "student.json").read_text())
    assert json.dumps(_skeleton(record)) == json.dumps(STUDENT_RECORD)  # as text: the key order counts too
    assert (record["format"], record["version"], record["weights"]["path"]) == ("edgetorch-split-student", 2,
                                                                                "student.safetensors")
    assert record["code_tables"]["path"] == "code_tables.safetensors" and load_trained(out).code_tables.channels == 2
    assert record["resolution"] == record["recipe"]["size"] == 32 and record["class_names"] == list(CLASSES)
    assert record["preprocess"] == {"color": "rgb", "mean": list(NORMALISATIONS["imagenet"][0]),
                                    "std": list(NORMALISATIONS["imagenet"][1]), "resize": "center-crop"}
    assert load_trained(out).record == record
    assert load_trained(out).preprocess.resize == "center-crop"


def test_a_student_record_from_before_resize_loads_as_stretched(trained, tmp_path) -> None:
    import shutil

    from edgetorch.split.student import load_trained

    old = shutil.copytree(trained[0], tmp_path / "old")
    record = json.loads((old / "student.json").read_text())
    del record["preprocess"]["resize"]
    (old / "student.json").write_text(json.dumps(record))
    assert load_trained(old).preprocess.resize == "stretch"
    record["preprocess"]["resize"] = 3
    (old / "student.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="resize"):
        load_trained(old)


def test_a_version_1_student_record_loads_without_tables_and_exports_8_bit_payloads(trained, tmp_path) -> None:
    import shutil

    from edgetorch.split.artifact import read_manifest
    from edgetorch.split.student import load_trained

    old = shutil.copytree(trained[0], tmp_path / "old")
    record = json.loads((old / "student.json").read_text())
    del record["code_tables"], record["evaluation"]["student"]["coded_payload_bytes"]
    (old / "student.json").write_text(json.dumps({**record, "version": 1}))
    assert load_trained(old).code_tables is None
    exported = CliRunner().invoke(app, ["split", "export", "--trained", str(old), "--out", str(tmp_path / "a")])
    assert exported.exit_code == 0, exported.output
    assert not read_manifest(tmp_path / "a").coded
    plain = CliRunner().invoke(app, ["split", "export", "--trained", str(trained[0]), "--out", str(tmp_path / "b"),
                                     "--no-entropy-coding"])
    assert plain.exit_code == 0 and not read_manifest(tmp_path / "b").coded, plain.output
    (old / "student.json").write_text(json.dumps({**record, "version": 2, "code_tables": {"path": "x", "sha256": "0" * 64}}))
    with pytest.raises(CheckpointError, match="SHA-256 mismatch"):
        load_trained(old)
    (old / "student.json").write_text(json.dumps({**record, "version": True}))
    with pytest.raises(CheckpointError, match="version 1 or 2"):
        load_trained(old)


def test_split_sees_a_folder_as_finetune_does(photos, teacher_file, trained) -> None:
    """One preprocessing: `split train` and `split infer` feed a folder's images to the model exactly
    as `finetune` validates them (short side resized on the 8-bit image, centre crop), so a
    teacher scores the same in both (it scored 80.0% in finetune and 67.5% in split train
    when split stretched whole images)."""
    from edgetorch.data import image_folder, image_files
    from edgetorch.split.client import preprocess_images
    from edgetorch.split.manifest import Preprocess

    paths = sorted(photos.glob("*/*"))
    assert {Image.open(p).size[0] == Image.open(p).size[1] for p in paths} == {False}  # framing matters
    crop = Preprocess((32, 32), "rgb", *NORMALISATIONS["imagenet"], resize="center-crop")
    finetune = image_files(paths, 32)
    assert torch.equal(preprocess_images(paths, crop, 3), torch.stack([finetune[i][0] for i in range(len(paths))]))
    stretched = preprocess_images(paths, dataclasses.replace(crop, resize="stretch"), 3)
    assert (stretched - preprocess_images(paths, crop, 3)).abs().max() > 0.5

    val = image_folder(photos, 32, "val", val_fraction=0.25, seed=0)
    teacher = build_model("torchvision:resnet18", num_classes=len(CLASSES), weights=teacher_file).eval()
    record = json.loads((trained[0] / "student.json").read_text())
    assert record["evaluation"]["teacher_accuracy"] == pytest.approx(evaluate_accuracy(teacher, val))


def test_train_student_returns_the_run_it_records(teacher_file, photos, tmp_path) -> None:
    """The library call, no CLI: a typed StudentRun whose to_json is the student.json written."""
    from edgetorch.split import RecipeConfig, StudentRun, train_student
    from edgetorch.split.bottlefit import StageRun

    config = RecipeConfig(teacher="torchvision:resnet18", teacher_weights=str(teacher_file), data=str(photos), size=32,
                          val_fraction=0.25, bottlefit=BottleFitConfig(channels=2, epochs=1, batch_size=8))
    run = train_student(config, tmp_path / "run", progress=False)
    assert isinstance(run, StudentRun) and run.recipe == config.resolved() and run.class_names == CLASSES
    assert all(isinstance(stage, StageRun) for stage in run.stages) and len(run.stages[1].loss_history) == 1
    assert run.evaluation.student.payload_bytes == payload_size((1, 2, 4, 4)) and run.evaluation.val_images == 9
    assert run.evaluation.offload["png"].mean_bytes > run.evaluation.student.payload_bytes
    assert (run.resolution, run.preprocess.size, run.preprocess.color) == (32, (32, 32), "rgb")
    assert json.loads((tmp_path / "run" / "student.json").read_text()) == json.loads(json.dumps(run.to_json()))
    assert not run.model.training


def test_an_interrupted_split_train_resumes_to_the_same_weights(trained, teacher_file, photos, tmp_path,
                                                                 monkeypatch) -> None:  # fmt: skip
    from safetensors.torch import load_file

    real_save, saves = checkpoint_module.save, []

    def save_then_interrupt(*args, **kwargs):
        real_save(*args, **kwargs)
        saves.append(1)
        if len(saves) == 3:  # stage 1's two epochs and stage 2's first are checkpointed
            raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "save", save_then_interrupt)
    out, runner = tmp_path / "run", CliRunner()
    stopped = runner.invoke(app, _train_args(teacher_file, photos, out))
    assert stopped.exit_code == 130 and "run the same command again to resume" in _said(stopped)
    assert not (out / "student.json").exists()
    monkeypatch.setattr(checkpoint_module, "save", real_save)
    resumed = runner.invoke(app, _train_args(teacher_file, photos, out))
    assert resumed.exit_code == 0, resumed.output
    assert "stage1-ghnd: resuming after epoch 2/2" in resumed.output and "stage2-ft: resuming after epoch 1/2" in resumed.output
    straight = load_file(str(trained[0] / "student.safetensors"))
    again = load_file(str(out / "student.safetensors"))
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)
    stages = [json.loads((d / "student.json").read_text())["stages"] for d in (trained[0], out)]
    assert [s["loss_history"] for s in stages[0]] == [s["loss_history"] for s in stages[1]]


@pytest.mark.parametrize("change, message", [
    ({"--teacher-weights": "missing.safetensors"}, "missing.safetensors does not exist"),
    ({"--teacher-weights": "{dir}"}, "is a directory, not a file"),
    ({"--teacher-weights": None}, "needs its trained weights (--teacher-weights FILE)"),
    ({"--data": "{empty}"}, "no class subfolders"),
    ({"--data": "digits", "--val-fraction": None}, "for 10 classes (digits)"),
    ({"--data": "digits"}, "val_fraction applies to folders"),
    ({"--size": "30"}, "size 30 is not a multiple of 8"),
    ({"--stage2": "ce"}, "accepted: ft, kd"),
    ({"--batch-size": "64"}, "is less than one batch of 64"),
    ({"--teacher": "zoo:cnn", "--teacher-weights": None}, "cannot inject a bottleneck into SmallResNet"),
    ({"--out": "{file}"}, "is an existing file"),
    ({"--json": "{dir}"}, "is a directory; give a file path"),
    ({"--plot": "{dir}/loss.txt"}, "give a .png, .pdf, .svg file"),
    ({"--out": "{trained}", "--channels": "3"}, "holds a run of another recipe (it differs in channels)"),
])  # fmt: skip
def test_split_train_refuses_bad_input_with_a_message(trained, teacher_file, photos, tmp_path, change,
                                                      message) -> None:  # fmt: skip
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    places = {"dir": str(tmp_path), "empty": str(tmp_path / "empty"), "file": str(tmp_path / "file"),
              "trained": str(trained[0])}  # fmt: skip
    change = {k: None if v is None else v.format(**places) for k, v in change.items()}
    result = CliRunner().invoke(app, _train_args(teacher_file, photos, tmp_path / "out", **change))
    assert result.exit_code == 2 and message in _said(result), result.output
    assert not (tmp_path / "out").exists()  # nothing is written before the input is checked


def test_split_train_refuses_a_folder_too_large_to_decode_into_memory(teacher_file, photos, tmp_path,
                                                                     monkeypatch) -> None:  # fmt: skip
    """Every image is decoded up front: a folder bigger than half the available memory is refused
    before decoding (simulated: 36 images of 12 KiB each against 512 KiB available), not killed by the OOM killer part way."""
    import collections

    import edgetorch.split.recipe as recipe

    memory = collections.namedtuple("memory", "available")
    monkeypatch.setattr(recipe.psutil, "virtual_memory", lambda: memory(2**19))
    result = CliRunner().invoke(app, _train_args(teacher_file, photos, tmp_path / "out"))
    assert result.exit_code == 2 and "more than half the 0.0 GiB of memory available" in _said(result), result.output
    assert not (tmp_path / "out").exists()


def test_split_export_trained_refuses_an_unfinished_run_and_conflicting_options(trained, tmp_path) -> None:
    runner = CliRunner()
    (tmp_path / "unfinished").mkdir()
    missing = runner.invoke(app, ["split", "export", "--trained", str(tmp_path / "unfinished"), "--out", str(tmp_path / "a")])
    assert missing.exit_code == 2 and "has no student.json" in _said(missing)
    both = runner.invoke(app, ["split", "export", "--trained", str(trained[0]), "--channels", "3", "--size", "64",
                               "--out", str(tmp_path / "a")])  # fmt: skip
    assert both.exit_code == 2 and "drop --channels, --size" in _said(both)
    neither = runner.invoke(app, ["split", "export", "--random-init", "--out", str(tmp_path / "a")])
    assert neither.exit_code == 2 and "--model and --channels are required" in _said(neither)


def test_split_train_stops_at_a_truncated_image_or_leaves_it_out(teacher_file, photos, tmp_path) -> None:
    import io
    import shutil

    copy = shutil.copytree(photos, tmp_path / "photos")
    buffer = io.BytesIO()
    _draw("disc", 0, np.random.default_rng(1)).resize((128, 128)).save(buffer, format="JPEG")
    (copy / "disc" / "cut.jpg").write_bytes(buffer.getvalue()[: buffer.tell() // 2])  # intact header, data cut off
    stopped = CliRunner().invoke(app, _train_args(teacher_file, copy, tmp_path / "out"))
    said = _said(stopped).replace(" ", "")
    assert stopped.exit_code == 2 and "cut.jpg:notareadableimage(imagefileistruncated" in said, stopped.output
    assert "--skip-bad-images" in said and not (tmp_path / "out").exists()

    with pytest.warns(UserWarning, match="left out 1 of 37 images that cannot be read"):
        skipped = CliRunner().invoke(app, [*_train_args(teacher_file, copy, tmp_path / "out", **{"--epochs": "1"}),
                                           "--skip-bad-images"])
    assert skipped.exit_code == 0, skipped.output
    assert "left out 1 unreadable image(s) (skip_bad_images)" in _said(skipped)
    record = json.loads((tmp_path / "out" / "student.json").read_text())
    assert len(record["skipped_images"]) == 1 and "cut.jpg: not a readable image" in record["skipped_images"][0]
    assert record["evaluation"]["val_images"] == 9  # the 36 readable images, split as before


def test_split_plan_reads_the_accuracies_split_train_wrote(trained, tmp_path) -> None:
    """`split train --json` feeds `split plan --accuracy` (it said the file held neither accuracy)."""
    from edgetorch.split.plan import load_accuracy
    from edgetorch.split.student import RECORD_FORMAT

    out, _ = trained
    evaluation = json.loads((out.parent / "log.json").read_text())["evaluation"]
    accuracy = load_accuracy(out.parent / "log.json")
    assert accuracy.teacher == evaluation["teacher_accuracy"]
    assert accuracy.jpeg == evaluation["offload"]["jpeg90"]["accuracy"]
    assert accuracy.split == {2: evaluation["student"]["quantized_accuracy"]}  # C = 2
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"format": RECORD_FORMAT, "evaluation": {}}))
    with pytest.raises(InputFileError, match="not an accuracy file"):
        load_accuracy(broken)
