"""The head as ONNX (``head.onnx``), for devices that run onnxruntime: export, the check against
the eager head, and a loader that inspects the graph before onnxruntime sees it.

The graph check admits only the operators a CNN head exports to, with bounded windows and node
counts, and bounds the memory a sample can ask for from the manifest's own shapes: a 2 KB head
reached 3.5 GB before it existed.
"""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .artifact import signed_manifest, skeleton, verified_bytes
from .bottleneck import BottleneckModel
from .manifest import MAX_BATCH, ONNX, SplitArtifactError, SplitManifest

_ONNX_TOLERANCE = 1e-3


def onnx_bytes(head: nn.Module, example: torch.Tensor, output_name: str = "bottleneck") -> bytes:
    """``head`` as a serialized ONNX model with a dynamic batch dimension (torch.onnx's exporter).

    Args:
        head: the module to export (in eval mode).
        example: an input batch; every dim but the batch is fixed to its size.
        output_name: the graph output's name (``"bottleneck"`` for a split head).

    Returns:
        The ModelProto's bytes.

    Raises:
        ImportError: onnxscript is not installed (the message says which extra brings it).
    """
    import importlib.util

    if importlib.util.find_spec("onnxscript") is None:  # torch.onnx's exporter needs it: fail with the fix
        raise ImportError("ONNX export needs the onnx extra: pip install 'edgetorch[onnx]'")
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its progress
        program = torch.onnx.export(head, (example,), dynamic_shapes=({0: batch},), dynamo=True,
                                    input_names=["image"], output_names=[output_name], verbose=False)
    return program.model_proto.SerializeToString()


def check_onnx(out: Path, key: bytes | str | None, example: torch.Tensor, bottleneck: torch.Tensor) -> None:
    try:
        session, _ = load_onnx_head(out, key=key)
    except ImportError:
        return  # export needs only onnx; the check runs where onnxruntime is installed too
    if not torch.allclose(session(example), bottleneck, atol=_ONNX_TOLERANCE, rtol=_ONNX_TOLERANCE):
        raise SplitArtifactError("head.onnx does not reproduce the head's bottleneck under onnxruntime")


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
    manifest = signed_manifest(Path(artifact_dir), key, expect_id)
    if ONNX not in manifest.files:
        raise SplitArtifactError(f"{artifact_dir}: no head.onnx; export with --onnx (onnx=True)")
    model = skeleton(manifest)
    data = verified_bytes(Path(artifact_dir), manifest, ONNX, model)
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
