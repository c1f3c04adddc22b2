"""Resolve a model spec string to a freshly built ``nn.Module``.

Accepted specs:

* ``zoo:NAME`` -- an edgetorch zoo model (``zoo:cnn``, ``zoo:plaincnn``, ``zoo:mlp``);
* ``torchvision:NAME`` -- any torchvision classification model builder, randomly initialised
  (``weights=None``: no download is ever attempted; pass ``weights=PATH`` for a local file);
* ``package.module:factory`` -- import ``package.module`` and call ``factory`` (a dotted
  attribute path such as ``Class.build`` is allowed). The prefixes ``zoo`` and
  ``torchvision`` always mean the two cases above.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .models import MLP, PlainCNN, SmallResNet
from ..weights import load_weights

ZOO_MODELS: dict[str, type[nn.Module]] = {"cnn": SmallResNet, "plaincnn": PlainCNN, "mlp": MLP}
_FORMS = "'zoo:NAME', 'torchvision:NAME' or 'package.module:factory'"


def takes_image_size(name: str) -> bool:
    """Whether zoo model ``name`` is built for one input size (its Linear layers follow the image).

    Args:
        name: a key of :data:`ZOO_MODELS`.
    """
    return "image_size" in inspect.signature(ZOO_MODELS[name]).parameters


def input_channels(model: nn.Module) -> int:
    """The channels of the model's first convolution (1 for a model without one: an MLP on gray images)."""
    first = next((m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    return first.in_channels if first is not None else 1


def with_channels(images: torch.Tensor, channels: int) -> torch.Tensor:
    """Grey images ``[N, 1, H, W]`` fed to a model with ``channels`` inputs: the same image in each.

    Args:
        images: a batch; returned as is unless it has one channel and ``channels > 1``.
        channels: the model's input channels (:func:`input_channels`).

    Returns:
        ``[N, channels, H, W]`` (an expanded view: no copy).

    Example:
        >>> with_channels(torch.zeros(2, 1, 32, 32), 3).shape
        torch.Size([2, 3, 32, 32])
    """
    return images.expand(-1, channels, -1, -1) if images.shape[1] == 1 and channels > 1 else images


def torchvision_classification_models() -> list[str]:
    """Names accepted after ``torchvision:``.

    Returns:
        Sorted classification model names of the installed torchvision.
    """
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def _build_zoo(name: str, num_classes: int | None, kw: dict[str, Any]) -> nn.Module:
    if name not in ZOO_MODELS:
        raise ValueError(f"unknown zoo model {name!r}; accepted: {', '.join(ZOO_MODELS)}")
    cls = ZOO_MODELS[name]
    if num_classes is not None:
        kw = {**kw, "num_classes": num_classes}
    try:
        inspect.signature(cls).bind(**kw)
    except TypeError as exc:
        accepted = ", ".join(inspect.signature(cls).parameters)
        raise ValueError(f"zoo:{name} got bad arguments ({exc}); accepted: {accepted}") from exc
    return cls(**kw)


def _build_torchvision(name: str, num_classes: int | None, kw: dict[str, Any]) -> nn.Module:
    import torchvision

    names = torchvision_classification_models()
    if name not in names:
        raise ValueError(
            f"unknown torchvision classification model {name!r}; accepted: {', '.join(names)}"
        )
    if num_classes is not None:
        kw = {**kw, "num_classes": num_classes}
    # GoogLeNet and Inception v3 return auxiliary outputs in train mode, which no loss takes;
    # every other builder returns plain logits, so these two do too unless asked otherwise.
    kw = {**_PLAIN_LOGITS.get(name, {}), **kw}
    return torchvision.models.get_model(name, weights=None, **kw)


_PLAIN_LOGITS = {"googlenet": {"aux_logits": False, "init_weights": True},
                 "inception_v3": {"aux_logits": False, "init_weights": True}}


def _resolve_factory(spec: str, module_name: str, attr_path: str) -> Callable[..., Any]:
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"model spec {spec!r}: cannot import module {module_name!r} ({exc})"
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model spec {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"model spec {spec!r}: {attr_path!r} is not callable")
    return obj


def redraw_zero_weights(model: nn.Module, std: float = 0.02) -> nn.Module:
    """Draw every all-zero weight matrix of a randomly initialised model from N(0, std^2), in place.

    Some builders zero-initialise a layer meant to be fine-tuned after a pretrained body
    (torchvision's ViT heads): at random init no gradient then reaches the rest of the model, so a
    gradient measurement on it sees that one layer. Biases and vectors are left alone.

    Args:
        model: a model at random init (a trained one has no all-zero weight matrices to redraw).
        std: standard deviation of the draw (0.02, a transformer's usual init).

    Returns:
        ``model``.

    Example:
        >>> model = redraw_zero_weights(build_model("torchvision:vit_b_16", num_classes=10))
    """
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and not p.any():
                nn.init.normal_(p, std=std)
    return model


def redraw_batchnorm(model: nn.Module) -> nn.Module:
    """Give every ``BatchNorm2d`` of a randomly initialised model trained-looking statistics, in place.

    At init every batch norm is the identity (mean 0, variance 1, weight 1, bias 0), so all
    channels look alike to anything that measures them (channel pruning's energies and
    covariances). Measurements on untrained weights draw, per batch norm in module order, a
    running mean in [-0.5, 0.5], a running variance in [0.5, 2], a weight in [0.2, 1.5] and a
    bias in [-0.2, 0.4] from the global RNG.

    Args:
        model: a model at random init.

    Returns:
        ``model`` in eval mode (its running statistics are what a forward pass then uses).

    Example:
        >>> model = redraw_batchnorm(build_model("torchvision:resnet50", num_classes=10))
    """
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.2, 1.5)
                m.bias.uniform_(-0.2, 0.4)
    return model.eval()


def build_model(
    spec: str,
    num_classes: int | None = None,
    weights: str | Path | None = None,
    **kw: Any,
) -> nn.Module:
    """Build a model from a spec string (see the module docstring for the accepted forms).

    Args:
        spec: ``zoo:NAME``, ``torchvision:NAME`` or ``package.module:factory``.
        num_classes: passed to the builder as ``num_classes=`` when given; ``None`` keeps the
            builder's default.
        weights: optional local weight file (safetensors, or a state dict read with
            ``torch.load(weights_only=True)``), loaded with a strict key/shape check.
        **kw: further keyword arguments for the builder (e.g. ``widths=`` for ``zoo:cnn``).

    Returns:
        The built model (training mode, as builders return it).

    Raises:
        ValueError: malformed spec, unknown name (the message lists accepted ones), unimportable
            module, bad builder arguments for a zoo model.
        TypeError: a factory returned something that is not an ``nn.Module``.
        CheckpointError: ``weights`` does not fit the model.
    """
    prefix, sep, name = spec.partition(":")
    if not sep or not prefix or not name:
        raise ValueError(f"malformed model spec {spec!r}; accepted forms: {_FORMS}")
    if prefix == "zoo":
        model = _build_zoo(name, num_classes, kw)
    elif prefix == "torchvision":
        model = _build_torchvision(name, num_classes, kw)
    else:
        factory = _resolve_factory(spec, prefix, name)
        if num_classes is not None:
            kw = {**kw, "num_classes": num_classes}
        model = factory(**kw)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model spec {spec!r}: factory returned {type(model).__name__}, expected nn.Module"
            )
    if weights is not None:
        load_weights(model, weights)
    return model
