"""The split artifact's manifest: the schema (:class:`SplitManifest`, :class:`Preprocess`), the
checks every field passes before anything is built from it, and its HMAC.

See :mod:`edgetorch.split.export` for what an artifact directory holds and its trust model.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import unicodedata
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .. import __version__
from .._files import InputFileError
from . import payload

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 3
# Version 2 is read as version 3 with preprocess.resize "stretch", the only resize it had (its
# signature and artifact id keep covering the version 2 body it was signed as).
_READABLE_VERSIONS = (2, MANIFEST_VERSION)
FORMAT = "edgetorch-split"
MAX_BATCH = 1024  # the ONNX head's declared batch range (the eager modules take any batch)
MAX_RESOLUTION = 4096  # input height/width a manifest may declare (the head is run on it to check shapes)
MAX_MANIFEST_BYTES = 1 << 20
# The largest head or tail an artifact may declare, checked on meta layers before any file is read.
# The largest accepted teacher's tail (resnet152 with 100,000 classes) needs 1.05 GB; ImageNet-21k classes, 0.41 GB.
MAX_PART_BYTES = 2 << 30
_MIN_KEY_BYTES = 16  # an HMAC key shorter than this is guessable; RFC 2104 advises >= the hash's 32
PARTS = ("head", "tail")
_UNPRINTABLE = frozenset({"Cc", "Cf", "Zl", "Zp"})  # controls, format (bidi) and line/paragraph separators
ONNX = "head_onnx"
CODE_TABLES = "code_tables"  # payload version 2's per-channel code tables (split/coded.py)
FILE_NAMES = {"head": "head.safetensors", "tail": "tail.safetensors", ONNX: "head.onnx",
              CODE_TABLES: "code_tables.safetensors"}
FORMATS = {"head": "safetensors", "tail": "safetensors", ONNX: "onnx", CODE_TABLES: "safetensors"}
#: the payload formats a manifest may name: 8-bit codes as bytes, or entropy-coded with its code tables
PLAIN_PAYLOAD = {"magic": payload.MAGIC.decode(), "version": payload.VERSION, "per_sample": True}
CODED_PAYLOAD = {"magic": payload.MAGIC.decode(), "version": payload.CODED_VERSION, "per_sample": True,
                 "coding": "rans-per-channel"}
#: entropy-coded codes of the code tables' fixed per-channel steps (a rate-trained student's)
STEPS_PAYLOAD = {"magic": payload.MAGIC.decode(), "version": payload.STEPS_VERSION, "per_sample": False,
                 "coding": "rans-per-channel"}


RESIZES = ("center-crop", "stretch")


class SplitArtifactError(InputFileError):
    """An artifact directory is incomplete, malformed, tampered with, or fails a check."""


@dataclass(frozen=True)
class Preprocess:
    """How the device turns an image file into the head's input.

    Attributes:
        size: (height, width) of the input.
        color: ``"gray"`` (converted to one channel, then repeated to the model's input channels,
            as the Fashion-MNIST teachers are trained) or ``"rgb"``.
        mean, std: per-channel normalisation applied after scaling pixels to [0, 1]
            (one value, or one per input channel).
        resize: one of :data:`RESIZES`. ``"center-crop"``: what ``edgetorch finetune`` evaluates
            with and records in ``model.json`` (:func:`edgetorch.data.preprocessing_record`:
            Pillow's bilinear resize of the 8-bit image to a short side of ``size * 256/224``,
            then a centre crop; square sizes only), so a fine-tuned teacher sees the same pixels in
            ``split train`` and on the device; image folders train with it. ``"stretch"``: the
            whole image resized to ``size`` (torch bilinear, antialiased when shrinking), for the
            built-in datasets, whose images are already square and framed, and what every
            manifest before version 3 meant.
    """

    size: tuple[int, int]
    color: str = "gray"
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    resize: str = "stretch"

    def check(self, channels: int) -> None:
        """Raise ``ValueError`` unless this preprocessing can feed ``channels`` input channels."""
        if self.color not in ("gray", "rgb"):
            raise ValueError(f"preprocess.color must be 'gray' or 'rgb', got {self.color!r}")
        if self.resize not in RESIZES:
            raise ValueError(f"preprocess.resize must be one of {', '.join(RESIZES)}, got {self.resize!r}")
        if self.resize == "center-crop" and self.size[0] != self.size[1]:
            raise ValueError(f"preprocess.resize center-crop makes square inputs, got size {list(self.size)}")
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
    payload_format: dict = field(default_factory=lambda: dict(PLAIN_PAYLOAD))
    torch_version: str = torch.__version__
    edgetorch_version: str = __version__
    class_names: tuple[str, ...] | None = None
    signature: str | None = None
    manifest_version: int = MANIFEST_VERSION
    format: str = FORMAT

    @property
    def coded(self) -> bool:
        """Payloads are entropy-coded (version 2, or 3 with fixed steps) with the artifact's code tables."""
        return self.payload_format in (CODED_PAYLOAD, STEPS_PAYLOAD)

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
        if self.manifest_version == 2:  # signed before resize existed (it can only be stretch)
            del body["preprocess"]["resize"]
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
        if not integer or version not in _READABLE_VERSIONS or raw.get("format") != FORMAT:
            raise SplitArtifactError(f"{MANIFEST_NAME}: format {raw.get('format')!r} version {version!r} is not "
                                     f"supported (expected {FORMAT!r} version 2 or {MANIFEST_VERSION})")
        expected = {f.name for f in cls.__dataclass_fields__.values()}
        if set(raw) != expected:
            raise SplitArtifactError(f"{MANIFEST_NAME}: fields {sorted(set(raw) ^ expected)} are missing or "
                                     f"unknown (expected exactly {sorted(expected)})")
        try:
            prep = raw["preprocess"]
            keys = ["size", "color", "mean", "std", *(["resize"] if version > 2 else [])]
            if not isinstance(prep, dict) or set(prep) != set(keys):
                raise ValueError(f"preprocess needs exactly {', '.join(keys)}")
            files = raw["files"]
            if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
                raise ValueError("files must map each part to {path, sha256, format}")
            manifest = cls(
                model=_plain_dict(raw["model"]),
                input_shape=_shape(raw["input_shape"], 3),
                bottleneck_shape=_shape(raw["bottleneck_shape"], 3),
                num_classes=_positive(raw["num_classes"]),
                preprocess=Preprocess(size=_shape(prep["size"], 2), color=_text(prep["color"]),
                                      mean=_floats(prep["mean"]), std=_floats(prep["std"]),
                                      resize=_text(prep.get("resize", "stretch"))),
                files={str(k): {"path": _text(v["path"]), "sha256": _text(v["sha256"]),
                                "format": _text(v["format"])} for k, v in files.items()},
                payload_format=_plain_dict(raw["payload_format"]),
                torch_version=_text(raw["torch_version"]), edgetorch_version=_text(raw["edgetorch_version"]),
                class_names=None if raw["class_names"] is None else _texts(raw["class_names"]),
                signature=None if raw["signature"] is None else _text(raw["signature"]),
                manifest_version=version,
            )
            check_class_names(manifest.class_names, manifest.num_classes)
            manifest.preprocess.check(manifest.input_shape[0])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SplitArtifactError(f"{MANIFEST_NAME}: missing or malformed field ({exc})") from None
        if not set(PARTS) <= set(manifest.files) <= {*PARTS, ONNX, CODE_TABLES}:
            raise SplitArtifactError(f"{MANIFEST_NAME}: files must list head and tail (and optionally "
                                     f"{ONNX} and {CODE_TABLES}), got {sorted(manifest.files)}")
        for part, entry in manifest.files.items():
            if entry["path"] != FILE_NAMES[part] or entry["format"] != FORMATS[part]:
                raise SplitArtifactError(f"{MANIFEST_NAME}: {part} must be {FILE_NAMES[part]} in format "
                                         f"{FORMATS[part]}, got {entry['path']!r} ({entry['format']!r})")
        if manifest.payload_format not in (PLAIN_PAYLOAD, CODED_PAYLOAD, STEPS_PAYLOAD):
            raise SplitArtifactError(f"{MANIFEST_NAME}: payload format {manifest.payload_format} is none of "
                                     f"{PLAIN_PAYLOAD}, {CODED_PAYLOAD}, {STEPS_PAYLOAD}")
        if manifest.coded != (CODE_TABLES in manifest.files):
            raise SplitArtifactError(f"{MANIFEST_NAME}: an entropy-coded payload format needs {CODE_TABLES} in "
                                     "files, and only it may list them")
        if max(manifest.input_shape[1:]) > MAX_RESOLUTION or manifest.input_shape[1:] != manifest.preprocess.size:
            raise SplitArtifactError(f"{MANIFEST_NAME}: input_shape {list(manifest.input_shape)} must match "
                                     f"preprocess.size {list(manifest.preprocess.size)}, at most {MAX_RESOLUTION} px")
        return manifest


def check_class_names(names: Sequence[str] | None, num_classes: int) -> None:
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


def key_bytes(key: bytes | str) -> bytes:
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) < _MIN_KEY_BYTES:
        raise ValueError(f"an HMAC key needs at least {_MIN_KEY_BYTES} bytes, got {len(raw)}; "
                         "generate one with `python -c 'import secrets; print(secrets.token_hex(32))'`")
    return raw


def manifest_hmac(manifest: SplitManifest, key: bytes | str) -> str:
    return hmac.new(key_bytes(key), manifest.signed_bytes(), hashlib.sha256).hexdigest()


def check_artifact_id(artifact_id: object) -> None:
    """Raise ``ValueError`` unless ``artifact_id`` is an id as export prints it (64 lowercase hex digits)."""
    if not isinstance(artifact_id, str) or len(artifact_id) != 64 or artifact_id.strip("0123456789abcdef"):
        raise ValueError(f"an artifact id is the 64 lowercase hex digits `edgetorch split export` prints, "
                         f"got {artifact_id!r}")
