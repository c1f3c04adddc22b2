"""Per-block storage (edgetorch.activations.blocks): blocks found by name, each block's tensors stored in its
own form in one pass of the engine, and a plan of one form everywhere equal to that form alone."""

from __future__ import annotations

import pytest
import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import edgetorch
from edgetorch.activations.blocks import PerBlock, Recompute, find_blocks
from edgetorch.activations.roles import EXACT
from edgetorch.activations.step import TrainingPolicy, forward_backward, parse_training_policy


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).train()


def _grads(model: nn.Module, policy, x: torch.Tensor, y: torch.Tensor, ledger=None) -> list[torch.Tensor]:
    torch.manual_seed(1)  # stochastic rounding draws from it
    x = x.clone().requires_grad_()
    with edgetorch.compress_activations(model, policy, ledger=ledger):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return grads


class _Tiny(nn.Module):
    """A transformer whose layers sit in an nn.ModuleList (as a BERT encoder's do); ``masked``: each
    layer is called with a padding mask by keyword, as a BERT encoder passes its attention mask."""

    def __init__(self, masked: bool = False):
        super().__init__()
        self.masked = masked
        self.embed = nn.Linear(16, 32)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
                                    for _ in range(3))
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        h, pad = self.embed(x), torch.zeros(x.shape[:2], dtype=torch.bool)
        pad[0, -2:] = True  # the first sequence is two tokens shorter
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=pad) if self.masked else layer(h)
        return self.head(h.mean(1))


def test_blocks_are_the_members_of_each_sequence_of_blocks():
    assert find_blocks(_resnet()) == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    assert find_blocks(torchvision.models.mobilenet_v2()) == [f"features.{i}" for i in range(19)]
    assert find_blocks(_Tiny()) == ["layers.0", "layers.1", "layers.2"]
    assert find_blocks(nn.Linear(2, 2)) == []


def test_the_stem_is_the_layers_before_the_first_sequence_of_blocks():
    """With ``stem=True`` the layers registered before the first sequence, in its parent, are blocks
    too (an Identity stores nothing and is left out); containers there are searched as before."""
    assert find_blocks(_resnet(), stem=True) == ["conv1", "bn1", "relu", "maxpool", *find_blocks(_resnet())]
    assert find_blocks(torchvision.models.mobilenet_v2(), stem=True) == find_blocks(torchvision.models.mobilenet_v2())
    assert find_blocks(_Tiny(), stem=True) == ["embed", "layers.0", "layers.1", "layers.2"]  # head comes after
    with_identity = nn.Sequential()
    with_identity.add_module("skip", nn.Identity())
    with_identity.add_module("body", _Tiny())
    assert find_blocks(with_identity, stem=True) == ["body.embed", "body.layers.0", "body.layers.1", "body.layers.2"]


def test_a_block_that_runs_twice_in_a_forward_is_refused_by_name():
    """A module used twice (one activation module shared by two layers) cannot be a block: its
    second start would be read as a rerun. The costs say which block ran again."""
    from edgetorch.activations.costs import measure_block_costs

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.act = nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()
            self.layers = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1))
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            h = self.layers(self.act(self.conv(x)))
            return self.head(self.act(h).mean((2, 3)))  # act again, after the blocks

    model = Shared()
    assert find_blocks(model, stem=True) == ["conv", "act", "layers.0", "layers.1"]
    with pytest.raises(ValueError, match="act ran again"):
        measure_block_costs(model, (torch.randn(2, 3, 8, 8), torch.tensor([0, 1])), (edgetorch.Dense(),),
                            time_rounds=0)


def test_stages_of_one_block_each_are_sequences_of_blocks():
    """A ResNet-10 ([1, 1, 1, 1]): each stage holds one block. The search went inside those blocks
    and took each downsample's convolution and batch norm for two blocks (and checkpointed the
    downsample alone). A stage of one block counts where a sibling is a sequence too; a lone
    wrapper of one block is searched inside, and a one-layer classifier is no block."""
    from torchvision.models.resnet import BasicBlock, ResNet

    from edgetorch.activations.checkpoint import find_stages

    resnet10 = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=4)
    assert find_blocks(resnet10) == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    assert [name for _, name, _ in find_stages(resnet10)] == ["layer1", "layer2", "layer3", "layer4"]
    wrapped = nn.Sequential(nn.Sequential(_resnet()))  # one block: the model itself, searched inside
    assert find_blocks(wrapped) == [f"0.0.layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    assert "classifier.1" not in find_blocks(torchvision.models.mobilenet_v2())  # Dropout, Linear: a layer


@pytest.mark.parametrize("policy", [edgetorch.Quantized(4), edgetorch.Quantized(8, stochastic=True),
                                    edgetorch.BackRazor(0.9, exact="int8"), edgetorch.BackRazor(0.8, scope="all"),
                                    edgetorch.Bitmap()], ids=lambda p: p.spec())
@pytest.mark.parametrize("make, shape", [(_resnet, (2, 3, 32, 32)), (_Tiny, (2, 6, 16))], ids=["resnet18", "tiny"])
def test_one_form_in_every_block_is_bit_identical_to_that_policy_alone(policy, make, shape):
    model = make().train()
    x, y = torch.randn(shape), torch.tensor([1, 3])
    plan = PerBlock(tuple((name, policy) for name in find_blocks(model)), default=policy)
    alone, planned = _grads(model, policy, x, y), _grads(model, plan, x, y)
    assert all(torch.equal(a, b) for a, b in zip(alone, planned))


def test_each_block_stores_its_own_form_and_masks_stay_exact():
    model = _resnet()
    plan = PerBlock((("layer1.0", edgetorch.Quantized(4)), ("layer2.1", edgetorch.BackRazor(0.9))),
                    default=edgetorch.Bitmap())
    ledger = edgetorch.SavedTensorLedger()
    _grads(model, plan, torch.randn(2, 3, 64, 64), torch.tensor([1, 3]), ledger)
    forms: dict[str, set[str]] = {}
    for r in ledger.records:
        if r.storage == "stored":  # encoded (not a tiny tensor kept dense, nor a copy an exact one superseded)
            block = ".".join(r.module.split(".")[:2]) if r.module.startswith("layer") else "outside"
            forms.setdefault(block, set()).add(r.form)
    assert forms["layer1.0"] == {"int4", "mask(0,inf)"}  # ReLU keeps its exact 1-bit mask
    assert "prune" in forms["layer2.1"] and "mask(0,inf)" in forms["layer2.1"]
    assert {f for block, fs in forms.items() if block not in ("layer1.0", "layer2.1") for f in fs} == {"exact"}


def test_back_razor_blocks_leave_input_gradients_exact_where_no_batch_norm_trains():
    model = _resnet().eval()  # batch norm uses running statistics: its backward reads no saved input
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    plan = PerBlock(tuple((name, edgetorch.BackRazor(0.95)) for name in find_blocks(model)[::2]),
                    default=edgetorch.Bitmap())
    planned, plain = _grads(model, plan, x, y), _grads(model, edgetorch.Dense(), x, y)
    assert torch.equal(planned[0], plain[0])
    assert not all(torch.equal(a, b) for a, b in zip(planned[1:], plain[1:]))  # weight gradients did move


def test_a_plan_says_what_was_wrong():
    with pytest.raises(ValueError, match="more than once: layer1.0"):
        PerBlock((("layer1.0", edgetorch.Bitmap()), ("layer1.0", edgetorch.Dense())))
    with pytest.raises(ValueError, match="not a PerBlock"):
        PerBlock((("layer1.0", PerBlock()),))
    with pytest.raises(ValueError, match="no module named 'layer9.0'"):
        with edgetorch.compress_activations(_resnet(), PerBlock((("layer9.0", edgetorch.Bitmap()),))):
            pass


def test_flags_and_spec_follow_the_policies_it_uses():
    plan = PerBlock((("layer1.0", edgetorch.BackRazor(0.9)),), default=edgetorch.Dense())
    assert plan.needs_roles and plan.encodes and not PerBlock().encodes
    assert plan.spec() == "per-block(layer1.0=backrazor:sparsity=0.9; default=dense)"
    assert PerBlock().spec() == "per-block(default=dense)"
    assert plan.policies == (edgetorch.Dense(), edgetorch.BackRazor(0.9))
    assert hash(plan) == hash(PerBlock((("layer1.0", edgetorch.BackRazor(0.9)),)))


def test_recomputed_blocks_give_plain_gradients_and_statistics_and_hold_less():
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    results = []
    for policy in (edgetorch.Dense(), PerBlock(tuple((n, Recompute()) for n in find_blocks(_resnet())[1:]),
                                               default=edgetorch.Bitmap())):
        model, ledger = _resnet(), edgetorch.SavedTensorLedger()
        forward_backward(model, x, y, TrainingPolicy(policy), F.cross_entropy, ledger)
        assert isinstance(model.layer1[1], torchvision.models.resnet.BasicBlock)  # swapped back
        results.append(([p.grad for p in model.parameters()], [b.clone() for b in model.buffers()],
                        ledger.peak_live_bytes))
    (plain, plain_stats, plain_bytes), (planned, planned_stats, planned_bytes) = results
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))
    assert all(torch.equal(a, b) for a, b in zip(plain_stats, planned_stats))  # statistics updated once
    assert planned_bytes < 0.6 * plain_bytes  # measured 0.54x: the stem and layer1.0 are held as before


def test_a_block_called_with_keyword_arguments_is_recomputed_with_them():
    """MiniLM's per-block plan failed here: a recomputed BERT layer was called with its attention
    mask by keyword, which CheckpointEvery did not take. The mask reaches the block in both passes
    (gradients equal plain PyTorch's, which they would not without it), and the layer is swapped back."""
    x, y = torch.randn(2, 6, 16), torch.tensor([1, 3])
    torch.manual_seed(0)
    model = _Tiny(masked=True).train()
    grads = []
    for policy in (edgetorch.Dense(), PerBlock((("layers.0", Recompute()), ("layers.2", Recompute())))):
        forward_backward(model, x, y, TrainingPolicy(policy), F.cross_entropy)
        grads.append([p.grad for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert isinstance(model.layers[0], nn.TransformerEncoderLayer)


def test_a_recomputed_block_refuses_extra_inputs_that_need_gradients():
    from edgetorch.activations.checkpoint import CheckpointEvery

    class Add(nn.Module):
        def forward(self, x, other):
            return x * other

    wrapped = CheckpointEvery([Add()], 1)
    with pytest.raises(ValueError, match="must not need gradients"):
        wrapped(torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True))
    with pytest.raises(TypeError, match="single block only"):
        CheckpointEvery([Add(), Add()], 2)(torch.ones(2), torch.ones(2))


def test_the_module_table_is_built_once_per_model_not_per_step(monkeypatch):
    import edgetorch.activations.blocks as blocks

    built = []
    table = blocks._table
    monkeypatch.setattr(blocks, "_table", lambda model, named: built.append(named) or table(model, named))
    model, x, y = _resnet(), torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    plan = PerBlock((("layer1.0", edgetorch.Quantized(8)), ("layer2.1", Recompute())), default=edgetorch.Bitmap())
    for _ in range(3):  # forward_backward makes an engine per step; each asks for the table
        forward_backward(model, x, y, TrainingPolicy(plan), F.cross_entropy)
    assert len(built) == 1  # recomputing swaps layer2.1 in on every step: one table for that state
    table_swapped, _ = plan.by_module(model)  # not swapped now: the names differ, a second table
    assert len(built) == 2 and "layer2.1.conv1" in table_swapped and "layer2.1.blocks.0.conv1" not in table_swapped
    assert table_swapped["layer1.0.bn2"] == edgetorch.Quantized(8) and "layer1.1.conv1" not in table_swapped
    plan.by_module(_resnet())  # another model: its own table
    assert len(built) == 3


def test_a_plan_has_no_form_of_its_own():
    plan = PerBlock((("layer1.0", edgetorch.BackRazor(0.9)),))
    with pytest.raises(TypeError, match="policy of the block that saved it"):
        plan.form(EXACT)
    with pytest.raises(TypeError, match="call form or encode on that block's policy"):
        plan.encode(torch.ones(4), EXACT)


def test_a_plan_recomputing_other_blocks_is_not_replayed_from_anothers_tape():
    # Both plans swap in as many wrappers, so only the module order tells them apart; the second
    # used to replay the first one's tape (wrong modules, every tensor exact).
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    blocks = find_blocks(_resnet())
    first = tuple(zip(blocks, [edgetorch.Quantized(4), Recompute()] * 4))
    second = tuple(zip(blocks, [Recompute(), edgetorch.Quantized(4)] * 4))

    def rows(model, named):
        ledger = edgetorch.SavedTensorLedger()
        forward_backward(model, x, y, TrainingPolicy(PerBlock(named, edgetorch.Bitmap())), F.cross_entropy, ledger)
        return [(r.module, r.op, r.form, r.stored_bytes) for r in ledger.records]

    model = _resnet()
    rows(model, first)
    assert rows(model, second) == rows(_resnet(), second)


def test_the_block_after_a_recomputed_one_keeps_its_roles():
    """A recomputed block's forward (reentrant checkpointing) ends in gradient-free ops, and the next
    block's first pack follows them directly. It takes its own op's role, a convolution input that
    Back Razor prunes, as without recomputation: not exact (as when every pack after a
    gradient-free op was taken for a custom Function's), and not the role of the last
    gradient-free op, which saved nothing (matching its output made the input a ReLU mask)."""
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])

    def forms(block_form):
        ledger = edgetorch.SavedTensorLedger()
        plan = PerBlock((("layer2.0", block_form),), default=edgetorch.BackRazor(0.9))
        forward_backward(_resnet(), x, y, TrainingPolicy(plan), F.cross_entropy, ledger)
        return sorted((r.op, r.form) for r in ledger.records if r.module == "layer2.1.conv1")

    stored = forms(edgetorch.BackRazor(0.9))
    assert ("convolution", "prune") in stored
    assert forms(Recompute(edgetorch.BackRazor(0.9))) == stored


_POLICIES = [edgetorch.Dense(), edgetorch.Bitmap(), edgetorch.Bitmap(threshold=0.05), edgetorch.Quantized(4),
             edgetorch.Quantized(8, group=64, stochastic=True), edgetorch.BackRazor(0.9),
             edgetorch.BackRazor(0.8, exact="int8", values="int8")]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["layer1.0", "layer2.1", "features.3", "encoder.layer.0"]),
                          st.sampled_from(_POLICIES), st.booleans()), unique_by=lambda b: b[0], max_size=4),
       st.sampled_from(_POLICIES))
def test_a_plans_spec_parses_back_to_the_plan(blocks, default):
    plan = PerBlock(tuple((name, Recompute(p) if recompute else p) for name, p, recompute in blocks), default)
    assert edgetorch.parse_policy(plan.spec()) == plan
    assert parse_training_policy(plan.spec()) == TrainingPolicy(plan)


def test_a_plan_does_not_combine_with_stage_checkpointing():
    plan = PerBlock((("layer2.0", Recompute()),))
    with pytest.raises(ValueError, match="give the blocks to recompute Recompute"):
        TrainingPolicy(plan, checkpoint=True)
    with pytest.raises(ValueError, match="does not combine"):
        parse_training_policy(plan.spec() + "+checkpoint")
