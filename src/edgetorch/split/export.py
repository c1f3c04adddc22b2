"""Head/tail artifacts for deployment: two ``torch.export`` programs and a JSON manifest.

Why ``torch.export`` (``.pt2``) and not TorchScript or ONNX: ``torch.jit.trace``/``script`` are
deprecated in the PyTorch this project targets (2.14 warns on every call), ONNX needs onnx and
onnxruntime, which a device may not have; a ``.pt2`` program is PyTorch's supported deployment
format, holds the graph as JSON and the weights as raw tensor bytes (no pickled Python objects),
and runs with plain ``torch`` and no edgetorch or model source code on the device. The batch dim
is exported dynamic (1..``MAX_BATCH``), every other dim is fixed by the example input.

An artifact directory holds::

    head.pt2        device side: image [N, C, H, W] -> bottleneck [N, c, h, w]
    tail.pt2        server side: bottleneck -> logits [N, num_classes]
    manifest.json   what the two programs expect (see :class:`SplitManifest`) and their SHA-256

:func:`load` refuses a directory whose manifest is malformed, of an unknown version, or whose
files do not match the recorded hashes, so a server never serves a head/tail pair that was
swapped or half copied.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..zoo.weights import file_sha256
from . import payload

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
MAX_BATCH = 1024
_EXPORT_TOLERANCE = 1e-4  # exported vs eager output: the same kernels, so only reassociation differs


class SplitArtifactError(ValueError):
    """An artifact directory is missing a file, has a malformed manifest, or fails its hash check."""


@dataclass(frozen=True)
class Preprocess:
    """How the device turns an image file into the head's input.

    Attributes:
        size: (height, width) the image is resized to (bilinear, antialiased when shrinking).
        color: ``"gray"`` (converted to one channel, then repeated to the model's input channels,
            as the Fashion-MNIST teachers are trained) or ``"rgb"``.
        mean, std: per-channel normalisation applied after scaling pixels to [0, 1].
    """

    size: tuple[int, int]
    color: str = "gray"
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)


@dataclass(frozen=True)
class SplitManifest:
    """What ``manifest.json`` records about a head/tail pair.

    Attributes:
        arch: model spec the split model was built from (e.g. ``"torchvision:resnet18"``).
        channels: bottleneck channels C.
        split_point: where the bottleneck was injected (e.g. ``"sp2"``).
        input_shape: one sample's head input [C_in, H, W].
        bottleneck_shape: one sample's head output [C, h, w] (what a payload carries, per sample).
        num_classes: logits per sample.
        preprocess: how images become the input.
        files: name -> {"path", "sha256", "format"} for ``head`` and ``tail``.
        payload_format: codec name, version and whether scales are per sample.
        torch_version: the torch that exported the programs.
        manifest_version: version of this manifest layout.
    """

    arch: str
    channels: int
    split_point: str
    input_shape: tuple[int, ...]
    bottleneck_shape: tuple[int, ...]
    num_classes: int
    preprocess: Preprocess
    files: dict[str, dict[str, str]]
    payload_format: dict = field(default_factory=lambda: {
        "magic": payload.MAGIC.decode(), "version": payload.VERSION, "per_sample": True})
    torch_version: str = torch.__version__
    manifest_version: int = MANIFEST_VERSION

    def to_json(self) -> str:
        """The manifest as indented JSON."""
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> SplitManifest:
        """Parse and validate a manifest.

        Raises:
            SplitArtifactError: not JSON, unknown version, missing or mistyped fields.
        """
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SplitArtifactError(f"{MANIFEST_NAME} is not JSON ({exc})") from None
        if not isinstance(raw, dict) or raw.get("manifest_version") != MANIFEST_VERSION:
            version = raw.get("manifest_version") if isinstance(raw, dict) else None
            raise SplitArtifactError(
                f"{MANIFEST_NAME}: manifest_version {version!r} is not supported (expected {MANIFEST_VERSION})")
        try:
            manifest = cls(
                arch=str(raw["arch"]), channels=_positive(raw["channels"]),
                split_point=str(raw["split_point"]),
                input_shape=tuple(_positive(d) for d in raw["input_shape"]),
                bottleneck_shape=tuple(_positive(d) for d in raw["bottleneck_shape"]),
                num_classes=_positive(raw["num_classes"]),
                preprocess=Preprocess(size=tuple(_positive(d) for d in raw["preprocess"]["size"]),
                                      color=raw["preprocess"]["color"],
                                      mean=tuple(float(v) for v in raw["preprocess"]["mean"]),
                                      std=tuple(float(v) for v in raw["preprocess"]["std"])),
                files={k: {"path": str(v["path"]), "sha256": str(v["sha256"]), "format": str(v["format"])}
                       for k, v in raw["files"].items()},
                payload_format=dict(raw["payload_format"]), torch_version=str(raw["torch_version"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SplitArtifactError(f"{MANIFEST_NAME}: missing or malformed field ({exc!r})") from None
        if set(manifest.files) != {"head", "tail"}:
            raise SplitArtifactError(f"{MANIFEST_NAME}: files must list exactly head and tail, got {sorted(manifest.files)}")
        if manifest.preprocess.color not in ("gray", "rgb"):
            raise SplitArtifactError(f"{MANIFEST_NAME}: preprocess.color must be gray or rgb")
        if payload.MAGIC.decode() != manifest.payload_format.get("magic") or \
                manifest.payload_format.get("version") != payload.VERSION:
            raise SplitArtifactError(f"{MANIFEST_NAME}: payload format {manifest.payload_format} is not "
                                     f"{payload.MAGIC.decode()} version {payload.VERSION}")
        return manifest


def _positive(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected a positive integer, got {value!r}")
    return value


def _export_program(module: nn.Module, example: torch.Tensor, path: Path) -> nn.Module:
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
    return program.module()


def export_split(head: nn.Module, tail: nn.Module, out_dir: str | Path, *, arch: str, channels: int,
                 split_point: str, input_shape: tuple[int, int, int],
                 preprocess: Preprocess | None = None) -> SplitManifest:
    """Export a head and a tail as ``torch.export`` programs plus a manifest.

    Both modules are put in eval mode (batch-norm uses its running statistics, as in deployment),
    exported with a dynamic batch dim, and checked against the eager modules on a random input.

    Args:
        head: device-side module, input [N, *input_shape] -> bottleneck.
        tail: server-side module, bottleneck -> logits [N, K].
        out_dir: directory to write (created; existing files of the same names are replaced).
        arch, channels, split_point: recorded in the manifest.
        input_shape: one sample's input shape [C_in, H, W].
        preprocess: image preprocessing for the client; default: gray, resized to (H, W).

    Returns:
        The written :class:`SplitManifest`.

    Raises:
        SplitArtifactError: the exported programs disagree with the eager modules.

    Example:
        >>> export_split(head, tail, "artifacts", arch="torchvision:resnet18", channels=3,
        ...              split_point="sp2", input_shape=(3, 96, 96))  # doctest: +SKIP
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head, tail = head.eval(), tail.eval()
    # Batch 2: an example of batch 1 would let export specialise the batch dim to a constant.
    example = torch.rand(2, *input_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # not inference_mode: export cannot trace with inference tensors
        bottleneck = head(example)
        logits = tail(bottleneck)
    exported_head = _export_program(head, example, out / "head.pt2")
    exported_tail = _export_program(tail, bottleneck, out / "tail.pt2")
    with torch.no_grad():
        again = exported_tail(exported_head(example))
    if not torch.allclose(again, logits, atol=_EXPORT_TOLERANCE, rtol=_EXPORT_TOLERANCE):
        raise SplitArtifactError("the exported head/tail do not reproduce the eager modules' logits")
    files = {name: {"path": f"{name}.pt2", "sha256": file_sha256(out / f"{name}.pt2"),
                    "format": "torch.export"} for name in ("head", "tail")}
    manifest = SplitManifest(
        arch=arch, channels=channels, split_point=split_point, input_shape=tuple(input_shape),
        bottleneck_shape=tuple(bottleneck.shape[1:]), num_classes=int(logits.shape[1]),
        preprocess=preprocess or Preprocess(size=(input_shape[1], input_shape[2])), files=files)
    (out / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


def read_manifest(artifact_dir: str | Path) -> SplitManifest:
    """Read and validate ``DIR/manifest.json`` and check both files' SHA-256.

    Args:
        artifact_dir: a directory written by :func:`export_split`.

    Returns:
        The :class:`SplitManifest`.

    Raises:
        SplitArtifactError: missing directory/file, malformed manifest, or a hash mismatch.
    """
    root = Path(artifact_dir)
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise SplitArtifactError(f"{root}: no {MANIFEST_NAME}; export one with `edgetorch split export`")
    manifest = SplitManifest.from_json(path.read_text())
    for name, entry in manifest.files.items():
        file = root / entry["path"]
        if Path(entry["path"]).is_absolute() or ".." in Path(entry["path"]).parts:
            raise SplitArtifactError(f"{MANIFEST_NAME}: {name} path {entry['path']!r} must stay inside {root}")
        if not file.is_file():
            raise SplitArtifactError(f"{root}: {name} file {entry['path']} is missing")
        if file_sha256(file) != entry["sha256"]:
            raise SplitArtifactError(f"{file}: SHA-256 does not match the manifest (modified or swapped)")
    return manifest


def load_part(artifact_dir: str | Path, part: str) -> tuple[nn.Module, SplitManifest]:
    """Load one verified program (``"head"`` or ``"tail"``) and the manifest.

    Args:
        artifact_dir: a directory written by :func:`export_split`.
        part: ``"head"`` (the device needs only this) or ``"tail"`` (the server).

    Returns:
        ``(module, manifest)``; the module runs on CPU.
    """
    if part not in ("head", "tail"):
        raise ValueError(f"part must be 'head' or 'tail', got {part!r}")
    manifest = read_manifest(artifact_dir)
    return _load_program(artifact_dir, manifest, part), manifest


def _load_program(artifact_dir: str | Path, manifest: SplitManifest, part: str) -> nn.Module:
    return torch.export.load(str(Path(artifact_dir) / manifest.files[part]["path"])).module()


def load(artifact_dir: str | Path) -> tuple[nn.Module, nn.Module]:
    """Load a verified head and tail from an artifact directory.

    Args:
        artifact_dir: a directory written by :func:`export_split` / ``edgetorch split export``.

    Returns:
        ``(head, tail)`` modules.

    Raises:
        SplitArtifactError: see :func:`read_manifest`.

    Example:
        >>> head, tail = load("artifacts")  # doctest: +SKIP
        >>> logits = tail(head(images))  # doctest: +SKIP
    """
    manifest = read_manifest(artifact_dir)
    return _load_program(artifact_dir, manifest, "head"), _load_program(artifact_dir, manifest, "tail")


def export_model(model: nn.Module, out_dir: str | Path, resolution: int,
                 preprocess: Preprocess | None = None) -> SplitManifest:
    """Export a :class:`~edgetorch.split.bottleneck.BottleneckModel`'s head and tail.

    Args:
        model: a bottleneck-injected student (``inject_bottleneck``), trained or not.
        out_dir: artifact directory to write.
        resolution: input height = width (a multiple of ``model.input_multiple``).
        preprocess: image preprocessing for the client; default: gray images at ``resolution``.

    Returns:
        The written :class:`SplitManifest`.

    Raises:
        ValueError: ``resolution`` does not suit the model's strides.
    """
    from .bottleneck import split

    if resolution % model.input_multiple:
        raise ValueError(f"resolution must be a multiple of {model.input_multiple} for this model, got {resolution}")
    head, tail = split(model)
    return export_split(head, tail, out_dir, arch=f"torchvision:{model.arch}", channels=model.channels,
                        split_point=model.split_point, input_shape=(3, resolution, resolution),
                        preprocess=preprocess)
