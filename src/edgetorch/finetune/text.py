"""Fine-tuning MiniLM-L6 as a text classifier under a training policy: one recipe, so the runs
that compare policies and the runs that reduce a fine-tuned model train it the same way.

The recipe: :class:`~edgetorch.zoo.minilm.MiniLMClassifier` with its head drawn from ``seed``;
:func:`edgetorch.training.train_epochs` over batches of ``batch_size`` padded token ids (epoch e
visits the e-th permutation of ``seed``'s generator, the last partial batch kept), each cut back to
its own longest text; :func:`~edgetorch.zoo.minilm.minilm_optimizer` (AdamW, warm-up then linear
decay); each step :func:`edgetorch.activations.step.forward_backward` under the policy. Dropout
masks come from ``1000 + seed``, so for one seed every policy sees the same head, batch order and
masks, and accuracy differences between policies are paired. Both seeds are used under
:func:`edgetorch.training.seeded`: the caller's random streams are left as they were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from ..activations.step import forward_backward, parse_training_policy
from ..data.token_ids import trim_padding
from ..training import LastBatch, Loop, Watch, seeded, train_epochs
from ..zoo.minilm import MiniLMClassifier, minilm_optimizer


def minilm_classifier(pad_id: int, seed: int) -> MiniLMClassifier:
    """A :class:`MiniLMClassifier` in train mode, its new head drawn from ``seed``.

    Args:
        pad_id: the tokenizer's ``pad_token_id``.
        seed: the head's initial weights (the caller's RNG is left as it was).

    Returns:
        The classifier (pretrained encoder, new 2-class head), in train mode.
    """
    with seeded(seed):  # built on the CPU
        return MiniLMClassifier(pad_id).train()


def finetune_minilm(model: MiniLMClassifier, data: TensorDataset, policy: str = "dense", epochs: int = 1,
                    seed: int = 0, *, batch_size: int = 16, watch: Watch | None = None, **recipe: float,
                    ) -> list[float]:  # fmt: skip
    """Fine-tune ``model`` on ``data`` under ``policy`` with the module's recipe.

    Args:
        model: a classifier from :func:`minilm_classifier` (its ``pad_id`` trims the batches).
        data: ``(ids, labels)``, the ids padded with the model's ``pad_id`` to a common length.
        policy: a training-policy spec (:func:`edgetorch.activations.parse_training_policy`).
        epochs: passes over ``data``.
        seed: the batch order; dropout masks come from ``1000 + seed``.
        batch_size: texts per step.
        watch: told of every epoch and step (:class:`edgetorch.training.Watch`).
        recipe: ``encoder_lr``, ``head_lr``, ``weight_decay``, ``warmup`` for
            :func:`~edgetorch.zoo.minilm.minilm_optimizer` (its defaults otherwise).

    Returns:
        The loss of every step, in order.

    Raises:
        ValueError: a policy spec that does not parse.

    Example:
        >>> model = minilm_classifier(tokenizer.pad_token_id, seed=0)  # doctest: +SKIP
        >>> losses = finetune_minilm(model, train, "backrazor:sparsity=0.9")  # doctest: +SKIP
    """
    how = parse_training_policy(policy)
    loop = Loop(epochs, batch_size, seed, LastBatch.KEEP)
    optimizer, schedule = minilm_optimizer(model, epochs * loop.steps_per_epoch(len(data)), **recipe)

    def step(ids: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return forward_backward(model, trim_padding(ids, model.pad_id), labels, how, F.cross_entropy)

    # dropout masks: the same for every policy of this seed
    with seeded(1000 + seed, next(model.parameters()).device):
        return train_epochs(model, data, loop, step, optimizer, schedule, watch=watch).step_losses
