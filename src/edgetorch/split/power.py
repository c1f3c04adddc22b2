"""Device and server profiles: how fast each side computes and what power the device draws, as
replaceable assumptions.

Both sides state their speed as seconds for a *reference model* on that machine (ResNet-152 at
224 px, batch 1, for every built-in). The planner times the same reference model on the host and
scales host-measured times by ``profile seconds / host seconds``: an assumption that a machine is
uniformly faster or slower, which is only roughly true (GPU vs CPU, model-dependent).

Device (BottleFit measures P_md = P_H + P_N on a Jetson Nano and a Raspberry Pi 4, Sec. V;
edgetorch has neither board, so a :class:`DeviceProfile` states its numbers):

* speed: the paper's own local-processing delay of ResNet-152: 0.53 s on the Jetson Nano (Fig. 9
  caption), 4.29 s on the Raspberry Pi 4 (Fig. 12 caption);
* power: watts while computing, while the radio transmits, and while idle-waiting for the server.
  Jetson: 4.3 W average for local DNN inference and 1.6 W average when offloading (paper Fig. 10);
  idle 1.25 W (a commonly quoted Jetson Nano idle draw, assumption). Raspberry Pi 4: 6.4 W under
  full CPU load and 2.7 W idle (commonly quoted board measurements, assumption), + 0.5 W for WiFi
  transmission, + 0.4 W for a LoRa radio transmitting at 20 dBm (SX127x datasheet: ~120 mA at 3.3 V).

Energy per inference is ``P_compute * D_H + P_transmit * D_tx + P_idle * D_wait``, and the mean
power is that energy over D_e2e.

Server (a :class:`ServerProfile`): the paper's edge server is a ThinkPad P72 laptop with an NVIDIA
Quadro P600 GPU (Sec. V-A), but the paper reports no server timing. The built-in ``quadro-p600``
(the planner's default) therefore scales the Jetson Nano's 0.53 s by the two GPUs' peak FP32
throughput, computed from the paper's own description of them: 384 CUDA cores at 1.45 GHz
(P600) against 128 at 0.95 GHz (Jetson Nano), one fused multiply-add per core and cycle on both
(Pascal, Maxwell), a ratio of 4.58 and so 0.116 s. That is an ASSUMPTION: it credits the P600
with the same fraction of its peak as the Jetson reaches, while its memory bandwidth grows less
than its compute. ``this-machine`` keeps the server on the machine running the plan (its times,
unscaled), and ``edgetorch split measure-server`` (:func:`edgetorch.split.plan.measure_server`)
writes a profile measured on the real server.

Replace any number with :func:`load_profile` / :func:`load_server` on a JSON file
(:func:`profile_json` writes one from a profile).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import TypeVar

from .._checks import check_json_fields
from .._files import InputFileError, read_json


@dataclass(frozen=True)
class DeviceProfile:
    """One device's speed and power assumptions.

    Attributes:
        name: label.
        reference_model: model spec timed on host and device (``torchvision:NAME``).
        reference_resolution: its input height = width.
        reference_seconds: the device's seconds for one reference inference (batch 1).
        compute_watts: board power while running a model.
        transmit_watts: board power while the radio sends.
        idle_watts: board power while waiting for the server.
        source: where the numbers come from (shown in plans).
    """

    name: str
    reference_model: str
    reference_resolution: int
    reference_seconds: float
    compute_watts: float
    transmit_watts: float
    idle_watts: float
    source: str

    def __post_init__(self) -> None:
        for f in ("reference_seconds", "compute_watts", "transmit_watts", "idle_watts"):
            if not getattr(self, f) > 0:
                raise ValueError(f"device profile {self.name!r}: {f} must be > 0, got {getattr(self, f)!r}")

    def energy(self, head_s: float, transmit_s: float, wait_s: float) -> float:
        """Joules on the device for one inference (compute, transmit, idle wait)."""
        return self.compute_watts * head_s + self.transmit_watts * transmit_s + self.idle_watts * wait_s


@dataclass(frozen=True)
class MeasuredTimes:
    """One model's batch-1 seconds measured on the server itself.

    Attributes:
        arch: model spec (``torchvision:NAME``).
        resolution: input height = width.
        split_point: ``"sp1"`` or ``"sp2"``.
        full_s: the unsplit model (what full offload runs).
        tail_s: per bottleneck channel count C, the tail (what split computing runs); JSON's
            string keys are read as integers.
    """

    arch: str
    resolution: int
    split_point: str
    full_s: float
    tail_s: dict[int, float]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tail_s", {int(c): float(s) for c, s in dict(self.tail_s).items()})
        if not (self.full_s > 0 and self.tail_s and all(s > 0 for s in self.tail_s.values())):
            raise ValueError(f"measured times need full_s > 0 and tail_s {{C: seconds > 0}}, got {self.full_s!r}, "
                             f"{self.tail_s!r}")

    def covers(self, arch: str, resolution: int, split_point: str, channels: set[int]) -> bool:
        """Whether these times are of that model and hold every C asked for."""
        return (self.arch, self.resolution, self.split_point) == (arch, resolution, split_point) and channels <= set(self.tail_s)


@dataclass(frozen=True)
class ServerProfile:
    """The edge server's speed: a reference model's seconds there, and optionally a model's own times.

    Attributes:
        name: label.
        reference_model: model spec timed on host and server; None with the next two for
            ``this-machine`` (the host's own times, unscaled).
        reference_resolution: its input height = width.
        reference_seconds: the server's seconds for one reference inference (batch 1).
        source: where the numbers come from (shown in plans and recorded in their JSON).
        measured: times measured on the server (``split measure-server``), used instead of scaling
            when the plan is of the same model.

    Example:
        >>> round(load_server("quadro-p600").reference_seconds, 3)
        0.116
    """

    name: str
    reference_model: str | None
    reference_resolution: int | None
    reference_seconds: float | None
    source: str
    measured: MeasuredTimes | None = None

    def __post_init__(self) -> None:
        reference = (self.reference_model, self.reference_resolution, self.reference_seconds)
        if (None in reference) != (reference == (None, None, None)):
            raise ValueError(f"server profile {self.name!r}: give reference_model, reference_resolution and "
                             "reference_seconds together, or none of them (this machine)")
        if self.reference_seconds is not None and not self.reference_seconds > 0:
            raise ValueError(f"server profile {self.name!r}: reference_seconds must be > 0, got {self.reference_seconds!r}")
        keys = [f.name for f in fields(MeasuredTimes)]
        if isinstance(self.measured, dict) and set(self.measured) == set(keys):  # the JSON form
            object.__setattr__(self, "measured", MeasuredTimes(**self.measured))
        if not isinstance(self.measured, (MeasuredTimes, type(None))):
            raise ValueError(f"server profile {self.name!r}: measured must be null or an object with exactly the "
                             f"keys {keys}, got {self.measured!r}")


REFERENCE_MODEL, REFERENCE_RESOLUTION = "torchvision:resnet152", 224
_PAPER = "BottleFit (Matsubara et al. 2022) Figs. 9, 10, 12"
PROFILES: dict[str, DeviceProfile] = {
    "jetson-nano": DeviceProfile(
        "jetson-nano", REFERENCE_MODEL, REFERENCE_RESOLUTION, 0.53, 4.3, 1.6, 1.25,
        f"ASSUMPTION: speed and compute/offload power from {_PAPER}; idle 1.25 W typical"),
    "raspberry-pi-4": DeviceProfile(
        "raspberry-pi-4", REFERENCE_MODEL, REFERENCE_RESOLUTION, 4.29, 6.4, 3.2, 2.7,
        f"ASSUMPTION: speed from {_PAPER}; power: 6.4 W loaded, 2.7 W idle, +0.5 W WiFi tx (typical)"),
    "raspberry-pi-4-lora": DeviceProfile(
        "raspberry-pi-4-lora", REFERENCE_MODEL, REFERENCE_RESOLUTION, 4.29, 6.4, 3.1, 2.7,
        f"ASSUMPTION: speed from {_PAPER}; power: 6.4 W loaded, 2.7 W idle, +0.4 W LoRa tx at 20 dBm"),
}
# Peak FP32 = cores x clock x 2 on both GPUs; the paper gives cores and clocks (Sec. V-A).
_P600_VS_NANO = (384 * 1.45) / (128 * 0.95)
SERVERS: dict[str, ServerProfile] = {
    "quadro-p600": ServerProfile(
        "quadro-p600", REFERENCE_MODEL, REFERENCE_RESOLUTION, 0.53 / _P600_VS_NANO,
        "ASSUMPTION: the paper's edge server (ThinkPad P72, Quadro P600; no server timing published): "
        f"the Jetson Nano's 0.53 s / {_P600_VS_NANO:.2f}, the GPUs' peak FP32 ratio (384 cores at 1.45 GHz "
        "vs 128 at 0.95 GHz, Sec. V-A)"),
    "this-machine": ServerProfile(
        "this-machine", None, None, None, "the machine running the plan: its own times, unscaled"),
}
DEFAULT_SERVER = "quadro-p600"

_Profile = TypeVar("_Profile", DeviceProfile, ServerProfile)


def load_profile(name_or_path: str) -> DeviceProfile:
    """A built-in device profile by name, or one read from a JSON file with :class:`DeviceProfile`'s fields.

    Args:
        name_or_path: ``jetson-nano``, ``raspberry-pi-4``, ``raspberry-pi-4-lora``, or a ``.json`` path.

    Returns:
        The profile.

    Raises:
        ValueError: unknown name, unreadable file, or missing/invalid fields.

    Example:
        >>> load_profile("jetson-nano").compute_watts
        4.3
    """
    return _load(name_or_path, PROFILES, DeviceProfile, "device")


def load_server(name_or_path: str) -> ServerProfile:
    """A built-in server profile by name, or one read from a JSON file (``split measure-server`` writes one).

    Args:
        name_or_path: ``quadro-p600`` (the default: the paper's edge server, speed assumed),
            ``this-machine``, or a ``.json`` path with :class:`ServerProfile`'s fields.

    Returns:
        The profile.

    Raises:
        ValueError: unknown name, unreadable file, or missing/invalid fields.

    Example:
        >>> load_server("this-machine").reference_seconds is None
        True
    """
    return _load(name_or_path, SERVERS, ServerProfile, "server")


def _load(name_or_path: str, builtins: dict[str, _Profile], cls: type[_Profile], what: str) -> _Profile:
    """One loader for both kinds of profile, so their files and error messages cannot drift apart."""
    if name_or_path in builtins:
        return builtins[name_or_path]
    accepted = f"accepted: {', '.join(builtins)} or a .json file"
    path = Path(name_or_path)
    if path.suffix != ".json":
        raise ValueError(f"unknown {what} {name_or_path!r}; {accepted}")
    required = sorted(f.name for f in fields(cls) if f.default is MISSING)
    optional = sorted(f.name for f in fields(cls) if f.default is not MISSING)
    keys = f"the keys {required}" + (f" (and optionally {optional})" if optional else "")
    try:
        raw = read_json(path)
        if not isinstance(raw, dict) or not set(required) <= set(raw) <= set(required + optional):
            raise ValueError(f"a {what} profile JSON has exactly {keys}")
        check_json_fields(cls, raw, f"{what} profile")
        return cls(**raw)
    except (TypeError, ValueError) as exc:
        raise InputFileError(f"{path}: not a valid {what} profile ({exc}); {accepted}") from None


def profile_json(profile: DeviceProfile | ServerProfile) -> str:
    """A profile as JSON: the starting point for a user's own file, or a measured server's."""
    return json.dumps(asdict(profile), indent=2) + "\n"
