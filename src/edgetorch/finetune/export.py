"""A fine-tuned or reduced classifier, or a split artifact's head, for the runtimes devices run (``edgetorch export``).

Two formats: ONNX (``.onnx``, for onnxruntime) and ExecuTorch (``.pte``, lowered to XNNPACK for
CPUs; ``executorch`` 1.5 installs beside torch 2.14 and its runtime ran the exported programs here).
The graph takes preprocessed images ``[N, C, H, W]`` (ONNX: any N; ExecuTorch: the N it was
exported for) and gives logits (a split head: its bottleneck, for the 8-bit payload); beside it, ``FILE.json`` records what its user must do first and
how to read the output: classes in label order, size, colour, normalisation and the whole
preprocessing (the finetune run's own record). Every export is checked: the runtime runs it on
the example inputs and its logits must match PyTorch's within :data:`TOLERANCE`, or nothing is
written.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .predict import Classifier

#: The largest |runtime - PyTorch| logit difference an fp32 export may show.
TOLERANCE = 1e-4
#: The record's format name; a reader checks it.
RECORD_FORMAT = "edgetorch-classifier-export/1"
#: Runtime -> the file suffix it loads.
SUFFIXES = {"onnx": ".onnx", "executorch": ".pte"}


@dataclass(frozen=True)
class ClassifierExport:
    """What :func:`export_classifier` wrote and measured.

    Attributes:
        model: the ``.onnx`` or ``.pte`` file.
        record: its ``.json`` record.
        max_abs_difference: the largest |runtime - PyTorch| logit over the checked inputs.
        checked_inputs: how many images were compared.
    """

    model: Path
    record: Path
    max_abs_difference: float
    checked_inputs: int


def export_classifier(classifier: Classifier, out: str | Path, runtime: str = "onnx",
                      batch_size: int = 4) -> ClassifierExport:
    """Write ``classifier`` (a split artifact: its head) for ``runtime`` and check it there against PyTorch.

    Args:
        classifier: from :func:`~edgetorch.finetune.predict.load_classifier`.
        out: the file to write (``.onnx`` or ``.pte``, as :data:`SUFFIXES` says; its record goes
            to ``out`` + ``.json``).
        runtime: ``"onnx"`` or ``"executorch"``.
        batch_size: random images of the input shape compared on; an ExecuTorch program takes
            batches of exactly this many (ONNX: any).

    Returns:
        A :class:`ClassifierExport`.

    Raises:
        ImportError: the runtime's packages are not installed (``edgetorch[onnx]``,
            ``edgetorch[executorch]``).
        ValueError: an unknown runtime, a suffix other than its own, or logits that differ from
            PyTorch's by more than :data:`TOLERANCE` (nothing is written).

    Example:
        >>> export_classifier(load_classifier("runs/photos"), "photos.onnx").max_abs_difference  # doctest: +SKIP
        2.1e-06
    """
    if runtime not in SUFFIXES:
        raise ValueError(f"unknown format {runtime!r}; accepted: {', '.join(SUFFIXES)}")
    out = Path(out)
    if out.suffix != SUFFIXES[runtime]:
        raise ValueError(f"{out}: give a file name ending in {SUFFIXES[runtime]} for {runtime}")
    if classifier.split is None:
        shape = (3 if classifier.color == "rgb" else 1, classifier.image_size, classifier.image_size)
        model, output, extra = classifier.model.eval(), "logits [N, classes]", {}
    else:  # the device's side only: its output goes to the tail server as the 8-bit payload
        shape, model = classifier.split.input_shape, classifier.model.head.eval()
        output = (f"bottleneck [N, {', '.join(map(str, classifier.split.bottleneck_shape))}]: encode it with "
                  "edgetorch.split.payload.encode and send it to `edgetorch split serve` of this artifact")
        extra = {"artifact_id": classifier.split.artifact_id}
    examples = torch.rand(batch_size, *shape, generator=torch.Generator().manual_seed(0))
    data, run = _onnx(model, examples, output.split()[0]) if runtime == "onnx" else _executorch(model, examples)
    with torch.inference_mode():
        expected = model(examples)
    difference = (run(examples) - expected).abs().max().item()
    if not difference <= TOLERANCE:
        raise ValueError(f"{runtime}'s outputs differ from PyTorch's by up to {difference:.2e} (tolerance "
                         f"{TOLERANCE:.0e}): the model uses an operator the exporter does not reproduce; nothing written")
    out.write_bytes(data)
    record = out.with_name(out.name + ".json")
    record.write_text(json.dumps({
        "format": RECORD_FORMAT, "runtime": runtime, "source": str(classifier.source), "classes": classifier.classes,
        "image_size": classifier.image_size, "color": classifier.color, "normalize": classifier.normalize,
        "preprocessing": classifier.preprocessing, "batch": None if runtime == "onnx" else len(examples),
        "input": "image [N, C, H, W], preprocessed", "output": output, **extra,
        "max_abs_difference": difference}, indent=2) + "\n")
    return ClassifierExport(out, record, difference, len(examples))


Runner = Callable[[torch.Tensor], torch.Tensor]


def _onnx(model: nn.Module, examples: torch.Tensor, output_name: str) -> tuple[bytes, Runner]:
    import onnxruntime

    from ..split.onnx_head import onnx_bytes

    data = onnx_bytes(model, examples[:2], output_name=output_name)
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.float().numpy()})[0])

    return data, run


def _executorch(model: nn.Module, examples: torch.Tensor) -> tuple[bytes, Runner]:
    # XNNPACK: ExecuTorch's CPU backend (ARM and x86), what a phone or a Raspberry Pi runs.
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        program = torch.export.export(model, (examples,))
        data = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
    # The check runs the very bytes that will be written.
    method = Runtime.get().load_program(data).load_method("forward")

    def run(x: torch.Tensor) -> torch.Tensor:
        return method.execute([x])[0]

    return data, run
