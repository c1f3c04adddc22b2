"""Nested ``nn.Sequential`` containers read as the one chain they compute.

``Sequential(Flatten(), Sequential(Linear, ReLU), Sequential(Linear, ReLU, Linear))`` computes
exactly what its flat version does, so it is reduced as that chain (:mod:`.sequential`) and the
reduced layers are put back where the originals sat: the result keeps the caller's containers
and their names. A container is opened only if it runs ``nn.Sequential``'s own forward (a
subclass with its own ``forward`` is one opaque module).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from torch import nn

from .sequential import KeepFeatures


def is_plain_sequential(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Sequential`` (or a subclass) that runs Sequential's forward."""
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _leaves(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    if not is_plain_sequential(module):
        return [(prefix, module)]
    return [leaf for name, child in module.named_children() for leaf in _leaves(child, f"{prefix}{name}.")]


@dataclass(frozen=True)
class Nesting:
    """A nested chain and its flat view.

    Attributes:
        model: the nested network.
        flat: an ``nn.Sequential`` of its leaf modules (the same module objects, not copies).
        names: each leaf's qualified name in :attr:`model`, in the order of :attr:`flat`.
    """

    model: nn.Sequential
    flat: nn.Sequential
    names: list[str]

    def nest(self, reduced: nn.Sequential) -> nn.Sequential:
        """Put the modules of a reduction of :attr:`flat` back into the containers of :attr:`model`.

        Each leaf's slot gets the module that replaced it (a smaller layer, a factored pair); an
        input selection (:class:`~edgetorch.reduce.sequential.KeepFeatures`) shares the slot of the
        layer it feeds, as ``Sequential(KeepFeatures, layer)``.

        Args:
            reduced: :func:`edgetorch.reduce.sequential.pruned` or ``factorised`` of :attr:`flat`.

        Returns:
            Plain ``nn.Sequential`` containers with the original names.
        """
        modules = iter(reduced)

        def rebuild(container: nn.Module) -> nn.Module:
            if not is_plain_sequential(container):
                module = next(modules)
                return nn.Sequential(module, next(modules)) if isinstance(module, KeepFeatures) else module
            return nn.Sequential(OrderedDict((name, rebuild(child)) for name, child in container.named_children()))

        out = rebuild(self.model)
        if next(modules, None) is not None:
            raise AssertionError("the reduction has more modules than the nested network has slots")
        return out


def nesting(model: nn.Module) -> Nesting | None:
    """The flat view of ``model`` if it is a plain ``nn.Sequential`` holding nested ones, else ``None``.

    Example:
        >>> net = nn.Sequential(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), nn.Linear(3, 2))
        >>> len(nesting(net).flat)
        3
    """
    if not is_plain_sequential(model) or not any(is_plain_sequential(child) for child in model):
        return None
    leaves = _leaves(model)
    return Nesting(model, nn.Sequential(*(m for _, m in leaves)), [name.rstrip(".") for name, _ in leaves])
