"""Grouped-reduced models on disk without pickle: safetensors weights + a JSON "how to rebuild".

A model reduced by :mod:`edgetorch.reduce.grouped` keeps its class (a torchvision ``ResNet``, the
zoo's ``SmallResNet``) but has smaller layers, so the JSON names the constructor
(``{"spec": "torchvision:resnet18", "kwargs": {"num_classes": 10}}``) and the new size of every
``Conv2d`` / ``Linear`` / ``BatchNorm`` by its qualified name. ``load`` builds the model from the
spec (only ``zoo:`` and ``torchvision:`` specs: a ``package.module:factory`` spec would import and
run code named by the file), replaces those layers by ones of the recorded sizes, keeping every
other constructor argument of the freshly built layer (kernel, stride, padding), and loads the
weights with a strict key and shape check. Nothing in either file is executed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..zoo import CheckpointError, build_model
from ..zoo.models import BasicBlock, SmallResNet
from ._record import FLAG, MAX_MODULES, MAX_WIDTH, NESTED, TEXT, Field, fields, integer, listing, mapping, number, shown

FORMAT = "edgetorch.reduced-graph/1"
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


def _describe(module: nn.Module) -> dict[str, Any] | None:
    if isinstance(module, nn.Conv2d):
        return {"type": "Conv2d", "in": module.in_channels, "out": module.out_channels, "groups": module.groups,
                "bias": module.bias is not None}
    if isinstance(module, nn.Linear):
        return {"type": "Linear", "in": module.in_features, "out": module.out_features, "bias": module.bias is not None}
    if isinstance(module, _NORMS):
        return {"type": type(module).__name__, "features": module.num_features}
    return None


def _outputs(model: nn.Module) -> int:
    last = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))][-1]
    return last.out_channels if isinstance(last, nn.Conv2d) else last.out_features


def _layout(model: nn.Module) -> list[tuple[str, str]]:
    return [(name, type(m).__name__) for name, m in model.named_modules()]


def infer_source(model: nn.Module) -> dict[str, Any]:
    """The constructor of a torchvision model or the zoo's SmallResNet, as ``{"spec", "kwargs"}``.

    A torchvision builder is found by building the candidates of the model's class on the meta
    device (no memory, no weights) and comparing the module layout.

    Raises:
        ValueError: no known constructor builds this layout (pass ``source=`` to ``save``).
    """
    if isinstance(model, SmallResNet):
        blocks = [m for m in model.features if isinstance(m, BasicBlock)]
        starts = [i for i, b in enumerate(blocks) if b.conv1.stride != (1, 1)] + [len(blocks)]
        return {"spec": "zoo:cnn", "kwargs": {
            "num_classes": model.classifier.out_features, "in_channels": model.features[0][0].in_channels,
            "widths": [blocks[i].conv2.out_channels for i in starts[:-1]],
            "blocks_per_stage": [b - a for a, b in zip(starts[:-1], starts[1:])]}}
    if type(model).__module__.startswith("torchvision.models"):
        import torchvision

        kwargs = {"num_classes": _outputs(model)}
        for name in torchvision.models.list_models(module=torchvision.models):
            if torchvision.models.get_model_builder(name).__module__ != type(model).__module__:
                continue
            try:
                with torch.device("meta"):
                    candidate = build_model(f"torchvision:{name}", **kwargs)
            except Exception:  # a builder that refuses these arguments is not the one
                continue
            if _layout(candidate) == _layout(model):
                return {"spec": f"torchvision:{name}", "kwargs": kwargs}
    raise ValueError(f"cannot tell which constructor built this {type(model).__name__}; pass source='torchvision:NAME' "
                     "or 'zoo:NAME' (with source_kwargs) to save")


def describe(model: nn.Module, source: dict[str, Any]) -> dict[str, Any]:
    """The JSON record: format, source constructor and the size of every weight and norm layer."""
    modules = {name: d for name, m in model.named_modules() if name and (d := _describe(m)) is not None}
    return {"format": FORMAT, "source": source, "modules": modules}


_SCALAR = Field(f"a number from {-MAX_WIDTH} to {MAX_WIDTH}, true, false or a string of at most 256 characters",
                lambda v: FLAG.test(v) or TEXT.test(v) or number(-MAX_WIDTH).test(v))
_KWARG = Field(f"{_SCALAR.accepted}, or a list of at most 64 of them",
               lambda v: _SCALAR.test(v) or listing(_SCALAR, 64).test(v),
               lambda v: tuple(v) if isinstance(v, list) else v)  # the builders take tuples (widths=...)
# The fields of each recorded layer; every other constructor argument is the freshly built layer's.
_ENTRY_FIELDS = {"Conv2d": {"in": integer(), "out": integer(), "groups": integer(), "bias": FLAG},
                 "Linear": {"in": integer(), "out": integer(), "bias": FLAG},
                 **{cls.__name__: {"features": integer()} for cls in _NORMS}}


def _entry(name: str, entry: Any) -> tuple[str, dict[str, Any]]:
    """A module entry's type and checked fields."""
    kind = entry.get("type") if isinstance(entry, dict) else None
    if not isinstance(kind, str) or kind not in _ENTRY_FIELDS:
        raise CheckpointError(f"module {name!r}: unknown type {shown(kind)}; accepted: {', '.join(_ENTRY_FIELDS)}")
    where = f"module {name!r} ({kind})"
    layer = fields({k: v for k, v in entry.items() if k != "type"}, where, _ENTRY_FIELDS[kind])
    if kind == "Conv2d" and (layer["in"] % layer["groups"] or layer["out"] % layer["groups"]):
        raise CheckpointError(f"{where}: groups={layer['groups']} must divide in={layer['in']} and out={layer['out']}")
    return kind, layer


def _source(record: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The checked constructor spec and keyword arguments."""
    source = fields(record.get("source"), "source", {"spec": TEXT}, {"kwargs": NESTED})
    spec = source["spec"]
    if spec.partition(":")[0] not in ("zoo", "torchvision"):
        raise CheckpointError(f"source spec {spec!r} is not accepted: a reduced model is rebuilt only from "
                              "'zoo:NAME' or 'torchvision:NAME' (a 'package.module:factory' spec would run code "
                              "named by the file)")
    kwargs = source.get("kwargs", {})
    if not isinstance(kwargs, dict) or len(kwargs) > 64 or not all(TEXT.test(k) for k in kwargs):
        raise CheckpointError(f"source kwargs must map names to values, at most 64 of them, got {shown(kwargs)}")
    if "weights" in kwargs:  # build_model would read the file it names
        raise CheckpointError("source kwargs may not name 'weights': the weights are the .safetensors file beside "
                              "the record")
    return spec, {k: _KWARG(v, f"source kwargs {k!r}") for k, v in kwargs.items()}


def check(record: Any) -> int:
    """Check every field of a :func:`describe` record, before anything is built.

    Returns:
        The fewest weights (tensor elements) the recorded layers hold (kernel sizes and norm
        layers' tensors are the constructor's, so not counted).

    Raises:
        CheckpointError: wrong format, a source spec other than ``zoo:``/``torchvision:``, a
            refused field, or more than ``MAX_MODULES`` layers.
    """
    if not is_record(record):
        raise CheckpointError(f"not a grouped-reduction record (expected format {FORMAT!r})")
    _source(record)
    entries = mapping(record.get("modules"), "'modules'", "module names to their sizes", MAX_MODULES)
    weights = 0
    for name, entry in entries.items():
        _, layer = _entry(name, entry)
        if "in" in layer:  # a norm layer's tensors follow constructor arguments the record does not hold
            weights += layer["in"] * layer["out"] // layer.get("groups", 1) + (layer["out"] if layer["bias"] else 0)
    return weights


def _replacement(name: str, old: nn.Module, entry: dict[str, Any]) -> nn.Module:
    kind, f = _entry(name, entry)
    if kind != type(old).__name__:
        raise CheckpointError(f"module {name!r}: the file says {kind!r}, the rebuilt model has {type(old).__name__}")
    if kind == "Conv2d":
        return nn.Conv2d(f["in"], f["out"], old.kernel_size, old.stride, old.padding, old.dilation, f["groups"],
                         f["bias"], old.padding_mode)
    if kind == "Linear":
        return nn.Linear(f["in"], f["out"], f["bias"])
    return type(old)(f["features"], eps=old.eps, momentum=old.momentum, affine=old.affine,
                     track_running_stats=old.track_running_stats)


def build(record: dict[str, Any]) -> nn.Module:
    """Rebuild the (untrained) model a :func:`describe` record names (each field checked first).

    Raises:
        CheckpointError: what :func:`check` refuses, constructor arguments the constructor refuses,
            or a module entry that does not fit the rebuilt model.
    """
    check(record)
    spec, kwargs = _source(record)
    try:
        model = build_model(spec, **kwargs)
    except CheckpointError:
        raise
    # What a constructor raises for arguments it cannot use: ValueError and TypeError from its own
    # checks, RuntimeError from torch (a negative width), AssertionError and ArithmeticError from
    # arithmetic on them.
    except (ValueError, TypeError, RuntimeError, AssertionError, ArithmeticError) as exc:
        raise CheckpointError(f"cannot rebuild {spec} with {shown(kwargs)}: {exc}") from None
    named = dict(model.named_modules())
    for name, entry in record["modules"].items():
        if name not in named or not name:
            raise CheckpointError(f"module {name!r} is not in a freshly built {spec}")
        parent_name, _, attr = name.rpartition(".")
        setattr(named[parent_name], attr, _replacement(name, named[name], entry))
    return model


def is_record(record: Any) -> bool:
    """Whether a JSON record is in this module's format."""
    return isinstance(record, dict) and record.get("format") == FORMAT
