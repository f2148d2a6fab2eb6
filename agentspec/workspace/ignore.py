"""Which files a workspace ignores, and the relative paths the rules are asked about.

A path is ignored when a ``.gitignore`` file above it (each relative to its own folder) or the
global ignore list (``DEFAULT_IGNORE`` unless given) matches it or a folder above it, or when it is
one of the server's own files (``OwnedPath``: its config file, log folder, caches, snapshot folder),
which no tenant ever sees. Paths are relative to the workspace root, with forward slashes.

A symbolic link is followed only where it lands inside the root, on a path the rules keep
(``IgnoreRules.link_refusal``): a link to a file outside the workspace, to a gitignored file or to
one of the server's files, or to a folder holding one of them, is skipped with the reason, never
read. Whatever the links on the way, a file is read only if what was opened passes
``IgnoreRules.file_refusal`` (its real path, and its identity against the server's files).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_IGNORE", "OwnedPath", "ignore_checker", "is_ignored", "owned_rule"]

DEFAULT_IGNORE = (".git/", ".hg/", ".svn/", "node_modules/", "__pycache__/", ".venv/", "venv/", ".tox/",
                  ".mypy_cache/", ".pytest_cache/", ".ruff_cache/", "*.pyc", "*.so", "*.o", "*.a",
                  "*.dylib", "*.dll", "*.exe", "*.class", "*.jar", "*.whl", "*.zip", "*.tar", "*.gz",
                  "*.png", "*.jpg", "*.jpeg", "*.gif", "*.pdf", "*.ico", "*.gguf", "*.safetensors",
                  "*.bin", "*.pt", "*.npz", "*.npy", ".DS_Store")


@dataclass(frozen=True)
class OwnedPath:
    """A file or folder of the server's own (``rule`` names it: "config file", "log_dir", ...),
    resolved: it and everything under it are no tenant's."""

    rule: str
    path: Path

    @classmethod
    def of(cls, rule: str, path: str | os.PathLike) -> OwnedPath:
        return cls(rule, Path(path).expanduser().resolve())

    def covers(self, resolved: Path) -> bool:
        return resolved == self.path or resolved.is_relative_to(self.path)


def owned_rule(owned: Sequence[OwnedPath], *paths: Path) -> str | None:
    """The rule of the first server-owned path covering any of ``paths`` (absolute; each checked
    as given and resolved), or None."""
    for p in paths:
        candidates = {p}
        try:
            candidates.add(p.resolve())
        except (OSError, RuntimeError):
            pass
        for o in owned:
            if any(o.covers(c) for c in candidates):
                return o.rule
    return None


def owned_identity(owned: Sequence[OwnedPath], st: os.stat_result, real: Path, root: Path) -> str | None:
    """The rule of the server-owned path that the file ``st`` (whose real path is ``real``, inside
    ``root``), or a folder between it and ``root``, is by identity (device and inode), or None: a
    hard link to the config file, or another spelling of it on a case-insensitive file system,
    which comparing paths misses."""
    ids: dict[tuple[int, int], str] = {}
    for o in owned:   # stat now: an owned file written again by rename is another inode
        try:
            s = os.stat(o.path)
        except OSError:
            continue
        ids.setdefault((s.st_dev, s.st_ino), o.rule)
    if not ids:
        return None
    rule = ids.get((st.st_dev, st.st_ino))
    parent = real.parent
    while rule is None and parent != root and parent.is_relative_to(root):
        try:
            s = os.stat(parent)
        except OSError:
            break
        rule = ids.get((s.st_dev, s.st_ino))
        parent = parent.parent
    return rule


class IgnoreRules:
    """``.gitignore`` files (each relative to its folder) plus a global ignore list and the
    server's own paths. Each ``.gitignore`` is read once, when a path first needs it, and cached
    until ``forget``."""

    def __init__(self, root: Path, patterns: Sequence[str], owned: Sequence[OwnedPath] = ()):
        import pathspec

        self.root = root
        self.owned = tuple(owned)
        # the owned paths inside the root, relative: ignored by the walk, the watcher, overlays
        self._owned_rel = tuple(relative(root, o.path) for o in self.owned
                                if o.path != root and o.path.is_relative_to(root))
        self.base = pathspec.GitIgnoreSpec.from_lines(list(patterns))
        self._specs: dict[str, Any] = {}   # folder (relative, "" = root) -> spec or None
        # folder (relative) -> ignored: what ``ignored_file`` asks of every file's folders, each
        # folder's answer once (a file at depth d costs d folder checks, each ~d matches); dropped
        # with any ``.gitignore``'s rules, which may change it
        self._folders: dict[str, bool] = {}
        self._generation = 0
        self._lock = threading.Lock()

    def _spec(self, rel_dir: str):
        with self._lock:
            if rel_dir in self._specs:
                return self._specs[rel_dir]
        import pathspec

        spec = None
        try:
            text = (self.root / rel_dir / ".gitignore").read_text(encoding="utf-8", errors="replace")
            spec = pathspec.GitIgnoreSpec.from_lines(text.splitlines())
        except OSError:
            pass
        with self._lock:
            self._specs[rel_dir] = spec
        return spec

    def forget(self, rel_dir: str) -> None:
        """Read ``rel_dir``'s ``.gitignore`` again when next needed (it changed)."""
        with self._lock:
            self._specs.pop(rel_dir, None)
            self._folders.clear()
            self._generation += 1

    def clear(self) -> None:
        """Forget every folder's rules (the tree was replaced)."""
        with self._lock:
            self._specs.clear()
            self._folders.clear()
            self._generation += 1

    def _folder_ignored(self, rel_dir: str) -> bool:
        """``ignored(rel_dir, True)``, remembered until the rules change."""
        with self._lock:
            hit, generation = self._folders.get(rel_dir), self._generation
        if hit is None:
            hit = self.ignored(rel_dir, True)
            with self._lock:
                if generation == self._generation:   # not a rule set forgotten meanwhile
                    self._folders[rel_dir] = hit
        return hit

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """``rel``: a path relative to the root, with forward slashes."""
        if any(rel == o or rel.startswith(o + "/") for o in self._owned_rel):
            return True
        probe = rel + "/" if is_dir else rel
        if self.base.match_file(probe):
            return True
        parts = rel.split("/")
        for i in range(len(parts)):
            parent = "/".join(parts[:i])
            spec = self._spec(parent)
            if spec is not None:
                sub = "/".join(parts[i:]) + ("/" if is_dir else "")
                if spec.match_file(sub):
                    return True
        # a path inside an ignored folder is ignored
        for i in range(1, len(parts)):
            if self.base.match_file("/".join(parts[:i]) + "/"):
                return True
        return False

    def ignored_file(self, rel: str) -> bool:
        """The file ``rel`` (relative, forward slashes) or a folder above it is ignored: what the
        walk never reaches."""
        return self.ignored(rel, False) or any(self._folder_ignored(d) for d in parents(rel))

    def owned_rule(self, path: Path) -> str | None:
        """The rule of the server-owned path ``path`` (absolute; as given or resolved) falls
        under, or None."""
        return owned_rule(self.owned, path)

    def link_refusal(self, path: Path) -> str | None:
        """Why the symbolic link ``path`` must not be followed, or None (not a link, or a link
        to a kept path inside the root): it is broken or loops, lands outside the root, on an
        ignored path or on one of the server's own."""
        try:
            if not path.is_symlink():
                return None
            target = path.resolve(strict=True)
        except RuntimeError:   # Python 3.11: a loop
            return "symlink loop"
        except OSError as e:
            return "symlink loop" if e.errno == errno.ELOOP else "broken symlink"
        if target == self.root:
            return "symlink loop"
        if not target.is_relative_to(self.root):
            return "symlink out of the workspace"
        if owned_rule(self.owned, target):
            return "symlink to a server-owned path"
        # a folder holding one: the files under the link would be checked by their names through it
        if any(o.path.is_relative_to(target) for o in self.owned):
            return "symlink to a folder holding a server-owned path"
        trel = relative(self.root, target)
        if self.ignored(trel, target.is_dir()) or any(self.ignored(d, True) for d in parents(trel)):
            return "symlink to an ignored path"
        return None

    def file_refusal(self, real: Path) -> str | None:
        """Why the file whose real path is ``real`` (no links left in it) must not be read for a
        tenant, or None: outside the root, one of the server's own, or ignored (it or a folder
        above it). Asked of the file about to be read, whatever path led there, so a symlinked
        folder anywhere on the way cannot lead around the rules."""
        if real == self.root or not real.is_relative_to(self.root):
            return "symlink out of the workspace"
        if any(o.covers(real) for o in self.owned):
            return "symlink to a server-owned path"
        if self.ignored_file(relative(self.root, real)):
            return "symlink to an ignored path"
        return None

    def identity_refusal(self, real: Path, st: os.stat_result) -> str | None:
        """"another name for a server-owned path" when the file ``st`` (at ``real``) or a folder
        above it is one by identity (``owned_identity``: a hard link), else None."""
        return "another name for a server-owned path" if owned_identity(self.owned, st, real, self.root) else None


def ignore_checker(root: str | os.PathLike, ignore: Sequence[str] = DEFAULT_IGNORE,
                   owned: Sequence[OwnedPath] = ()) -> Callable[[str | os.PathLike], bool]:
    """``Workspace.ignored`` for a root without a ``Workspace`` (an SGLang backend's tenants): a
    function telling whether a workspace at ``root`` with the ignore list ``ignore`` ignores the
    file it is given (absolute or relative to ``root``; ValueError outside ``root``). Each
    ``.gitignore`` file is read once, when a path first needs it."""
    base = Path(root).resolve()
    rules = IgnoreRules(base, ignore, owned)
    return lambda path: rules.ignored_file(rel_under(base, path))


def is_ignored(root: str | os.PathLike, path: str | os.PathLike, ignore: Sequence[str] = DEFAULT_IGNORE) -> bool:
    """``ignore_checker(root, ignore)(path)``: one question, the ``.gitignore`` files read now."""
    return ignore_checker(root, ignore)(path)


def relative(root: Path, path: Path) -> str:
    """``path`` relative to ``root`` with forward slashes ("" for the root itself); a path
    outside ``root`` comes back whole (callers skip those: they start with "/" or "../")."""
    try:
        rel = path.relative_to(root).as_posix()
        return "" if rel == "." else rel
    except ValueError:
        return path.as_posix()


def rel_under(root: Path, path: str | os.PathLike) -> str:
    """``path`` (absolute or relative to ``root``), normalized without resolving symlinks, as a
    path relative to ``root`` with forward slashes; ValueError outside ``root`` (or ``root``)."""
    p = Path(path)
    p = Path(os.path.normpath(p if p.is_absolute() else root / p))
    try:
        rel = p.relative_to(root).as_posix()
    except ValueError:
        raise ValueError(f"{str(path)!r} is not under the workspace root {str(root)!r}") from None
    if rel in ("", "."):
        raise ValueError(f"{str(path)!r} is the workspace root {str(root)!r}, not a file under it")
    return rel


def parents(rel: str) -> list[str]:
    """The folders above a relative path, outermost first: ``a/b/c.py`` -> ``["a", "a/b"]``."""
    parts = rel.split("/")[:-1]
    return ["/".join(parts[:i + 1]) for i in range(len(parts))]
