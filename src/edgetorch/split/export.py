"""Head/tail artifacts that load without running code: safetensors weights and a JSON manifest.

An artifact directory holds::

    manifest.json       the architecture as data (a :meth:`BottleneckModel.spec`), shapes,
                        preprocessing, payload format, each file's SHA-256, an optional HMAC
    head.safetensors    device side weights: image [N, 3, H, W] -> bottleneck [N, C, h, w]
    tail.safetensors    server side weights: bottleneck -> logits [N, K]
    head.onnx           optional (``onnx=True``): the head for devices that run onnxruntime
    code_tables.safetensors  optional (``code_tables=``): one table of the 8-bit codes per bottleneck
                        channel; payloads are then entropy-coded (version 2, :mod:`.coded`)

Why not ``torch.export`` (``.pt2``, this module's first format) or TorchScript: both loaders
unpickle (``torch.export.load`` reads its weights with ``weights_only=False``), so a crafted file
runs code on the machine that loads it, and a hash stored beside the file does not stop whoever
can rewrite both. Here nothing is unpickled: weights are safetensors (a JSON header and raw
bytes), and the layers are rebuilt by :func:`~edgetorch.split.bottleneck.rebuild`, which calls
only torchvision constructors of the accepted architectures. The layers are first built on the
``meta`` device, so a manifest that asks for absurd sizes costs no memory, and every manifest
field is checked against them (shapes, classes, split point) before any weight is read.

Trust model:

* The SHA-256 of each file catches corruption and a head/tail pair that was swapped or half
  copied; it does not stop tampering, since the manifest sits beside the files.
* With a key (``key=...``, ``--key-env`` on the CLI), export adds an HMAC-SHA256 of the
  manifest, which covers the file hashes. A loader given the key refuses an unsigned or
  altered artifact. Use it whenever the directory crosses a machine or a user boundary.
* Paths are plain file names in the directory; symlinks are refused, and each file's bytes are
  hashed and parsed from one read, so a file swapped between check and load is caught.

The input size is fixed at export (``resolution``): the loaded head refuses another size with an
error that names both, and the client resizes images to it.

Example:
    >>> import torchvision, edgetorch.split as es
    >>> student = es.inject_bottleneck(torchvision.models.resnet18(num_classes=10), channels=3)
    >>> manifest = es.save(student, "artifact", resolution=224)  # doctest: +SKIP
    >>> head, tail = es.load("artifact")  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from .artifact import load_deployed
from .bottleneck import BottleneckModel
from .coded import CodeTables
from .manifest import (CODE_TABLES, CODED_PAYLOAD, FILE_NAMES, STEPS_PAYLOAD, FORMAT, FORMATS, MANIFEST_NAME, MAX_RESOLUTION, ONNX,
                       PARTS, PLAIN_PAYLOAD, Preprocess, SplitArtifactError, SplitManifest, check_class_names,
                       key_bytes, manifest_hmac)
from .onnx_head import check_onnx, onnx_bytes

# Loaded vs eager modules: the same kernels on the same weights, so they agree to float rounding;
# ONNX Runtime's kernels differ more.
_EXPORT_TOLERANCE = 1e-5


def save(model: BottleneckModel, out_dir: str | Path, resolution: int = 224,
                 preprocess: Preprocess | None = None, *, class_names: Sequence[str] | None = None,
                 key: bytes | str | None = None, onnx: bool = False,
                 code_tables: CodeTables | None = None) -> SplitManifest:
    """Write a student's head and tail as safetensors plus a verified manifest.

    The files are written, then loaded back the way a server would, and the loaded split must
    reproduce the eager model's logits. The model's train/eval mode is left as it was.

    Args:
        model: a bottleneck-injected student (:func:`~edgetorch.split.inject_bottleneck`).
        out_dir: artifact directory (created; the artifact's own file names are replaced).
        resolution: input height = width the head is exported for (a multiple of
            ``model.input_multiple``); 224 is what torchvision models are trained at.
        preprocess: image preprocessing for the client; default: gray images at ``resolution``.
        class_names: one name per class, for the client's predictions.
        key: sign the manifest with HMAC-SHA256 (at least 16 bytes; read it from the environment,
            never from the command line).
        onnx: also write ``head.onnx`` (needs the ``onnx`` extra: onnx and onnxscript; checked
            against the eager head with onnxruntime when that is installed).
        code_tables: the bottleneck's code tables (:func:`~edgetorch.split.coded.fit_code_tables`
            on the codes of training images): devices then send entropy-coded payloads, which the
            server decodes with the same tables.

    Returns:
        The written :class:`SplitManifest`.

    Raises:
        TypeError: ``model`` is not a :class:`BottleneckModel`.
        ValueError: ``resolution`` does not suit the model, a bad preprocess or key, or code tables
            for another number of channels.
        SplitArtifactError: ``out_dir`` is a file, or the loaded split disagrees with the model.

    Example:
        >>> save(student, "r18_c12", 224, key=os.environ["SPLIT_KEY"])  # doctest: +SKIP
    """
    from safetensors.torch import save as serialize

    if not isinstance(model, BottleneckModel):
        raise TypeError(f"save takes a BottleneckModel (see inject_bottleneck), got {type(model).__name__}")
    if isinstance(resolution, bool) or not isinstance(resolution, int) or not \
            0 < resolution <= MAX_RESOLUTION or resolution % model.input_multiple:
        raise ValueError(f"resolution must be a multiple of {model.input_multiple} for this model, "
                         f"at most {MAX_RESOLUTION}, got {resolution!r}")
    preprocess = preprocess or Preprocess(size=(resolution, resolution))
    preprocess.check(3)
    if preprocess.size != (resolution, resolution):
        raise ValueError(f"preprocess.size {preprocess.size} must be the export resolution {resolution}")
    if key is not None:
        key_bytes(key)
    class_names = None if class_names is None else tuple(class_names)
    check_class_names(class_names, model.spec()["num_classes"])
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise SplitArtifactError(f"{out} is a file; give a directory for the artifact")
    out.mkdir(parents=True, exist_ok=True)
    example = torch.rand(2, 3, resolution, resolution, generator=torch.Generator().manual_seed(0))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            bottleneck = model.head(example)
            expected = model.tail(bottleneck)
        blobs = {part: serialize(_state(getattr(model, part)), metadata={"part": part, "format": FORMAT})
                 for part in PARTS}
        if onnx:
            blobs[ONNX] = onnx_bytes(model.head, example)
        if code_tables is not None:
            if code_tables.channels != bottleneck.shape[1]:
                raise ValueError(f"the code tables cover {code_tables.channels} channels; this bottleneck has "
                                 f"{bottleneck.shape[1]}: fit them on this model's codes")
            if code_tables.steps is not None and code_tables.steps.sample_shape != tuple(bottleneck.shape[1:]):
                raise ValueError(f"the code tables' fixed steps are for bottlenecks of shape "
                                 f"{code_tables.steps.sample_shape}; this one at {resolution} px is "
                                 f"{tuple(bottleneck.shape[1:])}: export at the resolution the student trained at")
            blobs[CODE_TABLES] = serialize(code_tables.to_tensors(), metadata={"part": CODE_TABLES, "format": FORMAT})
    finally:
        model.train(was_training)
    for stale in set(FILE_NAMES) - set(blobs):
        (out / FILE_NAMES[stale]).unlink(missing_ok=True)
    for part, blob in blobs.items():
        _write_new(out / FILE_NAMES[part], blob)
    manifest = SplitManifest(
        model=model.spec(), input_shape=(3, resolution, resolution),
        bottleneck_shape=tuple(bottleneck.shape[1:]),
        num_classes=int(expected.shape[1]), preprocess=preprocess, class_names=class_names,
        files={part: {"path": FILE_NAMES[part], "sha256": hashlib.sha256(blob).hexdigest(),
                      "format": FORMATS[part]} for part, blob in blobs.items()},
        payload_format=dict(PLAIN_PAYLOAD if code_tables is None
                            else CODED_PAYLOAD if code_tables.steps is None else STEPS_PAYLOAD))
    if key is not None:
        manifest = replace(manifest, signature=manifest_hmac(manifest, key))
    _write_new(out / MANIFEST_NAME, manifest.to_json().encode())
    deployed, _ = load_deployed(out, key=key)  # the tables too, where written
    head, tail = deployed.head, deployed.tail
    with torch.no_grad():
        again = tail(head(example))
    if not torch.allclose(again, expected, atol=_EXPORT_TOLERANCE, rtol=_EXPORT_TOLERANCE):
        raise SplitArtifactError("the loaded head/tail do not reproduce the model's logits")
    if onnx:
        check_onnx(out, key, example, bottleneck)
    return manifest


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    # Copies: safetensors refuses tensors that share memory, and a view would save its whole base.
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in module.state_dict().items()}


def _write_new(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name, then rename: a reader never sees half a file, and a
    symlink planted at ``path`` is replaced, never followed."""
    temporary = path.with_name(path.name + ".partial")
    temporary.unlink(missing_ok=True)
    with open(temporary, "xb") as f:
        f.write(data)
    os.replace(temporary, path)
