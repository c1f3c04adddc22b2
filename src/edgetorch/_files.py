"""Files in and out: written so a reader never sees half of one, read within bounds fixed before reading.

Every file edgetorch reads may have been made by someone else (weights, artifacts, checkpoints,
datasets), so every loader reads through :func:`open_regular` / :func:`read_bytes` /
:func:`read_json`. Their rules, each from a case that took a process down before it existed:

* regular files only: a FIFO named ``*.json`` or ``*.png`` blocked the reader forever, so files
  are opened with ``O_NONBLOCK`` and anything but a regular file is refused by ``fstat``;
* a size limit known before reading, checked against the real size (a 1 TB sparse file beside a
  tiny manifest was read whole), and never more than ``limit + 1`` bytes read even if the file
  grows;
* JSON with a depth limit (deeply nested arrays made seven loaders die in ``RecursionError``);
  ``NaN`` and ``Infinity`` parse as Python writes them (each loader checks its numbers' ranges).

Errors are :class:`InputFileError` (a ``ValueError``) or the loader's own subclass of it, with the
path, what was wrong and what is accepted.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

from .errors import EdgetorchError

MAX_JSON_BYTES = 16 << 20  # every JSON file edgetorch writes is far smaller (manifests, records, histories)
MAX_JSON_DEPTH = 32  # the deepest JSON edgetorch writes nests 5 levels


class InputFileError(EdgetorchError, ValueError):
    """A file edgetorch will not read: missing, not a regular file, over its size limit, or malformed.

    Every loader's own error type (``CheckpointError``, ``SplitArtifactError``, ...) is a subclass,
    so ``except edgetorch.InputFileError`` catches a refused file from any of them.
    """


def write_json_atomically(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` (parent folders created), atomically.

    Values JSON cannot hold (paths, dtypes) are written as their ``str``.
    """
    write_text_atomically(path, json.dumps(data, indent=2, default=str) + "\n")


def write_text_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` as :func:`write_bytes_atomically` does."""
    write_bytes_atomically(path, text.encode("utf-8"))


def write_bytes_atomically(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (parent folders created) through a temporary file and a rename.

    The temporary name carries the process id, so concurrent writers never interleave bytes, and a
    reader sees the old file or the new one, never a part.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def open_regular(path: str | Path, limit: int, *, error: type[InputFileError] = InputFileError,
                 follow_symlinks: bool = True, why: str = "") -> BinaryIO:
    """Open a regular file for reading, refusing anything else and anything over ``limit`` bytes.

    Args:
        path: the file.
        limit: the most bytes it may have (checked against its real size before any read).
        error: the exception type raised (the loader's own subclass of :class:`InputFileError`).
        follow_symlinks: False refuses a symlink at ``path`` itself (an artifact's files must
            be its own).
        why: appended to the over-limit message (what the limit is for).

    Returns:
        A binary file object positioned at 0; read at most ``limit + 1`` bytes from it.

    Raises:
        error: missing, a directory, FIFO, device or socket, a refused symlink, or too large.
    """
    path = Path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        # O_NONBLOCK: opening a FIFO would otherwise block until some writer appears (a hang);
        # with it the open returns and fstat refuses it.
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{path} is missing") from None
    except OSError as exc:  # ELOOP: a refused symlink or a loop; EACCES; ENXIO: a socket
        symlinks = "" if follow_symlinks else " (symlinks are refused)"
        raise error(f"{path}: cannot be opened as a regular file{symlinks}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)  # before fdopen, which raises IsADirectoryError for a directory
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a FIFO, device or socket"
            raise error(f"{path} is not a regular file ({kind}); a regular file is expected")
        if info.st_size > limit:
            raise error(f"{path} is {info.st_size} bytes, over the {limit}-byte limit{why}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_bytes(path: str | Path, limit: int, *, error: type[InputFileError] = InputFileError,
               follow_symlinks: bool = True, why: str = "") -> bytes:
    """A regular file's bytes, at most ``limit`` of them (see :func:`open_regular` for the checks).

    The buffer is sized from the real file size, never from ``limit``: a limit computed from a
    manifest's claims can be huge, and reading ``limit`` bytes allocated that much up front.

    Example:
        >>> read_bytes("weights.safetensors", 64 << 20)  # doctest: +SKIP
    """
    with open_regular(path, limit, error=error, follow_symlinks=follow_symlinks, why=why) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(min(size, limit) + 1)
        if len(data) > min(size, limit):  # it grew after fstat: read the rest, still bounded
            data += f.read(limit + 1 - len(data))
    if len(data) > limit:
        raise error(f"{path} grew past the {limit}-byte limit while it was read")
    return data


def read_json(path: str | Path, limit: int = MAX_JSON_BYTES, *, error: type[InputFileError] = InputFileError,
              follow_symlinks: bool = True) -> Any:
    """Parse a JSON file within a size and depth limit (see :func:`parse_json`).

    Example:
        >>> record = read_json("runs/ci/model.json")  # doctest: +SKIP
    """
    data = read_bytes(path, limit, error=error, follow_symlinks=follow_symlinks)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse_json(text, what=str(path), error=error)


def parse_json(text: str, *, what: str, error: type[InputFileError] = InputFileError,
               max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON text, refusing what is not JSON or nests deeper than ``max_depth``.

    Args:
        text: the JSON text.
        what: names the source in errors (a path, "the request body").
        error: the exception type raised.
        max_depth: the most nested arrays/objects accepted.

    Returns:
        The parsed value (dicts, lists, str, int, float, bool, None).

    Raises:
        error: not JSON, an integer of over 4,300 digits, or too deep.
    """
    try:
        value = json.loads(text)
    # ValueError, not only JSONDecodeError: an integer of over 4,300 digits raises a plain one.
    # RecursionError: thousands of nested brackets exhaust the parser's recursion.
    except (ValueError, RecursionError) as exc:
        message = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise error(f"{what} is not valid JSON ({message})") from None
    stack = [(value, 1)]
    while stack:  # iterative: the check itself must not recurse
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                raise error(f"{what}: JSON nested deeper than {max_depth} levels")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return value


def read_torch(path: str | Path, limit: int, *, error: type[InputFileError] = InputFileError) -> Any:
    """What ``torch.save`` wrote to ``path``, read with ``torch.load(weights_only=True)`` after the zip is checked.

    ``weights_only`` runs torch's restricted unpickler: it builds tensors and plain containers and
    refuses every other object, so nothing in the file runs. The zip is checked first because
    torch.save writes its entries uncompressed, and a 1 MB deflate-compressed entry inflated to
    1 GiB inside torch.load; files from before PyTorch 1.6 (not zips) are refused.

    Raises:
        error: not a regular file, over ``limit``, not a torch.save zip, or not loadable.
    """
    import zipfile

    import torch

    with open_regular(path, limit, error=error) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            with zipfile.ZipFile(f) as archive:
                entries = archive.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
            raise error(f"{path}: not a zip-format PyTorch file ({exc}); torch.save has written zip files since "
                        "PyTorch 1.6 (older files: load and save them again, or convert to .safetensors)") from None
        compressed = [e.filename for e in entries if e.compress_type != zipfile.ZIP_STORED]
        if compressed:
            raise error(f"{path}: holds compressed entries ({', '.join(compressed[:5])}); torch.save writes them "
                        "uncompressed, so this file was not made by it")
        if sum(e.file_size for e in entries) > size:
            raise error(f"{path}: its zip entries claim more bytes than the file's {size}")
        f.seek(0)
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        # torch.load raises many types here (UnpicklingError, RuntimeError, EOFError, ...).
        except Exception as exc:
            raise error(_unloadable(path, exc)) from None


def _unloadable(path: Path, exc: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused ``path``, in one or two lines: torch's own
    message runs to 20 lines with advice to unpickle (which nothing here does), and may carry
    terminal escapes."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
    if found:
        return (f"{path}: a pickled {found.group(1)} object, not a state dict of tensors; edgetorch never unpickles "
                "objects from files (that can run code). Save the weights instead: "
                "torch.save(model.state_dict(), path), or safetensors.torch.save_file(model.state_dict(), path)")
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    first = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", first)[:300]
    return f"{path}: not loadable with torch.load(weights_only=True) ({first})"
