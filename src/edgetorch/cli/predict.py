"""``edgetorch predict`` and ``edgetorch val``: a fine-tuned or reduced classifier on images."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import typer
from rich.table import Table

from .._extras import install_hint
from ._app import app, console, output_file, write_json

_MODEL_HELP = ("a finetune run directory (model.safetensors + model.json), a model reduce wrote for an image folder "
               "(.safetensors + .json), or a split export directory (head and tail run here, through the 8-bit payload)")


@contextlib.contextmanager
def _usage_error(param: str) -> Iterator[None]:
    # What a model, image or folder given on the command line cannot be: a usage error naming it.
    from ..errors import EdgetorchError

    try:
        yield
    except (EdgetorchError, ValueError, ImportError) as err:
        raise typer.BadParameter(install_hint(err), param_hint=param) from None


def _classifier(model: Path) -> object:  # a Classifier; typer reads this hint, and naming it would import torch
    from ..finetune.predict import load_classifier

    with _usage_error("MODEL"):
        return load_classifier(model)


@app.command()
def predict(
    classifier: Path = typer.Argument(..., metavar="MODEL", help=_MODEL_HELP, callback=_classifier),
    images: list[Path] = typer.Argument(..., help="image files, or folders whose images (recursively) are classified"),
    top_k: int = typer.Option(3, min=1, help="classes shown per image"),
    json: Path = typer.Option(None, callback=output_file, help="write every image's top classes here"),
) -> None:
    """Classify images with a fine-tuned, reduced or split model, preprocessed as it was trained."""
    from ..finetune.predict import predict as classify

    with _usage_error("IMAGES"):
        predictions = classify(classifier, images, top_k)
    for p in predictions:
        console.print(f"{p.path}: " + ", ".join(f"{name} {probability:.1%}" for name, probability in p.top))
    write_json(json, {"model": str(classifier.source), "predictions": [
        {"path": str(p.path), "top": [{"class": name, "probability": probability} for name, probability in p.top]}
        for p in predictions]})


@app.command()
def val(
    classifier: Path = typer.Argument(..., metavar="MODEL", help=_MODEL_HELP, callback=_classifier),
    data: Path = typer.Option(..., help="labelled images: one subfolder per class, or a path,label .csv; all are used"),
    top_k: int = typer.Option(5, min=1, help="also count a label among the k most likely classes"),
    json: Path = typer.Option(None, callback=output_file, help="write the accuracies here"),
) -> None:
    """Accuracy of a fine-tuned, reduced or split model on labelled images (top-1, top-k, per class)."""
    from ..finetune.predict import validate

    with _usage_error("'--data'"):
        result = validate(classifier, data, top_k)
    table = Table(title=f"{classifier.source} on {data}: {result.images:,} images")
    for column in ("class", "top-1 accuracy"):
        table.add_column(column, justify="right" if column != "class" else "left")
    for name, accuracy in result.per_class.items():
        table.add_row(name, f"{accuracy:.4f}")
    console.print(table)
    console.print(f"top-1 {result.top1:.4f}, top-{result.k} {result.topk:.4f}")
    write_json(json, {"model": str(classifier.source), "data": str(data), "images": result.images, "top1": result.top1,
                      f"top{result.k}": result.topk, "per_class": result.per_class})


@app.command()
def export(
    classifier: Path = typer.Argument(..., metavar="MODEL", help=_MODEL_HELP, callback=_classifier),
    out: Path = typer.Option(..., callback=output_file, help="the file to write: .onnx or .pte (its record: OUT.json)"),
    runtime: str = typer.Option("onnx", "--format", help="onnx (onnxruntime) or executorch (XNNPACK); of a split "
                                "artifact, its head is written"),
    batch_size: int = typer.Option(4, min=1, help="images per call of an ExecuTorch program (ONNX takes any)"),
) -> None:
    """Export a fine-tuned or reduced model, or a split head, for a device runtime, checked against PyTorch."""
    from ..finetune.export import export_classifier

    with _usage_error("'--format'"):
        done = export_classifier(classifier, out, runtime, batch_size)
    runner = {"onnx": "onnxruntime", "executorch": "ExecuTorch"}[runtime]
    console.print(f"wrote {done.model} and {done.record}: {runner}'s outputs within {done.max_abs_difference:.1e} "
                  f"of PyTorch's on {done.checked_inputs} images")
