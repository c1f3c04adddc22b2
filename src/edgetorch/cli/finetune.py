"""``edgetorch finetune``: fine-tune a model on the user's images, under a policy or a memory budget."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..errors import EdgetorchError
from .._extras import install_hint
from ._app import app, console, device_option, mib, output_dir, output_file, plot_file, write_json

if TYPE_CHECKING:  # the command imports torch-backed modules only when it runs
    from ..activations import MemoryPlan
    from ..activations.budget_blocks import BlockFit
    from ..finetune import FinetuneRun

_POLICY_HELP = ("repeatable: dense, bitmap[:threshold=..,value_dtype=..], quantized[:bits=8], "
                "backrazor[:sparsity=0.9,exact=int8], each optionally +checkpoint. Without --memory-budget give one; "
                "with it, these are the only candidates (default: dense, bitmap, with and without +checkpoint, "
                "8- and 4-bit quantized, Back Razor at 80-97%, and a plan of one form per block)")


@app.command()
def finetune(
    model: str = typer.Option(..., help="torchvision:NAME, zoo:NAME or pkg.module:factory (imports that module: runs its code)"),
    data: str = typer.Option(..., help="an image folder (one subfolder per class), a path,label .csv, "
                                       "or a built-in: digits, fashion-mnist"),
    weights: Path = typer.Option(None, help="local weights of --model (safetensors or a state dict), with their "
                                            "own classifier, e.g. torchvision's ImageNet file; default: zoo models "
                                            "start pretrained on digits, others from scratch"),
    out: Path = typer.Option(Path("runs/finetune"), callback=output_dir,
                             help="output directory: model.safetensors, model.json, log.json, checkpoint/ "
                                  "(an existing run with the same settings resumes)"),
    policy: list[str] = typer.Option(None, help=_POLICY_HELP),
    memory_budget: str = typer.Option(None, help="e.g. 600MiB: measure every candidate policy and batch size "
                                                 "first, and train with the safest one whose predicted peak fits"),
    scope: str = typer.Option("full", help="what trains: full, last, norm+last, bias (BitFit)"),
    freeze_batchnorm: bool = typer.Option(False, "--freeze-batchnorm", "--freeze-bn", metavar="", help="batch norm frozen: running statistics, no affine "
                                                             "training (the Back Razor paper's transfer setting)"),
    epochs: int = typer.Option(3, min=1, help="passes over the training images"),
    batch_size: int = typer.Option(32, min=1, help="batch size (with --memory-budget: the largest tried)"),
    min_batch: int = typer.Option(8, min=1, help="with --memory-budget: the smallest batch tried (smaller batches "
                                                 "risk more accuracy than Back Razor does)"),
    optimizer: str = typer.Option("sgd", help="sgd (momentum 0.9), adam, adamw"),
    lr: float = typer.Option(0.01, help="initial learning rate"),
    weight_decay: float = typer.Option(0.0, help="L2 penalty (decoupled for adamw)"),
    schedule: str = typer.Option("cosine", help="cosine (to 0 over the run) or constant"),
    seed: int = typer.Option(0, help="batch order, validation split and new classifier"),
    size: int = typer.Option(None, min=1, help="image height and width (default: 28 for zoo models, else 224)"),
    val_fraction: float = typer.Option(0.2, help="a folder's share of each class held out for validation"),
    train_limit: int = typer.Option(None, min=1, help="built-in datasets: use the first N training (and test) images"),
    skip_bad_images: bool = typer.Option(False, "--skip-bad-images", metavar="",
                                         help="a folder: decode every image before training and leave out (and "
                                              "list) the unreadable ones; default: an unreadable image is an error "
                                              "that names it"),
    device: str = typer.Option("cpu", callback=device_option, help="cpu, cuda or cuda:N"),
    json_path: Path = typer.Option(None, "--json", callback=output_file, help="write the run's summary as JSON here"),
    plot: Path = typer.Option(None, callback=plot_file, help="write loss and validation accuracy per epoch here (.png, .pdf, .svg)"),
) -> None:
    """Fine-tune a model on your images: per-epoch validation accuracy, measured peak memory, resumable."""
    from ..data import ImageFolderError
    from ..finetune import FinetuneJob, NothingFits, run_finetune, saved_run
    from ..training import TrainingDiverged
    from ..zoo import CheckpointError

    try:
        job = FinetuneJob(model=model, data=data, weights=weights, out=out, policy=tuple(policy or ()),
                          memory_budget=memory_budget, scope=scope, freeze_batchnorm=freeze_batchnorm, epochs=epochs,
                          batch=batch_size, min_batch=min_batch, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                          schedule=schedule, seed=seed, size=size, val_fraction=val_fraction, limit=train_limit,
                          skip_bad_images=skip_bad_images, device=device)
    except ValueError as err:
        raise typer.BadParameter(install_hint(err)) from None
    loaded = []  # an error before the model and data are ready is a usage error (exit 2), after it a failure (1)

    def show_loaded(run: FinetuneRun) -> None:
        loaded.append(run)
        console.print(f"model {model}: {run.origin}")
        console.print(f"data {run.data.description}; {run.image_size}x{run.image_size} px")
        if run.data.skipped:  # the library's warning named the first few
            console.print(f"left out {len(run.data.skipped)} unreadable image(s) (--skip-bad-images), each listed "
                          f"with the reason in {out / 'model.json'}", style="yellow")

    def show_training(run: FinetuneRun) -> None:
        config = run.config
        console.print(f"training: {config.policy}, scope {config.scope}, batch {config.batch_size}, {config.epochs} "
                      f"epoch(s), {config.optimizer} lr {config.lr} ({config.schedule})")
        saved = saved_run(out) if out is not None else None
        if saved is not None:  # what the checkpoint was made with: resuming checks it is this run
            settings, finished = saved
            shown = ", ".join(f"{k} {settings[k]}" for k in _SHOWN if settings.get(k) is not None)
            console.print(f"{out} holds {finished} finished epoch(s) of a run with {shown}")

    try:
        with _Display() as display:
            run = run_finetune(job, on_loaded=show_loaded, on_plan=_print_plan, on_training=show_training,
                               on_progress=display.update, status=console.status,
                               notice=console.print)
    except NothingFits:  # the table's "why" line said what to change
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        resume = (f"every finished epoch is saved under {out / 'checkpoint'}: run the same command again to resume "
                  "from the last one" if out is not None else "nothing was saved (no --out)")
        console.print(f"interrupted; {resume}", style="yellow")
        raise typer.Exit(130) from None
    except (EdgetorchError, ValueError, TypeError, ImportError) as err:
        if not loaded:
            raise typer.BadParameter(install_hint(err)) from None
        # ImageFolderError: a damaged image found when decoded; TrainingDiverged: the loss became NaN.
        if not isinstance(err, (CheckpointError, ImageFolderError, TrainingDiverged)):
            raise
        console.print(str(err), style="red")
        raise typer.Exit(1) from None

    result, plan = run.result, run.plan
    measured = f"measured peak {mib(result.peak_bytes)} MiB ({result.peak_kind}, training)"
    if result.process_peak_bytes is not None:
        measured += f", {mib(result.process_peak_bytes)} MiB over the whole process"
    if plan is not None:
        predicted, within = plan.chosen.predicted_peak_bytes, run.within_budget
        error = "" if run.prediction_error is None else f" ({run.prediction_error:+.1%})"
        console.print(f"{measured}, {'within' if within else 'OVER'} the budget of {mib(plan.budget_bytes)} MiB; "
                      f"predicted {mib(predicted)} MiB{error}", style=None if within else "red")
    else:
        console.print(measured)
    if result.resumed_from == run.config.epochs:
        console.print(f"{out} had finished its {result.resumed_from} epoch(s): nothing was trained, the peak and accuracy "
                      "are the run's own (train more: the same command with a larger --epochs extends it)")
    elif result.restarts and result.resumed_from == result.restarts[-1]:  # what finetune decided, not a guess
        restart = (f": the cosine schedule starts again at lr {run.config.lr} for epochs {result.resumed_from + 1}-"
                   f"{run.config.epochs}" if run.config.schedule == "cosine" else "")
        console.print(f"extended {out} from {result.resumed_from} to {run.config.epochs} epochs{restart}")
    elif result.resumed_from:
        console.print(f"resumed after epoch {result.resumed_from} from {out / 'checkpoint'}")
    console.print(f"validation accuracy {result.val_accuracy:.4f}; wrote {result.weights} and {out / 'model.json'} "
                  f"(a state_dict of {model} with num_classes={len(run.data.classes)})")
    write_json(json_path, run.summary())
    if plot is not None:
        from ..measure.plots import plot_training

        console.print(f"wrote {plot_training(result.history, plot, f'{model} on {run.data.description}')}")


# A checkpoint's settings shown when a run resumes (the rest are in its state.json).
_SHOWN = ("model", "data", "image_size", "policy", "scope", "batch_size", "epochs", "optimizer", "lr", "schedule",
          "seed")


class _Display:
    """A progress bar per epoch with the running loss and throughput, and a line per finished epoch.

    It goes live at the first event of the training loop, not on entry: before that the planner's
    spinner may run, and rich shows one live display at a time.
    """

    def __enter__(self) -> _Display:
        self.progress, self.task = None, None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def update(self, event: dict) -> None:
        if self.progress is None:
            self.progress = Progress(TextColumn("epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("loss {task.fields[loss]:.4f}  {task.fields[speed]:.1f} img/s"),
                                     TimeElapsedColumn(), console=console, transient=True)
            self.progress.__enter__()
        if event["event"] == "step":
            if self.task is None:
                self.task = self.progress.add_task("", total=event["steps"], epoch=event["epoch"], loss=0.0, speed=0.0)
            self.progress.update(self.task, completed=event["step"], epoch=event["epoch"], loss=event["loss"],
                                 speed=event["images_per_second"])
        else:
            if self.task is not None:
                self.progress.remove_task(self.task)
                self.task = None
            self.progress.console.print(
                f"epoch {event['epoch']}: loss {event['train_loss']:.4f}, val acc {event['val_accuracy']:.4f}, "
                f"{event['images_per_second']:.1f} img/s, peak {mib(event['peak_bytes'])} MiB")


def _print_plan(plan: MemoryPlan) -> None:
    if not plan.candidates:  # refused before any was measured
        console.print(f"why: {plan.reason}")
        return
    table = Table(title=f"candidates for a {mib(plan.budget_bytes)} MiB budget ({plan.memory_kind}), "
                        "in order of preference")
    # One row per policy: its largest batch that fits (or, if none does, its smallest), so the
    # table answers "what does each policy allow" without listing every halving; and every
    # candidate that was run at its own batch before choosing.
    rows = {}
    for c in plan.candidates:
        if c.policy not in rows or (not rows[c.policy].fits and (c.fits or c.batch < rows[c.policy].batch)):
            rows[c.policy] = c
    shown = {id(c) for c in rows.values()} | {id(c) for c in plan.candidates if c.measured_peak_bytes is not None}
    # The policy spec whole (six Back Razor rows were cut to the same "backrazor:sparsity=..."):
    # the narrower columns wrap their headers instead.
    per_block = plan.blocks.plan.policy.spec() if plan.blocks is not None else None
    name = {per_block: "per-block (below)"}.get  # its spec names every block: the table below shows it
    table.add_column("policy", justify="right", no_wrap=True,
                     min_width=max(len(name(c.policy, c.policy)) for c in plan.candidates if id(c) in shown))
    for col in ("batch", "predicted peak MiB", "measured MiB (one step)", "fits", "step time vs dense",
                "saved act. MiB (ledger)"):
        table.add_column(col, justify="right")
    for c in (c for c in plan.candidates if id(c) in shown):
        mark = Text("chosen", style="green") if c == plan.chosen else ("yes" if c.fits else "no")
        table.add_row(name(c.policy, c.policy), str(c.batch), mib(c.predicted_peak_bytes), mib(c.measured_peak_bytes),
                      mark, f"{c.step_time_ratio:.2f}", mib(c.saved_bytes))
    console.print(table)
    if plan.blocks is not None:
        _print_blocks(plan.blocks)
    console.print(f"why: {plan.reason}")


def _print_blocks(fit: BlockFit) -> None:
    """The per-block plan's table: each block's form, what it stores, its fidelity cost and time."""
    measured = "not run" if fit.measured_peak_bytes is None else f"measured {mib(fit.measured_peak_bytes)} MiB"
    table = Table(title=f"per-block plan at batch {fit.batch}: predicted {mib(fit.predicted_peak_bytes)} MiB, "
                        f"{measured}, summed fidelity cost {fit.plan.fidelity:.3g}")
    for col in ("block", "form", "stored MiB", "rerun MiB", "fidelity cost", "extra ms", "why"):
        table.add_column(col, justify="left" if col in ("block", "form", "why") else "right")
    for row in fit.plan.rows:
        table.add_row(row.block, row.form, mib(row.stored_bytes), mib(row.rerun_bytes), f"{row.fidelity:.3g}",
                      "-" if row.seconds is None else f"{row.seconds * 1e3:.1f}", row.why)
    console.print(table)
