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


def _count(entry: dict[str, Any], key: str) -> int:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"module entry {entry} needs a positive integer {key!r}")
    return value


def _replacement(name: str, old: nn.Module, entry: dict[str, Any]) -> nn.Module:
    kind = entry.get("type") if isinstance(entry, dict) else None
    if kind != type(old).__name__:
        raise CheckpointError(f"module {name!r}: the file says {kind!r}, the rebuilt model has {type(old).__name__}")
    bias = entry.get("bias")
    if kind in ("Conv2d", "Linear") and not isinstance(bias, bool):
        raise CheckpointError(f"module {name!r}: 'bias' must be true or false")
    if kind == "Conv2d":
        c_in, c_out, groups = (_count(entry, k) for k in ("in", "out", "groups"))
        if c_in % groups or c_out % groups:
            raise CheckpointError(f"module {name!r}: groups={groups} must divide in={c_in} and out={c_out}")
        return nn.Conv2d(c_in, c_out, old.kernel_size, old.stride, old.padding, old.dilation, groups, bias,
                         old.padding_mode)
    if kind == "Linear":
        return nn.Linear(_count(entry, "in"), _count(entry, "out"), bias)
    return type(old)(_count(entry, "features"), eps=old.eps, momentum=old.momentum, affine=old.affine,
                     track_running_stats=old.track_running_stats)


def build(record: dict[str, Any]) -> nn.Module:
    """Rebuild the (untrained) model a :func:`describe` record names.

    Raises:
        CheckpointError: wrong format, a source spec other than ``zoo:``/``torchvision:``, bad
            constructor arguments, or a module entry that does not fit the rebuilt model.
    """
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"not a grouped-reduction record (expected format {FORMAT!r})")
    source, entries = record.get("source"), record.get("modules")
    spec = source.get("spec") if isinstance(source, dict) else None
    kwargs = source.get("kwargs", {}) if isinstance(source, dict) else None
    if not isinstance(spec, str) or spec.partition(":")[0] not in ("zoo", "torchvision"):
        raise CheckpointError(f"source spec {spec!r} is not accepted: a reduced model is rebuilt only from "
                              "'zoo:NAME' or 'torchvision:NAME' (a 'package.module:factory' spec would run code "
                              "named by the file)")
    plain = (int, float, str, bool)
    if not isinstance(kwargs, dict) or not all(
            isinstance(k, str) and (isinstance(v, plain) or (isinstance(v, list) and all(isinstance(x, plain) for x in v)))
            for k, v in kwargs.items()):
        raise CheckpointError(f"source kwargs must map names to numbers, strings or lists of them, got {kwargs!r}")
    if not isinstance(entries, dict):
        raise CheckpointError("'modules' must map module names to their sizes")
    try:
        model = build_model(spec, **{k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()})
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"cannot rebuild {spec} with {kwargs}: {exc}") from exc
    named = dict(model.named_modules())
    for name, entry in entries.items():
        if name not in named or not name:
            raise CheckpointError(f"module {name!r} is not in a freshly built {spec}")
        parent_name, _, attr = name.rpartition(".")
        setattr(named[parent_name], attr, _replacement(name, named[name], entry))
    return model


def is_record(record: Any) -> bool:
    """Whether a JSON record is in this module's format."""
    return isinstance(record, dict) and record.get("format") == FORMAT
