"""Every error class edgetorch defines has one base, and keeps the builtin type it always had."""

import importlib
import inspect
import pkgutil

import pytest

import edgetorch
from edgetorch.errors import EdgetorchError


def _error_classes() -> dict[str, type]:
    found = {}
    for info in pkgutil.walk_packages(edgetorch.__path__, "edgetorch."):
        if info.name.endswith("__main__"):  # running it is the CLI
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # a module of an extra that is not installed (ray)
            continue
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__
                    and not name.startswith("_") and obj is not EdgetorchError):
                found[f"{module.__name__}.{name}"] = obj
    return found


ERRORS = _error_classes()


def test_the_public_errors_were_found():
    names = {name.rsplit(".", 1)[1] for name in ERRORS}
    assert {"InputFileError", "CheckpointError", "SplitArtifactError", "PayloadError", "SplitClientError",
            "CaptureError", "IDXFormatError", "DatasetNotFoundError", "ImageFolderError", "TrainingDiverged"} <= names


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_every_error_class_derives_from_the_one_base(name):
    cls = ERRORS[name]
    assert issubclass(cls, EdgetorchError), f"{name} should derive from edgetorch.EdgetorchError"
    # and from the builtin type its case has (callers' `except ValueError` keeps working)
    assert any(issubclass(cls, b) for b in (ValueError, RuntimeError, OSError, ArithmeticError)), name


def test_the_base_is_public():
    assert edgetorch.EdgetorchError is EdgetorchError
    assert issubclass(edgetorch.InputFileError, edgetorch.EdgetorchError)
