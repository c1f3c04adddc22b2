"""Reduced networks on disk without pickle: safetensors weights + a JSON layer list.

``edgetorch.reduce.save(model, "small.safetensors")`` writes the weights and ``small.json``, which
lists every module of the ``nn.Sequential`` with its sizes (widths, channels, kernels, ranks, kept
input units) and the few constructor arguments of activations and pooling; nested containers are
listed as such, with their children's names where these are not positions.
``edgetorch.reduce.load`` rebuilds the modules from the JSON and loads the weights with a strict
key/shape check: nothing in either file is ever executed. A model that is not a chain (a grouped
reduction of a residual or depthwise CNN) is recorded as its constructor plus its layer sizes
(:mod:`edgetorch.reduce.graph_checkpoint`), and, where low-rank factored its layers, the rank of
each :class:`~edgetorch.reduce.factored.Factored` layer by name; ``load`` tells the formats apart. (Plain state dicts, whose architecture
the caller builds, use ``edgetorch.zoo.save_weights`` / ``load_weights``.)
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._files import open_regular, read_bytes, read_json
from ..zoo import CheckpointError, load_weights, save_weights
from ..weights import tensors_from_bytes
from . import graph_checkpoint, transformer_checkpoint
from ._record import (FLAG, MAX_MODULES, MAX_RECORD_BYTES, MAX_WEIGHT_BYTES, MAX_WIDTH, NESTED, Field, check_fits,
                      fields, integer, mapping, meta_build, number, one_or_pair, optional, pair, shown, word)
from .factored import Factored, factored_like
from .sequential import ELEMENTWISE, PER_CHANNEL, KeepFeatures
from .transformer_blocks import is_transformer

_FORMAT = "edgetorch.reduced/1"
_HEADER_BYTES = 1 << 20  # room for a safetensors header beyond the tensors' bytes (plus 1 KiB per tensor)
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
        model: an ``nn.Sequential`` of the modules :func:`edgetorch.reduce.reduce_model` produces.

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


_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
_DIM = integer(-4, 3)  # a chain's tensors have at most 4 dimensions (N, C, H, W)
_PADDING = Field(f"'same', 'valid' or a list of two integers from 0 to {MAX_WIDTH}",
                 lambda v: v in ("same", "valid") if isinstance(v, str) else pair(integer(0)).test(v),
                 lambda v: v if isinstance(v, str) else tuple(v))
_NORM_FIELDS = {"features": integer(), "eps": number(0, 1, above=True), "momentum": optional(number(0, 1)),
                "affine": FLAG, "track_running_stats": FLAG}
# The fields of each layer entry, all required (save writes every one).
_LAYER_FIELDS: dict[str, dict[str, Field]] = {
    "Linear": {"in": integer(), "out": integer(), "bias": FLAG},
    "LowRank": {"in": integer(), "rank": integer(), "out": integer(), "bias": FLAG},
    "Conv2d": {"in": integer(), "out": integer(), "kernel_size": pair(integer()), "stride": pair(integer()),
               "padding": _PADDING, "dilation": pair(integer()), "padding_mode": word(*_PADDING_MODES), "bias": FLAG},
    **{name: _NORM_FIELDS for name in _NORMS},
    "KeepFeatures": {"size": integer(), "dim": _DIM},
}
# What each recorded argument of a parameter-free module accepts, by name (kernel_size means the same
# for both pools). Any may be left out: the constructor's default applies.
_ARGUMENT_FIELDS: dict[str, Field] = {
    "negative_slope": number(), "alpha": number(), "approximate": word("none", "tanh"), "min_val": number(),
    "max_val": number(), "beta": number(0, above=True), "threshold": number(), "p": number(0, 1),
    "dim": optional(_DIM), "start_dim": _DIM, "end_dim": _DIM, "kernel_size": one_or_pair(integer()),
    "stride": optional(one_or_pair(integer())), "padding": one_or_pair(integer(0)),
    "dilation": one_or_pair(integer()), "ceil_mode": FLAG, "count_include_pad": FLAG,
    "divisor_override": optional(integer()), "output_size": one_or_pair(optional(integer())),
}
_CONTAINERS = ("Sequential", "Factored")
_KINDS = ", ".join([*_LAYER_FIELDS, *_CONTAINERS, *_SIMPLE])


def _weights(kind: str, layer: dict[str, Any]) -> int:
    """The weights (tensor elements) of a checked layer entry."""
    bias = layer["out"] if layer.get("bias") else 0
    if kind == "Linear":
        return layer["in"] * layer["out"] + bias
    if kind == "LowRank":
        return layer["rank"] * (layer["in"] + layer["out"]) + bias
    if kind == "Conv2d":
        return layer["in"] * layer["out"] * math.prod(layer["kernel_size"]) + bias
    if kind in _NORMS:  # weight and bias, running mean and variance
        return 2 * layer["features"] * (layer["affine"] + layer["track_running_stats"])
    return layer["size"]  # KeepFeatures: its index


def _entry(entry: Any, where: str) -> tuple[str, dict[str, Any]]:
    """A module entry's type and its checked, converted fields (a parameter-free module's: its arguments)."""
    kind = entry.get("type") if isinstance(entry, dict) else None
    if not isinstance(kind, str) or kind not in (*_LAYER_FIELDS, *_CONTAINERS, *_SIMPLE):
        raise CheckpointError(f"{where}: unknown module type {shown(kind)}; accepted: {_KINDS}")
    where = f"{where} ({kind})"
    body = {key: value for key, value in entry.items() if key != "type"}
    if kind in _CONTAINERS:
        return kind, fields(body, where, {"modules": NESTED}, {"names": NESTED})
    if kind in _LAYER_FIELDS:
        layer = fields(body, where, _LAYER_FIELDS[kind])
        if kind == "Conv2d" and layer["padding"] == "same" and layer["stride"] != (1, 1):
            raise CheckpointError(f"{where}: padding 'same' needs stride [1, 1], got {list(layer['stride'])}")
        return kind, layer
    args = fields(body, where, {}, {"args": NESTED}).get("args", {})
    allowed = _ARGUMENTS.get(_SIMPLE[kind], ())
    return kind, fields(args, f"{where} args", {}, {name: _ARGUMENT_FIELDS[name] for name in allowed})


def check(description: Any) -> int:
    """Check every field of a chain record (:func:`architecture`), before anything is built.

    Returns:
        The weights (tensor elements) its layers hold.

    Raises:
        CheckpointError: another format, an unknown module type, a missing, unknown or refused
            field, or more than ``MAX_MODULES`` modules.
    """
    if not isinstance(description, dict) or description.get("format") != _FORMAT:
        raise CheckpointError(f"not a reduced-network description (expected format {_FORMAT!r})")
    weights, modules, pending = 0, 0, [(description, "")]
    while pending:  # containers nest at most as deep as the JSON (its depth is limited when read)
        container, prefix = pending.pop()
        entries, names = container.get("modules"), container.get("names")
        if not isinstance(entries, list):
            raise CheckpointError(f"'modules' must be a list of module entries, got {shown(entries)}")
        modules += len(entries)
        if modules > MAX_MODULES:
            raise CheckpointError(f"the record lists more than {MAX_MODULES} modules, the most a reduced-network "
                                  "record may build")
        if names is not None and not (isinstance(names, list) and len(names) == len(entries)
                                      and all(isinstance(n, str) and n and "." not in n for n in names)
                                      and len(set(names)) == len(names)):
            raise CheckpointError(f"'names' must give each of the {len(entries)} modules a distinct non-empty name "
                                  f"without '.', got {shown(names)}")
        if container.get("type") == "Factored" and len(entries) != 2:
            raise CheckpointError(f"module {prefix[:-1]} (Factored) must hold two layers, got {len(entries)}")
        for i, entry in enumerate(entries):
            kind, checked = _entry(entry, f"module {prefix}{i}")
            if kind in _CONTAINERS:
                pending.append((entry, f"{prefix}{i}."))
            elif kind in _LAYER_FIELDS:
                weights += _weights(kind, checked)
    return weights


def build(description: Any) -> nn.Sequential:
    """Rebuild the (untrained) modules listed by :func:`architecture` (each field checked first).

    Raises:
        CheckpointError: whatever :func:`check` refuses, or arguments a module's constructor refuses
            together (a Hardtanh whose ``min_val`` is not below its ``max_val``).
    """
    check(description)
    return _modules(description)


def _modules(description: dict[str, Any], container: type[nn.Sequential] = nn.Sequential,
             prefix: str = "") -> nn.Sequential:
    modules = [_module(entry, f"{prefix}{i}") for i, entry in enumerate(description["modules"])]
    names = description.get("names")
    return container(OrderedDict(zip(names, modules))) if names is not None else container(*modules)


def _module(entry: dict[str, Any], at: str) -> nn.Module:
    kind, f = _entry(entry, f"module {at}")
    if kind in _CONTAINERS:
        return _modules(entry, Factored if kind == "Factored" else nn.Sequential, f"{at}.")
    if kind == "Linear":
        return nn.Linear(f["in"], f["out"], bias=f["bias"])
    if kind == "LowRank":
        return Factored(nn.Linear(f["in"], f["rank"], bias=False), nn.Linear(f["rank"], f["out"], bias=f["bias"]))
    if kind == "Conv2d":
        return nn.Conv2d(f["in"], f["out"], f["kernel_size"], f["stride"], f["padding"], f["dilation"],
                         bias=f["bias"], padding_mode=f["padding_mode"])
    if kind in _NORMS:
        return _NORMS[kind](f["features"], eps=f["eps"], momentum=f["momentum"], affine=f["affine"],
                            track_running_stats=f["track_running_stats"])
    if kind == "KeepFeatures":
        return KeepFeatures(torch.zeros(f["size"], dtype=torch.long), f["dim"])
    try:
        return _SIMPLE[kind](**f)
    except (TypeError, ValueError, AssertionError) as exc:  # arguments refused together (Hardtanh's min < max)
        raise CheckpointError(f"module {at} ({kind}) rejected arguments {shown(entry.get('args'))} ({exc})") from None


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


def _factored(record: dict[str, Any]) -> dict[str, int]:
    """A graph record's factored layers and their ranks, checked (whether each fits is known once built)."""
    factored = mapping(record.get("factored", {}), "'factored'", "layer names to ranks", MAX_MODULES)
    return {name: integer()(rank, f"factored layer {name!r}: rank") for name, rank in factored.items()}


def _graph_check(record: Any) -> int:
    """Check every field of a graph record (with its factored layers); the fewest weights it implies."""
    weights = graph_checkpoint.check(record)
    _factored(record)
    return weights


def _graph_build(record: dict[str, Any]) -> nn.Module:
    # graph_checkpoint's model, then the recorded layers factored at their ranks (untrained).
    model = graph_checkpoint.build(record)
    named = dict(model.named_modules())
    for name, rank in _factored(record).items():
        layer = named.get(name) if name else None
        dense = isinstance(layer, nn.Linear) or (isinstance(layer, nn.Conv2d) and layer.groups == 1)
        top = min(layer.weight.shape[0], layer.weight[0].numel()) if dense else 0
        if not 1 <= rank < top:
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
        >>> save(reduce_model(model, 0.5, "lowrank").model, "small.safetensors", {"alpha": 0.5})
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


# Each record format: its check (every field, before anything is built; returns the fewest weights
# the record implies) and its build.
_FORMATS = {_FORMAT: (check, build), graph_checkpoint.FORMAT: (_graph_check, _graph_build),
            transformer_checkpoint.FORMAT: (transformer_checkpoint.check, transformer_checkpoint.build)}


def load(path: str | Path, model: nn.Module | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a network written by :func:`save` (weights checked strictly).

    Both files may come from anyone, so nothing is built until every field of the JSON is checked
    (type, range, accepted words) and the weights its sizes imply are known to fit in the weights
    file; the network is then built on the meta device (no memory, at most ``MAX_MODULES``
    modules) and every tensor comes from the weights file, read within a limit the built network
    sets. Limits: the JSON at most 4 MiB, the weights file at most 8 GiB, any width 2**24, a
    transformer 128 layers (:mod:`edgetorch.reduce._record`).

    Args:
        path: the ``.safetensors`` file or its ``.json`` (what :func:`save` returns); the other
            must sit next to it.
        model: only for a pruned transformer of a class of your own (its record has no
            constructor): that model, unreduced; it is shrunk in place and filled.

    Returns:
        ``(model in eval mode, the JSON record)``.

    Raises:
        CheckpointError: either file missing, not a regular file or too large; JSON that is
            malformed or nested too deeply; a field refused (the message names it and says what
            is accepted); weights that do not fit the record. Anything else a crafted record makes
            a constructor raise is reported as a CheckpointError too.
        ValueError: ``model`` given for a record that names its own architecture.

    Example:
        >>> small, record = load("small.safetensors")
        >>> record["alpha"]
        0.5
    """
    path = Path(path)
    json_path = path.with_suffix(".json")
    weights = json_path.with_suffix(".safetensors")
    record = read_json(json_path, MAX_RECORD_BYTES, error=CheckpointError)
    kind = record.get("format") if isinstance(record, dict) else None
    if not isinstance(kind, str) or kind not in _FORMATS:
        raise CheckpointError(f"{json_path}: format {shown(kind)} is not a reduced-network record; accepted: "
                              f"{', '.join(_FORMATS)}")
    if model is not None and kind != transformer_checkpoint.FORMAT:
        raise ValueError(f"{json_path} records its own architecture; model= is only for a pruned transformer of a "
                         "class of your own")
    with open_regular(weights, MAX_WEIGHT_BYTES, error=CheckpointError, why=" for a reduced network") as f:
        have = os.fstat(f.fileno()).st_size
    try:
        if model is not None:  # the caller's own class, already built: its constructor is not in the record
            model = transformer_checkpoint.build(record, model)
        else:
            check_record, rebuild = _FORMATS[kind]
            check_fits(check_record(record), have, weights)
            with meta_build():
                model = rebuild(record)
    except CheckpointError as exc:
        raise CheckpointError(f"{json_path}: {exc}") from None
    # The fields are checked above; this is the backstop for what a constructor still raises on a
    # crafted record (the message names the type, so the missing check can be added).
    except Exception as exc:
        raise CheckpointError(f"{json_path}: the recorded network cannot be built ({type(exc).__name__}: "
                              f"{shown(str(exc))})") from exc
    _fill(model, weights, have)
    if kind == transformer_checkpoint.FORMAT:
        transformer_checkpoint.restore_buffers(model)
    left = [name for name, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:  # a buffer that is never saved, of a class restore_buffers does not know
        raise CheckpointError(f"{json_path}: {', '.join(left[:5])} of the recorded network are not in {weights} "
                              "and cannot be rebuilt")
    return model.eval(), record


def _fill(model: nn.Module, weights: Path, have: int) -> None:
    """Put the weights file's tensors in ``model`` (their own, not copies), reading at most what
    ``model`` holds plus room for the header."""
    state = model.state_dict()
    need = sum(t.numel() * t.element_size() for t in state.values())
    if need > have:
        raise CheckpointError(f"the record describes {need:,} bytes of weights but {weights} holds {have:,}: the two "
                              "files do not belong together (save writes both)")
    data = read_bytes(weights, need + _HEADER_BYTES + 1024 * len(state), error=CheckpointError,
                      why=" for the record's network: the two files do not belong together (save writes both)")
    load_weights(model, weights, tensors_from_bytes(data, weights), assign=True)
