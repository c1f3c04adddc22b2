"""Bottleneck injection (BottleFit, Sec. III-B): turn a pretrained CNN into a splittable student.

The teacher is cut into three parts (:func:`decompose`):

* ``front`` -- the layers the encoder/decoder replace (``t_ed`` of eq. 4): ResNet up to and including
  ``layer2`` (``Ct x H/8``: 128 channels for resnet18, 512 for resnet50/152), DenseNet up to and
  including ``transition2`` (``256 x H/16``), as in the paper and its reference design;
* ``blocks`` -- the later blocks whose outputs GHND also matches (ResNet ``layer3``, ``layer4``;
  DenseNet ``denseblock3+transition3``, ``denseblock4+norm5``);
* ``classifier`` -- pooling and the final linear layer.

The student (:class:`BottleneckModel`) is ``head = encoder`` (runs on the device) and
``tail = decoder -> blocks -> classifier`` (runs on the server). The decoder's output has exactly
the shape of ``front``'s output, so the blocks and classifier are the teacher's, **copied**
(``copy.deepcopy``): training the student never changes the teacher, which stage 1 and KD still
need. The encoder's first convolution (and its batch norm) start from a copy of the teacher's stem.

The encoder and decoder layers of each split point, the paper's design and the authors' released
one (``architecture="released"``), are built in :mod:`edgetorch.split.designs`, whose docstring
describes both.

The paper's autoencoder baseline (:func:`inject_autoencoder`) instead keeps the teacher's front on
the device and inserts 4 convolutions + 4 deconvolutions with BN/ReLU between ``front`` and the
blocks.

Input height and width must be multiples of :attr:`BottleneckModel.input_multiple` (ResNet
halves with rounding up, DenseNet's transitions with rounding down, and a deconvolution can only
double: on multiples every path agrees); the head raises ``ValueError`` otherwise.

Example:
    >>> from edgetorch.zoo import build_model
    >>> student = inject_bottleneck(build_model("torchvision:resnet18", num_classes=10), channels=3)
    >>> head, tail = split(student)
    >>> head(torch.zeros(1, 3, 64, 64)).shape
    torch.Size([1, 3, 8, 8])
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from .designs import DENSENETS, RESNETS, conv_bn_relu, deconv_bn_relu, front_geometry, paper_layers, released_layers

ACCEPTED_ARCHS = RESNETS + DENSENETS
SPLIT_POINTS = ("sp1", "sp2")
ARCHITECTURES = ("paper", "released")


def detect_arch(model: nn.Module) -> str:
    """The torchvision architecture name of ``model``, found from its layer layout.

    Args:
        model: a torchvision ResNet or DenseNet (any number of classes).

    Returns:
        One of :data:`ACCEPTED_ARCHS`.

    Raises:
        ValueError: ``model`` is not one of the accepted architectures.
    """
    import torchvision.models as tvm

    if isinstance(model, tvm.ResNet):
        depths = tuple(len(getattr(model, f"layer{i}")) for i in range(1, 5))
        bottleneck = isinstance(model.layer1[0], tvm.resnet.Bottleneck)
        known = {((2, 2, 2, 2), False): "resnet18", ((3, 4, 6, 3), True): "resnet50",
                 ((3, 8, 36, 3), True): "resnet152"}  # fmt: skip
        if (depths, bottleneck) in known:
            return known[depths, bottleneck]
    elif isinstance(model, tvm.DenseNet):
        depths = tuple(
            len(block) for name, block in model.features.named_children() if name.startswith("denseblock")
        )
        known = {(6, 12, 24, 16): "densenet121", (6, 12, 32, 32): "densenet169",
                 (6, 12, 48, 32): "densenet201"}  # fmt: skip
        if depths in known:
            return known[depths]
    raise ValueError(
        f"cannot inject a bottleneck into {type(model).__name__}: accepted are the torchvision "
        f"architectures {', '.join(ACCEPTED_ARCHS)}"
    )


def _taps(first: torch.Tensor, blocks: nn.ModuleDict, classifier: nn.Module) -> list[torch.Tensor]:
    """``[first, each block's output..., logits]``: ``first`` run through ``blocks`` in order, then ``classifier``."""
    outputs = [first]
    for block in blocks.values():
        outputs.append(block(outputs[-1]))
    outputs.append(classifier(outputs[-1]))
    return outputs


class Stages(nn.Module):
    """A classifier seen as ``front -> blocks -> classifier``, with the intermediate outputs exposed.

    Attributes:
        front: the layers the bottleneck replaces (``t_ed`` of eq. 4).
        blocks: later blocks, in order; their outputs are GHND's extra targets.
        classifier: pooling, flatten, linear.
    """

    def __init__(self, front: nn.Module, blocks: OrderedDict[str, nn.Module], classifier: nn.Module):
        super().__init__()
        self.front = front
        self.blocks = nn.ModuleDict(blocks)
        self.classifier = classifier

    def taps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[front output, each block's output..., logits]`` for input ``x``."""
        return _taps(self.front(x), self.blocks, self.classifier)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.taps(x)[-1]


def decompose(model: nn.Module) -> Stages:
    """View a torchvision ResNet/DenseNet as :class:`Stages`, sharing its modules (no copy).

    Args:
        model: one of :data:`ACCEPTED_ARCHS`.

    Returns:
        Stages computing exactly ``model``'s function (the modules are ``model``'s own).

    Raises:
        ValueError: unsupported architecture.
    """
    arch = detect_arch(model)
    if arch in RESNETS:
        m: Any = model
        front = nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool, m.layer1, m.layer2)
        blocks = OrderedDict(layer3=m.layer3, layer4=m.layer4)
        classifier = nn.Sequential(m.avgpool, nn.Flatten(1), m.fc)
        return Stages(front, blocks, classifier)
    f: Any = model.features
    front = nn.Sequential(f.conv0, f.norm0, f.relu0, f.pool0, f.denseblock1, f.transition1,
                          f.denseblock2, f.transition2)  # fmt: skip
    blocks = OrderedDict(block3=nn.Sequential(f.denseblock3, f.transition3),
                         block4=nn.Sequential(f.denseblock4, f.norm5))  # fmt: skip
    # torchvision applies relu in place in forward; a separate non-inplace ReLU keeps block4's
    # output (a GHND target) intact.
    classifier = nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(1), model.classifier)
    return Stages(front, blocks, classifier)


class Head(nn.Module):
    """The device side: the encoder, with an input-size check.

    Attributes:
        encoder: input image -> bottleneck ``[N, C, h, w]``.
        input_multiple: input height and width must be multiples of this.
    """

    def __init__(self, encoder: nn.Module, input_multiple: int):
        super().__init__()
        self.encoder = encoder
        self.input_multiple = input_multiple

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] % self.input_multiple or x.shape[-2] % self.input_multiple:
            raise ValueError(
                f"head input must be [N, 3, H, W] with H and W multiples of {self.input_multiple}, "
                f"got {list(x.shape)}"
            )
        return self.encoder(x)


class Tail(nn.Module):
    """The server side: decoder, then the teacher's later blocks and classifier (copies).

    Attributes:
        decoder: bottleneck -> a tensor shaped like the teacher's front output.
        blocks: copies of the teacher's later blocks.
        classifier: copy of the teacher's pooling + linear layer.
    """

    def __init__(self, decoder: nn.Module, stages: Stages):
        super().__init__()
        self.decoder = decoder
        self.blocks = stages.blocks
        self.classifier = stages.classifier

    def taps(self, z: torch.Tensor) -> list[torch.Tensor]:
        """``[decoder output, each block's output..., logits]`` for bottleneck ``z``."""
        return _taps(self.decoder(z), self.blocks, self.classifier)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.decoder(z)
        for block in self.blocks.values():
            h = block(h)
        return self.classifier(h)


class BottleneckModel(nn.Module):
    """A bottleneck-injected student: ``forward(x) == tail(head(x))``.

    Attributes:
        head: runs on the device; outputs the bottleneck tensor (float ``[N, C, h, w]``).
        tail: runs on the server; bottleneck -> logits.
        channels: the bottleneck's channel count ``C``.
        split_point: ``"sp1"``, ``"sp2"`` or ``"ae"`` (autoencoder baseline).
        arch: the teacher's torchvision architecture, e.g. ``"resnet18"``.
        downsample: whether the bottleneck was spatially halved once more.
        architecture: the encoder/decoder design, ``"paper"`` or ``"released"`` (see the module docstring).
    """

    def __init__(self, head: Head, tail: Tail, channels: int, split_point: str, arch: str,
                 downsample: bool, architecture: str = "paper"):  # fmt: skip
        super().__init__()
        self.head = head
        self.tail = tail
        self.channels = channels
        self.split_point = split_point
        self.arch = arch
        self.downsample = downsample
        self.architecture = architecture

    @property
    def input_multiple(self) -> int:
        """Input height and width must be multiples of this."""
        return self.head.input_multiple

    def spec(self) -> dict[str, Any]:
        """What :func:`rebuild` needs to build this student's layers again (as plain JSON data).

        Returns:
            ``{"arch", "channels", "split_point", "downsample", "num_classes", "architecture"}``.
        """
        linear = self.tail.classifier[-1]
        return {"arch": self.arch, "channels": self.channels, "split_point": self.split_point,
                "downsample": self.downsample, "num_classes": int(linear.out_features),
                "architecture": self.architecture}

    def bottleneck_parts(self) -> list[nn.Module]:
        """The layers bottleneck training (HND/GHND/AE reconstruction) updates: encoder and decoder.

        For the autoencoder baseline the head's copy of the teacher's front is excluded.
        """
        encoder = self.head.encoder[1] if self.split_point == "ae" else self.head.encoder
        return [encoder, self.tail.decoder]

    def taps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[decoder output, each block's output..., logits]``, aligned with :meth:`Stages.taps`."""
        return self.tail.taps(self.head(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.head(x))


def _device_of(model: nn.Module) -> torch.device:
    """Where the new layers are created: the teacher's device (CPU for a parameterless model)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _check_channels(channels: int) -> None:
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        raise ValueError(f"channels must be a positive int (the paper uses 1, 2, 3, 6, 9, 12), got {channels!r}")


def inject_bottleneck(model: nn.Module, channels: int, split_point: str = "sp2", downsample: bool = False,
                      architecture: str = "paper") -> BottleneckModel:  # fmt: skip
    """Build a BottleFit student from a (pretrained) torchvision ResNet or DenseNet.

    ``model`` itself is not modified: the student's tail holds copies of its later blocks and
    classifier; the paper design's encoder starts from a copy of its stem (see the module
    docstring for the exact encoder/decoder designs).

    Args:
        model: the teacher, one of :data:`ACCEPTED_ARCHS` (any ``num_classes``).
        channels: bottleneck channels ``C`` (the paper uses 1, 2, 3, 6, 9, 12; any positive int).
        split_point: ``"sp1"`` (bottleneck ``C x (H/8 + 1)``) or ``"sp2"`` (``C x H/8``).
        downsample: halve the bottleneck's height and width once more; the decoder deconvolves back.
        architecture: ``"paper"`` (the paper's text, edgetorch's default) or ``"released"`` (the
            authors' code: 2x2 convolutions, a heavier decoder).

    Returns:
        The student; ``student.head`` outputs the bottleneck, ``student.tail`` maps it to logits.

    Raises:
        ValueError: unsupported architecture (teacher or design), split point, or channel count.

    Example:
        >>> from edgetorch.zoo import build_model
        >>> s = inject_bottleneck(build_model("torchvision:densenet121"), 12, "sp1", downsample=True)
        >>> s.head(torch.zeros(1, 3, 64, 64)).shape
        torch.Size([1, 12, 5, 5])
        >>> r = inject_bottleneck(build_model("torchvision:resnet18"), 12, "sp2", architecture="released")
        >>> r.head(torch.zeros(1, 3, 224, 224)).shape
        torch.Size([1, 12, 28, 28])
    """
    _check_channels(channels)
    if split_point not in SPLIT_POINTS:
        raise ValueError(f"unknown split point {split_point!r}; accepted: {', '.join(SPLIT_POINTS)}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown bottleneck architecture {architecture!r}; accepted: {', '.join(ARCHITECTURES)}")
    arch = detect_arch(model)
    with torch.device(_device_of(model)):
        if architecture == "paper":
            encoder, decoder = paper_layers(model, arch, channels, split_point, downsample)
        else:
            encoder, decoder = released_layers(arch, channels, split_point, downsample)
    stages = copy.deepcopy(decompose(model))
    multiple = max(8 * (2 if downsample else 1), front_geometry(arch)[1])
    return BottleneckModel(Head(nn.Sequential(*encoder), multiple), Tail(decoder, stages),
                           channels, split_point, arch, downsample, architecture)  # fmt: skip


def inject_autoencoder(model: nn.Module, channels: int) -> BottleneckModel:
    """The paper's autoencoder baseline (Sec. IV-C): 4 convs + 4 deconvs after the front.

    The head is a copy of the teacher's front (through ``layer2`` / ``transition2``) followed by
    the AE encoder: convs ``Ct -> Ct/2 -> Ct/4 (stride 2) -> Ct/8 -> C`` with BN + ReLU between
    them. The tail's decoder mirrors it with deconvolutions back to ``Ct`` channels at the front's
    resolution, then the teacher's blocks and classifier (copies). Train it with a reconstruction
    loss on the front's output (:func:`edgetorch.split.train.train_stage` with ``loss="hnd"`` and
    ``trainable="bottleneck"``): only the AE layers are trainable there.

    Args:
        model: the teacher, one of :data:`ACCEPTED_ARCHS`.
        channels: bottleneck channels ``C``.

    Returns:
        The student, with ``split_point == "ae"``; its head's first module is the front copy.

    Raises:
        ValueError: unsupported architecture or channel count.
    """
    _check_channels(channels)
    arch = detect_arch(model)
    target, front_stride = front_geometry(arch)
    c2, c4, c8 = target // 2, target // 4, target // 8
    stages = copy.deepcopy(decompose(model))
    with torch.device(_device_of(model)):
        encoder = (conv_bn_relu(target, c2) + conv_bn_relu(c2, c4, 2) + conv_bn_relu(c4, c8)
                   + [nn.Conv2d(c8, channels, 3, 1, 1)])  # fmt: skip
        decoder = (deconv_bn_relu(channels, c8, 3, 1) + deconv_bn_relu(c8, c4, 3, 1)
                   + deconv_bn_relu(c4, c2, 2, 2) + [nn.ConvTranspose2d(c2, target, 3, 1, 1)])  # fmt: skip
    if arch in RESNETS:
        decoder.append(nn.ReLU(inplace=True))  # the front's output (layer2) is post-ReLU
    head = Head(nn.Sequential(stages.front, nn.Sequential(*encoder)), front_stride * 2)
    return BottleneckModel(head, Tail(nn.Sequential(*decoder), stages), channels, "ae", arch, True)


_SPEC_KEYS = ("arch", "channels", "split_point", "downsample", "num_classes", "architecture")


def rebuild(spec: dict[str, Any]) -> BottleneckModel:
    """A student with freshly initialised layers, built from :meth:`BottleneckModel.spec` data.

    Only torchvision constructors of :data:`ACCEPTED_ARCHS` are called (no import of a name
    taken from ``spec``), so a spec read from an untrusted file builds nothing but these layers.
    Load the weights afterwards (strictly), e.g. from safetensors.

    Args:
        spec: ``{"arch", "channels", "split_point", "downsample", "num_classes", "architecture"}``;
            ``split_point`` may also be ``"ae"`` (:func:`inject_autoencoder`, whose architecture
            is ``"paper"``). A spec without ``"architecture"`` (written before the key existed)
            means ``"paper"``.

    Returns:
        The student, in training mode, with random weights.

    Raises:
        ValueError: a missing or unknown key, or a value outside what the builders accept.
    """
    import torchvision.models as tvm

    if isinstance(spec, dict) and "architecture" not in spec:
        spec = {**spec, "architecture": "paper"}
    if not isinstance(spec, dict) or set(spec) != set(_SPEC_KEYS):
        keys = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(f"a bottleneck spec needs exactly the keys {', '.join(_SPEC_KEYS)}; got {keys}")
    arch, classes, downsample = spec["arch"], spec["num_classes"], spec["downsample"]
    if arch not in ACCEPTED_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; accepted: {', '.join(ACCEPTED_ARCHS)}")
    if isinstance(classes, bool) or not isinstance(classes, int) or not 1 <= classes <= 1_000_000:
        raise ValueError(f"num_classes must be an int in [1, 1000000], got {classes!r}")
    if not isinstance(downsample, bool):
        raise ValueError(f"downsample must be true or false, got {downsample!r}")
    teacher = getattr(tvm, arch)(num_classes=classes)
    if spec["split_point"] == "ae":
        if spec["architecture"] != "paper":
            raise ValueError(f"the autoencoder baseline has only the paper's architecture, got {spec['architecture']!r}")
        return inject_autoencoder(teacher, spec["channels"])
    return inject_bottleneck(teacher, spec["channels"], spec["split_point"], downsample, spec["architecture"])


def split(model: BottleneckModel) -> tuple[nn.Module, nn.Module]:
    """The device and server halves of a student.

    Args:
        model: a :class:`BottleneckModel`.

    Returns:
        ``(head, tail)``: the student's own modules (not copies), so ``tail(head(x)) == model(x)``.

    Raises:
        TypeError: ``model`` is not a :class:`BottleneckModel`.
    """
    if not isinstance(model, BottleneckModel):
        raise TypeError(f"split() takes a BottleneckModel (see inject_bottleneck), got {type(model).__name__}")
    return model.head, model.tail
