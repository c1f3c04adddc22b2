"""Frozen batch norm, the Back Razor paper's choice for CNN transfer (Jiang et al., Sec. 4.2).

A batch norm that uses its running statistics and does not train its affine parameters needs
nothing of its input in backward (grad_input = grad * weight / sqrt(running_var + eps)), so
under :class:`~edgetorch.BackRazor` its saved input costs zero bytes. One that trains keeps its
input exactly: the batch-statistics and affine gradients read every value of it.
"""

from __future__ import annotations

from torch import nn


def _stay_in_eval(module: nn.Module, args) -> None:
    module.training = False  # survives model.train(), which would switch batch statistics back on


def freeze_batchnorm(model: nn.Module) -> nn.Module:
    """Put every batch norm of ``model`` in eval mode for good and stop training its affine.

    Args:
        model: any module; its ``BatchNorm1d/2d/3d`` (and ``SyncBatchNorm``) submodules are
            frozen in place. Calling ``model.train()`` later does not unfreeze them.

    Returns:
        ``model`` itself.

    Example:
        >>> model = edgetorch.freeze_batchnorm(torchvision.models.mobilenet_v2())
        >>> with edgetorch.compress_activations(model, edgetorch.BackRazor(0.9)):
        ...     loss = criterion(model(x), y)   # batch-norm inputs: nothing stored
    """
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            # Every call freezes the affine again (something may have turned it back on since);
            # the hook is registered once.
            module.requires_grad_(False)
            module.eval()
            if not getattr(module, "_edgetorch_frozen", False):
                module.register_forward_pre_hook(_stay_in_eval)
                module._edgetorch_frozen = True
    return model
