"""The deployment decision: local, full offload, or split at each C, by delay, energy and accuracy.

BottleFit's model (Sec. III-D): D_e2e = D_H + D_N + D_T and P_md = P_H + P_N. Here:

* D_H (device): the head (or, for local computing, the whole model) timed on this host, batch 1
  (fastest of interleaved rounds: :func:`time_modules`), plus encoding what is sent (the 8-bit
  payload for split computing, the PNG or JPEG file for full offload), scaled by the device
  profile's speed ratio (:mod:`edgetorch.split.power`);
* D_N: the link model (:mod:`edgetorch.split.links`) for the true payload bytes: the 8-bit
  bottleneck payload (:func:`edgetorch.split.payload.payload_size`) for split computing, the
  mean PNG or JPEG file size of real test images at the model's resolution for full offload;
* D_T (server): the tail (or the whole model for offload) from a server profile
  (:class:`~edgetorch.split.power.ServerProfile`): this host's times scaled by the profile's speed
  ratio (default ``quadro-p600``, the paper's edge server, speed assumed), this host's own times
  (``this-machine``), or times measured on the real server (:func:`measure_server`).

Accuracy is not measured by the planner: it comes from a JSON file (part A's training results or
the user's), and the plan says which; options without a known accuracy show none.
"""

from __future__ import annotations

import functools
import io
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .._checks import check_json_fields
from .._files import InputFileError, read_json
from ..data.images import IMAGE_EXTENSIONS, list_images, read_image
from ..training import seeded
from .coded import fit_code_tables
from .links import Link
from .payload import encode, payload_size, quantize
from .power import (
    DEFAULT_SERVER,
    REFERENCE_MODEL,
    REFERENCE_RESOLUTION,
    SERVERS,
    DeviceProfile,
    MeasuredTimes,
    ServerProfile,
)
from .student import RECORD_FORMAT

# The random weights and inputs the planner times (a dense CNN's time does not depend on them).
TIMING_SEED = 0


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
        coded_encode_s: per C, encoding it entropy-coded (tables fitted on the timed head's own
            codes: the coder's time hardly depends on the table).
        split_point: where the bottleneck sits (``"sp1"`` or ``"sp2"``).
        server_reference_s: the server profile's reference model, when it is not the device's
            (else None: ``reference_s`` serves both).
    """

    arch: str
    resolution: int
    full_s: float
    head_s: dict[int, float]
    tail_s: dict[int, float]
    bottleneck_shapes: dict[int, tuple[int, ...]]
    reference_s: float
    payload_encode_s: dict[int, float] = field(default_factory=dict)
    split_point: str = "sp2"
    server_reference_s: float | None = None
    coded_encode_s: dict[int, float] = field(default_factory=dict)


def time_modules(calls: dict[str, tuple[Callable[[torch.Tensor], Any], torch.Tensor]],
                 rounds: int = 5) -> dict[str, float]:
    """Fastest of ``rounds`` wall-clock timings of each ``module(x)``, interleaved round-robin.

    On a shared machine other jobs only ever add time, so the minimum estimates the module's own
    cost; interleaving puts every module under the same drifting load instead of timing one module
    in a quiet minute and the next in a busy one. One untimed warm-up call each comes first. With
    a CUDA input each call waits for the GPU to finish (kernels launch asynchronously).

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
            _wait(x)
        for _ in range(rounds):
            for name, (module, x) in calls.items():
                start = time.perf_counter()
                module(x)
                _wait(x)
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def _wait(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def measure_host_times(arch: str, channels: list[int], resolution: int, reference: DeviceProfile,
                       split_point: str = "sp2", num_classes: int = 10, rounds: int = 5,
                       server: ServerProfile | None = None) -> HostTimes:
    """Time the full model, each C's head and tail, and the profiles' reference models on this host.

    Weights do not change the time of a dense CNN, so randomly initialised models are timed.

    Args:
        arch: ``torchvision:NAME`` of a ResNet/DenseNet accepted by ``inject_bottleneck``.
        channels: bottleneck channel counts to plan for.
        resolution: input height = width (must suit the bottleneck's stride, e.g. a multiple of 32).
        reference: the device profile whose reference model sets the device's speed ratio.
        split_point: ``"sp1"`` or ``"sp2"``.
        num_classes: classifier outputs.
        rounds: timed calls per module (the fastest counts, see :func:`time_modules`).
        server: the server profile, whose reference model is timed too when it is not the device's.

    Returns:
        :class:`HostTimes`.

    Example:
        >>> times = measure_host_times("torchvision:resnet18", [3, 12], 96, PROFILES["jetson-nano"])
    """
    references = {"reference": _reference(reference)}
    if server is not None and server.reference_model is not None and _reference(server) != references["reference"]:
        references["server_reference"] = _reference(server)
    calls = _timing_calls(arch, channels, resolution, split_point, num_classes, references)
    seconds = time_modules(calls, rounds)
    return HostTimes(arch, resolution, seconds["full"], {c: seconds[f"head{c}"] for c in channels},
                     {c: seconds[f"tail{c}"] for c in channels},
                     {c: tuple(calls[f"tail{c}"][1].shape[1:]) for c in channels}, seconds["reference"],
                     {c: seconds[f"encode{c}"] for c in channels}, split_point, seconds.get("server_reference"),
                     {c: seconds[f"coded{c}"] for c in channels})


def measure_server(arch: str, channels: list[int], resolution: int, split_point: str = "sp2",
                   device: str = "cpu", name: str | None = None, num_classes: int = 10,
                   rounds: int = 5) -> ServerProfile:
    """Time the full model, each C's tail and the reference model here, as a server profile.

    Run it on the edge server (``edgetorch split measure-server`` does) and give the profile's JSON
    (:func:`~edgetorch.split.power.profile_json`) to ``edgetorch split plan --server FILE``: a plan
    of the same model uses these times, any other model is scaled by the reference model's.

    Args:
        arch: ``torchvision:NAME`` of a ResNet/DenseNet accepted by ``inject_bottleneck``.
        channels: bottleneck channel counts.
        resolution: input height = width.
        split_point: ``"sp1"`` or ``"sp2"``.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``: where the server runs the tail.
        name: the profile's label (default: this machine's host name and ``device``).
        num_classes: classifier outputs.
        rounds: timed calls per module (the fastest counts, see :func:`time_modules`).

    Returns:
        A :class:`~edgetorch.split.power.ServerProfile` whose ``source`` says where and when it was measured.

    Example:
        >>> profile = measure_server("torchvision:resnet18", [3, 12], 96, device="cuda")
        >>> Path("server.json").write_text(profile_json(profile))
    """
    reference = (REFERENCE_MODEL, REFERENCE_RESOLUTION)
    calls = _timing_calls(arch, channels, resolution, split_point, num_classes, {"reference": reference}, device)
    # The device runs the heads and encodes the payload; the server needs neither.
    seconds = time_modules({k: v for k, v in calls.items() if not k.startswith(("head", "encode", "coded"))}, rounds)
    host = platform.node() or "server"
    where = (torch.cuda.get_device_name(device) if device.startswith("cuda")
             else f"CPU, torch threads {torch.get_num_threads()}")
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return ServerProfile(name or f"{host} {device}", *reference, seconds["reference"],
                         f"MEASURED on {host} ({where}), torch {torch.__version__}, {when}: batch 1, fastest of {rounds}",
                         MeasuredTimes(arch, resolution, split_point, seconds["full"],
                                       {c: seconds[f"tail{c}"] for c in channels}))


def _reference(profile: DeviceProfile | ServerProfile) -> tuple[str | None, int | None]:
    return profile.reference_model, profile.reference_resolution


def _timing_calls(arch: str, channels: list[int], resolution: int, split_point: str, num_classes: int,
                  references: dict[str, tuple[str, int]],
                  device: str = "cpu") -> dict[str, tuple[Callable[[torch.Tensor], Any], torch.Tensor]]:
    """What :func:`time_modules` times: ``full``, per C ``head{c}``, ``tail{c}``, ``encode{c}`` and ``coded{c}``, and each
    reference model under its key, with batch-1 inputs on ``device`` (random weights: see callers).

    The weights and inputs are drawn from :data:`TIMING_SEED` under :func:`torch.random.fork_rng`:
    the same on every run, and the caller's random state is left as it was."""
    from ..zoo import build_model
    from .bottleneck import inject_bottleneck

    with seeded(TIMING_SEED, device):
        teacher = build_model(arch, num_classes=num_classes).to(device)
        x = torch.rand(1, 3, resolution, resolution, device=device)
        calls: dict[str, tuple[Callable[[torch.Tensor], Any], torch.Tensor]] = {"full": (teacher, x)}
        for c in channels:
            student = inject_bottleneck(teacher, c, split_point).to(device).eval()
            with torch.inference_mode():
                z = student.head(x)
            calls[f"head{c}"], calls[f"tail{c}"], calls[f"encode{c}"] = (student.head, x), (student.tail, z), (encode, z)
            tables = fit_code_tables(quantize(z)[0])
            calls[f"coded{c}"] = (functools.partial(encode, tables=tables), z)
        for key, (model, side) in references.items():
            calls[key] = (build_model(model, num_classes=1000).to(device), torch.rand(1, 3, side, side, device=device))
    return calls


def image_file_bytes(resolution: int, count: int = 64, jpeg_quality: int = 90,
                     dataset: str = "fashion-mnist", images_dir: str | Path | None = None) -> dict[str, float]:
    """Mean PNG and JPEG file sizes, and the time to encode them here, of real images resized to
    the model's resolution.

    By default the first ``count`` test images of ``dataset``, gray (one channel: the model
    repeats it to 3, so a device would send the one-channel file). With ``images_dir``, the
    user's own images instead (the files an image folder lists under it, in its order, the
    first ``count``), in their own colour mode.

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
        InputFileError: (a ``ValueError``) ``images_dir`` cannot be listed, holds no image files,
            or one of the first ``count`` is not a readable image.
    """
    from PIL import Image

    if images_dir is None:
        from ..data import load_dataset

        images = load_dataset(dataset, "test", size=resolution, limit=count).tensors[0]
        pictures = [Image.fromarray((image[0].numpy() * 255).round().astype(np.uint8), mode="L") for image in images]
    else:
        if not Path(images_dir).is_dir():
            raise InputFileError(f"{images_dir} is not a folder; a folder of {'/'.join(IMAGE_EXTENSIONS)} images "
                                 "is expected")
        # A folder reached twice (a symlink loop) is not entered again; its images are listed once already.
        (files,), _ = list_images([images_dir])
        pictures = []
        for path in files[:count]:
            image = read_image(path)
            mode = image.mode if image.mode in ("L", "RGB") else "RGB"
            pictures.append(image.convert(mode).resize((resolution, resolution), Image.BILINEAR))
        if not pictures:
            raise InputFileError(f"{images_dir}: no {'/'.join(IMAGE_EXTENSIONS)} images found")
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



@dataclass(frozen=True)
class Accuracy:
    """Known accuracies and where they come from.

    Attributes:
        teacher: the unsplit model (local computing and lossless PNG offload).
        jpeg: the unsplit model on JPEG inputs, if measured.
        split: per C, the split model with the 8-bit payload.
        source: the file they were read from.
        coded_bytes: per C, real entropy-coded payload sizes of a representative set of images
            (``split train``'s record holds the first 256 validation images'); the plan then has a
            coded row per C, each size sent over the link.
        coded: per C, the accuracy through the coded payloads where it differs from ``split``'s
            (a rate-trained student's version-3 payloads); else the coded row has the 8-bit one.
    """

    teacher: float | None
    jpeg: float | None
    split: dict[int, float]
    source: str
    coded_bytes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    coded: dict[int, float] = field(default_factory=dict)


def load_accuracy(path: str | Path) -> Accuracy:
    """Read accuracies from ``{"teacher": a, "jpeg": a (optional), "split": {"C": a, ...},
    "coded_bytes": {"C": [bytes, ...]} (optional), "coded": {"C": a} (optional: the accuracy through
    them, where not the 8-bit one)}``, or from the record ``edgetorch split train
    --json`` writes (``student.json``: the teacher on the validation images, on their JPEG q90
    files where scored, the student through its 8-bit payload at its C, and the sizes of its
    entropy-coded payloads).

    Args:
        path: the JSON file (e.g. written from the training benchmark's results).

    Returns:
        :class:`Accuracy` with ``source`` = the path.

    Raises:
        ValueError: unreadable file or values outside [0, 1].
    """
    raw = read_json(path)
    try:
        if isinstance(raw, dict) and raw.get("format") == RECORD_FORMAT:
            raw = _student_accuracy(raw)
        if not isinstance(raw, dict):  # other keys are allowed: a results file holds more than these
            raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
        check_json_fields(Accuracy, {k: v for k, v in raw.items() if k != "source"}, "accuracy file")
        split = {int(c): float(a) for c, a in raw.get("split", {}).items()}
        coded = {int(c): tuple(sizes) for c, sizes in raw.get("coded_bytes", {}).items()}
        if any(not sizes or not all(0 < b < 2**32 for b in sizes) for sizes in coded.values()):
            raise ValueError("coded_bytes holds, per C, a non-empty list of payload sizes in bytes (1..2**32-1)")
        coded_accuracy = {int(c): float(a) for c, a in raw.get("coded", {}).items()}
        result = Accuracy(_fraction(raw.get("teacher")), _fraction(raw.get("jpeg")), split, str(path), coded,
                          coded_accuracy)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise InputFileError(f"{path}: not an accuracy file {{'teacher', 'jpeg', 'split': {{C: acc}}}} ({exc})") from None
    if result.teacher is None and not split:
        raise InputFileError(f"{path}: holds neither a 'teacher' nor a 'split' accuracy")
    if any(not 0 <= a <= 1 for a in (*split.values(), *result.coded.values())) or any(c < 1 for c in split):
        raise InputFileError(f"{path}: accuracies are fractions in [0, 1], per channel count C >= 1")
    return result


def _student_accuracy(record: dict) -> dict:
    """A ``split train`` record's accuracies in the accuracy file's keys."""
    evaluation = record["evaluation"]
    student = evaluation["student"]
    jpeg = (evaluation.get("offload") or {}).get("jpeg90")
    c = str(student["bottleneck_shape"][0])
    coded = student.get("coded_payload_bytes")  # version-2 records
    through = student.get("coded_accuracy")  # rate-aware training's records
    return {"teacher": evaluation["teacher_accuracy"], "jpeg": None if jpeg is None else jpeg["accuracy"],
            "split": {c: student["quantized_accuracy"]}, **({"coded_bytes": {c: coded["sample"]}} if coded else {}),
            **({"coded": {c: through}} if through is not None else {})}


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
        option: ``local``, ``offload png``, ``offload jpeg``, ``split C=c`` or ``split C=c coded``
            (entropy-coded payloads, where the accuracy file gives their sizes).
        sent_bytes: request bytes over the link (0 for local; the mean of the coded sizes).
        network_s, network_p95_s: link delay, mean and 95th percentile over the link's samples
            (and, for a coded row, over its payload sizes).
        head_s: device compute seconds (whole model when local), encoding what is sent included.
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


def _row(option: str, nbytes: int | Sequence[int], head_s: float, tail_s: float, link: Link | None,
         device: DeviceProfile, accuracy: float | None) -> PlanRow:
    """One option's row; ``nbytes`` a size or a sample of sizes, each sent over the link (a LoRa
    delay is a step function of the bytes: the delay of the mean size is not the mean delay)."""
    sizes = [nbytes] if isinstance(nbytes, int) else list(nbytes)
    if link is None:  # local: no transfer, no server
        delays, uplink = np.zeros(1), np.zeros(1)
    else:
        delays = np.concatenate([link.delays(b) for b in sizes])
        uplink = np.concatenate([link.uplink(b) for b in sizes])
    network = float(delays.mean())
    transmit = float(uplink.mean())
    e2e = head_s + network + tail_s
    energy = device.energy(head_s, transmit, network - transmit + tail_s)
    return PlanRow(option, round(float(np.mean(sizes))), head_s, network, float(np.percentile(delays, 95)), tail_s,
                   e2e, energy, energy / e2e, accuracy)


@dataclass(frozen=True)
class ServerTimes:
    """The server's seconds per batch-1 inference, and how they were obtained.

    Attributes:
        full_s: the unsplit model (full offload).
        tail_s: per C, the tail (split computing).
        basis: where the numbers come from, in words (printed and recorded in plans).
    """

    full_s: float
    tail_s: dict[int, float]
    basis: str


def server_times(times: HostTimes, device: DeviceProfile, server: ServerProfile) -> ServerTimes:
    """The server's time for the full model and each C's tail under a server profile.

    Times measured on the server when the profile holds them for this model (same architecture,
    resolution, split point, every C); otherwise this host's times, unscaled for ``this-machine``,
    else scaled by the server's reference seconds over this host's.

    Args:
        times: this host's timings (:func:`measure_host_times`, given ``server=`` when the server
            profile's reference model is not the device's).
        device: the device profile (its reference timing serves when both name the same model).
        server: the server profile.

    Returns:
        :class:`ServerTimes`.

    Raises:
        ValueError: the server's reference model was not timed on this host.

    Example:
        >>> server_times(times, PROFILES["jetson-nano"], SERVERS["quadro-p600"]).basis  # on a 2-core VM
        "this machine's times x 0.364 (torchvision:resnet152 224 px: 0.116 s there, 0.318 s here)"
    """
    measured = server.measured
    if measured is not None and measured.covers(times.arch, times.resolution, times.split_point, set(times.tail_s)):
        return ServerTimes(measured.full_s, {c: measured.tail_s[c] for c in times.tail_s}, "measured on the server")
    if server.reference_seconds is None:
        return ServerTimes(times.full_s, dict(times.tail_s), "this machine's times, unscaled")
    if _reference(server) == _reference(device):
        here = times.reference_s
    elif times.server_reference_s is not None:
        here = times.server_reference_s
    else:
        raise ValueError(f"server profile {server.name!r} is scaled by {server.reference_model} at "
                         f"{server.reference_resolution} px, which was not timed here: pass server= to measure_host_times")
    ratio = server.reference_seconds / here
    basis = (f"this machine's times x {ratio:.3g} ({server.reference_model} {server.reference_resolution} px: "
             f"{server.reference_seconds:.3g} s there, {here:.3g} s here)")
    if measured is not None:
        basis += (f"; its measured times are of {measured.arch} {measured.resolution} px {measured.split_point} "
                  f"C={','.join(map(str, sorted(measured.tail_s)))}, not of this plan")
    return ServerTimes(times.full_s * ratio, {c: t * ratio for c, t in times.tail_s.items()}, basis)


def compare_deployments(times: HostTimes, file_bytes: dict[str, float], link: Link, device: DeviceProfile,
         accuracy: Accuracy | None = None, per_sample: bool = True,
         server: ServerProfile = SERVERS[DEFAULT_SERVER]) -> list[PlanRow]:
    """Every option's delay, energy and accuracy for one link, device and server.

    Args:
        times: host timings (:func:`measure_host_times`).
        file_bytes: mean input file sizes (:func:`image_file_bytes`).
        link: the network model.
        device: the device profile.
        accuracy: known accuracies, or None.
        per_sample: payload scale mode (5 bytes more per sample when True).
        server: the server profile (default ``quadro-p600``, the paper's edge server; see :func:`server_times`).

    Returns:
        Rows in the order local, offload png, offload jpeg, split C ascending.

    Example:
        >>> rows = compare_deployments(times, image_file_bytes(96), parse_link("wifi:5"), PROFILES["jetson-nano"])
    """
    slowdown = device.reference_seconds / times.reference_s
    on_server = server_times(times, device, server)
    acc = accuracy or Accuracy(None, None, {}, "none")
    rows = [_row("local", 0, times.full_s * slowdown, 0.0, None, device, acc.teacher)]
    for fmt, known in (("png", acc.teacher), ("jpeg", acc.jpeg)):
        encoding = file_bytes.get(f"{fmt}_encode_s", 0.0) * slowdown  # the device encodes the file it sends
        rows.append(_row(f"offload {fmt}", round(file_bytes[fmt]), encoding, on_server.full_s, link, device, known))
    for c in sorted(times.head_s):
        nbytes = payload_size((1, *times.bottleneck_shapes[c]), per_sample)
        head = (times.head_s[c] + times.payload_encode_s.get(c, 0.0)) * slowdown
        rows.append(_row(f"split C={c}", nbytes, head, on_server.tail_s[c], link, device, acc.split.get(c)))
        if c in acc.coded_bytes and c in times.coded_encode_s:  # at the accuracy through them where known
            head = (times.head_s[c] + times.coded_encode_s[c]) * slowdown
            rows.append(_row(f"split C={c} coded", acc.coded_bytes[c], head, on_server.tail_s[c], link, device,
                             acc.coded.get(c, acc.split.get(c))))
    return rows


def plan_record(rows: list[PlanRow], link: Link, device: DeviceProfile, times: HostTimes,
                accuracy: Accuracy | None, server: ServerProfile = SERVERS[DEFAULT_SERVER]) -> dict:
    """A JSON-ready record of a plan with every assumption it used: the device and server profiles
    (each with its ``source``) and how the server's times were obtained (``server_times_from``)."""
    return {"link": link.name, "device": asdict(device), "server": asdict(server),
            "server_times_from": server_times(times, device, server).basis, "host_times": asdict(times),
            "device_slowdown_vs_host": device.reference_seconds / times.reference_s,
            "accuracy_source": accuracy.source if accuracy else None,
            "rows": [asdict(r) for r in rows],
            "best_delay": min(rows, key=lambda r: r.e2e_s).option,
            "best_energy": min(rows, key=lambda r: r.energy_j).option}
