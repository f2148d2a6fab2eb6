"""Split source files into chunks at definition boundaries (tree-sitter), other text by lines.

A file's chunks cover it exactly: concatenated, they give the file back, so a response that
reproduces a file can be drafted chunk after chunk. Splits fall at line starts. For languages
tree-sitter knows (Python, JavaScript, TypeScript/TSX, Go, Rust, Java, C, C++), every top-level
definition (function, class, method, impl, struct, ...) starts its own chunk and runs of small
top-level statements (imports, constants) are grouped; a definition longer than ``max_lines`` is
split inside at its own children (a class at its methods), recursively. Other text is cut every
``max_lines`` lines.
"""

from __future__ import annotations

import importlib
import threading
from pathlib import PurePath

__all__ = ["LANGUAGES", "chunk_text", "language_for"]

# extension -> (grammar module, language function)
LANGUAGES: dict[str, tuple[str, str]] = {
    ".py": ("tree_sitter_python", "language"), ".pyi": ("tree_sitter_python", "language"),
    ".js": ("tree_sitter_javascript", "language"), ".jsx": ("tree_sitter_javascript", "language"),
    ".mjs": ("tree_sitter_javascript", "language"), ".cjs": ("tree_sitter_javascript", "language"),
    ".ts": ("tree_sitter_typescript", "language_typescript"), ".mts": ("tree_sitter_typescript", "language_typescript"),
    ".tsx": ("tree_sitter_typescript", "language_tsx"),
    ".go": ("tree_sitter_go", "language"),
    ".rs": ("tree_sitter_rust", "language"),
    ".java": ("tree_sitter_java", "language"),
    ".c": ("tree_sitter_c", "language"), ".h": ("tree_sitter_c", "language"),
    ".cc": ("tree_sitter_cpp", "language"), ".cpp": ("tree_sitter_cpp", "language"),
    ".cxx": ("tree_sitter_cpp", "language"), ".hpp": ("tree_sitter_cpp", "language"),
    ".hh": ("tree_sitter_cpp", "language"), ".hxx": ("tree_sitter_cpp", "language"),
}

# node types that start a chunk of their own
DEFINITIONS = frozenset({
    # python
    "function_definition", "class_definition", "decorated_definition",
    # javascript / typescript
    "function_declaration", "generator_function_declaration", "class_declaration", "method_definition",
    "lexical_declaration", "export_statement", "interface_declaration", "type_alias_declaration",
    "enum_declaration", "abstract_class_declaration", "module",
    # go
    "method_declaration", "type_declaration",
    # rust
    "function_item", "impl_item", "struct_item", "enum_item", "trait_item", "mod_item", "macro_definition",
    # java
    "constructor_declaration", "record_declaration",
    # c / c++
    "struct_specifier", "class_specifier", "namespace_definition", "template_declaration",
})

_parsers = threading.local()


def language_for(path: str | PurePath) -> str | None:
    """The grammar module for a file name, or None for plain text."""
    spec = LANGUAGES.get(PurePath(path).suffix.lower())
    return spec[0] if spec else None


def _parser(suffix: str):
    cache = getattr(_parsers, "cache", None)
    if cache is None:
        cache = _parsers.cache = {}
    if suffix not in cache:
        spec = LANGUAGES.get(suffix)
        parser = None
        if spec is not None:
            try:
                import tree_sitter

                mod = importlib.import_module(spec[0])
                parser = tree_sitter.Parser(tree_sitter.Language(getattr(mod, spec[1])()))
            except (ImportError, AttributeError, ValueError):  # grammar missing: line chunks
                parser = None
        cache[suffix] = parser
    return cache[suffix]


def chunk_text(text: str, path: str | PurePath = "", *, max_lines: int = 80, min_lines: int = 4) -> list[str]:
    """``text`` cut into chunks (their concatenation is ``text``)."""
    if not text:
        return []
    data = text.encode("utf-8")
    line_starts = [0]
    for i, b in enumerate(data):
        if b == 10:  # "\n"
            line_starts.append(i + 1)
    parser = _parser(PurePath(path).suffix.lower()) if path else None
    if parser is None or len(line_starts) <= max_lines:
        cuts = list(range(0, len(line_starts), max_lines))[1:] if parser is None else []
        byte_cuts = [line_starts[c] for c in cuts if line_starts[c] < len(data)]
    else:
        tree = parser.parse(data)
        rows: set[int] = set()
        _split(tree.root_node, rows, max_lines, min_lines)
        byte_cuts = sorted({line_starts[r] for r in rows if 0 < r < len(line_starts) and line_starts[r] < len(data)})
    bounds = [0, *byte_cuts, len(data)]
    return [data[a:b].decode("utf-8") for a, b in zip(bounds, bounds[1:]) if b > a]


def _split(node, rows: set[int], max_lines: int, min_lines: int) -> None:
    """Add the line numbers where chunks start, for ``node``'s children."""
    group_start = None   # first row of the group of small statements being collected
    group_rows = 0
    for child in node.children:
        r0, r1 = child.start_point[0], child.end_point[0]
        n = r1 - r0 + 1
        if child.type in DEFINITIONS or n >= max_lines:
            if group_start is not None and group_rows >= min_lines:
                rows.add(group_start)
            rows.add(r0)
            group_start, group_rows = None, 0
            if n > max_lines:   # too long for one chunk: split at its own children
                _split(child, rows, max_lines, min_lines)
            continue
        if group_start is None:
            group_start, group_rows = r0, 0
        if group_rows + n > max_lines:
            rows.add(r0)
            group_start, group_rows = r0, 0
        group_rows += n
    if group_start is not None and group_rows >= min_lines:
        rows.add(group_start)   # a long run of statements after the last definition
