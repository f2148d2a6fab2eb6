"""benchmarks/bench_apply.py's edit snippets: the changed hunks of the new file with two lines of
context, a marker wherever unchanged lines are left out, in the file's comment syntax."""

from __future__ import annotations

from benchmarks.bench_apply import marker, morph_snippet


def test_changed_hunks_with_context_and_markers():
    old = "\n".join(f"line {i}" for i in range(20)) + "\n"
    new = old.replace("line 3\n", "line 3\nadded a\n").replace("line 15\n", "line fifteen\n")
    assert morph_snippet(old, new, "a.py").split("\n") == [
        "# ... existing code ...", "line 2", "line 3", "added a", "line 4", "line 5",
        "# ... existing code ...", "line 13", "line 14", "line fifteen", "line 16", "line 17",
        "# ... existing code ..."]


def test_edits_at_the_ends_need_no_outer_markers():
    old = "a\nb\nc\n"
    assert morph_snippet(old, "z\nb\nc\n", "x.js") == "z\nb\nc"
    assert morph_snippet(old, old, "x.js") is None


def test_comment_syntax_follows_the_file():
    assert marker("x.go") == "// ... existing code ..."
    assert marker("README.md") == "<!-- ... existing code ... -->"
    assert marker("tags.scm") == "; ... existing code ..."
