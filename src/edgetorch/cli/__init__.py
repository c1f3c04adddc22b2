"""The ``edgetorch`` command: one module per feature registers its commands on the root app.

Heavy imports (torch, models) happen inside the commands, so ``edgetorch --help`` stays fast.
"""

from . import profile  # noqa: F401  (registers `edgetorch profile`)
from ._app import app

__all__ = ["app"]

if __name__ == "__main__":
    app()
