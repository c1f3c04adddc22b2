"""Use a trained classifier on images: ``edgetorch predict`` (top-k per image) and ``edgetorch val`` (accuracy).

A classifier is a finetune run directory (``model.safetensors`` and ``model.json``), a model
``edgetorch reduce`` wrote for an image folder (``small.safetensors`` and ``small.json``), or a
split artifact directory (``edgetorch split export``: the head and tail run here, joined through
the 8-bit payload the device would send). Their records name the classes in label order and the
preprocessing the model was trained with; images go through exactly that (a folder's validation
transform, :func:`edgetorch.data.image_files`, or the manifest's, which for a folder-trained
student is the same), so a prediction here is what the model scored in training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ..split.manifest import SplitManifest

#: Images per forward pass.
BATCH = 32


@dataclass(frozen=True)
class Classifier:
    """A trained classifier and what its inputs must be.

    Attributes:
        model: the network, in eval mode.
        classes: class names; output ``i`` is ``classes[i]``.
        image_size: input height = width.
        color: ``"rgb"`` or ``"gray"``.
        normalize: ``"imagenet"`` or ``None`` (pixels in [0, 1]); a split artifact normalised
            otherwise says ``"custom"`` (its mean and std are in ``preprocessing``).
        source: the file or directory it was loaded from.
        preprocessing: the record's whole transform as data (empty where an older record has none;
            a split artifact's is its manifest's ``preprocess``).
        split: a split artifact's manifest (``model`` is then a
            :class:`~edgetorch.split.artifact.DeployedSplit`), else None.
    """

    model: nn.Module
    classes: list[str]
    image_size: int
    color: str
    normalize: str | None
    source: Path
    preprocessing: dict
    split: SplitManifest | None = None

    def inputs(self, paths: Sequence[Path]) -> torch.Tensor:
        """Image files as this model takes them: float32 ``[N, C, H, W]``, preprocessed as it was trained.

        Raises:
            InputFileError: (a ``ValueError``) an unreadable image; the message names it.
        """
        if self.split is not None:
            from ..split.client import preprocess_images

            return preprocess_images(paths, self.split.preprocess, self.split.input_shape[0])
        from ..data import image_files

        data = image_files(paths, self.image_size, color=self.color, normalize=self.normalize)
        return torch.stack([data[i][0] for i in range(len(data))])


@dataclass(frozen=True)
class Prediction:
    """One image's top classes.

    Attributes:
        path: the image file.
        top: ``(class, probability)`` pairs, most likely first.
    """

    path: Path
    top: list[tuple[str, float]]


@dataclass(frozen=True)
class Validation:
    """A classifier's accuracy on labelled images.

    Attributes:
        images: how many were classified.
        top1: share whose most likely class is the label.
        topk: share whose label is among the ``k`` most likely.
        k: the ``k`` of ``topk``.
        per_class: each class's top-1 accuracy (over its images; classes without images left out).
    """

    images: int
    top1: float
    topk: float
    k: int
    per_class: dict[str, float]


def load_classifier(path: str | Path) -> Classifier:
    """Load a finetune run directory, a model ``edgetorch reduce`` wrote for an image folder, or a split artifact.

    Args:
        path: a directory holding ``model.safetensors`` and ``model.json``, a reduced model's
            ``.safetensors`` with its ``.json`` record beside it, or a directory ``edgetorch split
            export`` wrote (its files' hashes are checked; a signature is not, as no key is given).

    Returns:
        A :class:`Classifier`.

    Raises:
        ValueError: a path that is none of these, or a reduced model whose record names no
            classes (one reduced on a built-in dataset); InputFileError, CheckpointError,
            SplitArtifactError: damaged files.

    Example:
        >>> classifier = load_classifier("runs/photos")  # doctest: +SKIP
    """
    from ..reduce import load
    from ..zoo import input_channels
    from .model import start_model
    from .record import check_record, read_record

    source = Path(path)
    if source.is_dir() and (source / "manifest.json").exists():
        return _split_classifier(source)
    if source.is_dir():
        weights, record_path = source / "model.safetensors", source / "model.json"
        if not (weights.is_file() and record_path.is_file()):
            raise ValueError(f"{source} is neither a finetune run (model.safetensors + model.json: `edgetorch finetune "
                         "--out DIR` writes both once the first epoch ends) nor a split artifact (manifest.json: "
                         "`edgetorch split export --out DIR`)")
        record = read_record(record_path, ("model", "classes", "image_size", "channels"))
        model, _ = start_model(record["model"], None, weights)
        color = "rgb" if record["channels"] == 3 else "gray"
        return Classifier(model.eval(), record["classes"], record["image_size"], color, record.get("normalize"),
                          source, _preprocessing(record))
    if source.suffix not in (".safetensors", ".json") or not source.exists():
        raise ValueError(f"{source}: give a finetune run directory or a reduced model's .safetensors "
                         "(`edgetorch reduce --out FILE`)")
    model, record = load(source)
    reduction = record.get("reduction") if isinstance(record.get("reduction"), dict) else {}
    if "classes" not in reduction:
        raise ValueError(f"{source} was reduced on a built-in dataset and records no classes or preprocessing; "
                         "predict takes a model reduced on an image folder (reduce --data FOLDER --weights ...)")
    fields = check_record(reduction, source.with_suffix(".json"), ("classes", "image_size"))
    color = "rgb" if input_channels(model) == 3 else "gray"
    return Classifier(model.eval(), fields["classes"], fields["image_size"], color, fields.get("normalize"), source,
                      _preprocessing(fields))


def _split_classifier(source: Path) -> Classifier:
    from ..split.artifact import load_deployed

    from ..data.folder import normalisation_name

    model, manifest = load_deployed(source)
    classes = list(manifest.class_names or map(str, range(manifest.num_classes)))
    prep = manifest.preprocess
    # What an export record says of it: a record saying None for ImageNet's mean/std had a device skip them.
    normalize = normalisation_name(prep.color, prep.mean, prep.std)
    return Classifier(model, classes, manifest.input_shape[1], prep.color, normalize, source, dataclasses.asdict(prep),
                      manifest)


def predict(classifier: Classifier, images: list[str | Path], top_k: int = 3) -> list[Prediction]:
    """The ``top_k`` most likely classes of each image.

    Args:
        classifier: from :func:`load_classifier`.
        images: image files, or folders whose images (recursively) are all classified.
        top_k: classes per image (at most the classifier's class count).

    Returns:
        One :class:`Prediction` per image, in the order listed.

    Raises:
        ImageFolderError: a missing path, no image, or an unreadable image (the message names it).
    """
    from ..data import image_files

    paths = [path for path, _ in image_files(images, classifier.image_size).samples]  # folders listed, paths checked
    k = min(top_k, len(classifier.classes))
    values, indices = _probabilities(classifier, paths).topk(k, dim=1)
    return [Prediction(path, [(classifier.classes[i], p) for p, i in zip(v.tolist(), ix.tolist())])
            for path, v, ix in zip(paths, values, indices)]


def validate(classifier: Classifier, data: str | Path, k: int = 5) -> Validation:
    """Accuracy on a labelled image folder (one subfolder per class) or ``path,label`` CSV, all of it.

    Args:
        classifier: from :func:`load_classifier`.
        data: the folder or CSV; its classes must be the classifier's, in the same order.
        k: also count a label among the ``k`` most likely (at most the class count).

    Returns:
        A :class:`Validation`.

    Raises:
        ValueError: the folder's classes differ from the classifier's (the message lists both);
        ImageFolderError: an unusable folder or image.
    """
    from ..data import image_folder

    images = image_folder(data, classifier.image_size, "all", color=classifier.color,
                          normalize=classifier.normalize, augment=False)
    if images.classes != classifier.classes:
        raise ValueError(f"{data} has the classes {images.classes}; {classifier.source} classifies into "
                         f"{classifier.classes}: give a folder with the same class subfolders")
    probabilities, labels = _probabilities(classifier, [path for path, _ in images.samples]), images.labels
    k = min(k, len(classifier.classes))
    hit = probabilities.argmax(1) == labels
    within = (probabilities.topk(k, dim=1).indices == labels[:, None]).any(1)
    per_class = {name: hit[labels == i].float().mean().item() for i, name in enumerate(classifier.classes)
                 if (labels == i).any()}
    return Validation(len(labels), hit.float().mean().item(), within.float().mean().item(), k, per_class)


def _probabilities(classifier: Classifier, paths: list[Path]) -> torch.Tensor:
    device = next(classifier.model.parameters()).device
    with torch.inference_mode():
        return torch.cat([classifier.model(classifier.inputs(paths[i : i + BATCH]).to(device)).softmax(1).cpu()
                          for i in range(0, len(paths), BATCH)])


def _preprocessing(record: dict) -> dict:
    # Carried from a record into the next (export): only when it is a JSON object.
    value = record.get("preprocessing")
    return value if isinstance(value, dict) else {}
