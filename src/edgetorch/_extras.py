"""Which install extra brings each optional package, and the hint a missing one gets.

A device needs only the core install (torch, torchvision, numpy and a few small packages) to
fine-tune, plan memory, export a split head and run the client. What a workstation or a server
needs lives in extras, imported only inside the features that use them.
"""

from __future__ import annotations

#: Each extra: the top-level modules it brings, and what ``pip install`` takes without the extra.
_EXTRAS: dict[str, tuple[tuple[str, ...], str]] = {
    "plot": (("matplotlib",), "matplotlib"), "data": (("sklearn",), "scikit-learn"),
    "reduce": (("scipy", "torch_pruning"), "scipy 'torch-pruning>=1.6'"),
    "server": (("fastapi", "starlette", "uvicorn"), "fastapi uvicorn"),
    "onnx": (("onnx", "onnxscript", "onnxruntime"), "onnx onnxscript onnxruntime"),
    "executorch": (("executorch",), "executorch"), "ray": (("ray",), "'ray[serve]'"),
    "hf": (("transformers",), "transformers"),
}
#: Top-level module -> the edgetorch extra that brings it.
EXTRAS: dict[str, str] = {module: extra for extra, (modules, _) in _EXTRAS.items() for module in modules}


def install_hint(err: BaseException) -> str:
    """What to say of ``err``: its own message, or for a missing optional package, the extra that installs it.

    Args:
        err: any exception; only a ``ModuleNotFoundError`` for a module of :data:`EXTRAS` is reworded.

    Returns:
        One line, e.g. ``"sklearn is not installed: pip install 'edgetorch[data]'  (or: pip install scikit-learn)"``.

    Example:
        >>> install_hint(ModuleNotFoundError("No module named 'scipy'", name="scipy"))
        "scipy is not installed: pip install 'edgetorch[reduce]'  (or: pip install scipy 'torch-pruning>=1.6')"
    """
    name = (getattr(err, "name", None) or "").split(".")[0] if isinstance(err, ModuleNotFoundError) else ""
    if name not in EXTRAS:
        return str(err)
    extra = EXTRAS[name]
    return f"{name} is not installed: pip install 'edgetorch[{extra}]'  (or: pip install {_EXTRAS[extra][1]})"
