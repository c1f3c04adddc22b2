"""``edgetorch finetune`` as a library call: a :class:`FinetuneJob` in, a :class:`FinetuneRun` out.

The job builds the model (:func:`~edgetorch.finetune.start_model`), loads the images
(:func:`~edgetorch.data.image_data`), gives the model a classifier for their classes, with a
memory budget measures the candidate policies and batch sizes (:func:`~edgetorch.plan_memory`) and
takes the plan's choice, then trains (:func:`~edgetorch.finetune.finetune`). The CLI parses
arguments into a job and renders the run through the hooks; a Python caller gets the same numbers
as fields, and the same summary dict the CLI writes with ``--json``.

Example:
    >>> run = run_finetune(FinetuneJob(model="zoo:mlp", data="digits", epochs=1, limit=200))  # doctest: +SKIP
    >>> run.result.val_accuracy > 0.9  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._checks import check_device, check_positive_int
from .._status import Notice, Status
from ..activations import MemoryPlan, parse_bytes, parse_training_policy, plan_memory
from ..activations.budget import DEFAULT_POLICIES
from ..data import ImageData, image_data
from ..errors import EdgetorchError
from ..training.rng import seeded
from ..zoo import input_channels
from .model import replace_classifier, start_model
from .run import FinetuneConfig, FinetuneResult, ProgressFn, finetune, prepare



class NothingFits(EdgetorchError, RuntimeError):
    """A memory budget that no candidate policy and batch size is predicted (or measured) to fit.

    Attributes:
        plan: the planner's :class:`~edgetorch.activations.MemoryPlan` (every candidate, and the
            reason, which says what to change).
    """

    def __init__(self, plan: MemoryPlan) -> None:
        super().__init__(plan.reason)
        self.plan = plan


@dataclass(frozen=True)
class FinetuneJob:
    """One fine-tuning run, as ``edgetorch finetune`` takes it (each field is the flag of the same name).

    Args:
        model: ``torchvision:NAME``, ``zoo:NAME`` or ``pkg.module:factory`` (imports that module).
        data: an image folder (one subfolder per class), a ``path,label`` CSV, or a built-in:
            ``digits``, ``fashion-mnist``.
        weights: local weights of ``model`` with their own classifier; default: zoo models start
            pretrained on digits, others from scratch.
        out: directory for ``model.safetensors``, ``model.json``, ``log.json`` and ``checkpoint/``
            (an existing run with the same settings resumes); None: nothing is written.
        policy: training policy specs. Without ``memory_budget`` at most one (default ``dense``);
            with it, the candidates (default: the planner's).
        memory_budget: e.g. ``"600MiB"`` (or bytes): plan first, and train with the safest candidate whose
            predicted peak fits.
        scope: what trains: ``full``, ``last``, ``norm+last``, ``bias``.
        freeze_batchnorm: batch norm on its running statistics, its affine frozen.
        epochs: passes over the training images.
        batch: batch size (with ``memory_budget``: the largest tried).
        min_batch: with ``memory_budget``: the smallest batch tried.
        optimizer: ``sgd`` (momentum 0.9), ``adam``, ``adamw``.
        lr: initial learning rate.
        weight_decay: L2 penalty (decoupled for adamw).
        schedule: ``cosine`` or ``constant``.
        seed: the batch order, the validation split, the new classifier and every other draw of
            the run (see :func:`run_finetune`).
        size: image height and width; None: 28 for zoo models, else 224.
        val_fraction: a folder's share of each class held out for validation, in (0, 1).
        limit: built-in datasets: use the first N training (and test) images.
        skip_bad_images: a folder: leave out (and list) unreadable images instead of refusing.
        device: ``cpu``, ``cuda`` or ``cuda:N``, one this machine has (checked when the job is made).

    Raises:
        ValueError: a field out of range or an unknown word (the message says what is accepted).
    """

    model: str
    data: str | Path
    weights: str | Path | None = None
    out: str | Path | None = None
    policy: tuple[str, ...] = ()
    memory_budget: str | int | None = None
    scope: str = "full"
    freeze_batchnorm: bool = False
    epochs: int = 3
    batch: int = 32
    min_batch: int = 8
    optimizer: str = "sgd"
    lr: float = 0.01
    weight_decay: float = 0.0
    schedule: str = "cosine"
    seed: int = 0
    size: int | None = None
    val_fraction: float = 0.2
    limit: int | None = None
    skip_bad_images: bool = False
    device: str = "cpu"

    def __post_init__(self) -> None:
        # One spec given as a string is one policy, not a tuple of its letters.
        object.__setattr__(self, "policy", (self.policy,) if isinstance(self.policy, str) else tuple(self.policy))
        for spec in self.policy:
            parse_training_policy(spec)
        # The messages name the flags: the CLI shows them as they are.
        if self.memory_budget is None and len(self.policy) > 1:
            raise ValueError("several --policy values are candidates for --memory-budget; without a budget give one")
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)
        self.config  # built to run its own checks: scope, optimizer, schedule, epochs, batch, lr
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        check_positive_int("min_batch", self.min_batch)
        for name in ("size", "limit"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_device(self.device)

    @property
    def config(self) -> FinetuneConfig:
        """The loop's config before any plan: the one policy (default dense) at ``batch``."""
        return FinetuneConfig(policy=self.policy[0] if self.policy else "dense", scope=self.scope,
                              freeze_batchnorm=self.freeze_batchnorm, epochs=self.epochs, batch_size=self.batch,
                              optimizer=self.optimizer, lr=self.lr, weight_decay=self.weight_decay,
                              schedule=self.schedule, seed=self.seed)

    @property
    def image_size(self) -> int:
        """``size``, or its default: 28 for zoo models (their digits pretraining), else 224."""
        return self.size or (28 if self.model.startswith("zoo:") else 224)


@dataclass
class FinetuneRun:
    """What a :class:`FinetuneJob` built, planned and trained.

    The hooks of :func:`run_finetune` see it before training, with ``result`` still None.

    Attributes:
        job: the job.
        origin: one line on where the model's weights came from (and whether its classifier is new).
        data: the train and validation images, their classes and normalisation.
        image_size: the height and width the images were resized to.
        channels: the input channels the model takes.
        model: the network (on the job's device), trained in place.
        config: the loop's config: the job's, or with the plan's policy and batch.
        plan: the memory planner's measurements and choice (None without a budget).
        result: the training run (None until it trained).
    """

    job: FinetuneJob
    origin: str
    data: ImageData
    image_size: int
    channels: int
    model: nn.Module
    config: FinetuneConfig
    plan: MemoryPlan | None = None
    result: FinetuneResult | None = None

    @property
    def metadata(self) -> dict[str, Any]:
        """What ``model.json`` and ``log.json`` record about the model and its data."""
        job, data = self.job, self.data
        return {"model": job.model, "weights": str(job.weights) if job.weights else None, "origin": self.origin,
                "data": data.description, "classes": data.classes, "num_classes": len(data.classes),
                "image_size": self.image_size, "channels": self.channels, "normalize": data.normalize,
                # The folder's split (with config's seed): `reduce` measures accuracy on the same held-out images.
                "val_fraction": job.val_fraction, "preprocessing": data.preprocessing,
                "skipped_images": [why for _, why in data.skipped]}

    @property
    def within_budget(self) -> bool | None:
        """Whether the measured peaks (training, and the whole process) stayed within the budget;
        None without a plan."""
        if self.plan is None or self.result is None:
            return None
        return max(self.result.peak_bytes, self.result.process_peak_bytes or 0) <= self.plan.budget_bytes

    @property
    def prediction_error(self) -> float | None:
        """The chosen candidate's predicted peak over the measured one, minus 1; None without a plan."""
        if self.plan is None or self.result is None or not self.result.peak_bytes:
            return None
        return self.plan.chosen.predicted_peak_bytes / self.result.peak_bytes - 1

    def summary(self) -> dict[str, Any]:
        """The JSON summary ``edgetorch finetune --json`` writes."""
        result, plan = self.result, self.plan
        out = {**self.metadata, "config": dataclasses.asdict(self.config), "history": result.history,
               "val_accuracy": result.val_accuracy, "peak_bytes": result.peak_bytes, "peak_kind": result.peak_kind,
               "process_peak_bytes": result.process_peak_bytes, "resumed_from_epoch": result.resumed_from,
               "weights_file": str(result.weights) if result.weights is not None else None}
        if plan is not None:
            out["plan"] = {
                "budget_bytes": plan.budget_bytes,
                "chosen": dataclasses.asdict(plan.chosen) if plan.chosen else None, "reason": plan.reason,
                "held_bytes": plan.held_bytes, "memory_kind": plan.memory_kind,
                "calibration_batches": plan.calibration_batches,
                "candidates": [dataclasses.asdict(c) for c in plan.candidates],
                "measured_peak_bytes": result.peak_bytes, "within_budget": self.within_budget,
                "prediction_error": self.prediction_error}
        return out


RunHook = Callable[[FinetuneRun], None]


def run_finetune(job: FinetuneJob, *, on_loaded: RunHook | None = None,
                 on_plan: Callable[[MemoryPlan], None] | None = None, on_training: RunHook | None = None,
                 on_progress: ProgressFn | None = None, status: Status = contextlib.nullcontext,
                 notice: Notice | None = None) -> FinetuneRun:
    """Run ``job``: build, load, plan (with a budget) and train (see the module docstring).

    torch's global RNG is seeded with ``job.seed`` for the run and restored afterwards: the
    caller's stream is neither advanced nor reset, and a job draws the same numbers (a random
    initialisation, the new classifier, dropout) whatever ran before it in the process.

    Args:
        job: what to fine-tune, on what, and how.
        on_loaded: called once the model is built (on its device) and the images are loaded.
        on_plan: called with the memory plan, before training (or before :class:`NothingFits`).
        on_training: called just before training, with ``run.config`` final.
        on_progress: the loop's per-step and per-epoch events (see :func:`~edgetorch.finetune.finetune`).
        status: shows a line while the planner measures (the CLI's spinner; default: nothing).
        notice: told when a zoo model is pretrained on first use, and its time left.

    Returns:
        A :class:`FinetuneRun`; its ``model`` is trained, its weights written under ``job.out``.

    Raises:
        ValueError, TypeError, ImportError: a model spec, weights or data source that cannot be
            used (messages say why; weights and image files raise subclasses of
            :class:`~edgetorch.InputFileError`), raised before ``on_loaded``.
        NothingFits: with a budget, no candidate fits it.
        ImageFolderError: a damaged image found when decoded, while planning or training.
        CheckpointError: ``job.out`` holds a checkpoint of another run, or damaged files.
        TrainingDiverged: the loss became NaN.

    Example:
        >>> job = FinetuneJob(model="zoo:cnn", data="photos", memory_budget="600MiB", out="runs/photos")  # doctest: +SKIP
        >>> run = run_finetune(job, on_plan=lambda plan: print(plan.reason))  # doctest: +SKIP
        >>> run.config.policy, run.within_budget  # doctest: +SKIP
        ('dense', True)
    """
    # The run draws in the order the command always has (a random initialisation, the new
    # classifier, the planner's first-batch loader, then dropout), so a job trains to the weights
    # the command did when it seeded the process's RNG.
    with seeded(job.seed, job.device):
        return _run(job, on_loaded, on_plan, on_training, on_progress, status, notice)


def _run(job: FinetuneJob, on_loaded: RunHook | None, on_plan: Callable[[MemoryPlan], None] | None,
         on_training: RunHook | None, on_progress: ProgressFn | None, status: Status,
         notice: Notice | None) -> FinetuneRun:
    net, origin = start_model(job.model, None, job.weights, notice=notice)
    size = job.image_size
    images = image_data(job.data, size=size, channels=input_channels(net), val_fraction=job.val_fraction,
                        seed=job.seed, limit=job.limit, skip_bad_images=job.skip_bad_images)
    if replace_classifier(net, len(images.classes)):
        origin += f"; new {len(images.classes)}-class classifier"
    net = net.to(job.device)
    run = FinetuneRun(job=job, origin=origin, data=images, image_size=size, channels=input_channels(net), model=net,
                      config=job.config)
    if on_loaded is not None:
        on_loaded(run)
    if job.memory_budget is not None:
        run.plan = _plan(run, status)
        if on_plan is not None:
            on_plan(run.plan)
        if run.plan.chosen is None:
            raise NothingFits(run.plan)
        run.config = dataclasses.replace(run.config, policy=run.plan.chosen.policy, batch_size=run.plan.chosen.batch)
    if on_training is not None:
        on_training(run)
    run.result = finetune(net, images.train, images.val, run.config, job.out, metadata=run.metadata,
                          on_progress=on_progress)
    return run


def _plan(run: FinetuneRun, status: Status) -> MemoryPlan:
    """Measure the job's candidate policies on a first batch of its training images, as the model will train."""
    job, config = run.job, run.config
    prepare(run.model, config)
    # The loader draws its base seed from the seeded global RNG, as the command always did: the
    # dropout draws after it, and so the trained weights, depend on that draw.
    x, y = next(iter(torch.utils.data.DataLoader(run.data.train, batch_size=min(job.batch, len(run.data.train)))))
    policies = job.policy or DEFAULT_POLICIES
    with status(f"measuring {len(policies)} candidate policies (two small steps each) against {job.memory_budget}"):
        # Given policies are the whole choice; by default a plan of one form per block is fitted
        # too, where no exact policy fits at the batch asked for (plan_memory says when it is used).
        return plan_memory(run.model, (x.to(job.device), y.to(job.device)), parse_bytes(job.memory_budget),
                           policies=policies, optimizer=config.planner_optimizer, weight_decay=job.weight_decay,
                           min_batch=job.min_batch, per_block=not job.policy)

