"""`make demo`: one short section per feature, run in order.

``python -m edgetorch.demo`` runs every section; ``python -m edgetorch.demo bittrain`` runs one.
Each section module exposes ``run(console)`` and raises ``SystemExit`` if what it shows is wrong.
"""

from __future__ import annotations

import importlib
import sys

from rich.console import Console

SECTIONS = ("bittrain", "backrazor", "reduce", "split")


def main(argv: list[str] | None = None) -> None:
    names = list(argv if argv is not None else sys.argv[1:]) or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown demo section(s) {unknown}; choose from {list(SECTIONS)}")
    console = Console(width=110)
    for name in names:
        importlib.import_module(f"{__name__}.{name}").run(console)
    if names == list(SECTIONS):
        console.rule("what next: the same on your own data")
        console.print(WHAT_NEXT)


WHAT_NEXT = """\
  # fine-tune your model on a folder of images (one subfolder per class) within a memory budget
  edgetorch finetune --model torchvision:resnet18 --weights resnet18.safetensors --data photos/ \\
      --memory-budget 1GiB --epochs 5 --out runs/photos --plot runs/photos.png
  # see what one training step saves and holds, per policy
  edgetorch profile --model torchvision:resnet18 --policy dense --policy bitmap --policy backrazor
  # shrink a trained network to a multiplication budget
  edgetorch reduce --model zoo:plaincnn --data fashion-mnist --alpha 0.5 --out small.safetensors
  # train a BottleFit student from your teacher, then export and serve it
  edgetorch split train --help
README.md has each in full; docs/results/ has every measured number."""
