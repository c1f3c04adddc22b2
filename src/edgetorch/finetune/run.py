"""A fine-tuning run: config, loop, per-epoch validation and measured peak, resumable checkpoints.

The loop is the one the memory planner assumes (:func:`edgetorch.plan_memory`): gradients are
freed before each forward (``zero_grad(set_to_none=True)``), and each step is
:func:`edgetorch.activations.forward_backward` under the run's training policy, then the
optimizer's step. So a plan made for this config predicts this loop's peak.

Files under ``out`` (all written atomically; nothing here is ever unpickled):

* ``checkpoint/model.safetensors``, ``checkpoint/optimizer.safetensors`` (optimizer state
  tensors and the torch RNG) and ``checkpoint/state.json`` (epoch, config, history, the
  optimizer's parameter groups, the schedule, both files' SHA-256), after every epoch. Running
  again with the same ``out`` and config resumes after the last finished epoch and ends with the
  same weights as an uninterrupted run (batch order is a function of seed and epoch; the RNG
  that drives augmentation and dropout is restored).
* ``model.safetensors``: the final ``state_dict`` under the architecture's own names, and
  ``model.json``: what a user needs to use it (classes, input size, channels, normalisation).
* ``log.json``: the config and one record per epoch (loss, validation accuracy, throughput,
  measured peak), rewritten after every epoch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .._checks import check_choice, check_positive_int
from .._files import read_json, write_json_atomically
from ..activations import freeze_batchnorm, parse_training_policy
from ..activations.step import forward_backward
from ..measure.process import peak_bytes, peak_kind, process_peak_rss_bytes, reset_peak
from ..zoo import CheckpointError, evaluate_accuracy, load_weights, save_weights
from ..zoo.weights import file_sha256, restore_training_state
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
            images (all of them, if there are fewer).
        optimizer: ``sgd`` (with ``momentum``), ``adam`` or ``adamw``.
        lr: initial learning rate.
        momentum: SGD momentum.
        weight_decay: L2 penalty (decoupled for adamw).
        schedule: ``cosine`` (to 0 over the run, per step) or ``constant``.
        seed: the batch order and the new classifier's initialisation.
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
        process_peak_bytes: on a CPU, the process's peak resident memory since it started
            (loading, any planning, every epoch, validation and checkpoints; what a memory
            limit sees); None on a GPU, where ``peak_bytes`` is the allocator's.
        resumed_from: the epoch a checkpoint was resumed after (0: a fresh run).
        weights: the final ``model.safetensors`` (None without ``out``).
    """

    history: list[dict[str, Any]] = field(default_factory=list)
    val_accuracy: float = float("nan")
    peak_bytes: int = 0
    peak_kind: str = "peak_rss"
    process_peak_bytes: int | None = None
    resumed_from: int = 0
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
            ``out`` and config resumes. ``None``: nothing is written.
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
    total_steps = config.epochs * -(-len(train) // config.batch_size)
    schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
                if config.schedule == "cosine" else torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
    out = Path(out) if out is not None else None
    result = FinetuneResult(peak_kind=peak_kind(device))
    start_epoch = 0
    # What a checkpoint must match to be resumed: the config, and the model and data it trains.
    identity = {**dataclasses.asdict(config), "train_samples": len(train),
                **{k: (metadata or {}).get(k) for k in ("model", "weights", "data")}}
    if out is not None:
        state = _resume(out / "checkpoint", model, optimizer, schedule, identity)
        if state is not None:
            start_epoch = result.resumed_from = state["epoch"]
            result.history = state["history"]
    meta = {**(metadata or {}), "config": dataclasses.asdict(config)}
    for epoch in range(start_epoch, config.epochs):
        record = _epoch(model, train, config, how, optimizer, schedule, epoch, device, on_progress)
        record["val_accuracy"] = evaluate_accuracy(model, val, batch_size=config.batch_size)
        result.history.append(record)
        if out is not None:
            _checkpoint(out / "checkpoint", model, optimizer, schedule, identity, epoch + 1, result.history)
            write_json_atomically(out / "log.json", {**meta, "epochs": result.history})
        if on_progress is not None:  # after the checkpoint: an interrupted display loses no epoch
            on_progress({"event": "epoch", **record})
    epochs_run = result.history[start_epoch:]
    result.peak_bytes = max((r["peak_bytes"] for r in epochs_run), default=0)
    result.val_accuracy = result.history[-1]["val_accuracy"] if result.history else float("nan")
    if out is not None:
        result.weights = out / "model.safetensors"
        save_weights(model, result.weights)
        write_json_atomically(out / "model.json", {**meta, "val_accuracy": result.val_accuracy})
    if device.type != "cuda":
        result.process_peak_bytes = process_peak_rss_bytes()
    return result


def _optimizer(config: FinetuneConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    cls = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=config.lr, weight_decay=config.weight_decay)


def _epoch(model: nn.Module, train: Dataset, config: FinetuneConfig, how, optimizer, schedule, epoch: int,
           device: torch.device, on_progress: ProgressFn | None) -> dict[str, Any]:
    loader = DataLoader(train, batch_size=config.batch_size, sampler=_epoch_order(len(train), config, epoch))
    model.train()
    reset_peak(device)
    start = time.perf_counter()
    losses, seen = [], 0
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(model, x, y, how, F.cross_entropy)
        optimizer.step()
        schedule.step()
        losses.append(float(loss))
        seen += len(y)
        if on_progress is not None:
            on_progress({"event": "step", "epoch": epoch + 1, "step": step + 1, "steps": len(loader),
                         "loss": losses[-1], "images_per_second": seen / (time.perf_counter() - start)})
    optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    return {"epoch": epoch + 1, "train_loss": sum(losses) / max(len(losses), 1), "seconds": seconds,
            "images_per_second": seen / seconds, "peak_bytes": peak_bytes(device)}


def _epoch_order(count: int, config: FinetuneConfig, epoch: int) -> list[int]:
    """Every sample once in a seeded shuffle, then the first few again to fill the last batch.

    So no sample is left out of an epoch, and every step has a full batch (as the memory plan
    measured, and never a batch norm's batch of one). Dropping the last partial batch instead
    left a different few images unseen each epoch, all of them in a one-epoch run, and an
    unreadable image among them went unnoticed. The order depends on the seed and the epoch
    only, so a resumed run sees the same batches.
    """
    order = torch.randperm(count, generator=torch.Generator().manual_seed(config.seed * 1_000_003 + epoch)).tolist()
    if count > config.batch_size:
        order += order[: -count % config.batch_size]
    return order


def _checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, schedule,
                identity: dict[str, Any], epoch: int, history: list[dict[str, Any]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    opt = optimizer.state_dict()
    tensors = {f"state.{index}.{name}": value.detach().cpu().contiguous()
               for index, entries in opt["state"].items() for name, value in entries.items()}
    tensors["rng.torch"] = torch.get_rng_state()
    tmp = directory / f".optimizer.safetensors.{os.getpid()}.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, directory / "optimizer.safetensors")
    # state.json is written last: it names the files of a finished epoch, so a run killed while
    # writing resumes from the previous epoch's consistent set.
    write_json_atomically(directory / "state.json", {
        "epoch": epoch, "run": identity, "history": history,
        "param_groups": opt["param_groups"], "schedule": schedule.state_dict(),
        "sha256": {"model.safetensors": save_weights(model, directory / "model.safetensors"),
                   "optimizer.safetensors": file_sha256(directory / "optimizer.safetensors")}})


def _resume(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, schedule,
            identity: dict[str, Any]) -> dict[str, Any] | None:
    state_path = directory / "state.json"
    if not state_path.is_file():
        return None
    state = read_json(state_path, error=CheckpointError)
    try:
        if not isinstance(state, dict) or set(state) != _STATE_KEYS:
            raise ValueError(f"expected an object with exactly the keys {sorted(_STATE_KEYS)}")
        recorded, epoch, digests, history = state["run"], state["epoch"], state["sha256"], state["history"]
        if not isinstance(recorded, dict) or not isinstance(digests, dict):
            raise ValueError("'run' and 'sha256' must be objects")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 1 <= epoch <= identity["epochs"]:
            raise ValueError(f"epoch must be an int in [1, {identity['epochs']}], got {epoch!r}")
        _check_history(history, epoch)
    except ValueError as exc:
        raise CheckpointError(f"{state_path}: not a checkpoint state this version wrote ({exc}); delete "
                              f"{directory} to start over") from None
    if recorded != identity:
        changed = ", ".join(f"{k}: {recorded.get(k)!r} -> {v!r}" for k, v in identity.items() if recorded.get(k) != v)
        raise CheckpointError(f"{directory} holds a checkpoint of another run ({changed}); give another output "
                              "directory, or delete it to start over")
    for name in ("model.safetensors", "optimizer.safetensors"):
        path = directory / name
        if not path.is_file() or file_sha256(path) != digests.get(name):
            raise CheckpointError(f"{path} is missing or differs from the SHA-256 in {state_path}; delete "
                                  f"{directory} to start over")
    load_weights(model, directory / "model.safetensors")
    try:
        tensors = load_file(str(directory / "optimizer.safetensors"))  # its SHA-256 was checked above
        rng = tensors.pop("rng.torch")
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            _, index, name = key.split(".", 2)
            per_param.setdefault(int(index), {})[name] = value
    except (SafetensorError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{directory}: optimizer.safetensors is not what this version writes ({exc!r}); "
                              f"delete {directory} to start over") from None
    restore_training_state(optimizer, schedule, {"state": per_param, "param_groups": state["param_groups"]},
                           state["schedule"], str(state_path))
    torch.set_rng_state(rng)
    return {"epoch": epoch, "history": history}


_STATE_KEYS = frozenset({"epoch", "run", "history", "param_groups", "schedule", "sha256"})
_HISTORY_NUMBERS = ("train_loss", "seconds", "images_per_second", "val_accuracy")


def _check_history(history: object, epochs: int) -> None:
    """Raise ValueError unless ``history`` is the per-epoch records :func:`_epoch` writes, one per epoch."""
    if not isinstance(history, list) or len(history) != epochs:
        raise ValueError(f"history must be a list of {epochs} epoch records")
    for number, record in enumerate(history, 1):
        if not isinstance(record, dict) or set(record) != {"epoch", "peak_bytes", *_HISTORY_NUMBERS}:
            raise ValueError(f"history record {number} must have exactly the keys epoch, peak_bytes, "
                             f"{', '.join(_HISTORY_NUMBERS)}")
        if record["epoch"] != number or type(record["epoch"]) is not int:
            raise ValueError(f"history record {number} says epoch {record['epoch']!r}")
        if type(record["peak_bytes"]) is not int or not all(
                type(record[k]) in (int, float) for k in _HISTORY_NUMBERS):  # NaN allowed: a diverged loss
            raise ValueError(f"history record {number} must hold numbers, got {record}"[:300])
