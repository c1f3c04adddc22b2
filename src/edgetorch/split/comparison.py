"""BottleFit against the paper's baselines, trained side by side at one bottleneck size (Tables I/II, Fig. 5).

The rows of the paper's comparison (Matsubara et al., BottleFit):

* the baselines of Table I, one stage each from the teacher's weights: conventional training
  (cross entropy, whole student), KD (whole student), HND (encoder + decoder mimic the teacher's
  front output) and the autoencoder (Sec. IV-C: 4 conv + 4 deconv layers after the teacher's
  ``layer2``, reconstruction loss);
* BottleFit's configurations of Table II: GHND stage 1 (:data:`STAGE1_ONLY`), then stage 2 FT or
  KD with the encoder frozen ("FE") or not, trained by :func:`~edgetorch.split.train_bottlefit`,
  so the four stage-2 rows share one stage-1 checkpoint.

:func:`train_rows` trains and scores a set of them at one C; every SP2 student, baseline or
BottleFit, starts from the same seeded encoder and decoder
(:func:`~edgetorch.split.bottlefit.build_student`). A baseline trains as many epochs as
BottleFit's two stages together (the paper gives both 20 = 10 + 10). :func:`plot_accuracy_vs_bytes`
draws Fig. 5 from the rows and the file-offload scores.

Example:
    >>> rows = train_rows(teacher, train, test, 12, (*TABLE1_BASELINES, *TABLE2_VARIANTS),
    ...                   epochs=1, batch_size=64, out_dir="runs/compare")  # doctest: +SKIP
    >>> [(r.method, r.accuracy.quantized_accuracy) for r in rows]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import TensorDataset

from ..measure.plots import new_figure, save_figure
from ..training import seeded
from .bottlefit import BottleFitConfig, Log, StageRun, build_student, lr_step, run_stage, train_bottlefit
from .bottleneck import BottleneckModel, inject_autoencoder
from .evaluate import EVAL_BATCH, OffloadScore, SplitAccuracy, evaluate_split
from .train import StageConfig


@dataclass(frozen=True)
class Baseline:
    """A baseline row of Table I: one stage from the teacher's weights.

    Attributes:
        name: row label.
        loss, trainable, optimizer: the :class:`~edgetorch.split.StageConfig` fields.
        autoencoder: build the student with :func:`~edgetorch.split.inject_autoencoder` instead
            of the bottleneck at the split point.
    """

    name: str
    loss: str
    trainable: str
    optimizer: str
    autoencoder: bool = False
    family: str = "baseline"

    def stage(self, epochs: int, batch_size: int) -> StageConfig:
        """The row's single stage, with the BottleFit stages' schedule (:func:`~edgetorch.split.bottlefit.lr_step`)."""
        return StageConfig(loss=self.loss, trainable=self.trainable, epochs=epochs, optimizer=self.optimizer,
                           lr=1e-3, momentum=0.9, lr_step=lr_step(epochs), batch_size=batch_size)

    def student(self, teacher: nn.Module, channels: int, split_point: str = "sp2") -> BottleneckModel:
        """The student BottleFit starts from (same seeded layers), or the autoencoder baseline's.

        The caller's random state is left as it was.
        """
        if not self.autoencoder:
            return build_student(teacher, BottleFitConfig(channels=channels, split_point=split_point))
        device = next(teacher.parameters()).device
        with seeded(0, device):
            return inject_autoencoder(teacher, channels)  # new layers are made on the teacher's device


@dataclass(frozen=True)
class Variant:
    """A BottleFit row of Table II: the shared GHND stage 1, then ``stage2`` (None: stage 1 itself).

    Attributes:
        name: row label.
        stage2, freeze_encoder: the :class:`~edgetorch.split.BottleFitConfig` fields.
    """

    name: str
    stage2: str | None
    freeze_encoder: bool = False
    family: str = "bottlefit"

    def config(self, channels: int, epochs: int, batch_size: int, split_point: str = "sp2") -> BottleFitConfig:
        """The row's :class:`~edgetorch.split.BottleFitConfig` (learning rate 1e-3, the paper's)."""
        return BottleFitConfig(channels=channels, split_point=split_point, stage2=self.stage2,
                               freeze_encoder=self.freeze_encoder, epochs=epochs, batch_size=batch_size, lr=1e-3)


TABLE1_BASELINES = (
    Baseline("Conventional (CE)", "ce", "all", "sgd"),
    Baseline("KD", "kd", "all", "sgd"),
    Baseline("HND", "hnd", "bottleneck", "adam"),
    Baseline("Autoencoder", "hnd", "bottleneck", "adam", autoencoder=True),
)
STAGE1_ONLY = Variant("GHND (stage 1 only)", None)
TABLE2_VARIANTS = (
    Variant("GHND -> FT (FE)", "ft", freeze_encoder=True),
    Variant("GHND -> KD (FE)", "kd", freeze_encoder=True),
    Variant("GHND -> FT", "ft"),
    Variant("GHND -> KD", "kd"),
)


@dataclass(frozen=True)
class ComparisonRow:
    """One trained and scored row of :func:`train_rows`.

    Attributes:
        method: the row's label; family: ``"baseline"`` or ``"bottlefit"``.
        channels: bottleneck channels C.
        accuracy: float and 8-bit accuracy and the bytes one image sends (:func:`~edgetorch.split.evaluate_split`).
        stage: the row's (last) training stage.
        stage1_seconds: a stage-2 row's shared stage 1 training time; else None.
    """

    method: str
    family: str
    channels: int
    accuracy: SplitAccuracy
    stage: StageRun
    stage1_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The row as plain JSON data: ``method``, ``family``, ``channels``, the accuracy's fields,
        then ``loss_history``, ``train_seconds``, ``seconds_this_run``, ``config`` and, for a
        stage-2 row, ``stage1_train_seconds``."""
        record = {"method": self.method, "family": self.family, "channels": self.channels,
                  **dataclasses.asdict(self.accuracy), "loss_history": self.stage.loss_history,
                  "train_seconds": self.stage.seconds, "seconds_this_run": self.stage.seconds_this_run,
                  "config": dataclasses.asdict(self.stage.config)}
        if self.stage1_seconds is not None:
            record["stage1_train_seconds"] = self.stage1_seconds
        return record


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")


def train_rows(teacher: nn.Module, train: TensorDataset, test: TensorDataset, channels: int,
               methods: Sequence[Baseline | Variant], epochs: int, batch_size: int, out_dir: str | Path,
               split_point: str = "sp2", log: Log | None = None) -> list[ComparisonRow]:  # fmt: skip
    """Train and score ``methods`` (baselines and/or stage-2 variants) at one C.

    Baselines come first, each in its own checkpoint directory under ``out_dir/C{channels}``; then,
    if any variant is asked for, :data:`STAGE1_ONLY` (its checkpoint is the one every stage-2
    variant starts from) and the variants. Every stage resumes from its checkpoint.

    Args:
        teacher: the trained teacher (never changed); students are built on its device.
        train: training images and labels (as the teacher takes them).
        test: the images the rows are scored on.
        channels: bottleneck channels C.
        methods: the rows, e.g. ``(*TABLE1_BASELINES, *TABLE2_VARIANTS)``.
        epochs: per BottleFit stage; a baseline trains ``2 * epochs``.
        batch_size: samples per training step.
        out_dir: the checkpoint root; use one per teacher and training data.
        split_point: where the (non-autoencoder) bottleneck goes.
        log: called with a progress line (prefixed ``C=channels``) per stage and per scored row.

    Returns:
        One :class:`ComparisonRow` per baseline asked for, then, if variants were asked for, one
        for :data:`STAGE1_ONLY` and one per variant.

    Raises:
        ValueError: a bad config, or data smaller than a batch.
        CheckpointError: a stage directory holds a checkpoint of another config or model.
        FloatingPointError: a loss became inf or NaN.
    """
    say = log or (lambda line: None)

    def at_c(line: str) -> None:
        say(f"C={channels} {line}")

    rows = []

    def record(method: Baseline | Variant, model: BottleneckModel, stage: StageRun, stage1: float | None) -> None:
        row = ComparisonRow(method.name, method.family, channels, evaluate_split(model, test, batch_size=EVAL_BATCH),
                            stage, stage1)  # fmt: skip
        rows.append(row)
        a = row.accuracy
        at_c(f"{method.name}: float {100 * a.float_accuracy:.2f}%, 8-bit {100 * a.quantized_accuracy:.2f}%, "
             f"{a.payload_bytes} B")

    base = Path(out_dir) / f"C{channels}"
    for method in (m for m in methods if isinstance(m, Baseline)):
        student = method.student(teacher, channels, split_point)
        stage = run_stage(student, train, method.stage(2 * epochs, batch_size), teacher, base / _slug(method.name),
                          progress=False, log=at_c)  # fmt: skip
        record(method, student, stage, None)
    variants = [m for m in methods if isinstance(m, Variant)]
    # Stage 1 alone first: it trains the checkpoint every stage-2 variant then starts from.
    for variant in [STAGE1_ONLY, *variants] if variants else []:
        run = train_bottlefit(teacher, train, variant.config(channels, epochs, batch_size, split_point), base,
                              progress=False, log=at_c)  # fmt: skip
        record(variant, run.student, run.stages[-1], run.stages[0].seconds if variant.stage2 is not None else None)
    return rows


@dataclass(frozen=True)
class PaperClaims:
    """The paper's claims at one C, read off the rows (8-bit accuracies; ``_points`` are differences x 100).

    The paper (ImageNet, 10 + 10 epochs) reports every BottleFit configuration above the best
    baseline, KD above conventional training, HND best at C = 12 and worst at C = 3, the
    autoencoder below the baselines, and 8-bit quantisation costing no accuracy.

    Attributes:
        best_baseline, best_baseline_accuracy: the best Table I row but the autoencoder.
        bottlefit_min, bottlefit_max: the range of the four Table II rows.
        deployed_gain_points: the deployed row over the best baseline.
        kd_minus_ce_points, hnd_minus_kd_points: KD over conventional, HND over KD.
        autoencoder_minus_best_baseline_points: the autoencoder over the best baseline.
        max_quantization_change_points: the largest |8-bit - float| of any row at this C.
    """

    best_baseline: str
    best_baseline_accuracy: float
    bottlefit_min: float
    bottlefit_max: float
    deployed_gain_points: float
    kd_minus_ce_points: float
    hnd_minus_kd_points: float
    autoencoder_minus_best_baseline_points: float
    max_quantization_change_points: float


def paper_claims(rows: Sequence[ComparisonRow], channels: int, deployed: str) -> PaperClaims:
    """Check the paper's claims at C = ``channels``: BottleFit (Table II) against the best baseline (Table I).

    Args:
        rows: the rows of :func:`train_rows`, with every Table I and Table II row at this C.
        channels: the C to read.
        deployed: the row whose gain over the best baseline is reported.

    Returns:
        The :class:`PaperClaims`.

    Raises:
        KeyError: a row of Table I or II is missing at this C.
    """
    at_c = {r.method: r.accuracy for r in rows if r.channels == channels}
    q = {name: a.quantized_accuracy for name, a in at_c.items()}
    base = max((m.name for m in TABLE1_BASELINES if not m.autoencoder), key=lambda name: q[name])
    bf = [q[v.name] for v in TABLE2_VARIANTS]
    return PaperClaims(base, q[base], min(bf), max(bf), 100 * (q[deployed] - q[base]),
                       100 * (q["KD"] - q["Conventional (CE)"]), 100 * (q["HND"] - q["KD"]),
                       100 * (q["Autoencoder"] - q[base]),
                       max(abs(100 * (a.quantized_accuracy - a.float_accuracy)) for a in at_c.values()))


def plot_accuracy_vs_bytes(rows: Sequence[ComparisonRow], files: dict[str, OffloadScore], teacher_accuracy: float,
                           path: str | Path, deployed: str, channels: Sequence[int], title: str) -> Path:  # fmt: skip
    """Fig. 5: accuracy against the bytes sent per image, split rows beside full offload of the image file.

    Args:
        rows: the trained rows (:func:`train_rows`), every C.
        files: the teacher on files (:func:`~edgetorch.split.file_offload`): ``"png"`` and ``"jpegQ"`` keys.
        teacher_accuracy: drawn as a dotted line (the teacher on lossless input).
        path: the image to write.
        deployed: the row drawn as a curve over every C (float32 and 8-bit).
        channels: the C whose best Table II row, best baseline and autoencoder are marked.
        title: the axes' title.

    Returns:
        The path written.
    """
    from matplotlib.ticker import FuncFormatter, NullFormatter

    def point(r: ComparisonRow) -> tuple[int, float]:
        return r.accuracy.payload_bytes, 100 * r.accuracy.quantized_accuracy

    fig, ax = new_figure((8, 5))
    line = sorted((r for r in rows if r.method == deployed), key=lambda r: r.accuracy.payload_bytes)
    ax.plot([r.accuracy.float32_bytes for r in line], [100 * r.accuracy.float_accuracy for r in line], "o--",
            color="tab:blue", alpha=0.6, label=f"BottleFit {deployed}, float32 bottleneck")
    ax.plot([point(r)[0] for r in line], [point(r)[1] for r in line], "o-", color="tab:blue",
            label=f"BottleFit {deployed}, 8-bit payload")
    for r in line:
        ax.annotate(f"C={r.channels}", point(r), textcoords="offset points", xytext=(4, -12), fontsize=8)
    stage2 = {v.name for v in TABLE2_VARIANTS}
    for c in channels:
        first = c == channels[0]
        top = max((r for r in rows if r.channels == c and r.method in stage2),
                  key=lambda r: r.accuracy.quantized_accuracy)
        ax.plot(*point(top), "o", mfc="none", ms=10, color="tab:blue",
                label="BottleFit, best of the four Table II rows, 8-bit" if first else None)
        ax.annotate(top.method, point(top), textcoords="offset points", xytext=(-30, 8), fontsize=7, color="tab:blue")
        best = max((r for r in rows if r.channels == c and r.family == "baseline" and r.method != "Autoencoder"),
                   key=lambda r: r.accuracy.quantized_accuracy)
        ax.plot(*point(best), "s", color="tab:red", label="best SP2 baseline, 8-bit" if first else None)
        ax.annotate(best.method, point(best), textcoords="offset points", xytext=(4, 4), fontsize=7, color="tab:red")
        ae = next(r for r in rows if r.channels == c and r.method == "Autoencoder")
        ax.plot(*point(ae), "^", color="tab:purple", label="autoencoder baseline, 8-bit" if first else None)
        ax.annotate(f"C={c}", point(ae), textcoords="offset points", xytext=(4, 4), fontsize=7, color="tab:purple")
    jpeg = sorted((v.mean_bytes, 100 * v.accuracy, k) for k, v in files.items() if k.startswith("jpeg"))
    ax.plot([j[0] for j in jpeg], [j[1] for j in jpeg], "D-", color="tab:orange", label="offload JPEG (teacher)")
    for b, a, k in jpeg:
        ax.annotate(f"q{k[4:]}", (b, a), textcoords="offset points", xytext=(4, -10), fontsize=7, color="tab:orange")
    ax.plot(files["png"].mean_bytes, 100 * files["png"].accuracy, "*", ms=12, color="tab:green",
            label="offload PNG (teacher, lossless)")
    ax.axhline(100 * teacher_accuracy, color="gray", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xticks([t for t in (25, 50, 100, 200, 400, 800, 1600) if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]])
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("bytes transferred per image (log)")
    ax.set_ylabel("test accuracy, %")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    return save_figure(fig, path)
