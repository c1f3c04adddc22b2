"""How a trained split is scored: accuracy through the real 8-bit payload (:func:`evaluate_split`), and
the baseline of sending the same images as PNG or JPEG files to a server that runs the whole model
(:func:`file_offload`), decoded inside bounds.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from .bottleneck import BottleneckModel, split
from .coded import CodeTables, FixedSteps, fit_code_tables
from .payload import decode, encode, payload_size, quantize

JPEG_QUALITY = 90  # the offload comparison's JPEG (the planner's "jpeg")
EVAL_BATCH = 250
DECODE_CHUNK = 256  # images decoded per preprocess call: bounds the temporary copies
TABLE_IMAGES = 10_000  # images whose codes fit the code tables: a representative batch, bounded time
SIZE_SAMPLE = 256  # coded payload sizes kept per record: the distribution `split plan` sends over a link


@dataclass(frozen=True)
class PayloadSizes:
    """Real entropy-coded payload sizes, one image per payload, over a set of images.

    Attributes:
        mean, median, p90, largest: bytes per payload, over every image.
        sample: the sizes of the first images (at most 256), for models of a link whose delay is
            not linear in the bytes (LoRa fragments), as ``split plan`` reads them.
    """

    mean: float
    median: float
    p90: float
    largest: int
    sample: tuple[int, ...]


@dataclass(frozen=True)
class SplitAccuracy:
    """A student's accuracy with the float bottleneck and through the deployed 8-bit payload.

    Attributes:
        float_accuracy: ``tail(head(x))``.
        quantized_accuracy: ``tail(decode(encode(head(x))))``, the bytes that go over the network.
        bottleneck_shape: one image's bottleneck ``[C, h, w]``.
        float32_bytes: one image's bottleneck as float32.
        payload_bytes: one image's 8-bit payload (values and header), the exact size sent.
        coded_payload_bytes: with code tables, the sizes of each image's entropy-coded payload,
            else None.
        coded_accuracy: with code tables, ``tail(decode(encode(head(x), tables)))``: the
            quantized accuracy for version 2 (the same codes), the accuracy through the tables'
            fixed steps for version 3; else None.
    """

    float_accuracy: float
    quantized_accuracy: float
    bottleneck_shape: tuple[int, ...]
    float32_bytes: int
    payload_bytes: int
    coded_payload_bytes: PayloadSizes | None = None
    coded_accuracy: float | None = None


@dataclass(frozen=True)
class OffloadScore:
    """The unsplit model on images sent as files of one format (:func:`file_offload`).

    Attributes:
        mean_bytes: the files' mean size.
        accuracy: the model's accuracy on the decoded files.
    """

    mean_bytes: float
    accuracy: float


@torch.inference_mode()
def evaluate_split(model: BottleneckModel, data: TensorDataset, batch_size: int = EVAL_BATCH,
                   tables: CodeTables | None = None) -> SplitAccuracy:
    """Float and 8-bit accuracy of a student, and the bytes one image sends.

    The 8-bit path is the deployed one: the head's output is encoded to payload bytes (on the
    CPU, as on the wire), decoded and fed to the tail. Payloads carry one scale and zero point
    per sample, so encoding a batch gives each image the values it gets alone.

    Args:
        model: the student (its mode is restored afterwards).
        data: images and labels, on any device.
        batch_size: images per forward pass.
        tables: code tables (:func:`fit_payload_tables`): each image is also encoded alone with
            them and the real payload sizes reported (never an entropy estimate).

    Returns:
        The :class:`SplitAccuracy`.

    Example:
        >>> evaluate_split(student, val).quantized_accuracy  # doctest: +SKIP
    """
    was_training = model.training
    head, tail = split(model.eval())
    device = next(model.parameters()).device
    images, labels = data.tensors
    correct_float = correct_q = correct_coded = 0
    shape: tuple[int, ...] = ()
    coded: list[int] = []
    for x, y in zip(images.split(batch_size), labels.split(batch_size)):
        z = head(x.to(device))
        restored = decode(encode(z)).to(device)
        y = y.to(device)
        correct_float += int((tail(z).argmax(1) == y).sum())
        correct_q += int((tail(restored).argmax(1) == y).sum())
        if tables is not None:  # each image's own payload: its size, and the tensor the tail gets from it
            blobs = [encode(one, tables=tables) for one in z.cpu().split(1)]
            coded += [len(blob) for blob in blobs]
            if tables.steps is None:  # version 2 (or 1 where smaller): decodes to version 1's tensor, bit for bit
                correct_coded = correct_q
            else:
                through = torch.cat([decode(blob, tables=tables) for blob in blobs]).to(device)
                correct_coded += int((tail(through).argmax(1) == y).sum())
        shape = tuple(z.shape[1:])
    model.train(was_training)
    sizes = None if not coded else PayloadSizes(float(np.mean(coded)), float(np.median(coded)),
                                                 float(np.percentile(coded, 90)), max(coded), tuple(coded[:SIZE_SAMPLE]))
    return SplitAccuracy(correct_float / len(labels), correct_q / len(labels), shape, 4 * int(np.prod(shape)),
                         payload_size((1, *shape)), sizes, None if tables is None else correct_coded / len(labels))


@torch.inference_mode()
def fit_payload_tables(model: BottleneckModel, data: TensorDataset, batch_size: int = EVAL_BATCH,
                       limit: int = TABLE_IMAGES, steps: FixedSteps | None = None) -> CodeTables:
    """Code tables for a student's payloads: each channel's 8-bit codes counted over images.

    Args:
        model: the trained student (its mode is restored afterwards).
        data: representative images (the training set), on any device; the first ``limit`` are used.
        batch_size: images per forward pass.
        limit: the most images counted.
        steps: a rate-trained student's fixed steps (:attr:`BottleFitRun.steps`): the codes are
            theirs and the tables keep them (payload version 3); else each payload's own 8-bit
            scale (version 2).

    Returns:
        The :class:`~edgetorch.split.coded.CodeTables` to export with the student.

    Example:
        >>> save(student, "artifact", 96, code_tables=fit_payload_tables(student, train))  # doctest: +SKIP
    """
    was_training = model.training
    head, _ = split(model.eval())
    device = next(model.parameters()).device
    counts = None
    for x in data.tensors[0][:limit].split(batch_size):
        z = head(x.to(device))
        batch = fit_code_tables(quantize(z)[0] if steps is None else steps.quantize(z)).counts
        counts = batch if counts is None else counts + batch
    model.train(was_training)
    return CodeTables(counts, steps)


def file_offload(model: nn.Module, data: TensorDataset, color: str = "gray", mean: Sequence[float] = (0.0,),
                 std: Sequence[float] = (1.0,), jpeg_qualities: Sequence[int] = (JPEG_QUALITY,),
                 batch_size: int = EVAL_BATCH, webp_qualities: Sequence[int] = ()) -> dict[str, OffloadScore]:  # fmt: skip
    """Full offload of the same images: each sent as a PNG, JPEG or WebP file, and ``model`` on the decoded files.

    Each input is un-normalised to [0, 1] and rounded to 8 bits (the picture a device holds at the
    model's resolution), gray images as one channel; the file is encoded with PIL (PNG optimised,
    JPEG at each quality), decoded, normalised again and classified.

    Args:
        model: the unsplit model (the teacher).
        data: model inputs ``[N, 3, H, W]`` normalised with ``mean``/``std``, and labels.
        color: ``"gray"`` (the three channels are equal; the file has one) or ``"rgb"``.
        mean, std: the normalisation the inputs carry (one value or one per channel).
        jpeg_qualities: the JPEG qualities to compare.
        batch_size: images per forward pass.
        webp_qualities: lossy WebP qualities to compare (Pillow's libwebp, default method 4).

    Returns:
        An :class:`OffloadScore` per format: ``"png"``, then ``"jpeg{q}"`` per JPEG quality
        (``"jpeg90"``), then ``"webp{q}"`` per WebP quality.

    Raises:
        ValueError: an unknown color.
    """
    from PIL import Image

    if color not in ("gray", "rgb"):
        raise ValueError(f"color must be 'gray' or 'rgb', got {color!r}")
    images, labels = data.tensors
    m, s = torch.tensor(mean).view(1, -1, 1, 1), torch.tensor(std).view(1, -1, 1, 1)
    formats = [("png", {"format": "PNG", "optimize": True})]
    formats += [(f"jpeg{q}", {"format": "JPEG", "quality": q}) for q in jpeg_qualities]
    formats += [(f"webp{q}", {"format": "WEBP", "quality": q}) for q in webp_qualities]
    sizes: dict[str, list[int]] = {name: [] for name, _ in formats}
    correct = dict.fromkeys(sizes, 0)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    mode = "L" if color == "gray" else "RGB"
    for x, y in zip(images.split(batch_size), labels.split(batch_size)):
        pixels = ((x.cpu() * s + m).clamp(0, 1) * 255).round().to(torch.uint8)
        arrays = pixels[:, 0].numpy() if color == "gray" else pixels.permute(0, 2, 3, 1).numpy()
        for name, options in formats:
            decoded = []
            for array in arrays:
                buffer = io.BytesIO()
                Image.fromarray(array).save(buffer, **options)
                sizes[name].append(buffer.tell())
                buffer.seek(0)
                with Image.open(buffer) as image:
                    decoded.append(np.asarray(image.convert(mode)))
            back = torch.from_numpy(np.stack(decoded)).float() / 255  # [N, H, W] gray, [N, H, W, 3] rgb
            back = back[:, None] if color == "gray" else back.permute(0, 3, 1, 2)
            inputs = (back.expand(-1, 3, -1, -1) - m) / s
            with torch.inference_mode():
                correct[name] += int((model(inputs.to(device)).argmax(1).cpu() == y.cpu()).sum())
    model.train(was_training)
    return {name: OffloadScore(float(np.mean(sizes[name])), correct[name] / len(labels)) for name in sizes}
