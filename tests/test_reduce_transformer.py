"""Transformer reduction (issue 13, item 2): attention heads and MLP hidden units as groups.

Tiny randomly initialised BERT (transformers) and torchvision ViT models, so these tests check
structure, not accuracy: the cost model is what PyTorch's flop counter counts, alpha 0 changes
nothing, the budget holds on the smaller modules, the exact knapsack allocation is the brute-force
optimum, padding tokens do not enter the statistics, and checkpoints round-trip without pickle.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from torch import nn

from edgetorch.reduce.allocation import solve_graph_allocation
from edgetorch.reduce.graph_problem import make_graph_problem
from edgetorch.reduce.knapsack import solve_separable
from edgetorch.reduce.transformer import (block_statistics, cost_graph, count_transformer_macs, head_order,
                                          reduce_transformer)
from edgetorch.reduce.transformer_blocks import Block, HeadAttention, find_blocks, split_attention
from edgetorch.reduce import load, save
from edgetorch.zoo import CheckpointError, redraw_zero_weights

transformers = pytest.importorskip("transformers")
D, HEADS, HIDDEN, LAYERS, PAD = 32, 4, 64, 2, 0


def bert(seed: int = 0, hidden: int = HIDDEN) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=60, hidden_size=D, num_attention_heads=HEADS, intermediate_size=hidden,
                                     num_hidden_layers=LAYERS, max_position_embeddings=40, pad_token_id=PAD)
    return transformers.BertModel(config).eval()


def token_ids(n: int = 64, length: int = 12, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(1, 60, (n, length), generator=torch.Generator().manual_seed(seed))
    ids[::3, length - 3:] = PAD  # every third text is shorter: padded
    return ids


def vit(seed: int = 0) -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)  # its classifier is zero-initialised: redrawn, so outputs depend on the encoder
    return redraw_zero_weights(VisionTransformer(image_size=32, patch_size=8, num_layers=LAYERS, num_heads=HEADS,
                                                 hidden_dim=D, mlp_dim=HIDDEN, num_classes=5)).eval()


def images(n: int = 48) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if x.is_floating_point():
            return model(x)
        return model(input_ids=x, attention_mask=(x != PAD).long()).last_hidden_state


MODELS = {"bert": (bert, token_ids), "vit": (vit, images)}


def test_the_cost_model_is_the_flop_count_of_bert():
    # Per layer and token: q, k, v, output 4 d^2, MLP 2 d h, scores and context 2 T d; the pooler d^2 once.
    model, ids = bert(), token_ids()
    length = ids.shape[1]
    expected = LAYERS * length * (4 * D * D + 2 * D * HIDDEN + 2 * length * D) + D * D
    assert count_transformer_macs(model, ids[:1]) == expected
    graph, where = cost_graph(find_blocks(model), ("heads", "mlp"), length, D * D)
    assert graph.cost() == expected and len(where) == 2 * LAYERS


@pytest.mark.parametrize("name", MODELS)
def test_alpha_zero_changes_nothing(name):
    build, data = MODELS[name]
    model, x = build(), data()
    result = reduce_transformer(model, 0.0, "prune-ls", calibration=x)
    assert result.allocation.theta == [HEADS, HIDDEN] * LAYERS
    if name == "bert":  # nothing is replaced: bit for bit
        assert torch.equal(run(result.model, x), run(model, x))
    else:  # the split attention computes nn.MultiheadAttention's function in another order
        torch.testing.assert_close(run(result.model, x), run(model, x), rtol=1e-5, atol=1e-5)


def test_an_unsplit_vit_counts_what_its_split_copy_counts():
    # nn.MultiheadAttention's eval forward is a fused op the flop counter misses (attention products
    # and projections went uncounted): the count must not depend on which form the model is in.
    model, x = vit(), images()
    assert count_transformer_macs(model, x[:1]) == count_transformer_macs(split_attention(vit()), x[:1])
    assert any(isinstance(m, nn.MultiheadAttention) for m in model.modules())  # the caller's model is left as it was


@pytest.mark.parametrize("allocation", ["optimal", "pso", "uniform"])
@pytest.mark.parametrize("method", ["prune", "prune-ls"])
@pytest.mark.parametrize("name", MODELS)
def test_budget_holds_on_the_smaller_modules(name, method, allocation):
    build, data = MODELS[name]
    model, x = build(), data()
    full = count_transformer_macs(split_attention(build()), x[:1])
    result = reduce_transformer(model, 0.5, method, allocation, calibration=x)
    macs = count_transformer_macs(result.model, x[:1])
    assert macs == result.allocation.cost <= 0.5 * full and result.allocation.total == full
    for block in find_blocks(result.model):
        sizes = result.sizes[block.name]
        assert (block.heads, block.hidden) == (sizes["heads"], sizes["hidden"])
        attention = result.model.get_submodule(block.attention)
        heads = attention.heads if isinstance(attention, HeadAttention) else attention.num_attention_heads
        assert heads == sizes["heads"] and result.model.get_submodule(block.query).out_features == heads * D // HEADS
    assert torch.isfinite(run(result.model, x)).all()
    assert [g.kept for g in result.groups] == result.allocation.theta


def test_only_the_mlp_groups_when_asked():
    model, ids = bert(), token_ids()
    result = reduce_transformer(model, 0.3, "prune", calibration=ids, parts=("mlp",))
    assert all(s["heads"] == HEADS for s in result.sizes.values())
    assert result.allocation.alpha >= 0.3 and len(result.allocation.theta) == LAYERS


def test_the_exact_allocation_is_the_brute_force_optimum():
    # Random knapsacks of the transformer's shape (heads and hidden units per block, additive costs).
    rng = np.random.default_rng(0)
    blocks = [Block(f"b{i}", "", "", "", "", "", "", "", int(rng.integers(2, 5)), 2, int(rng.integers(3, 7)), 4)
              for i in range(2)]
    for trial in range(8):
        graph, _ = cost_graph(blocks, ("heads", "mlp"), int(rng.integers(2, 9)), int(rng.integers(0, 200)))
        # Decreasing curves, 0 when everything is kept, with ties (plateaus) where a draw was zeroed.
        curves = [np.concatenate([[np.inf], np.sort(rng.exponential(size=g.size - 1) * (rng.random(g.size - 1) > 0.2))[::-1],
                                  [0.0]]) for g in graph.groups]
        alpha = float(rng.uniform(0.05, 0.6))
        try:
            problem = make_graph_problem(graph, curves, alpha)
        except ValueError:
            continue  # alpha past what one unit per group reaches
        best = min(problem.objective(k) for k in itertools.product(*(range(1, u + 1) for u in problem.upper))
                   if problem.feasible(k))
        theta = solve_separable(problem)
        assert problem.feasible(theta) and problem.objective(theta) == pytest.approx(best, abs=1e-12), trial
        for baseline in ("optimal", "pso", "uniform"):  # the channel-graph solver and both heuristics
            assert solve_graph_allocation(problem, "prune", baseline).objective >= best - 1e-12


def test_the_knapsack_refuses_coupled_groups():
    from edgetorch.reduce.graph import ChannelGraph, ChannelGroup, CostTerm

    groups = tuple(ChannelGroup(i, 3, f"g{i}", (), ()) for i in range(2))
    graph = ChannelGraph(groups, (CostTerm("a", 1, (0,), 1, 1, 1, False, 4, 1),), "a")  # reads g0, writes g1
    with pytest.raises(ValueError, match="uncoupled"):
        solve_separable(make_graph_problem(graph, [[np.inf, 2, 1, 0]] * 2, 0.3))


def test_head_curves():
    # Power order on an identity: every head holds 2 of 8, so J(v) = (8 - 2v) / 2v.
    order, curve = head_order(np.eye(8), 2, correlated=False)
    assert curve.tolist() == [np.inf, 3.0, 1.0, 1 / 3, 0.0]
    # Head 2 copies head 0: the correlation-aware order explains everything with heads 0 (or 2), 1, 3.
    rng = np.random.default_rng(1)
    basis = rng.normal(size=(6, 500))
    x = np.concatenate([basis[:2], basis[2:4], basis[:2], basis[4:6]])
    cov = x @ x.T / 500
    order, curve = head_order(cov, 2, correlated=True)
    assert curve[3] == pytest.approx(0.0, abs=1e-9) and {order[0], order[1], order[2]} >= {1, 3}
    _, naive = head_order(cov, 2, correlated=False)
    assert naive[3] > 0.1


def test_padding_is_left_out_of_the_statistics():
    model, ids = bert(), token_ids(length=12)
    longer = torch.cat([ids, torch.full((len(ids), 4), PAD)], dim=1)
    blocks = find_blocks(model)
    short, padded = block_statistics(model, blocks, ids), block_statistics(model, blocks, longer)
    assert padded.tokens == short.tokens == int((ids != PAD).sum())
    for (m1, c1), (m2, c2) in zip(short.mlp + short.attention, padded.mlp + padded.attention):
        np.testing.assert_allclose(m1, m2, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(c1, c2, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_save_and_load_round_trip(tmp_path, name):
    build, data = MODELS[name]
    x = data()
    result = reduce_transformer(build(), 0.5, "prune-ls", calibration=x)
    path = save(result.model, tmp_path / "small.safetensors", {"alpha": 0.5})
    loaded, record = load(path)
    assert record["alpha"] == 0.5 and torch.equal(run(loaded, x), run(result.model, x))
    record["blocks"][next(iter(record["blocks"]))]["hidden"] = HIDDEN + 1  # more than the model has
    path.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="hidden must be an integer"):
        load(path)


def test_a_wrapper_of_your_own_class_loads_into_the_model_you_build(tmp_path):
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.head = bert(), nn.Linear(D, 2)

        def forward(self, ids):
            return self.head(self.encoder(input_ids=ids, attention_mask=(ids != PAD).long()).last_hidden_state[:, 0])

    ids = token_ids()
    result = reduce_transformer(Classifier().eval(), 0.4, "prune", calibration=ids)
    path = save(result.model, tmp_path / "c.safetensors")
    with pytest.raises(CheckpointError, match="pass it as model="):
        load(path)
    loaded, _ = load(path, model=Classifier())
    assert torch.equal(loaded(ids), result.model(ids))


def test_refusals():
    with pytest.raises(TypeError, match="no transformer block"):
        reduce_transformer(nn.Sequential(nn.Linear(4, 4)), 0.5, calibration=torch.rand(8, 4))
    with pytest.raises(ValueError, match="accepted: prune, prune-ls"):
        reduce_transformer(bert(), 0.5, "lowrank", calibration=token_ids())
    with pytest.raises(ValueError, match="parts"):
        reduce_transformer(bert(), 0.5, calibration=token_ids(), parts=("ffn",))
    attention = HeadAttention.from_multihead(nn.MultiheadAttention(8, 2, batch_first=True))
    with pytest.raises(NotImplementedError, match="need_weights"):
        attention(torch.rand(1, 3, 8), torch.rand(1, 3, 8), torch.rand(1, 3, 8), need_weights=True)


def test_shared_statistics_give_the_same_reduction():
    model, ids = bert(), token_ids()
    stats = block_statistics(model, find_blocks(model), ids)
    shared = reduce_transformer(model, 0.5, "prune-ls", calibration=ids, statistics=stats)
    alone = reduce_transformer(model, 0.5, "prune-ls", calibration=ids)
    assert shared.allocation.theta == alone.allocation.theta and torch.equal(run(shared.model, ids), run(alone.model, ids))
    with pytest.raises(ValueError, match="another model"):
        reduce_transformer(bert(hidden=48), 0.5, calibration=ids, statistics=stats)


def test_reduce_model_takes_the_transformer_path():
    from edgetorch.reduce import reduce_model
    from edgetorch.reduce.api import ReductionPath, reduction_path

    model, ids = bert(), token_ids()
    assert reduction_path(model, "prune-ls") is ReductionPath.TRANSFORMER
    assert reduction_path(model, "lowrank") is ReductionPath.LOWRANK_LAYERS  # factored layer by layer
    result = reduce_model(model, 0.4, "prune-ls", calibration=ids)
    direct = reduce_transformer(model, 0.4, "prune-ls", calibration=ids)
    assert result.allocation.theta == direct.allocation.theta and result.allocation.alpha >= 0.4
    assert [g.root for g in result.groups] == [f"encoder.layer.{i}.{p}" for i in range(LAYERS) for p in ("heads", "mlp")]
