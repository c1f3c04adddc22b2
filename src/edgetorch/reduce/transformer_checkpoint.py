"""Pruned transformers on disk without pickle: safetensors weights + a JSON of the constructor and block sizes.

The JSON (format ``edgetorch.reduced-transformer/1``) records

* ``source``: how to build the unreduced model: ``{"class": "transformers.BertModel", "config": {...}}``
  (or ``BertForSequenceClassification``; the config is the plain dictionary ``BertConfig`` takes) or
  ``{"class": "torchvision.VisionTransformer", "kwargs": {...}}`` (its constructor's numbers); ``null``
  for a model of the caller's own class (a classifier wrapping a ``BertModel``), which the caller
  builds and passes to ``edgetorch.reduce.load(path, model=...)``;
* ``blocks``: per block name, the heads and MLP hidden units kept.

``edgetorch.reduce.load`` builds the unreduced model (on the meta device first: the recorded sizes must
fit the weight file before anything is allocated), removes heads and hidden units to the recorded
sizes with the same functions the reduction uses, and loads the weights with a strict key/shape
check. Only the classes named above are ever constructed; nothing in either file is executed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn

from ..zoo import CheckpointError
from .transformer_blocks import find_blocks, keep_heads, keep_hidden, split_attention

FORMAT = "edgetorch.reduced-transformer/1"
_BERT_CLASSES = ("BertModel", "BertForSequenceClassification")
_VIT_ARGUMENTS = ("image_size", "patch_size", "num_layers", "num_heads", "hidden_dim", "mlp_dim", "dropout",
                  "attention_dropout", "num_classes", "representation_size")


def transformer_source(model: nn.Module) -> dict[str, Any] | None:
    """The constructor of a (reduced or full) BERT or torchvision ViT, or ``None`` for any other class.

    Raises:
        TypeError: a ViT with a convolutional stem (its constructor takes layer objects, not numbers).
    """
    from torchvision.models.vision_transformer import VisionTransformer

    if type(model).__name__ in _BERT_CLASSES and type(model).__module__.startswith("transformers."):
        return {"class": f"transformers.{type(model).__name__}", "config": model.config.to_dict()}
    if type(model) is VisionTransformer:
        if not isinstance(model.conv_proj, nn.Conv2d):
            raise TypeError("a VisionTransformer with a convolutional stem cannot be recorded (its constructor takes "
                            "layer configurations); save its state dict and sizes yourself")
        values = {"num_layers": len(model.encoder.layers), "num_heads": model.encoder.layers[0].num_heads,
                  **{k: getattr(model, k) for k in _VIT_ARGUMENTS if hasattr(model, k)}}
        return {"class": "torchvision.VisionTransformer", "kwargs": values}
    return None


def _build(source: dict[str, Any]) -> nn.Module:
    kind = source.get("class") if isinstance(source, dict) else None
    if kind == "torchvision.VisionTransformer":
        from torchvision.models.vision_transformer import VisionTransformer

        kwargs = source.get("kwargs")
        if not isinstance(kwargs, dict) or set(kwargs) - set(_VIT_ARGUMENTS) or not all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in kwargs.values()):
            raise CheckpointError(f"ViT kwargs must be numbers for {', '.join(_VIT_ARGUMENTS)}, got {kwargs!r}")
        try:
            return VisionTransformer(**kwargs)
        except (TypeError, ValueError, AssertionError, RuntimeError) as exc:
            raise CheckpointError(f"cannot build a VisionTransformer from {kwargs}: {exc}") from exc
    name = kind.partition(".")[2] if isinstance(kind, str) and kind.startswith("transformers.") else None
    if name in _BERT_CLASSES:
        import transformers

        config = source.get("config")
        if not isinstance(config, dict) or config.get("model_type") != "bert":
            raise CheckpointError("a BERT source needs its config dictionary with model_type 'bert'")
        try:
            return getattr(transformers, name)(transformers.BertConfig.from_dict(config))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"cannot build {name} from the recorded config: {exc}") from exc
    accepted = ", ".join(["torchvision.VisionTransformer", *(f"transformers.{c}" for c in _BERT_CLASSES)])
    raise CheckpointError(f"source class {kind!r} is not accepted; a pruned transformer is rebuilt only as {accepted} "
                          "(or pass the unreduced model of your own class: load(path, model=...))")


def apply_sizes(model: nn.Module, blocks: dict[str, Any]) -> nn.Module:
    """Shrink an unreduced ``model`` (in place) to the heads and hidden units a record lists per block.

    The kept weights are placeholders (the first heads and units) until a weight file is loaded.

    Args:
        model: the unreduced model (a ViT's attention is split into :class:`HeadAttention` here).
        blocks: ``{block name: {"heads": int, "hidden": int}}``.

    Returns:
        ``model``.

    Raises:
        CheckpointError: a block the model does not have, or a size outside 1..its full size.
    """
    found = {b.name: b for b in find_blocks(split_attention(model))}
    if not isinstance(blocks, dict) or set(blocks) != set(found):
        raise CheckpointError(f"the record's blocks {sorted(blocks) if isinstance(blocks, dict) else blocks!r} are not "
                              f"the model's {sorted(found)}")
    for name, sizes in blocks.items():
        block = found[name]
        for key, full in (("heads", block.heads), ("hidden", block.hidden)):
            value = sizes.get(key) if isinstance(sizes, dict) else None
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= full:
                raise CheckpointError(f"block {name!r}: {key} must be an integer in 1..{full}, got {value!r}")
        if sizes["heads"] < block.heads:
            keep_heads(model, block, np.arange(sizes["heads"]))
        if sizes["hidden"] < block.hidden:
            keep_hidden(model, block, np.arange(sizes["hidden"]))
    return model


def is_record(record: Any) -> bool:
    """Whether a JSON record is a pruned transformer's (what :func:`describe` writes)."""
    return isinstance(record, dict) and record.get("format") == FORMAT


def describe(model: nn.Module) -> dict[str, Any]:
    """The JSON record of a (reduced or full) transformer: format, constructor and kept sizes per block.

    Args:
        model: a model :func:`~edgetorch.reduce.transformer.reduce_transformer` returned (or a full one).

    Returns:
        ``{"format", "source", "blocks"}``; :func:`edgetorch.reduce.save` writes it beside the weights.

    Example:
        >>> describe(reduce_transformer(bert, 0.5, calibration=ids).model)["blocks"]["encoder.layer.0"]
        {'heads': 9, 'hidden': 700}
    """
    blocks = {b.name: {"heads": b.heads, "hidden": b.hidden} for b in find_blocks(model)}
    return {"format": FORMAT, "source": transformer_source(model), "blocks": blocks}


def build(record: dict[str, Any], model: nn.Module | None = None) -> nn.Module:
    """The pruned architecture a record describes, with placeholder weights (``load`` fills them).

    Args:
        record: what :func:`describe` returned.
        model: the unreduced model, for a record without a source (a class of your own); it is
            modified in place.

    Returns:
        The model at the recorded sizes.

    Raises:
        CheckpointError: an unaccepted source, a missing model, or sizes that do not fit the model.
    """
    if model is None:
        if record.get("source") is None:
            raise CheckpointError("the record is of a model of the caller's own class: build it unreduced and pass it "
                                  "as model=: edgetorch.reduce.load(path, model=YourModel())")
        model = _build(record["source"])
    return apply_sizes(model, record.get("blocks"))
