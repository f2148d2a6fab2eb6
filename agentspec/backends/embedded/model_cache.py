"""The converted-weight cache: GGUF files dequantized once, memory-mapped by every later start.

Entries live in ``cache_root()/models``, one folder each, named by the source file's stem, the
sha256 of its content and the converter's version (``weights.CONVERT_VERSION``): every checkout,
virtual environment or copy of the same file shares one entry, and a new converter makes a new
one. Hashing a multi-gigabyte file at every start would cost seconds, so ``sources.json`` remembers
each path's (size, mtime, inode) and the digest they gave; a file is hashed again only when one of
those changes.

The cache is bounded: after a conversion the least recently used entries are removed until the
total fits ``AGENTSPEC_CACHE_MAX_GB`` (default 20; the entry being loaded is never removed, however
large). An entry's ``last_used`` file is touched at every load. Half-written conversions left by a
crash (``*.tmp-*`` folders) are removed once they are an hour old. ``agentspec cache list`` and
``agentspec cache clear`` show and empty it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import ModelLoadError
from ..files import read_json_object, write_json_atomic

__all__ = ["CacheEntry", "cache_limit_bytes", "clear", "content_digest", "entries", "entry_dir", "evict",
           "models_dir", "summary", "touch"]

DEFAULT_LIMIT_GB = 20.0
SOURCES = "sources.json"
META = "source.json"
LAST_USED = "last_used"
TMP_MARK = ".tmp-"
STALE_TMP_S = 3600.0


def models_dir() -> Path:
    from .weights import cache_root

    return cache_root() / "models"


def cache_limit_bytes() -> int:
    """``AGENTSPEC_CACHE_MAX_GB`` (gigabytes, 10^9 bytes) or the default; a bad value is an error
    naming it."""
    raw = os.environ.get("AGENTSPEC_CACHE_MAX_GB")
    if raw is None or raw.strip() == "":
        return int(DEFAULT_LIMIT_GB * 1e9)
    try:
        gb = float(raw)
    except ValueError:
        gb = -1.0
    if not gb >= 0:
        raise ModelLoadError(f"AGENTSPEC_CACHE_MAX_GB={raw!r}: give the model cache's size limit in gigabytes, "
                             "a number >= 0 (e.g. 20)")
    return int(gb * 1e9)


def _fingerprint(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _read_json(path: Path) -> dict:
    return read_json_object(path)


def _write_json(path: Path, data: dict) -> None:
    write_json_atomic(path, data, tmp_mark=TMP_MARK)


def content_digest(path: Path, *, quiet: bool = True) -> str:
    """The sha256 of ``path``'s bytes: remembered per (path, size, mtime, inode), computed when
    those are new (with a progress bar for files over 256 MB)."""
    path = path.resolve()
    fp = _fingerprint(path)
    index_file = models_dir() / SOURCES
    known = _read_json(index_file).get(str(path))
    if isinstance(known, dict) and all(known.get(k) == v for k, v in fp.items()) and isinstance(known.get("sha256"), str):
        return known["sha256"]
    h = hashlib.sha256()
    show = not quiet and fp["size"] > 256 * 1024 * 1024
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=fp["size"], unit="B", unit_scale=True, desc=f"hashing {path.name}", file=sys.stderr)
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    if bar is not None:
        bar.close()
    digest = h.hexdigest()
    index = _read_json(index_file)   # read again: another process may have added its own paths
    index[str(path)] = {**fp, "sha256": digest}
    _write_json(index_file, index)
    return digest


def entry_dir(path: Path, convert_version: int, *, quiet: bool = True) -> Path:
    """The cache folder for ``path``'s content under converter ``convert_version``."""
    digest = content_digest(path, quiet=quiet)
    return models_dir() / f"{path.stem}-{digest[:16]}-v{convert_version}"


def record_source(entry: Path, source: Path, digest: str | None = None) -> None:
    """Note in the entry which file it was converted from (shown by ``agentspec cache list``)."""
    meta = _read_json(entry / META)
    sources = [s for s in meta.get("sources", []) if s != str(source.resolve())]
    meta["sources"] = [str(source.resolve()), *sources][:8]
    if digest:
        meta["sha256"] = digest
    _write_json(entry / META, meta)


def touch(entry: Path) -> None:
    """Mark ``entry`` used now (least-recently-used eviction reads this)."""
    stamp = entry / LAST_USED
    try:
        stamp.touch()
        os.utime(stamp)
    except OSError:
        pass


@dataclass(frozen=True)
class CacheEntry:
    name: str
    path: Path
    bytes: int
    last_used: float          # seconds since the epoch
    sources: tuple[str, ...]  # the files it was converted from, most recent first
    complete: bool            # False: a conversion in progress or left by a crash

    def to_dict(self) -> dict:
        return {"name": self.name, "path": str(self.path), "bytes": self.bytes, "last_used": self.last_used,
                "sources": list(self.sources), "complete": self.complete}


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _last_used(path: Path) -> float:
    for p in (path / LAST_USED, path / "config.json", path):
        try:
            return p.stat().st_mtime
        except OSError:
            continue
    return 0.0


def entries(root: Path | None = None) -> list[CacheEntry]:
    """Every folder in the cache, most recently used first (older layouts included: they are
    listed and evicted like the others)."""
    root = models_dir() if root is None else root
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if not p.is_dir() or p.is_symlink():
            continue
        meta = _read_json(p / META)
        out.append(CacheEntry(name=p.name, path=p, bytes=_tree_bytes(p), last_used=_last_used(p),
                              sources=tuple(meta.get("sources", ())), complete=TMP_MARK not in p.name
                              and (p / "config.json").is_file()))
    out.sort(key=lambda e: -e.last_used)
    return out


def _remove(path: Path) -> None:
    """Rename aside, then delete: a reader never sees half an entry under its real name. Another
    process that has the entry's files memory-mapped keeps them until it closes them."""
    try:
        aside = path.with_name(f"{path.name}{TMP_MARK}removing-{os.getpid()}-{time.monotonic_ns()}")
        os.rename(path, aside)
    except OSError:
        aside = path
    shutil.rmtree(aside, ignore_errors=True)


def evict(limit: int | None = None, *, keep: tuple[Path, ...] = (), now: float | None = None) -> list[CacheEntry]:
    """Remove least recently used entries until the cache's total is at most ``limit`` bytes
    (default ``cache_limit_bytes()``), never those in ``keep``; also half-written folders older
    than an hour. Returns what was removed."""
    limit = cache_limit_bytes() if limit is None else limit
    now = time.time() if now is None else now
    kept = {p.resolve() for p in keep}
    removed = []
    current = entries()
    for e in current:
        if not e.complete and TMP_MARK in e.name and now - e.last_used > STALE_TMP_S:
            _remove(e.path)
            removed.append(e)
    current = [e for e in current if e not in removed]
    total = sum(e.bytes for e in current)
    for e in reversed(current):   # least recently used first
        if total <= limit:
            break
        if e.path.resolve() in kept or not e.complete:
            continue
        _remove(e.path)
        removed.append(e)
        total -= e.bytes
    return removed


def clear(names: list[str] | None = None) -> list[CacheEntry]:
    """Remove the named entries (all complete ones when ``names`` is None or empty); an unknown
    name is an error naming it and what exists."""
    current = {e.name: e for e in entries()}
    if names:
        unknown = [n for n in names if n not in current]
        if unknown:
            have = ", ".join(sorted(current)) or "none"
            raise ModelLoadError(f"no model cache entry named {', '.join(map(repr, unknown))} "
                                 f"(entries: {have}; `agentspec cache list` shows them)")
        chosen = [current[n] for n in names]
    else:
        chosen = list(current.values())
    for e in chosen:
        _remove(e.path)
    if not names:
        try:
            (models_dir() / SOURCES).unlink()
        except OSError:
            pass
    return chosen


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.1f} MB"


def summary() -> str:
    """One line for the start-up output: what the cache holds against its limit, and where."""
    es = entries()
    total = sum(e.bytes for e in es)
    try:
        limit = _gb(cache_limit_bytes())
    except ModelLoadError:
        limit = "an invalid limit (AGENTSPEC_CACHE_MAX_GB)"
    return (f"model cache: {len(es)} entr{'y' if len(es) == 1 else 'ies'}, {_gb(total)} of {limit} "
            f"at {models_dir()} (agentspec cache list | clear)")
