"""Head/tail artifacts that load without running code: safetensors weights and a JSON manifest.

An artifact directory holds::

    manifest.json       the architecture as data (a :meth:`BottleneckModel.spec`), shapes,
                        preprocessing, payload format, each file's SHA-256, an optional HMAC
    head.safetensors    device side weights: image [N, 3, H, W] -> bottleneck [N, C, h, w]
    tail.safetensors    server side weights: bottleneck -> logits [N, K]
    head.onnx           optional (``onnx=True``): the head for devices that run onnxruntime

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

import contextlib
import hashlib
import hmac
import io
import json
import math
import os
import unicodedata
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import __version__
from .._files import InputFileError, open_regular, read_bytes
from . import payload
from .bottleneck import BottleneckModel, rebuild

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 2
FORMAT = "edgetorch-split"
MAX_BATCH = 1024  # the ONNX head's declared batch range (the eager modules take any batch)
MAX_RESOLUTION = 4096  # input height/width a manifest may declare (the head is run on it to check shapes)
_MAX_MANIFEST_BYTES = 1 << 20
# The largest head or tail an artifact may declare, checked on meta layers before any file is read.
# The largest accepted teacher's tail (resnet152 with 100,000 classes) needs 1.05 GB; ImageNet-21k classes, 0.41 GB.
MAX_PART_BYTES = 2 << 30
_MIN_KEY_BYTES = 16  # an HMAC key shorter than this is guessable; RFC 2104 advises >= the hash's 32
_PARTS = ("head", "tail")
_UNPRINTABLE = frozenset({"Cc", "Cf", "Zl", "Zp"})  # controls, format (bidi) and line/paragraph separators
_ONNX = "head_onnx"
_FILE_NAMES = {"head": "head.safetensors", "tail": "tail.safetensors", _ONNX: "head.onnx"}
_FORMATS = {"head": "safetensors", "tail": "safetensors", _ONNX: "onnx"}
# Loaded vs eager modules: the same kernels on the same weights, so they agree to float rounding;
# ONNX Runtime's kernels differ more.
_EXPORT_TOLERANCE = 1e-5
_ONNX_TOLERANCE = 1e-3


class SplitArtifactError(InputFileError):
    """An artifact directory is incomplete, malformed, tampered with, or fails a check."""


@dataclass(frozen=True)
class Preprocess:
    """How the device turns an image file into the head's input.

    Attributes:
        size: (height, width) the image is resized to (bilinear, antialiased when shrinking).
        color: ``"gray"`` (converted to one channel, then repeated to the model's input channels,
            as the Fashion-MNIST teachers are trained) or ``"rgb"``.
        mean, std: per-channel normalisation applied after scaling pixels to [0, 1]
            (one value, or one per input channel).
    """

    size: tuple[int, int]
    color: str = "gray"
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)

    def check(self, channels: int) -> None:
        """Raise ``ValueError`` unless this preprocessing can feed ``channels`` input channels."""
        if self.color not in ("gray", "rgb"):
            raise ValueError(f"preprocess.color must be 'gray' or 'rgb', got {self.color!r}")
        for name, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, channels):
                raise ValueError(f"preprocess.{name} needs 1 or {channels} values, got {len(values)}")
            if not all(math.isfinite(v) for v in values):
                raise ValueError(f"preprocess.{name} must be finite, got {list(values)}")
        if not all(v > 0 for v in self.std):
            raise ValueError(f"preprocess.std must be > 0 (it divides), got {list(self.std)}")


@dataclass(frozen=True)
class SplitManifest:
    """What ``manifest.json`` records about a head/tail pair.

    Attributes:
        model: the student's architecture as data (:meth:`BottleneckModel.spec`).
        input_shape: one sample's head input [3, H, W].
        bottleneck_shape: one sample's head output [C, h, w] (what a payload carries, per sample).
        num_classes: logits per sample.
        preprocess: how images become the input.
        files: part -> {"path", "sha256", "format"} for ``head``, ``tail`` and optionally
            ``head_onnx``.
        payload_format: codec name, version and whether scales are per sample.
        torch_version, edgetorch_version: what exported it (information only).
        class_names: one name per class, or None (the client then prints class indices).
        signature: hex HMAC-SHA256 of the rest of the manifest, when exported with a key.
        manifest_version: version of this manifest layout.
    """

    model: dict[str, Any]
    input_shape: tuple[int, ...]
    bottleneck_shape: tuple[int, ...]
    num_classes: int
    preprocess: Preprocess
    files: dict[str, dict[str, str]]
    payload_format: dict = field(default_factory=lambda: {
        "magic": payload.MAGIC.decode(), "version": payload.VERSION, "per_sample": True})
    torch_version: str = torch.__version__
    edgetorch_version: str = __version__
    class_names: tuple[str, ...] | None = None
    signature: str | None = None
    manifest_version: int = MANIFEST_VERSION
    format: str = FORMAT

    @property
    def arch(self) -> str:
        """The teacher as a model spec, e.g. ``"torchvision:resnet18"``."""
        return f"torchvision:{self.model['arch']}"

    @property
    def channels(self) -> int:
        """Bottleneck channels C."""
        return int(self.model["channels"])

    @property
    def split_point(self) -> str:
        """Where the bottleneck sits (``"sp1"``, ``"sp2"``, ``"ae"``)."""
        return str(self.model["split_point"])

    def to_json(self) -> str:
        """The manifest as indented JSON."""
        return json.dumps(asdict(self), indent=2) + "\n"

    @property
    def artifact_id(self) -> str:
        """The SHA-256 of :meth:`signed_bytes`: it names this artifact exactly, since the manifest
        holds every file's hash. Pin it (``expect_id``, ``--expect-id``) so that another artifact,
        even one validly signed with the same key, is refused in its place."""
        return hashlib.sha256(self.signed_bytes()).hexdigest()

    def signed_bytes(self) -> bytes:
        """The bytes an HMAC covers: every field but the signature, as canonical JSON."""
        body = asdict(self)
        body.pop("signature")
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, text: str) -> SplitManifest:
        """Parse and validate a manifest's fields (types and ranges; not yet the files).

        Raises:
            SplitArtifactError: not JSON, another version, missing, unknown or mistyped fields.
        """
        try:
            raw = json.loads(text)
        # ValueError, not only JSONDecodeError: an integer of over 4300 digits raises a plain one.
        except (ValueError, RecursionError) as exc:
            raise SplitArtifactError(f"{MANIFEST_NAME} is not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise SplitArtifactError(f"{MANIFEST_NAME} must hold a JSON object, got {type(raw).__name__}")
        version = raw.get("manifest_version")
        integer = type(version) is int  # 2.0 == 2 and True == 1: only a JSON integer is a version
        if integer and version == 1:
            raise SplitArtifactError(
                f"{MANIFEST_NAME}: version 1 artifacts hold torch.export programs, whose loader "
                "unpickles and can run code; they are no longer read. Export again with "
                "`edgetorch split export` (same checkpoint) to get safetensors weights")
        if not integer or version != MANIFEST_VERSION or raw.get("format") != FORMAT:
            raise SplitArtifactError(f"{MANIFEST_NAME}: format {raw.get('format')!r} version {version!r} is not "
                                     f"supported (expected {FORMAT!r} version {MANIFEST_VERSION})")
        expected = {f.name for f in cls.__dataclass_fields__.values()}
        if set(raw) != expected:
            raise SplitArtifactError(f"{MANIFEST_NAME}: fields {sorted(set(raw) ^ expected)} are missing or "
                                     f"unknown (expected exactly {sorted(expected)})")
        try:
            prep = raw["preprocess"]
            if not isinstance(prep, dict) or set(prep) != {"size", "color", "mean", "std"}:
                raise ValueError("preprocess needs exactly size, color, mean, std")
            files = raw["files"]
            if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
                raise ValueError("files must map each part to {path, sha256, format}")
            manifest = cls(
                model=_plain_dict(raw["model"]),
                input_shape=_shape(raw["input_shape"], 3),
                bottleneck_shape=_shape(raw["bottleneck_shape"], 3),
                num_classes=_positive(raw["num_classes"]),
                preprocess=Preprocess(size=_shape(prep["size"], 2), color=_text(prep["color"]),
                                      mean=_floats(prep["mean"]), std=_floats(prep["std"])),
                files={str(k): {"path": _text(v["path"]), "sha256": _text(v["sha256"]),
                                "format": _text(v["format"])} for k, v in files.items()},
                payload_format=_plain_dict(raw["payload_format"]),
                torch_version=_text(raw["torch_version"]), edgetorch_version=_text(raw["edgetorch_version"]),
                class_names=None if raw["class_names"] is None else _texts(raw["class_names"]),
                signature=None if raw["signature"] is None else _text(raw["signature"]),
            )
            _check_class_names(manifest.class_names, manifest.num_classes)
            manifest.preprocess.check(manifest.input_shape[0])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SplitArtifactError(f"{MANIFEST_NAME}: missing or malformed field ({exc})") from None
        if not set(_PARTS) <= set(manifest.files) <= {*_PARTS, _ONNX}:
            raise SplitArtifactError(f"{MANIFEST_NAME}: files must list head and tail (and optionally "
                                     f"{_ONNX}), got {sorted(manifest.files)}")
        for part, entry in manifest.files.items():
            if entry["path"] != _FILE_NAMES[part] or entry["format"] != _FORMATS[part]:
                raise SplitArtifactError(f"{MANIFEST_NAME}: {part} must be {_FILE_NAMES[part]} in format "
                                         f"{_FORMATS[part]}, got {entry['path']!r} ({entry['format']!r})")
        if manifest.payload_format != SplitManifest.__dataclass_fields__["payload_format"].default_factory():
            raise SplitArtifactError(f"{MANIFEST_NAME}: payload format {manifest.payload_format} is not "
                                     f"{payload.MAGIC.decode()} version {payload.VERSION}, per sample")
        if max(manifest.input_shape[1:]) > MAX_RESOLUTION or manifest.input_shape[1:] != manifest.preprocess.size:
            raise SplitArtifactError(f"{MANIFEST_NAME}: input_shape {list(manifest.input_shape)} must match "
                                     f"preprocess.size {list(manifest.preprocess.size)}, at most {MAX_RESOLUTION} px")
        return manifest


def _check_class_names(names: Sequence[str] | None, num_classes: int) -> None:
    if names is None:
        return
    if len(names) != num_classes or not all(isinstance(n, str) and 0 < len(n) <= 200 for n in names):
        raise ValueError(f"class_names must be {num_classes} non-empty strings of at most 200 characters, "
                         f"got {len(names)}")
    for name in names:
        # Names are printed to the device's terminal: an ANSI escape was written raw to it, a
        # newline forged output lines, and a bidi override can reorder what the user reads.
        bad = next((c for c in name if unicodedata.category(c) in _UNPRINTABLE), None)
        if bad is not None:
            raise ValueError(f"class name {name!r} holds the control character U+{ord(bad):04X}; class names "
                             "must be printable text (letters, digits, spaces, punctuation)")


def _positive(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected a positive integer, got {value!r}")
    return value


def _shape(value: object, ndim: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) != ndim:
        raise ValueError(f"expected a list of {ndim} positive integers, got {value!r}")
    return tuple(_positive(d) for d in value)


def _floats(value: object) -> tuple[float, ...]:
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"expected a list of numbers, got {value!r}")
    return tuple(float(v) for v in value)


def _texts(value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of strings, got {value!r}")
    return tuple(_text(v) for v in value)


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    # JSON's "\ud800" is a lone surrogate, not text: as a class name it made `split infer` die
    # with UnicodeEncodeError when printing predictions. (UnicodeEncodeError is a ValueError.)
    value.encode("utf-8")
    return value


def _plain_dict(value: object) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"expected an object, got {value!r}")
    return dict(value)


def _key_bytes(key: bytes | str) -> bytes:
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) < _MIN_KEY_BYTES:
        raise ValueError(f"an HMAC key needs at least {_MIN_KEY_BYTES} bytes, got {len(raw)}; "
                         "generate one with `python -c 'import secrets; print(secrets.token_hex(32))'`")
    return raw


def _signature(manifest: SplitManifest, key: bytes | str) -> str:
    return hmac.new(_key_bytes(key), manifest.signed_bytes(), hashlib.sha256).hexdigest()


class CheckedInput(nn.Module):
    """A loaded head or tail that refuses inputs of another per-sample shape than exported.

    Attributes:
        module: the head or tail.
        sample_shape: the per-sample input shape it was exported for.
    """

    def __init__(self, module: nn.Module, sample_shape: tuple[int, ...], what: str):
        super().__init__()
        self.module, self.sample_shape, self._what = module, tuple(sample_shape), what

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != len(self.sample_shape) + 1 or tuple(x.shape[1:]) != self.sample_shape:
            want = ", ".join(map(str, self.sample_shape))
            hint = (f": resize images to {self.sample_shape[1]}x{self.sample_shape[2]} (the split client "
                    "does), or export again at this resolution") if self._what == "head" else ""
            raise ValueError(f"this {self._what} was exported for inputs [N, {want}], got {list(x.shape)}{hint}")
        return self.module(x)


def save(model: BottleneckModel, out_dir: str | Path, resolution: int = 224,
                 preprocess: Preprocess | None = None, *, class_names: Sequence[str] | None = None,
                 key: bytes | str | None = None, onnx: bool = False) -> SplitManifest:
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

    Returns:
        The written :class:`SplitManifest`.

    Raises:
        TypeError: ``model`` is not a :class:`BottleneckModel`.
        ValueError: ``resolution`` does not suit the model, or a bad preprocess or key.
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
        _key_bytes(key)
    class_names = None if class_names is None else tuple(class_names)
    _check_class_names(class_names, model.spec()["num_classes"])
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
                 for part in _PARTS}
        if onnx:
            blobs[_ONNX] = _onnx_bytes(model.head, example)
    finally:
        model.train(was_training)
    for stale in set(_FILE_NAMES) - set(blobs):
        (out / _FILE_NAMES[stale]).unlink(missing_ok=True)
    for part, blob in blobs.items():
        _write_new(out / _FILE_NAMES[part], blob)
    manifest = SplitManifest(
        model=model.spec(), input_shape=(3, resolution, resolution),
        bottleneck_shape=tuple(bottleneck.shape[1:]),
        num_classes=int(expected.shape[1]), preprocess=preprocess, class_names=class_names,
        files={part: {"path": _FILE_NAMES[part], "sha256": hashlib.sha256(blob).hexdigest(),
                      "format": _FORMATS[part]} for part, blob in blobs.items()})
    if key is not None:
        manifest = replace(manifest, signature=_signature(manifest, key))
    _write_new(out / MANIFEST_NAME, manifest.to_json().encode())
    head, tail = load(out, key=key)
    with torch.no_grad():
        again = tail(head(example))
    if not torch.allclose(again, expected, atol=_EXPORT_TOLERANCE, rtol=_EXPORT_TOLERANCE):
        raise SplitArtifactError("the loaded head/tail do not reproduce the model's logits")
    if onnx:
        _check_onnx(out, key, example, bottleneck)
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


def _onnx_bytes(head: nn.Module, example: torch.Tensor) -> bytes:
    import importlib.util

    if importlib.util.find_spec("onnxscript") is None:  # torch.onnx's exporter needs it: fail with the fix
        raise ImportError("ONNX export needs the onnx extra: pip install 'edgetorch[onnx]'")
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its progress
        program = torch.onnx.export(head, (example,), dynamic_shapes=({0: batch},), dynamo=True,
                                    input_names=["image"], output_names=["bottleneck"], verbose=False)
    return program.model_proto.SerializeToString()


def _check_onnx(out: Path, key: bytes | str | None, example: torch.Tensor, bottleneck: torch.Tensor) -> None:
    try:
        session, _ = load_onnx_head(out, key=key)
    except ImportError:
        return  # export needs only onnx; the check runs where onnxruntime is installed too
    if not torch.allclose(session(example), bottleneck, atol=_ONNX_TOLERANCE, rtol=_ONNX_TOLERANCE):
        raise SplitArtifactError("head.onnx does not reproduce the head's bottleneck under onnxruntime")


def read_manifest(artifact_dir: str | Path, key: bytes | str | None = None, *,
                  expect_id: str | None = None) -> SplitManifest:
    """Read and validate ``DIR/manifest.json``, its signature when a key is given, and every file's hash.

    Args:
        artifact_dir: a directory written by :func:`save`.
        key: the HMAC key the artifact was signed with; when given, an unsigned or altered
            manifest is refused.
        expect_id: the :attr:`SplitManifest.artifact_id` this must be (printed by export);
            any other artifact is refused, signed or not.

    Returns:
        The :class:`SplitManifest`, its shapes checked against the layers it describes.

    Raises:
        SplitArtifactError: missing directory or file, a symlink, a malformed manifest, a bad
            signature, a file larger than the model's weights need, or a hash mismatch.
    """
    manifest = _signed_manifest(Path(artifact_dir), key, expect_id)
    model = _skeleton(manifest)  # meta layers: what bounds each file's size before it is read
    for part in manifest.files:
        _verified_bytes(Path(artifact_dir), manifest, part, model)
    return manifest


def _signed_manifest(root: Path, key: bytes | str | None, expect_id: str | None) -> SplitManifest:
    """The parsed manifest, its HMAC checked when a key is given and its id when one is expected
    (the files are checked as read)."""
    if expect_id is not None:
        check_artifact_id(expect_id)
    if not root.is_dir():
        raise SplitArtifactError(f"{root} is not a directory; export one with `edgetorch split export`")
    manifest = SplitManifest.from_json(read_bytes(root / MANIFEST_NAME, _MAX_MANIFEST_BYTES, error=SplitArtifactError, follow_symlinks=False).decode("utf-8", "replace"))
    if key is not None:
        if manifest.signature is None:
            raise SplitArtifactError(f"{root}: the manifest is not signed, but a key was given; export it "
                                     "again with the key (--key-env) or load it without one")
        # Bytes: compare_digest raises TypeError for a str signature with non-ASCII characters.
        if not hmac.compare_digest(manifest.signature.encode("utf-8", "replace"), _signature(manifest, key).encode()):
            raise SplitArtifactError(f"{root}: the manifest's HMAC does not match this key (tampered, or "
                                     "signed with another key)")
    if expect_id is not None and not hmac.compare_digest(manifest.artifact_id, expect_id):
        raise SplitArtifactError(f"{root} is artifact {manifest.artifact_id}, not the expected {expect_id}: "
                                 "another artifact was put in its place (or the expected id is out of date)")
    return manifest


def check_artifact_id(artifact_id: object) -> None:
    """Raise ``ValueError`` unless ``artifact_id`` is an id as export prints it (64 lowercase hex digits)."""
    if not isinstance(artifact_id, str) or len(artifact_id) != 64 or artifact_id.strip("0123456789abcdef"):
        raise ValueError(f"an artifact id is the 64 lowercase hex digits `edgetorch split export` prints, "
                         f"got {artifact_id!r}")


def _verified_bytes(root: Path, manifest: SplitManifest, part: str, model: BottleneckModel) -> bytes:
    """A part's bytes, checked against the manifest's SHA-256 before they are held in memory.

    The file is hashed in chunks first: a file of the right size class but the wrong bytes (a
    sparse 1 GiB file beside an unsigned manifest) is refused in bounded memory. Only then are the
    bytes read and hashed again (what is parsed is what was hashed, even if the file changed)."""
    entry = manifest.files[part]
    path = root / entry["path"]
    high = _size_limit(model, part)
    with open_regular(path, high, error=SplitArtifactError, follow_symlinks=False,
                      why=f" for this manifest's model: the {part} weights do not fit the manifest's model "
                      "(head and tail swapped, or another model)") as f:
        streamed = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            streamed.update(chunk)
        _check_digest(path, streamed, entry)
        f.seek(0)
        data = f.read(high + 1)
    if len(data) > high:
        raise SplitArtifactError(f"{path} grew past the {high}-byte limit while it was read")
    _check_digest(path, hashlib.sha256(data), entry)
    return data


def _check_digest(path: Path, digest: Any, entry: dict[str, str]) -> None:
    # Bytes, not str: compare_digest raises TypeError for a str with non-ASCII characters.
    if not hmac.compare_digest(digest.hexdigest().encode(), entry["sha256"].encode("utf-8", "replace")):
        raise SplitArtifactError(f"{path}: SHA-256 does not match the manifest (modified or swapped)")


def _size_limit(model: BottleneckModel, part: str) -> int:
    """The most bytes ``part``'s file may have for this model: its weights, plus room for the
    header (safetensors) or graph (ONNX). Without the upper bound a sparse file of 1 TB
    beside a tiny manifest was read into memory whole (MemoryError, or all of RAM) before any
    check; :func:`_skeleton` has already refused a model over :data:`MAX_PART_BYTES`."""
    weights = _weight_bytes(model, part)  # meta tensors: no memory
    if part == _ONNX:
        return 2 * weights + (16 << 20)
    return weights + (1 << 20) + 1024 * len(_part(model, part).state_dict())


def _part(model: BottleneckModel, part: str) -> nn.Module:
    return model.tail if part == "tail" else model.head


def _weight_bytes(model: BottleneckModel, part: str) -> int:
    return sum(t.numel() * t.element_size() for t in _part(model, part).state_dict().values())


def _skeleton(manifest: SplitManifest) -> BottleneckModel:
    """The manifest's layers on the meta device (no memory), checked against its shapes."""
    try:
        with torch.device("meta"):
            model = rebuild(manifest.model).eval()
            bottleneck = model.head(torch.empty(1, *manifest.input_shape))
            logits = model.tail(bottleneck)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise SplitArtifactError(f"{MANIFEST_NAME}: model {manifest.model} with input "
                                 f"{list(manifest.input_shape)} cannot be built ({exc})") from None
    if tuple(bottleneck.shape[1:]) != manifest.bottleneck_shape or manifest.bottleneck_shape[0] != manifest.channels:
        raise SplitArtifactError(f"{MANIFEST_NAME}: bottleneck_shape {list(manifest.bottleneck_shape)} is not "
                                 f"what the model gives at this input ({list(bottleneck.shape[1:])})")
    if logits.shape[1] != manifest.num_classes:
        raise SplitArtifactError(f"{MANIFEST_NAME}: num_classes {manifest.num_classes} is not the model's "
                                 f"{logits.shape[1]}")
    for part in _PARTS:
        if _weight_bytes(model, part) > MAX_PART_BYTES:
            raise SplitArtifactError(f"{MANIFEST_NAME}: the {part} of model {manifest.model} needs "
                                     f"{_weight_bytes(model, part)} bytes of weights, over the {MAX_PART_BYTES} "
                                     "an artifact part may have")
    return model


def _load_weights(root: Path, manifest: SplitManifest, model: BottleneckModel, part: str) -> nn.Module:
    from ..zoo.weights import CheckpointError, tensors_from_bytes

    data = _verified_bytes(root, manifest, part, model)
    try:
        tensors = tensors_from_bytes(data, root / manifest.files[part]["path"])
    except CheckpointError as exc:
        raise SplitArtifactError(str(exc)) from None
    module: nn.Module = getattr(model, part)
    wanted = module.state_dict()
    if set(tensors) != set(wanted):
        missing, extra = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
        raise SplitArtifactError(f"{part} weights do not fit the manifest's model: missing {missing[:5]}, "
                                 f"unexpected {extra[:5]} (head and tail swapped, or another model)")
    for name, tensor in tensors.items():
        if tensor.shape != wanted[name].shape or tensor.dtype != wanted[name].dtype:
            raise SplitArtifactError(f"{part} weight {name} is {tensor.dtype} {list(tensor.shape)}, the model "
                                     f"needs {wanted[name].dtype} {list(wanted[name].shape)}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise SplitArtifactError(f"{part} weight {name} holds inf or NaN")
    module.load_state_dict(tensors, strict=True, assign=True)
    shape = manifest.input_shape if part == "head" else manifest.bottleneck_shape
    return CheckedInput(module.eval(), shape, part)


def load_part(artifact_dir: str | Path, part: str, key: bytes | str | None = None, *,
              expect_id: str | None = None) -> tuple[nn.Module, SplitManifest]:
    """Load one verified side (``"head"`` for the device, ``"tail"`` for the server) and the manifest.

    Only that side's file is read (a device needs no tail file) and only its weights allocated.

    Args:
        artifact_dir: a directory written by :func:`save`.
        part: ``"head"`` or ``"tail"``.
        key: the HMAC key, if the artifact was signed (see :func:`read_manifest`).
        expect_id: the artifact id this must be (see :func:`read_manifest`).

    Returns:
        ``(module, manifest)``; the module runs on CPU in eval mode and refuses inputs of
        another per-sample shape than the manifest's.

    Raises:
        ValueError: ``part`` is neither.
        SplitArtifactError: see :func:`read_manifest`, or weights that do not fit the manifest.
    """
    if part not in _PARTS:
        raise ValueError(f"part must be 'head' or 'tail', got {part!r}")
    manifest = _signed_manifest(Path(artifact_dir), key, expect_id)
    return _load_weights(Path(artifact_dir), manifest, _skeleton(manifest), part), manifest


def load(artifact_dir: str | Path, key: bytes | str | None = None, *,
         expect_id: str | None = None) -> tuple[nn.Module, nn.Module]:
    """Load a verified head and tail from an artifact directory.

    Args:
        artifact_dir: a directory written by :func:`save` / ``edgetorch split export``.
        key: the HMAC key, if the artifact was signed (see :func:`read_manifest`).
        expect_id: the artifact id this must be (see :func:`read_manifest`).

    Returns:
        ``(head, tail)`` modules in eval mode.

    Raises:
        SplitArtifactError: see :func:`read_manifest`, or weights that do not fit the manifest.

    Example:
        >>> head, tail = load("artifacts")  # doctest: +SKIP
        >>> logits = tail(head(images))  # doctest: +SKIP
    """
    manifest = _signed_manifest(Path(artifact_dir), key, expect_id)
    model = _skeleton(manifest)
    root = Path(artifact_dir)
    return _load_weights(root, manifest, model, "head"), _load_weights(root, manifest, model, "tail")


class OnnxHead:
    """An ONNX Runtime session that takes and returns torch tensors, like the torch head.

    Attributes:
        sample_shape: the per-sample input shape [3, H, W].
        output_shape: the per-sample bottleneck shape each output is checked against (None: unchecked).
    """

    def __init__(self, session: Any, sample_shape: tuple[int, ...], output_shape: tuple[int, ...] | None = None):
        self._session, self.sample_shape = session, tuple(sample_shape)
        self.output_shape = None if output_shape is None else tuple(output_shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[1:]) != self.sample_shape:
            raise ValueError(f"this head was exported for inputs [N, {', '.join(map(str, self.sample_shape))}], "
                             f"got {list(x.shape)}")
        try:
            out = self._session.run(None, {self._session.get_inputs()[0].name: x.detach().float().contiguous().numpy()})[0]
        except Exception as exc:  # onnxruntime's own types (Fail, RuntimeException, ...): a graph that cannot run
            raise SplitArtifactError(f"head.onnx failed to run ({exc})") from None
        # Symbolic dims in the graph's declaration are not checked at load: check what it gave.
        if self.output_shape is not None and tuple(out.shape) != (x.shape[0], *self.output_shape):
            raise SplitArtifactError(f"head.onnx gave {list(out.shape)}, the manifest's bottleneck is "
                                     f"[{x.shape[0]}, {', '.join(map(str, self.output_shape))}]")
        return torch.from_numpy(out)


def load_onnx_head(artifact_dir: str | Path, key: bytes | str | None = None, *,
                   expect_id: str | None = None) -> tuple[OnnxHead, SplitManifest]:
    """The verified ``head.onnx`` as an ONNX Runtime session (for devices without PyTorch models).

    The session is built from the bytes whose hash was checked. A model that points at external
    data files is refused (they would be read from outside the checked bytes), and so is one with
    an operator a bottleneck head does not use or an oversized window (an ONNX graph is a program
    that could allocate without bound at inference).

    Args:
        artifact_dir: a directory exported with ``onnx=True`` (``--onnx``).
        key: the HMAC key, if the artifact was signed.
        expect_id: the artifact id this must be (see :func:`read_manifest`).

    Returns:
        ``(head, manifest)``: call the :class:`OnnxHead` on a float [N, 3, H, W] tensor.

    Raises:
        ImportError: onnxruntime or onnx is not installed.
        SplitArtifactError: no ``head.onnx`` in the artifact, a graph whose input or output is not
            the manifest's shape, or any check of :func:`read_manifest`.
    """
    try:
        import onnxruntime
    except ImportError:
        raise ImportError("loading head.onnx needs onnxruntime: pip install onnxruntime") from None
    manifest = _signed_manifest(Path(artifact_dir), key, expect_id)
    if _ONNX not in manifest.files:
        raise SplitArtifactError(f"{artifact_dir}: no head.onnx; export with --onnx (onnx=True)")
    model = _skeleton(manifest)
    data = _verified_bytes(Path(artifact_dir), manifest, _ONNX, model)
    _check_onnx_graph(data, manifest, model)
    try:
        session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types for a malformed model
        raise SplitArtifactError(f"{artifact_dir}: head.onnx does not load in onnxruntime ({exc})") from None
    # The graph's declared interface must be the manifest's: before this, a head.onnx giving
    # another bottleneck shape loaded and only the server refused its payloads.
    inputs, outputs = session.get_inputs(), session.get_outputs()
    for what, args, shape in (("input", inputs, manifest.input_shape), ("output", outputs, manifest.bottleneck_shape)):
        declared = list(args[0].shape) if len(args) == 1 else None
        # Every dim but the batch concrete: a symbolic one passed this check, and the memory bound
        # below is computed for the manifest's shape.
        if declared is None or len(declared) != 1 + len(shape) or any(
                not isinstance(d, int) or d != want for d, want in zip(declared[1:], shape)):
            raise SplitArtifactError(f"{artifact_dir}: head.onnx must have one {what} [N, "
                                     f"{', '.join(map(str, shape))}] as the manifest says, got "
                                     f"{[list(a.shape) for a in args]}")
    return OnnxHead(session, manifest.input_shape, manifest.bottleneck_shape), manifest


# An ONNX model is a program: a 500-byte graph with ConstantOfShape allocated 2 GB at inference
# (found in review), and onnxruntime caps only load-time constant folding. So an unsigned head
# may use only the operators the exporter writes for a bottleneck head (measured on resnet and
# densenet heads, both architectures, SP1 and SP2: Conv, BatchNormalization, Relu, MaxPool; the
# rest are their plain variants), with no subgraphs, and small window attributes.
_ONNX_OPS = frozenset({"Conv", "BatchNormalization", "Relu", "MaxPool", "Identity", "Add", "AveragePool", "Clip"})
_ONNX_WINDOW_ATTRS = frozenset({"kernel_shape", "pads", "strides", "dilations"})
_ONNX_WINDOW_MAX = 64
# Measured on the eager heads at 224 px: every accepted architecture's head outputs 17-21x its
# input's values per image, over at most ~60 layers.
_ONNX_MAX_NODES = 1000
_ONNX_MEMORY_FACTOR = 3


def _check_onnx_graph(data: bytes, manifest: SplitManifest, skeleton: BottleneckModel) -> None:
    """Refuse a head.onnx that reads other files, or that could compute or hold more than a bottleneck head."""
    try:
        import onnx
        from onnx.external_data_helper import uses_external_data
    except ImportError:  # without the parser the graph cannot be checked, so it is not run
        raise ImportError("loading head.onnx needs the onnx package to check its graph: pip install "
                          "'edgetorch[onnx]'") from None
    try:
        proto = onnx.load_from_string(data)
    except Exception as exc:  # protobuf's DecodeError and onnx's own errors
        raise SplitArtifactError(f"head.onnx is not an ONNX model ({exc})") from None
    nodes = [*proto.graph.node, *(n for f in proto.functions for n in f.node)]
    if any(uses_external_data(t) for t in _onnx_tensors(proto.graph.initializer, proto.graph.sparse_initializer, nodes)):
        raise SplitArtifactError("head.onnx refers to external data files; an artifact's head must be self-contained")
    for node in nodes:
        if node.op_type not in _ONNX_OPS or node.domain not in ("", "ai.onnx"):
            raise SplitArtifactError(f"head.onnx uses operator {node.domain or 'ai.onnx'}.{node.op_type}; a bottleneck "
                                     f"head uses only {', '.join(sorted(_ONNX_OPS))}")
        for attribute in node.attribute:
            if attribute.name in _ONNX_WINDOW_ATTRS and any(abs(v) > _ONNX_WINDOW_MAX for v in attribute.ints):
                raise SplitArtifactError(f"head.onnx: {node.op_type} {attribute.name} {list(attribute.ints)} exceeds "
                                         f"{_ONNX_WINDOW_MAX}; a bottleneck head's windows are small")
    if len(nodes) > _ONNX_MAX_NODES:
        raise SplitArtifactError(f"head.onnx has {len(nodes)} nodes; a bottleneck head has at most {_ONNX_MAX_NODES}")
    elements, bound = _onnx_elements_per_sample(proto, manifest), _head_elements_bound(skeleton, manifest)
    if elements > bound:
        raise SplitArtifactError(f"head.onnx computes {elements} values per image, over the {bound} that "
                                 f"{_ONNX_MEMORY_FACTOR}x this manifest's own head computes; it would allocate "
                                 "far more memory than a bottleneck head")


def _onnx_elements_per_sample(proto: Any, manifest: SplitManifest) -> int:
    """The values every node of the graph outputs for one image, from ONNX's static shape
    inference at the manifest's input shape (a 2 KB head of padded convolutions reached 3.5 GB
    at inference before this; onnxruntime has no memory limit of its own)."""
    import onnx

    graph = onnx.ModelProto()
    graph.CopyFrom(proto)
    initialized = {t.name for t in graph.graph.initializer}
    inputs = [i for i in graph.graph.input if i.name not in initialized]
    if len(inputs) != 1:
        raise SplitArtifactError(f"head.onnx must have one input, got {[i.name for i in inputs]}")
    dims = inputs[0].type.tensor_type.shape.dim
    declared = [d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in dims]
    if declared[1:] != list(manifest.input_shape):  # every dim but the batch fixed, and the manifest's
        raise SplitArtifactError(f"head.onnx must have one input [N, {', '.join(map(str, manifest.input_shape))}] "
                                 f"as the manifest says, got {declared}")
    for dim, size in zip(dims, (1, *manifest.input_shape)):
        dim.Clear()
        dim.dim_value = size
    try:
        inferred = onnx.shape_inference.infer_shapes(graph, strict_mode=True, data_prop=True)
    except Exception as exc:  # onnx's InferenceError, ValidationError
        first = str(exc).strip().splitlines()[:2]  # one error per node: a long graph repeats it hundreds of times
        raise SplitArtifactError(f"head.onnx: shape inference fails at the manifest's input ({' '.join(first)})") from None
    shapes = {v.name: v.type.tensor_type.shape for v in (*inferred.graph.value_info, *inferred.graph.output)}
    total = 0
    for node in inferred.graph.node:
        for name in node.output:
            shape = shapes.get(name)
            if shape is None or not all(d.HasField("dim_value") for d in shape.dim):
                raise SplitArtifactError(f"head.onnx: the shape of {node.op_type} output {name!r} is not fixed by "
                                         "the manifest's input, so its memory cannot be bounded")
            total += math.prod(d.dim_value for d in shape.dim)
    return total


def _head_elements_bound(model: BottleneckModel, manifest: SplitManifest) -> int:
    """:data:`_ONNX_MEMORY_FACTOR` times the values the manifest's own head outputs from its
    layers for one image (on meta layers: no memory)."""
    counted = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: counted.append(out.numel()))
             for m in model.head.modules() if not list(m.children())]
    try:
        model.head(torch.empty(1, *manifest.input_shape, device="meta"))
    finally:
        for hook in hooks:
            hook.remove()
    return _ONNX_MEMORY_FACTOR * sum(counted)


def _onnx_tensors(initializers: Any, sparse: Any, nodes: Any) -> Any:
    """Every TensorProto of a graph: initializers and, what checking only those missed, sparse
    initializers and node attributes (a Constant's value), in subgraphs (If, Loop) too."""
    yield from initializers
    for s in sparse:
        yield from (s.values, s.indices)
    for node in nodes:
        for a in node.attribute:
            yield from [a.t] if a.HasField("t") else []
            yield from a.tensors
            for s in [*([a.sparse_tensor] if a.HasField("sparse_tensor") else []), *a.sparse_tensors]:
                yield from (s.values, s.indices)
            for g in [*([a.g] if a.HasField("g") else []), *a.graphs]:
                yield from _onnx_tensors(g.initializer, g.sparse_initializer, g.node)
