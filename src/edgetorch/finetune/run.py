"""A fine-tuning run: config, loop, per-epoch validation and measured peak, resumable checkpoints.

The loop is the one the memory planner assumes (:func:`edgetorch.plan_memory`): gradients are
freed before each forward (``zero_grad(set_to_none=True)``), and each step is
:func:`edgetorch.activations.forward_backward` under the run's training policy, then the
optimizer's step. So a plan made for this config predicts this loop's peak.

Files under ``out`` (all written atomically; nothing here is ever unpickled):

* ``checkpoint/``: the training loop's checkpoint (:mod:`edgetorch.training.checkpoint`), after
  every epoch. Running again with the same ``out`` and config resumes after the last finished
  epoch and ends with the same weights as an uninterrupted run (the batch order is a function of
  the seed; the RNG that drives augmentation and dropout is restored). Running a finished run
  again with a larger ``epochs`` and nothing else changed extends it (:func:`finetune`).
* ``model.safetensors``: the final ``state_dict`` under the architecture's own names, and
  ``model.json``: what a user needs to use it (classes, input size, channels, normalisation).
* ``log.json``: the config and one record per epoch (loss, validation accuracy, throughput,
  measured peak), rewritten after every epoch; ``metrics.csv``: the same records as a table.
* ``best.safetensors``: the weights after the epoch with the highest validation accuracy so far
  (the earliest among equals); ``model.json`` names that epoch. ``model.safetensors`` is the last.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .._checks import check_choice, check_positive_int
from .._files import write_json_atomically, write_text_atomically
from ..activations import freeze_batchnorm, parse_training_policy
from ..activations.step import forward_backward
from ..measure.process import peak_bytes, peak_kind, process_peak_bytes, reset_peak
from ..training import Checkpointing, LastBatch, Loop, Watch, evaluate_accuracy, train_epochs
from ..weights import save_weights
from .model import SCOPES, set_scope

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class FinetuneConfig:
    """How to fine-tune.

    Attributes:
        policy: training policy spec: ``dense``, ``bitmap[:...]``, ``backrazor[:sparsity=...]``,
            each optionally ``+checkpoint`` (see :func:`edgetorch.activations.parse_training_policy`).
        scope: which parameters train: ``full``, ``last``, ``norm+last`` or ``bias``.
        freeze_batchnorm: batch norm uses its running statistics and its affine does not train (the
            Back Razor paper's setting for CNN transfer).
        epochs: passes over the training images.
        batch_size: images per step. Every image is used once an epoch; the last batch is filled
            up with images from the start of the epoch's order, so every step has ``batch_size``
            images (all of them, if there are fewer). Dropping the last partial batch instead
            left a different few images unseen each epoch, all of them in a one-epoch run.
        optimizer: ``sgd`` (with ``momentum``), ``adam`` or ``adamw``.
        lr: initial learning rate.
        momentum: SGD momentum.
        weight_decay: L2 penalty (decoupled for adamw).
        schedule: ``cosine`` (to 0 over the run, per step) or ``constant``.
        seed: the batch order (:func:`edgetorch.training.epoch_orders`) and the new classifier's
            initialisation.
    """

    policy: str = "dense"
    scope: str = "full"
    freeze_batchnorm: bool = False
    epochs: int = 3
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    schedule: str = "cosine"
    seed: int = 0

    def __post_init__(self) -> None:
        parse_training_policy(self.policy)
        for name, accepted in (("scope", SCOPES), ("optimizer", OPTIMIZERS), ("schedule", SCHEDULES)):
            check_choice(name, getattr(self, name), accepted)
        for name in ("epochs", "batch_size"):
            check_positive_int(name, getattr(self, name))
        if not (math.isfinite(self.lr) and self.lr > 0 and 0 <= self.momentum < 1
                and math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"need lr > 0, 0 <= momentum < 1 and weight_decay >= 0; got lr={self.lr}, "
                             f"momentum={self.momentum}, weight_decay={self.weight_decay}")
        if self.freeze_batchnorm and self.scope == "norm+last":
            raise ValueError("scope norm+last trains the batch-norm affine, which freeze_batchnorm freezes; drop one")

    @property
    def planner_optimizer(self) -> str:
        """The optimizer name :func:`edgetorch.plan_memory` takes for this config."""
        return "sgd-no-momentum" if self.optimizer == "sgd" and self.momentum == 0 else self.optimizer


@dataclass
class FinetuneResult:
    """What a run did.

    Attributes:
        history: one record per epoch: ``epoch``, ``train_loss``, ``val_accuracy``,
            ``seconds``, ``images_per_second``, ``peak_bytes`` (measured over the epoch).
        val_accuracy: the last epoch's validation accuracy.
        peak_bytes: the measured peak over the epochs run in this call (peak RSS on a CPU,
            the CUDA allocator's peak on a GPU; see ``peak_kind``).
        peak_kind: ``"peak_rss"`` or ``"cuda_max_allocated"``.
        process_peak_bytes: the process's peak since it started, in ``peak_kind``'s unit
            (loading, any planning, every epoch, validation and checkpoints; on a CPU, what a
            memory limit sees).
        resumed_from: the epoch a checkpoint was resumed after (0: a fresh run).
        restarts: the epochs after which the schedule started again, each where a finished
            run was extended (empty: never extended).
        weights: the final ``model.safetensors`` (None without ``out``).
    """

    history: list[dict[str, Any]] = field(default_factory=list)
    val_accuracy: float = float("nan")
    peak_bytes: int = 0
    peak_kind: str = "peak_rss"
    process_peak_bytes: int | None = None
    resumed_from: int = 0
    restarts: list[int] = field(default_factory=list)
    weights: Path | None = None


ProgressFn = Callable[[dict[str, Any]], None]


def prepare(model: nn.Module, config: FinetuneConfig) -> list[nn.Parameter]:
    """Set ``model`` up as ``config`` trains it (scope, frozen batch norm); return its trainable parameters.

    Call it before :func:`edgetorch.plan_memory` so the plan measures the model as it will train.
    """
    params = set_scope(model, config.scope)
    if config.freeze_batchnorm:
        freeze_batchnorm(model)  # after set_scope, which would turn the affine back on
        params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError(f"scope {config.scope!r} with freeze_batchnorm leaves nothing to train")
    return params


def finetune(model: nn.Module, train: Dataset, val: Dataset, config: FinetuneConfig, out: str | Path | None = None,
             *, metadata: dict[str, Any] | None = None, on_progress: ProgressFn | None = None) -> FinetuneResult:
    """Fine-tune ``model`` on ``train``, validating on ``val`` after every epoch.

    Args:
        model: the model (on the device to train on); :func:`prepare` is applied to it.
        train: ``(image, label)`` samples.
        val: validation samples.
        config: the run's :class:`FinetuneConfig`.
        out: a directory for checkpoints, the log and the final weights; a run with the same
            ``out`` and config resumes. A finished run there whose config differs only in fewer
            ``epochs`` is extended: trained on from its checkpoint (optimizer state included)
            with the batch order an uninterrupted run of ``epochs`` would have; a cosine schedule
            starts again from ``lr`` over the added epochs (a warm restart, as in SGDR,
            Loshchilov & Hutter 2017), so only a constant schedule ends where a run of
            ``epochs`` from the start would. ``None``: nothing is written.
        metadata: extra fields for ``model.json`` and ``log.json`` (e.g. the model spec, classes).
        on_progress: called with ``{"event": "step", "epoch", "step", "steps", "loss",
            "images_per_second"}`` after each step and ``{"event": "epoch", **record}`` after
            each epoch (a progress display).

    Returns:
        A :class:`FinetuneResult`.

    Raises:
        CheckpointError: ``out`` holds a checkpoint of another config, or damaged files.

    Example:
        >>> config = FinetuneConfig(policy="backrazor:sparsity=0.9", scope="full", epochs=2)  # doctest: +SKIP
        >>> result = finetune(model, data.train, data.val, config, "runs/cats")  # doctest: +SKIP
    """
    device = next(model.parameters()).device
    how = parse_training_policy(config.policy)
    params = prepare(model, config)
    optimizer = _optimizer(config, params)
    loop = Loop(config.epochs, config.batch_size, config.seed, last_batch=LastBatch.FILL)
    out = Path(out) if out is not None else None
    # What a checkpoint must match to be resumed: the config, and the model and data it trains.
    # The input geometry and normalisation too: weights trained at one size must not resume at
    # another and be recorded as trained there.
    identity = {**dataclasses.asdict(config), "train_samples": len(train),
                **{k: (metadata or {}).get(k) for k in ("model", "weights", "data", "image_size", "channels",
                                                        "normalize")}}
    identity, extends = _extension(out, identity) if out is not None else (identity, None)
    restarts = identity.get("restarts", [])
    # The cosine runs from the last restart (0: the start) to the last epoch.
    steps = (config.epochs - (restarts[-1] if restarts else 0)) * loop.steps_per_epoch(len(train))
    schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
                if config.schedule == "cosine" else None)
    meta = {**(metadata or {}), "config": dataclasses.asdict(config), **({"restarts": restarts} if restarts else {})}
    watch = _Epochs(model, val, config.batch_size, device, out, meta, on_progress)

    def step(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return forward_backward(model, x, y, how, F.cross_entropy)

    model.train()
    run = train_epochs(model, train, loop, step, optimizer, schedule, watch=watch, label="finetune",
                       checkpoint=None if out is None else Checkpointing(out / "checkpoint", identity, extends))
    result = FinetuneResult(history=run.history, resumed_from=run.resumed_from, restarts=restarts,
                            peak_kind=peak_kind(device))
    # A run resumed after its last epoch trains nothing: its peak is what its epochs recorded.
    trained = run.history[run.resumed_from:] or run.history
    result.peak_bytes = max((r["peak_bytes"] for r in trained), default=0)
    result.val_accuracy = run.history[-1]["val_accuracy"] if run.history else float("nan")
    if out is not None:
        result.weights = out / "model.safetensors"
        save_weights(model, result.weights)
        best = best_epoch(run.history)
        write_json_atomically(out / "model.json", {
            **meta, "val_accuracy": result.val_accuracy,
            "best": {"epoch": best, "val_accuracy": run.history[best - 1]["val_accuracy"], "weights": "best.safetensors"}})
    result.process_peak_bytes = process_peak_bytes(device)
    return result


def saved_run(out: str | Path) -> tuple[dict[str, Any], int] | None:
    """The settings a run under ``out`` was checkpointed with and the epochs it finished, or ``None``.

    Example:
        >>> saved_run("runs/photos")  # doctest: +SKIP
        ({'policy': 'dense', 'epochs': 3, ..., 'model': 'zoo:cnn', 'image_size': 96}, 2)
    """
    from ..training.checkpoint import recorded_run

    found = recorded_run(Path(out) / "checkpoint")
    if found is None or not isinstance(found[0], dict) or type(found[1]) is not int:
        return None
    return found


def _extension(out: Path, identity: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """This run's identity given the checkpoint in ``out``, and the finished run it extends, if any.

    A run extended once records the epochs its schedule restarted after (``restarts``), so that
    the extended run resumes like any other; a finished run whose identity differs from this one
    only in fewer ``epochs`` (and its restarts) is extended by this one.
    """
    found = saved_run(out)
    if found is None:
        return identity, None
    recorded, finished = found
    restarts = recorded.get("restarts", [])
    if not (isinstance(restarts, list) and all(type(r) is int and r > 0 for r in restarts)
            and restarts == sorted(restarts) and restarts[-1:] < [identity["epochs"]]):
        return identity, None  # not what this version writes: resuming refuses it

    def rest(run: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in run.items() if k not in ("epochs", "restarts")}

    if rest(recorded) != json.loads(json.dumps(rest(identity))):
        return identity, None  # another run: resuming refuses it and says what differs
    mine = {**identity, **({"restarts": restarts} if restarts else {})}
    epochs = recorded.get("epochs")
    if isinstance(epochs, int) and finished == epochs < identity["epochs"]:
        return {**identity, "restarts": [*restarts, epochs]}, recorded
    return mine, None


def best_epoch(history: list[dict[str, Any]]) -> int:
    """The epoch (1-based) with the highest validation accuracy, the earliest among equals."""
    return max(history, key=lambda r: (r["val_accuracy"], -r["epoch"]))["epoch"]


class _Epochs(Watch):
    """Per step: the progress callback. Per epoch: the measured peak, validation, ``log.json``."""

    measures = ("peak_bytes", "val_accuracy")

    def __init__(self, model: nn.Module, val: Dataset, batch_size: int, device: torch.device, out: Path | None,
                 meta: dict[str, Any], on_progress: ProgressFn | None) -> None:
        self.model, self.val, self.batch_size, self.device = model, val, batch_size, device
        self.out, self.meta, self.on_progress = out, meta, on_progress

    def epoch_started(self, epoch: int) -> None:
        reset_peak(self.device)

    def step_done(self, epoch: int, step: int, steps: int, loss: float, images_per_second: float) -> None:
        if self.on_progress is not None:
            self.on_progress({"event": "step", "epoch": epoch, "step": step, "steps": steps, "loss": loss,
                              "images_per_second": images_per_second})

    def measure(self, record: dict[str, Any]) -> None:
        record["peak_bytes"] = peak_bytes(self.device)  # the epoch's training steps, before validation
        record["val_accuracy"] = evaluate_accuracy(self.model, self.val, batch_size=self.batch_size)

    def epoch_done(self, history: list[dict[str, Any]]) -> None:
        if self.out is not None:
            write_json_atomically(self.out / "log.json", {**self.meta, "epochs": history})
            columns = list(history[-1])
            write_text_atomically(self.out / "metrics.csv", "\n".join(
                [",".join(columns), *(",".join(str(r[c]) for c in columns) for r in history)]) + "\n")
            if best_epoch(history) == history[-1]["epoch"]:
                save_weights(self.model, self.out / "best.safetensors")
        if self.on_progress is not None:  # after the checkpoint: an interrupted display loses no epoch
            self.on_progress({"event": "epoch", **history[-1]})


def _optimizer(config: FinetuneConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    cls = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=config.lr, weight_decay=config.weight_decay)
