"""Shared by the entropy-coded payload tests (versions 2 and 3): 10,000 damaged payloads against a decoder."""

from __future__ import annotations

import random
import tracemalloc

import torch

from edgetorch.split.coded import CodeTables
from edgetorch.split.fuzz import reseal
from edgetorch.split.payload import PayloadError, decode, read_header

COUNT = 10_000


def fuzz_decoder(valid: list[bytes], tables: CodeTables, rng: random.Random, max_numel: int = 2**24) -> dict[str, int]:
    """Byte flips, cuts, extensions and another payload's words after a header, each resealed past the
    CRC (as a lying encoder's would, so the stream checks are reached), decoded with ``tables``.

    Asserts that each decodes to a finite tensor of its header's shape or is a PayloadError, and that
    Python allocated under 16 MiB at the peak; returns how many of each there were.
    """
    outcomes = {"decoded": 0, "refused": 0}
    tracemalloc.start()
    for i in range(COUNT):
        blob = bytearray(rng.choice(valid))
        kind = i % 4
        if kind == 0:
            for _ in range(rng.randint(1, 6)):
                blob[rng.randrange(len(blob))] = rng.randrange(256)
        elif kind == 1:
            blob = blob[:rng.randrange(len(blob))]
        elif kind == 2:
            blob += bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 8, 64])))
        else:
            header = read_header(bytes(blob), tables).header_bytes
            blob = blob[:header] + rng.choice(valid)[-rng.randint(1, 40):]
        blob = reseal(bytes(blob))
        try:
            y = decode(blob, max_bytes=4096, tables=tables, max_numel=max_numel)
        except PayloadError:
            outcomes["refused"] += 1
            continue
        assert bool(torch.isfinite(y).all()) and y.shape == read_header(blob, tables).shape
        outcomes["decoded"] += 1
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20, peak
    return outcomes
