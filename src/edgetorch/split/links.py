"""Link models for the network delay D_N of BottleFit's D_e2e = D_H + D_N + D_T (Sec. III-D).

Each link turns a request of ``n`` bytes (and a small response) into transfer seconds. Rates are
the user's assumption (the paper measured its WiFi, replayed LTE traces, and used LoRa's nominal
rates); nothing here claims to know a particular network.

* ``wifi:RATE`` / ``lte:RATE``: constant uplink goodput in Mbit/s plus a round-trip time
  (defaults 2 ms for WiFi, 50 ms for LTE: typical values, assumptions). Both are
  ``request * 8 / rate + response * 8 / rate + rtt``.
* ``trace:FILE``: a throughput trace (one Mbit/s value per line, e.g. exported from an LTE
  dataset such as Raca et al. 2018, the paper's [36]); every sample gives one delay, so the plan
  reports the mean and the 95th percentile over the trace.
* ``lora:sf=6,bw=125,cr=1``: LoRa with the Semtech time-on-air formula (AN1200.13), the request
  cut into fragments of at most ``max_payload`` bytes (255, LoRa's PHY limit), each sent as its
  own packet, optionally spaced by a duty-cycle limit. The paper's setting (SF 6, coding rate 4/5)
  is the default; SF 6 requires implicit-header mode, which the formula then uses.

Example:
    >>> parse_link("wifi:20").delays(10_000).round(4).tolist()
    [0.006]
    >>> round(parse_link("lora:sf=6,bw=500").nominal_bps)
    37500
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._files import read_bytes

RESPONSE_BYTES = 4  # the prediction sent back: one class index (the paper's steps 6-7)


@dataclass(frozen=True)
class RateLink:
    """A link with a constant goodput and round-trip time.

    Attributes:
        name: label shown in tables, e.g. ``"wifi 20 Mbit/s"``.
        rate_bps: goodput in bit/s, both directions.
        rtt_s: round-trip time in seconds (added once per request).
    """

    name: str
    rate_bps: float
    rtt_s: float

    def delays(self, request_bytes: int, response_bytes: int = RESPONSE_BYTES) -> np.ndarray:
        """Transfer seconds for one request/response (an array of one value)."""
        return np.array([(request_bytes + response_bytes) * 8 / self.rate_bps + self.rtt_s])

    def uplink(self, request_bytes: int) -> np.ndarray:
        """Seconds the device's radio spends sending the request."""
        return np.array([request_bytes * 8 / self.rate_bps])


@dataclass(frozen=True)
class TraceLink:
    """A link whose goodput follows a trace; one delay per trace sample.

    Attributes:
        name: label.
        rates_bps: goodput samples in bit/s (all > 0).
        rtt_s: round-trip time in seconds.
    """

    name: str
    rates_bps: tuple[float, ...]
    rtt_s: float

    def delays(self, request_bytes: int, response_bytes: int = RESPONSE_BYTES) -> np.ndarray:
        """Transfer seconds for one request/response at every trace sample."""
        return (request_bytes + response_bytes) * 8 / np.asarray(self.rates_bps) + self.rtt_s

    def uplink(self, request_bytes: int) -> np.ndarray:
        """Seconds the device's radio spends sending the request, per trace sample."""
        return request_bytes * 8 / np.asarray(self.rates_bps)


@dataclass(frozen=True)
class LoRaLink:
    """LoRa with the Semtech time-on-air formula and fragmentation.

    Attributes:
        spreading_factor: SF, 6..12 (SF 6 forces implicit header mode).
        bandwidth_hz: 125e3, 250e3 or 500e3.
        coding_rate: 1..4 for 4/5..4/8.
        preamble_symbols: programmed preamble length (8 by default).
        crc: payload CRC on (the uplink default).
        max_payload: bytes per packet (255 = the PHY maximum).
        duty_cycle: fraction of time the radio may transmit (1.0 = no limit; 0.01 for EU 868 MHz
            sub-bands); after each fragment but the last the sender waits ``airtime * (1/dc - 1)``.
        model: ``"airtime"`` (the Semtech formula per fragment, with duty-cycle waits) or
            ``"rate"`` (the paper's delay: bytes x 8 / the nominal bit rate, no packet overhead).
    """

    spreading_factor: int = 6
    bandwidth_hz: float = 125e3
    coding_rate: int = 1
    preamble_symbols: int = 8
    crc: bool = True  # the last input of the Semtech formula; fragmenting's two settings follow
    max_payload: int = 255
    duty_cycle: float = 1.0
    model: str = "airtime"

    def __post_init__(self) -> None:
        if self.model not in ("airtime", "rate"):
            raise ValueError(f"LoRa delay model must be airtime or rate, got {self.model!r}")
        if not 6 <= self.spreading_factor <= 12:
            raise ValueError(f"LoRa spreading factor must be 6..12, got {self.spreading_factor}")
        if self.bandwidth_hz not in (125e3, 250e3, 500e3):
            raise ValueError(f"LoRa bandwidth must be 125, 250 or 500 kHz, got {self.bandwidth_hz / 1e3:g}")
        if not 1 <= self.coding_rate <= 4:
            raise ValueError(f"LoRa coding rate index must be 1..4 (4/5..4/8), got {self.coding_rate}")
        if not 1 <= self.max_payload <= 255 or not 0 < self.duty_cycle <= 1:
            raise ValueError("max_payload must be 1..255 and duty_cycle in (0, 1]")

    @property
    def name(self) -> str:
        rate = ", nominal-rate model" if self.model == "rate" else ""
        return f"LoRa SF{self.spreading_factor} BW{self.bandwidth_hz / 1e3:g} CR4/{4 + self.coding_rate}{rate}"

    @property
    def symbol_s(self) -> float:
        """Symbol time 2^SF / BW."""
        return 2**self.spreading_factor / self.bandwidth_hz

    @property
    def nominal_bps(self) -> float:
        """The nominal bit rate SF * BW / 2^SF * 4 / (4 + CR) the paper used for its delays."""
        return self.spreading_factor * self.bandwidth_hz / 2**self.spreading_factor * 4 / (4 + self.coding_rate)

    def airtime(self, payload_bytes: int) -> float:
        """Time on air of one packet (Semtech AN1200.13, eq. for T_packet).

        T_preamble = (n_preamble + 4.25) T_sym;
        n_payload = 8 + max(ceil((8 PL - 4 SF + 28 + 16 CRC - 20 IH) / (4 (SF - 2 DE))) (CR + 4), 0);
        IH = 1 for SF 6 (implicit header), DE = 1 when T_sym > 16 ms (low data-rate optimisation).
        """
        if not 0 <= payload_bytes <= self.max_payload:
            raise ValueError(f"one LoRa packet carries 0..{self.max_payload} bytes, got {payload_bytes}")
        sf = self.spreading_factor
        implicit = 1 if sf == 6 else 0
        low_rate = 1 if self.symbol_s > 0.016 else 0
        numerator = 8 * payload_bytes - 4 * sf + 28 + 16 * int(self.crc) - 20 * implicit
        symbols = 8 + max(math.ceil(numerator / (4 * (sf - 2 * low_rate))) * (self.coding_rate + 4), 0)
        return (self.preamble_symbols + 4.25) * self.symbol_s + symbols * self.symbol_s

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to send ``nbytes`` as full fragments plus one remainder, with duty-cycle waits
        (or, with ``model="rate"``, the paper's ``nbytes * 8 / nominal_bps``)."""
        if self.model == "rate":
            return nbytes * 8 / self.nominal_bps
        full, rest = divmod(nbytes, self.max_payload)
        airtimes = [self.airtime(self.max_payload)] * full + ([self.airtime(rest)] if rest else [])
        on_air = sum(airtimes)
        waits = sum(airtimes[:-1]) * (1 / self.duty_cycle - 1)
        return on_air + waits

    def fragments(self, nbytes: int) -> int:
        """Packets needed for ``nbytes``."""
        return max(1, math.ceil(nbytes / self.max_payload))

    def delays(self, request_bytes: int, response_bytes: int = RESPONSE_BYTES) -> np.ndarray:
        """Uplink fragments plus one downlink packet with the prediction."""
        return np.array([self.transfer_s(request_bytes) + self.transfer_s(response_bytes)])

    def uplink(self, request_bytes: int) -> np.ndarray:
        """Seconds the device's radio is on air for the request (duty-cycle waits excluded)."""
        if self.model == "rate":
            return np.array([self.transfer_s(request_bytes)])
        full, rest = divmod(request_bytes, self.max_payload)
        return np.array([full * self.airtime(self.max_payload) + (self.airtime(rest) if rest else 0.0)])


Link = RateLink | TraceLink | LoRaLink
_DEFAULT_RTT_S = {"wifi": 0.002, "lte": 0.050}
_MAX_TRACE_BYTES = 16 << 20  # a bandwidth trace: one number per line, a day of seconds is ~1 MB


def _options(text: str) -> dict[str, str]:
    pairs = [p for p in text.split(",") if p]
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise ValueError(f"link options are key=value, got {bad}")
    return dict(p.split("=", 1) for p in pairs)


def parse_link(spec: str) -> Link:
    """Build a link from a spec string.

    Args:
        spec: ``wifi:MBPS[,rtt_ms=MS]``, ``lte:MBPS[,rtt_ms=MS]``, ``trace:FILE[,rtt_ms=MS]`` (one
            Mbit/s per line), or ``lora[:sf=6,bw=125,cr=1,duty=1.0,max_payload=255,model=airtime|rate]``
            (bw in kHz; ``model=rate`` is the paper's bytes x 8 / nominal rate).

    Returns:
        A :class:`RateLink`, :class:`TraceLink` or :class:`LoRaLink`.

    Raises:
        ValueError: an unknown kind or a malformed value; the message lists the accepted forms.
    """
    kind, _, rest = spec.partition(":")
    kind = kind.strip().lower()
    try:
        if kind in ("wifi", "lte"):
            rate, _, more = rest.partition(",")
            options = _options(more)
            rtt = float(options.pop("rtt_ms", _DEFAULT_RTT_S[kind] * 1e3)) / 1e3
            if options or float(rate) <= 0 or rtt < 0:
                raise ValueError(f"unknown options {sorted(options)} or a non-positive rate")
            return RateLink(f"{kind} {float(rate):g} Mbit/s", float(rate) * 1e6, rtt)
        if kind == "trace":
            path, _, more = rest.partition(",")
            options = _options(more)
            rtt = float(options.pop("rtt_ms", _DEFAULT_RTT_S["lte"] * 1e3)) / 1e3
            text = read_bytes(path, _MAX_TRACE_BYTES).decode("utf-8", "replace")
            rates = [float(line) for line in text.split() if line]
            if options or not rates or not all(math.isfinite(r) and r > 0 for r in rates):
                raise ValueError("a trace needs one positive, finite Mbit/s value per line")
            return TraceLink(f"trace {Path(path).name}", tuple(r * 1e6 for r in rates), rtt)
        if kind == "lora":
            options = _options(rest)
            link = LoRaLink(spreading_factor=int(options.pop("sf", 6)),
                            bandwidth_hz=float(options.pop("bw", 125)) * 1e3,
                            coding_rate=int(options.pop("cr", 1)),
                            duty_cycle=float(options.pop("duty", 1.0)),
                            max_payload=int(options.pop("max_payload", 255)),
                            model=options.pop("model", "airtime"))
            if options:
                raise ValueError(f"unknown LoRa options {sorted(options)}")
            return link
    except (ValueError, OSError) as exc:
        raise ValueError(f"bad link spec {spec!r}: {exc}") from None
    raise ValueError(f"unknown link kind {kind!r} in {spec!r}; accepted: wifi:MBPS, lte:MBPS, "
                     "trace:FILE, lora:sf=..,bw=..,cr=..")
