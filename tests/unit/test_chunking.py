"""Chunks at definition boundaries cover the file exactly, for every supported language."""

from __future__ import annotations

import pytest

from agentspec.workspace.chunking import LANGUAGES, chunk_text

PY = '''"""Module docstring."""
import os
import sys

CONSTANT = 1


def first(a, b):
    return a + b


@decorator
def second():
    pass


class Thing:
    """A class."""

    def method(self):
        return 1

    def other(self):
        return 2
'''

SAMPLES = {
    ".py": PY,
    ".js": "import x from 'y';\nconst a = 1;\n\nfunction f(a) {\n  return a;\n}\n\nclass C {\n  m() { return 1; }\n}\n",
    ".ts": "interface I { a: number }\n\nfunction f(a: number): number {\n  return a;\n}\n\nexport class C {}\n",
    ".tsx": "const A = () => <div>hi</div>;\n\nfunction B() {\n  return <A />;\n}\n",
    ".go": "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(1)\n}\n\ntype T struct{ a int }\n",
    ".rs": "use std::io;\n\nfn main() {\n    println!(\"x\");\n}\n\nstruct S { a: i32 }\n\nimpl S {\n    fn f(&self) {}\n}\n",
    ".java": "package a;\n\nimport b.C;\n\npublic class A {\n  void f() {}\n  int g() { return 1; }\n}\n",
    ".c": "#include <stdio.h>\n\nint f(int a) {\n  return a;\n}\n\nstruct S { int a; };\n",
    ".cpp": "#include <vector>\n\nnamespace n {\nint f() { return 1; }\n}\n\nclass K {\n public:\n  int g();\n};\n",
}


@pytest.mark.parametrize("suffix", sorted(SAMPLES))
def test_chunks_cover_the_file(suffix):
    text = SAMPLES[suffix] * 30     # long enough to be split
    chunks = chunk_text(text, f"x{suffix}", max_lines=20)
    assert "".join(chunks) == text
    assert len(chunks) > 1 and all(chunks)


def test_python_definitions_start_chunks():
    chunks = chunk_text(PY * 3, "m.py", max_lines=12, min_lines=2)
    assert "".join(chunks) == PY * 3
    starts = [c.lstrip("\n").splitlines()[0] for c in chunks]
    assert "def first(a, b):" in starts and "@decorator" in starts
    assert any(s.startswith("class Thing") for s in starts)


def test_long_class_is_split_at_its_methods():
    body = "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(40))
    text = "class Big:\n" + body
    chunks = chunk_text(text, "big.py", max_lines=20)
    assert "".join(chunks) == text
    assert len(chunks) >= 4
    assert sum(c.lstrip().startswith("def m") for c in chunks) >= 3


def test_plain_text_is_cut_by_lines_and_every_language_is_known():
    text = "".join(f"line {i}\n" for i in range(250))
    chunks = chunk_text(text, "notes.txt", max_lines=100)
    assert [c.count("\n") for c in chunks] == [100, 100, 50]
    assert chunk_text("", "a.py") == []
    assert {m for m, _ in LANGUAGES.values()} >= {"tree_sitter_python", "tree_sitter_javascript",
                                                  "tree_sitter_typescript", "tree_sitter_go", "tree_sitter_rust",
                                                  "tree_sitter_java", "tree_sitter_c", "tree_sitter_cpp"}
    # a broken file still chunks (tree-sitter recovers) and still covers the text
    broken = "def f(:\n    return (\n" * 50
    assert "".join(chunk_text(broken, "b.py", max_lines=10)) == broken
