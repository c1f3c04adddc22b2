"""The deployment decision: local, full offload, or split at each C, by delay, energy and accuracy.

BottleFit's model (Sec. III-D): D_e2e = D_H + D_N + D_T and P_md = P_H + P_N. Here:

* D_H (device): the head (or, for local computing, the whole model) timed on this host, batch 1
  (fastest of interleaved rounds: :func:`time_modules`), plus encoding what is sent (the 8-bit
  payload for split computing, the PNG or JPEG file for full offload), scaled by the device
  profile's speed ratio (:mod:`edgetorch.split.power`);
* D_N: the link model (:mod:`edgetorch.split.links`) for the true payload bytes: the 8-bit
  bottleneck payload (:func:`edgetorch.split.payload.payload_size`) for split computing, the
  mean PNG or JPEG file size of real test images at the model's resolution for full offload;
* D_T (server): the tail (or the whole model for offload) timed on this host, divided by an
  assumed ``server_speedup`` (1 = the server is this host; an edge server with a GPU is faster).

Accuracy is not measured by the planner: it comes from a JSON file (part A's training results or
the user's), and the plan says which; options without a known accuracy show none.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .links import Link
from .payload import encode, payload_size
from .power import DeviceProfile


@dataclass(frozen=True)
class HostTimes:
    """Seconds per batch-1 inference on this host (fastest of interleaved rounds).

    Attributes:
        arch: model spec.
        resolution: input height = width.
        full_s: the unsplit model.
        head_s, tail_s: per bottleneck channel count C.
        bottleneck_shapes: per C, one sample's bottleneck shape.
        reference_s: the device profile's reference model, for the speed ratio.
        payload_encode_s: per C, encoding one bottleneck as the 8-bit payload.
    """

    arch: str
    resolution: int
    full_s: float
    head_s: dict[int, float]
    tail_s: dict[int, float]
    bottleneck_shapes: dict[int, tuple[int, ...]]
    reference_s: float
    payload_encode_s: dict[int, float] = field(default_factory=dict)


def time_modules(calls: dict[str, tuple[Callable[[torch.Tensor], Any], torch.Tensor]],
                 rounds: int = 5) -> dict[str, float]:
    """Fastest of ``rounds`` wall-clock timings of each ``module(x)``, interleaved round-robin.

    On a shared machine other jobs only ever add time, so the minimum estimates the module's own
    cost; interleaving puts every module under the same drifting load instead of timing one module
    in a quiet minute and the next in a busy one. One untimed warm-up call each comes first.

    Args:
        calls: name -> (module or function, input); modules are put in eval mode.
        rounds: timed calls per entry.

    Returns:
        name -> seconds.
    """
    best = {name: float("inf") for name in calls}
    with torch.inference_mode():
        for module, x in calls.values():
            (module.eval() if isinstance(module, nn.Module) else module)(x)
        for _ in range(rounds):
            for name, (module, x) in calls.items():
                start = time.perf_counter()
                module(x)
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def measure_host_times(arch: str, channels: list[int], resolution: int, reference: DeviceProfile,
                       split_point: str = "sp2", num_classes: int = 10, rounds: int = 5) -> HostTimes:
    """Time the full model, each C's head and tail, and the profile's reference model on this host.

    Weights do not change the time of a dense CNN, so randomly initialised models are timed.

    Args:
        arch: ``torchvision:NAME`` of a ResNet/DenseNet accepted by ``inject_bottleneck``.
        channels: bottleneck channel counts to plan for.
        resolution: input height = width (must suit the bottleneck's stride, e.g. a multiple of 32).
        reference: the device profile whose reference model sets the speed ratio.
        split_point: ``"sp1"`` or ``"sp2"``.
        num_classes: classifier outputs.
        rounds: timed calls per module (the fastest counts, see :func:`time_modules`).

    Returns:
        :class:`HostTimes`.
    """
    from ..zoo import build_model
    from .bottleneck import inject_bottleneck

    torch.manual_seed(0)
    teacher = build_model(arch, num_classes=num_classes)
    x = torch.rand(1, 3, resolution, resolution)
    calls: dict[str, tuple[nn.Module, torch.Tensor]] = {"full": (teacher, x)}
    shapes = {}
    for c in channels:
        student = inject_bottleneck(teacher, c, split_point).eval()
        with torch.inference_mode():
            z = student.head(x)
        calls[f"head{c}"], calls[f"tail{c}"], calls[f"encode{c}"] = (student.head, x), (student.tail, z), (encode, z)
        shapes[c] = tuple(z.shape[1:])
    side = reference.reference_resolution
    calls["reference"] = (build_model(reference.reference_model, num_classes=1000), torch.rand(1, 3, side, side))
    seconds = time_modules(calls, rounds)
    return HostTimes(arch, resolution, seconds["full"], {c: seconds[f"head{c}"] for c in channels},
                     {c: seconds[f"tail{c}"] for c in channels}, shapes, seconds["reference"],
                     {c: seconds[f"encode{c}"] for c in channels})


def image_file_bytes(resolution: int, count: int = 64, jpeg_quality: int = 90,
                     dataset: str = "fashion-mnist", images_dir: str | Path | None = None) -> dict[str, float]:
    """Mean PNG and JPEG file sizes, and the time to encode them here, of real images resized to
    the model's resolution.

    By default the first ``count`` test images of ``dataset``, gray (one channel: the model
    repeats it to 3, so a device would send the one-channel file). With ``images_dir``, the
    user's own images instead (PNG/JPEG/BMP/WebP found under it, sorted, the first ``count``),
    in their own colour mode.

    Args:
        resolution: height = width after resizing (bilinear, as ``load_dataset(size=...)`` does).
        count: images averaged.
        jpeg_quality: PIL JPEG quality.
        dataset: ``"fashion-mnist"`` or ``"digits"`` (when no ``images_dir``).
        images_dir: a folder of the user's images.

    Returns:
        ``{"png", "jpeg"}``: mean bytes; ``{"png_encode_s", "jpeg_encode_s"}``: mean seconds to
        encode one image on this host; ``"source"`` is not included (the caller knows it).

    Raises:
        ValueError: ``images_dir`` holds no readable image.
    """
    from PIL import Image, UnidentifiedImageError

    if images_dir is None:
        from ..data import load_dataset

        images = load_dataset(dataset, "test", size=resolution, limit=count).tensors[0]
        pictures = [Image.fromarray((image[0].numpy() * 255).round().astype(np.uint8), mode="L") for image in images]
    else:
        files = sorted(p for p in Path(images_dir).rglob("*") if p.suffix.lower() in _IMAGE_SUFFIXES)
        pictures = []
        for path in files[:count]:
            try:
                with Image.open(path) as image:
                    mode = image.mode if image.mode in ("L", "RGB") else "RGB"
                    pictures.append(image.convert(mode).resize((resolution, resolution), Image.BILINEAR))
            except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
                raise ValueError(f"{path}: not a readable image ({exc})") from None
        if not pictures:
            raise ValueError(f"{images_dir}: no {'/'.join(sorted(_IMAGE_SUFFIXES))} images found")
    sizes: dict[str, list[int]] = {"png": [], "jpeg": []}
    seconds: dict[str, list[float]] = {"png": [], "jpeg": []}
    for pixels in pictures:
        for fmt, options in (("png", {"optimize": True}), ("jpeg", {"quality": jpeg_quality})):
            buffer = io.BytesIO()
            start = time.perf_counter()
            pixels.save(buffer, format=fmt.upper(), **options)
            seconds[fmt].append(time.perf_counter() - start)
            sizes[fmt].append(buffer.tell())
    return {**{fmt: float(np.mean(v)) for fmt, v in sizes.items()},
            **{f"{fmt}_encode_s": float(np.median(v)) for fmt, v in seconds.items()}}


_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp"}


@dataclass(frozen=True)
class Accuracy:
    """Known accuracies and where they come from.

    Attributes:
        teacher: the unsplit model (local computing and lossless PNG offload).
        jpeg: the unsplit model on JPEG inputs, if measured.
        split: per C, the split model with the 8-bit payload.
        source: the file they were read from.
    """

    teacher: float | None
    jpeg: float | None
    split: dict[int, float]
    source: str


def load_accuracy(path: str | Path) -> Accuracy:
    """Read accuracies from ``{"teacher": a, "jpeg": a (optional), "split": {"C": a, ...}}``.

    Args:
        path: the JSON file (e.g. written from the training benchmark's results).

    Returns:
        :class:`Accuracy` with ``source`` = the path.

    Raises:
        ValueError: unreadable file or values outside [0, 1].
    """
    try:
        raw = json.loads(Path(path).read_text())
        split = {int(c): float(a) for c, a in raw.get("split", {}).items()}
        result = Accuracy(_fraction(raw.get("teacher")), _fraction(raw.get("jpeg")), split, str(path))
    except (OSError, json.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not an accuracy file {{'teacher', 'jpeg', 'split': {{C: acc}}}} ({exc})") from None
    if result.teacher is None and not split:
        raise ValueError(f"{path}: holds neither a 'teacher' nor a 'split' accuracy")
    if any(not 0 <= a <= 1 for a in split.values()):
        raise ValueError(f"{path}: accuracies are fractions in [0, 1]")
    return result


def _fraction(value: object) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not 0 <= value <= 1:
        raise ValueError(f"accuracy {value} is not a fraction in [0, 1]")
    return value


@dataclass(frozen=True)
class PlanRow:
    """One deployment option.

    Attributes:
        option: ``local``, ``offload png``, ``offload jpeg`` or ``split C=c``.
        sent_bytes: request bytes over the link (0 for local).
        head_s: device compute seconds (whole model when local), encoding what is sent included.
        network_s, network_p95_s: link delay, mean and 95th percentile over the link's samples.
        tail_s: server compute seconds.
        e2e_s: head + network (mean) + tail.
        energy_j: device energy per inference.
        power_w: mean device power over e2e.
        accuracy: known accuracy or None.
    """

    option: str
    sent_bytes: int
    head_s: float
    network_s: float
    network_p95_s: float
    tail_s: float
    e2e_s: float
    energy_j: float
    power_w: float
    accuracy: float | None


def _row(option: str, nbytes: int, head_s: float, tail_s: float, link: Link | None,
         device: DeviceProfile, accuracy: float | None) -> PlanRow:
    if link is None:  # local: no transfer, no server
        delays, uplink = np.zeros(1), np.zeros(1)
    else:
        delays, uplink = link.delays(nbytes), link.uplink(nbytes)
    network = float(delays.mean())
    transmit = float(uplink.mean())
    e2e = head_s + network + tail_s
    energy = device.energy(head_s, transmit, network - transmit + tail_s)
    return PlanRow(option, nbytes, head_s, network, float(np.percentile(delays, 95)), tail_s, e2e,
                   energy, energy / e2e, accuracy)


def compare_deployments(times: HostTimes, file_bytes: dict[str, float], link: Link, device: DeviceProfile,
         accuracy: Accuracy | None = None, per_sample: bool = True,
         server_speedup: float = 1.0) -> list[PlanRow]:
    """Every option's delay, energy and accuracy for one link and device.

    Args:
        times: host timings (:func:`measure_host_times`).
        file_bytes: mean input file sizes (:func:`image_file_bytes`).
        link: the network model.
        device: the device profile.
        accuracy: known accuracies, or None.
        per_sample: payload scale mode (5 bytes more per sample when True).
        server_speedup: how many times faster than this host the server runs (assumption).

    Returns:
        Rows in the order local, offload png, offload jpeg, split C ascending.
    """
    if not server_speedup > 0:
        raise ValueError(f"server_speedup must be > 0, got {server_speedup}")
    slowdown = device.reference_seconds / times.reference_s
    server_full, server_tail = times.full_s / server_speedup, {c: t / server_speedup for c, t in times.tail_s.items()}
    acc = accuracy or Accuracy(None, None, {}, "none")
    rows = [_row("local", 0, times.full_s * slowdown, 0.0, None, device, acc.teacher)]
    for fmt, known in (("png", acc.teacher), ("jpeg", acc.jpeg)):
        encoding = file_bytes.get(f"{fmt}_encode_s", 0.0) * slowdown  # the device encodes the file it sends
        rows.append(_row(f"offload {fmt}", round(file_bytes[fmt]), encoding, server_full, link, device, known))
    for c in sorted(times.head_s):
        nbytes = payload_size((1, *times.bottleneck_shapes[c]), per_sample)
        head = (times.head_s[c] + times.payload_encode_s.get(c, 0.0)) * slowdown
        rows.append(_row(f"split C={c}", nbytes, head, server_tail[c], link, device, acc.split.get(c)))
    return rows


def plan_record(rows: list[PlanRow], link: Link, device: DeviceProfile, times: HostTimes,
                accuracy: Accuracy | None, server_speedup: float = 1.0) -> dict:
    """A JSON-ready record of a plan with every assumption it used."""
    return {"link": link.name, "device": asdict(device), "host_times": asdict(times),
            "device_slowdown_vs_host": device.reference_seconds / times.reference_s,
            "server_speedup_vs_host": server_speedup,
            "accuracy_source": accuracy.source if accuracy else None,
            "rows": [asdict(r) for r in rows],
            "best_delay": min(rows, key=lambda r: r.e2e_s).option,
            "best_energy": min(rows, key=lambda r: r.energy_j).option}
