"""Entropy coding of the 8-bit bottleneck codes (payload format version 2; issue 27).

Version 1 sends each 8-bit code as one byte. The codes of a trained bottleneck are far from
uniform (ReLU zeros map to one code; most of a channel's values sit in a few codes), so an entropy
coder with a probability table per channel sends the same codes in fewer bytes. Version 2 keeps
version 1's quantisation unchanged (the decoded tensor is bit for bit what version 1 decodes, so
accuracy cannot move) and replaces the raw code bytes by an rANS stream.

The coder is ``constriction``'s ``AnsCoder`` (Bamler 2022, "Understanding entropy coding with
asymmetric numeral systems (ANS): a statistician's perspective"), chosen over CompressAI's
``EntropyBottleneck`` coder because a device needs only the coder: constriction is a compiled
Rust extension with numpy as its one dependency (a 0.4 MB wheel), while CompressAI brings scipy,
matplotlib and its training code. Its ``Categorical`` model turns a table into fixed-point
probabilities deterministically and gives every symbol at least the smallest representable
probability, so a code never seen when the table was fitted still encodes (at up to 24 bits).

The tables (:class:`CodeTables`) are data: one row of 256 code counts per channel, fitted on a
representative batch of codes (:func:`fit_code_tables`) and stored in a split artifact as a
safetensors tensor. A payload names the tables it was coded with by a 4-byte digest of their
counts, so a payload coded with other tables is refused instead of decoded into a wrong tensor.

Wire format, version 2: version 1's header (magic, version = 2, mode, value dtype, restored dtype,
ndim, CRC-32, shape, per-group scale and zero point), then::

    size       field
    1          coding: 1 = rANS over 32-bit words, one table per channel (dim 1)
    4          table digest: the first 4 bytes of SHA-256 over the tables' counts (little-endian uint64)
    4 * W      W >= 0 words, uint32 little-endian: the rANS stream of the codes, channel by channel
               (dim 1), each channel's codes in C order over the other dims

The CRC covers the extension and the words too.

Version 3 (issue 27's rate-trained students) also moves the quantiser into the tables: a fixed
scale and zero point per channel (:class:`FixedSteps`, fitted once on training bottlenecks and
trained against in stage 2 with a rate term, :mod:`.rate`), so a payload carries no per-sample
scale, and the sample shape, so it carries no shape either. Its wire format is in
:mod:`.payload`: 16 bytes of header, then the words.
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .payload import PayloadError

CODING_ANS = 1
CODES = 256  # 8-bit codes
DIGEST_BYTES = 4
#: counts are stored as int64 and handed to the coder as float64: above 2**53 they would round
MAX_COUNT = 2**53
#: the most channels a table set may hold (a bottleneck's dim 1 is at most a few hundred)
MAX_CHANNELS = 4096
_TENSOR_NAME = "code_counts"
_STEP_NAMES = ("scale", "zero_point", "sample_shape")
#: the most elements one sample of a version-3 bottleneck may have (its shape is stored in the tables)
MAX_SAMPLE_NUMEL = 2**20


@dataclass(frozen=True, eq=False)  # arrays: compare to_bytes() where equality is wanted
class FixedSteps:
    """A fixed 8-bit affine quantiser per channel: ``q = clamp(round(x / scale_c) + zero_point_c, 0, 255)``.

    Payload version 3 quantises with it (no per-sample scale travels); :mod:`.rate` trains a student
    against it. Within the range of codes 0..255 the error is at most ``scale_c / 2``; values beyond
    it are clamped to its nearest end. (Fitted with fewer than 256 levels, the codes above the last
    level still carry values beyond the fitted range, up to 255 steps from the zero point.)

    Attributes:
        scale: float32 [C], finite and > 0.
        zero_point: uint8 [C].
        sample_shape: one sample's shape ``(C, ...)``: a version-3 payload's shape is ``(N, *sample_shape)``.
    """

    scale: np.ndarray
    zero_point: np.ndarray
    sample_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        from .payload import MAX_NDIM, _check_range

        scale, zero = np.asarray(self.scale), np.asarray(self.zero_point)
        try:  # operator.index: ints and numpy integers, not 2.5, "3" or True
            shape = tuple(operator.index(d) for d in self.sample_shape if not isinstance(d, bool))
        except TypeError:
            shape = ()
        if not (len(shape) == len(tuple(self.sample_shape)) and 1 <= len(shape) < MAX_NDIM
                and all(d >= 1 for d in shape) and math.prod(shape) <= MAX_SAMPLE_NUMEL):
            raise PayloadError(f"a sample shape is 1..{MAX_NDIM - 1} positive dims with at most {MAX_SAMPLE_NUMEL} "
                               f"elements, got {shape}")
        if scale.shape != (shape[0],) or zero.shape != (shape[0],):
            raise PayloadError(f"fixed steps hold one scale and zero point per channel ({shape[0]}), got "
                               f"{scale.shape} and {zero.shape}")
        if scale.dtype != np.float32 or zero.dtype != np.uint8:
            raise PayloadError(f"scale is float32 and zero_point uint8, got {scale.dtype} and {zero.dtype}")
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            raise PayloadError("every scale must be finite and > 0")
        _check_range(scale, zero, torch.float32)
        for name, value in (("scale", scale), ("zero_point", zero)):
            value = value.copy()
            value.flags.writeable = False
            object.__setattr__(self, name, value)
        object.__setattr__(self, "sample_shape", shape)
        object.__setattr__(self, "_ranges", {torch.float32: None})  # dtype -> why not representable (None: it is)
        object.__setattr__(self, "_broadcast", {})  # device -> broadcast()

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise :class:`PayloadError` if values of these steps overflow ``dtype`` (checked once per dtype:
        every payload asks, and the check costs more than a tenth of an image's coding)."""
        from .payload import _check_range

        if dtype not in self._ranges:
            try:
                _check_range(self.scale, self.zero_point, dtype)
                self._ranges[dtype] = None
            except PayloadError as exc:
                self._ranges[dtype] = str(exc)
        if self._ranges[dtype] is not None:
            raise PayloadError(self._ranges[dtype])

    @classmethod
    def fit(cls, bottlenecks: torch.Tensor, levels: int = CODES) -> FixedSteps:
        """Each channel's range over ``bottlenecks`` (widened to contain 0) in ``levels - 1`` steps.

        Args:
            bottlenecks: finite floating ``[N, C, ...]``, representative (the training images').
            levels: codes spanning the fitted range, 2..256: 256 steps as finely as 8 bits do; fewer,
                coarser steps (values beyond the range still take the codes above, up to 255).

        Example:
            >>> FixedSteps.fit(torch.rand(8, 3, 4, 4), levels=32).sample_shape
            (3, 4, 4)
        """
        from .payload import quantize

        if not isinstance(bottlenecks, torch.Tensor) or bottlenecks.dim() < 2:
            raise PayloadError("fixed steps are fitted on a floating tensor [N, C, ...]")
        if isinstance(levels, bool) or not isinstance(levels, int) or not 2 <= levels <= CODES:
            raise PayloadError(f"levels must be an int in 2..{CODES}, got {levels!r}")
        channels = bottlenecks.shape[1]
        # quantize's per-group range in 255 steps, one group per channel; then (levels - 1) steps over it
        _, scale, zero = quantize(bottlenecks.detach().transpose(0, 1).reshape(channels, -1), per_sample=True)
        widen = (CODES - 1) / (levels - 1)
        scale = scale.double() * widen
        zero = torch.round(zero.double() / widen).to(torch.uint8)
        return cls(scale.to(torch.float32).numpy(), zero.numpy(), tuple(int(d) for d in bottlenecks.shape[1:]))

    def broadcast(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)`` as float64 ``[1, C, 1, ...]`` on ``device``, to broadcast over
        ``[N, *sample_shape]``. Made once per device (each payload and training step uses them; on a
        GPU a copy from host memory would wait for the queue). Do not modify them."""
        key = torch.device(device)
        if key not in self._broadcast:
            shape = (1, -1) + (1,) * (len(self.sample_shape) - 1)
            self._broadcast[key] = (torch.tensor(self.scale, device=key, dtype=torch.float64).view(shape),
                                    torch.tensor(self.zero_point, device=key, dtype=torch.float64).view(shape))
        return self._broadcast[key]

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 codes (on the CPU) of ``x`` ``[N, *sample_shape]``, clamped to 0..255."""
        if tuple(x.shape[1:]) != self.sample_shape:
            raise PayloadError(f"these fixed steps quantise samples of shape {self.sample_shape}, got a tensor of "
                               f"shape {tuple(x.shape)}")
        scale, zero = self.broadcast()
        # float64 on the CPU (as version 1 quantises): every device, MPS too, gives the same codes,
        # and rate.RateTerm rounds with the same formula
        return torch.round(x.detach().to("cpu", torch.float64) / scale + zero).clamp(0, CODES - 1).to(torch.uint8)

    def dequantize(self, q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``scale_c * (q - zero_point_c)`` in float32 (as version 1 dequantises), as ``dtype``."""
        scale, zero = self.broadcast(q.device)
        return ((q.to(torch.float32) - zero.float()) * scale.float()).to(dtype)

    @classmethod
    def from_json(cls, data: object) -> FixedSteps:
        """Inverse of :meth:`to_json`; refuses anything else with :class:`PayloadError`."""
        if not isinstance(data, dict) or set(data) != {"scale", "zero_point", "sample_shape"}:
            raise PayloadError("fixed steps are {'scale': [...], 'zero_point': [...], 'sample_shape': [...]}")
        try:
            zero = np.asarray(data["zero_point"])
            if zero.dtype.kind not in "iu" or zero.size and not (zero.min() >= 0 and zero.max() < CODES):
                raise ValueError(f"zero points are integers in 0..{CODES - 1}")
            return cls(np.asarray(data["scale"], dtype=np.float32), zero.astype(np.uint8), tuple(data["sample_shape"]))
        except (TypeError, ValueError) as exc:
            raise PayloadError(f"fixed steps: {exc}") from None

    def to_json(self) -> dict:
        """The steps as plain JSON data (a rate-aware stage's fixed_steps.json and checkpoint identity)."""
        return {"scale": [float(v) for v in self.scale], "zero_point": [int(v) for v in self.zero_point],
                "sample_shape": list(self.sample_shape)}

    def to_bytes(self) -> bytes:
        """What the tables' digest covers besides the counts."""
        return (self.scale.astype("<f4").tobytes() + self.zero_point.tobytes()
                + np.asarray(self.sample_shape, dtype="<u4").tobytes())


class CodeTables:
    """One probability table of the 256 8-bit codes per bottleneck channel, as counts.

    Args:
        counts: int64 array or tensor [C, 256], each row how often each code occurred in channel c
            of the fitting data (zeros allowed: the coder still gives those codes a tiny
            probability); 1 <= C <= 4096, every count in 0..2**53.

    Raises:
        PayloadError: the counts are not an integer [C, 256] array in those bounds.

    Example:
        >>> tables = fit_code_tables(torch.zeros(4, 3, 8, 8, dtype=torch.uint8))
        >>> tables.channels, len(tables.digest)
        (3, 4)
    """

    def __init__(self, counts: np.ndarray | torch.Tensor, steps: FixedSteps | None = None) -> None:
        if isinstance(counts, torch.Tensor):
            counts = counts.detach().cpu().numpy()
        counts = np.asarray(counts)
        if counts.ndim != 2 or counts.shape[1] != CODES or not 1 <= counts.shape[0] <= MAX_CHANNELS:
            raise PayloadError(f"code tables are a [channels, {CODES}] array with 1..{MAX_CHANNELS} channels, "
                               f"got shape {tuple(counts.shape)}")
        if counts.dtype.kind not in "iu":
            raise PayloadError(f"code tables hold integer counts, got dtype {counts.dtype}")
        if counts.size and (counts.min() < 0 or counts.max() > MAX_COUNT):
            raise PayloadError(f"every code count must be in 0..2**53, got {counts.min()}..{counts.max()}")
        self.counts = counts.astype("<i8")
        self.counts.flags.writeable = False
        if steps is not None and steps.sample_shape[0] != self.channels:
            raise PayloadError(f"the fixed steps cover {steps.sample_shape[0]} channels, the counts {self.channels}")
        self.steps = steps

    @property
    def channels(self) -> int:
        """How many channels (dim 1 of a coded tensor) the tables cover."""
        return self.counts.shape[0]

    @functools.cached_property
    def digest(self) -> bytes:
        """The 4 bytes a payload carries to name these tables (SHA-256 of the counts)."""
        steps = b"" if self.steps is None else self.steps.to_bytes()
        return hashlib.sha256(self.counts.astype("<u8").tobytes() + steps).digest()[:DIGEST_BYTES]

    @functools.cached_property
    def _models(self) -> list:
        import constriction  # its submodules are attributes of the compiled module, not importable paths

        Categorical = constriction.stream.model.Categorical
        # An all-zero row is a channel never seen: uniform. perfect=False: the coder's recommended
        # quantisation (fast to build); encoder and decoder must agree on it, and both are this code.
        return [Categorical(row.astype(np.float64) if row.any() else np.ones(CODES), perfect=False)
                for row in self.counts]

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tables as safetensors can store them: ``{"code_counts": int64 [C, 256]}``, and with
        fixed steps also ``scale`` (float32 [C]), ``zero_point`` (uint8 [C]), ``sample_shape`` (int64)."""
        tensors = {_TENSOR_NAME: torch.from_numpy(self.counts.astype(np.int64))}
        if self.steps is not None:
            tensors.update(scale=torch.from_numpy(self.steps.scale.copy()),
                           zero_point=torch.from_numpy(self.steps.zero_point.copy()),
                           sample_shape=torch.tensor(self.steps.sample_shape, dtype=torch.int64))
        return tensors

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> CodeTables:
        """Inverse of :meth:`to_tensors`; refuses anything else with :class:`PayloadError`."""
        if set(tensors) not in ({_TENSOR_NAME}, {_TENSOR_NAME, *_STEP_NAMES}):
            raise PayloadError(f"code tables are a tensor named {_TENSOR_NAME!r}, with fixed steps also "
                               f"{', '.join(map(repr, _STEP_NAMES))}; got {sorted(tensors)}")
        wanted = {_TENSOR_NAME: torch.int64, "scale": torch.float32, "zero_point": torch.uint8,
                  "sample_shape": torch.int64}
        for name, tensor in tensors.items():
            if tensor.dtype != wanted[name] or tensor.dim() != (2 if name == _TENSOR_NAME else 1):
                raise PayloadError(f"{name} must be {'2-D' if name == _TENSOR_NAME else '1-D'} "
                                   f"{str(wanted[name]).removeprefix('torch.')}, got {tensor.dtype} {list(tensor.shape)}")
        steps = None
        if "scale" in tensors:
            shape = tensors["sample_shape"]
            if shape.numel() > 8:  # checked before tolist(): FixedSteps checks the rest
                raise PayloadError(f"sample_shape must have 1..7 dims, got {shape.numel()}")
            steps = FixedSteps(tensors["scale"].numpy(), tensors["zero_point"].numpy(), tuple(shape.tolist()))
        return cls(tensors[_TENSOR_NAME], steps)


#: the largest code tables file: int64 counts, a float32 scale and a uint8 zero point for MAX_CHANNELS
#: channels, a sample shape and a safetensors header
MAX_TABLES_FILE_BYTES = MAX_CHANNELS * (CODES * 8 + 5) + 4096


def save_code_tables(tables: CodeTables, path: str | Path) -> str:
    """Write ``tables`` as safetensors, atomically (a temporary file, then rename).

    Returns:
        The written file's SHA-256 (hex), for the record that names it.
    """
    from safetensors.torch import save as serialize

    from .._files import write_bytes_atomically

    data = serialize(tables.to_tensors())
    write_bytes_atomically(path, data)
    return hashlib.sha256(data).hexdigest()


def load_code_tables_file(path: str | Path, sha256: str) -> CodeTables:
    """Read tables :func:`save_code_tables` wrote, refusing a file whose SHA-256 is not ``sha256``.

    Raises:
        CheckpointError: a missing, oversized, altered or malformed file (what it is and why).
    """
    from .._files import read_bytes
    from ..weights import CheckpointError

    data = read_bytes(path, MAX_TABLES_FILE_BYTES, error=CheckpointError)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{path} differs from the one its record names (SHA-256 mismatch)")
    return tables_from_bytes(data, path, CheckpointError)


def tables_from_bytes(data: bytes, path: str | Path, error: type[Exception]) -> CodeTables:
    """Parse a code tables file's bytes (already bounded and hash-checked by the caller).

    Raises:
        error: not safetensors, or not an int64 ``[C, 256]`` tensor of counts in range (with valid
            fixed steps, if any) (the message names ``path`` and what was wrong).
    """
    from ..weights import CheckpointError, tensors_from_bytes

    try:
        return CodeTables.from_tensors(tensors_from_bytes(data, path))
    except (CheckpointError, PayloadError) as exc:
        raise error(f"{path}: {exc}") from None


def fit_code_tables(codes: torch.Tensor, steps: FixedSteps | None = None) -> CodeTables:
    """Count each channel's 8-bit codes over a representative batch.

    Args:
        codes: uint8 codes [N, C, ...] (``payload.quantize(bottleneck)[0]`` of training images, or
            ``steps.quantize(bottleneck)``).
        steps: the fixed quantiser the codes came from, kept in the tables (payload version 3).

    Returns:
        The :class:`CodeTables`.

    Raises:
        PayloadError: not a uint8 tensor with at least 2 dims.

    Example:
        >>> from edgetorch.split.payload import quantize
        >>> tables = fit_code_tables(quantize(torch.relu(torch.randn(16, 3, 8, 8)))[0])
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() < 2:
        got = f"{codes.dtype} [{', '.join(map(str, codes.shape))}]" if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise PayloadError(f"code tables are fitted on uint8 codes [N, C, ...], got {got}")
    channels = codes.shape[1]
    keyed = codes.detach().cpu().transpose(0, 1).reshape(channels, -1).to(torch.int64)
    keyed += torch.arange(channels)[:, None] * CODES
    counts = torch.bincount(keyed.reshape(-1), minlength=channels * CODES).reshape(channels, CODES)
    return CodeTables(counts, steps)


def encode_codes(codes: torch.Tensor, tables: CodeTables) -> bytes:
    """The rANS stream of ``codes`` (uint8 [N, C, ...]) under ``tables``: version 2's words.

    Args:
        codes: uint8 codes whose dim 1 has ``tables.channels`` entries.
        tables: the channel tables.

    Returns:
        The words as little-endian bytes (a multiple of 4; none where every code was certain
        enough that the coder's state never grew past its start).

    Raises:
        PayloadError: the codes' channels do not match the tables'.
    """
    import constriction

    if codes.dim() < 2 or codes.shape[1] != tables.channels:
        raise PayloadError(f"the code tables cover {tables.channels} channels (dim 1); the tensor has shape "
                           f"{tuple(codes.shape)}")
    by_channel = codes.detach().cpu().transpose(0, 1).reshape(tables.channels, -1).numpy().astype(np.int32)
    coder = constriction.stream.stack.AnsCoder()
    for channel in reversed(range(tables.channels)):  # a stack: the last channel in is the first out
        coder.encode_reverse(by_channel[channel], tables._models[channel])
    return coder.get_compressed().astype("<u4").tobytes()


def decode_codes(words: memoryview, shape: tuple[int, ...], tables: CodeTables) -> torch.Tensor:
    """Inverse of :func:`encode_codes`: uint8 codes of ``shape`` from the stream's bytes.

    The caller bounds ``math.prod(shape)`` (the stream's length does not: a code of probability
    near 1 costs almost nothing, so a few bytes can claim any count).

    Raises:
        PayloadError: the stream is malformed (not whole words, ending in a zero word) or does not hold
            exactly the codes of ``shape`` (words left over, or too few: the coder's state does not
            end where encoding started).
    """
    import constriction

    if len(shape) < 2 or shape[1] != tables.channels:
        raise PayloadError(f"the code tables cover {tables.channels} channels (dim 1); the payload's shape is "
                           f"{tuple(shape)}")
    if len(words) % 4:
        raise PayloadError(f"inconsistent payload: the coded stream is {len(words)} bytes, not a multiple of 4")
    stream = np.frombuffer(words, dtype="<u4").astype(np.uint32)
    try:
        coder = constriction.stream.stack.AnsCoder(stream)
    except ValueError as e:  # constriction: "ANS compressed data never ends in a zero word"
        raise PayloadError(f"inconsistent payload: the coded stream is not rANS data ({e})") from None
    per_channel = math.prod(shape) // (shape[0] * shape[1]) * shape[0]
    out = np.empty((tables.channels, per_channel), dtype=np.uint8)
    for channel in range(tables.channels):
        out[channel] = coder.decode(tables._models[channel], per_channel)
    if not coder.is_empty():  # the coder ends where it started only if the stream held exactly these codes
        raise PayloadError("inconsistent payload: the coded stream does not hold exactly the codes of its shape")
    by_channel = torch.from_numpy(out).reshape(shape[1], shape[0], *shape[2:])
    return by_channel.transpose(0, 1).contiguous()
