"""`edgetorch predict`, `val` and `export` (issue 28): a fine-tuned or reduced model on images,
preprocessed as it was trained, and the pipeline finetune -> reduce -> predict -> export on one folder.
(A split artifact's: tests/test_split_train.py, beside the run that makes one.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from edgetorch.cli import app
from edgetorch.data import image_folder
from edgetorch.finetune.predict import load_classifier, predict, validate


def _said(result) -> str:
    return " ".join(result.output.replace("│", " ").split())


def test_predict_shows_each_images_top_classes_as_the_model_scores_them(fine_tuned, tmp_path):
    run, photos = fine_tuned / "run", fine_tuned / "photos"
    out = tmp_path / "predictions.json"
    result = CliRunner().invoke(app, ["predict", str(run), str(photos / "two"), str(photos / "one" / "0.png"),
                                      "--top-k", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())["predictions"]
    assert [p["path"] for p in written] == [*(str(photos / "two" / f"{i}.png") for i in range(10)),
                                            str(photos / "one" / "0.png")]
    # The same numbers as the model on the validation transform of the folder (what training scored).
    model = load_classifier(run).model
    images = image_folder(photos, 28, "all", color="gray", normalize=None)
    with torch.inference_mode():
        expected = model(torch.stack([images[i][0] for i in range(len(images))])).softmax(1)
    index = {str(path): i for i, (path, _) in enumerate(images.samples)}
    classes = json.loads((run / "model.json").read_text())["classes"]
    for p in written:
        row = expected[index[p["path"]]]
        top = row.topk(2)
        assert [t["class"] for t in p["top"]] == [classes[i] for i in top.indices.tolist()]
        assert [t["probability"] for t in p["top"]] == pytest.approx(top.values.tolist(), abs=1e-6)
        assert f"{p['path']}: {p['top'][0]['class']} {p['top'][0]['probability']:.1%}" in result.output


def test_val_reports_top1_topk_and_per_class_accuracy(fine_tuned, tmp_path):
    run, photos = fine_tuned / "run", fine_tuned / "photos"
    out = tmp_path / "val.json"
    result = CliRunner().invoke(app, ["val", str(run), "--data", str(photos), "--top-k", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    predictions = predict(load_classifier(run), [photos], top_k=3)
    labels = [p.path.parent.name for p in predictions]
    top1 = sum(p.top[0][0] == label for p, label in zip(predictions, labels)) / len(labels)
    top2 = sum(label in (p.top[0][0], p.top[1][0]) for p, label in zip(predictions, labels)) / len(labels)
    assert record["images"] == 30 and record["top1"] == pytest.approx(top1) and record["top2"] == pytest.approx(top2)
    assert set(record["per_class"]) == {"one", "three", "two"}
    assert f"top-1 {top1:.4f}, top-2 {top2:.4f}" in result.output


def test_finetune_reduce_predict_export_on_one_folder(fine_tuned, tmp_path):
    """The pipeline: the model finetune wrote is reduced on its folder, and the reduced model
    predicts and validates with the classes and preprocessing its record carries."""
    small = tmp_path / "small.safetensors"
    reduced = CliRunner().invoke(app, ["reduce", "--model", "zoo:mlp", "--weights",
                                       str(fine_tuned / "run" / "model.safetensors"), "--data",
                                       str(fine_tuned / "photos"), "--size", "28", "--alpha", "0.3",
                                       "--calibration", "16", "--latency-batch", "2", "--out", str(small)])
    assert reduced.exit_code == 0, reduced.output
    classifier = load_classifier(small)
    assert classifier.classes == ["one", "three", "two"] and (classifier.image_size, classifier.color) == (28, "gray")
    shown = CliRunner().invoke(app, ["predict", str(small), str(fine_tuned / "photos" / "three" / "1.png")])
    assert shown.exit_code == 0 and "1.png: " in shown.output, shown.output
    assert 0 <= validate(classifier, fine_tuned / "photos").top1 <= 1

    # ... and exported for onnxruntime: the same logits as PyTorch on the folder's real images.
    onnxruntime = pytest.importorskip("onnxruntime")
    exported = CliRunner().invoke(app, ["export", str(small), "--format", "onnx", "--out", str(tmp_path / "small.onnx")])
    assert exported.exit_code == 0 and "onnxruntime's outputs within" in exported.output, exported.output
    record = json.loads((tmp_path / "small.onnx.json").read_text())
    assert record["classes"] == classifier.classes and (record["image_size"], record["color"]) == (28, "gray")
    images = image_folder(fine_tuned / "photos", 28, "all", color="gray", normalize=None)
    x = torch.stack([images[i][0] for i in range(len(images))])
    session = onnxruntime.InferenceSession(str(tmp_path / "small.onnx"), providers=["CPUExecutionProvider"])
    with torch.inference_mode():
        expected = classifier.model(x)
    got = torch.from_numpy(session.run(None, {"image": x.numpy()})[0])
    assert (got - expected).abs().max().item() <= 1e-4

    # ... and for ExecuTorch (XNNPACK), a program for batches of 5: its runtime on real images.
    runtime = pytest.importorskip("executorch.runtime")
    exported = CliRunner().invoke(app, ["export", str(small), "--format", "executorch", "--batch-size", "5",
                                        "--out", str(tmp_path / "small.pte")])
    assert exported.exit_code == 0 and "ExecuTorch's outputs within" in exported.output, exported.output
    assert json.loads((tmp_path / "small.pte.json").read_text())["batch"] == 5
    method = runtime.Runtime.get().load_program(tmp_path / "small.pte").load_method("forward")
    for start in range(0, 30, 5):
        assert (method.execute([x[start:start + 5]])[0] - expected[start:start + 5]).abs().max().item() <= 1e-4


def test_export_refuses_what_it_cannot_write(fine_tuned, tmp_path):
    runner = CliRunner()
    run = str(fine_tuned / "run")
    for args, message in ((["--format", "tflite", "--out", str(tmp_path / "m.onnx")], "accepted: onnx, executorch"),
                          (["--out", str(tmp_path / "m.pt")], "give a file name ending in .onnx"),
                          (["--format", "executorch", "--out", str(tmp_path / "m.onnx")], "ending in .pte")):
        result = runner.invoke(app, ["export", run, *args])
        assert result.exit_code == 2 and message in _said(result), _said(result)
    assert not list(tmp_path.iterdir())


def test_predict_and_val_refuse_what_they_cannot_use_with_a_message(fine_tuned, tmp_path):
    runner = CliRunner()
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["predict", str(empty), "x.png"], "is neither a finetune run (model.safetensors + model.json"),
        (["predict", str(fine_tuned / "run"), str(tmp_path / "none.png")], "none.png: no such file or folder"),
        (["predict", str(fine_tuned / "run"), str(empty)], "no image files among"),
        (["predict", str(tmp_path / "model.pt"), "x.png"], "give a finetune run directory or a reduced model's"),
    ]
    other = tmp_path / "other"
    for name in ("a", "b"):
        (other / name).mkdir(parents=True)
        shutil.copy(fine_tuned / "photos" / "one" / "0.png", other / name / "0.png")
        shutil.copy(fine_tuned / "photos" / "one" / "1.png", other / name / "1.png")
    cases.append((["val", str(fine_tuned / "run"), "--data", str(other)], "has the classes ['a', 'b']"))
    tampered = tmp_path / "tampered"
    shutil.copytree(fine_tuned / "run", tampered)
    record = json.loads((tampered / "model.json").read_text())
    edits = [({"image_size": 10**9}, ["predict", str(tampered), str(fine_tuned / "photos")], "image_size '1000000000' is missing or not what"),
             ({"classes": "one"}, ["val", str(tampered), "--data", str(fine_tuned / "photos")], "classes 'one'"),
             # A record naming a factory would import its module when the model is built: refused first.
             ({"model": "shutil:rmtree"}, ["predict", str(tampered), str(fine_tuned / "photos")],
              "may name only zoo:NAME or torchvision:NAME models")]
    for edit, args, message in [({}, args, message) for args, message in cases] + edits:
        (tampered / "model.json").write_text(json.dumps({**record, **edit}))
        result = runner.invoke(app, args)
        said = _said(result)
        assert result.exit_code == 2 and message in said and "Traceback" not in said, (args, said)


@pytest.mark.parametrize("color, normalize", [("rgb", "imagenet"), ("gray", None), ("gray", "imagenet")])
def test_the_preprocessing_record_reproduces_what_the_model_saw(tmp_path, color, normalize):
    """Issue 28, item 3: model.json said only the size and "imagenet", and torchvision's
    Resize(64)+CenterCrop(64) differed from what training saw by up to 4.5. The record now spells
    out every step; followed here with Pillow and numpy alone, it gives exactly the tensors the
    model was trained and validated on."""
    import numpy as np
    from PIL import Image

    from edgetorch.data import image_files
    from edgetorch.data.folder import preprocessing_record

    rng = np.random.default_rng(1)
    path = tmp_path / "photo.png"
    Image.fromarray(rng.integers(0, 256, (75, 103, 3), dtype=np.uint8)).save(path)
    record = json.loads(json.dumps(preprocessing_record(48, color, normalize)))  # as read back from model.json
    assert record["version"] == 1 and record["center_crop"] == [48, 48] and record["resize_short_side"] == 55
    image = Image.open(path).convert(record["mode"])
    width, height = image.size  # 103 x 75: the height is the short side
    short = record["resize_short_side"]
    image = image.resize((int(short * width / height), short), Image.Resampling.BILINEAR)
    crop_h, crop_w = record["center_crop"]
    top, left = round((image.height - crop_h) / 2), round((image.width - crop_w) / 2)
    pixels = np.asarray(image.crop((left, top, left + crop_w, top + crop_h)), dtype=np.float32) * record["scale"]
    pixels = pixels.reshape(crop_h, crop_w, -1).transpose(2, 0, 1)
    if record["mean"]:
        pixels = (pixels - np.array(record["mean"], np.float32)[:, None, None]) / np.array(record["std"],
                                                                                           np.float32)[:, None, None]
    seen = image_files([path], 48, color=color, normalize=normalize)[0][0]
    assert tuple(seen.shape) == pixels.shape and (seen - torch.from_numpy(pixels)).abs().max().item() < 1e-5


def test_each_record_carries_the_preprocessing(fine_tuned, tmp_path):
    from edgetorch.data.folder import preprocessing_record

    expected = preprocessing_record(28, "gray", None)
    assert json.loads((fine_tuned / "run" / "model.json").read_text())["preprocessing"] == expected
    small = tmp_path / "small.safetensors"
    reduced = CliRunner().invoke(app, ["reduce", "--model", "zoo:mlp", "--weights",
                                       str(fine_tuned / "run" / "model.safetensors"), "--data",
                                       str(fine_tuned / "photos"), "--alpha", "0.3", "--calibration", "16",
                                       "--latency-batch", "2", "--out", str(small)])
    assert reduced.exit_code == 0, reduced.output
    assert load_classifier(small).preprocessing == expected
    pytest.importorskip("onnxruntime")
    exported = CliRunner().invoke(app, ["export", str(fine_tuned / "run"), "--out", str(tmp_path / "m.onnx")])
    assert exported.exit_code == 0, exported.output
    assert json.loads((tmp_path / "m.onnx.json").read_text())["preprocessing"] == expected
