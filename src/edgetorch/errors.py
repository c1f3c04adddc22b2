"""The one base of the errors edgetorch defines.

Every error class edgetorch raises on purpose derives from :class:`EdgetorchError` and from the
builtin type its case has always had (``InputFileError`` is a ``ValueError``, ``CaptureError`` a
``RuntimeError``, ...), so ``except edgetorch.EdgetorchError`` catches all of them while existing
``except ValueError`` code keeps working. Bad arguments to a function stay plain ``ValueError`` /
``TypeError``, as in torch.
"""

from __future__ import annotations


class EdgetorchError(Exception):
    """Base of every error class edgetorch defines (files, payloads, artifacts, capture, client).

    Example:
        >>> try:
        ...     edgetorch.zoo.load_weights(model, "downloaded.safetensors")
        ... except edgetorch.EdgetorchError as err:
        ...     print(err)  # what was wrong and what is accepted
    """
