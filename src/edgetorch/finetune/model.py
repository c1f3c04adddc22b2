"""The model a fine-tuning run starts from, its new classifier, and which parameters train.

Scopes (what the Back Razor paper compares, Jiang et al. Table 1, plus BitFit):

* ``full``: every parameter;
* ``last``: the classifier only (linear probing);
* ``norm+last``: the normalisation layers' affine parameters and the classifier;
* ``bias``: every bias and the classifier (BitFit, Ben Zaken et al., 2022).

The classifier is the model's last ``nn.Linear`` (``fc`` in torchvision's ResNets,
``classifier.1`` in MobileNet v2, ``heads.head`` in ViT). When its outputs differ from the
data's classes it is replaced by a new one of the same input width; every other name stays, so
the saved weights load into the architecture's own builder with ``num_classes`` set.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .._checks import check_choice
from .._status import Notice

SCOPES = ("full", "last", "norm+last", "bias")
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)


def classifier_name(model: nn.Module) -> str:
    """The qualified name of ``model``'s last ``nn.Linear`` (its classifier).

    Raises:
        ValueError: the model has no ``nn.Linear``.
    """
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no nn.Linear classifier to fine-tune; "
                         "give a model whose last layer is a Linear")
    return names[-1]


def replace_classifier(model: nn.Module, num_classes: int, *, new_task: bool = False) -> bool:
    """Give ``model`` a new classifier with ``num_classes`` outputs, unless it has that many.

    Args:
        model: the model (its classifier is found with :func:`classifier_name`).
        num_classes: outputs of the new classifier.
        new_task: replace it even when it has ``num_classes`` outputs: a model trained on other
            classes, as many as the new task's (transfer from classes 0-4 to 5-9), has a head
            that maps features to the wrong labels.

    Returns:
        Whether a new classifier was made (from the current torch RNG).
    """
    name = classifier_name(model)
    old = model.get_submodule(name)
    if old.out_features == num_classes and not new_task:
        return False
    parent_name, _, attr = name.rpartition(".")
    new = nn.Linear(old.in_features, num_classes, bias=old.bias is not None,
                    device=old.weight.device, dtype=old.weight.dtype)
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    return True


def start_model(spec: str, num_classes: int | None, weights: str | Path | None = None, *,
                notice: Notice | None = None) -> tuple[nn.Module, str]:
    """Build ``spec``, load its weights, and give it ``num_classes`` outputs.

    Args:
        spec: ``torchvision:NAME``, ``zoo:NAME`` or ``package.module:factory``.
        num_classes: the data's classes (a new classifier is made, from the current torch RNG,
            when the model has another count); ``None`` keeps the model's classifier.
        weights: a local weight file of the architecture, with its own classifier (e.g.
            torchvision's ImageNet weights, 1,000 outputs). ``None``: a zoo model starts from
            its weights pretrained on scikit-learn digits (seconds to train, then cached);
            any other spec starts from random weights.
        notice: told when that pretraining runs (first use), and its time left.

    Returns:
        ``(model, origin)``: the model in train mode, and one line on where its weights came from.

    Raises:
        ValueError: a bad spec; CheckpointError: weights that do not fit the architecture.

    Example:
        >>> model, origin = start_model("zoo:cnn", num_classes=3)  # doctest: +SKIP
    """
    from ..zoo import ZOO_MODELS, build_model, load_weights, pretrained, read_weights

    prefix, _, name = spec.partition(":")
    if weights is not None:
        state = read_weights(weights)
        model = build_model(spec)
        head = classifier_name(model)
        saved = state.get(f"{head}.weight")
        in_features = model.get_submodule(head).in_features
        # The file's own class count (e.g. 1,000), taken only from a classifier the file really
        # holds: a [10**9, 0] weight in an 88-byte file asked for a 2 TB classifier.
        if saved is not None and saved.dim() == 2 and saved.shape[1] == in_features:
            replace_classifier(model, saved.shape[0])
        load_weights(model, weights, state)
        origin = f"weights from {weights}"
    elif prefix == "zoo" and name in ZOO_MODELS:
        model = pretrained(name, dataset="digits", notice=notice)
        origin = f"{spec} pretrained on scikit-learn digits (edgetorch's zoo recipe)"
    else:
        model = build_model(spec)
        origin = "random initialisation (no --weights given): training from scratch"
    if num_classes is not None and replace_classifier(model, num_classes):
        origin += f"; new {num_classes}-class classifier"
    return model.train(), origin


def set_scope(model: nn.Module, scope: str) -> list[nn.Parameter]:
    """Mark which parameters train (``requires_grad``) and return them.

    Args:
        model: the model (its classifier is found with :func:`classifier_name`).
        scope: one of :data:`SCOPES`.

    Returns:
        The trainable parameters, in the model's order.

    Raises:
        ValueError: an unknown scope.
    """
    check_choice("scope", scope, SCOPES)
    keep = set(model.get_submodule(classifier_name(model)).parameters())
    if scope == "full":
        keep = set(model.parameters())
    elif scope == "norm+last":
        keep |= {p for m in model.modules() if isinstance(m, _NORMS) for p in m.parameters()}
    elif scope == "bias":
        keep |= {p for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] == "bias"}
    for p in model.parameters():
        p.requires_grad_(p in keep)
    return [p for p in model.parameters() if p.requires_grad]

