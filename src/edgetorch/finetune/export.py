"""A fine-tuned or reduced classifier as ONNX for the runtimes devices run (``edgetorch export``).

The graph (``model.onnx``) takes preprocessed images ``[N, C, H, W]`` and gives logits; beside it,
``model.onnx.json`` records what its user must do first and how to read the output: classes in
label order, size, colour and normalisation (the finetune run's own record). Every export is
checked: onnxruntime runs it on real preprocessed inputs and its logits must match PyTorch's
within :data:`TOLERANCE`, or the export fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .predict import Classifier

#: The largest |ONNX - PyTorch| logit difference an fp32 export may show.
TOLERANCE = 1e-4
#: The record's format name; a reader checks it.
RECORD_FORMAT = "edgetorch-onnx-classifier/1"


@dataclass(frozen=True)
class OnnxExport:
    """What :func:`export_onnx` wrote and measured.

    Attributes:
        model: the ``.onnx`` file.
        record: its ``.json`` record.
        max_abs_difference: the largest |onnxruntime - PyTorch| logit over the checked inputs.
        checked_inputs: how many images were compared.
    """

    model: Path
    record: Path
    max_abs_difference: float
    checked_inputs: int


def export_onnx(classifier: Classifier, out: str | Path, examples: torch.Tensor | None = None) -> OnnxExport:
    """Write ``classifier`` as ONNX and check it in onnxruntime against PyTorch.

    Args:
        classifier: from :func:`~edgetorch.finetune.predict.load_classifier`.
        out: the ``.onnx`` file to write (its record goes to ``out`` + ``.json``).
        examples: preprocessed images to compare on (default: 4 random images of the input shape).

    Returns:
        An :class:`OnnxExport`.

    Raises:
        ImportError: onnx, onnxscript or onnxruntime is not installed (``edgetorch[onnx]``).
        ValueError: ``out`` does not end in ``.onnx``, or onnxruntime's logits differ from
            PyTorch's by more than :data:`TOLERANCE` (nothing is left written).

    Example:
        >>> export_onnx(load_classifier("runs/photos"), "photos.onnx").max_abs_difference  # doctest: +SKIP
        2.1e-06
    """
    import onnxruntime

    from ..split.onnx_head import onnx_bytes

    out = Path(out)
    if out.suffix != ".onnx":
        raise ValueError(f"{out}: give a file name ending in .onnx")
    channels = 3 if classifier.color == "rgb" else 1
    if examples is None:
        examples = torch.rand(4, channels, classifier.image_size, classifier.image_size,
                              generator=torch.Generator().manual_seed(0))
    model = classifier.model.eval()
    data = onnx_bytes(model, examples[:2], output_name="logits")
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    with torch.inference_mode():
        expected = model(examples)
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: examples.float().numpy()})[0])
    difference = (got - expected).abs().max().item()
    if not difference <= TOLERANCE:
        raise ValueError(f"onnxruntime's logits differ from PyTorch's by up to {difference:.2e} (tolerance "
                         f"{TOLERANCE:.0e}): the model uses an operator the exporter does not reproduce; nothing written")
    record = out.with_name(out.name + ".json")
    out.write_bytes(data)
    record.write_text(json.dumps({"format": RECORD_FORMAT, "source": str(classifier.source),
                                  "classes": classifier.classes, "image_size": classifier.image_size,
                                  "color": classifier.color, "normalize": classifier.normalize,
                                  "preprocessing": classifier.preprocessing,
                                  "input": "image [N, C, H, W], preprocessed", "output": "logits [N, classes]",
                                  "max_abs_difference": difference}, indent=2) + "\n")
    return OnnxExport(out, record, difference, len(examples))
