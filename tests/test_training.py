"""The one training loop (edgetorch.training): batch order, resume, RNG, divergence, checkpoint format."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import edgetorch.training.checkpoint as checkpoint_module
from edgetorch import EdgetorchError
from edgetorch.training import (
    Checkpointing,
    LastBatch,
    Loop,
    TrainingDiverged,
    Watch,
    epoch_orders,
    one_cycle_adamw,
    supervised,
    train_epochs,
)
from edgetorch.weights import CheckpointError


def _data(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(3)  # dropout makes the global RNG part of the result
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _train(model: nn.Module, data, loop: Loop, directory=None, identity=None, watch=None):
    optimizer, schedule = one_cycle_adamw(model, loop, len(data), 1e-2, 1e-4)
    checkpoint = None if directory is None else Checkpointing(directory, identity or {"run": "test"})
    return train_epochs(model.train(), data, loop, supervised(model), optimizer, schedule, checkpoint=checkpoint,
                        watch=watch)  # fmt: skip


def test_epoch_e_visits_the_e_th_permutation_of_the_seeded_generator() -> None:
    loop = Loop(epochs=3, batch_size=4, seed=7)
    generator = torch.Generator().manual_seed(7)
    orders = epoch_orders(10, loop)
    for _ in range(3):
        expected = torch.randperm(10, generator=generator)
        batches = next(orders)
        assert [len(b) for b in batches] == [4, 4]  # the last partial batch is dropped
        assert torch.equal(torch.cat(batches), expected[:8])


def test_the_last_batch_is_dropped_filled_or_kept_as_asked() -> None:
    orders = epoch_orders(10, Loop(epochs=2, batch_size=4, last_batch=LastBatch.FILL))
    for _ in range(2):
        batches = next(orders)
        assert [len(b) for b in batches] == [4, 4, 4]
        flat = torch.cat(batches)
        assert set(flat.tolist()) == set(range(10)) and torch.equal(flat[10:], flat[:2])
    assert [len(b) for b in next(epoch_orders(3, Loop(epochs=1, batch_size=4, last_batch=LastBatch.FILL)))] == [3]
    kept = next(epoch_orders(10, Loop(epochs=1, batch_size=4, last_batch=LastBatch.KEEP)))
    assert [len(b) for b in kept] == [4, 4, 2] and sorted(torch.cat(kept).tolist()) == list(range(10))
    with pytest.raises(TypeError, match="LastBatch"):
        Loop(epochs=1, batch_size=4, last_batch="fill")
    with pytest.raises(ValueError, match="less than one batch of 4"):
        next(epoch_orders(3, Loop(epochs=1, batch_size=4)))


def test_a_tensor_dataset_and_any_dataset_give_the_same_run() -> None:
    class Wrapped(Dataset):
        def __init__(self, data):
            self.data = data

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            return self.data[i]

    data, loop = _data(), Loop(epochs=2, batch_size=8, seed=1, last_batch=LastBatch.FILL)
    a = _model()  # seeds the global RNG: each run's dropout starts from the same state
    losses = _train(a, data, loop).losses
    b = _model()
    assert _train(b, Wrapped(data), loop).losses == losses
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_an_interrupted_run_resumes_to_the_same_weights_dropout_included(tmp_path, interrupted_after_a_checkpoint):
    data, loop = _data(), Loop(epochs=3, batch_size=8, seed=2)
    straight = _model()
    expected = _train(straight, data, loop)
    interrupted_after_a_checkpoint(lambda: _train(_model(), data, loop, tmp_path))
    torch.manual_seed(99)  # whatever the caller's RNG holds now, the checkpoint's is restored
    resumed = _model()
    torch.manual_seed(99)
    run = _train(resumed, data, loop, tmp_path)
    assert run.resumed_from == 1 and run.losses == expected.losses
    assert run.step_losses == expected.step_losses[-len(run.step_losses):] and len(run.step_losses) == 2 * 5
    assert all(torch.equal(x, y) for x, y in zip(resumed.state_dict().values(), straight.state_dict().values()))
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["format"] == checkpoint_module.FORMAT and state["epoch"] == 3 and state["run"] == {"run": "test"}


def test_a_checkpoint_of_another_run_names_what_changed(tmp_path) -> None:
    data, loop = _data(), Loop(epochs=1, batch_size=8)
    _train(_model(), data, loop, tmp_path, {"config": {"lr": 0.1, "epochs": 1}, "samples": 40})
    with pytest.raises(CheckpointError, match=r"another run \(config.lr: 0.1 -> 0.2\)"):
        _train(_model(), data, loop, tmp_path, {"config": {"lr": 0.2, "epochs": 1}, "samples": 40})


def test_checkpoints_of_earlier_versions_are_refused_with_what_to_do(tmp_path) -> None:
    data, loop = _data(), Loop(epochs=1, batch_size=8)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "state.pt").write_bytes(b"whatever")
    with pytest.raises(CheckpointError, match="earlier edgetorch .*delete it to start over"):
        _train(_model(), data, loop, tmp_path / "old")
    _train(_model(), data, loop, tmp_path / "v1")
    state = json.loads((tmp_path / "v1" / "state.json").read_text())
    del state["format"]  # what edgetorch finetune wrote before the loops were one
    (tmp_path / "v1" / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"earlier edgetorch \(format 1"):
        _train(_model(), data, loop, tmp_path / "v1")


def test_a_diverged_loss_stops_the_run_and_keeps_the_last_finished_epoch(tmp_path) -> None:
    data, loop = _data(), Loop(epochs=2, batch_size=8)

    class PoisonSecondEpoch(Watch):
        def epoch_done(self, history):
            with torch.no_grad():
                model[0].weight.fill_(float("nan"))

    model = _model()
    with pytest.raises(TrainingDiverged, match="loss is nan at epoch 2, step 1.*lower the learning rate") as err:
        _train(model, data, loop, tmp_path, watch=PoisonSecondEpoch())
    assert isinstance(err.value, EdgetorchError) and isinstance(err.value, FloatingPointError)
    assert json.loads((tmp_path / "state.json").read_text())["epoch"] == 1


def test_a_watch_sees_every_step_and_adds_its_measures(tmp_path) -> None:
    seen = []

    class Measures(Watch):
        measures = ("norm",)

        def epoch_started(self, epoch):
            seen.append(("start", epoch))

        def step_done(self, epoch, step, steps, loss, images_per_second):
            seen.append((epoch, step, steps))

        def measure(self, record):
            record["norm"] = 1.5

    run = _train(_model(), _data(20), Loop(epochs=2, batch_size=8), tmp_path, watch=Measures())
    assert seen == [("start", 1), (1, 1, 2), (1, 2, 2), ("start", 2), (2, 1, 2), (2, 2, 2)]
    assert [r["norm"] for r in run.history] == [1.5, 1.5]
    assert len(run.step_losses) == 4 and [sum(run.step_losses[i:i + 2]) / 2 for i in (0, 2)] == run.losses

    class Forgetful(Watch):
        measures = ("norm",)

    with pytest.raises(CheckpointError, match="exactly the keys"):  # resuming needs the field it promised
        _train(_model(), _data(20), Loop(epochs=3, batch_size=8), tmp_path, watch=Watch())
    with pytest.raises(TypeError, match="measure added"):
        _train(_model(), _data(20), Loop(epochs=1, batch_size=8), watch=Forgetful())


def test_the_paper_network_trains_as_a_plain_rmsprop_loop_and_is_cached(tmp_path, monkeypatch) -> None:
    import torch.nn.functional as F

    from edgetorch.data import load_dataset
    from edgetorch.zoo import paper

    recipe = paper.PaperRecipe("digits", epochs=1, batch_size=500)  # 1,438 images: the last batch has 438
    monkeypatch.setitem(paper.PAPER_RECIPES, "digits", recipe)
    state = torch.get_rng_state()
    model, record = paper.paper_mlp("digits", cache=tmp_path)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is left alone
    # The same training written plainly: seeded init, seeded permutation, every slice a step.
    torch.manual_seed(recipe.seed)
    plain = paper.build_paper_mlp("digits")
    images, labels = load_dataset("digits", "train").tensors
    optimizer = torch.optim.RMSprop(plain.parameters(), lr=recipe.lr, alpha=recipe.rho, eps=1e-7)
    for batch in torch.randperm(len(labels), generator=torch.Generator().manual_seed(recipe.seed)).split(500):
        optimizer.zero_grad()
        F.cross_entropy(plain(images[batch]), labels[batch]).backward()
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    again, cached = paper.paper_mlp("digits", cache=tmp_path)
    assert cached == record and record["hidden"] == list(paper.PAPER_HIDDEN)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_run_log_reads_back_finished_runs_appends_new_ones_and_skips_missing_files(tmp_path):
    from edgetorch.training.runs import RunLog

    def key(run: dict) -> str:
        return json.dumps([run["model"], run["seed"]])

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    log = RunLog([first, second], key)
    assert log.get(key({"model": "m", "seed": 0})) is None
    run = {"model": "m", "seed": 0, "accuracy": 0.5}
    assert log.add(first, run) is run and log.get(key(run)) is run
    log.add(second, {"model": "n", "seed": 1, "accuracy": 0.25})
    again = RunLog([first, second, tmp_path / "missing.jsonl"], key)
    assert again.get(key(run)) == run
    assert again.get(json.dumps(["n", 1])) == {"model": "n", "seed": 1, "accuracy": 0.25}
    assert first.read_text() == json.dumps(run) + "\n"


def test_run_log_skips_a_cut_short_last_line_and_refuses_a_malformed_one_in_the_middle(tmp_path):
    from edgetorch._files import InputFileError
    from edgetorch.training.runs import RunLog

    def key(run: dict) -> str:
        return str(run["seed"])

    path = tmp_path / "runs.jsonl"
    done = json.dumps({"seed": 0}) + "\n"
    path.write_text(done + json.dumps({"seed": 1})[:-3])  # killed while appending the second run
    with pytest.warns(UserWarning, match="cut-short last line"):
        log = RunLog([path], key)
    assert log.get("0") == {"seed": 0} and log.get("1") is None
    with pytest.warns(UserWarning, match="removed its cut-short last line"):
        log.add(path, {"seed": 1})
    assert path.read_text() == done + json.dumps({"seed": 1}) + "\n"
    assert RunLog([path], key).get("1") == {"seed": 1}

    path.write_text(done + json.dumps({"seed": 1}))  # only the newline was lost: the run is whole
    assert RunLog([path], key).get("1") == {"seed": 1}
    RunLog([path], key).add(path, {"seed": 2})
    assert [json.loads(line)["seed"] for line in path.read_text().splitlines()] == [0, 1, 2]

    path.write_text(done + '{"seed": 1\n' + done)
    with pytest.raises(InputFileError, match="line 2 is not a JSON record"):
        RunLog([path], key)
