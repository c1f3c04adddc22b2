"""The one checkpoint format of :func:`edgetorch.training.train_epochs`; nothing in it is unpickled.

A checkpoint directory holds, after every finished epoch (each file written atomically):

* ``model.safetensors``: the model's ``state_dict``;
* ``optimizer.safetensors``: the optimizer's per-parameter state tensors (``state.{index}.{name}``)
  and the RNG states: ``rng.cpu`` and, for a model on a GPU, ``rng.cuda``, so that dropout after a
  resume draws what an uninterrupted run would;
* ``state.json``, written last: ``format``, ``epoch``, ``run`` (the identity the caller gave: a
  checkpoint of another run is refused), ``history`` (one record per epoch), the optimizer's
  ``param_groups``, the schedule's state and both files' SHA-256. It names the files of a finished
  epoch, so a run killed while writing resumes from the previous epoch's consistent set.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .._files import read_json, write_json_atomically
from ..weights import CheckpointError, file_sha256, load_weights, save_weights

FORMAT = 2  # 1: edgetorch finetune's format before the loops were one (another batch order)
_STATE_KEYS = frozenset({"format", "epoch", "run", "history", "param_groups", "schedule", "sha256"})
_FILES = ("model.safetensors", "optimizer.safetensors")


@dataclass(frozen=True)
class Resumed:
    """What a checkpoint restored: the epochs it finished and their records."""

    epoch: int
    history: list[dict[str, Any]]


def save(directory: Path, identity: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
         schedule: torch.optim.lr_scheduler.LRScheduler, history: list[dict[str, Any]]) -> None:
    """Write the checkpoint of the epochs in ``history`` (see the module docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    opt = optimizer.state_dict()
    tensors = {f"state.{index}.{name}": value.detach().cpu().contiguous()
               for index, entries in opt["state"].items() for name, value in entries.items()}
    tensors["rng.cpu"] = torch.get_rng_state()
    device = next(model.parameters()).device
    if device.type == "cuda":
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    tmp = directory / f".optimizer.safetensors.{os.getpid()}.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, directory / "optimizer.safetensors")
    write_json_atomically(directory / "state.json", {
        "format": FORMAT, "epoch": len(history), "run": dict(identity), "history": history,
        "param_groups": opt["param_groups"], "schedule": schedule.state_dict(),
        "sha256": {"model.safetensors": save_weights(model, directory / "model.safetensors"),
                   "optimizer.safetensors": file_sha256(directory / "optimizer.safetensors")}})


def recorded_run(directory: Path) -> tuple[Any, Any] | None:
    """The ``run`` identity and finished ``epoch`` a checkpoint's ``state.json`` names, unchecked
    (:func:`resume` checks them), or ``None`` when ``directory`` holds no checkpoint."""
    state_path = directory / "state.json"
    if not state_path.is_file():
        return None
    state = read_json(state_path, error=CheckpointError)
    return (state.get("run"), state.get("epoch")) if isinstance(state, dict) else None


def resume(directory: Path, identity: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
           schedule: torch.optim.lr_scheduler.LRScheduler, epochs: int, fields: tuple[str, ...],
           extends: Mapping[str, Any] | None = None) -> Resumed | None:
    """Load the checkpoint in ``directory`` into ``model``, ``optimizer``, ``schedule`` and the RNGs.

    Args:
        directory: the checkpoint directory (``None`` is returned when it holds none).
        identity: what the checkpoint's ``run`` must equal.
        model, optimizer, schedule: made for this run, not stepped yet.
        epochs: the run's epochs (a checkpoint of more is refused).
        fields: the fields of every epoch record.
        extends: a finished run's identity that the checkpoint may name instead: this run trains
            it for more epochs. The schedule is not restored but starts again (a fresh
            ``schedule`` from the configured learning rate); everything else is.

    Returns:
        The :class:`Resumed` epochs, or ``None``.

    Raises:
        CheckpointError: a checkpoint of another run, of an earlier edgetorch, or damaged files.
    """
    identity = json.loads(json.dumps(dict(identity)))  # as state.json holds it: tuples are lists
    state_path = directory / "state.json"
    if not state_path.is_file():
        if (directory / "state.pt").is_file():
            raise CheckpointError(f"{directory} holds a checkpoint of an earlier edgetorch (state.pt), which "
                                  "visited batches in another order; delete it to start over")
        return None
    state = read_json(state_path, error=CheckpointError)
    if isinstance(state, dict) and state.get("format") != FORMAT and "run" in state:
        raise CheckpointError(f"{directory} holds a checkpoint of an earlier edgetorch (format "
                              f"{state.get('format', 1)}, another batch order); delete it to start over")
    try:
        history = state_history(state, fields)
    except ValueError as exc:
        raise CheckpointError(f"{state_path}: not a checkpoint state this version wrote ({exc}); delete "
                              f"{directory} to start over") from None
    recorded = state["run"]
    extending = extends is not None and recorded == json.loads(json.dumps(dict(extends)))
    if recorded != identity and not extending:
        raise CheckpointError(f"{directory} holds a checkpoint of another run ({_changes(recorded, identity)}); give "
                              "another directory, or delete it to start over")
    if len(history) > epochs:  # an identity that does not name the epochs
        raise CheckpointError(f"{directory} holds {len(history)} epochs, more than this run's {epochs}; give "
                              "another directory, or delete it to start over")
    for name in _FILES:
        path = directory / name
        if not path.is_file() or file_sha256(path) != state["sha256"].get(name):
            raise CheckpointError(f"{path} is missing or differs from the SHA-256 in {state_path}; delete "
                                  f"{directory} to start over")
    load_weights(model, directory / "model.safetensors")
    try:
        tensors = load_file(str(directory / "optimizer.safetensors"))  # its SHA-256 was checked above
        rng_cpu, rng_cuda = tensors.pop("rng.cpu"), tensors.pop("rng.cuda", None)
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            _, index, name = key.split(".", 2)
            per_param.setdefault(int(index), {})[name] = value
    except (SafetensorError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{directory}: optimizer.safetensors is not what this version writes ({exc!r}); "
                              f"delete {directory} to start over") from None
    restore_training_state(optimizer, schedule, {"state": per_param, "param_groups": state["param_groups"]},
                           state["schedule"], str(state_path), restart_schedule=extending)
    torch.set_rng_state(rng_cpu)
    device = next(model.parameters()).device
    if device.type == "cuda" and rng_cuda is not None:  # a CPU run resumed on a GPU had no CUDA stream to keep
        torch.cuda.set_rng_state(rng_cuda, device)
    return Resumed(state["epoch"], history)


def state_history(state: object, fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """The per-epoch records of a checkpoint's ``state.json`` contents, checked.

    Args:
        state: the parsed ``state.json``.
        fields: the fields of every record.

    Returns:
        The records.

    Raises:
        ValueError: not what :func:`save` writes.
    """
    if not isinstance(state, dict) or set(state) != _STATE_KEYS:
        raise ValueError(f"expected an object with exactly the keys {sorted(_STATE_KEYS)}")
    epoch, history = state["epoch"], state["history"]
    if not isinstance(state["run"], dict) or not isinstance(state["sha256"], dict):
        raise ValueError("'run' and 'sha256' must be objects")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
        raise ValueError(f"epoch must be a positive int, got {epoch!r}")
    if not isinstance(history, list) or len(history) != epoch:
        raise ValueError(f"history must be a list of {epoch} epoch records")
    for number, record in enumerate(history, 1):
        if not isinstance(record, dict) or set(record) != set(fields):
            raise ValueError(f"history record {number} must have exactly the keys {', '.join(fields)}")
        if record["epoch"] != number or type(record["epoch"]) is not int:
            raise ValueError(f"history record {number} says epoch {record['epoch']!r}")
        if not all(type(value) in (int, float) for value in record.values()):
            raise ValueError(f"history record {number} must hold numbers, got {record}"[:300])
    return history


def _changes(recorded: object, identity: dict[str, Any], where: str = "") -> str:
    """``name: recorded -> now`` for each field that differs, nested fields by dotted name."""
    recorded = recorded if isinstance(recorded, dict) else {}
    return ", ".join(_changes(recorded.get(k), v, f"{where}{k}.") if isinstance(v, dict) and isinstance(recorded.get(k), dict)
                     else f"{where}{k}: {recorded.get(k)!r} -> {v!r}" for k, v in identity.items() if recorded.get(k) != v)


# What a resumed optimizer or schedule may have moved since it was made: the learning rate, the
# momentum (a one-cycle schedule cycles SGD's momentum and AdamW's beta1 against the learning rate)
# and the step counters. Everything else in their state follows from the run's config, which the
# caller has already matched, so it must equal what a fresh optimizer and schedule hold.
_PROGRESS = frozenset({"lr", "betas", "momentum", "last_epoch", "_step_count", "_last_lr"})


def restore_training_state(optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LRScheduler,
                           optimizer_state: object, schedule_state: object, where: str, *,
                           restart_schedule: bool = False) -> None:
    """Load an optimizer's and a schedule's saved state, checked against fresh ones first.

    A checkpoint's state file is not covered by a hash (it holds them). Loaded unchecked, an edited
    field failed later as a traceback: a string learning rate at the first step, ``T_max`` 0 as a
    ZeroDivisionError, a momentum buffer of another shape mid-epoch.

    Args:
        optimizer, schedule: made for this run, not stepped yet.
        optimizer_state: ``{"state": {index: {name: tensor}}, "param_groups": [...]}`` as saved.
        schedule_state: the schedule's saved ``state_dict()``.
        where: names the checkpoint in errors.
        restart_schedule: leave ``schedule_state`` unread: the fresh ``schedule`` stays and the
            learning rate goes back to where it starts (``initial_lr``).

    Raises:
        CheckpointError: anything that is not what this run's optimizer and schedule save.
    """
    try:
        if not isinstance(optimizer_state, Mapping) or set(optimizer_state) != {"state", "param_groups"}:
            raise ValueError("the optimizer state needs exactly 'state' and 'param_groups'")
        _check_like(optimizer_state["param_groups"], optimizer.state_dict()["param_groups"], "param_groups")
        if not restart_schedule:
            _check_like(schedule_state, schedule.state_dict(), "schedule")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        per_param = optimizer_state["state"]
        if not isinstance(per_param, Mapping):
            raise ValueError("the optimizer's 'state' must map parameter indices to tensors")
        for index, entries in per_param.items():
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params) \
                    or not isinstance(entries, Mapping):
                raise ValueError(f"optimizer state for parameter {index!r}: no such parameter")
            for name, value in entries.items():
                if not isinstance(value, torch.Tensor) or value.dim() and value.shape != params[index].shape \
                        or not torch.isfinite(value).all():
                    raise ValueError(f"optimizer state {name!r} of parameter {index} must be a finite tensor of "
                                     f"shape {list(params[index].shape)} (or a scalar)")
        optimizer.load_state_dict(optimizer_state)
        if not restart_schedule:
            schedule.load_state_dict(schedule_state)
        else:
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"]
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: the optimizer state does not fit this run ({exc}); delete it to start "
                              "over") from None


def _check_like(value: object, fresh: object, where: str) -> None:
    """Raise ValueError unless ``value`` has ``fresh``'s structure: the same keys and lengths, the
    same values, except that :data:`_PROGRESS` fields may hold other finite numbers (JSON gives
    lists for tuples)."""
    name = where.rsplit(".", 1)[-1]
    if isinstance(fresh, Mapping):
        if not isinstance(value, Mapping) or set(value) != set(fresh):
            raise ValueError(f"{where} must have exactly the keys {sorted(fresh)}")
        for key in fresh:
            _check_like(value[key], fresh[key], f"{where}.{key}")
    elif isinstance(fresh, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(fresh):
            raise ValueError(f"{where} must be a list of {len(fresh)}")
        for k, (item, want) in enumerate(zip(value, fresh)):
            _check_like(item, want, f"{where}[{k}]" if name in _PROGRESS else where)
    elif name.split("[")[0] in _PROGRESS:
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or value < 0 or isinstance(fresh, int) and not isinstance(value, int):
            raise ValueError(f"{where} must be a finite {type(fresh).__name__} >= 0, got {value!r}")
    elif value != fresh or type(value) is not type(fresh) and not (
            isinstance(value, (int, float)) and isinstance(fresh, (int, float)) and not isinstance(value, bool)):
        raise ValueError(f"{where} is {value!r}; this run's config gives {fresh!r}")
