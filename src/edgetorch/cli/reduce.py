"""``edgetorch reduce``: shrink a trained network to a multiplication budget (Mauch & Yang).

An MLP or plain CNN (an ``nn.Sequential`` chain) is reduced layer by layer; any other CNN
(``torchvision:resnet18``, ``zoo:cnn`` ...) by its coupled channel groups, printed one per row.
``--finetune-epochs N`` then fine-tunes the reduced model on the dataset's training split
(``--distill``: from the full model as teacher), and the fine-tuned model is the one saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from ..errors import EdgetorchError
from .._extras import install_hint
from ._app import app, console, output_file, plot_file, write_json

if TYPE_CHECKING:  # the command imports torch-backed modules only when it runs
    from ..reduce import Reduction


def _print_groups(result: Reduction, title: str) -> None:
    """The channel groups of a grouped :class:`~edgetorch.reduce.Reduction`: root layer, channels kept, consumers, J_g."""
    table = Table(title=title)
    for col in ("group", "root layer", "channels", "kept", "readers", "J_g"):
        table.add_column(col, justify="left" if col == "root layer" else "right")
    for g in result.groups:
        table.add_row(str(g.group), g.root, str(g.channels), str(g.kept), str(g.consumers), f"{g.error:.4g}")
    console.print(table)


def _print_layers(result: Reduction, title: str) -> None:
    """The per-layer table of a :class:`~edgetorch.reduce.Reduction`: sizes, kept units or rank, MACs, alpha_l, J_l."""
    table = Table(title=title)
    for col in ("layer", "name", "M_in x M_out", "kept inputs" if result.method != "lowrank" else "rank",
                "MACs", "alpha_l", "J_l"):
        table.add_column(col, justify="left" if col == "name" else "right")
    for f in result.layers:
        value = f.kept_inputs if f.kept_inputs is not None else f.rank
        table.add_row(str(f.layer), f.name, f"{f.in_features} x {f.out_features}", str(value),
                      f"{f.macs:,}", f"{f.alpha:.3f}", f"{f.error:.4g}")
    console.print(table)


@app.command()
def reduce(
    model: str = typer.Option("zoo:mlp", help="zoo:NAME, torchvision:resnet18 or torchvision:mobilenet_v2 (pretrained "
                              "on --data unless --weights), or any spec with --weights (torchvision:NAME: any "
                              "CNN, pruned by channel groups; pkg.module:factory imports that module: runs its code)"),
    weights: Path = typer.Option(None, help="safetensors/state-dict weights of --model"),
    alpha: float = typer.Option(..., help="total reduction factor in [0, 1): share of multiplications removed"),
    method: str = typer.Option("prune", help="prune (the paper's), prune-ls (correlation-aware), lowrank"),
    allocation: str = typer.Option("optimal", help="optimal (exact), pso (the paper's), uniform"),
    data: str = typer.Option("digits", help="digits or fashion-mnist (calibration from the train split, accuracy on "
                             "the test split), or an image folder with --weights fine-tuned on it (a finetune run's "
                             "model.safetensors: accuracy on the images it held out)"),
    size: int = typer.Option(28, min=1, help="image size the model takes"),
    calibration: int = typer.Option(1000, min=2, help="unlabeled calibration samples (pruning)"),
    accuracy: bool = typer.Option(True, metavar="", help="evaluate full and reduced accuracy on the test labels"),
    latency_batch: int = typer.Option(64, min=1, help="batch size of the CPU latency comparison"),
    seed: int = typer.Option(0, help="PSO seed (and the fine-tune's batch order)"),
    prune_input: bool = typer.Option(False, metavar="", help="pruning a chain, also drop input features of its first layer "
                                     "(the paper's setting; by default the input is kept whole, which measured "
                                     "as accurate and faster: docs/results/reduce_input_selection.md)"),
    finetune_epochs: int = typer.Option(0, min=0, help="fine-tune the reduced model this many epochs on the "
                                        "dataset's training split (0: no fine-tuning, the paper's setting)"),
    finetune_lr: float = typer.Option(1e-3, help="peak learning rate of the fine-tune "
                                      "(AdamW, one-cycle)"),
    distill: bool = typer.Option(False, metavar="", help="fine-tune against the full model's outputs too (knowledge "
                                 "distillation, teacher = the unreduced model); needs --finetune-epochs"),
    out: Path = typer.Option(None, callback=output_file, help="write the reduced network here (.safetensors + .json)"),
    json_path: Path = typer.Option(None, "--json", callback=output_file, help="write the summary, per-layer factors included, as JSON here"),
    plot: Path = typer.Option(None, callback=plot_file, help="write a bar chart of the per-layer factors alpha_l here (.png, .pdf, .svg)"),
) -> None:
    """Reduce a trained network: per-layer (chain) or per-channel-group factors, MACs, accuracy, CPU latency ratio."""
    from ..reduce import ALLOCATIONS, METHODS, save
    from ..reduce.transformer_blocks import is_transformer
    from ..reduce.workflow import ReduceJob, run_reduction
    from .._checks import check_choice

    for name, value, accepted in (("method", method, METHODS), ("allocation", allocation, ALLOCATIONS)):
        try:
            check_choice(name, value, accepted)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint=f"'--{name}'") from None
    if not finetune_lr > 0:
        raise typer.BadParameter(f"{finetune_lr} is not a learning rate: give a number > 0", param_hint="'--finetune-lr'")
    if distill and finetune_epochs == 0:
        raise typer.BadParameter("--distill fine-tunes from the full model: give --finetune-epochs 1 or more",
                                 param_hint="'--distill'")
    if out is not None and out.suffix != ".safetensors":
        raise typer.BadParameter(f"{out} must end in .safetensors", param_hint="'--out'")
    job = ReduceJob(model=model, alpha=alpha, weights=weights, method=method, allocation=allocation, dataset=data,
                    size=size, calibration=calibration, accuracy=accuracy, latency_batch=latency_batch, seed=seed,
                    prune_input=prune_input, finetune_epochs=finetune_epochs, finetune_lr=finetune_lr, distill=distill)
    try:
        run = run_reduction(job, status=console.status, notice=console.print)
    except (EdgetorchError, ValueError, TypeError) as err:
        raise typer.BadParameter(str(err)) from None
    except (ImportError, RuntimeError) as err:  # not a chain without Torch-Pruning; torch refusing the data
        console.print(f"reduce failed: {install_hint(err)}", style="red")
        raise typer.Exit(1) from None

    result, a = run.reduction, run.reduction.allocation
    title = f"{model} on {data}: {method}, {allocation} allocation, alpha >= {alpha}"
    if result.groups:
        console.print(f"{len(result.groups)} groups found (each block's attention heads, and its MLP hidden units)"
                      if is_transformer(run.full) else
                      f"{len(result.groups)} channel groups found (channels pruned together: residual sums, "
                      "depthwise convolutions, concatenations, the flatten into the classifier)")
        _print_groups(result, title)
    else:
        _print_layers(result, title)
    console.print(f"MACs per sample: {run.macs_full:,} -> {run.macs_reduced:,} "
                  f"(alpha achieved {a.alpha:.4f}); J = {a.objective:.4g}, solver {a.seconds:.2f} s"
                  + (f", proven gap {a.proven_gap:.3g}" if a.proven_gap is not None else ""))
    if run.accuracy_full is not None:
        console.print(f"test accuracy ({run.test_samples} samples): {run.accuracy_full:.4f} -> "
                      f"{run.accuracy_reduced:.4f}")
    if run.finetune is not None:
        history, teacher = run.finetune, " distilling from the full model" if distill else ""
        line = f"fine-tuned {finetune_epochs} epoch(s) on {run.finetune_samples} samples{teacher} in {history.seconds:.1f} s"
        if history.accuracy_before is not None:
            line += f": test accuracy {history.accuracy_before:.4f} -> {history.accuracy_after:.4f}"
        console.print(line)
    timing = run.latency
    console.print(f"CPU latency, batch {run.latency_batch} (median of {timing.rounds} interleaved rounds): "
                  f"{timing.full_seconds * 1e3:.3f} ms -> {timing.reduced_seconds * 1e3:.3f} ms "
                  f"(ratio {timing.ratio:.2f}, measured)")
    summary = run.summary()
    console.print_json(json.dumps({k: v for k, v in summary.items() if k not in ("layers", "groups")}))  # tabled
    try:
        if out is not None:  # a grouped model is rebuilt from --model's constructor
            console.print(f"wrote {out} and {save(result.model, out, {'reduction': summary}, source=model)}")
        write_json(json_path, summary)
        if plot is not None:
            from ..reduce.plots import plot_layer_factors

            console.print(f"wrote {plot_layer_factors(result.layers, a.alpha, plot, title)}")
    except OSError as err:  # the disk filled up, a directory vanished mid-run
        console.print(f"reduce could not write its outputs: {err}", style="red")
        raise typer.Exit(1) from None
    except (TypeError, ValueError) as err:  # a model whose constructor the checkpoint cannot name
        console.print(f"reduce could not save the reduced model: {err}", style="red")
        raise typer.Exit(1) from None
