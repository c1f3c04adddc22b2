"""edgetorch finetune: start models, scopes, the loop's exactness and resume, and the CLI on a real folder."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import shutil

import pytest
import torch
import torchvision
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

from edgetorch.cli import app
from edgetorch.data import image_data
from edgetorch.finetune import (FinetuneConfig, FinetuneJob, NothingFits, classifier_name, finetune, replace_classifier,
                                run_finetune, set_scope, start_model)
from edgetorch.zoo import CheckpointError, save_weights

COLORS = {"red": (200, 30, 30), "green": (30, 180, 40), "blue": (40, 50, 210)}
# The keys, in order, of what `edgetorch finetune --json` wrote before the command became a call
# of run_finetune (read from its output at 8641608): scripts that read the summary keep working.
SUMMARY_KEYS = ["model", "weights", "origin", "data", "classes", "num_classes", "image_size", "channels", "normalize",
                "val_fraction", "preprocessing", "skipped_images", "config", "history", "val_accuracy", "peak_bytes",
                "peak_kind", "process_peak_bytes", "resumed_from_epoch", "weights_file"]
PLAN_KEYS = ["budget_bytes", "chosen", "reason", "held_bytes", "memory_kind", "calibration_batches", "candidates",
             "measured_peak_bytes", "within_budget", "prediction_error"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Three classes of 10 real PNG files each: noisy images of one dominant colour per class."""
    root = tmp_path_factory.mktemp("photos")
    rng = torch.Generator().manual_seed(0)
    for name, rgb in COLORS.items():
        (root / name).mkdir()
        for i in range(10):
            noise = torch.randint(-60, 60, (40, 40, 3), generator=rng)
            pixels = (torch.tensor(rgb) + noise).clamp(0, 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def imagenet_weights(tmp_path_factory):
    """A resnet18 weight file with torchvision's own 1,000-class classifier (random values)."""
    path = tmp_path_factory.mktemp("weights") / "resnet18.safetensors"
    torch.manual_seed(1)
    save_weights(torchvision.models.resnet18(), path)
    return path


def _resnet(weights, classes=3):
    torch.manual_seed(0)
    model, origin = start_model("torchvision:resnet18", classes, weights)
    return model, origin


def test_start_model_replaces_the_classifier_and_keeps_the_rest(imagenet_weights):
    model, origin = _resnet(imagenet_weights)
    assert classifier_name(model) == "fc" and model.fc.out_features == 3
    assert "new 3-class classifier" in origin
    reference = load_file(str(imagenet_weights))
    assert torch.equal(model.conv1.weight, reference["conv1.weight"])
    assert torch.equal(model.layer4[1].bn2.running_var, reference["layer4.1.bn2.running_var"])


def test_scopes_mark_the_documented_parameters(imagenet_weights):
    model, _ = _resnet(imagenet_weights)
    names = lambda: {n for n, p in model.named_parameters() if p.requires_grad}  # noqa: E731
    set_scope(model, "last")
    assert names() == {"fc.weight", "fc.bias"}
    set_scope(model, "bias")
    assert names() == {"fc.weight", "fc.bias"} | {n for n, _ in model.named_parameters() if n.endswith(".bias")}
    set_scope(model, "norm+last")
    assert "bn1.weight" in names() and "layer1.0.conv1.weight" not in names() and "fc.weight" in names()
    set_scope(model, "full")
    assert names() == {n for n, _ in model.named_parameters()}
    with pytest.raises(ValueError, match="accepted: full, last, norm\\+last, bias"):
        set_scope(model, "head")


def test_a_new_task_with_as_many_classes_gets_a_new_classifier_drawn_from_the_rng():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5))
    old, first = model[2], model[0].weight.detach().clone()
    assert not replace_classifier(model, 5) and model[2] is old  # same count: kept by default
    torch.manual_seed(7)
    assert replace_classifier(model, 5, new_task=True) and model[2] is not old
    torch.manual_seed(7)
    expected = torch.nn.Linear(8, 5)
    assert torch.equal(model[2].weight, expected.weight) and torch.equal(model[2].bias, expected.bias)
    assert torch.equal(model[0].weight, first)  # the rest is untouched


def test_lossless_policies_train_to_identical_weights(folder, imagenet_weights, tmp_path):
    """bitmap and checkpointing change how activations are stored, never the result."""
    data = image_data(folder, size=32, channels=3)
    states = []
    for policy in ("dense", "bitmap+checkpoint"):
        model, _ = _resnet(imagenet_weights)
        torch.manual_seed(5)  # augmentation draws from the global RNG
        finetune(model, data.train, data.val, FinetuneConfig(policy=policy, epochs=1, batch_size=8, lr=0.05))
        states.append(model.state_dict())
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key


def test_an_interrupted_run_resumes_to_the_same_weights(folder, imagenet_weights, tmp_path):
    data = image_data(folder, size=32, channels=3)
    config = FinetuneConfig(policy="backrazor:sparsity=0.9", epochs=2, batch_size=8, optimizer="adam", lr=1e-3)

    model, _ = _resnet(imagenet_weights)
    torch.manual_seed(5)
    whole = finetune(model, data.train, data.val, config, tmp_path / "whole")

    class Interrupt(Exception):
        pass

    def stop_after_first_epoch(event):
        if event["event"] == "epoch":
            raise Interrupt

    model, _ = _resnet(imagenet_weights)
    torch.manual_seed(5)
    with pytest.raises(Interrupt):
        finetune(model, data.train, data.val, config, tmp_path / "split", on_progress=stop_after_first_epoch)
    torch.manual_seed(123)  # a new process: the RNG comes from the checkpoint, not from here
    model, _ = _resnet(imagenet_weights)
    resumed = finetune(model, data.train, data.val, config, tmp_path / "split")
    assert resumed.resumed_from == 1 and len(resumed.history) == 2
    a, b = load_file(str(whole.weights)), load_file(str(resumed.weights))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    other = FinetuneConfig(policy="dense", epochs=2, batch_size=8, optimizer="adam", lr=1e-3)
    with pytest.raises(CheckpointError, match="another run.*policy"):
        finetune(model, data.train, data.val, other, tmp_path / "split")
    with pytest.raises(CheckpointError, match="another run.*train_samples: 24 -> 12"):  # other data, same config
        finetune(model, torch.utils.data.Subset(data.train, range(12)), data.val, config, tmp_path / "split")
    state_file = tmp_path / "split" / "checkpoint" / "state.json"
    edited = json.loads(state_file.read_text())
    edited["param_groups"] = [{"lr": "fast"}]  # not hashed: an edit must be a CheckpointError too
    original = state_file.read_text()
    state_file.write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match="optimizer state does not fit this run"):
        finetune(model, data.train, data.val, config, tmp_path / "split")
    state_file.write_text(original)
    optimizer_file = tmp_path / "split" / "checkpoint" / "optimizer.safetensors"
    damaged = bytearray(optimizer_file.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    optimizer_file.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="differs from the SHA-256"):
        finetune(model, data.train, data.val, config, tmp_path / "split")


def test_a_finished_run_is_extended_by_a_larger_epochs(folder, imagenet_weights, tmp_path):
    """Extending trains on from the checkpoint with the batch order of the longer run: with a
    constant schedule it ends exactly where the longer run from the start does; a cosine schedule
    starts again over the added epochs, and an extended run resumes and extends like any other."""
    data = image_data(folder, size=32, channels=3)
    weights = {}
    for out, epochs in (("whole", [3]), ("extended", [1, 3])):
        for count in epochs:
            model, _ = _resnet(imagenet_weights)
            torch.manual_seed(5)
            config = FinetuneConfig(epochs=count, batch_size=8, optimizer="adam", lr=1e-3, schedule="constant")
            result = finetune(model, data.train, data.val, config, tmp_path / out)
        weights[out] = load_file(str(result.weights))
    assert (result.resumed_from, result.restarts, len(result.history)) == (1, [1], 3)
    assert all(torch.equal(value, weights["whole"][key]) for key, value in weights["extended"].items())

    cosine = tmp_path / "cosine"
    lrs = []
    for count in (1, 2, 2, 3):  # the repeated 2 resumes the extended run: nothing left to train
        model, _ = _resnet(imagenet_weights)
        config = FinetuneConfig(epochs=count, batch_size=8, lr=0.05)
        result = finetune(model, data.train, data.val, config, cosine,
                          on_progress=lambda e: lrs.append(e["event"]) if e["event"] == "epoch" else None)
    assert result.restarts == [1, 2] and [r["epoch"] for r in result.history] == [1, 2, 3] and len(lrs) == 3
    assert json.loads((cosine / "model.json").read_text())["restarts"] == [1, 2]
    with pytest.raises(CheckpointError, match="epochs"):  # fewer epochs than trained: not an extension
        finetune(_resnet(imagenet_weights)[0], data.train, data.val, FinetuneConfig(epochs=2, batch_size=8, lr=0.05),
                 cosine)


def _run(args):
    result = CliRunner().invoke(app, ["finetune", *map(str, args)])
    return result, " ".join(result.output.replace("│", " ").split())


def test_cli_finetunes_a_folder_into_weights_torchvision_loads(folder, imagenet_weights, tmp_path):
    out = tmp_path / "run"
    result, text = _run(["--model", "torchvision:resnet18", "--weights", imagenet_weights, "--data", folder,
                         "--size", 32, "--epochs", 2, "--batch-size", 8, "--lr", 0.05, "--out", out,
                         "--json", tmp_path / "run.json", "--plot", tmp_path / "run.png"])
    assert result.exit_code == 0, text
    assert "epoch 2: loss" in text and "validation accuracy" in text and "measured peak" in text
    model = torchvision.models.resnet18(num_classes=3)
    model.load_state_dict(load_file(str(out / "model.safetensors")))  # strict: the architecture's own names
    meta = json.loads((out / "model.json").read_text())
    assert meta["classes"] == ["blue", "green", "red"] and meta["image_size"] == 32 and meta["normalize"] == "imagenet"
    summary = json.loads((tmp_path / "run.json").read_text())
    assert [r["epoch"] for r in summary["history"]] == [1, 2] and summary["peak_bytes"] > 0
    assert (tmp_path / "run.png").stat().st_size > 1000
    log = json.loads((out / "log.json").read_text())
    assert len(log["epochs"]) == 2 and log["config"]["policy"] == "dense"

    again, text = _run(["--model", "torchvision:resnet18", "--weights", imagenet_weights, "--data", folder,
                        "--size", 32, "--epochs", 2, "--batch-size", 8, "--lr", 0.05, "--out", out])
    assert again.exit_code == 0 and "had finished its 2 epoch(s): nothing was trained" in text
    # The saved run's settings are shown before anything resumes.
    assert (f"{out} holds 2 finished epoch(s) of a run with model torchvision:resnet18, data {folder}: 24 train, "
            "6 val images, 3 classes, image_size 32, policy dense, scope full, batch_size 8, epochs 2, optimizer sgd, lr 0.05, "
            "schedule cosine, seed 0") in text, text
    assert f"measured peak {summary['peak_bytes'] / 2**20:,.1f} MiB" in text  # the run's own, not 0.0
    more, text = _run(["--model", "torchvision:resnet18", "--weights", imagenet_weights, "--data", folder,
                       "--size", 32, "--epochs", 3, "--batch-size", 8, "--lr", 0.05, "--out", out])
    assert more.exit_code == 0 and "the cosine schedule starts again at lr 0.05 for epochs 3-3" in text, text
    assert "extended" in text and "from 2 to 3 epochs" in text and "epoch 3: loss" in text, text

    # Another size is another run: refused, not resumed and recorded as trained at 40 px
    other, text = _run(["--model", "torchvision:resnet18", "--weights", imagenet_weights, "--data", folder,
                        "--size", 40, "--epochs", 3, "--batch-size", 8, "--lr", 0.05, "--out", out])
    assert other.exit_code == 1 and "image_size: 32 -> 40" in text, text
    assert json.loads((out / "model.json").read_text())["image_size"] == 32


def test_cli_memory_budget_plans_then_stays_within(folder, imagenet_weights, tmp_path):
    args = ["--model", "torchvision:resnet18", "--weights", imagenet_weights, "--data", folder, "--size", 32,
            "--epochs", 1, "--batch-size", 8, "--out", tmp_path / "run", "--json", tmp_path / "run.json"]
    result, text = _run([*args, "--memory-budget", "16GiB"])
    assert result.exit_code == 0, text
    assert "candidates for a" in text and "why: dense at batch 8: an exact policy" in text
    summary = json.loads((tmp_path / "run.json").read_text())
    assert list(summary) == [*SUMMARY_KEYS, "plan"] and list(summary["plan"]) == PLAN_KEYS
    plan = summary["plan"]
    assert plan["within_budget"] and plan["chosen"]["policy"] == "dense"
    assert {c["policy"] for c in plan["candidates"]} >= {"bitmap+checkpoint", "backrazor:sparsity=0.97"}
    for spec in {c["policy"] for c in plan["candidates"]}:  # each policy's row shows its spec whole
        assert f" {spec} " in text, spec

    # Again, finished: it used to divide by the 0 bytes the no epochs it trained measured (one
    # candidate, the one chosen: the path is the same, and planning every policy again took 20 s)
    again, text = _run([*args, "--memory-budget", "16GiB", "--policy", "dense"])
    assert again.exit_code == 0 and "had finished its 1 epoch(s)" in text and "within the budget" in text, text
    rerun = json.loads((tmp_path / "run.json").read_text())
    assert rerun["peak_bytes"] == summary["peak_bytes"] and -1 < rerun["plan"]["prediction_error"] < 1

    result, text = _run([*args, "--memory-budget", "1MiB", "--policy", "dense", "--policy", "bitmap"])
    assert result.exit_code == 1 and "nothing fits 1 MiB with 5% headroom" in text


@pytest.mark.parametrize("extra, message", [
    (["--scope", "head"], "accepted: full, last, norm+last, bias"),
    (["--policy", "dense", "--policy", "bitmap"], "without a budget give one"),
    (["--policy", "backrazor:sparsity=2"], "sparsity"),
    (["--memory-budget", "lots"], "not a number with a unit"),
    (["--weights", "missing.safetensors"], "does not exist"),
    (["--freeze-bn", "--scope", "norm+last"], "drop one"),
    (["--val-fraction", "1"], "--val-fraction must be in (0, 1)"),
])
def test_cli_usage_errors_are_messages(folder, tmp_path, extra, message):
    result, text = _run(["--model", "zoo:cnn", "--data", folder, "--out", tmp_path / "run", *extra])
    assert result.exit_code == 2, text
    assert message in text and "Traceback" not in text


def test_cli_rejects_a_source_that_is_neither_builtin_nor_a_path(tmp_path):
    result, text = _run(["--model", "zoo:cnn", "--data", tmp_path / "nowhere", "--out", tmp_path / "run"])
    assert result.exit_code == 2 and "neither a built-in dataset (digits, fashion-mnist)" in text


def test_every_image_is_used_every_epoch_in_full_batches():
    """The last partial batch used to be dropped: a few images unseen each epoch, and an
    unreadable one among them went unnoticed."""
    class Recorded(torch.utils.data.Dataset):
        def __init__(self):
            self.used = []

        def __len__(self):
            return 10

        def __getitem__(self, index):
            self.used.append(index)
            return torch.full((3, 4, 4), float(index)), index % 2

    train, val, events = Recorded(), Recorded(), []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 2))
    finetune(model, train, val, FinetuneConfig(epochs=2, batch_size=4), on_progress=events.append)
    assert [len(train.used[i : i + 12]) for i in (0, 12)] == [12, 12] and len(train.used) == 24
    for epoch in (train.used[:12], train.used[12:]):
        assert set(epoch) == set(range(10))  # all of them, two again to fill the third batch of 4
    assert train.used[:12] != train.used[12:]  # reshuffled
    assert {e["steps"] for e in events if e["event"] == "step"} == {3}


def _with_truncated_image(folder, tmp_path):
    copy = shutil.copytree(folder, tmp_path / "photos")
    buffer = io.BytesIO()
    Image.open(copy / "red" / "0.png").convert("RGB").resize((128, 128)).save(buffer, format="JPEG")
    (copy / "red" / "cut.jpg").write_bytes(buffer.getvalue()[: buffer.tell() // 2])  # intact header, data cut off
    return copy


def test_cli_stops_at_a_truncated_image_with_its_name(folder, imagenet_weights, tmp_path):
    result, text = _run(["--model", "torchvision:resnet18", "--weights", imagenet_weights, "--size", 32,
                         "--data", _with_truncated_image(folder, tmp_path), "--epochs", 1, "--batch-size", 8,
                         "--out", tmp_path / "run"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), text  # no traceback
    assert "cut.jpg:notareadableimage(imagefileistruncated" in text.replace(" ", "")
    assert "--skip-bad-images" in text


def test_cli_skip_bad_images_trains_on_the_rest_and_lists_what_it_left_out(folder, imagenet_weights, tmp_path):
    out = tmp_path / "run"
    with pytest.warns(UserWarning, match="left out 1 of 31 images that cannot be read"):  # the library's report
        result, text = _run(["--model", "torchvision:resnet18", "--weights", imagenet_weights, "--size", 32,
                             "--data", _with_truncated_image(folder, tmp_path), "--epochs", 1, "--batch-size", 8,
                             "--out", out, "--skip-bad-images"])
    assert result.exit_code == 0, text
    assert "24 train, 6 val images, 3 classes, 1 unreadable left out" in text
    assert "left out 1 unreadable image(s) (--skip-bad-images)" in text and "validation accuracy" in text
    skipped = json.loads((out / "model.json").read_text())["skipped_images"]
    assert len(skipped) == 1 and "cut.jpg: not a readable image (image file is truncated" in skipped[0]


def test_checkpointed_stages_are_the_sequences_of_parameterised_blocks():
    from edgetorch.activations import find_stages

    names = lambda model: [f"{type(parent).__name__}.{attr}" for parent, attr, _ in find_stages(model)]  # noqa: E731
    assert names(torchvision.models.resnet18()) == [f"ResNet.layer{i}" for i in range(1, 5)]
    assert names(torchvision.models.mobilenet_v2()) == ["MobileNetV2.features"]  # not (Dropout, Linear)
    assert names(start_model("zoo:cnn", None)[0]) == ["SmallResNet.features"]  # not (pool, Flatten)


def _set(path: str, value):
    """An edit of state.json that sets the field at ``path`` (dot-separated; digits index lists)."""
    def edit(state):
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        target = state
        for p in parents:
            target = target[p]
        target[last] = value
    return edit


def _drop(key: str):
    return lambda state: state.pop(key)


STATE_EDITS = {  # the 21 edits an outside test tried (9 gave tracebacks), and their neighbours
    "lr string": _set("param_groups.0.lr", "fast"), "lr negative": _set("param_groups.0.lr", -1),
    "lr infinite": _set("param_groups.0.lr", float("inf")), "betas short": _set("param_groups.0.betas", [0.9]),
    "betas strings": _set("param_groups.0.betas", ["a", "b"]), "eps zero": _set("param_groups.0.eps", 0),
    "params other": _set("param_groups.0.params", [0]), "extra group": lambda s: s["param_groups"].append({}),
    "groups not a list": _set("param_groups", {"lr": 1}), "amsgrad string": _set("param_groups.0.amsgrad", "yes"),
    "T_max zero": _set("schedule.T_max", 0), "last_epoch string": _set("schedule.last_epoch", "x"),
    "last_epoch float": _set("schedule.last_epoch", 1.5), "base_lrs empty": _set("schedule.base_lrs", []),
    "schedule null": _set("schedule", None), "unknown schedule key": _set("schedule.evil", 1),
    "history not a list": _set("history", {"a": 1}), "history short": _set("history", []),
    "history record string": _set("history.0", "x"), "history loss string": _set("history.0.train_loss", "x"),
    "history missing key": lambda s: s["history"][0].pop("val_accuracy"), "epoch string": _set("epoch", "1"),
    "epoch zero": _set("epoch", 0), "epoch past the run": _set("epoch", 99), "epoch bool": _set("epoch", True),
    "no sha256": _drop("sha256"), "run a list": _set("run", []), "extra key": _set("evil", 1),
    "deep nesting": lambda s: '{"history": ' + "[" * 5000 + "]" * 5000 + "}",  # the text itself
}


@pytest.fixture(scope="module")
def one_epoch(folder, tmp_path_factory):
    """A finished first epoch of a two-epoch run (zoo:cnn on the folder, gray, 16 px): its checkpoint."""
    data = image_data(folder, size=16, channels=1)
    config = FinetuneConfig(epochs=2, batch_size=8, optimizer="adam", lr=1e-3, schedule="cosine")
    out = tmp_path_factory.mktemp("one-epoch") / "run"

    def stop(event):
        if event["event"] == "epoch":
            raise KeyboardInterrupt

    model, _ = start_model("zoo:cnn", 3)
    with pytest.raises(KeyboardInterrupt):
        finetune(model, data.train, data.val, config, out, on_progress=stop)
    return data, config, out


@pytest.mark.parametrize("edit", STATE_EDITS)
def test_an_edited_checkpoint_state_is_a_checkpoint_error(one_epoch, tmp_path, edit):
    """state.json is not hashed (it holds the hashes): every edit must fail as CheckpointError."""
    import shutil

    data, config, out = one_epoch
    copy = shutil.copytree(out, tmp_path / "run")
    state_file = copy / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    text = STATE_EDITS[edit](state)
    state_file.write_text(text if isinstance(text, str) else json.dumps(state))
    model, _ = start_model("zoo:cnn", 3)
    with pytest.raises(CheckpointError):
        finetune(model, data.train, data.val, config, copy)


def test_an_unedited_checkpoint_resumes(one_epoch, tmp_path):
    import shutil

    data, config, out = one_epoch
    model, _ = start_model("zoo:cnn", 3)
    result = finetune(model, data.train, data.val, config, shutil.copytree(out, tmp_path / "run"))
    assert result.resumed_from == 1 and [r["epoch"] for r in result.history] == [1, 2]


def test_run_finetune_draws_from_the_jobs_seed_and_leaves_the_callers_rng(folder, tmp_path):
    def first_classifier(run):
        heads.append(run.model.get_submodule(classifier_name(run.model)).weight.detach().clone())

    heads = []
    job = FinetuneJob(model="zoo:mlp", data=folder, epochs=1, batch=8, out=tmp_path / "a")
    torch.manual_seed(123)
    before = torch.get_rng_state()
    run = run_finetune(job, on_loaded=first_classifier)
    assert torch.equal(torch.get_rng_state(), before)  # neither advanced nor reset
    assert "new 3-class classifier" in run.origin and run.plan is None and run.config == job.config
    assert list(run.summary()) == SUMMARY_KEYS and run.summary()["weights_file"] == str(tmp_path / "a" / "model.safetensors")
    trained = load_file(str(run.result.weights))
    assert all(torch.equal(trained[k], v) for k, v in run.model.state_dict().items())

    torch.manual_seed(7)  # another state before the call: the same draws, the same bytes
    run_finetune(dataclasses.replace(job, out=tmp_path / "b"), on_loaded=first_classifier)
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()
    run_finetune(dataclasses.replace(job, out=None, seed=1), on_loaded=first_classifier)
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])


def test_run_finetune_plans_trains_and_refuses_a_budget_nothing_fits():
    events = []
    job = FinetuneJob(model="zoo:mlp", data="digits", limit=64, epochs=1, batch=16, policy=("dense", "bitmap"),
                      memory_budget="16GiB")
    run = run_finetune(job, on_loaded=lambda run: events.append("loaded"),
                       on_plan=lambda plan: events.append(f"plan {plan.chosen.policy}"),
                       on_training=lambda run: events.append(f"training {run.config.policy}"),
                       on_progress=lambda event: events.append(event["event"]))
    assert events[:4] == ["loaded", "plan dense", "training dense", "step"] and events[-1] == "epoch"
    summary = run.summary()
    assert list(summary) == [*SUMMARY_KEYS, "plan"] and list(summary["plan"]) == PLAN_KEYS
    assert summary["plan"]["within_budget"] is run.within_budget is True and summary["weights_file"] is None
    assert json.loads(json.dumps(summary))["config"]["batch_size"] == run.plan.chosen.batch == 16

    with pytest.raises(NothingFits, match="nothing fits 1 MiB .* already holds") as refused:
        run_finetune(dataclasses.replace(job, memory_budget="1MiB"))
    assert refused.value.plan.chosen is None and refused.value.plan.candidates == []  # refused before measuring


@pytest.mark.parametrize("fields, message", [
    ({"policy": ("dense", "bitmap")}, "without a budget give one"),
    ({"memory_budget": "lots"}, "not a number with a unit"),
    ({"optimizer": "lion"}, "accepted: sgd, adam, adamw"),
    ({"val_fraction": 0.0}, "must be in (0, 1)"),
    ({"min_batch": 0}, "min_batch must be a positive int"),
    ({"limit": 0}, "limit must be a positive int"),
    ({"device": "gpu"}, "accepted: cpu, cuda, cuda:N"),
])
def test_a_job_refuses_a_bad_field_saying_what_is_accepted(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        FinetuneJob(model="zoo:mlp", data="digits", **fields)


def test_a_job_and_the_cli_refuse_a_cuda_device_this_machine_lacks(monkeypatch):
    import typer

    from edgetorch.cli._app import device_option

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for refuse in (lambda device: FinetuneJob(model="zoo:mlp", data="digits", device=device), device_option):
        with pytest.raises((ValueError, typer.BadParameter), match="no CUDA device is available here"):
            refuse("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert FinetuneJob(model="zoo:mlp", data="digits", device="cuda:1").device == device_option("cuda:1") == "cuda:1"
    for refuse in (lambda device: FinetuneJob(model="zoo:mlp", data="digits", device=device), device_option):
        with pytest.raises((ValueError, typer.BadParameter), match=re.escape("has 2 CUDA device(s); accepted: cuda, "
                                                                              "cuda:0 to cuda:1")):
            refuse("cuda:2")


def test_a_job_takes_one_policy_given_as_a_string_as_one_spec():
    job = FinetuneJob(model="zoo:mlp", data="digits", policy="bitmap")
    assert job.policy == ("bitmap",) and job.config.policy == "bitmap"


def test_a_budget_below_what_the_process_holds_is_refused_before_measuring_anything():
    """A unitless --memory-budget 1 is one byte: refused at once (it measured every candidate for
    71 s, then said nothing fits 0 MiB), saying that budgets without a unit are bytes."""
    job = FinetuneJob(model="zoo:mlp", data="digits", limit=64, epochs=1, batch=16, memory_budget=1)
    with pytest.raises(NothingFits, match="nothing fits 1 byte with .* already holds .* unless it carries a unit") as refused:
        run_finetune(job)
    assert refused.value.plan.candidates == []


def test_ctrl_c_says_how_to_resume(folder, tmp_path, monkeypatch):
    import edgetorch.finetune as finetune_package

    def interrupted(job, **hooks):
        raise KeyboardInterrupt

    monkeypatch.setattr(finetune_package, "run_finetune", interrupted)
    result, text = _run(["--model", "zoo:cnn", "--data", folder, "--out", tmp_path / "run"])
    assert result.exit_code == 130 and "interrupted; every finished epoch is saved under" in text
    assert "run the same command again to resume" in text and "Traceback" not in text


def test_commands_print_warnings_as_one_line_without_source(monkeypatch):
    import warnings

    from edgetorch.cli import _app

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # put back after the test
    assert CliRunner().invoke(app, ["split", "--help"]).exit_code == 0
    assert warnings.formatwarning is _app.format_warning  # what Python's default showwarning prints
    shown = warnings.formatwarning(RuntimeWarning("the C extension is not built"), RuntimeWarning,
                                   "/site-packages/edgetorch/codecs/_cpu_kernels.py", 62, "    warnings.warn(...)")
    assert shown == "warning: the C extension is not built\n"
    assert warnings.formatwarning(UserWarning("left out a\x1b[31mb.png"), UserWarning, "x.py", 1) == \
        "warning: left out a\\x1b[31mb.png\n"  # a file name's escape sequence is shown, not sent
    with pytest.warns(RuntimeWarning, match="still recorded"):  # what tests (and callers) catch is unchanged
        warnings.warn("still recorded", RuntimeWarning)


def test_a_run_keeps_its_best_and_last_weights_and_a_metrics_table(fine_tuned):
    """Issue 28 (run management): a run kept only its last weights and a JSON log. Now
    metrics.csv holds every epoch's record, best.safetensors the weights of the epoch with the
    highest validation accuracy (the earliest among equals), and model.json names that epoch."""
    import csv

    from edgetorch.finetune.run import best_epoch
    from edgetorch.weights import read_weights

    run = fine_tuned / "run"
    log = json.loads((run / "log.json").read_text())["epochs"]
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    assert [float(r["val_accuracy"]) for r in rows] == [e["val_accuracy"] for e in log]
    assert [float(r["train_loss"]) for r in rows] == [e["train_loss"] for e in log]
    accuracies = [e["val_accuracy"] for e in log]
    best = json.loads((run / "model.json").read_text())["best"]
    assert best == {"epoch": accuracies.index(max(accuracies)) + 1, "val_accuracy": max(accuracies),
                    "weights": "best.safetensors"}
    best_weights, last = read_weights(run / "best.safetensors"), read_weights(run / "model.safetensors")
    assert all(torch.equal(best_weights[k], last[k]) for k in last) == (best["epoch"] == 3)
    assert best_epoch([{"epoch": 1, "val_accuracy": 0.5}, {"epoch": 2, "val_accuracy": 0.7},
                       {"epoch": 3, "val_accuracy": 0.7}]) == 2
