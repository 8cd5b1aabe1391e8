"""The import graph has no circles and no room outgrows one reading (issue 40; ARCHITECTURE.md "One face per package,
imports go down").

The graph is read with ``ast`` (nothing is imported) over ``distattn/`` (every subpackage), ``kernels/`` (installed as
``distattn.kernels``), ``launch/`` and ``bench/``; a package's ``__init__`` is a node of its own (the package's face).
Every import statement counts, inside functions too, with these edges:

* ``import a.b.c`` / ``import a.b.c as x``: to ``a.b.c`` (the nearest module we own);
* ``from a.b import name``: to ``a.b`` (``name`` is read off ``a.b``'s namespace), and also to ``a.b.name`` when that is
  a module. So ``from distattn import kernels`` inside a room of ``distattn`` is an edge to the face ``distattn``:
  a room names its sibling module in full (``import distattn.kernels as kernels``) or imports names from it
  (``from distattn.comm import DistAttnError``);
* relative imports are resolved against the importing module's package (``from . import x`` is ``from pkg import x``).

A circle (a strongly connected component of two or more modules) fails the test, which names its modules and the
import lines that close it. ``levels`` (the longest downward chain of each module) is what the fast-tier report's
before/after table counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder -> the package name it is imported as
TREES = {"distattn": "distattn", "kernels": "distattn.kernels", "launch": "launch", "bench": "bench"}
MAX_LINES = 500
SIZED = ("distattn", "kernels", "launch")  # the bound; bench/ scripts are not rooms of the library


def modules(root: Path = ROOT, trees: dict = TREES) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's ``__init__``)."""
    found = {}
    for folder, package in trees.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join([package, *parts])] = (path, is_package)
    return found


def _owned(name: str, mods: dict) -> str | None:
    """The nearest enclosing module of ``name`` that we own (``kernels.x`` is ``distattn.kernels.x``), or None."""
    if name == "kernels" or name.startswith("kernels."):
        name = "distattn." + name
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def edges(mods: dict) -> dict[str, dict[str, list[int]]]:
    """module -> {imported module: [line, ...]} over our own modules (see the module docstring for the rules)."""
    graph: dict[str, dict[str, list[int]]] = {m: {} for m in mods}
    for module, (path, is_package) in mods.items():
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets.append(base)
                targets += [f"{base}.{alias.name}" for alias in node.names
                            if f"{base}.{alias.name}" in mods or f"distattn.{base}.{alias.name}" in mods]
            for target in targets:
                owned = _owned(target, mods)
                if owned and owned != module:
                    graph[module].setdefault(owned, []).append(node.lineno)
    return graph


def circles(graph: dict) -> list[list[str]]:
    """Strongly connected components with two or more modules (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def levels(graph: dict) -> dict[str, int]:
    """Each module's level: 0 for a module that imports none of ours, else 1 + the highest level it imports. A circle
    counts as one node (its members share a level)."""
    component = {m: (m,) for m in graph}
    for members in circles(graph):
        for m in members:
            component[m] = tuple(members)
    memo: dict[tuple, int] = {}

    def level(comp: tuple) -> int:
        if comp not in memo:
            below = {component[t] for m in comp for t in graph[m]} - {comp}
            memo[comp] = 1 + max(map(level, below)) if below else 0
        return memo[comp]

    return {m: level(component[m]) for m in graph}


def _describe(members: list[str], graph: dict, mods: dict) -> str:
    inside = set(members)
    lines = [f"  {a} -> {b} ({mods[a][0].relative_to(ROOT)}:{','.join(map(str, graph[a][b]))})"
             for a in members for b in sorted(graph[a]) if b in inside]
    return " <-> ".join(members) + "\n" + "\n".join(lines)


def test_no_import_circles():
    mods = modules()
    graph = edges(mods)
    found = circles(graph)
    assert not found, ("import circles (a package's face only hands names on; rooms import downward; shared helpers "
                       "and error types get a room of their own):\n" + "\n".join(_describe(c, graph, mods)
                                                                           for c in found))


def test_no_room_over_500_lines():
    big = sorted((n, str(p.relative_to(ROOT))) for folder in SIZED for p in (ROOT / folder).rglob("*.py")
                 if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert not big, (f"modules over {MAX_LINES} lines; split each along a seam it already has, the new room with a "
                     "docstring saying what it owns and may import: " + ", ".join(f"{p} ({n})" for n, p in big))


def test_the_rules_on_a_small_tree(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("import pkg.b as b\nfrom pkg.c import g\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")  # through the face, lazily: a circle
    (pkg / "c.py").write_text("from .sub import d\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "d.py").write_text("from ..c import h\n")  # back up to c: a circle with the sub face
    mods = modules(tmp_path, {"pkg": "pkg"})
    graph = edges(mods)
    assert graph["pkg.b"] == {"pkg": [2], "pkg.a": [2]}
    assert set(graph["pkg.c"]) == {"pkg.sub", "pkg.sub.d"}
    assert circles(graph) == [["pkg", "pkg.a", "pkg.b"], ["pkg.c", "pkg.sub.d"]]
    (pkg / "b.py").write_text("def f():\n    import pkg.a as a\n")  # the sibling by its full name: only to pkg.a
    graph = edges(modules(tmp_path, {"pkg": "pkg"}))
    assert graph["pkg.b"] == {"pkg.a": [2]}
    assert circles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub.d"]]
    assert levels(graph)["pkg"] == levels(graph)["pkg.a"] + 1
