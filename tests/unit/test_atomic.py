"""The one crash-safe write helper (``suffix_index.atomic``) that the index and agentspec share."""

from __future__ import annotations

import os

import pytest

from suffix_index.atomic import fsync_dir, fsync_tree, open_atomic, write_atomic


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_write_atomic_bytes_and_text(tmp_path):
    p = tmp_path / "a.bin"
    write_atomic(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    write_atomic(p, "é\r\nline\n")              # text: UTF-8, line endings as given
    assert p.read_bytes() == "é\r\nline\n".encode()
    assert _leftovers(tmp_path) == []


def test_an_existing_file_keeps_its_mode_and_a_new_one_is_private(tmp_path):
    p = tmp_path / "script.sh"
    p.write_text("old")
    os.chmod(p, 0o751)
    write_atomic(p, "new")
    assert p.read_text() == "new" and p.stat().st_mode & 0o7777 == 0o751
    q = tmp_path / "fresh"
    write_atomic(q, b"x")
    assert q.stat().st_mode & 0o7777 == 0o600


def test_a_failed_write_leaves_the_old_contents_and_no_temporary_file(tmp_path):
    p = tmp_path / "state"
    write_atomic(p, b"old")
    with pytest.raises(RuntimeError, match="mid-write"):
        with open_atomic(p) as f:
            f.write(b"half")
            raise RuntimeError("mid-write")
    assert p.read_bytes() == b"old" and _leftovers(tmp_path) == []


def test_open_atomic_defaults_and_modes(tmp_path):
    p = tmp_path / "out"
    with open_atomic(p) as f:                  # default: binary
        f.write(b"abc")
    assert p.read_bytes() == b"abc"
    with open_atomic(p, "w", encoding="utf-8") as f:
        f.write("text")
    assert p.read_text() == "text"
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb', got 'a'"):
        with open_atomic(p, "a"):
            pass
    assert p.read_text() == "text"


def test_fsync_tree_and_fsync_dir(tmp_path):
    (tmp_path / "x").write_bytes(b"1")
    (tmp_path / "sub").mkdir()
    fsync_tree(tmp_path)                        # files and the folder; subfolders skipped
    fsync_dir(tmp_path / "missing")             # a folder that cannot be opened: nothing to do
