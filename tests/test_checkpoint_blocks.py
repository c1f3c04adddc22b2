"""The per-block checkpoint peer (edgetorch.activations.checkpoint.checkpoint_blocks): the plain-PyTorch
baseline the GPU benchmark measures edgetorch against must compute exactly what the model computes."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

from edgetorch.activations.checkpoint import CheckpointedBlock, checkpoint_blocks


# vgg11_bn: its 8 convolutions in features, and the 3 Linear layers of its classifier (a stage of its own).
@pytest.mark.parametrize("name, blocks", [("resnet18", 8), ("resnet50", 16), ("vgg11_bn", 11), ("mobilenet_v2", 19)])
def test_every_block_is_checkpointed_and_gradients_equal_plain(name, blocks):
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, num_classes=10).eval()
    peer = checkpoint_blocks(copy.deepcopy(model))
    assert sum(isinstance(m, CheckpointedBlock) for m in peer.modules()) == blocks
    assert not any(getattr(m, "inplace", False) for m in peer.modules())
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    grads = []
    for net in (model, peer):  # eval-mode batch norm: the recomputed forward is the same
        x.grad = None
        net(x).square().sum().backward()
        grads.append([x.grad.clone()] + [p.grad for p in net.parameters()])
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(*grads))
    peer.train()(x).sum().backward()  # the train-mode step an in-place ReLU broke on vgg11_bn


def test_without_gradients_blocks_run_plainly():
    block = CheckpointedBlock(nn.Linear(3, 3))
    with torch.no_grad():
        assert torch.equal(block(torch.ones(1, 3)), block.block(torch.ones(1, 3)))
