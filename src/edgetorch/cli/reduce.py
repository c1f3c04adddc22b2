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
from ._app import app, console, output_file, plot_file, write_json

if TYPE_CHECKING:  # the command imports torch-backed modules only when it runs
    import torch
    from torch.utils.data import TensorDataset

    from ..reduce import Reduction


def _load_model(model: str, weights: Path | None, dataset: str, size: int):
    from ..data import dataset_info
    from ..zoo import ZOO_MODELS, build_model, pretrained
    from ..zoo.pretrain import TORCHVISION_TRAINED, default_config
    from ..zoo.registry import takes_image_size

    zoo, name = model.startswith("zoo:"), model.removeprefix("zoo:")
    if weights is None:
        if not zoo and model not in TORCHVISION_TRAINED:
            raise typer.BadParameter("--weights is required unless --model is a zoo model (zoo:NAME) or one of "
                                     f"{', '.join(TORCHVISION_TRAINED)} (pretrained here on fashion-mnist)")
        trained_at = default_config(name, dataset).image_size
        if size != trained_at:
            raise typer.BadParameter(f"{model} is pretrained on {trained_at}x{trained_at} images; use --size "
                                     f"{trained_at}, or give --weights of a model built for {size}x{size}")
        return pretrained(name, dataset=dataset)
    sized = zoo and name in ZOO_MODELS and takes_image_size(name)
    return build_model(model, num_classes=dataset_info(dataset).num_classes, weights=weights,
                       **({"image_size": size} if sized else {}))


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


def _finetune(result: Reduction, full: torch.nn.Module, train: TensorDataset, test: TensorDataset | None,
              epochs: int, lr: float, distill: bool, seed: int) -> dict:
    """Fine-tune ``result.model`` in place; the JSON record of what it did, accuracy per epoch included."""
    from ..reduce.recover import RecoverConfig, recover

    config = RecoverConfig(epochs=epochs, lr=lr, seed=seed, distill=distill,
                            batch_size=min(RecoverConfig.batch_size, len(train)))
    teacher = " distilling from the full model" if distill else ""
    with console.status(f"fine-tuning {epochs} epoch(s) on {len(train)} training samples{teacher}"):
        history = recover(result.model, train, config, teacher=full if distill else None, test=test)
    record = {**vars(config), "train_samples": len(train), "seconds": history.seconds,
              "train_loss": history.train_loss, "accuracy": history.accuracy}
    line = f"fine-tuned {epochs} epoch(s) on {len(train)} samples{teacher} in {history.seconds:.1f} s"
    if test is not None:
        line += f": test accuracy {history.accuracy_before:.4f} -> {history.accuracy_after:.4f}"
    console.print(line)
    return record


@app.command()
def reduce(
    model: str = typer.Option("zoo:mlp", help="zoo:NAME, torchvision:resnet18 or torchvision:mobilenet_v2 (pretrained "
                              "on --dataset unless --weights), or any spec with --weights (torchvision:NAME: any "
                              "CNN, pruned by channel groups; pkg.module:factory imports that module: runs its code)"),
    weights: Path = typer.Option(None, help="safetensors/state-dict weights of --model"),
    alpha: float = typer.Option(..., help="total reduction factor in [0, 1): share of multiplications removed"),
    method: str = typer.Option("prune", help="prune (the paper's), prune-ls (correlation-aware), lowrank"),
    allocation: str = typer.Option("optimal", help="optimal (exact), pso (the paper's), uniform"),
    dataset: str = typer.Option("digits", help="calibration samples from its train split, accuracy on its test split"),
    size: int = typer.Option(28, min=1, help="image size the model takes"),
    calibration: int = typer.Option(1000, min=2, help="unlabeled calibration samples (pruning)"),
    accuracy: bool = typer.Option(True, help="evaluate full and reduced accuracy on the test labels"),
    latency_batch: int = typer.Option(64, min=1, help="batch size of the CPU latency comparison"),
    seed: int = typer.Option(0, help="PSO seed (and the fine-tune's batch order)"),
    prune_input: bool = typer.Option(False, help="pruning a chain, also drop input features of its first layer "
                                     "(the paper's setting; by default the input is kept whole, which measured "
                                     "as accurate and faster: docs/results/reduce_input_selection.md)"),
    finetune_epochs: int = typer.Option(0, min=0, help="fine-tune the reduced model this many epochs on the "
                                        "dataset's training split (0: no fine-tuning, the paper's setting)"),
    finetune_lr: float = typer.Option(1e-3, help="peak learning rate of the fine-tune "
                                      "(AdamW, one-cycle)"),
    distill: bool = typer.Option(False, help="fine-tune against the full model's outputs too (knowledge "
                                 "distillation, teacher = the unreduced model); needs --finetune-epochs"),
    output: Path = typer.Option(None, callback=output_file, help="write the reduced network here (.safetensors + .json)"),
    json_path: Path = typer.Option(None, "--json", callback=output_file, help="write the summary, per-layer factors included, as JSON here"),
    plot: Path = typer.Option(None, callback=plot_file, help="write a bar chart of the per-layer factors alpha_l here (.png, .pdf, .svg)"),
) -> None:
    """Reduce a trained network: per-layer (chain) or per-channel-group factors, MACs, accuracy, CPU latency ratio."""
    import torch
    from torch.utils.data import TensorDataset

    from ..data import load_dataset
    from ..reduce import ALLOCATIONS, METHODS, compare_latency, count_macs, count_transformer_macs, reduce_model, save
    from ..reduce.transformer_blocks import is_transformer
    from .._checks import check_choice
    from ..zoo import evaluate_accuracy, input_channels
    from ..zoo.registry import with_channels

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
    if output is not None and output.suffix != ".safetensors":
        raise typer.BadParameter(f"{output} must end in .safetensors", param_hint="'--output'")
    try:
        with console.status(f"loading {model} (a zoo model without --weights is pretrained on first use: minutes "
                            "on a CPU, then cached)"):
            full = _load_model(model, weights, dataset, size).eval()
            channels = input_channels(full)
            train = load_dataset(dataset, "train", size=size)
            test = load_dataset(dataset, "test", size=size)
            train, test = (TensorDataset(with_channels(d.tensors[0], channels), d.tensors[1]) for d in (train, test))
        calib = train.tensors[0][: min(calibration, len(train))]
        with console.status(f"measuring each layer's error curve on {len(calib)} samples, then the {allocation} "
                            "allocation"):
            result = reduce_model(full, alpha, method, allocation, calibration=calib, seed=seed,
                                  prune_input=prune_input)
    except (EdgetorchError, ValueError, TypeError) as err:
        raise typer.BadParameter(str(err)) from None
    except ImportError as err:  # a network that is not a chain, without Torch-Pruning
        console.print(f"reduce failed: {err}", style="red")
        raise typer.Exit(1) from None
    except RuntimeError as err:  # torch refusing the data, e.g. images that do not fit the model
        console.print(f"reduce failed: {err}", style="red")
        raise typer.Exit(1) from None

    one = test.tensors[0][:1]
    # count_macs sees weight layers only; a transformer's attention products are counted by PyTorch's counter
    count = count_transformer_macs if is_transformer(full) else count_macs
    full_macs, reduced_macs = count(full, one), count(result.model, one)
    title = f"{model} on {dataset}: {method}, {allocation} allocation, alpha >= {alpha}"
    if result.groups:
        console.print(f"{len(result.groups)} groups found (each block's attention heads, and its MLP hidden units)"
                      if is_transformer(full) else
                      f"{len(result.groups)} channel groups found (channels pruned together: residual sums, "
                      "depthwise convolutions, concatenations, the flatten into the classifier)")
        _print_groups(result, title)
    else:
        _print_layers(result, title)
    a = result.allocation
    summary = {"model": model, "dataset": dataset, "method": method, "allocation": allocation,
               "alpha": alpha, "achieved_alpha": a.alpha, "objective_J": a.objective,
               "solver_seconds": a.seconds, "proven_gap": a.proven_gap, "macs_full": full_macs,
               "macs_reduced": reduced_macs,
               "layers": [vars(f) for f in result.layers], "groups": [vars(g) for g in result.groups]}
    console.print(f"MACs per sample: {full_macs:,} -> {reduced_macs:,} "
                  f"(alpha achieved {a.alpha:.4f}); J = {a.objective:.4g}, solver {a.seconds:.2f} s"
                  + (f", proven gap {a.proven_gap:.3g}" if a.proven_gap is not None else ""))
    if accuracy:
        summary["accuracy_full"] = evaluate_accuracy(full, test)
        summary["accuracy_reduced"] = evaluate_accuracy(result.model, test)
        console.print(f"test accuracy ({len(test)} samples): {summary['accuracy_full']:.4f} -> "
                      f"{summary['accuracy_reduced']:.4f}")
    if finetune_epochs:
        summary["finetune"] = _finetune(result, full, train, test if accuracy else None, finetune_epochs,
                                        finetune_lr, distill, seed)
        if accuracy:
            summary["accuracy_finetuned"] = summary["finetune"]["accuracy"][-1]
    torch.manual_seed(0)
    batch = test.tensors[0][:latency_batch]
    timing = compare_latency(full, result.model, batch)
    summary |= {"latency_batch": len(batch), "latency_full_s": timing.full_seconds,
                "latency_reduced_s": timing.reduced_seconds, "latency_ratio": timing.ratio}
    console.print(f"CPU latency, batch {len(batch)} (median of {timing.rounds} interleaved rounds): "
                  f"{timing.full_seconds * 1e3:.3f} ms -> {timing.reduced_seconds * 1e3:.3f} ms "
                  f"(ratio {timing.ratio:.2f}, measured)")
    console.print_json(json.dumps({k: v for k, v in summary.items() if k not in ("layers", "groups")}))  # tabled
    try:
        if output is not None:  # a grouped model is rebuilt from --model's constructor
            console.print(f"wrote {output} and {save(result.model, output, {'reduction': summary}, source=model)}")
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
