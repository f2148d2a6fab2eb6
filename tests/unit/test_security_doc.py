"""SECURITY.md's controls each name the tests that check them: every named file and test exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rows() -> list[tuple[str, str]]:
    text = (ROOT / "SECURITY.md").read_text()
    table = text[text.index("## Controls"):text.index("## TLS")]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("Control", "---"):
            rows.append((cells[0], cells[2]))
    return rows


def test_every_control_names_tests_that_exist():
    rows = _rows()
    assert len(rows) >= 15, rows
    for control, tests in rows:
        refs = [r for r in re.findall(r"`([^`]+)`", tests) if r.startswith(("tests/", "::"))]
        assert refs, f"{control}: names no test"
        current = None
        for ref in refs:
            path, _, name = ref.partition("::")
            if path:
                current = ROOT / path
                assert current.is_file(), f"{control}: {path} does not exist"
            assert current is not None, f"{control}: {ref!r} names no file"
            if name:
                assert re.search(rf"^(async )?def {re.escape(name)}\(", current.read_text(), re.M), \
                    f"{control}: {current.relative_to(ROOT)} has no test {name}"
