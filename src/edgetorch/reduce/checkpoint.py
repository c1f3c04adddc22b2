"""Reduced networks on disk without pickle: safetensors weights + a JSON layer list.

``edgetorch.reduce.save(model, "small.safetensors")`` writes the weights and ``small.json``, which
lists every module of the ``nn.Sequential`` with its sizes (widths, channels, kernels, ranks, kept
input units) and the few constructor arguments of activations and pooling; nested containers are
listed as such, with their children's names where these are not positions.
``edgetorch.reduce.load`` rebuilds the modules from the JSON and loads the weights with a strict
key/shape check: nothing in either file is ever executed. A model that is not a chain (a grouped
reduction of a residual or depthwise CNN) is recorded as its constructor plus its layer sizes
(:mod:`edgetorch.reduce.graph_checkpoint`), and, where low-rank factored its layers, the rank of
each :class:`~edgetorch.reduce.sequential.Factored` layer by name; ``load`` tells the formats apart. (Plain state dicts, whose architecture
the caller builds, use ``edgetorch.zoo.save_weights`` / ``load_weights``.)
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..zoo import CheckpointError, load_weights, save_weights
from . import graph_checkpoint, transformer_checkpoint
from .transformer_blocks import is_transformer
from .sequential import ELEMENTWISE, PER_CHANNEL, Factored, KeepFeatures, factored_like

_FORMAT = "edgetorch.reduced/1"
# Constructor arguments worth keeping, per parameter-free module type.
_ARGUMENTS: dict[type[nn.Module], tuple[str, ...]] = {
    nn.LeakyReLU: ("negative_slope",), nn.ELU: ("alpha",), nn.GELU: ("approximate",),
    nn.Hardtanh: ("min_val", "max_val"), nn.Softplus: ("beta", "threshold"), nn.Dropout: ("p",),
    nn.Softmax: ("dim",), nn.LogSoftmax: ("dim",), nn.Flatten: ("start_dim", "end_dim"),
    nn.MaxPool2d: ("kernel_size", "stride", "padding", "dilation", "ceil_mode"),
    nn.AvgPool2d: ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
    nn.AdaptiveAvgPool2d: ("output_size",), nn.AdaptiveMaxPool2d: ("output_size",), nn.Dropout2d: ("p",),
}
_NORMS = {cls.__name__: cls for cls in (nn.BatchNorm1d, nn.BatchNorm2d)}
_SIMPLE = {cls.__name__: cls for cls in (*ELEMENTWISE, *PER_CHANNEL, nn.Softmax, nn.LogSoftmax, nn.Flatten)
           if cls.__name__ not in _NORMS}


def _plain(value: Any) -> Any:
    # JSON has no tuples: kernel sizes and strides come back as lists.
    return tuple(value) if isinstance(value, list) else value


def _describe(module: nn.Module) -> dict[str, Any]:
    if isinstance(module, nn.Linear):
        return {"type": "Linear", "in": module.in_features, "out": module.out_features,
                "bias": module.bias is not None}
    if isinstance(module, nn.Conv2d) and module.groups == 1:
        return {"type": "Conv2d", "in": module.in_channels, "out": module.out_channels,
                "kernel_size": list(module.kernel_size), "stride": list(module.stride),
                "padding": module.padding if isinstance(module.padding, str) else list(module.padding),
                "dilation": list(module.dilation), "padding_mode": module.padding_mode,
                "bias": module.bias is not None}
    if type(module).__name__ in _NORMS and type(module) is _NORMS[type(module).__name__]:
        return {"type": type(module).__name__, "features": module.num_features, "eps": module.eps,
                "momentum": module.momentum, "affine": module.affine,
                "track_running_stats": module.track_running_stats}
    if isinstance(module, KeepFeatures):
        return {"type": "KeepFeatures", "size": int(module.index.numel()), "dim": module.dim}
    if type(module) is Factored and isinstance(module[0], nn.Linear):
        first, second = module
        return {"type": "LowRank", "in": first.in_features, "rank": first.out_features,
                "out": second.out_features, "bias": second.bias is not None}
    if type(module) in (nn.Sequential, Factored):  # a factored convolution, or a nested container
        return {"type": "Factored" if type(module) is Factored else "Sequential", **_children(module)}
    if type(module).__name__ in _SIMPLE and type(module) is _SIMPLE[type(module).__name__]:
        keys = _ARGUMENTS.get(type(module), ())
        return {"type": type(module).__name__, "args": {k: getattr(module, k) for k in keys}}
    raise TypeError(f"cannot describe a {type(module).__name__} in a reduced network")


def architecture(model: nn.Sequential) -> dict[str, Any]:
    """The JSON-able description of a reduced (or full) supported network.

    Args:
        model: an ``nn.Sequential`` of the modules :func:`edgetorch.reduce.reduce` produces.

    Returns:
        ``{"format": ..., "modules": [...]}``.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"expected an nn.Sequential, got {type(model).__name__}")
    return {"format": _FORMAT, **_children(model)}


def _children(container: nn.Sequential) -> dict[str, Any]:
    # Names are recorded only where they are not the positions (an OrderedDict-built container),
    # so that the rebuilt model has the same state-dict keys.
    names = [name for name, _ in container.named_children()]
    described = {"modules": [_describe(m) for m in container]}
    return described if names == [str(i) for i in range(len(names))] else {**described, "names": names}


def _positive(entry: dict[str, Any], *keys: str) -> list[int]:
    values = [entry.get(k) for k in keys]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise CheckpointError(f"module entry {entry} needs positive integer {', '.join(keys)}")
    return values


def _conv(entry: dict[str, Any]) -> nn.Conv2d:
    m_in, m_out = _positive(entry, "in", "out")
    sizes = {k: entry.get(k) for k in ("kernel_size", "stride", "dilation")}
    padding = entry.get("padding")
    ok = all(isinstance(v, list) and len(v) == 2 and all(type(x) is int and x >= 1 for x in v) for v in sizes.values())
    ok = ok and (padding in ("same", "valid") or (isinstance(padding, list) and len(padding) == 2
                                                  and all(type(x) is int and x >= 0 for x in padding)))
    if not ok or entry.get("padding_mode") not in ("zeros", "reflect", "replicate", "circular"):
        raise CheckpointError(f"Conv2d entry {entry} needs kernel_size/stride/dilation as two positive ints, "
                              "padding as two ints >= 0 or 'same'/'valid', and a torch padding_mode")
    return nn.Conv2d(m_in, m_out, tuple(sizes["kernel_size"]), tuple(sizes["stride"]), _plain(padding),
                     tuple(sizes["dilation"]), bias=bool(entry.get("bias", True)), padding_mode=entry["padding_mode"])


def _norm(kind: str, entry: dict[str, Any]) -> nn.Module:
    (features,) = _positive(entry, "features")
    eps, momentum = entry.get("eps"), entry.get("momentum")
    if not isinstance(eps, float) or not (momentum is None or isinstance(momentum, float)):
        raise CheckpointError(f"{kind} entry {entry} needs a float eps and a float or null momentum")
    return _NORMS[kind](features, eps=eps, momentum=momentum, affine=bool(entry.get("affine", True)),
                        track_running_stats=bool(entry.get("track_running_stats", True)))


def build(description: dict[str, Any]) -> nn.Sequential:
    """Rebuild the (untrained) modules listed by :func:`architecture`.

    Raises:
        CheckpointError: an unknown format, module type or argument, or a bad size.
    """
    if not isinstance(description, dict) or description.get("format") != _FORMAT:
        raise CheckpointError(f"not a reduced-network description (expected format {_FORMAT!r})")
    return _modules(description)


def _modules(description: dict[str, Any], container: type[nn.Sequential] = nn.Sequential) -> nn.Sequential:
    entries, names = description.get("modules", []), description.get("names")
    if not isinstance(entries, list):
        raise CheckpointError(f"'modules' must be a list of module entries, got {type(entries).__name__}")
    if names is not None and not (isinstance(names, list) and len(names) == len(entries) == len(set(names))
                                  and all(isinstance(n, str) and n and "." not in n for n in names)):
        raise CheckpointError(f"'names' must give each of the {len(entries)} modules a distinct non-empty name "
                              f"without '.', got {names!r}")
    modules: list[nn.Module] = []
    for entry in entries:
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind == "Linear":
            m_in, m_out = _positive(entry, "in", "out")
            modules.append(nn.Linear(m_in, m_out, bias=bool(entry.get("bias", True))))
        elif kind == "LowRank":
            m_in, rank, m_out = _positive(entry, "in", "rank", "out")
            modules.append(Factored(nn.Linear(m_in, rank, bias=False),
                                    nn.Linear(rank, m_out, bias=bool(entry.get("bias", True)))))
        elif kind == "Conv2d":
            modules.append(_conv(entry))
        elif kind in _NORMS:
            modules.append(_norm(kind, entry))
        elif kind in ("Sequential", "Factored"):
            modules.append(_modules(entry, Factored if kind == "Factored" else nn.Sequential))
        elif kind == "KeepFeatures":
            (size,) = _positive(entry, "size")
            dim = entry.get("dim", -1)
            if type(dim) is not int:
                raise CheckpointError(f"KeepFeatures entry {entry} needs an int dim")
            modules.append(KeepFeatures(torch.zeros(size, dtype=torch.long), dim))
        elif kind in _SIMPLE:
            args = entry.get("args", {})
            allowed = _ARGUMENTS.get(_SIMPLE[kind], ())
            if not isinstance(args, dict) or set(args) - set(allowed):
                raise CheckpointError(f"{kind} accepts arguments {list(allowed)}, got {args!r}")
            try:
                modules.append(_SIMPLE[kind](**{k: _plain(v) for k, v in args.items()}))
            except (TypeError, ValueError) as exc:
                raise CheckpointError(f"{kind} rejected arguments {args!r} ({exc})") from exc
        else:
            accepted = ", ".join(["Linear", "LowRank", "Conv2d", "Sequential", "Factored", "KeepFeatures", *_NORMS,
                                  *_SIMPLE])
            raise CheckpointError(f"unknown module type {kind!r}; accepted: {accepted}")
    return container(OrderedDict(zip(names, modules))) if names is not None else container(*modules)


def _dense_like(pair: Factored) -> nn.Module:
    first, second = pair
    if isinstance(first, nn.Linear):
        return nn.Linear(first.in_features, second.out_features, bias=second.bias is not None)
    return nn.Conv2d(first.in_channels, second.out_channels, first.kernel_size, first.stride, first.padding,
                     first.dilation, bias=second.bias is not None, padding_mode=first.padding_mode)


def _dense_stand_in(model: nn.Module) -> tuple[nn.Module, dict[str, int]]:
    # A model of its own class with factored layers (low-rank of any network): the same model with
    # each Factored pair back as one (meta, empty) dense layer is what its constructor builds,
    # plus the rank of each pair by name.
    pairs = {name: m for name, m in model.named_modules() if type(m) is Factored}
    if not pairs:
        return model, {}
    with torch.device("meta"):
        dense = {id(pair): _dense_like(pair) for pair in pairs.values()}
    ranks = {name: pair[1].weight.shape[1] for name, pair in pairs.items()}
    return copy.deepcopy(model, memo=dense), ranks


def _graph_build(record: dict[str, Any]) -> nn.Module:
    # graph_checkpoint's model, then the recorded layers factored at their ranks (untrained).
    model = graph_checkpoint.build(record)
    factored = record.get("factored", {})
    if not isinstance(factored, dict):
        raise CheckpointError(f"'factored' must map layer names to ranks, got {factored!r}")
    named = dict(model.named_modules())
    for name, rank in factored.items():
        layer = named.get(name) if name else None
        dense = isinstance(layer, nn.Linear) or (isinstance(layer, nn.Conv2d) and layer.groups == 1)
        top = min(layer.weight.shape[0], layer.weight[0].numel()) if dense else 0
        if not dense or isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank < top:
            raise CheckpointError(f"factored layer {name!r} at rank {rank!r}: the rebuilt model needs a Linear or "
                                  "groups=1 Conv2d there and a rank from 1 to below its full rank")
        parent, _, attr = name.rpartition(".")
        setattr(named[parent], attr, factored_like(layer, rank))
    return model


def _graph_record(model: nn.Module, source: str | dict[str, Any] | None) -> dict[str, Any]:
    # A model of its own class (reduced by edgetorch.reduce.grouped, or factored layer by layer):
    # the constructor + layer sizes (+ the factored layers' ranks).
    stand_in, ranks = _dense_stand_in(model)
    if source is None:
        source = graph_checkpoint.infer_source(stand_in)
    elif isinstance(source, str):
        try:
            inferred = graph_checkpoint.infer_source(stand_in)
        except ValueError:
            inferred = {"spec": source, "kwargs": {}}
        kwargs = inferred["kwargs"] if inferred["spec"] == source or source.startswith("torchvision:") else {}
        source = {"spec": source, "kwargs": kwargs}
    record = graph_checkpoint.describe(stand_in, source) | ({"factored": ranks} if ranks else {})
    with torch.device("meta"):  # check now that load will fit the weights, not when a user loads the file
        try:
            rebuilt = _graph_build(record)
        except CheckpointError as exc:
            raise TypeError(f"cannot describe this {type(model).__name__} for load: {exc}") from exc
    theirs = {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if theirs != ours:
        wrong = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        raise TypeError(f"cannot describe this {type(model).__name__} for load: rebuilding {source['spec']} with the "
                        f"recorded layer sizes gives other tensors for {', '.join(wrong[:5])}")
    return record


def save(model: nn.Module, path: str | Path, extra: dict[str, Any] | None = None,
         source: str | dict[str, Any] | None = None) -> Path:
    """Write ``model`` as ``PATH`` (safetensors) and ``PATH`` with ``.json`` (architecture).

    An ``nn.Sequential`` of the modules the chain reduction produces is listed module by module;
    any other model (a grouped reduction of a torchvision or zoo CNN) is recorded as its
    constructor plus the new size of every layer (:mod:`edgetorch.reduce.graph_checkpoint`).

    Args:
        model: a reduced (or full) supported network.
        path: the weights file, ending in ``.safetensors``.
        extra: more JSON-able facts to record next to the architecture (alpha, method, ...).
        source: for a model that is not a chain, its constructor: ``"torchvision:NAME"``,
            ``"zoo:NAME"`` or ``{"spec": ..., "kwargs": {...}}``; by default inferred (torchvision
            models and the zoo's SmallResNet).

    Returns:
        The JSON path (which :func:`load` accepts, as it does the weights path).

    Raises:
        ValueError: ``path`` does not end in ``.safetensors``, or the constructor cannot be inferred.
        TypeError: a module that the JSON architecture cannot describe.

    Example:
        >>> save(reduce(model, 0.5, "lowrank"), "small.safetensors", {"alpha": 0.5})
        PosixPath('small.json')
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"reduced checkpoints are .safetensors files, got {path.name!r}")
    if is_transformer(model):  # heads and MLP units pruned: constructor + kept sizes per block
        described = transformer_checkpoint.describe(model)
    else:
        try:
            described = architecture(model)
        except TypeError:
            if isinstance(model, nn.Sequential) and source is None:
                raise
            described = _graph_record(model, source)
    record = {**described, **(extra or {})}
    save_weights(model, path)
    json_path = path.with_suffix(".json")
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    return json_path


def load(path: str | Path, model: nn.Module | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a network written by :func:`save` (weights checked strictly).

    Args:
        path: the ``.safetensors`` file or its ``.json`` (what :func:`save` returns); the other
            must sit next to it.
        model: only for a pruned transformer of a class of your own (its record has no
            constructor): that model, unreduced; it is shrunk in place and filled.

    Returns:
        ``(model in eval mode, the JSON record)``.

    Raises:
        CheckpointError: missing or malformed JSON, or weights that do not fit it.

    Example:
        >>> small, record = load("small.safetensors")
        >>> record["alpha"]
        0.5
    """
    path = Path(path)
    json_path = path.with_suffix(".json")
    weights = json_path.with_suffix(".safetensors")
    try:
        record = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{json_path}: cannot read the architecture ({exc})") from exc
    if transformer_checkpoint.is_record(record):
        if model is not None:  # the caller's own class: its constructor is not in the record
            model = transformer_checkpoint.build(record, model)
            load_weights(model, weights)
            return model.eval(), record
        rebuild = transformer_checkpoint.build
    elif model is not None:
        raise ValueError(f"{json_path} records its own architecture; model= is only for a pruned transformer of a "
                         "class of your own")
    else:
        rebuild = _graph_build if graph_checkpoint.is_record(record) else build
    # The JSON sizes every layer (and a grouped record's constructor builds the unreduced model
    # first): built on the meta device, nothing is allocated until the sizes are known to fit the
    # weight file, so a tampered size (a Linear of 10^6 x 10^6) is refused, not attempted.
    with torch.device("meta"):
        model = rebuild(record)
    state = model.state_dict()
    need = sum(t.numel() * t.element_size() for t in state.values())
    have = weights.stat().st_size if weights.is_file() else 0
    if need > have:
        raise CheckpointError(f"{json_path} describes {need:,} bytes of weights but {weights} holds {have:,}: "
                              "the two files do not belong together (save writes both)")
    if {n for n, _ in model.named_buffers()} <= state.keys():
        model = model.to_empty(device="cpu")  # every tensor is then filled from the file, strictly
    else:  # a buffer the file does not hold keeps its constructor value
        model = rebuild(record)
    load_weights(model, weights)
    return model.eval(), record
