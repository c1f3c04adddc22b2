"""Which install extra brings each optional package, and the hint a missing one gets.

A device needs only the core install (torch, torchvision, numpy and a few small packages) to
fine-tune, plan memory, export a split head and run the client. What a workstation or a server
needs lives in extras, imported only inside the features that use them.
"""

from __future__ import annotations

#: Top-level module -> (the package it comes from, the edgetorch extra that brings it, what
#: ``pip install`` takes without the extra).
EXTRAS: dict[str, tuple[str, str, str]] = {
    "matplotlib": ("matplotlib", "plot", "matplotlib"),
    "sklearn": ("scikit-learn", "data", "scikit-learn"),
    "scipy": ("scipy", "reduce", "scipy"),
    "torch_pruning": ("torch-pruning", "reduce", "'torch-pruning>=1.6'"),
    "fastapi": ("fastapi", "server", "fastapi uvicorn"),
    "starlette": ("fastapi", "server", "fastapi uvicorn"),
    "uvicorn": ("uvicorn", "server", "fastapi uvicorn"),
    "onnx": ("onnx", "onnx", "onnx onnxscript onnxruntime"),
    "onnxscript": ("onnxscript", "onnx", "onnx onnxscript onnxruntime"),
    "onnxruntime": ("onnxruntime", "onnx", "onnxruntime"),
    "ray": ("ray", "ray", "'ray[serve]'"),
    "transformers": ("transformers", "hf", "transformers"),
}


def install_hint(err: BaseException) -> str:
    """What to say of ``err``: its own message, or for a missing optional package, the extra that installs it.

    Args:
        err: any exception; only a ``ModuleNotFoundError`` for a module of :data:`EXTRAS` is reworded.

    Returns:
        One line, e.g. ``"scipy is not installed: pip install 'edgetorch[reduce]'"``.

    Example:
        >>> install_hint(ModuleNotFoundError("No module named 'scipy'", name="scipy"))
        "scipy is not installed: pip install 'edgetorch[reduce]'  (or: pip install scipy)"
    """
    name = getattr(err, "name", None) if isinstance(err, ModuleNotFoundError) else None
    known = EXTRAS.get((name or "").split(".")[0])
    if known is None:
        return str(err)
    package, extra, pip = known
    return f"{package} is not installed: pip install 'edgetorch[{extra}]'  (or: pip install {pip})"
