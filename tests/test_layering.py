"""The package's import graph: no circle anywhere in loraplex/, and the lower packages never import the
higher ones (kernels/ and adapters/ never import engine/ or platform/; engine/ never imports platform/)."""

from __future__ import annotations

import ast
from pathlib import Path

import loraplex

ROOT = Path(loraplex.__file__).parent
FORBIDDEN = {"kernels": ("engine", "platform", "adapters"), "adapters": ("engine", "platform"),
             "engine": ("platform",), "model_config": ("engine", "platform", "adapters", "kernels"),
             "threads": ("engine", "platform", "adapters", "kernels"),
             "isa": ("engine", "platform", "adapters", "kernels", "bench")}


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """module -> the loraplex modules it imports (anywhere in the file, function bodies included; not the
    names imported for type checking only)."""
    graph: dict[str, set[str]] = {}
    modules = {module_of(p): p for p in ROOT.rglob("*.py")}
    for name, path in modules.items():
        deps = set()
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("loraplex"):
                for alias in node.names:  # `from loraplex.kernels import cpu_ext` imports a module
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("loraplex"))
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_no_import_circle():
    graph = imports()
    # a package's __init__ re-exporting its own submodules is not a circle of concerns: leave it out
    edges = {m: {d for d in deps if not (graph.get(d) is not None and m.startswith(d + "."))}
             for m, deps in graph.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_lower_packages_never_import_higher_ones():
    bad = []
    for module, deps in imports().items():
        layer = module.split(".")[1] if "." in module else ""
        for dep in deps:
            dep_layer = dep.split(".")[1] if "." in dep else ""
            if dep_layer in FORBIDDEN.get(layer, ()):
                bad.append(f"{module} imports {dep}")
    assert not bad, bad
