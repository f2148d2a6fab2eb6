"""Finding and reading a workspace's files.

``walk`` lists the files under the root that the ignore rules keep (a symbolic link is followed only
when it lands inside the root on a kept path, ``IgnoreRules.link_refusal``; a symlinked folder is
followed once: a loop or a second path to the same folder is skipped with a reason); ``read_text`` reads
one as UTF-8 text, or skips it with a reason (binary, oversized, not a regular file, unreadable,
vanished, or leading where the rules refuse). Skips go to a callback, ``skip(rel, reason)``, where the
workspace counts them.

Checking a path and then opening it by name again is a race: a folder on the way can become a
symlink in between. So a file is opened once (``read_opened``), what was opened is checked (its real
path per the descriptor, its identity) and the text is read from that descriptor.
"""

from __future__ import annotations

import errno
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
    the watcher's look at a folder that appeared or whose ``.gitignore`` changed. A ``folder``
    that is a symlink the rules refuse (made after start: ``ln -s / x``) gives nothing; os.walk
    would follow it."""
    if rules.link_refusal(folder):
        return
    for dirpath, dirnames, filenames in os.walk(folder):
        base = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not rules.ignored(relative(root, base / d), True)]
        for name in filenames:
            rel = relative(root, base / name)
            if not rules.ignored(rel, False) and not rules.link_refusal(base / name):
                yield rel, base / name


def read_opened(path: Path, limit: int | None = None) -> tuple[Path, os.stat_result, bytes | None]:
    """Open ``path`` (resolved: no symlink in it) once and read it from that descriptor: what was
    opened (its real path per the descriptor, ``/proc/self/fd``, or ``path`` itself where there is
    none), its stat, and up to ``limit`` bytes (None: all; None for data when it is no regular file,
    which is not read). A final component that became a symlink is not followed (ELOOP); a folder
    on the way that did shows in the real path, which the caller checks before using the bytes.
    Non-blocking: a FIFO opens at once. FileNotFoundError when the file vanished meanwhile; other
    OSErrors as ``os.open`` / ``os.read``."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        try:
            real = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:   # no /proc (not Linux, or not mounted): the path checked is what was opened
            real = path
        if real.name.endswith(" (deleted)") and os.fstat(fd).st_nlink == 0:
            raise FileNotFoundError(errno.ENOENT, "vanished while it was opened", str(path))
        if not stat.S_ISREG(st.st_mode):
            return real, st, None
        parts, got = [], 0
        while limit is None or got < limit:
            b = os.read(fd, 1 << 20 if limit is None else min(limit - got, 1 << 20))
            if not b:
                break
            parts.append(b)
            got += len(b)
        return real, st, b"".join(parts)
    finally:
        os.close(fd)


def read_text(rel: str, path: Path, *, rules: IgnoreRules, max_bytes: int,
              skip: Skip) -> tuple[str, os.stat_result] | None:
    """The file's text and its stat (taken from the descriptor before reading), or None (skipped
    with the reason). Read only when the file opened passes ``rules.file_refusal``: a symlinked
    folder on the way (``a-link -> deploy``, made at any time) cannot bring in a file outside the
    root, an ignored one or one of the server's own."""
    try:
        real = path.resolve(strict=True)
        st = real.stat()   # before opening: a FIFO or device is never opened
    except FileNotFoundError:
        skip(rel, "vanished before it was read" if not path.is_symlink() else "broken symlink")
        return None
    except RuntimeError:   # Python 3.11: a loop
        skip(rel, "symlink loop")
        return None
    except OSError as e:
        skip(rel, "symlink loop" if e.errno == errno.ELOOP else f"unreadable: {e.strerror or e}")
        return None
    refused = rules.file_refusal(real)
    if refused:
        skip(rel, refused)
        return None
    if not stat.S_ISREG(st.st_mode):
        skip(rel, "not a regular file")
        return None
    if st.st_size > max_bytes:
        skip(rel, f"over {max_bytes} bytes")
        return None
    try:
        opened, st, data = read_opened(real, max_bytes + 1)
    except FileNotFoundError:
        skip(rel, "vanished before it was read")
        return None
    except OSError as e:
        skip(rel, f"unreadable: {e.strerror or e}")
        return None
    # what was opened is what was read: a folder on the way may have become a link since the checks
    refused = (rules.file_refusal(opened) if opened != real else None) or rules.identity_refusal(opened, st)
    if refused:
        skip(rel, refused)
        return None
    if data is None:
        skip(rel, "not a regular file")
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
