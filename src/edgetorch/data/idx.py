"""Reader for the IDX format (the container of the MNIST family), gzip-compressed or raw.

Layout: two zero bytes, one dtype code byte, one byte holding the number of dimensions ``d``,
then ``d`` big-endian uint32 sizes, then the elements big-endian in row-major order. The file
must hold exactly ``prod(sizes)`` elements: a short or over-long file is reported, never
truncated or padded.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np

from .._files import InputFileError, read_bytes

# IDX dtype codes and their big-endian numpy equivalents.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"
# The largest IDX file read (after gzip): Fashion-MNIST's training images are 47 MB, EMNIST's 640 MB.
MAX_IDX_BYTES = 1 << 30


class IDXFormatError(InputFileError):
    """An IDX file is malformed (bad magic, unknown dtype, or a size that does not match)."""


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (raw or gzip, detected from the content, not the name).

    Args:
        path: file to read.

    Returns:
        A writable array in native byte order with the shape stored in the header.

    Raises:
        IDXFormatError: the file is missing, not a regular file, over :data:`MAX_IDX_BYTES`
            (compressed or not), or not well-formed IDX (the message says which check failed).
    """
    path = Path(path)
    data = read_bytes(path, MAX_IDX_BYTES, error=IDXFormatError)
    if data[:2] == _GZIP_MAGIC:
        # Bounded: a 1 MB gzip stream of zeros inflates to 1 GiB (gzip.decompress has no limit).
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            data = inflate.decompress(data, MAX_IDX_BYTES + 1)
        except zlib.error as exc:
            raise IDXFormatError(f"{path}: corrupt gzip stream ({exc})") from None
        if len(data) > MAX_IDX_BYTES:
            raise IDXFormatError(f"{path} inflates past the {MAX_IDX_BYTES}-byte limit of an IDX file")
        if not inflate.eof:
            raise IDXFormatError(f"{path}: corrupt gzip stream (it ends before its end marker: truncated)")
    return parse_idx(data, source=str(path))


def parse_idx(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """Parse the bytes of an uncompressed IDX file.

    Args:
        data: the complete file content.
        source: name used in error messages.

    Returns:
        A writable array in native byte order with the shape stored in the header.

    Raises:
        IDXFormatError: the content is not a well-formed IDX file.
    """
    if len(data) < 4:
        raise IDXFormatError(f"{source}: {len(data)} bytes, too short for the 4-byte IDX magic")
    if data[0] != 0 or data[1] != 0:
        raise IDXFormatError(
            f"{source}: bad IDX magic {data[:4].hex()}: the first two bytes must be 00 00"
        )
    code, ndim = data[2], data[3]
    if code not in IDX_DTYPES:
        accepted = ", ".join(f"0x{c:02X} ({d.name})" for c, d in IDX_DTYPES.items())
        raise IDXFormatError(f"{source}: unknown IDX dtype code 0x{code:02X}; accepted: {accepted}")
    if ndim == 0:
        raise IDXFormatError(f"{source}: IDX header declares 0 dimensions; at least 1 is required")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise IDXFormatError(
            f"{source}: header declares {ndim} dimensions ({header_len} header bytes) "
            f"but the file has only {len(data)} bytes"
        )
    shape = tuple(int(s) for s in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = IDX_DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    actual = len(data) - header_len
    if actual != expected:
        raise IDXFormatError(
            f"{source}: header shape {shape} of {dtype.name} needs {expected} data bytes, "
            f"file has {actual}"
        )
    array = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(shape)
    # astype copies, which also makes the array writable (frombuffer over bytes is read-only).
    return array.astype(dtype.newbyteorder("="))
