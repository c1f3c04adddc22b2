"""Role tapes: a steady-state step runs no dispatch mode, and gives what watching every op gives."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn
from torch.nn import functional as F

import edgetorch as et
from edgetorch.activations import roles, tape
from edgetorch.measure.counters import count_calls


@pytest.fixture()
def dispatches():
    """Counts the role dispatch mode's calls (one per ATen op it sees)."""
    with count_calls(roles.OpWatch, "__torch_dispatch__") as calls:
        yield calls


def run(model, x, y, policy, ledger=None):
    """One step; returns the gradients and the block."""
    model.zero_grad(set_to_none=True)
    with et.compress_activations(model, policy, ledger=ledger) as block:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], block


def watched(model, x, y, policy, ledger=None):
    """The same step with every op watched (no tape), on a copy."""
    fresh = copy.deepcopy(model)
    tape.forget(fresh)
    return run(fresh, x, y, policy, ledger)


POLICIES = [et.BackRazor(0.9), et.Quantized(8), et.BackRazor(0.8, exact="int8"), et.Bitmap()]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.spec())
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_steady_state_runs_no_dispatch_mode_and_matches_watching(name, policy, dispatches):
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, num_classes=10).eval()  # eval: dropout off, same step twice
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.train()  # batch statistics: batch norm's input stays exact (a training need)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    run(model, x, y, policy, et.SavedTensorLedger())  # records the tape (with a ledger: roles too)
    before = dispatches.count
    assert before > 0
    ledger = et.SavedTensorLedger()
    grads, block = run(model, x, y, policy, ledger)  # a ledger must not switch watching back on
    assert dispatches.count == before, "the dispatch mode ran on a steady-state step"
    grads_plain, _ = run(model, x, y, policy)
    assert dispatches.count == before
    ref_ledger = et.SavedTensorLedger()
    ref, ref_block = watched(model, x, y, policy, ref_ledger)
    assert block.saved_count == ref_block.saved_count
    for a, b, c in zip(grads, grads_plain, ref):
        assert torch.equal(a, c) and torch.equal(b, c)
    rows = [(r.module, r.module_type, r.op, r.form, r.storage, r.stored_bytes) for r in ledger.records]
    assert rows == [(r.module, r.module_type, r.op, r.form, r.storage, r.stored_bytes) for r in ref_ledger.records]


class Branchy(nn.Module):
    """Data-dependent control flow with equal shapes: ReLU (a mask suffices) or GELU (exact)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1), nn.Linear(16, 4)
        self.use_relu = True

    def forward(self, x):
        h = self.a(x)
        h = F.relu(h) if self.use_relu else F.gelu(h)
        h = self.b(h)
        return self.head(h.mean((2, 3)))


def test_a_step_that_leaves_its_tape_watches_the_rest_and_stays_exact(dispatches):
    torch.manual_seed(0)
    model = Branchy()
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    policy = et.BackRazor(0.9)
    # Step 3 takes the GELU path, on no tape: stored exactly from there on, and the next steps are
    # watched until one records a new path (step 4); from then on both paths replay.
    watched_steps = []
    for use_relu in (True, True, False, False, True, False, True):
        model.use_relu = use_relu
        ledger = et.SavedTensorLedger()
        before = dispatches.count
        grads, _ = run(model, x, y, policy, ledger)
        watched_steps.append(dispatches.count > before)
        ref_ledger = et.SavedTensorLedger()
        ref, _ = watched(model, x, y, policy, ref_ledger)
        names = [name for name, _ in model.named_parameters()]
        left_tape = len(watched_steps) == 3
        for name, a, b in zip(names, grads, ref):
            # The step that leaves its tape stores the rest exactly, so the next convolution's
            # weight gradient is not pruned there. Every input gradient is exact either way:
            # GELU's backward needs its exact input, ReLU's a mask, and a wrong role shows in a.*.
            if not (left_tape and name.startswith("b.")):
                assert torch.equal(a, b), f"use_relu={use_relu}: gradient of {name} differs"
        forms = [(r.op, r.form) for r in ledger.records if r.storage != "external"]
        if not left_tape:
            assert [(r.op, r.form) for r in ref_ledger.records if r.storage != "external"] == forms
    assert watched_steps == [True, False, False, True, False, False, False]


def test_each_input_size_gets_its_own_tape(dispatches):
    torch.manual_seed(0)
    model = torchvision.models.get_model("resnet18", num_classes=10)
    policy = et.BackRazor(0.9)
    batches = [(torch.randn(n, 3, 32, 32), torch.arange(n) % 10) for n in (4, 3)]
    for x, y in batches:
        run(model, x, y, policy)
    for x, y in batches * 2:  # the last, smaller batch of an epoch, then the next epoch
        before = dispatches.count
        grads, _ = run(model, x, y, policy)
        assert dispatches.count == before
        assert all(torch.equal(a, b) for a, b in zip(grads, watched(model, x, y, policy)[0]))


def test_freezing_a_layer_records_a_new_tape():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 28 * 28, 3))
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    policy = et.BackRazor(0.9)
    ledger = et.SavedTensorLedger()
    run(model, x, y, policy, ledger)
    assert ("convolution", "prune") in [(r.op, r.form) for r in ledger.records]
    model[2].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    ledger = et.SavedTensorLedger()
    with et.compress_activations(model, policy, ledger=ledger):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    # a frozen convolution's input feeds no weight gradient: only its shape is kept
    assert ("convolution", "shape") in [(r.op, r.form) for r in ledger.records]


def test_a_replaced_layer_is_seen_as_a_parameter_on_the_next_step():
    # The walk over modules, parameters and buffers is cached until anything is registered: a new
    # head (transfer learning) must count as the model's, not as an activation to store.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 3))
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    policy = et.BackRazor(0.9)
    run(model, x, y, policy)
    run(model, x, y, policy)
    model[3] = nn.Linear(8 * 30 * 30, 5)
    ledger = et.SavedTensorLedger()
    grads, _ = run(model, x, torch.tensor([0, 4]), policy, ledger)
    assert grads[-2].shape == (5, 8 * 30 * 30)
    weight_rows = [r for r in ledger.records if r.shape == (5, 8 * 30 * 30) or r.shape == (8 * 30 * 30, 5)]
    assert weight_rows and all(r.storage == "external" for r in weight_rows)


def test_a_trained_model_is_not_kept_alive_by_its_tapes():
    import gc
    import weakref

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 3))
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    for _ in range(2):
        run(model, x, y, et.BackRazor(0.9))
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("policy", [et.Bitmap(), et.BackRazor(0.9), et.Dense()])
def test_a_model_is_freed_when_dropped_without_the_garbage_collector(policy):
    """A finished block is no reference cycle: a block that held a bound method of itself kept the
    model, its optimizer state and what it stored alive until the collector ran, which then freed
    them in the middle of a later step (a negative forward increase was measured on an H100)."""
    import gc
    import weakref

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 3))
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    gc.collect()
    gc.disable()
    try:
        for ledger in (None, et.SavedTensorLedger(), None):
            run(model, x, y, policy, ledger)
        gone = weakref.ref(model)
        del model
        assert gone() is None
    finally:
        gc.enable()


def test_a_replayed_step_follows_a_change_of_policy_or_min_bytes():
    # What a replayed position does is planned once per tape, policy and min_bytes (.replay):
    # a plan made under one of them must not serve a step under another.
    torch.manual_seed(0)
    model = Branchy()
    x, y = torch.randn(2, 3, 16, 16), torch.tensor([1, 3])

    def grads(policy, min_bytes=4096):
        model.zero_grad(set_to_none=True)
        with et.compress_activations(model, policy, min_bytes=min_bytes):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    fine, coarse = et.Quantized(8), et.Quantized(2)
    grads(fine)  # records the tape
    steps = {"fine": grads(fine), "coarse": grads(coarse), "fine again": grads(fine),
             "nothing stored": grads(fine, min_bytes=1 << 40)}
    assert len(tape.tapes_of(model).tapes) == 1  # every step above replayed the one tape
    references = {"fine": watched(model, x, y, fine)[0], "coarse": watched(model, x, y, coarse)[0]}
    assert not all(torch.equal(a, b) for a, b in zip(references["fine"], references["coarse"]))
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()  # plain PyTorch: what nothing stored gives
    references["nothing stored"] = [p.grad.clone() for p in model.parameters()]
    references["fine again"] = references["fine"]
    for name, got in steps.items():
        assert all(torch.equal(a, b) for a, b in zip(got, references[name])), name


def test_an_equal_policy_built_each_step_reuses_the_replay_plan():
    # The README's loop builds `compress_activations(model, BackRazor(0.9))` every step: an equal
    # policy object must be served by the plan made for the first, not plan every slot again.
    torch.manual_seed(0)
    model = Branchy()
    x, y = torch.randn(2, 3, 16, 16), torch.tensor([1, 3])
    for _ in range(4):
        with et.compress_activations(model, et.BackRazor(0.9)):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    tapes = tape.tapes_of(model)
    assert len(tapes.tapes) == 1 and len(tapes.plans) == 1
