"""Pruned transformers on disk without pickle: safetensors weights + a JSON of the constructor and block sizes.

The JSON (format ``edgetorch.reduced-transformer/1``) records

* ``source``: how to build the unreduced model: ``{"class": "transformers.BertModel", "config": {...}}``
  (or ``BertForSequenceClassification``; the config is the plain dictionary ``BertConfig`` takes) or
  ``{"class": "torchvision.VisionTransformer", "kwargs": {...}}`` (its constructor's numbers); ``null``
  for a model of the caller's own class (a classifier wrapping a ``BertModel``), which the caller
  builds and passes to ``edgetorch.reduce.load(path, model=...)``;
* ``blocks``: per block name, the heads and MLP hidden units kept.

``edgetorch.reduce.load`` checks every field first (:func:`check`: a BERT config's keys are the ones
``BertConfig.to_dict`` writes, each with its type and range, and any other key is refused rather than
passed on), counts the weights the pruned sizes imply against the weights file, then builds the
unreduced model on the meta device (no memory), removes heads and hidden units to the recorded sizes
with the same functions the reduction uses, and fills every tensor from the weights file with a
strict key/shape/dtype check. Only the classes named above are ever constructed; nothing in either
file is executed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ..zoo import CheckpointError
from ._record import (FLAG, MAX_LAYERS, NESTED, TEXT, Field, fields, integer, listing, mapping, number, optional, shown,
                      word)
from .transformer_blocks import find_blocks, keep_heads, keep_hidden, split_attention

FORMAT = "edgetorch.reduced-transformer/1"
_BERT_CLASSES = ("BertModel", "BertForSequenceClassification")
_CLASSES = ("torchvision.VisionTransformer", *(f"transformers.{c}" for c in _BERT_CLASSES))
_PROBABILITY = number(0, 1)
_TOKEN = integer(0)  # below the vocabulary size: checked against it
_TOKENS = Field(f"{_TOKEN.accepted}, or a list of them", lambda v: _TOKEN.test(v) or listing(_TOKEN, 64).test(v))
_VIT_REQUIRED = {"image_size": integer(), "patch_size": integer(), "num_layers": integer(1, MAX_LAYERS),
                 "num_heads": integer(), "hidden_dim": integer(), "mlp_dim": integer()}
_VIT_OPTIONAL = {"dropout": _PROBABILITY, "attention_dropout": _PROBABILITY, "num_classes": integer(),
                 "representation_size": optional(integer())}
_VIT_ARGUMENTS = (*_VIT_REQUIRED, *_VIT_OPTIONAL)
_BERT_REQUIRED = {"model_type": word("bert"), "vocab_size": integer(), "hidden_size": integer(),
                  "num_hidden_layers": integer(1, MAX_LAYERS), "num_attention_heads": integer(),
                  "intermediate_size": integer(), "max_position_embeddings": integer(), "type_vocab_size": integer()}
# The rest of what BertConfig.to_dict writes (transformers 5), each with what it accepts.
_BERT_OPTIONAL = {
    "hidden_dropout_prob": _PROBABILITY, "attention_probs_dropout_prob": _PROBABILITY,
    "classifier_dropout": optional(_PROBABILITY), "initializer_range": number(0),
    "layer_norm_eps": number(0, 1, above=True), "pad_token_id": optional(_TOKEN), "bos_token_id": optional(_TOKEN),
    "eos_token_id": optional(_TOKENS), "use_cache": FLAG, "is_decoder": FLAG, "tie_word_embeddings": FLAG,
    "output_hidden_states": FLAG, "output_attentions": FLAG, "return_dict": FLAG, "is_encoder_decoder": FLAG,
    # find_blocks refuses cross-attention, so save never writes true
    "add_cross_attention": Field("false (a record holds encoder layers only)", lambda v: v is False),
    "chunk_size_feed_forward": integer(0),
    "id2label": Field("an object mapping label numbers ('0', '1', ...) to names",
                      lambda v: isinstance(v, dict) and all(k.isdecimal() and TEXT.test(n) for k, n in v.items())),
    "label2id": Field("an object mapping label names to numbers",
                      lambda v: isinstance(v, dict) and all(TEXT.test(k) and _TOKEN.test(n) for k, n in v.items())),
    "problem_type": optional(word("regression", "single_label_classification", "multi_label_classification")),
    "dtype": optional(word("float32", "float16", "bfloat16", "float64")),
    "architectures": optional(listing(TEXT, 16)), "transformers_version": TEXT, "_name_or_path": TEXT,
}


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


def _constructor(source: Any) -> tuple[str, dict[str, Any]]:
    """A record's source, checked: its class and constructor arguments (ViT keyword arguments or a BERT config)."""
    kind = source.get("class") if isinstance(source, dict) else None
    if not isinstance(kind, str) or kind not in _CLASSES:
        raise CheckpointError(f"source class {shown(kind)} is not accepted; a pruned transformer is rebuilt only as "
                              f"{', '.join(_CLASSES)} (or pass the unreduced model of your own class: "
                              "load(path, model=...))")
    if kind == "torchvision.VisionTransformer":
        given = fields(source, "source", {"class": TEXT, "kwargs": NESTED})["kwargs"]
        arguments = fields(given, "ViT kwargs", _VIT_REQUIRED, _VIT_OPTIONAL)
        divides = (("patch_size", "image_size"), ("num_heads", "hidden_dim"))
    else:
        from transformers.activations import ACT2FN

        given = fields(source, "source", {"class": TEXT, "config": NESTED})["config"]
        activation = word(*sorted(ACT2FN))  # the words BertIntermediate looks up
        arguments = fields(given, "BERT config", _BERT_REQUIRED, {**_BERT_OPTIONAL, "hidden_act": activation})
        divides = (("num_attention_heads", "hidden_size"),)
        eos = arguments.get("eos_token_id")
        tokens = [arguments.get("pad_token_id"), arguments.get("bos_token_id"),
                  *(eos if isinstance(eos, list) else [eos])]
        outside = [t for t in tokens if t is not None and t >= arguments["vocab_size"]]
        if outside:
            raise CheckpointError(f"BERT config: token ids must be below vocab_size {arguments['vocab_size']}, got "
                                  f"{shown(outside)}")
    for part, whole in divides:
        if arguments[whole] % arguments[part]:
            raise CheckpointError(f"{kind}: {part}={arguments[part]} must divide {whole}={arguments[whole]}")
    return kind, arguments


def _sizes(kind: str, arguments: dict[str, Any]) -> tuple[int, int, int]:
    """Layers, attention heads and MLP hidden units of each layer of the unreduced model."""
    keys = (("num_layers", "num_heads", "mlp_dim") if kind == "torchvision.VisionTransformer" else
            ("num_hidden_layers", "num_attention_heads", "intermediate_size"))
    return tuple(arguments[k] for k in keys)


def _weights(kind: str, arguments: dict[str, Any], blocks: dict[str, dict[str, int]]) -> int:
    """The fewest weights (tensor elements) the pruned model holds: its embeddings and the kept rows
    and columns of attention and MLP (biases, norms and the classifier are not counted)."""
    if kind == "torchvision.VisionTransformer":
        width, patch = arguments["hidden_dim"], arguments["patch_size"]
        # the patch projection, and a position per patch and for the class token
        fixed = width * (3 * patch * patch + (arguments["image_size"] // patch) ** 2 + 1)
    else:
        width = arguments["hidden_size"]
        fixed = width * (arguments["vocab_size"] + arguments["max_position_embeddings"] + arguments["type_vocab_size"])
    head_size = width // _sizes(kind, arguments)[1]
    return fixed + sum(4 * width * kept["heads"] * head_size + 2 * width * kept["hidden"] for kept in blocks.values())


def check(record: Any, model_given: bool = False) -> int:
    """Check every field of a :func:`describe` record, before anything is built.

    Args:
        record: the parsed JSON.
        model_given: the caller passes the unreduced model (``load(path, model=...)``): the source
            is then not used, so not checked.

    Returns:
        The fewest weights (tensor elements) the pruned model holds (0 for a caller's model, whose
        own sizes bound what is read).

    Raises:
        CheckpointError: another format, a source class not accepted, a missing, unknown or refused
            field, or block sizes the source's layers cannot have.
    """
    if not is_record(record):
        raise CheckpointError(f"not a pruned-transformer record (expected format {FORMAT!r})")
    blocks = {name: fields(sizes, f"block {name!r}", {"heads": integer(), "hidden": integer()}) for name, sizes in
              mapping(record.get("blocks"), "'blocks'", "block names to kept sizes", MAX_LAYERS).items()}
    if model_given:
        return 0
    if record.get("source") is None:
        raise CheckpointError("the record is of a model of the caller's own class: build it unreduced and pass it "
                              "as model=: edgetorch.reduce.load(path, model=YourModel())")
    kind, arguments = _constructor(record["source"])
    layers, heads, hidden = _sizes(kind, arguments)
    if len(blocks) != layers:
        raise CheckpointError(f"the record lists {len(blocks)} blocks, but its {kind} has {layers} layers")
    for name, kept in blocks.items():
        for key, full in (("heads", heads), ("hidden", hidden)):
            if kept[key] > full:
                raise CheckpointError(f"block {name!r}: {key} must be an integer in 1..{full}, got {kept[key]}")
    return _weights(kind, arguments, blocks)


def _build(kind: str, arguments: dict[str, Any]) -> nn.Module:
    if kind == "torchvision.VisionTransformer":
        from torchvision.models.vision_transformer import VisionTransformer

        return VisionTransformer(**arguments)
    import transformers

    return getattr(transformers, kind.partition(".")[2])(transformers.BertConfig.from_dict(arguments))


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
        CheckpointError: what :func:`check` refuses, or sizes that do not fit the model.
    """
    check(record, model is not None)
    if model is None:
        model = _build(*_constructor(record["source"]))
    return apply_sizes(model, record["blocks"])


def restore_buffers(model: nn.Module) -> None:
    """Give BERT embeddings' position and token-type ids, still on the meta device, their constructor values.

    The two are non-persistent buffers, so never in the weights file. ``load`` once rebuilt the
    unreduced model on the CPU to get them, which allocated whatever the record's config said (an
    ``intermediate_size`` of 10**12 with every block pruned to 16 units asked for 32 TB).
    """
    for module in model.modules():
        if type(module).__name__ == "BertEmbeddings" and module.position_ids.is_meta:
            positions = module.position_ids.shape[-1]
            module.position_ids = torch.arange(positions).expand(1, -1)
            module.token_type_ids = torch.zeros(1, positions, dtype=torch.long)
