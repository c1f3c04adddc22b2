"""`edgetorch reduce` end to end, and the measured latency comparison it reports."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from edgetorch.cli import app
from edgetorch.data import load_dataset
from edgetorch.reduce import compare_latency, count_macs, load
from edgetorch.training import Loop, one_cycle_adamw, supervised, train_epochs
from edgetorch.zoo import MLP, PlainCNN, evaluate_accuracy, save_weights


def test_compare_latency_times_both_models_and_reports_the_ratio():
    calls = []

    class Counted(nn.Linear):
        def __init__(self, name, width):
            super().__init__(16, width)
            self.name = name

        def forward(self, x):
            calls.append(self.name)
            return super().forward(x)

    result = compare_latency(Counted("full", 64), Counted("reduced", 4), torch.randn(8, 16), rounds=5, warmup=2)
    pair = ["full", "reduced"]
    assert calls == pair * 2 + (pair + pair[::-1]) * 2 + pair  # the warm-up, then who goes first alternates
    assert result.rounds == 5 and result.full_seconds > 0 and result.reduced_seconds > 0
    assert result.ratio == pytest.approx(result.reduced_seconds / result.full_seconds)


def test_compare_latency_rejects_no_rounds():
    with pytest.raises(ValueError, match="rounds >= 1"):
        compare_latency(nn.Identity(), nn.Identity(), torch.zeros(1), rounds=0)


@pytest.fixture()
def mlp_weights(tmp_path):
    torch.manual_seed(0)
    model = MLP(num_classes=10, image_size=8)
    path = tmp_path / "mlp.safetensors"
    save_weights(model, path)
    return model.eval(), path


def test_reduce_command_writes_a_model_within_budget(mlp_weights, tmp_path):
    full, weights = mlp_weights
    out, summary_json, plot = tmp_path / "reduced.safetensors", tmp_path / "summary.json", tmp_path / "factors.png"
    result = CliRunner().invoke(app, [
        "reduce", "--model", "zoo:mlp", "--weights", str(weights), "--size", "8", "--alpha", "0.6",
        "--method", "lowrank", "--allocation", "optimal", "--data", "digits", "--calibration", "50",
        "--latency-batch", "4", "--out", str(out), "--json", str(summary_json), "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "ratio" in result.output and "measured" in result.output
    reduced, record = load(out)
    x = load_dataset("digits", "test", size=8).tensors[0][:3]
    assert reduced(x).shape == full(x).shape
    assert 1 - count_macs(reduced, x[:1]) / count_macs(full, x[:1]) >= 0.6
    summary = record["reduction"]
    assert summary["macs_reduced"] == count_macs(reduced, x[:1])
    assert summary["latency_ratio"] > 0 and 0 <= summary["accuracy_reduced"] <= 1
    assert json.loads(json.dumps(summary)) == summary  # JSON-able as written
    assert json.loads(summary_json.read_text()) == summary  # --json: the same summary, layers included


@pytest.mark.parametrize("args, match", [
    (["--method", "magic"], "unknown method 'magic'; accepted: prune, prune-ls, lowrank"),
    (["--allocation", "exact"], "unknown allocation 'exact'; accepted: optimal, pso, uniform"),
    (["--alpha", "1.5"], "alpha"),
    (["--size", "10"], "shape mismatch"),
    (["--out", "small.pt"], "must end in .safetensors"),
    (["--plot", "factors.txt"], "give a .png, .pdf, .svg file"),
    (["--json", "missing/summary.json"], "does not exist"),
    (["--finetune-epochs", "-1"], "Input should be greater than or equal to 0"),
    (["--finetune-epochs", "1", "--finetune-lr", "0"], "0.0 is not a learning rate: give a number > 0"),
    (["--distill"], "--distill fine-tunes from the full model: give --finetune-epochs 1 or more"),
])
def test_reduce_command_refuses_bad_arguments(mlp_weights, args, match):
    _, weights = mlp_weights
    base = ["reduce", "--model", "zoo:mlp", "--weights", str(weights), "--size", "8", "--alpha", "0.5"]
    result = CliRunner().invoke(app, base + args)
    assert result.exit_code == 2, result.output  # a usage error, reported without a traceback
    assert match in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_reduce_command_exits_1_when_it_cannot_write(mlp_weights, tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("edgetorch.reduce.save", full_disk)
    _, weights = mlp_weights
    result = CliRunner().invoke(app, [
        "reduce", "--model", "zoo:mlp", "--weights", str(weights), "--size", "8", "--alpha", "0.5",
        "--method", "lowrank", "--no-accuracy", "--latency-batch", "2", "--out", str(tmp_path / "small.safetensors")])
    assert result.exit_code == 1, result.output
    assert "could not write its outputs" in result.output and "No space left" in result.output
    assert not isinstance(result.exception, OSError)  # handled, not raised


def test_reduce_command_prunes_the_zoo_plain_cnn(tmp_path):
    torch.manual_seed(0)
    full = PlainCNN(num_classes=10, image_size=16).eval()  # the CLI builds zoo:plaincnn with its defaults
    weights, out = tmp_path / "cnn.safetensors", tmp_path / "small.safetensors"
    save_weights(full, weights)
    result = CliRunner().invoke(app, [
        "reduce", "--model", "zoo:plaincnn", "--weights", str(weights), "--size", "16", "--alpha", "0.5",
        "--method", "prune-ls", "--data", "digits", "--calibration", "100", "--latency-batch", "4",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    reduced, record = load(out)
    x = load_dataset("digits", "test", size=16).tensors[0][:3]
    assert reduced(x).shape == (3, 10)
    assert 1 - count_macs(reduced, x[:1]) / count_macs(full, x[:1]) >= 0.5
    assert any(entry["type"] == "BatchNorm2d" for entry in record["modules"])


def test_reduce_command_finetunes_an_over_pruned_model_and_saves_the_fine_tuned_one(tmp_path):
    train, test = load_dataset("digits", "train", size=8), load_dataset("digits", "test", size=8)
    torch.manual_seed(0)
    full = MLP(num_classes=10, image_size=8)  # what the CLI builds for zoo:mlp at --size 8
    loop = Loop(epochs=10, batch_size=64)
    train_epochs(full.train(), train, loop, supervised(full), *one_cycle_adamw(full, loop, len(train), 3e-3, 1e-4))
    weights, out, summary_json = tmp_path / "mlp.safetensors", tmp_path / "small.safetensors", tmp_path / "s.json"
    save_weights(full, weights)
    result = CliRunner().invoke(app, [
        "reduce", "--model", "zoo:mlp", "--weights", str(weights), "--size", "8", "--alpha", "0.95",
        "--method", "prune", "--data", "digits", "--calibration", "500", "--latency-batch", "4",
        "--finetune-epochs", "3", "--finetune-lr", "3e-3", "--distill", "--out", str(out),
        "--json", str(summary_json)])
    assert result.exit_code == 0, result.output
    summary = json.loads(summary_json.read_text())
    assert summary["accuracy_reduced"] < summary["accuracy_full"] - 0.1  # over-pruned: much lost ...
    assert summary["accuracy_finetuned"] > summary["accuracy_reduced"] + 0.05  # ... and much recovered
    tuned = summary["finetune"]
    assert (tuned["epochs"], tuned["lr"], tuned["distill"], tuned["train_samples"]) == (3, 3e-3, True, len(train))
    assert len(tuned["accuracy"]) == len(tuned["train_loss"]) == 3 and tuned["accuracy"][-1] == summary["accuracy_finetuned"]
    assert "fine-tuned 3 epoch(s)" in result.output and "distilling from the full model" in result.output
    reduced, _ = load(out)
    assert evaluate_accuracy(reduced, test) == summary["accuracy_finetuned"]  # the saved model is the fine-tuned one


def test_the_reduce_workflow_is_a_library_call_with_the_clis_numbers(mlp_weights, tmp_path):
    """What `edgetorch reduce --json` writes, a Python caller gets from run_reduction, without the
    command touching torch's global generator."""
    from edgetorch.reduce.workflow import ReduceJob, run_reduction

    _, weights = mlp_weights
    # uniform allocation: no solver whose answer could depend on a time limit on a busy machine
    job = ReduceJob(model="zoo:mlp", weights=weights, size=8, alpha=0.6, method="lowrank", allocation="uniform",
                    latency_batch=4)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    run = run_reduction(job)
    assert torch.equal(torch.get_rng_state(), state)
    summary = run.summary()
    assert summary["macs_reduced"] == run.macs_reduced == count_macs(run.reduction.model, torch.zeros(1, 1, 8, 8))
    assert 1 - run.macs_reduced / run.macs_full >= 0.6 and summary["achieved_alpha"] >= 0.6
    assert 0 <= run.accuracy_reduced <= 1 and run.latency.ratio > 0 and "finetune" not in summary

    result = CliRunner().invoke(app, ["reduce", "--model", "zoo:mlp", "--weights", str(weights), "--size", "8",
                                      "--alpha", "0.6", "--method", "lowrank", "--allocation", "uniform",
                                      "--latency-batch", "4",
                                      "--json", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "s.json").read_text())
    timing = ("solver_seconds", "latency_full_s", "latency_reduced_s", "latency_ratio")
    assert {k: v for k, v in written.items() if k not in timing} == \
        {k: v for k, v in json.loads(json.dumps(summary, default=str)).items() if k not in timing}


@pytest.mark.parametrize("fields, match", [
    ({"distill": True}, "distill fine-tunes from the full model"),
    ({"finetune_epochs": 1, "finetune_lr": 0.0}, "is not a learning rate"),
])
def test_a_reduce_job_refuses_what_cannot_run(fields, match):
    from edgetorch.reduce.workflow import ReduceJob

    with pytest.raises(ValueError, match=match):
        ReduceJob(model="zoo:mlp", alpha=0.5, **fields)


def test_reduce_without_torch_pruning_prints_the_install_hint_whole(tmp_path, monkeypatch):
    """A residual network needs Torch-Pruning; the hint names the extra in brackets, which rich
    markup would swallow (issue 28: it printed pip install 'edgetorch')."""
    import sys

    import torchvision

    monkeypatch.setitem(sys.modules, "torch_pruning", None)
    save_weights(torchvision.models.resnet18(num_classes=10), tmp_path / "r18.safetensors")
    result = CliRunner().invoke(app, ["reduce", "--model", "torchvision:resnet18", "--weights", str(tmp_path / "r18.safetensors"),
                                      "--data", "digits", "--size", "32", "--calibration", "8", "--no-accuracy",
                                      "--alpha", "0.5"])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "pip install 'edgetorch[reduce]'" in text, text


def test_first_use_pretraining_is_announced_with_its_time_left_then_loads_quietly(tmp_path, monkeypatch):
    """Issue 28, item 7: pretraining a zoo model on first use ran minutes without a word (plaincnn
    on Fashion-MNIST: 6 min). The command now says what it trains and where it caches it, then the
    time left as measured; a second run loads the cached model and says nothing of it."""
    monkeypatch.setenv("EDGETORCH_CACHE", str(tmp_path / "cache"))
    command = ["reduce", "--model", "zoo:mlp", "--data", "digits", "--size", "28", "--alpha", "0.3",
               "--calibration", "64", "--latency-batch", "4", "--out", str(tmp_path / "small.safetensors")]
    first = CliRunner().invoke(app, command)
    assert first.exit_code == 0, first.output
    lines = first.output.splitlines()
    announced = [line for line in lines if line.startswith("pretraining mlp on digits once")]
    assert len(announced) == 1 and "20 epoch(s) over 1,438 images at 28 px" in announced[0], first.output
    assert str(tmp_path / "cache" / "zoo") in "".join(first.output.split()), first.output  # wrapped at 130 columns
    left = [line for line in lines if line.startswith("pretraining mlp on digits: step ")]
    assert 5 <= len(left) <= 10 and all(" left" in line for line in left), left  # about every tenth
    second = CliRunner().invoke(app, command)
    assert second.exit_code == 0, second.output
    assert not [line for line in second.output.splitlines() if line.startswith("pretraining")], second.output


def test_reduce_takes_a_fine_tuned_model_and_its_folder(fine_tuned, tmp_path):
    """Issue 28, item 4: `reduce --data photos/` answered "accepted: digits, fashion-mnist", and a
    3-class model.safetensors failed on its classifier's shape. Now the model finetune wrote and
    its folder reduce end to end: accuracy on the images fine-tuning held out (its record's seed),
    and the reduced model's record says its classes, size and normalisation."""
    run = fine_tuned / "run"
    record = json.loads((run / "model.json").read_text())
    out, summary_file = tmp_path / "small.safetensors", tmp_path / "small.json.summary"
    result = CliRunner().invoke(app, ["reduce", "--model", "zoo:mlp", "--weights", str(run / "model.safetensors"),
                                      "--data", str(fine_tuned / "photos"), "--size", "28", "--alpha", "0.5",
                                      "--calibration", "16", "--latency-batch", "2", "--out", str(out),
                                      "--json", str(summary_file)])
    assert result.exit_code == 0, result.output
    summary = json.loads(summary_file.read_text())
    assert summary["classes"] == record["classes"] == ["one", "three", "two"]
    assert summary["image_size"] == 28 and summary["normalize"] is None
    held_out = int(record["data"].split(", ")[1].split()[0])  # "photos: 24 train, 6 val images, 3 classes"
    assert summary["test_samples"] == held_out == 6
    assert summary["accuracy_full"] == pytest.approx(record["val_accuracy"])  # the same images, the same model
    reduced, saved = load(out)
    assert saved["reduction"]["classes"] == record["classes"] and reduced(torch.rand(2, 1, 28, 28)).shape == (2, 3)


@pytest.mark.parametrize("change, message", [
    ({"--size": "32"}, "was fine-tuned on 28x28 images"),
    ({"--weights": None}, "needs --weights: the model fine-tuned on them"),
    ({"--data": "other"}, "was fine-tuned on ['one', 'three', 'two']"),
])
def test_reduce_refuses_a_folder_that_does_not_match_the_fine_tuned_model(fine_tuned, change, message):
    other = fine_tuned / "other"
    if not other.exists():
        for name in ("a", "b", "c"):
            (other / name).mkdir(parents=True)
            for i in range(3):
                (other / name / f"{i}.png").write_bytes((fine_tuned / "photos" / "one" / f"{i}.png").read_bytes())
    options = {"--model": "zoo:mlp", "--weights": str(fine_tuned / "run" / "model.safetensors"),
               "--data": str(fine_tuned / "photos"), "--size": "28", "--alpha": "0.5"}
    options |= {k: (str(other) if v == "other" else v) for k, v in change.items()}
    args = ["reduce", *(x for k, v in options.items() if v is not None for x in (k, v))]
    result = CliRunner().invoke(app, args)
    said = " ".join(result.output.replace("│", " ").split())  # the error panel's borders out
    assert result.exit_code == 2 and message in said, result.output


@pytest.mark.parametrize("field, value", [("image_size", "28"), ("classes", {"a": 1}), ("val_fraction", 7),
                                          ("config", {"seed": "x"}), (None, [1, 2])])
def test_reduce_refuses_a_tampered_finetune_record_with_a_message(fine_tuned, tmp_path, field, value):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(fine_tuned / "run", run)
    record = json.loads((run / "model.json").read_text())
    (run / "model.json").write_text(json.dumps(value if field is None else {**record, field: value}))
    result = CliRunner().invoke(app, ["reduce", "--model", "zoo:mlp", "--weights", str(run / "model.safetensors"),
                                      "--data", str(fine_tuned / "photos"), "--size", "28", "--alpha", "0.5"])
    said = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and "Traceback" not in said, said
    assert ("is not a finetune record" if field is None else f"{field} ") in said and "model.json" in said, said
