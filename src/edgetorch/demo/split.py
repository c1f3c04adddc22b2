"""Demo section: a BottleFit split round trip over loopback HTTP.

A resnet18 with a C = 12 bottleneck at SP2 (seeded random weights: this section shows the
runtime; the training section shows accuracy) is exported to a temporary directory as head and
tail programs; the tail is served by uvicorn on a free loopback port in a background thread; a few
real Fashion-MNIST test images, written as PNG files, go through head -> 8-bit payload -> HTTP ->
tail. The section checks that the server's logits equal the unsplit model's up to quantisation,
and prints the payload size next to the PNG input and each stage's time.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from rich.console import Console
from rich.table import Table

from ..data import load_dataset
from ..split.bottleneck import inject_bottleneck
from ..split.client import SplitClient, preprocess_images
from ..split.export import save
from ..split.protocol import serve_in_background
from ..split.server import app_from_dir
from ..zoo import build_model

ARCH, CHANNELS, RESOLUTION, IMAGES = "torchvision:resnet18", 12, 64, 4


def run(console: Console) -> None:
    """Print the split section; exits non-zero if the served logits drift beyond quantisation."""
    console.rule("edgetorch demo: BottleFit split computing over loopback HTTP")
    torch.manual_seed(0)
    student = inject_bottleneck(build_model(ARCH, num_classes=10), CHANNELS, "sp2").eval()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        manifest = save(student, root / "artifact", RESOLUTION)
        console.print(f"exported {ARCH} (SP2, C={CHANNELS}) at {RESOLUTION}px: head -> "
                      f"{list(manifest.bottleneck_shape)}, tail -> {manifest.num_classes} logits")
        test = load_dataset("fashion-mnist", "test", limit=IMAGES)
        paths = []
        for i, image in enumerate(test.tensors[0]):
            paths.append(root / f"fashion_{i}.png")
            Image.fromarray((image[0].numpy() * 255).round().astype(np.uint8), mode="L").save(paths[-1])

        with serve_in_background(app_from_dir(root / "artifact")) as url, \
                SplitClient.from_dir(root / "artifact", url) as client:
            console.print(f"tail served at {url}")
            client.infer_files(paths[:1])  # warm-up: first calls pay one-time setup
            result = client.infer_files(paths)
        images = preprocess_images(paths, manifest.preprocess, 3)  # what the device fed its head
        png_at_input_size = _png_bytes(images[:, 0], root / "resized.png")

    with torch.inference_mode():
        unsplit = student(images)
    error = float((result.logits - unsplit).abs().max())
    spread = float(unsplit.amax() - unsplit.amin())

    table = Table(title=f"{IMAGES} images, one request")
    table.add_column("stage")
    table.add_column("ms", justify="right")
    for stage, seconds in result.seconds.items():
        table.add_row(stage, f"{seconds * 1e3:.1f}")
    console.print(table)
    console.print(f"payload {result.payload_bytes:,} bytes for {IMAGES} bottlenecks "
                  f"({result.payload_bytes / IMAGES:,.0f} per image) vs the PNG of the "
                  f"{RESOLUTION}px input: {png_at_input_size / IMAGES:,.0f} bytes per image")
    agree = result.predictions == unsplit.argmax(1).tolist()
    console.print(f"server logits vs the unsplit model: max |diff| {error:.2e} (logit spread {spread:.3f}); "
                  f"predictions {'agree' if agree else 'differ'}")
    if not error < 0.05 * spread:
        raise SystemExit(f"split logits differ from the unsplit model by {error:.4f}, beyond quantisation")


def _png_bytes(images: torch.Tensor, scratch: Path) -> int:
    """Total bytes of ``images`` ([N, H, W] in [0, 1]) saved as optimised gray PNG files."""
    total = 0
    for image in images:
        Image.fromarray((image.numpy() * 255).round().astype(np.uint8), mode="L").save(scratch, optimize=True)
        total += scratch.stat().st_size
    return total
