"""The paper's machinery on transformers: MLP hidden units and attention heads as groups (issue 13, item 2).

Every block (:mod:`edgetorch.reduce.transformer_blocks`) gives two groups:

* **MLP hidden units** (rows of ``fc1`` = columns of ``fc2``). ``J`` is eq. 14 on ``fc2``'s input
  covariance over the calibration tokens (each token a sample): the naive power order
  (``"prune"``, dropped units' means move into ``fc2``'s bias) or the correlation-aware pivoted
  Cholesky order with a least-squares refit of ``fc2`` on the kept units (``"prune-ls"``).
* **Attention heads.** A head is kept or dropped whole: its ``d_head`` rows of query, key and value
  and the same columns of the output projection. ``J`` comes from the output projection's input
  covariance ``C`` (the concatenated head contexts) restricted to head blocks. ``"prune"`` orders
  heads by power (the trace of their diagonal block) and uses eq. 14 over those powers;
  ``"prune-ls"`` keeps, step by step, the head that explains the most of the remaining variance
  (the trace of the Schur complement of ``C`` on the kept heads drops the most), the block form of
  the pivoted Cholesky curve (``J(v)`` = variance not explained by the first ``v`` heads over the
  explained), then refits the output projection by least squares on the kept heads' columns.

Cost (multiplications per sample, the paper's footnote 1 plus the attention products, at the
calibration's sequence length ``T``): a hidden unit costs ``2 d T`` (a row of ``fc1``, a column of
``fc2``), a head ``d_head (4 d + 2 T) T`` (its q, k, v rows and output columns: ``4 d d_head`` per
token; its scores ``q k^T`` and context ``softmax v``: ``2 T d_head`` per token). Everything
else (embeddings, patch projection, pooler, classifier) is a constant. The cost is additive over
groups, so the allocation is a knapsack: it is posed as a channel-graph problem without couplings
(:class:`~edgetorch.reduce.graph_problem.GraphProblem`), solved exactly by the dynamic program of
:mod:`edgetorch.reduce.knapsack` (the channel-graph branch and bound ran into its time limit here),
with the same PSO and uniform baselines as any CNN's groups. The physically smaller model's multiplications are
then counted for real (``torch.utils.flop_counter``, attention on its math path) and must equal
the cost model's.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .._checks import check_choice
from .allocation import ALLOCATIONS, Allocation, solve_graph_allocation
from .curves import correlated_order, power_order, tail_over_head
from .graph import ChannelGraph, ChannelGroup, CostTerm
from .graph_problem import make_graph_problem
from .grouped import GroupFactor
from .knapsack import solve_separable
from .macs import hooked_eval
from .statistics import Moments, kept_inputs
from .transformer_blocks import Block, find_blocks, head_columns, keep_heads, keep_hidden, split_attention

PARTS = ("heads", "mlp")  # what ``parts=`` takes


@torch.no_grad()
def count_transformer_macs(model: nn.Module, example: torch.Tensor) -> int:
    """Multiplications per sample of one forward pass, counted by PyTorch's own ``FlopCounterMode``.

    Matrix products (Linear layers, convolutions, attention's ``q k^T`` and ``softmax v``) are
    counted as flops / 2; attention runs on its math path, whose products the counter sees (the
    fused CPU kernels are not counted). Biases, norms and activations are left out, as in the paper.

    Args:
        model: any module (in eval mode for a deterministic count).
        example: a batch of inputs; the count is divided by its first dimension.

    Returns:
        Multiplications per sample.

    Example:
        >>> count_transformer_macs(bert, ids[:1])  # 2 T (4 d^2 + 2 d h + 2 T d) per layer + pooler
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    if any(isinstance(m, nn.MultiheadAttention) for m in model.modules()):
        # Its eval forward is one fused native op that the counter does not see into (an unreduced
        # vit_b_16 counted 11.3 G instead of 17.6 G); the split copy computes the same products.
        model = split_attention(copy.deepcopy(model))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(example)
    return counter.get_total_flops() // 2 // len(example)


@dataclass(frozen=True)
class BlockStatistics:
    """Per block, the moments of the output projection's and ``fc2``'s inputs over the calibration tokens.

    Attributes:
        attention: per block ``(means [H d_head, 1], covariance [H d_head, H d_head])``.
        mlp: per block ``(means [h, 1], covariance [h, h])``.
        tokens: tokens the statistics come from (padding excluded).
        length: ``T``, the tokens per sample the blocks saw (what the attention cost is stated at).
    """

    attention: list[tuple[np.ndarray, np.ndarray]]
    mlp: list[tuple[np.ndarray, np.ndarray]]
    tokens: int
    length: int


def _pad_id(model: nn.Module) -> int | None:
    # The first config in the model: its own, or its encoder's in a wrapper (a classifier holding a BertModel).
    config = next((m.config for m in model.modules() if hasattr(m, "config")), None)
    return getattr(config, "pad_token_id", None)


@torch.no_grad()
def block_statistics(model: nn.Module, blocks: list[Block], calibration: torch.Tensor,
                     batch_size: int = 32) -> BlockStatistics:
    """Run the calibration samples through ``model`` and accumulate the two consumers' input moments per block.

    Token ids (an integer tensor) equal to the model config's ``pad_token_id`` are padding: their
    positions are left out of the statistics, and a Hugging Face model (one with a ``config``) is
    called with the matching ``attention_mask``. A wrapper whose input is token ids builds its own
    mask; other inputs (images) count every token.

    Args:
        model: the model ``blocks`` were found in.
        blocks: from :func:`~edgetorch.reduce.transformer_blocks.find_blocks`.
        calibration: N >= 2 unlabeled inputs (token ids ``[N, T]`` or images ``[N, C, H, W]``).
        batch_size: samples per forward pass.

    Returns:
        The :class:`BlockStatistics`.
    """
    pad = None if calibration.is_floating_point() else _pad_id(model)
    moments = {name: Moments(shared=False, samples=len(calibration)) for b in blocks for name in (b.out, b.fc2)}
    state: dict[str, torch.Tensor | None] = {"mask": None}
    lengths: set[int] = set()

    def read(name: str):
        def hook(module, inputs):
            x = inputs[0]
            lengths.add(x.shape[1])
            mask = state["mask"]
            rows = x[mask] if mask is not None and mask.shape == x.shape[:2] else x.reshape(-1, x.shape[-1])
            moments[name].add(rows.unsqueeze(-1))  # every token one sample of the unit vector
        return hook

    with hooked_eval(model, [model.get_submodule(name).register_forward_pre_hook(read(name)) for name in moments]):
        for batch in calibration.split(batch_size):
            mask = None if pad is None else batch != pad
            state["mask"] = mask
            if mask is not None and hasattr(model, "config"):
                model(input_ids=batch, attention_mask=mask.long())
            else:
                model(batch)
    if len(lengths) != 1:
        raise ValueError(f"the blocks saw sequences of lengths {sorted(lengths)}; pad the calibration inputs to one "
                         "length (the length the attention cost is stated at)")
    finished = {name: m.finish()[:2] for name, m in moments.items()}
    return BlockStatistics([finished[b.out] for b in blocks], [finished[b.fc2] for b in blocks],
                           moments[blocks[0].fc2].vectors, lengths.pop())


def head_order(cov: np.ndarray, head_size: int, correlated: bool) -> tuple[np.ndarray, np.ndarray]:
    """Heads in the order they are kept and ``J`` for 0..H kept heads (module docstring).

    Args:
        cov: the output projection's input covariance ``[H d_head, H d_head]``.
        head_size: d_head.
        correlated: the block-greedy Schur-complement order (``prune-ls``) instead of head power.

    Returns:
        ``(order, curve)`` as :func:`~edgetorch.reduce.curves.power_order` returns for units.

    Example:
        >>> order, curve = head_order(np.eye(8), 2, correlated=False)
        >>> curve.tolist()
        [inf, 3.0, 1.0, 0.3333333333333333, 0.0]
    """
    cov = np.asarray(cov, dtype=np.float64)
    heads = len(cov) // head_size
    blocks = [head_columns(np.array([h]), head_size) for h in range(heads)]
    if not correlated:
        power = np.array([np.trace(cov[np.ix_(b, b)]) for b in blocks]).clip(0.0)
        order = np.argsort(-power, kind="stable")
        return order, tail_over_head(power[order])
    rest, order, explained = cov.copy(), [], []
    left = list(range(heads))
    for _ in range(heads):
        best = None
        for h in left:
            b = blocks[h]
            values, vectors = np.linalg.eigh(rest[np.ix_(b, b)])
            keep = values > 1e-10 * max(np.abs(values).max(initial=0.0), 1e-300)
            # rest[:, b] pinv(rest[b, b]) rest[b, :]: the variance of every column that head h explains.
            half = rest[:, b] @ (vectors[:, keep] / np.sqrt(values[keep]))
            gain = float(np.sum(half**2))
            if best is None or gain > best[0]:
                best = (gain, h, half)
        gain, h, half = best
        rest -= half @ half.T
        order.append(h)
        explained.append(gain)
        left.remove(h)
    return np.array(order), tail_over_head(np.array(explained))


def cost_graph(blocks: list[Block], parts: tuple[str, ...], length: int,
               fixed: int) -> tuple[ChannelGraph, list[tuple[int, str]]]:
    """The blocks' groups as a channel graph without couplings: ``cost = fixed + sum_g scale_g k_g``.

    Args:
        blocks: from :func:`~edgetorch.reduce.transformer_blocks.find_blocks`.
        parts: the groups per block, in :data:`PARTS` order.
        length: sequence length ``T``.
        fixed: multiplications per sample outside the groups.

    Returns:
        ``(graph, where)``: the graph (a head costs ``d_head (4 d + 2 T) T``, a hidden unit ``2 d T``)
        and, per group, ``(block index, part)``.

    Example:
        >>> graph, where = cost_graph(find_blocks(bert), PARTS, 128, 0)
        >>> where[:2]
        [(0, 'heads'), (0, 'mlp')]
    """
    groups, terms, where = [], [], []
    for i, b in enumerate(blocks):
        for part in parts:
            size, scale = ((b.heads, b.head_size * (4 * b.width + 2 * length) * length) if part == "heads"
                           else (b.hidden, 2 * b.width * length))
            name = f"{b.name}.{part}"
            groups.append(ChannelGroup(len(groups), size, name, (), ()))
            terms.append(CostTerm(name, scale, (len(groups) - 1,), 0, None, 1, False, size, 1))
            where.append((i, part))
    terms.append(CostTerm("(not reduced)", 1, (), fixed, None, 1, False, fixed, 1))
    return ChannelGraph(tuple(groups), tuple(terms), "(not reduced)"), where


@dataclass(frozen=True)
class TransformerReduction:
    """What :func:`reduce_transformer` found and built.

    Attributes:
        model: the smaller model (eval mode; a ViT's attention is a :class:`HeadAttention`).
        method: ``"prune"`` or ``"prune-ls"``.
        allocation: the solver's record (``theta`` = kept heads / hidden units per group, ``cost`` and
            ``total`` in multiplications per sample at ``length`` tokens).
        groups: one :class:`~edgetorch.reduce.grouped.GroupFactor` per group (``root`` is
            ``BLOCK.heads`` or ``BLOCK.mlp``).
        length: the sequence length ``T`` the attention cost is stated at.
        sizes: per block name, ``{"heads": kept, "hidden": kept}`` (what a checkpoint records).
    """

    model: nn.Module
    method: str
    allocation: Allocation
    groups: list[GroupFactor]
    length: int
    sizes: dict[str, dict[str, int]]


def reduce_transformer(model: nn.Module, alpha: float, method: str = "prune", allocation: str = "optimal",
                       calibration: torch.Tensor | None = None, seed: int = 0, parts: tuple[str, ...] = PARTS,
                       statistics: BlockStatistics | None = None) -> TransformerReduction:
    """Prune a transformer's attention heads and MLP hidden units so that ``alpha`` of its multiplications go.

    Args:
        model: a model holding Hugging Face BERT-style layers (``BertModel``, MiniLM, a classifier
            wrapping one) or torchvision ViT encoder blocks; not modified.
        alpha: total reduction factor in [0, 1) of the whole model's multiplications per sample
            (constant parts included) at the calibration's sequence length.
        method: ``"prune"`` (power order, means into biases) or ``"prune-ls"`` (correlation-aware
            order, least-squares refit of ``fc2`` and of the output projection).
        allocation: ``"optimal"`` (exact: :func:`~edgetorch.reduce.knapsack.solve_separable`), ``"pso"`` or
            ``"uniform"`` (the same fraction of every group).
        calibration: N >= 2 unlabeled inputs of one sequence length (token ids ``[N, T]``, padding =
            the config's ``pad_token_id``; or images).
        seed: PSO seed.
        parts: which groups to prune: ``("heads", "mlp")``, ``("mlp",)`` or ``("heads",)``.
        statistics: :func:`block_statistics` of this model on ``calibration``, when several reductions
            share one calibration pass (the pass is most of a reduction's time: a ``[tokens, h]``
            covariance per block).

    Returns:
        The :class:`TransformerReduction`.

    Raises:
        ValueError: bad method/allocation/alpha/parts, no calibration data, sequences of several lengths.
        TypeError: no supported transformer block (the message says what is accepted).
        RuntimeError: the reduced model's counted multiplications differ from the cost model's.

    Example:
        >>> result = reduce_transformer(bert, 0.5, "prune-ls", calibration=ids)
        >>> count_transformer_macs(result.model, ids[:1]) == result.allocation.cost
        True
    """
    if method not in ("prune", "prune-ls"):
        raise ValueError(f"method {method!r} is not available for a transformer; accepted: prune, prune-ls")
    check_choice("allocation", allocation, ALLOCATIONS)  # before the calibration pass, which takes a while
    if not parts or any(p not in PARTS for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(f"parts must name some of {PARTS} once each, got {parts!r}")
    if not isinstance(calibration, torch.Tensor) or calibration.ndim < 2 or len(calibration) < 2:
        raise ValueError(f"method {method!r} needs calibration samples: a tensor of at least 2 unlabeled inputs")
    reduced = split_attention(copy.deepcopy(model).eval())
    blocks = find_blocks(reduced)
    stats = statistics if statistics is not None else block_statistics(reduced, blocks, calibration)
    if len(stats.mlp) != len(blocks) or any(len(c) != b.hidden for (_, c), b in zip(stats.mlp, blocks)):
        raise ValueError("statistics= belong to another model: their sizes are not this model's blocks")
    correlated = method == "prune-ls"
    full = count_transformer_macs(reduced, calibration[:1])
    parts = tuple(p for p in PARTS if p in parts)
    graph, where = cost_graph(blocks, parts, stats.length, 0)
    graph, where = cost_graph(blocks, parts, stats.length, full - graph.cost())  # the rest is a constant
    orders = []
    for i, part in where:
        mean, cov = (stats.attention if part == "heads" else stats.mlp)[i]
        orders.append(head_order(cov, blocks[i].head_size, correlated) if part == "heads"
                      else (correlated_order if correlated else power_order)(cov))
    if correlated and stats.tokens <= max(b.hidden for b in blocks):
        warnings.warn(f"prune-ls: {stats.tokens} calibration tokens for {max(b.hidden for b in blocks)} hidden units; "
                      "the refit is underdetermined and J underestimates the error. Give more calibration text.",
                      stacklevel=2)
    problem = make_graph_problem(graph, [curve for _, curve in orders], alpha)
    if allocation == "optimal":  # uncoupled groups: the exact knapsack DP, proven (gap 0) in about a second
        start = time.perf_counter()
        theta = solve_separable(problem)
        chosen = Allocation(theta, method, allocation, problem.objective(theta), problem.cost(theta), problem.total,
                            time.perf_counter() - start, 0.0)
    else:
        chosen = solve_graph_allocation(problem, method, allocation, seed=seed)
    for (i, part), (order, _), k in zip(where, orders, chosen.theta):
        block = blocks[i]
        size = block.heads if part == "heads" else block.hidden
        if k == size:
            continue  # nothing dropped: the layers stay as they are (alpha 0 is the identity)
        kept = np.sort(order[:k])
        columns = head_columns(kept, block.head_size) if part == "heads" else kept
        consumer = reduced.get_submodule(block.out if part == "heads" else block.fc2)
        mean, cov = (stats.attention if part == "heads" else stats.mlp)[i]
        weight = consumer.weight.detach().double().cpu().numpy()[:, :, None]
        bias = (consumer.bias.detach().double().cpu().numpy() if consumer.bias is not None
                else np.zeros(weight.shape[0]))
        new_weight, new_bias = kept_inputs(weight, bias, cov, mean, columns, correlated)
        (keep_heads if part == "heads" else keep_hidden)(reduced, block, kept, new_weight[:, :, 0], new_bias)
    reduced.eval()
    macs = count_transformer_macs(reduced, calibration[:1])
    if macs != chosen.cost:  # the cost model and the pruned modules disagree: never ship that silently
        raise RuntimeError(f"the reduced model costs {macs:,} multiplications per sample but the allocation counted "
                           f"{chosen.cost:,} (please report)")
    factors = [GroupFactor(g.index, g.root, g.size, k, 1, float(curve[k]))
               for g, k, (_, curve) in zip(graph.groups, chosen.theta, orders)]
    sizes = {b.name: {"heads": b.heads, "hidden": b.hidden} for b in blocks}
    for (i, part), k in zip(where, chosen.theta):
        sizes[blocks[i].name]["heads" if part == "heads" else "hidden"] = int(k)
    return TransformerReduction(reduced, method, chosen, factors, stats.length, sizes)
