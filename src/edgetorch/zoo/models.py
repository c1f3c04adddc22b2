"""Small reference models for 28x28 grey images: a ResNet-style CNN, a plain (VGG-style) CNN and an MLP.

All are plain ``nn.Module`` s. The ResNet keeps every block in one ``nn.Sequential`` called
``features`` (stem first, then the residual blocks), followed by ``pool`` and ``classifier``,
so tools that split a network into segments (checkpointing every m blocks, head/tail
splitting) can cut ``features`` at any index. The MLP and the plain CNN *are* ``nn.Sequential``
chains, which is what layer reduction (``edgetorch.reduce``) takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def _positive_ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    values = tuple(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name} must be a non-empty sequence of positive ints, got {values!r}")
    return values


class BasicBlock(nn.Module):
    """Residual block: conv3x3-BN-ReLU-conv3x3-BN, plus identity (or 1x1 conv-BN), then ReLU.

    Args:
        in_channels: input channels.
        out_channels: output channels.
        stride: stride of the first conv (2 halves the resolution).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        # Separate ReLU modules (not one reused) so per-module hooks see each activation once.
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """ResNet-style CNN for small grey images (default about 0.31M parameters, ~10M MACs at 28x28).

    Layout: stem (conv3x3-BN-ReLU at ``widths[0]``, full resolution), then one stage per width,
    each starting with a stride-2 block: 28x28 input gives 28 -> 14 -> 7 -> 4 with the default
    three stages. Downsampling in every stage keeps CPU training of the Fashion-MNIST recipe to
    minutes. Any input size works (global average pooling).

    Args:
        num_classes: outputs of the linear head.
        in_channels: input image channels.
        widths: channels of each stage.
        blocks_per_stage: residual blocks in each stage (an int applies to every stage).
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        widths: Sequence[int] = (32, 64, 128),
        blocks_per_stage: int | Sequence[int] = 1,
    ) -> None:
        super().__init__()
        widths = _positive_ints("widths", widths)
        if isinstance(blocks_per_stage, int):
            blocks_per_stage = (blocks_per_stage,) * len(widths)
        blocks = _positive_ints("blocks_per_stage", blocks_per_stage)
        if len(blocks) != len(widths):
            raise ValueError(
                f"blocks_per_stage has {len(blocks)} entries but widths has {len(widths)}"
            )
        _positive_ints("num_classes and in_channels", (num_classes, in_channels))

        layers: list[nn.Module] = [
            nn.Sequential(
                nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
                nn.BatchNorm2d(widths[0]),
                nn.ReLU(),
            )
        ]
        channels = widths[0]
        for width, count in zip(widths, blocks):
            for i in range(count):
                layers.append(BasicBlock(channels, width, stride=2 if i == 0 else 1))
                channels = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)))


class MLP(nn.Sequential):
    """Fully connected classifier: Flatten, then (Linear, ReLU) per hidden width, then Linear.

    Args:
        num_classes: outputs of the last layer.
        in_channels: input image channels.
        image_size: input height (= width); the input must be exactly this size.
        hidden: width of each hidden layer.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        image_size: int = 28,
        hidden: Sequence[int] = (256, 128),
    ) -> None:
        hidden = _positive_ints("hidden", hidden)
        _positive_ints(
            "num_classes, in_channels and image_size", (num_classes, in_channels, image_size)
        )
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_channels * image_size * image_size
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)


class PlainCNN(nn.Sequential):
    """VGG-style classifier without shortcuts: conv3x3-BN-ReLU blocks, max pooling, then two Linear layers.

    Every block's channels are prunable (nothing adds two blocks' outputs), so this is the zoo's
    convolutional network for ``edgetorch.reduce``. The default has five blocks, 2x2 max pooling
    after the 2nd, 4th and 5th (28 -> 14 -> 7 -> 3), then Flatten, Linear, ReLU, Linear: 5.6M
    multiplications per 28x28 image, 0.11M parameters.

    Args:
        num_classes: outputs of the last layer.
        in_channels: input image channels.
        image_size: input height (= width); the input must be exactly this size.
        widths: channels of each conv block.
        pool_after: block indices followed by max pooling.
        hidden: width of the hidden Linear layer.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        image_size: int = 28,
        widths: Sequence[int] = (16, 16, 32, 32, 64),
        pool_after: Sequence[int] = (1, 3, 4),
        hidden: int = 128,
    ) -> None:
        widths = _positive_ints("widths", widths)
        _positive_ints("num_classes, in_channels, image_size and hidden", (num_classes, in_channels, image_size, hidden))
        if any(not 0 <= i < len(widths) for i in pool_after):
            raise ValueError(f"pool_after must index the {len(widths)} blocks, got {tuple(pool_after)!r}")
        layers: list[nn.Module] = []
        channels, size = in_channels, image_size
        for i, width in enumerate(widths):
            layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
            if i in pool_after:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            channels = width
        if size < 1:
            raise ValueError(f"image_size {image_size} is too small for {len(tuple(pool_after))} poolings")
        layers += [nn.Flatten(), nn.Linear(channels * size * size, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)]
        super().__init__(*layers)
