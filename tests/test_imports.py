"""The import graph of the project's packages: every module imports, no import cycle, and the
kernels (``pallas_kernels``) never import the model (``dsv41_jax``).

The graph is read from the source (``ast``): every ``import`` / ``from ... import`` statement
counts, at module level or inside a function, to a module of the packages. ``from p import x``
is an edge to ``p.x`` when that is a module, else to ``p``; importing a submodule is not
counted as an edge to its parent packages (Python runs their ``__init__`` first, but a package
importing its own submodules is not a cycle).
"""

from __future__ import annotations

import ast
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = [p for p in ("dsv41_jax", "pallas_kernels", "benchmarks")
            if os.path.isfile(os.path.join(ROOT, p, "__init__.py"))]


def _modules() -> dict[str, str]:
    """Dotted module name -> path, for every .py file of the packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, pkg)):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3]
                    parts = rel.split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    out[".".join(parts)] = os.path.join(dirpath, f)
    return out


MODULES = _modules()


def _imports(name: str, path: str) -> set[str]:
    """The modules of the packages that module ``name`` (file ``path``) imports."""
    is_pkg = path.endswith("__init__.py")
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".") if is_pkg else name.split(".")[:-1]
                parent = parent[:len(parent) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in MODULES and t != name}
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}   # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_graph_reader():
    """The reader sees module-level and function-level imports, relative ones, and finds a
    cycle through a function-level import."""
    assert "pallas_kernels.sparse_attention.common" in MODULES
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_no_import_cycle():
    cycle = _cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernels_do_not_import_the_model():
    back = sorted((a, b) for a, deps in GRAPH.items() if a.startswith("pallas_kernels")
                  for b in deps if b.split(".")[0] != "pallas_kernels")
    assert not back, f"pallas_kernels imports outside itself: {back}"
    # (and nothing else of the repository's top level either: the kernels are a leaf package)
    for name, path in MODULES.items():
        if name.startswith("pallas_kernels"):
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
            for node in ast.walk(tree):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                        [node.module or ""] if isinstance(node, ast.ImportFrom) and
                        not node.level else [])
                for m in mods:
                    assert m.split(".")[0] not in ("dsv41_jax", "benchmarks", "scripts",
                                                   "tools"), (name, m)
