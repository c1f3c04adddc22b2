"""The prunable parts of transformer blocks: attention heads and MLP hidden units, found and resized.

Two families are recognised:

* **Hugging Face BERT-style layers** (``BertLayer`` and its look-alikes: MiniLM, RoBERTa, ...): a
  module with ``attention.self.{query,key,value}``, ``attention.output.dense``,
  ``intermediate.dense`` and ``output.dense``. The self-attention reshapes its projections with
  ``view(..., -1, attention_head_size)``, so fewer rows in query/key/value mean fewer heads; its
  ``num_attention_heads`` / ``all_head_size`` are kept in step (``transformers`` 5 has no
  ``prune_heads`` any more, so heads are removed here).
* **torchvision's ViT** ``EncoderBlock``: the MLP is ``mlp[0]`` / ``mlp[3]``. Its
  ``nn.MultiheadAttention`` keeps q, k, v in one ``in_proj_weight`` and calls the output
  projection functionally, so neither can lose a head nor be observed by a hook; it is replaced by
  :class:`HeadAttention`, the same computation with four ``nn.Linear`` (outputs equal to float
  rounding), before anything is measured or pruned.

A *unit* of the MLP group is one hidden neuron (a row of ``fc1`` and a column of ``fc2``); a unit of
the head group is one head, i.e. ``head_size`` rows of each of query/key/value and the same
columns of the output projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class HeadAttention(nn.Module):
    """Batch-first self-attention with separate q/k/v/output ``nn.Linear`` layers, so heads can be removed.

    It stands in for torchvision ViT's ``nn.MultiheadAttention`` (same call ``attn(x, x, x,
    need_weights=False)``, same ``(output, None)`` return), computing
    ``out(softmax(q k^T / sqrt(d_head)) v)`` per head with ``scaled_dot_product_attention``.

    Args:
        embed_dim: model width d (input and output).
        heads: number of heads.
        head_size: d_head (unchanged by pruning: the softmax scale stays ``d_head ** -0.5``).
        dropout: attention dropout in training mode.

    Example:
        >>> attention = HeadAttention.from_multihead(nn.MultiheadAttention(64, 4, batch_first=True))
        >>> attention(x, x, x, need_weights=False)[0].shape == x.shape
        True
    """

    def __init__(self, embed_dim: int, heads: int, head_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.head_size, self.dropout = heads, head_size, dropout
        width = heads * head_size
        self.query = nn.Linear(embed_dim, width)
        self.key = nn.Linear(embed_dim, width)
        self.value = nn.Linear(embed_dim, width)
        self.out = nn.Linear(width, embed_dim)

    @classmethod
    def from_multihead(cls, attention: nn.MultiheadAttention) -> "HeadAttention":
        """The same attention (same weights) as a batch-first ``nn.MultiheadAttention`` with biases.

        Raises:
            TypeError: a variant this module does not compute (separate k/v widths, ``bias_k``,
                ``add_zero_attn``, no bias, sequence-first).
        """
        if not (attention.batch_first and attention._qkv_same_embed_dim and attention.in_proj_bias is not None
                and attention.bias_k is None and not attention.add_zero_attn):
            raise TypeError("only a batch-first nn.MultiheadAttention with one in_proj_weight, biases, no bias_k/bias_v "
                            "and no add_zero_attn (torchvision's ViT) can have its heads pruned")
        d, heads = attention.embed_dim, attention.num_heads
        new = cls(d, heads, d // heads, attention.dropout).to(attention.in_proj_weight.device,
                                                              attention.in_proj_weight.dtype)
        with torch.no_grad():
            for part, w, b in zip((new.query, new.key, new.value), attention.in_proj_weight.chunk(3),
                                  attention.in_proj_bias.chunk(3)):
                part.weight.copy_(w)
                part.bias.copy_(b)
            new.out.weight.copy_(attention.out_proj.weight)
            new.out.bias.copy_(attention.out_proj.bias)
        return new

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, need_weights: bool = False,
                attn_mask: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None):
        if need_weights or attn_mask is not None or key_padding_mask is not None:
            raise NotImplementedError("a pruned HeadAttention computes plain self-attention only: need_weights, "
                                      "attn_mask and key_padding_mask are not supported")
        batch, length = query.shape[:2]

        def split(x: torch.Tensor) -> torch.Tensor:  # [B, T, heads * d_head] -> [B, heads, T, d_head]
            return x.view(batch, x.shape[1], -1, self.head_size).transpose(1, 2)

        context = F.scaled_dot_product_attention(split(self.query(query)), split(self.key(key)), split(self.value(value)),
                                                 dropout_p=self.dropout if self.training else 0.0)
        return self.out(context.transpose(1, 2).reshape(batch, length, -1)), None


@dataclass(frozen=True)
class Block:
    """One transformer block's prunable layers, by qualified name.

    Attributes:
        name: the block.
        attention: the module holding the head count (``BertSelfAttention`` or :class:`HeadAttention`).
        query, key, value, out: the projections (``out`` reads the concatenated heads).
        fc1, fc2: the MLP (``fc2`` reads the hidden units).
        heads: heads H.
        head_size: d_head.
        hidden: MLP hidden units h.
        width: model width d.
    """

    name: str
    attention: str
    query: str
    key: str
    value: str
    out: str
    fc1: str
    fc2: str
    heads: int
    head_size: int
    hidden: int
    width: int


def _is_bert_layer(module: nn.Module) -> bool:
    parts = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
             "intermediate.dense", "output.dense")
    names = dict(module.named_modules())
    return all(isinstance(names.get(p), nn.Linear) for p in parts) and hasattr(names["attention.self"], "attention_head_size")


def _is_vit_block(module: nn.Module) -> bool:
    from torchvision.models.vision_transformer import EncoderBlock

    return isinstance(module, EncoderBlock)


def is_transformer(model: nn.Module) -> bool:
    """Whether ``model`` holds a Hugging Face BERT-style layer or a torchvision ViT encoder block."""
    return any(_is_bert_layer(m) or _is_vit_block(m) for m in model.modules())


def split_attention(model: nn.Module) -> nn.Module:
    """Replace every ViT ``EncoderBlock``'s ``nn.MultiheadAttention`` by a :class:`HeadAttention` (in place).

    Returns:
        ``model``.
    """
    for module in model.modules():
        if _is_vit_block(module) and isinstance(module.self_attention, nn.MultiheadAttention):
            module.self_attention = HeadAttention.from_multihead(module.self_attention)
    return model


def find_blocks(model: nn.Module) -> list[Block]:
    """The transformer blocks of ``model`` in module order (call :func:`split_attention` first for a ViT).

    Raises:
        TypeError: no supported block, a block with cross-attention, or a ViT block whose attention was
            not split (the message says what is accepted).
    """
    blocks = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if _is_bert_layer(module):
            if getattr(module, "crossattention", None) is not None:
                raise TypeError(f"layer {name!r} has cross-attention (a decoder); only encoder self-attention and "
                                "MLP blocks are pruned")
            attention = module.attention.self
            blocks.append(Block(name, f"{prefix}attention.self", f"{prefix}attention.self.query",
                                f"{prefix}attention.self.key", f"{prefix}attention.self.value",
                                f"{prefix}attention.output.dense", f"{prefix}intermediate.dense", f"{prefix}output.dense",
                                attention.query.out_features // attention.attention_head_size,
                                attention.attention_head_size, module.intermediate.dense.out_features,
                                attention.query.in_features))
        elif _is_vit_block(module):
            attention = module.self_attention
            if not isinstance(attention, HeadAttention):
                raise TypeError(f"block {name!r}: call split_attention(model) first (its nn.MultiheadAttention "
                                "cannot lose heads)")
            blocks.append(Block(name, f"{prefix}self_attention", f"{prefix}self_attention.query",
                                f"{prefix}self_attention.key", f"{prefix}self_attention.value",
                                f"{prefix}self_attention.out", f"{prefix}mlp.0", f"{prefix}mlp.3",
                                attention.query.out_features // attention.head_size, attention.head_size,
                                module.mlp[0].out_features, attention.query.in_features))
    if not blocks:
        raise TypeError(f"no transformer block found in this {type(model).__name__}; supported: Hugging Face BERT-style "
                        "layers (attention.self.query/key/value, attention.output.dense, intermediate.dense, "
                        "output.dense) and torchvision ViT EncoderBlocks")
    return blocks


def head_columns(heads: np.ndarray, head_size: int) -> np.ndarray:
    """The input columns of the output projection (= rows of q/k/v) that the given heads own, in order."""
    heads = np.asarray(heads, dtype=np.int64)
    return (heads[:, None] * head_size + np.arange(head_size)[None, :]).reshape(-1)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


@torch.no_grad()
def _linear(like: nn.Linear, weight, bias) -> nn.Linear:
    """A new Linear (``like``'s dtype and device) holding ``weight [out, in]`` and ``bias`` (``None``: no bias)."""
    as_tensor = lambda t: torch.as_tensor(t, dtype=like.weight.dtype, device=like.weight.device)  # noqa: E731
    weight = as_tensor(weight)
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=like.weight.device,
                    dtype=like.weight.dtype)
    new.weight.copy_(weight)
    if bias is not None:
        new.bias.copy_(as_tensor(bias))
    return new


def _rows(old: nn.Linear, rows: np.ndarray) -> nn.Linear:
    index = torch.as_tensor(rows, dtype=torch.long, device=old.weight.device)
    return _linear(old, old.weight.detach()[index], None if old.bias is None else old.bias.detach()[index])


def _columns(old: nn.Linear, columns: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None) -> nn.Linear:
    # A refit (weight given) always returns a bias: the dropped inputs' means move into it.
    if weight is not None:
        return _linear(old, weight, bias)
    index = torch.as_tensor(columns, dtype=torch.long, device=old.weight.device)
    return _linear(old, old.weight.detach()[:, index], None if old.bias is None else old.bias.detach())


def keep_heads(model: nn.Module, block: Block, heads: np.ndarray, out_weight: np.ndarray | None = None,
               out_bias: np.ndarray | None = None) -> None:
    """Keep only ``heads`` (increasing indices) of ``block``, in place.

    Args:
        model: the model ``block`` belongs to.
        block: from :func:`find_blocks`.
        heads: kept head indices, increasing, at least one.
        out_weight, out_bias: the output projection on the kept columns ``[d, len(heads) d_head]`` and
            its bias (from a refit); by default its kept columns as they are.

    Example:
        >>> keep_heads(model, find_blocks(model)[0], np.array([0, 2]))
    """
    rows = head_columns(heads, block.head_size)
    for part in (block.query, block.key, block.value):
        _replace(model, part, _rows(model.get_submodule(part), rows))
    _replace(model, block.out, _columns(model.get_submodule(block.out), rows, out_weight, out_bias))
    attention = model.get_submodule(block.attention)
    if isinstance(attention, HeadAttention):
        attention.heads = len(heads)
    else:  # transformers' BertSelfAttention (and look-alikes): kept in step for anyone who reads them
        attention.num_attention_heads = len(heads)
        attention.all_head_size = len(rows)


def keep_hidden(model: nn.Module, block: Block, units: np.ndarray, fc2_weight: np.ndarray | None = None,
                fc2_bias: np.ndarray | None = None) -> None:
    """Keep only the MLP hidden ``units`` (increasing) of ``block``, in place.

    Args:
        model, block: as for :func:`keep_heads`.
        units: kept hidden units, increasing, at least one.
        fc2_weight, fc2_bias: ``fc2`` on the kept units ``[d, len(units)]`` and its bias (from a refit);
            by default its kept columns as they are.

    Example:
        >>> keep_hidden(model, find_blocks(model)[0], np.arange(100))
    """
    _replace(model, block.fc1, _rows(model.get_submodule(block.fc1), units))
    _replace(model, block.fc2, _columns(model.get_submodule(block.fc2), units, fc2_weight, fc2_bias))
