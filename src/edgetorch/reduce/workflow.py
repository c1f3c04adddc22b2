"""``edgetorch reduce`` as a library call: a :class:`ReduceJob` in, a :class:`ReduceRun` out.

The job loads a trained network (a zoo model, pretrained here on first use, or any model spec with
its weights), takes calibration samples from a dataset's training split, reduces the network to
the multiplication budget (:func:`~edgetorch.reduce.reduce_model`), counts MACs, optionally
evaluates and fine-tunes, and measures the CPU latency of both networks. The CLI parses arguments
into a job and renders the run; a Python caller gets the same numbers as fields, and the same
summary dict the CLI writes with ``--json``.

Example:
    >>> run = run_reduction(ReduceJob(model="zoo:mlp", alpha=0.6, dataset="digits", size=8))  # doctest: +SKIP
    >>> run.macs_reduced / run.macs_full <= 0.4  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from .._status import Notice, Status
from .api import Reduction, reduce_model
from .finetuned import load_finetuned
from .latency import LatencyComparison, compare_latency
from .macs import count_macs
from .recover import RecoverConfig, RecoverHistory, recover
from .transformer import count_transformer_macs
from .transformer_blocks import is_transformer



@dataclass(frozen=True)
class ReduceJob:
    """One reduction, as ``edgetorch reduce`` takes it (each field is the flag of the same name).

    Args:
        model: ``zoo:NAME``, ``torchvision:resnet18`` / ``torchvision:mobilenet_v2`` (pretrained on
            ``dataset`` unless ``weights``), or any model spec with ``weights``.
        alpha: total reduction factor in [0, 1): the share of multiplications removed.
        weights: safetensors / state-dict weights of ``model``.
        method: ``prune`` (the paper's), ``prune-ls`` (correlation-aware) or ``lowrank``.
        allocation: ``optimal`` (exact), ``pso`` (the paper's) or ``uniform``.
        dataset: ``digits`` or ``fashion-mnist`` (calibration samples from the train split,
            accuracy on the test split), or an image folder with ``weights`` fine-tuned on it
            (:func:`~edgetorch.reduce.finetuned.load_finetuned`: accuracy on the share
            fine-tuning held out).
        size: image size the model takes.
        calibration: unlabeled calibration samples (pruning).
        accuracy: evaluate full and reduced accuracy on the test labels.
        latency_batch: batch size of the CPU latency comparison.
        seed: PSO seed, and the fine-tune's batch order.
        prune_input: pruning a chain, also drop input features of its first layer.
        finetune_epochs: fine-tune the reduced model this many epochs (0: the paper's setting).
        finetune_lr: peak learning rate of the fine-tune (AdamW, one-cycle).
        distill: fine-tune against the full model's outputs too (needs ``finetune_epochs``).
    """

    model: str
    alpha: float
    weights: Path | None = None
    method: str = "prune"
    allocation: str = "optimal"
    dataset: str = "digits"
    size: int = 28
    calibration: int = 1000
    accuracy: bool = True
    latency_batch: int = 64
    seed: int = 0
    prune_input: bool = False
    finetune_epochs: int = 0
    finetune_lr: float = 1e-3
    distill: bool = False

    def __post_init__(self) -> None:
        if self.distill and self.finetune_epochs == 0:
            raise ValueError("distill fine-tunes from the full model: give finetune_epochs of 1 or more")
        if not self.finetune_lr > 0:
            raise ValueError(f"{self.finetune_lr} is not a learning rate: give a number > 0")


@dataclass
class ReduceRun:
    """What a :class:`ReduceJob` produced and measured.

    Attributes:
        job: the job.
        full: the network as loaded (eval mode).
        reduction: :func:`~edgetorch.reduce.reduce_model`'s result; its ``model`` is fine-tuned in
            place when the job fine-tunes.
        macs_full, macs_reduced: multiply-accumulates per sample (a transformer's attention products
            included).
        accuracy_full, accuracy_reduced: test accuracy before fine-tuning (None: not evaluated).
        finetune, finetune_config: the fine-tune's history and settings (None: no fine-tuning).
        finetune_samples: training samples the fine-tune saw; test_samples: the accuracy's.
        classes, normalize, preprocessing: an image folder's class names in label order, the
            normalisation its images went through, and the whole transform as data (None for a
            built-in dataset).
        latency: the measured CPU latency comparison, on ``latency_batch`` test images.
    """

    job: ReduceJob
    full: nn.Module
    reduction: Reduction
    macs_full: int
    macs_reduced: int
    latency: LatencyComparison
    latency_batch: int
    accuracy_full: float | None = None
    accuracy_reduced: float | None = None
    finetune: RecoverHistory | None = None
    finetune_config: RecoverConfig | None = None
    finetune_samples: int = 0
    test_samples: int = 0
    classes: list[str] | None = None
    normalize: str | None = None
    preprocessing: dict | None = None

    def summary(self) -> dict[str, Any]:
        """The JSON summary ``edgetorch reduce --json`` writes (per-layer factors included)."""
        a, job = self.reduction.allocation, self.job
        out: dict[str, Any] = {
            "model": job.model, "dataset": str(job.dataset), "method": job.method, "allocation": job.allocation,
            "alpha": job.alpha, "achieved_alpha": a.alpha, "objective_J": a.objective,
            "solver_seconds": a.seconds, "proven_gap": a.proven_gap, "macs_full": self.macs_full,
            "macs_reduced": self.macs_reduced,
            "layers": [vars(f) for f in self.reduction.layers], "groups": [vars(g) for g in self.reduction.groups]}
        if self.accuracy_full is not None:
            out["accuracy_full"], out["accuracy_reduced"] = self.accuracy_full, self.accuracy_reduced
        if self.finetune is not None:
            history = self.finetune
            out["finetune"] = {**vars(self.finetune_config), "train_samples": self.finetune_samples,
                               "seconds": history.seconds, "train_loss": history.train_loss,
                               "accuracy": history.accuracy}
            if self.accuracy_full is not None:
                out["accuracy_finetuned"] = history.accuracy[-1]
        if self.classes is not None:  # what the reduced model's user needs to feed it and read it
            out |= {"classes": self.classes, "image_size": job.size, "normalize": self.normalize,
                    "preprocessing": self.preprocessing, "test_samples": self.test_samples}
        out |= {"latency_batch": self.latency_batch, "latency_full_s": self.latency.full_seconds,
                "latency_reduced_s": self.latency.reduced_seconds, "latency_ratio": self.latency.ratio}
        return out


def load_for_reduction(model: str, weights: str | Path | None, dataset: str, size: int, *,
                       notice: Notice | None = None) -> nn.Module:
    """The network a :class:`ReduceJob` reduces, in eval mode.

    Raises:
        ValueError: no weights for a model that is not pretrained here, or a size other than the
            one a pretrained model was trained at.
    """
    from ..data import dataset_info
    from ..zoo import ZOO_MODELS, build_model, pretrained
    from ..zoo.pretrain import TORCHVISION_TRAINED, default_config
    from ..zoo.registry import takes_image_size

    zoo, name = model.startswith("zoo:"), model.removeprefix("zoo:")
    if weights is None:
        if not zoo and model not in TORCHVISION_TRAINED:
            raise ValueError("--weights is required unless --model is a zoo model (zoo:NAME) or one of "
                             f"{', '.join(TORCHVISION_TRAINED)} (pretrained here on fashion-mnist)")
        trained_at = default_config(name, dataset).image_size
        if size != trained_at:
            raise ValueError(f"{model} is pretrained on {trained_at}x{trained_at} images; use --size "
                             f"{trained_at}, or give --weights of a model built for {size}x{size}")
        return pretrained(name, dataset=dataset, notice=notice).eval()
    sized = zoo and name in ZOO_MODELS and takes_image_size(name)
    return build_model(model, num_classes=dataset_info(dataset).num_classes, weights=weights,
                       **({"image_size": size} if sized else {})).eval()


def run_reduction(job: ReduceJob, status: Status = contextlib.nullcontext, notice: Notice | None = None) -> ReduceRun:
    """Run ``job``: load, reduce, count, evaluate, fine-tune and time (see the module docstring).

    Args:
        job: what to reduce and how.
        status: shows a line while each long step runs (the CLI's spinner; default: nothing).
        notice: told when a model is pretrained on first use, and its time left.

    Returns:
        A :class:`ReduceRun`; ``run.reduction.model`` is the network to save.

    Raises:
        ValueError, TypeError: a bad model, weights, dataset or size (messages say which).
        ImportError: a network that is not a chain, without Torch-Pruning.
        RuntimeError: torch refusing the data (images that do not fit the model).
    """
    # Building layers draws from torch's generator (their initial weights, then overwritten): the
    # caller's random stream is neither advanced nor reset by a reduction.
    with torch.random.fork_rng(devices=[]):
        return _run(job, status, notice)


def _run(job: ReduceJob, status: Status, notice: Notice | None) -> ReduceRun:
    from ..data import DATASETS, load_dataset
    from ..zoo import evaluate_accuracy, input_channels
    from ..zoo.registry import with_channels

    with status(f"loading {job.model} and {job.dataset}"):
        if str(job.dataset).lower().replace("_", "-") in DATASETS:
            full = load_for_reduction(job.model, job.weights, job.dataset, job.size, notice=notice)
            channels = input_channels(full)
            train = load_dataset(job.dataset, "train", size=job.size)
            test = load_dataset(job.dataset, "test", size=job.size)
            train, test = (TensorDataset(with_channels(d.tensors[0], channels), d.tensors[1]) for d in (train, test))
            folder = None
        else:  # an image folder, and the model fine-tuned on it
            folder = load_finetuned(job.model, job.weights, job.dataset, job.size)
            full, train, test = folder.model, folder.train, folder.test
    calibration = train.tensors[0][: min(job.calibration, len(train))]
    with status(f"measuring each layer's error curve on {len(calibration)} samples, then the {job.allocation} "
                "allocation"):
        reduction = reduce_model(full, job.alpha, job.method, job.allocation, calibration=calibration,
                                 seed=job.seed, prune_input=job.prune_input)
    one = test.tensors[0][:1]
    # count_macs sees weight layers only; a transformer's attention products are counted by PyTorch's counter
    count = count_transformer_macs if is_transformer(full) else count_macs
    macs_full, macs_reduced = count(full, one), count(reduction.model, one)
    accuracy_full = accuracy_reduced = None
    if job.accuracy:
        accuracy_full, accuracy_reduced = evaluate_accuracy(full, test), evaluate_accuracy(reduction.model, test)
    history = config = None
    if job.finetune_epochs:
        config = RecoverConfig(epochs=job.finetune_epochs, lr=job.finetune_lr, seed=job.seed, distill=job.distill,
                               batch_size=min(RecoverConfig.batch_size, len(train)))
        teacher = " distilling from the full model" if job.distill else ""
        with status(f"fine-tuning {job.finetune_epochs} epoch(s) on {len(train)} training samples{teacher}"):
            history = recover(reduction.model, train, config, teacher=full if job.distill else None,
                              test=test if job.accuracy else None)
    batch = test.tensors[0][: job.latency_batch]
    latency = compare_latency(full, reduction.model, batch)
    return ReduceRun(job=job, full=full, reduction=reduction, macs_full=macs_full, macs_reduced=macs_reduced,
                     latency=latency, latency_batch=len(batch), accuracy_full=accuracy_full,
                     accuracy_reduced=accuracy_reduced, finetune=history, finetune_config=config,
                     finetune_samples=len(train), test_samples=len(test),
                     classes=None if folder is None else folder.classes,
                     normalize=None if folder is None else folder.normalize,
                     preprocessing=None if folder is None else folder.preprocessing)
