"""Finding and reading a workspace's files.

``walk`` lists the files under the root that the ignore rules keep (a symbolic link is followed only
when it lands inside the root on a kept path, ``IgnoreRules.link_refusal``; a symlinked folder is
followed once: a loop or a second path to the same folder is skipped with a reason); ``read_text`` reads
one as UTF-8 text, or skips it with a reason (binary, oversized, not a regular file, unreadable,
vanished). Skips go to a callback, ``skip(rel, reason)``, where the workspace counts them.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from .ignore import IgnoreRules, relative

SNIFF_BYTES = 8192   # a NUL byte in the first this many bytes: a binary file

Skip = Callable[[str, str], None]   # (relative path, reason): a file or folder left out


def walk(root: Path, rules: IgnoreRules, skip: Skip) -> Iterator[tuple[str, Path]]:
    """(relative path, absolute path) of candidate files, in name order, folders depth first."""
    seen_dirs: set[tuple[int, int]] = set()
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            st = d.stat()
        except OSError as e:
            skip(relative(root, d), f"unreadable folder: {e.strerror or e}")
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen_dirs:
            loop = d.is_symlink() and d.resolve() in {p.resolve() for p in d.parents}
            skip(relative(root, d), "symlink loop" if loop else "duplicate folder (symlink)")
            continue
        seen_dirs.add(key)
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            skip(relative(root, d), f"unreadable folder: {e.strerror or e}")
            continue
        subdirs = []
        for entry in entries:
            path = Path(entry.path)
            rel = relative(root, path)
            try:
                is_dir = entry.is_dir(follow_symlinks=True)
            except OSError:
                is_dir = False
            if rules.ignored(rel, is_dir):
                continue
            linked = entry.is_symlink()
            if linked:
                refused = rules.link_refusal(path)
                if refused:
                    skip(rel, refused)
                    continue
            if is_dir:
                subdirs.append(path)
            else:
                yield rel, path.resolve() if linked else path   # read what was checked
        stack.extend(reversed(subdirs))


def walk_under(root: Path, folder: Path, rules: IgnoreRules) -> Iterator[tuple[str, Path]]:
    """The files under ``folder`` (inside ``root``) that the rules keep, without skip reasons:
    the watcher's look at a folder that appeared or whose ``.gitignore`` changed."""
    for dirpath, dirnames, filenames in os.walk(folder):
        base = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not rules.ignored(relative(root, base / d), True)]
        for name in filenames:
            rel = relative(root, base / name)
            if not rules.ignored(rel, False) and not rules.link_refusal(base / name):
                yield rel, base / name


def read_text(rel: str, path: Path, *, max_bytes: int, skip: Skip) -> tuple[str, os.stat_result] | None:
    """The file's text and the stat taken before reading it, or None (skipped with the reason)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        skip(rel, "vanished before it was read" if not path.is_symlink() else "broken symlink")
        return None
    except OSError as e:
        skip(rel, "symlink loop" if e.errno == 40 else f"unreadable: {e.strerror or e}")
        return None
    if not stat.S_ISREG(st.st_mode):
        skip(rel, "not a regular file")
        return None
    if st.st_size > max_bytes:
        skip(rel, f"over {max_bytes} bytes")
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        skip(rel, "vanished before it was read")
        return None
    except OSError as e:
        skip(rel, f"unreadable: {e.strerror or e}")
        return None
    if b"\0" in data[:SNIFF_BYTES]:
        skip(rel, "binary")
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        skip(rel, "binary")   # not UTF-8 text
        return None
    return text, st
