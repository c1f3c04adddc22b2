"""Device profiles: how fast a device computes and what power it draws, as replaceable assumptions.

BottleFit measures P_md = P_H + P_N on a Jetson Nano and a Raspberry Pi 4 (Sec. V). edgetorch has
neither board, so a :class:`DeviceProfile` states its assumptions explicitly:

* speed: the device's measured seconds for a *reference model* (the paper's own local-processing
  delay of ResNet-152 at 224 px: 0.53 s on the Jetson Nano, Fig. 9 caption; 4.29 s on the Raspberry
  Pi 4, Fig. 12 caption). The planner times the same reference model on the host and scales every
  host-measured head/local time by ``device_seconds / host_seconds``: an assumption that the
  device is uniformly slower, which is only roughly true (GPU vs CPU, model-dependent);
* power: watts while computing, while the radio transmits, and while idle-waiting for the server.
  Jetson: 4.3 W average for local DNN inference and 1.6 W average when offloading (paper Fig. 10);
  idle 1.25 W (a commonly quoted Jetson Nano idle draw, assumption). Raspberry Pi 4: 6.4 W under
  full CPU load and 2.7 W idle (commonly quoted board measurements, assumption), + 0.5 W for WiFi
  transmission, + 0.4 W for a LoRa radio transmitting at 20 dBm (SX127x datasheet: ~120 mA at 3.3 V).

Energy per inference is ``P_compute * D_H + P_transmit * D_tx + P_idle * D_wait``, and the mean
power is that energy over D_e2e. Replace any number with :func:`load_profile` on a JSON file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path


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


_PAPER = "BottleFit (Matsubara et al. 2022) Figs. 9, 10, 12"
PROFILES: dict[str, DeviceProfile] = {
    "jetson-nano": DeviceProfile(
        "jetson-nano", "torchvision:resnet152", 224, 0.53, 4.3, 1.6, 1.25,
        f"ASSUMPTION: speed and compute/offload power from {_PAPER}; idle 1.25 W typical"),
    "raspberry-pi-4": DeviceProfile(
        "raspberry-pi-4", "torchvision:resnet152", 224, 4.29, 6.4, 3.2, 2.7,
        f"ASSUMPTION: speed from {_PAPER}; power: 6.4 W loaded, 2.7 W idle, +0.5 W WiFi tx (typical)"),
    "raspberry-pi-4-lora": DeviceProfile(
        "raspberry-pi-4-lora", "torchvision:resnet152", 224, 4.29, 6.4, 3.1, 2.7,
        f"ASSUMPTION: speed from {_PAPER}; power: 6.4 W loaded, 2.7 W idle, +0.4 W LoRa tx at 20 dBm"),
}


def load_profile(name_or_path: str) -> DeviceProfile:
    """A built-in profile by name, or one read from a JSON file with :class:`DeviceProfile`'s fields.

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
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.suffix == ".json":
        raise ValueError(f"unknown device {name_or_path!r}; accepted: {', '.join(PROFILES)} or a .json file")
    try:
        raw = json.loads(path.read_text())
        expected = {f.name for f in fields(DeviceProfile)}
        if not isinstance(raw, dict) or set(raw) != expected:
            raise ValueError(f"a profile JSON has exactly the keys {sorted(expected)}")
        return DeviceProfile(**raw)
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a valid device profile ({exc})") from None


def profile_json(profile: DeviceProfile) -> str:
    """A profile as JSON, the starting point for a user's own file."""
    return json.dumps(asdict(profile), indent=2) + "\n"
