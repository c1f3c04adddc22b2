"""A fine-tuned model and its image folder as what ``edgetorch reduce`` reduces.

``edgetorch finetune --data photos/ --out runs/photos`` writes ``model.safetensors`` and, beside it,
``model.json``: the classes in label order, the input size and channels, the validation split's
seed and share. Reducing that model needs the same classes in the same order, the size it was
trained at, and an accuracy measured on the images fine-tuning held out rather than on those it
trained on. This module reads the record, checks the folder against it, and splits the folder as
fine-tuning did (:func:`edgetorch.data.image_data`, the same preprocessing).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

@dataclass(frozen=True)
class FolderReduction:
    """The network and images a reduction of a fine-tuned model works on.

    Attributes:
        model: the fine-tuned network, in eval mode, with its own classifier.
        train: the folder's training share (calibration samples, and the fine-tune after reducing).
        test: the share fine-tuning held out (every accuracy is measured on it).
        classes: class names in label order.
        normalize: ``"imagenet"`` or ``None``: what the reduced model's inputs must go through.
        preprocessing: the whole transform as data (:func:`edgetorch.data.folder.preprocessing_record`).
    """

    model: nn.Module
    train: TensorDataset
    test: TensorDataset
    classes: list[str]
    normalize: str | None
    preprocessing: dict


def load_finetuned(model: str, weights: str | Path | None, folder: str | Path, size: int) -> FolderReduction:
    """Load ``model`` with ``weights`` fine-tuned on ``folder``, and the folder split as fine-tuning split it.

    Args:
        model: the model spec the weights belong to (``torchvision:NAME``, ``zoo:NAME``, ...).
        weights: the fine-tuned weights; a ``model.json`` beside them (finetune's record) supplies
            the split's seed and share and is checked against ``size`` and the folder's classes.
        folder: an image folder (one subfolder per class) or a ``path,label`` CSV.
        size: image height = width the model takes.

    Returns:
        A :class:`FolderReduction`.

    Raises:
        ValueError: no weights, a size or class list other than the record's, or a classifier
            whose outputs do not match the folder's classes (each message says what to give).
        InputFileError, ImageFolderError: unreadable weights, record or images.

    Example:
        >>> data = load_finetuned("torchvision:resnet18", "runs/photos/model.safetensors", "photos", 224)  # doctest: +SKIP
        >>> data.classes  # doctest: +SKIP
        ['cat', 'dog']
    """
    from ..data import image_data
    from ..finetune import FinetuneJob, classifier_name, start_model
    from ..finetune.record import read_record
    from ..zoo import input_channels

    from ..data import DATASETS

    if not Path(folder).exists():
        raise ValueError(f"data {str(folder)!r} is neither a built-in dataset ({', '.join(DATASETS)}) nor an existing "
                         "folder or .csv file")
    if weights is None:
        raise ValueError(f"reducing for the images of {folder} needs --weights: the model fine-tuned on them "
                         "(e.g. `edgetorch finetune --out DIR` wrote DIR/model.safetensors)")
    record_path = Path(weights).with_name("model.json")
    record = read_record(record_path) if record_path.is_file() else {}
    trained_at = record.get("image_size")
    if trained_at is not None and trained_at != size:
        raise ValueError(f"{weights} was fine-tuned on {trained_at}x{trained_at} images ({record_path}); "
                         f"give --size {trained_at}")
    network, _ = start_model(model, None, weights)  # the file's own classifier, as finetune saved it
    data = image_data(folder, size=size, channels=input_channels(network),
                      val_fraction=record.get("val_fraction", FinetuneJob.val_fraction),  # older records: the default
                      seed=record.get("config", {}).get("seed", FinetuneJob.seed))
    recorded = record.get("classes")
    if recorded is not None and recorded != data.classes:
        raise ValueError(f"{folder} has the classes {data.classes}; {weights} was fine-tuned on {recorded} "
                         f"({record_path}): give the folder it was fine-tuned on")
    outputs = network.get_submodule(classifier_name(network)).out_features
    if outputs != len(data.classes):
        raise ValueError(f"{weights} classifies into {outputs} classes; {folder} has {len(data.classes)} "
                         f"({', '.join(data.classes)}): give the weights fine-tuned on this folder")
    return FolderReduction(network.eval(), _tensors(data.train), _tensors(data.val), data.classes, data.normalize,
                           data.preprocessing)


def _tensors(samples: Dataset) -> TensorDataset:
    # The reduction reads calibration rows and accuracy batches by index: decode the folder once.
    images, labels = zip(*(samples[i] for i in range(len(samples))))
    return TensorDataset(torch.stack(images), torch.as_tensor(labels))
