"""Fine-tuning after reduction (edgetorch.reduce.recover): recovers accuracy, distils exactly as a plain loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from edgetorch.data import load_dataset
from edgetorch.reduce import reduce_model
from edgetorch.reduce.recover import RecoverConfig, recover
from edgetorch.split.losses import kd_loss as split_kd_loss
from edgetorch.training import Loop, kd_loss, one_cycle_adamw, supervised, train_epochs
from edgetorch.zoo import MLP, evaluate_accuracy


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", "train", size=8), load_dataset("digits", "test", size=8)


@pytest.fixture(scope="module")
def trained_mlp(digits):
    torch.manual_seed(0)
    model = MLP(num_classes=10, image_size=8, hidden=(64, 32))
    loop = Loop(epochs=15, batch_size=64)
    train_epochs(model.train(), digits[0], loop, supervised(model), *one_cycle_adamw(model, loop, len(digits[0]), 3e-3, 1e-4))
    return model.eval()


def test_finetune_recovers_an_over_pruned_model(trained_mlp, digits):
    train, test = digits
    reduced = reduce_model(trained_mlp, 0.9, "prune", calibration=train.tensors[0][:500]).model
    history = recover(reduced, train, RecoverConfig(epochs=3, lr=3e-3), test=test)
    assert history.accuracy_before == pytest.approx(evaluate_accuracy(
        reduce_model(trained_mlp, 0.9, "prune", calibration=train.tensors[0][:500]).model, test))
    assert history.accuracy_after > history.accuracy_before + 0.05  # 0.9 of the MACs gone: much to recover
    assert len(history.accuracy) == len(history.train_loss) == 3 and history.seconds > 0
    assert not reduced.training


def test_distillation_equals_a_plain_loop_with_the_teacher_run_per_batch(trained_mlp, digits):
    """Teacher logits computed once up front give the same weights as the teacher run on each batch."""
    train = TensorDataset(*(t[:256] for t in digits[0].tensors))
    student = reduce_model(trained_mlp, 0.5, "prune", calibration=train.tensors[0]).model
    reference = copy.deepcopy(student)
    config = RecoverConfig(epochs=2, batch_size=32, lr=2e-3, distill=True, kd_alpha=0.3, tau=2.0)
    recover(student, train, config, teacher=trained_mlp)

    images, labels = train.tensors
    opt = torch.optim.AdamW(reference.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=config.lr, total_steps=2 * 8)
    order = torch.Generator().manual_seed(config.seed)
    reference.train()
    for _ in range(2):
        perm = torch.randperm(256, generator=order)
        for step in range(8):
            idx = perm[step * 32 : (step + 1) * 32]
            with torch.no_grad():
                target = trained_mlp(images[idx])
            loss = config.kd_alpha * F.cross_entropy(reference(images[idx]), labels[idx]) + (
                1 - config.kd_alpha) * config.tau**2 * F.kl_div(
                F.log_softmax(reference(images[idx]) / config.tau, 1), F.softmax(target / config.tau, 1),
                reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    for a, b in zip(student.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_kd_loss_has_one_home():
    assert split_kd_loss is kd_loss  # split re-exports the shared one; no copy


@pytest.mark.parametrize("kwargs, match", [
    ({"epochs": 0}, "epochs"),
    ({"lr": 0.0}, "lr > 0"),
    ({"kd_alpha": 1.5}, "kd_alpha"),
    ({"tau": 0.0}, "tau > 0"),
])
def test_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RecoverConfig(**kwargs)


def test_finetune_refuses_distillation_without_teacher_and_too_little_data(trained_mlp, digits):
    train = digits[0]
    with pytest.raises(ValueError, match="teacher="):
        recover(copy.deepcopy(trained_mlp), train, RecoverConfig(distill=True))
    with pytest.raises(ValueError, match="less than one batch of 64"):
        recover(copy.deepcopy(trained_mlp), TensorDataset(*(t[:10] for t in train.tensors)))
