"""What a long library call shows while it works, as the workflows take it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

#: A context manager made from one line of text, entered around a long step (the CLI passes a
#: spinner; the workflows' default, ``contextlib.nullcontext``, shows nothing).
Status = Callable[[str], AbstractContextManager[Any]]

#: Prints one line that stays (the CLI's ``console.print``, shown on a terminal and in a pipe
#: alike); the workflows' default, ``None``, prints nothing.
Notice = Callable[[str], None]
