"""Checkpoint-every-m combined with a storage policy (BitTrain, Sec. 4 and Fig. 11).

The forward keeps only the input of every m-th block (encoded by the policy); backward
recomputes one segment at a time, and that recomputation stores its own saved tensors under the
policy too, so the peak is (segment inputs + one segment), each compressed.

Reentrant checkpointing is used on purpose: it runs the first pass under no_grad and the
recomputation under our hooks, whereas the non-reentrant variant is itself built on
saved_tensors_hooks and would hide the segment's tensors from ours.

:func:`checkpoint_stages` applies this to a whole model for the length of a block: every
``nn.Sequential`` of blocks (ResNet's ``layer1..4``, MobileNet's ``features``, ViT's encoder
layers) is swapped for a :class:`CheckpointEvery` and swapped back on exit, so parameter names,
``state_dict`` keys and the saved weights stay the model's own.

:func:`checkpoint_blocks` is the peer these are measured against: plain PyTorch's non-reentrant
checkpoint around every block, with no policy (what a GPU user picks without edgetorch).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..measure.ledger import SavedTensorLedger
from .engine import compress_activations
from .policies import Bitmap, Policy

class CheckpointEvery(nn.Module):
    """Run ``blocks`` in segments of ``every`` blocks, storing only segment inputs for backward.

    The module applies ``policy`` itself (to segment inputs in the forward, and to each
    segment's saved tensors while it is recomputed in backward): call it without an outer
    :func:`edgetorch.compress_activations`. Gradients and batch-norm running statistics are
    identical to running ``blocks`` plainly: recomputation replays the RNG state and does not
    update running statistics a second time (a known wart of plain checkpointing).

    Args:
        blocks: the sequence of blocks (an ``nn.Sequential`` or an iterable of modules).
        every: blocks per segment, ``m`` in the paper's checkpoint-every-m (>= 1).
        policy: storage policy for segment inputs and recomputed segments (default lossless
            :class:`edgetorch.Bitmap`).
        ledger: optional :class:`edgetorch.SavedTensorLedger`; its ``peak_live_bytes`` then
            covers the forward and every recomputation in backward.

    Example:
        >>> model = edgetorch.CheckpointEvery(net.features, every=2)
        >>> loss = model(x).sum(); loss.backward()
    """

    def __init__(
        self,
        blocks: nn.Sequential | Iterable[nn.Module],
        every: int,
        policy: Policy | None = None,
        ledger: SavedTensorLedger | None = None,
    ):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (blocks per segment), got {every!r}")
        self.blocks = blocks if isinstance(blocks, nn.Sequential) else nn.Sequential(*blocks)
        if len(self.blocks) == 0:
            raise ValueError("blocks is empty: give at least one module to run")
        self.every = every
        self.policy = policy if policy is not None else Bitmap()
        self.ledger = ledger

    def forward(self, x: torch.Tensor, *args, **kwargs):
        """``x`` through the blocks. Further arguments (a transformer layer's attention mask, as a
        BERT encoder passes it) go to a single block as they are; the recomputation reuses them, so
        none may need a gradient (reentrant checkpointing would not carry it)."""
        if args or kwargs:
            if len(self.blocks) != 1:
                raise TypeError(f"extra arguments reach a single block only; these {len(self.blocks)} run in sequence "
                                "and pass one tensor along")
            extra = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.requires_grad]
            if extra and torch.is_grad_enabled():
                raise ValueError("a recomputed block's extra inputs must not need gradients (reentrant checkpointing "
                                 "would drop them); recompute the blocks around it instead")
        if not torch.is_grad_enabled():
            return self.blocks[0](x, *args, **kwargs) if args or kwargs else self.blocks(x)
        # Inside a model-wide compress_activations (checkpoint_stages), that block already
        # stores the segment inputs under the same policy and deduplicates them against the
        # other ops that save them; a second, innermost pair of hooks would hide them from it.
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
        with contextlib.nullcontext() if outer else compress_activations(self, self.policy, ledger=self.ledger,
                                                                          keep=(x,)):
            for start in range(0, len(self.blocks), self.every):
                segment = self.blocks[start : start + self.every]
                if not x.requires_grad:
                    # Reentrant checkpointing only backpropagates into a segment whose input
                    # requires grad; the detached alias shares the caller's memory.
                    x = x.detach().requires_grad_()
                run = functools.partial(self._run_segment, args=args, kwargs=kwargs)
                x = checkpoint(run, segment, x, use_reentrant=True)
        return x

    def _run_segment(self, segment: nn.Sequential, x: torch.Tensor, args: tuple = (), kwargs: dict | None = None):
        if getattr(segment[0], "inplace", False) is True:
            # Dropout(inplace=True), ReLU(inplace=True) first: in the first pass it would change
            # the input checkpointing keeps for the recomputation, and in the recomputation that
            # input is a leaf that requires grad, which autograd refuses to change in place.
            # A transient copy of one segment input is the price.
            x = x.clone()
        kwargs = kwargs or {}

        def call(t: torch.Tensor):
            return segment[0](t, *args, **kwargs) if args or kwargs else segment(t)

        if not torch.is_grad_enabled():  # the first pass: nothing is saved
            return call(x)
        with _running_stats_frozen(segment), compress_activations(
            segment, self.policy, ledger=self.ledger
        ):
            return call(x)


def holds_parameters(module: nn.Module) -> bool:
    """Whether ``module`` or any module inside it has a parameter."""
    return any(True for _ in module.parameters())


def block_sequences(module: nn.Module, kinds: tuple[type[nn.Module], ...]) -> dict[str, list[tuple[str, nn.Module]]]:
    """The children of ``module`` that are sequences of blocks, in module order, each with its
    members that hold parameters (the blocks).

    A sequence is a container of one of ``kinds`` with two or more such members, or with one
    member that is itself made of modules with parameters (a block, not a layer) where a sibling
    is a sequence too: the stages of a ResNet with one block each (a ResNet-10), whose blocks were
    otherwise searched inside, and whose downsample's convolution and batch norm were taken for
    two blocks. A lone container of one block (a wrapper around a whole model) is searched inside.
    """
    many, one = {}, {}
    for name, child in module.named_children():
        if isinstance(child, kinds):
            members = [(n, c) for n, c in child.named_children() if holds_parameters(c)]
            if len(members) >= 2:
                many[name] = members
            elif len(members) == 1 and any(holds_parameters(c) for c in members[0][1].children()):
                one[name] = members
    found = {**many, **one} if many or len(one) >= 2 else many
    return {name: found[name] for name, _ in module.named_children() if name in found}


def find_stages(model: nn.Module) -> list[tuple[nn.Module, str, nn.Sequential]]:
    """The sequences of blocks :func:`checkpoint_stages` checkpoints: the outermost
    ``nn.Sequential`` submodules with at least two children that hold parameters, or with one
    block where a sibling is such a sequence (:func:`block_sequences`; a sequence of pooling and
    flattening, or of dropout and one Linear, saves nothing worth recomputing), as
    ``(parent, attribute, stage)``.

    A model that is itself an ``nn.Sequential`` is searched inside (it cannot replace itself).
    """
    stages = []
    sequences = block_sequences(model, (nn.Sequential,))
    for name, child in model.named_children():
        if name in sequences:
            stages.append((model, name, child))
        else:
            stages.extend(find_stages(child))
    return stages


@contextlib.contextmanager
def checkpoint_stages(model: nn.Module, policy: Policy | None = None,
                      ledger: SavedTensorLedger | None = None) -> Iterator[list[str]]:
    """Checkpoint every stage of ``model`` (see :func:`find_stages`) while the block runs.

    Each stage of n blocks keeps the input of every ``round(sqrt(n))``-th block (Chen et al.,
    2016: sqrt(n) segments of sqrt(n) blocks minimise the stored inputs plus one recomputed
    segment). Run the forward inside the block, under :func:`edgetorch.compress_activations`
    entered after it with the same ``policy``, so the tensors outside the stages are stored by it
    too and the engine sees the swapped modules; backward
    may run after the block (the recomputation holds the stage modules, not the attributes).

    Args:
        model: the model; its stage attributes are replaced and restored in place.
        policy: how recomputed segments store their saved tensors (default lossless Bitmap).
        ledger: optional ledger for the recomputed segments.

    Yields:
        The checkpointed stages' qualified names.

    Raises:
        ValueError: the model has no ``nn.Sequential`` of two or more blocks.

    Example:
        >>> with checkpoint_stages(model, policy), edgetorch.compress_activations(model, policy):
        ...     loss = criterion(model(x), y)
        >>> loss.backward()
    """
    stages = find_stages(model)
    if not stages:
        raise ValueError(f"{type(model).__name__} has no nn.Sequential of two or more blocks to checkpoint")
    names = {id(m): name for name, m in model.named_modules()}
    wrapped = [names[id(stage)] for _, _, stage in stages]
    try:
        for parent, attr, stage in stages:
            every = max(1, round(math.sqrt(len(stage))))
            setattr(parent, attr, CheckpointEvery(stage, every, policy, ledger))
        yield wrapped
    finally:
        for parent, attr, stage in stages:
            setattr(parent, attr, stage)


class CheckpointedBlock(nn.Module):
    """One block run under non-reentrant ``torch.utils.checkpoint`` (plainly where no gradient is
    needed), storing nothing edgetorch decides: the peer :func:`checkpoint_blocks` builds."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False) if torch.is_grad_enabled() else self.block(x)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """``model`` (edited in place) with every block checkpointed and no in-place module.

    Blocks are the children of each stage :func:`find_stages` finds (ResNet's ``layer1..4``,
    MobileNet's ``features``) that are blocks themselves (a residual or inverted residual block);
    where a stage is a flat run of layers (VGG's ``features`` and ``classifier``), each
    convolution or Linear with the parameter-free layers and batch norm after it (checkpointing
    a lone activation or batch norm stores its input, which it saves anyway). Every module with
    ``inplace=True`` is set to ``inplace=False``, because torchvision's ``ReLU(inplace=True)``
    modifies a tensor a checkpointed block saved as its input ("one of the variables needed for
    gradient computation has been modified by an inplace operation" on vgg11_bn with one
    checkpoint per layer).

    Args:
        model: the model (parts outside its stages are left as they are).

    Returns:
        ``model`` itself, its blocks wrapped in :class:`CheckpointedBlock`.

    Example:
        >>> peer = checkpoint_blocks(copy.deepcopy(model))  # doctest: +SKIP
        >>> peer(x).sum().backward()  # doctest: +SKIP
    """
    for m in model.modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False
    for parent, attr, stage in find_stages(model):
        blocks: list[nn.Module] = []
        run: list[nn.Module] = []
        for child in stage:
            if any(True for _ in child.children()):  # a block of its own
                blocks += [nn.Sequential(*run)] if run else []
                blocks.append(child)
                run = []
            else:
                if isinstance(child, _LAYERS) and run:
                    blocks.append(nn.Sequential(*run))
                    run = []
                run.append(child)
        blocks += [nn.Sequential(*run)] if run else []
        setattr(parent, attr, nn.Sequential(*(CheckpointedBlock(b) for b in blocks)))
    return model


# Where a flat run of layers starts a new block in checkpoint_blocks.
_LAYERS = (nn.modules.conv._ConvNd, nn.Linear)


@contextlib.contextmanager
def _running_stats_frozen(module: nn.Module) -> Iterator[None]:
    """Batch norm in train mode, but running statistics left as they are (momentum 0)."""
    norms = [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(norms, saved):
            m.momentum = momentum
            m.num_batches_tracked.copy_(tracked)
