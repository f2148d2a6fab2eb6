"""Minimal line edits for the language server: applying them gives the new text, unchanged lines
are never inside an edit's range, and columns are counted in the client's code units."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.lsp.edits import apply_edits, line_edits, lines, utf16_units

LINE = st.sampled_from(["a\n", "b\n", "def f():\n", "    return 1\n", "ü😀\n", "x", "y\r\n", "\n", "\r", "\x0c\n"])
TEXT = st.lists(LINE, max_size=12).map("".join)


@settings(max_examples=400, deadline=None)
@given(old=TEXT, new=TEXT)
def test_edits_turn_old_into_new(old, new):
    edits = line_edits(old, new)
    assert apply_edits(old, edits) == new
    assert (edits == []) == (old == new)
    starts = [(e["range"]["start"]["line"], e["range"]["start"]["character"]) for e in edits]
    assert starts == sorted(starts)


def test_unchanged_lines_are_left_alone():
    old = "".join(f"line {i}\n" for i in range(100))
    new = old.replace("line 50\n", "line fifty\n").replace("line 90\n", "")
    edits = line_edits(old, new)
    assert [(e["range"]["start"]["line"], e["range"]["end"]["line"], e["newText"]) for e in edits] == [
        (50, 51, "line fifty\n"), (90, 91, "")]


def test_a_last_line_without_newline_ends_at_its_utf16_length():
    edits = line_edits("a\nü😀", "a\nchanged")
    assert edits == [{"range": {"start": {"line": 1, "character": 0}, "end": {"line": 1, "character": 3}},
                      "newText": "changed"}]
    assert utf16_units("ü😀") == 3
    assert line_edits("a\nü😀", "a\nz", units=len)[0]["range"]["end"]["character"] == 2   # UTF-32 clients


def test_lines_split_at_lsp_line_ends_only():
    assert lines("a\nb\r\nc\rd\x0ce\u2028f") == ["a\n", "b\r\n", "c\r", "d\x0ce\u2028f"]
    assert lines("") == [] and lines("\n\n") == ["\n", "\n"]
