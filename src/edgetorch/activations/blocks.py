"""Per-block storage: each block of a model (a residual block, a transformer layer) stores what
its ops save for backward in a form of its own, in one pass of the engine.

A block is a module whose saved tensors the engine can scope by name: every tensor it packs is
attributed to the innermost module running, and that module's qualified name starts with the
block's. :func:`find_blocks` finds them the way :func:`~edgetorch.activations.checkpoint.find_stages`
finds stages, one level down: the children of each sequence of blocks. :class:`PerBlock` maps
blocks to policies; the engine asks it (:meth:`PerBlock.by_module`, built once per model and kept)
for a table from every module name inside a block to that block's policy, and then looks each
saved tensor's policy up in it (one dict lookup; tensors saved outside every block take ``default``).

A block may also be recomputed (:class:`Recompute`): :func:`recomputing` swaps it for a
:class:`~edgetorch.activations.checkpoint.CheckpointEvery` of that one block while the forward
runs, so the forward keeps only its input, and backward runs it again, storing what the rerun
saves under the policy the plan gives it.

A tensor saved by two blocks (a block's output is the next block's input) is stored once per
distinct form, as under one policy; each op's own block says which form it wants, and a held form
serves another where that op's policy says it may (an exact copy serves every op). Two Back Razor
blocks at different sparsities both want the top-k form, so a tensor both prune is kept at the
sparsity of the first that saved it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..measure.ledger import SavedTensorLedger
from .checkpoint import CheckpointEvery, block_sequences
from .forms import Form
from .policies import Bitmap, Dense, Policy
from .roles import EXACT, Need


def find_blocks(model: nn.Module, *, stem: bool = False) -> list[str]:
    """Qualified names of ``model``'s blocks, in module order.

    A block is a child that holds parameters of a sequence of blocks: an ``nn.Sequential`` or
    ``nn.ModuleList`` with at least two such children (ResNet's ``layer1.0``, MobileNet's
    ``features.3``, torchvision ViT's ``encoder.layers.encoder_layer_0``, a BERT encoder's
    ``encoder.layer.0``), or with one where a sibling is such a sequence (a ResNet-10's stages:
    :func:`~edgetorch.activations.checkpoint.block_sequences`). Other modules are searched inside;
    a block is not.

    Args:
        model: the model.
        stem: also the layers before the first sequence of blocks, each a block of its own: the
            children of that sequence's parent registered before it that are layers (no children
            of their own), such as a ResNet's ``conv1``, ``bn1``, ``relu`` and ``maxpool``. What
            they save otherwise takes a plan's default form, and it is not small: a ResNet's stem
            saves as much per sample as its first stage (four full-resolution maps). Registration
            order is taken for running order; :func:`~edgetorch.activations.costs.measure_block_costs`
            checks it.

    Returns:
        The block names (empty for a model with no sequence of blocks).

    Example:
        >>> find_blocks(torchvision.models.resnet18())[:3]  # doctest: +SKIP
        ['layer1.0', 'layer1.1', 'layer2.0']
        >>> find_blocks(torchvision.models.resnet18(), stem=True)[:5]  # doctest: +SKIP
        ['conv1', 'bn1', 'relu', 'maxpool', 'layer1.0']
    """
    found: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        sequences = block_sequences(module, (nn.Sequential, nn.ModuleList))
        leading = stem and not found and bool(sequences)  # the parent of the first sequence
        for name, child in module.named_children():
            qualified = f"{prefix}{name}"
            if name in sequences:
                found.extend(f"{qualified}.{n}" for n, _ in sequences[name])
                leading = False
            elif leading and next(child.children(), None) is None:
                if not isinstance(child, nn.Identity):  # stores nothing: a block of it only costs measuring
                    found.append(qualified)
            else:
                visit(child, f"{qualified}.")

    visit(model, "")
    return found


@dataclass(frozen=True)
class Recompute:
    """A block's form in a :class:`PerBlock` plan: recompute it in backward (checkpointing).

    Args:
        keep: how its input is stored in the forward, and what its rerun saves in backward
            (default lossless :class:`~edgetorch.Bitmap`).
    """

    keep: Policy = Bitmap()

    def __post_init__(self) -> None:
        if not isinstance(self.keep, Policy) or isinstance(self.keep, PerBlock):
            raise ValueError(f"Recompute keeps what it stores under a storage policy such as Bitmap(); got {self.keep!r}")

    def spec(self) -> str:
        return f"recompute({self.keep.spec()})"


@dataclass(frozen=True)
class PerBlock(Policy):
    """A storage policy per block, and one for every tensor saved outside the named blocks.

    Each tensor a block's modules save is stored as that block's policy says, with the rules of
    that policy (masks stay exact, only Back Razor prunes, only where the op's backward allows).
    Giving every block and the default the same policy stores every tensor as that policy does
    alone, so gradients are bit-identical to it.

    Args:
        blocks: ``(block name, policy)`` pairs; names as :func:`find_blocks` gives them (any
            module's qualified name works); a block inside another named block takes its own
            policy for its own modules. A :class:`Recompute` instead of a policy recomputes the
            block (run the forward inside :func:`recomputing`, as
            :func:`~edgetorch.activations.step.storing` does).
        default: the policy of tensors saved outside every named block (default ``Dense()``).

    Raises:
        ValueError: a block named twice, or a policy that is not a plain storage policy.

    Example:
        >>> plan = PerBlock((("layer1.0", Bitmap()), ("layer4.1", Quantized(8))), default=Bitmap())
        >>> with edgetorch.compress_activations(model, plan):  # doctest: +SKIP
        ...     loss = criterion(model(x), y)
    """

    blocks: tuple[tuple[str, Policy], ...] = ()
    default: Policy = Dense()

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple((str(n), p) for n, p in self.blocks))
        names = [n for n, _ in self.blocks]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"each block takes one policy; named more than once: {', '.join(twice)}")
        for name, policy in (*self.blocks, ("default", self.default)):
            recompute = isinstance(policy, Recompute) and name != "default"
            if not recompute and (not isinstance(policy, Policy) or isinstance(policy, PerBlock)):
                raise ValueError(f"{name}: the policy must be a storage policy such as Bitmap() or Quantized(8), "
                                 f"or Recompute(policy) for a block (not a PerBlock), got {policy!r}")
        policies = self.policies
        # The engine reads these once per block: a flag any block needs is on for the whole run.
        for flag in ("needs_roles", "narrows_integers", "encodes", "sized_by_count"):
            object.__setattr__(self, flag, any(getattr(p, flag) for p in policies))
        # by_module's tables: model -> {recomputed blocks swapped in: table}. Not a field, so
        # equal plans stay equal; weak, so a plan kept across models does not keep them alive.
        object.__setattr__(self, "_tables", weakref.WeakKeyDictionary())

    @property
    def policies(self) -> tuple[Policy, ...]:
        """Every policy the plan uses, the default first, each once."""
        return tuple(dict.fromkeys((self.default, *(_stores(p) for _, p in self.blocks))))

    @property
    def recomputed(self) -> tuple[tuple[str, Policy], ...]:
        """``(block, policy of what it keeps)`` for each block the plan recomputes."""
        return tuple((name, p.keep) for name, p in self.blocks if isinstance(p, Recompute))

    def by_module(self, model: nn.Module) -> tuple[dict[str, Policy], Policy]:
        """Every module name inside a named block, mapped to that block's policy; and ``default``.

        The engine asks for it on every step (a training loop makes an engine per step), so the
        table is built once per model (held weakly) and per state of :func:`recomputing` (its
        wrappers add module names), and kept on the plan: a model whose modules are replaced
        otherwise between steps needs a new plan.

        Raises:
            ValueError: a block name that is not a module of ``model``.
        """
        swapped = self._swapped(model)
        tables = self._tables.setdefault(model, {})
        if swapped not in tables:
            tables[swapped] = _table(model, self.blocks)
        return tables[swapped], self.default

    def _swapped(self, model: nn.Module) -> bool:
        """Whether :func:`recomputing` has swapped this plan's recomputed blocks in."""
        try:
            return any(isinstance(model.get_submodule(name), CheckpointEvery) for name, _ in self.recomputed)
        except AttributeError:  # not a module of the model: _table says so
            return False

    def form(self, need: Need) -> Form:
        """Not a plan's to say: each tensor takes the form of its block's policy, which the engine
        looks up by the module that saved it (:meth:`by_module`).

        Raises:
            TypeError: always; ask the block's policy.
        """
        raise TypeError(_PER_TENSOR)

    def encode(self, t: torch.Tensor, need: Need = EXACT):
        """Not a plan's to do: see :meth:`form`.

        Raises:
            TypeError: always; encode with the block's policy.
        """
        raise TypeError(_PER_TENSOR)

    def spec(self) -> str:
        """The string :func:`~edgetorch.parse_policy` turns back into this plan:
        ``per-block(layer1.0=bitmap; layer2.0=recompute(bitmap); default=dense)`` (items apart by
        ``;``, since a policy's own arguments are apart by ``,``)."""
        listed = "".join(f"{name}={policy.spec()}; " for name, policy in self.blocks)
        return f"per-block({listed}default={self.default.spec()})"


_PER_TENSOR = ("a PerBlock plan stores each saved tensor with the policy of the block that saved it, which only "
               "the engine knows (compress_activations looks it up with by_module); call form or encode on that "
               "block's policy, e.g. plan.blocks[0][1]")


def _table(model: nn.Module, blocks: tuple[tuple[str, Policy | Recompute], ...]) -> dict[str, Policy]:
    """Module name -> the policy of the innermost named block it lies in (see :meth:`PerBlock.by_module`).

    Each name's dotted prefixes are looked up, longest first: as many dict lookups as the name has
    parts, rather than a comparison with every block (341 us a step on vit_b_16 when it was).
    """
    names = [name for name, _ in model.named_modules()]
    known = set(names)
    missing = [n for n, _ in blocks if n not in known]
    if missing:
        raise ValueError(f"{type(model).__name__} has no module named {', '.join(map(repr, missing))}; "
                         f"name blocks as find_blocks gives them, e.g. {find_blocks(model)[:3]}")
    policies = {name: _stores(policy) for name, policy in blocks}
    table: dict[str, Policy] = {}
    for name in names:
        prefix = name
        while prefix:
            if prefix in policies:
                table[name] = policies[prefix]
                break
            prefix = prefix.rpartition(".")[0]
    return table


def _stores(form: Policy | Recompute) -> Policy:
    """The policy that stores a block's saved tensors (a recomputed block's: what it keeps)."""
    return form.keep if isinstance(form, Recompute) else form


@contextlib.contextmanager
def recomputing(model: nn.Module, plan: PerBlock, ledger: SavedTensorLedger | None = None) -> Iterator[None]:
    """Swap each block ``plan`` recomputes for a :class:`CheckpointEvery` of that block while the
    block of code runs, and back on exit (parameter names and ``state_dict`` keys stay the model's).

    Run the forward inside it under :func:`~edgetorch.compress_activations` with ``plan``, entered
    after it, so the engine sees (and names) the wrappers; backward may run after the block.

    Args:
        model: the model; blocks are replaced and restored in place.
        plan: the plan; blocks not recomputed are left alone.
        ledger: optional ledger for what the reruns in backward save.

    Example:
        >>> with recomputing(model, plan), edgetorch.compress_activations(model, plan):  # doctest: +SKIP
        ...     loss = criterion(model(x), y)
    """
    swapped = []
    try:
        for name, keep in plan.recomputed:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            block = getattr(parent, attr)
            setattr(parent, attr, CheckpointEvery([block], 1, keep, ledger))
            swapped.append((parent, attr, block))
        yield
    finally:
        for parent, attr, block in reversed(swapped):
            setattr(parent, attr, block)
