"""``python -m edgetorch.cli``: the same command as ``edgetorch``."""

from . import app

app(prog_name="edgetorch")
