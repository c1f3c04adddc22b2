"""The package's layers, read from the source as a static reader would: no import cycles among
module-level imports, and no module imports from a layer above its own, lazily or not
(cli, demo -> activations, reduce, split, finetune, integrations -> codecs, measure, data, zoo -> core)."""

from __future__ import annotations

import ast
from pathlib import Path

import edgetorch

ROOT = Path(edgetorch.__file__).parent
LAYERS = {"cli": 3, "demo": 3, "activations": 2, "reduce": 2, "split": 2, "finetune": 2, "integrations": 2,
          "codecs": 1, "measure": 1, "data": 1, "zoo": 1, "training": 1}  # anything else at the top (errors, _files): 0


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, bool]]:
    """(imported edgetorch module, whether at module level) for every import outside
    ``if TYPE_CHECKING:``; ``from pkg import sub`` counts as importing ``pkg.sub`` when that is a module."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = ".".join(package[: len(package) - child.level + 1] + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                if base.split(".")[0] == "edgetorch":
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        found.append((sub if sub in MODULES else base, top))
            elif isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names if alias.name.split(".")[0] == "edgetorch")
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))

    visit(ast.parse(path.read_text()), True)
    return [(target, top) for target, top in found if target in MODULES and target != name]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return None if len(parts) == 1 else LAYERS.get(parts[1], 0)  # the root package: lazy, no layer


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{name} -> {target}" for name, path in MODULES.items() for target, _ in _imports(name, path)
              if _layer(name) is not None and _layer(target) is not None and _layer(target) > _layer(name)]
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))


def test_module_level_imports_have_no_cycles():
    graph = {name: {t for t, top in _imports(name, path) if top} for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                walk(nxt, path + [node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [])
    assert not cycles, "module-level import cycles:\n" + "\n".join(cycles)


def test_the_reader_sees_the_imports_it_should():
    """The checks above would pass on a reader that finds nothing: pin a few known edges."""
    edges = {name: {t for t, _ in _imports(name, path)} for name, path in MODULES.items()}
    assert "edgetorch.activations.held" in edges["edgetorch.activations.engine"]
    assert "edgetorch.split.manifest" in edges["edgetorch.split.artifact"]
    assert "edgetorch.reduce.workflow" in edges["edgetorch.cli.reduce"]  # a function-level import
    assert len(MODULES) > 100
