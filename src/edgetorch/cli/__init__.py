"""The ``edgetorch`` command: one module per feature registers its commands on the root app.

Heavy imports (torch, models) happen inside the commands, so ``edgetorch --help`` stays fast.
"""

from . import finetune, predict, profile, reduce, split  # noqa: F401  (each registers its commands)
from ._app import app

__all__ = ["app"]

if __name__ == "__main__":
    app()
