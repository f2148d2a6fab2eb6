"""Crash-safe file writes, shared by the suffix index and agentspec.

``write_atomic`` / ``open_atomic`` replace a file's contents so that a crash (or power loss)
leaves either the old contents or the new, never a mix: the data goes to a temporary file in
the same folder, is flushed and fsynced, renamed over the target (``os.replace``), and the
folder is fsynced so the rename itself is durable. ``fsync_dir`` and ``fsync_tree`` serve
callers that publish a whole folder by renaming it.

Standard library only, and inside ``suffix_index`` because the index imports nothing from
``agentspec`` while ``agentspec`` already depends on the index: one copy both can import.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["fsync_dir", "fsync_tree", "open_atomic", "write_atomic"]


@contextmanager
def open_atomic(path: str | os.PathLike, mode: str = "wb", *, encoding: str | None = None,
                newline: str | None = None) -> Iterator[IO[Any]]:
    """A file to write the new contents of ``path`` into; on a clean exit it replaces ``path``
    (fsync, rename, fsync of the folder), on an exception ``path`` is left untouched and the
    temporary file removed. ``mode``: ``"wb"`` or ``"w"`` (text: ``encoding`` and ``newline``
    as for ``open``). An existing ``path`` keeps its permission bits; a new one gets 0o600."""
    if mode not in ("w", "wb"):
        raise ValueError(f"open_atomic mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    try:
        perms = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        perms = None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, encoding=encoding, newline=newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if perms is not None:
            os.chmod(tmp, perms)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace ``path``'s contents with ``data`` (``str`` is written as UTF-8, line endings as
    given) through ``open_atomic``."""
    if isinstance(data, str):
        with open_atomic(path, "w", encoding="utf-8", newline="") as f:
            f.write(data)
    else:
        with open_atomic(path, "wb") as f:
            f.write(data)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of folder ``path`` (a file created or renamed in it) durable. Where a
    folder cannot be opened or fsynced (Windows, some network file systems) this does nothing:
    the data itself was already fsynced."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file directly in folder ``path``, then the folder: call it before renaming a
    freshly written folder into place."""
    for entry in Path(path).iterdir():
        if entry.is_file():
            with open(entry, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)
