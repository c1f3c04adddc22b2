"""The device side: image -> head -> 8-bit payload -> HTTP -> logits, timing every stage."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .._files import InputFileError
from ..data.images import read_image
from ..errors import EdgetorchError
from .artifact import load_code_tables, load_part
from .coded import CodeTables
from .manifest import Preprocess, SplitManifest
from .onnx_head import load_onnx_head
from .payload import encode


class SplitClientError(EdgetorchError, RuntimeError):
    """The server refused a request or answered something that is not logits of the right shape."""


@dataclass(frozen=True)
class InferenceResult:
    """One round trip.

    Attributes:
        logits: [N, num_classes] from the server.
        payload_bytes: the request body's exact length.
        seconds: wall-clock seconds per stage: ``head``, ``encode``, ``network`` (round trip minus
            the server's own time), ``server`` (decode + tail, as the server measured), ``total``.
    """

    logits: torch.Tensor
    payload_bytes: int
    seconds: dict[str, float]

    @property
    def predictions(self) -> list[int]:
        """Arg-max class per sample."""
        return self.logits.argmax(dim=1).tolist()

    def top(self, k: int = 3, class_names: Sequence[str] | None = None) -> list[list[tuple[str, float]]]:
        """The ``k`` most probable classes of each sample, as (name, softmax probability).

        Args:
            k: how many per sample (at most the number of classes).
            class_names: names by class index (the manifest's); indices when None.
        """
        probabilities = torch.softmax(self.logits.double(), dim=1)
        values, indices = probabilities.topk(min(k, probabilities.shape[1]), dim=1)
        name = (lambda i: class_names[i]) if class_names else str
        return [[(name(i), float(p)) for p, i in zip(row_p.tolist(), row_i.tolist())]
                for row_p, row_i in zip(values, indices)]


def preprocess_images(paths: Sequence[str | Path], preprocess: Preprocess, in_channels: int) -> torch.Tensor:
    """Load image files (PNG, JPEG, anything PIL reads) as the head's input batch.

    Args:
        paths: image files.
        preprocess: the manifest's preprocessing (size, resize, color, normalisation).
        in_channels: the head's input channels (gray images are repeated to fill them).

    Returns:
        float32 [N, in_channels, H, W].

    Raises:
        InputFileError: (a ``ValueError``) a file that is not a readable image (see
            :func:`edgetorch.data.images.read_image`).
        ValueError: a color mode that cannot fill ``in_channels``.
    """
    mode = "L" if preprocess.color == "gray" else "RGB"
    if preprocess.resize == "center-crop":  # finetune's evaluation transform, on the 8-bit image
        from ..data.folder import evaluation_transform

        transform = evaluation_transform(preprocess.size[0], preprocess.color, None)
        images = [_transformed(transform, path, mode) for path in paths]
    else:
        images = [_stretched(read_image(path).convert(mode), preprocess.size) for path in paths]
    batch = torch.stack(images)
    if batch.shape[1] != in_channels:
        if batch.shape[1] != 1:
            raise ValueError(f"{preprocess.color} images have {batch.shape[1]} channels; the head takes {in_channels}")
        batch = batch.expand(-1, in_channels, -1, -1)
    mean = torch.tensor(preprocess.mean).view(1, -1, 1, 1)
    std = torch.tensor(preprocess.std).view(1, -1, 1, 1)
    return ((batch - mean) / std).contiguous()


def _transformed(transform, path: str | Path, mode: str) -> torch.Tensor:
    from ..data.folder import ElongatedImageError

    try:
        return transform(read_image(path).convert(mode))
    except ElongatedImageError as exc:  # the file's shape, not a bug
        raise InputFileError(f"{path}: {exc}") from None


def _stretched(image, size: tuple[int, int]) -> torch.Tensor:
    """The whole image resized to ``size``: the resize load_dataset gives training images
    (bilinear on [0, 1] floats, antialiased when shrinking)."""
    array = np.asarray(image, dtype=np.float32) / 255.0
    pixels = torch.from_numpy(array.reshape(*array.shape[:2], -1)).permute(2, 0, 1)[None]
    shrinking = pixels.shape[-1] > size[1] or pixels.shape[-2] > size[0]
    return F.interpolate(pixels, size=tuple(size), mode="bilinear", align_corners=False,
                         antialias=shrinking).clamp_(0.0, 1.0)[0]


class SplitClient:
    """Runs the head locally and the tail on a server.

    Args:
        head: the device-side module (or an :class:`~edgetorch.split.onnx_head.OnnxHead`).
        manifest: the artifact manifest (bottleneck shape, preprocessing).
        server: base URL, e.g. ``http://127.0.0.1:8000``.
        token: bearer token, if the server requires one.
        timeout: seconds per HTTP request.
        tables: the artifact's code tables, required where ``manifest.coded``: payloads are then
            entropy-coded (:func:`~edgetorch.split.artifact.load_code_tables`; ``from_dir`` loads them).

    Raises:
        ValueError: an entropy-coded artifact's manifest without its tables.

    Example:
        >>> client = SplitClient.from_dir("artifacts", "http://127.0.0.1:8000")  # doctest: +SKIP
        >>> client.infer_files(["shoe.png"]).predictions  # doctest: +SKIP
    """

    def __init__(self, head: nn.Module | Callable[[torch.Tensor], torch.Tensor], manifest: SplitManifest, server: str,
                 token: str | None = None, timeout: float = 30.0, tables: CodeTables | None = None) -> None:
        import httpx

        if manifest.coded and tables is None:
            raise ValueError("this artifact's payloads are entropy-coded: pass its code tables "
                             "(load_code_tables(artifact_dir, manifest), or SplitClient.from_dir)")
        self.head, self.manifest, self.tables = head, manifest, tables
        headers = {"content-type": "application/octet-stream"}
        if token is not None:
            headers["authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=timeout)

    @classmethod
    def from_dir(cls, artifact_dir: str | Path, server: str, *, key: bytes | str | None = None,
                 expect_id: str | None = None, runtime: str = "torch", **kwargs) -> SplitClient:
        """Load the verified head from an artifact directory (the device needs no tail).

        Args:
            artifact_dir: a directory written by :func:`~edgetorch.split.save`.
            server: the tail server's base URL.
            key: the HMAC key, if the artifact was signed.
            expect_id: the artifact id the head must come from (``edgetorch split export``
                prints it); another artifact is refused, even one signed with the same key.
            runtime: ``"torch"`` (the safetensors head) or ``"onnx"`` (``head.onnx`` under
                onnxruntime; the artifact must have been exported with ``onnx=True``).
            **kwargs: ``token`` and ``timeout`` (see the class).
        """
        if runtime == "torch":
            head, manifest = load_part(artifact_dir, "head", key, expect_id=expect_id)
        elif runtime == "onnx":
            head, manifest = load_onnx_head(artifact_dir, key, expect_id=expect_id)
        else:
            raise ValueError(f"runtime must be 'torch' or 'onnx', got {runtime!r}")
        kwargs["tables"] = load_code_tables(artifact_dir, manifest)
        return cls(head, manifest, server, **kwargs)

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    def __enter__(self) -> SplitClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def infer(self, images: torch.Tensor) -> InferenceResult:
        """One round trip for a batch of preprocessed images [N, *input_shape].

        Raises:
            SplitClientError: a non-200 answer (its JSON error is quoted) or malformed logits.
        """
        start = time.perf_counter()
        with torch.inference_mode():
            bottleneck = self.head(images)
        headed = time.perf_counter()
        body = encode(bottleneck, tables=self.tables)
        encoded = time.perf_counter()
        response = self._http.post("/infer", content=body)
        answered = time.perf_counter()
        if response.status_code != 200:
            raise SplitClientError(f"server answered {response.status_code}: {response.text}")
        # A 200 whose body is not the server's JSON (another service, a proxy page, a hostile
        # server) raised KeyError/TypeError/JSONDecodeError here: a traceback, not this error.
        try:
            answer = response.json()
            logits = torch.tensor(answer["logits"], dtype=torch.float32)
            server_s = float(answer["timing"]["decode_s"]) + float(answer["timing"]["tail_s"])
        except (ValueError, KeyError, TypeError, IndexError, OverflowError, RuntimeError) as exc:
            raise SplitClientError(f"server answered 200 but not with {{logits, timing}} JSON "
                                   f"({type(exc).__name__}: {exc}): {response.text[:200]!r}") from None
        if logits.shape != (images.shape[0], self.manifest.num_classes):
            raise SplitClientError(f"server returned logits of shape {list(logits.shape)}, expected "
                                   f"[{images.shape[0]}, {self.manifest.num_classes}]")
        seconds = {"head": headed - start, "encode": encoded - headed,
                   "network": answered - encoded - server_s, "server": server_s,
                   "total": time.perf_counter() - start}
        return InferenceResult(logits, len(body), seconds)

    def infer_files(self, paths: Sequence[str | Path]) -> InferenceResult:
        """Preprocess image files as the manifest says, then :meth:`infer` (preprocessing not timed)."""
        images = preprocess_images(paths, self.manifest.preprocess, self.manifest.input_shape[0])
        return self.infer(images)
