"""Minimal text edits between two versions of a document, as LSP ``TextEdit`` dicts.

Editors keep cursors, marks, folds and undo history on lines an edit does not touch, so a
rewrite is sent as the changed line ranges only (``difflib`` over lines), never as "replace the
whole buffer". Ranges refer to the original text (LSP applies a ``TextEdit[]`` against the
document as it was) and come in document order. Columns are in the client's position encoding:
``units(text)`` counts a string's code units (UTF-16 by default, as LSP says).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable

_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")


def lines(text: str) -> list[str]:
    """``text`` cut into lines with their ends, at LSP's line ends only (``\\n``, ``\\r\\n``,
    ``\\r``; ``str.splitlines`` also cuts at form feeds and U+2028, which editors do not)."""
    return _LINE.findall(text)


def utf16_units(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def line_edits(old: str, new: str, units: Callable[[str], int] = utf16_units) -> list[dict]:
    """The ``TextEdit``s (``{"range": {"start", "end"}, "newText"}``) that turn ``old`` into
    ``new``, replacing whole changed lines only. Empty when the texts are equal."""
    if old == new:
        return []
    a = lines(old)
    b = lines(new)
    ends_open = bool(a) and not a[-1].endswith(("\n", "\r"))   # the last line has no newline

    def pos(k: int) -> dict:
        """Where old line ``k`` starts (``k == len(a)``: the end of the text)."""
        if k < len(a):
            return {"line": k, "character": 0}
        if ends_open:
            return {"line": len(a) - 1, "character": units(a[-1])}
        return {"line": len(a), "character": 0}

    edits = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        # (an old last line without a newline equals no line of ``b`` but ``b``'s own last, so
        # nothing is ever inserted after it: every range here starts at a line start)
        text = "".join(b[j1:j2])
        edits.append({"range": {"start": pos(i1), "end": pos(i2)}, "newText": text})
    return edits


def apply_edits(text: str, edits: list[dict], units: Callable[[str], int] = utf16_units) -> str:
    """Apply ``TextEdit``s (ranges against ``text``, non-overlapping) as an editor would; for
    tests and for checking an edit before sending it."""
    ls = lines(text)

    def offset(p: dict) -> int:
        line, ch = p["line"], p["character"]
        base = sum(len(x) for x in ls[:line])
        if line >= len(ls):
            return len(text)
        s, n = ls[line], 0
        for i, c in enumerate(s):
            if n >= ch:
                return base + i
            n += units(c)
        return base + len(s)

    out, last = [], 0
    for e in sorted(edits, key=lambda e: (e["range"]["start"]["line"], e["range"]["start"]["character"])):
        a, b = offset(e["range"]["start"]), offset(e["range"]["end"])
        if a < last:
            raise ValueError("overlapping edits")
        out.append(text[last:a])
        out.append(e["newText"])
        last = b
    out.append(text[last:])
    return "".join(out)
