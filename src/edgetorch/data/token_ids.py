"""Batches of token ids: texts of different lengths as one tensor, padded, and cut back again.

A text classifier that masks its padding (:class:`~edgetorch.zoo.minilm.MiniLMClassifier`)
gives the same outputs for a batch whatever padding it carries, so a dataset is padded once to a
common length and each batch is cut back to its own longest text before the forward pass: a
short batch costs what its texts need, not what the longest text of the corpus does.
"""

from __future__ import annotations

import torch


def pad_ids(ids: list[list[int]], pad_id: int, length: int | None = None) -> torch.Tensor:
    """Token id lists as one ``[len(ids), length]`` tensor, padded with ``pad_id``.

    Args:
        ids: each text's token ids (none longer than ``length``).
        pad_id: the tokenizer's ``pad_token_id``.
        length: columns (``None``: the longest text's length).

    Returns:
        The padded ``long`` tensor.

    Example:
        >>> pad_ids([[101, 7, 102], [101, 102]], pad_id=0)
        tensor([[101,   7, 102],
                [101, 102,   0]])
    """
    out = torch.full((len(ids), length or max(len(row) for row in ids)), pad_id, dtype=torch.long)
    for i, row in enumerate(ids):
        out[i, : len(row)] = torch.tensor(row)
    return out


def trim_padding(ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """``ids`` without the trailing columns that are padding in every row: a batch padded to its
    longest text, as if it had been padded on its own (``pad_id`` never occurs inside a text).

    Args:
        ids: ``[batch, length]`` token ids, padded at the end with ``pad_id``.
        pad_id: the tokenizer's ``pad_token_id``.

    Returns:
        A view of ``ids`` as wide as its longest text.

    Example:
        >>> trim_padding(torch.tensor([[5, 6, 0, 0], [5, 0, 0, 0]]), pad_id=0)
        tensor([[5, 6],
                [5, 0]])
    """
    return ids[:, : int((ids != pad_id).sum(1).max())]
