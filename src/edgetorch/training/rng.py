"""Seeding a run without touching the caller's random streams."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded(seed: int, device: str | torch.device = "cpu") -> Iterator[None]:
    """Inside: torch's CPU generator, and ``device``'s if it is a GPU, seeded with ``seed``; after: as before.

    A run seeded this way draws the same numbers (an initialisation, a new classifier, dropout
    masks) whatever ran before it in the process, and the caller's stream is neither advanced nor
    reset. Only ``device``'s CUDA generator is seeded (``torch.manual_seed`` would reset every
    GPU's, and ``fork_rng`` restores only the ones it is given).

    Args:
        seed: the seed.
        device: where the run's model lives; ``cuda`` means the current CUDA device.

    Example:
        >>> with seeded(0):
        ...     first = torch.rand(1)
        >>> with seeded(0):
        ...     torch.equal(first, torch.rand(1))
        True
    """
    where = torch.device(device)
    devices = [where.index if where.index is not None else torch.cuda.current_device()] if where.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        for index in devices:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield
