"""Training-loop integrations turn the policy on for each training step and change nothing else."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetorch as et
from edgetorch.integrations import StepCompression


def small_net() -> nn.Module:
    torch.manual_seed(0)
    # 8 x 256 floats per activation: above the engine's 4 KiB floor, so they are encoded
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 3))


DATA = torch.randn(24, 16), torch.randint(0, 3, (24,))


def manual_loop(model: nn.Module, step: StepCompression | None) -> nn.Module:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        x, y = DATA[0][i * 8 : (i + 1) * 8], DATA[1][i * 8 : (i + 1) * 8]
        if step:
            step.start(model)
        loss = F.cross_entropy(model(x), y)
        if step:
            step.stop()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_step_compression_in_a_hand_written_loop():
    plain = manual_loop(small_net(), None)
    step = StepCompression(et.Bitmap(), track=True)
    assert same_weights(plain, manual_loop(small_net(), step))
    assert step.steps == 3 and step.ledger.total().count > 0
    razor = StepCompression(et.BackRazor(0.9), track=True)
    assert not same_weights(plain, manual_loop(small_net(), razor))  # it did act
    assert razor.ledger.total().stored_bytes < razor.ledger.total().dense_bytes
    with pytest.raises(TypeError, match="Policy"):
        StepCompression("backrazor")


def test_lightning_callback():
    pl = pytest.importorskip("pytorch_lightning")
    from edgetorch.integrations.lightning import CompressActivations

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = small_net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(callbacks) -> nn.Module:
        module = Module()
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*DATA), batch_size=8)
        trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
        trainer.fit(module, loader)
        return module.net

    callback = CompressActivations(et.Bitmap(), track=True)
    assert same_weights(fit([]), fit([callback]))
    assert callback.step.steps == 3 and callback.step.ledger.total().count > 0


def test_hugging_face_trainer_callback(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from edgetorch.integrations.huggingface import CompressActivations

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = small_net()

        def forward(self, x, labels):
            return {"loss": F.cross_entropy(self.net(x), labels)}

    rows = [{"x": DATA[0][i], "labels": DATA[1][i]} for i in range(24)]

    def fit(callbacks) -> nn.Module:
        model = Net()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, learning_rate=0.1,
            lr_scheduler_type="constant", optim="sgd", report_to=[], use_cpu=True, save_strategy="no",
            logging_strategy="no", disable_tqdm=True, seed=0, dataloader_drop_last=True,
        )
        transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks).train()
        return model

    callback = CompressActivations(et.Bitmap(), track=True)
    assert same_weights(fit([]), fit([callback]))
    assert callback.step.steps == 3 and callback.step.ledger.total().count > 0
    razor = CompressActivations(et.BackRazor(0.9))
    assert not same_weights(copy.deepcopy(fit([])), fit([razor]))


@pytest.mark.parametrize("module, frameworks, hint", [
    ("huggingface", ["transformers"], "pip install transformers"),
    ("lightning", ["pytorch_lightning", "lightning", "lightning.pytorch"], "pip install lightning"),
])
def test_an_integration_without_its_framework_says_how_to_install_it(monkeypatch, module, frameworks, hint):
    import importlib
    import sys

    for name in frameworks:
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, f"edgetorch.integrations.{module}", raising=False)
    with pytest.raises(ImportError, match=hint):
        importlib.import_module(f"edgetorch.integrations.{module}")
