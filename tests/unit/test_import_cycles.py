"""No import cycle crosses the package's folders (scripts/import_cycles.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_import_cycle_crosses_folders():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_cycles.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_script_finds_a_cycle(tmp_path, monkeypatch):
    """The checker itself: a planted cycle across two folders is reported with its imports."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_cycles
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "__init__.py").write_text("")
    (tmp_path / "b" / "__init__.py").write_text("")
    (tmp_path / "a" / "x.py").write_text("from ..b import y\n")
    (tmp_path / "b" / "y.py").write_text("def f():\n    from ..a.x import g\n")
    (tmp_path / "a" / "z.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..b import y\n")
    files = {"pkg.a": tmp_path / "a" / "__init__.py", "pkg.b": tmp_path / "b" / "__init__.py",
             "pkg.a.x": tmp_path / "a" / "x.py", "pkg.b.y": tmp_path / "b" / "y.py", "pkg.a.z": tmp_path / "a" / "z.py"}
    found = import_cycles.cycles(files)
    assert len(found) == 1 and "pkg.a.x -> pkg.b.y" in found[0] and "pkg.b.y -> pkg.a.x" in found[0]
    assert not any("pkg.a.z" in c for c in found[0])   # TYPE_CHECKING imports are not dependencies
