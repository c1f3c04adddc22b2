"""The user's image files: listed and opened one bounded way by every reader (training folders,
``split infer``, ``split plan --images``).

Most rules come from a file that once took a run down:

* listing: a folder walk that visits each real directory once, so two symlinks to ``.`` in a
  class folder (a loop) end instead of recursing for ever, and at most :data:`MAX_LISTED` entries;
* opening: regular files only, through :func:`edgetorch._files.open_regular` (a FIFO named
  ``*.png`` blocked the reader for ever), of at most :data:`MAX_IMAGE_BYTES`;
* decoding: only the formats the listed extensions name (PIL would otherwise try every plugin
  on the bytes, and some run external programs), at most :data:`MAX_IMAGE_PIXELS` pixels as the
  header declares them, checked before any pixel is decoded (a PNG of a few dozen bytes declared
  30000 x 30000), and fully decoded where pixels are wanted, so a truncated JPEG or PNG fails
  here with the file's name rather than later inside a transform.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path

from .._files import InputFileError, open_regular

# torchvision's ImageFolder extensions, so a folder lists the same files it would there.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# The PIL formats those extensions name (PPM also reads PGM).
IMAGE_FORMATS = ("JPEG", "PNG", "PPM", "BMP", "TIFF", "WEBP")
MAX_IMAGE_BYTES = 64 << 20  # a 50-megapixel JPEG is ~20 MB; a training image larger than this is a mistake
MAX_IMAGE_PIXELS = 89_478_485  # PIL's default warning threshold (~9,459 x 9,459), enforced whatever PIL's global says
MAX_LISTED = 2_000_000  # files and folders one listing looks at: ImageNet-1k's 1.28M training images fit
ACCEPTED = (f"complete {', '.join(IMAGE_FORMATS)} files of at most {MAX_IMAGE_BYTES >> 20} MiB and "
            f"{MAX_IMAGE_PIXELS:,} pixels")


def read_image(path: str | Path, *, error: type[InputFileError] = InputFileError, header_only: bool = False):
    """One image file, checked and (unless ``header_only``) fully decoded.

    Args:
        path: the file.
        error: the exception type raised (a subclass of :class:`~edgetorch.InputFileError`).
        header_only: read the header only (mode and size; cheap): the returned image's pixels
            cannot be read. Otherwise every pixel is decoded, so truncated data is found here.

    Returns:
        A ``PIL.Image.Image`` that needs no open file.

    Raises:
        error: not a regular file, over :data:`MAX_IMAGE_BYTES` or :data:`MAX_IMAGE_PIXELS`, not
            one of :data:`IMAGE_FORMATS`, or damaged (truncated, corrupt); the message names the
            file and says what is accepted.

    Example:
        >>> read_image("photos/cat/1.jpg").convert("RGB")  # doctest: +SKIP
    """
    from PIL import Image

    with open_regular(path, MAX_IMAGE_BYTES, error=error, why=f"; accepted: {ACCEPTED}") as f:
        try:
            image = Image.open(f, formats=IMAGE_FORMATS)
            width, height = image.size
            if width * height <= MAX_IMAGE_PIXELS and not header_only:
                image.load()
        # What PIL raises on bytes it cannot decode depends on the plugin and where the data
        # breaks: OSError (truncated, unidentified), SyntaxError, EOFError, ValueError,
        # struct.error, IndexError; DecompressionBombError when its own global limit is lower.
        except (OSError, SyntaxError, EOFError, ValueError, struct.error, IndexError,
                Image.DecompressionBombError) as exc:
            raise error(f"{path}: not a readable image ({exc or type(exc).__name__}); accepted: {ACCEPTED}") from None
    if width * height > MAX_IMAGE_PIXELS:
        raise error(f"{path}: not a readable image (its header declares {width} x {height} = {width * height:,} "
                    f"pixels, over the {MAX_IMAGE_PIXELS:,}-pixel limit against decompression bombs; nothing "
                    f"was decoded); accepted: {ACCEPTED}")
    return image


def list_images(folders: Sequence[str | Path], *, error: type[InputFileError] = InputFileError,
                outside: Sequence[str | Path] = ()) -> tuple[list[list[Path]], list[Path]]:
    """The files with an image extension under each folder, recursively, in torchvision's order.

    Directory symlinks are followed (a class folder may link to where its images live), but each
    real directory, known by ``(st_dev, st_ino)``, is entered once over all ``folders``: a loop
    (two links to ``.``) ends, and no image is listed twice, under two names or two classes.

    Args:
        folders: the folders to list (a tree's class folders).
        error: the exception type raised.
        outside: folders never entered through a link (a tree's root: a link to it from a
            class folder would list every other class's images again).

    Returns:
        ``(files, not_followed)``: per folder, its image files (sorted by folder path, then
        name, as ``torchvision``'s ``make_dataset`` lists them; not opened yet, so a FIFO or a
        broken link is refused when read), and the directories not entered because they were
        entered already (links, or a folder given twice).

    Raises:
        error: a folder that cannot be listed, or over :data:`MAX_LISTED` entries in all.
    """
    visited = {_identity(path, error) for path in outside}
    not_followed: list[Path] = []
    # Every given folder is marked entered first, so a link from one into another is not
    # followed whichever is listed first.
    tops = []
    for top in map(str, folders):
        tops.append(top if _enter(top, visited, error) else None)
        if tops[-1] is None:
            not_followed.append(Path(top))
    left = MAX_LISTED
    files: list[list[Path]] = []
    for top in tops:
        stack, found = [top] if top is not None else [], []
        while stack:
            directory = stack.pop()
            try:
                with os.scandir(directory) as entries:
                    listed = list(entries)
            except OSError as exc:
                raise error(f"{directory}: cannot be listed ({exc.strerror})") from None
            left -= len(listed)
            if left < 0:
                raise error(f"{top}: over {MAX_LISTED:,} files and folders in all; an image listing looks at no "
                            "more (train on a part of them)")
            names = []
            for entry in listed:
                if entry.is_dir():  # follows links; a broken link or a link loop (ELOOP) is not a directory
                    if _enter(entry.path, visited, error):
                        stack.append(entry.path)
                    else:
                        not_followed.append(Path(entry.path))
                elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                    names.append(entry.name)
            found.append((directory, sorted(names)))
        files.append([Path(directory, name) for directory, names in sorted(found) for name in names])
    return files, sorted(not_followed)


def _enter(path: str, visited: set[tuple[int, int]], error: type[InputFileError]) -> bool:
    """Whether ``path``'s directory is not entered yet (and mark it entered)."""
    key = _identity(path, error)
    if key in visited:
        return False
    visited.add(key)
    return True


def _identity(path: str | Path, error: type[InputFileError]) -> tuple[int, int]:
    try:
        info = os.stat(path)
    except OSError as exc:
        raise error(f"{path}: cannot be listed ({exc.strerror})") from None
    return info.st_dev, info.st_ino
