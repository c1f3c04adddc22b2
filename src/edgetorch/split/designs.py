"""The bottleneck's encoder and decoder layers for each accepted teacher and split point.

Split points (both build the bottleneck with a convolution, as the paper does):

* ``"sp1"`` (early, least work on the device; the paper's Sec. IV-A "reducing the output channels
  of the 2nd convolution layer"): the stem conv 7x7/2 + BN + ReLU and max-pool, then a second conv,
  2x2/2 with padding 1, whose output channels are ``C`` -- a ``C x (H/8 + 1)`` bottleneck, the
  paper's 12 x 29 x 29 at 224 px (the 2x2 kernel and padding are the authors' code's). The decoder
  starts with a 2x2 conv without padding that brings H/8 + 1 back to H/8;
* ``"sp2"`` (later): the stem + max-pool, a conv 3x3/2 to ``Ct/2`` channels (the resolution of
  ``layer2``), then a conv to ``C`` channels -- a ``C x H/8`` bottleneck.

``downsample=True`` halves the bottleneck's height and width once more (its conv gets stride 2);
the decoder then brings the resolution back with a 2x2/2 deconvolution. In general the decoder
is ``conv3x3 C->w, BN, ReLU``, one resampling step per factor of two between the bottleneck's and
the front's resolution (deconvolution up, strided conv down), then ``conv3x3 w->Ct`` and, for
ResNet, BN + ReLU (``layer2``'s output is post-ReLU; a DenseNet transition's output is not).

``architecture="released"`` builds the authors' published design instead of the one above, read
from their code: ``Bottleneck4ResNet152`` in the BottleFit repository's ``custom/model.py``
(``bottleneck_ver`` "2" with ``bottleneck_idx`` 7 is SP1, "3" with index 10 is SP2, per the
``config/ghnd_vanilla-finetune/custom_resnet152_from_resnet152-*.yaml`` files) and
torchdistill's ``models/custom/bottleneck/classification/densenet.py`` ``Bottleneck4DenseNet``
(DenseNet-169/201, index 7). It differs from the paper's text in every layer after the stem:

* encoder: conv 7x7/2, BN, ReLU, max-pool, then a *second* BN + ReLU; SP1: conv 2x2/2 (padding 1)
  to ``C``; SP2: conv 2x2/2 (padding 1) to 512 channels, BN, ReLU, then the bottleneck conv 2x2 to
  ``C``. Every convolution is 2x2 and bias-free, and all layers start fresh (the authors' student
  takes only the later blocks from the pretrained model);
* decoder: BN + ReLU on the bottleneck, then four 2x2 convolutions ``C -> 512 -> 512 -> Ct -> Ct``
  with padding 1, 1, 0, 0 (BN + ReLU between them; none after the last), then an average pool
  2x2: stride 1 trims ResNet's ``H/8 + 1`` to ``H/8``, stride 2 halves to DenseNet's ``H/16``.

The authors released SP2 only downsampled (ver 3: a 2x2/2 bottleneck conv, ``C x 15 x 15`` at
224 px, and a 2x2/2 deconvolution as the decoder's first layer); that is ``sp2`` with
``downsample=True`` here. Plain ``sp2`` keeps the paper's ``C x H/8`` (12 x 28 x 28): its
bottleneck conv is 2x2/1 without padding and, with no ``+1`` to trim, a ResNet decoder ends
without the pool. ``sp1`` with ``downsample=True`` uses stride 4 and the same deconvolution.
No released configuration covers ResNet-18/50 or DenseNet-121; they follow the same rules.
"""

from __future__ import annotations

import copy

from torch import nn

RESNETS = ("resnet18", "resnet50", "resnet152")
DENSENETS = ("densenet121", "densenet169", "densenet201")
_STEM_CHANNELS = 64  # every accepted architecture's stem conv has 64 output channels
_RELEASED_WIDTH = 512  # the released encoder's SP2 middle layer and the decoder's first two convs


def front_geometry(arch: str) -> tuple[int, int]:
    """``(channels, stride)`` of the front's output, the decoder's target."""
    if arch in DENSENETS:
        return 256, 16
    return (128 if arch == "resnet18" else 512), 8


def conv_bn_relu(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


def deconv_bn_relu(cin: int, cout: int, kernel: int, stride: int) -> list[nn.Module]:
    padding = (kernel - 1) // 2 if stride == 1 else 0
    return [nn.ConvTranspose2d(cin, cout, kernel, stride, padding, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True)]  # fmt: skip


def _copied_stem(teacher: nn.Module, arch: str) -> list[nn.Module]:
    """Copies of the teacher's stem conv 7x7/2 and its batch norm: the encoder starts from them."""
    if arch in RESNETS:
        conv, bn = teacher.conv1, teacher.bn1  # type: ignore[union-attr]
    else:
        conv, bn = teacher.features.conv0, teacher.features.norm0  # type: ignore[union-attr]
    return [copy.deepcopy(conv), copy.deepcopy(bn), nn.ReLU(inplace=True)]


def _decoder(channels: int, width: int, target: int, steps: int, final_relu: bool, trim: bool = False) -> nn.Sequential:
    """conv C->width; with ``trim`` a 2x2 conv without padding (SP1's n + 1 back to n); |steps|
    resamplings (>0: 2x2/2 deconv up, <0: 3x3/2 conv down); conv -> target."""
    layers = conv_bn_relu(channels, width)
    if trim:
        layers += [nn.Conv2d(width, width, 2, 1, 0, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
    for _ in range(abs(steps)):
        layers += deconv_bn_relu(width, width, 2, 2) if steps > 0 else conv_bn_relu(width, width, 2)
    layers.append(nn.Conv2d(width, target, 3, 1, 1, bias=not final_relu))
    if final_relu:
        layers += [nn.BatchNorm2d(target), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers)


def paper_layers(model: nn.Module, arch: str, channels: int, split_point: str,
                  downsample: bool) -> tuple[list[nn.Module], nn.Sequential]:  # fmt: skip
    """Encoder layers and decoder of the paper's design (the module docstring's first part)."""
    target, front_stride = front_geometry(arch)
    width = max(_STEM_CHANNELS, target // 2)
    stride = 2 if downsample else 1
    encoder = _copied_stem(model, arch) + [nn.MaxPool2d(3, 2, 1)]
    if split_point == "sp1":
        encoder.append(nn.Conv2d(_STEM_CHANNELS, channels, 2, 2 * stride, 1))  # H/(8 stride) + 1
    else:
        encoder += conv_bn_relu(_STEM_CHANNELS, width, 2)
        encoder.append(nn.Conv2d(width, channels, 3, stride, 1))
    # log2(bottleneck stride / front stride): positive means the decoder must upsample.
    steps = (8 * stride).bit_length() - front_stride.bit_length()
    return encoder, _decoder(channels, width, target, steps, final_relu=arch in RESNETS, trim=split_point == "sp1")


def _conv2x2(cin: int, cout: int, stride: int = 1, padding: int = 0) -> nn.Conv2d:
    # Every released convolution after the stem is 2x2 and bias-free (BottleFit custom/model.py).
    return nn.Conv2d(cin, cout, 2, stride, padding, bias=False)


def _bn_relu(channels: int) -> list[nn.Module]:
    return [nn.BatchNorm2d(channels), nn.ReLU(inplace=True)]


def released_layers(arch: str, channels: int, split_point: str,
                     downsample: bool) -> tuple[list[nn.Module], nn.Sequential]:  # fmt: skip
    """Encoder layers and decoder of the authors' released design (the module docstring's second part).

    Sizes at 224 px for ResNet: SP1 56 -> 29, decoder 30, 31, 30, 29, pool 28; downsampled
    (both split points) 15, deconvolution 30, then 31, 30, 29, pool 28; plain SP2 29 -> 28,
    decoder 29, 30, 29, 28 and no pool.
    """
    target, front_stride = front_geometry(arch)
    stride = 2 if downsample else 1
    # Stem, then BN + ReLU once more after the max-pool, as in Bottleneck4ResNet152 / Bottleneck4DenseNet.
    encoder = [nn.Conv2d(3, _STEM_CHANNELS, 7, 2, 3, bias=False), *_bn_relu(_STEM_CHANNELS),
               nn.MaxPool2d(3, 2, 1), *_bn_relu(_STEM_CHANNELS)]  # fmt: skip
    if split_point == "sp1":  # ver 2: conv 2x2/2, padding 1 -> H/8 + 1
        encoder.append(_conv2x2(_STEM_CHANNELS, channels, 2 * stride, 1))
    else:  # ver 3: conv 2x2/2 to 512 (H/8 + 1), then the bottleneck conv
        encoder += [_conv2x2(_STEM_CHANNELS, _RELEASED_WIDTH, 2, 1), *_bn_relu(_RELEASED_WIDTH)]
        # ver 3's 2x2/2 with padding 1 gives H/16 + 1; undownsampled (no released config) a 2x2/1
        # conv without padding gives the paper's H/8.
        encoder.append(_conv2x2(_RELEASED_WIDTH, channels, stride, 1 if downsample else 0))
    # The released split puts the bottleneck conv's BN + ReLU on the server side (bottleneck_idx).
    first = (nn.ConvTranspose2d(channels, _RELEASED_WIDTH, 2, 2, bias=False) if downsample  # ver 3
             else _conv2x2(channels, _RELEASED_WIDTH, 1, 1))
    decoder = [*_bn_relu(channels), first, *_bn_relu(_RELEASED_WIDTH),
               _conv2x2(_RELEASED_WIDTH, _RELEASED_WIDTH, 1, 1), *_bn_relu(_RELEASED_WIDTH),
               _conv2x2(_RELEASED_WIDTH, target), *_bn_relu(target), _conv2x2(target, target)]  # fmt: skip
    # The encoder's padding leaves H/8 + 1 except on plain SP2; the pool trims it (ResNet: 2x2/1)
    # or halves to the front's H/16 (DenseNet: 2x2/2, which floors either size to H/16).
    if front_stride > 8 or split_point == "sp1" or downsample:
        decoder.append(nn.AvgPool2d(2, front_stride // 8))
    return encoder, nn.Sequential(*decoder)
