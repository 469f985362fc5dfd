"""Import circles among kvplug's product modules (sdk, backends, gpu, connector).

    python scripts/import_circles.py [ROOT] [--typing]

Reads each module with ``ast`` (nothing is imported): module-level imports only (function bodies
are skipped; ``if TYPE_CHECKING:`` blocks too, unless ``--typing``), relative imports resolved,
``from pkg import name`` counted as an import of ``pkg.name`` where that is a module. Prints the
strongly connected components of more than one module and exits 1 when there is any.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

#: folder -> import name (pyproject.toml's package-dir)
FOLDERS = {"sdk": "kvplug", "backends": "kvplug.backends", "gpu": "kvplug.gpu",
           "connector": "kvplug.connector"}


def modules(root: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def top_imports(body: list[ast.stmt], typing: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if typing or not _type_checking(node.test):
                yield from top_imports(node.body, typing)
            yield from top_imports(node.orelse, typing)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse,
                          node.finalbody):
                yield from top_imports(block, typing)
        elif isinstance(node, ast.With):
            yield from top_imports(node.body, typing)


def graph(root: Path, typing: bool) -> dict[str, set[str]]:
    mods = modules(root)

    def owner(name: str) -> str | None:  # the product module a dotted name lands in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        base = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in top_imports(ast.parse(path.read_text()).body, typing):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                src = node.module or ""
                if node.level:
                    pkg = base
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    src = f"{pkg}.{node.module}" if node.module else pkg
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src
                           for a in node.names]
            for target in targets:
                if (o := owner(target)) is not None and o != mod:
                    edges[mod].add(o)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main(argv: list[str]) -> int:
    typing = "--typing" in argv
    args = [a for a in argv if not a.startswith("--")]
    edges = graph(Path(args[0] if args else "."), typing)
    found = circles(edges)
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} module-level imports, "
          f"{len(found)} circle(s){' (TYPE_CHECKING imports included)' if typing else ''}")
    for comp in found:
        print("  " + " <-> ".join(comp))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
