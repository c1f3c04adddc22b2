"""Reading a split artifact directory: the manifest and its signature, each file's hash from one
bounded read, and the head and tail rebuilt from data (nothing unpickled).

See :mod:`edgetorch.split.export` for the directory's layout and trust model.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._files import open_regular, read_bytes
from .bottleneck import BottleneckModel, rebuild
from .coded import MAX_TABLES_FILE_BYTES, CodeTables, tables_from_bytes
from .manifest import (CODE_TABLES, STEPS_PAYLOAD, MANIFEST_NAME, MAX_MANIFEST_BYTES, MAX_PART_BYTES, ONNX, PARTS, SplitArtifactError,
                       SplitManifest, check_artifact_id, manifest_hmac)

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
    manifest = signed_manifest(Path(artifact_dir), key, expect_id)
    model = skeleton(manifest)  # meta layers: what bounds each file's size before it is read
    for part in manifest.files:
        verified_bytes(Path(artifact_dir), manifest, part, model)
    return manifest


def signed_manifest(root: Path, key: bytes | str | None, expect_id: str | None) -> SplitManifest:
    """The parsed manifest, its HMAC checked when a key is given and its id when one is expected
    (the files are checked as read)."""
    if expect_id is not None:
        check_artifact_id(expect_id)
    if not root.is_dir():
        raise SplitArtifactError(f"{root} is not a directory; export one with `edgetorch split export`")
    manifest = SplitManifest.from_json(read_bytes(root / MANIFEST_NAME, MAX_MANIFEST_BYTES, error=SplitArtifactError, follow_symlinks=False).decode("utf-8", "replace"))
    if key is not None:
        if manifest.signature is None:
            raise SplitArtifactError(f"{root}: the manifest is not signed, but a key was given; export it "
                                     "again with the key (--key-env) or load it without one")
        # Bytes: compare_digest raises TypeError for a str signature with non-ASCII characters.
        if not hmac.compare_digest(manifest.signature.encode("utf-8", "replace"), manifest_hmac(manifest, key).encode()):
            raise SplitArtifactError(f"{root}: the manifest's HMAC does not match this key (tampered, or "
                                     "signed with another key)")
    if expect_id is not None and not hmac.compare_digest(manifest.artifact_id, expect_id):
        raise SplitArtifactError(f"{root} is artifact {manifest.artifact_id}, not the expected {expect_id}: "
                                 "another artifact was put in its place (or the expected id is out of date)")
    return manifest


def verified_bytes(root: Path, manifest: SplitManifest, part: str, model: BottleneckModel | None) -> bytes:
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
    check; :func:`skeleton` has already refused a model over :data:`MAX_PART_BYTES`."""
    if part == CODE_TABLES:  # int64 counts, [channels, 256], and a safetensors header
        return MAX_TABLES_FILE_BYTES
    weights = _weight_bytes(model, part)  # meta tensors: no memory
    if part == ONNX:
        return 2 * weights + (16 << 20)
    return weights + (1 << 20) + 1024 * len(_part(model, part).state_dict())


def _part(model: BottleneckModel, part: str) -> nn.Module:
    return model.tail if part == "tail" else model.head


def _weight_bytes(model: BottleneckModel, part: str) -> int:
    return sum(t.numel() * t.element_size() for t in _part(model, part).state_dict().values())


def skeleton(manifest: SplitManifest) -> BottleneckModel:
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
    for part in PARTS:
        if _weight_bytes(model, part) > MAX_PART_BYTES:
            raise SplitArtifactError(f"{MANIFEST_NAME}: the {part} of model {manifest.model} needs "
                                     f"{_weight_bytes(model, part)} bytes of weights, over the {MAX_PART_BYTES} "
                                     "an artifact part may have")
    return model


def _load_weights(root: Path, manifest: SplitManifest, model: BottleneckModel, part: str) -> nn.Module:
    from ..weights import CheckpointError, tensors_from_bytes

    data = verified_bytes(root, manifest, part, model)
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


def load_code_tables(artifact_dir: str | Path, manifest: SplitManifest) -> CodeTables | None:
    """The code tables of an artifact whose payloads are entropy-coded (``manifest.coded``), else None.

    Args:
        artifact_dir: the artifact directory ``manifest`` was read from (:func:`load_part`).
        manifest: its manifest, already verified (signature, id).

    Returns:
        The :class:`~edgetorch.split.coded.CodeTables`, one per bottleneck channel, or None.

    Raises:
        SplitArtifactError: the file is missing, differs from the manifest's hash, or is not one
            int64 ``[C, 256]`` tensor of counts for the bottleneck's C channels.

    Example:
        >>> head, manifest = load_part("artifact", "head")  # doctest: +SKIP
        >>> payload = encode(head(x), tables=load_code_tables("artifact", manifest))  # doctest: +SKIP
    """
    if not manifest.coded:
        return None
    root = Path(artifact_dir)
    path = root / manifest.files[CODE_TABLES]["path"]
    tables = tables_from_bytes(verified_bytes(root, manifest, CODE_TABLES, None), path, SplitArtifactError)
    if tables.channels != manifest.bottleneck_shape[0]:
        raise SplitArtifactError(f"{path} holds tables for {tables.channels} channels; the bottleneck has "
                                 f"{manifest.bottleneck_shape[0]}")
    fixed = manifest.payload_format == STEPS_PAYLOAD
    if fixed != (tables.steps is not None):
        raise SplitArtifactError(f"{path}: payload version {manifest.payload_format['version']} needs code tables "
                                 f"{'with' if fixed else 'without'} fixed steps")
    if fixed and tables.steps.sample_shape != tuple(manifest.bottleneck_shape):
        raise SplitArtifactError(f"{path}: the fixed steps are for samples of shape {tables.steps.sample_shape}; "
                                 f"the bottleneck is {tuple(manifest.bottleneck_shape)}")
    return tables


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
    if part not in PARTS:
        raise ValueError(f"part must be 'head' or 'tail', got {part!r}")
    manifest = signed_manifest(Path(artifact_dir), key, expect_id)
    return _load_weights(Path(artifact_dir), manifest, skeleton(manifest), part), manifest


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
    deployed, _ = load_deployed(artifact_dir, key, expect_id=expect_id)
    return deployed.head, deployed.tail


class DeployedSplit(nn.Module):
    """A head and its tail joined through the 8-bit payload: the logits a device gets back from
    the tail server (``split infer``), computed in one process.

    Attributes:
        head, tail: the artifact's two sides.
        tables: the code tables of an entropy-coded artifact (the same tensor reaches the tail
            either way; kept so the payload is the one sent), else None.
    """

    def __init__(self, head: nn.Module, tail: nn.Module, tables: CodeTables | None = None):
        super().__init__()
        self.head, self.tail, self.tables = head, tail, tables

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .payload import decode, encode

        return self.tail(decode(encode(self.head(x), tables=self.tables), tables=self.tables).to(x.device))


def load_deployed(artifact_dir: str | Path, key: bytes | str | None = None, *,
                  expect_id: str | None = None) -> tuple[DeployedSplit, SplitManifest]:
    """Load a verified artifact as one classifier that runs the deployed path (see :class:`DeployedSplit`).

    Args:
        artifact_dir: a directory written by :func:`save` / ``edgetorch split export``.
        key: the HMAC key, if the artifact was signed (see :func:`read_manifest`).
        expect_id: the artifact id this must be (see :func:`read_manifest`).

    Returns:
        ``(model, manifest)``: the model in eval mode on the CPU.

    Raises:
        SplitArtifactError: see :func:`read_manifest`, or weights that do not fit the manifest.

    Example:
        >>> model, manifest = load_deployed("artifacts")  # doctest: +SKIP
        >>> logits = model(images)  # doctest: +SKIP
    """
    root = Path(artifact_dir)
    manifest = signed_manifest(root, key, expect_id)
    model = skeleton(manifest)
    return DeployedSplit(_load_weights(root, manifest, model, "head"), _load_weights(root, manifest, model, "tail"),
                         load_code_tables(root, manifest)).eval(), manifest
