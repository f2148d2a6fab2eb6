"""Import cycles that cross the package's folders: none allowed.

    python scripts/import_cycles.py          # prints each such cycle; exit 1 if any

Reads every module of the installed layout (``agentspec/``, ``kernels/`` as ``agentspec.kernels``,
``integrations/`` as ``agentspec.integrations``, ``suffix_index/``) as text, takes every import it
makes (at module level or inside a function: a lazy import is still a dependency; those under
``if TYPE_CHECKING:`` are not), and finds the cycles of the module graph (its strongly connected
groups). A cycle among the modules of one folder (``agentspec.api``, ``agentspec.backends.embedded``,
...; the modules directly in ``agentspec/`` are one folder) is that folder's business; a cycle whose
modules sit in different folders is reported, with the imports that close it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = {"agentspec": ROOT / "agentspec", "agentspec.kernels": ROOT / "kernels",
          "agentspec.integrations": ROOT / "integrations", "suffix_index": ROOT / "suffix_index"}
SKIP_PARTS = {"csrc", "editor", "__pycache__"}


def modules() -> dict[str, Path]:
    """Module name -> file, for the installed layout."""
    out: dict[str, Path] = {}
    for pkg, folder in LAYOUT.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder)
            if SKIP_PARTS & set(rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([pkg, *parts])
            if pkg == "agentspec" and parts[:1] in (["kernels"], ["integrations"]):
                continue   # the source tree's agentspec/ has no such folders; the layout maps them
            out[name] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules ``name`` imports (resolved: relative imports, ``from pkg import module``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for a in child.names:
                    found.add(a.name)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    anchor = base.split(".")
                    anchor = anchor[:len(anchor) - (child.level - 1)]
                    mod = ".".join(anchor + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                found.add(mod)
                for a in child.names:
                    found.add(f"{mod}.{a.name}")
            visit(child)

    visit(tree)
    out = set()
    for m in found:
        while m and m not in known:   # `import a.b.c` depends on the deepest known module it names
            m = m.rpartition(".")[0]
        if m and m != name:
            out.add(m)
    return out


def folder(name: str, files: dict[str, Path]) -> str:
    """The folder a module belongs to (a package is its own folder's)."""
    if files[name].name == "__init__.py":
        return name
    parent = name.rpartition(".")[0]
    return parent if parent else name


def cycles(files: dict[str, Path]) -> list[list[str]]:
    """The module graph's strongly connected groups whose modules sit in more than one folder:
    each as its sorted module names followed by the imports ("a -> b") inside the group."""
    known = set(files)
    edges = {name: imports(name, path, known) for name, path in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:   # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len({folder(m, files) for m in comp}) > 1:
                comp = sorted(comp)
                out.append(comp + [f"{a} -> {b}" for a in comp for b in sorted(edges[a]) if b in comp])

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))   # the walk recurses once per module on a path
    try:
        for v in sorted(files):
            if v not in index:
                strong(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def main() -> int:
    files = modules()
    found = cycles(files)
    if not found:
        print("no import cycles between folders")
        return 0
    for comp in found:
        names = [c for c in comp if " -> " not in c]
        print(f"cycle among {len(names)} modules of {len({folder(n, files) for n in names})} folders:")
        for c in comp:
            if " -> " in c:
                print(f"  {c}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
