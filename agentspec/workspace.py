"""A repository, indexed for drafting and kept current while it is edited.

``Workspace(root)`` walks the tree (respecting ``.gitignore`` files and an ignore list; binary,
oversized, non-regular, unreadable and vanished files are skipped with a reason), cuts files at
definition boundaries (``agentspec.chunking``), tokenizes the chunks with the engine's tokenizer
and adds them as documents of its tenant to a ``suffix_index.SuffixIndex``. With ``watch=True`` a
watchdog observer feeds file events to a queue; one updater thread drains it, coalesces bursts
and re-indexes only the chunks that changed. Nothing on a request's path touches the file
system: requests only read the index.

    with agentspec.Workspace(".", tokenizer=engine.tokenizer) as ws:
        engine = agentspec.Engine.embedded(workspace=ws)

With ``snapshot=DIR`` the index and a manifest (path -> size, mtime, hash, chunk ids) are
written atomically by ``save()`` and at ``close()``, and loaded at start; files changed since
are re-indexed.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from suffix_index.atomic import write_atomic

from .chunking import chunk_text

__all__ = ["Workspace", "DEFAULT_IGNORE", "ignore_checker", "is_ignored"]

DEFAULT_IGNORE = (".git/", ".hg/", ".svn/", "node_modules/", "__pycache__/", ".venv/", "venv/", ".tox/",
                  ".mypy_cache/", ".pytest_cache/", ".ruff_cache/", "*.pyc", "*.so", "*.o", "*.a",
                  "*.dylib", "*.dll", "*.exe", "*.class", "*.jar", "*.whl", "*.zip", "*.tar", "*.gz",
                  "*.png", "*.jpg", "*.jpeg", "*.gif", "*.pdf", "*.ico", "*.gguf", "*.safetensors",
                  "*.bin", "*.pt", "*.npz", "*.npy", ".DS_Store")
SNIFF_BYTES = 8192
MANIFEST_VERSION = 1
# A file whose mtime is this close to the moment it was read may be written again without its
# (size, mtime) changing (coarse file-system clocks: 1-2 s on some; a clock tick on others), so
# that pair does not prove it unchanged: its next event re-reads it and compares the hash.
RACY_NS = 2_000_000_000


class _Ignore:
    """``.gitignore`` files (each relative to its folder) plus a global ignore list."""

    def __init__(self, root: Path, patterns: Sequence[str]):
        import pathspec

        self.root = root
        self.base = pathspec.GitIgnoreSpec.from_lines(list(patterns))
        self._specs: dict[str, Any] = {}   # folder (relative, "" = root) -> spec or None
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
        with self._lock:
            self._specs.pop(rel_dir, None)

    def clear(self) -> None:
        """Forget every folder's rules (the tree was replaced)."""
        with self._lock:
            self._specs.clear()

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """``rel``: a path relative to the root, with forward slashes."""
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
        return self.ignored(rel, False) or any(self.ignored(d, True) for d in _parents(rel))


def ignore_checker(root: str | os.PathLike,
                   ignore: Sequence[str] = DEFAULT_IGNORE) -> Callable[[str | os.PathLike], bool]:
    """``Workspace.ignored`` for a root without a ``Workspace`` (an SGLang backend's tenants): a
    function telling whether a workspace at ``root`` with the ignore list ``ignore`` ignores the
    file it is given (absolute or relative to ``root``; ValueError outside ``root``). Each
    ``.gitignore`` file is read once, when a path first needs it."""
    base = Path(root).resolve()
    rules = _Ignore(base, ignore)
    return lambda path: rules.ignored_file(_rel_under(base, path))


def is_ignored(root: str | os.PathLike, path: str | os.PathLike, ignore: Sequence[str] = DEFAULT_IGNORE) -> bool:
    """``ignore_checker(root, ignore)(path)``: one question, the ``.gitignore`` files read now."""
    return ignore_checker(root, ignore)(path)


def _rel_under(root: Path, path: str | os.PathLike) -> str:
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


class Workspace:
    """A repository indexed into a ``SuffixIndex`` for one tenant, optionally watched.

    Options:
      tenant: whose requests may draft from these files (default "default").
      watch: follow edits with a watchdog observer (default True).
      tokenizer: the engine's tokenizer (``engine.tokenizer``); default the bundled model's.
      index: a ``SuffixIndex`` to add to (default: a new one; ``ws.index``).
      ignore: patterns (gitignore syntax) ignored besides ``.gitignore`` files.
      max_file_bytes: larger files are skipped (default 1 MB).
      max_chunk_lines: chunk size cap in lines (default 80).
      snapshot: a folder for the persisted index (loaded at start, written by save()/close()).
      progress: show a progress bar while indexing (default: when stderr is a terminal).
      debounce: seconds to wait for a burst of events to settle before re-indexing (default 0.02).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        tenant: str = "default",
        watch: bool = True,
        tokenizer: Any = None,
        index: Any = None,
        ignore: Sequence[str] = DEFAULT_IGNORE,
        max_file_bytes: int = 1 << 20,
        max_chunk_lines: int = 80,
        snapshot: str | os.PathLike | None = None,
        progress: bool | None = None,
        debounce: float = 0.02,
    ) -> None:
        from suffix_index import SuffixIndex

        root_path = Path(root)
        if not root_path.is_dir():
            raise ValueError(f"workspace root is not a directory: {str(root)!r}")
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")
        if max_file_bytes < 1 or max_chunk_lines < 1:
            raise ValueError(f"max_file_bytes and max_chunk_lines must be >= 1, got {max_file_bytes}, {max_chunk_lines}")
        self.root = root_path.resolve()
        self.tenant = tenant
        if tokenizer is None:
            from .engine.weights import load_checkpoint

            tokenizer = load_checkpoint(quiet=True).tokenizer
        self.tokenizer = tokenizer
        self.index = index if index is not None else SuffixIndex(vocab_size=getattr(tokenizer, "vocab_size", None))
        self.max_file_bytes = int(max_file_bytes)
        self.max_chunk_lines = int(max_chunk_lines)
        self.snapshot = Path(snapshot) if snapshot is not None else None
        self.debounce = float(debounce)
        self._ignore = _Ignore(self.root, ignore)
        self._prefix = f"ws\x1f{tenant}\x1f{self.root}\x1f"
        self._files: dict[str, dict] = {}     # rel path -> {"size", "mtime_ns", "sha", "docs": [ids]}
        self._overlays: dict[str, int] = {}   # rel path -> overlay generation (an editor's unsaved text)
        self._lock = threading.RLock()        # guards _files and index updates from this workspace
        self.skipped: Counter[str] = Counter()
        self.skipped_paths: dict[str, str] = {}
        # snapshot_refused: why a snapshot there was not loaded (damaged, another version), or None
        self.stats = {"seconds": 0.0, "loaded_from_snapshot": False, "snapshot_refused": None}
        self.updates = 0                      # files re-indexed by the watcher
        self._queue: queue.Queue = queue.Queue()
        self._busy = threading.Event()
        self._closed = False
        self._observer = None
        self._thread = None
        if progress is None:
            progress = sys.stderr.isatty()
        t0 = time.perf_counter()
        self._started = False
        if watch:   # watching before the scan: a file written while the scan reads it is queued and read again
            self._start_watching()
        try:
            if self.snapshot is not None:
                self._load_snapshot()
            self._scan(progress)
        except BaseException:
            self.close()   # no observer left behind by a failed start
            raise
        self.stats["seconds"] = time.perf_counter() - t0
        self._started = True
        if watch:   # the updater only now: it must not index a file while the scan does
            self._thread = threading.Thread(target=self._updater, name="agentspec-workspace", daemon=True)
            self._thread.start()

    # ---- public -------------------------------------------------------------------------------

    def summary(self) -> dict:
        """Files, chunks, tokens, skipped files by reason, seconds, index bytes."""
        with self._lock:
            chunks = sum(len(f["docs"]) for f in self._files.values())
            tokens = sum(f.get("tokens", 0) for f in self._files.values())
            return {"root": str(self.root), "tenant": self.tenant, "files": len(self._files), "chunks": chunks,
                    "tokens": tokens, "skipped": dict(self.skipped), "seconds": round(self.stats["seconds"], 3),
                    "tokens_per_s": round(tokens / self.stats["seconds"], 1) if self.stats["seconds"] else None,
                    "index_bytes": self.index.nbytes, "loaded_from_snapshot": self.stats["loaded_from_snapshot"],
                    "snapshot_refused": self.stats["snapshot_refused"]}

    def files(self) -> list[str]:
        with self._lock:
            return sorted(self._files)

    def wait_idle(self, timeout: float = 5.0, settle: float = 0.05) -> bool:
        """Block until the watcher has applied every event and none arrived for ``settle``
        seconds (file events reach the observer a little after the write; for tests)."""
        deadline = time.monotonic() + timeout
        quiet_since = None
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0 and not self._busy.is_set():
                now = time.monotonic()
                if quiet_since is None:
                    quiet_since = now
                elif now - quiet_since >= settle:
                    return True
            else:
                quiet_since = None
            time.sleep(0.002)
        return False

    def overlay(self, path: str | os.PathLike, text: str) -> bool:
        """Index ``text`` as the content of ``path`` (an editor's unsaved buffer) instead of the
        file on disk, until ``drop_overlay(path)``: drafts come from what the user sees, and the
        watcher leaves the path alone meanwhile. ``path``: absolute or relative to the root; it
        need not exist on disk yet. Only the chunks that changed are tokenized again, so calling
        this on every keystroke of a large file is cheap. Returns False (nothing indexed) for a
        path the workspace ignores (``.gitignore``, the ignore list) or text over
        ``max_file_bytes``; raises ``ValueError`` for a path outside the root."""
        rel = self._overlay_rel(path)
        if not isinstance(text, str):
            raise TypeError(f"overlay text must be a str, got {type(text).__name__}")
        if self._ignore.ignored(rel, False) or any(self._ignore.ignored(d, True) for d in _parents(rel)):
            return False
        data = text.encode("utf-8", "surrogatepass")
        with self._lock:
            self._overlays[rel] = self._overlays.get(rel, 0) + 1
            if len(data) > self.max_file_bytes:
                self._forget(rel)
                return False
            sha = hashlib.sha1(data).hexdigest()
            old = self._files.get(rel)
            if old is not None and old["sha"] == sha:
                return True
            chunks = chunk_text(text, rel, max_lines=self.max_chunk_lines)
            self._replace_chunks(rel, chunks, size=len(data), mtime_ns=-1, sha=sha)
            return True

    def drop_overlay(self, path: str | os.PathLike) -> None:
        """Stop shadowing ``path``: the file on disk is indexed again (or forgotten if gone)."""
        rel = self._overlay_rel(path)
        with self._lock:
            if self._overlays.pop(rel, None) is None:
                return
            self._forget(rel)
        self._apply({str(self.root / rel)})

    def overlays(self) -> list[str]:
        """Relative paths currently shadowed by ``overlay``."""
        with self._lock:
            return sorted(self._overlays)

    def ignored(self, path: str | os.PathLike) -> bool:
        """Whether the workspace ignores the file ``path`` (absolute or relative to the root;
        normalized, symlinks not followed): matched by a ``.gitignore`` file or the ignore list
        (``DEFAULT_IGNORE`` unless given), or inside an ignored folder (``.git/``, ``.venv/``, a
        gitignored ``build/``). Such files are never indexed, and ``POST /v1/apply`` refuses them
        (403). ValueError for a path outside the root."""
        return self._ignore.ignored_file(_rel_under(self.root, path))

    def _overlay_rel(self, path: str | os.PathLike) -> str:
        p = Path(path)
        if not p.is_absolute():
            p = self.root / p
        p = Path(os.path.normpath(p))
        rel = self._rel(p)
        if not rel or rel.startswith("../") or rel.startswith("/") or Path(rel).is_absolute():
            raise ValueError(f"{str(path)!r} is not a file under the workspace root {str(self.root)!r}")
        return rel

    def save(self) -> None:
        """Write the snapshot (index + manifest) atomically, if ``snapshot`` was given."""
        if self.snapshot is None:
            raise ValueError("this workspace has no snapshot folder (Workspace(..., snapshot=DIR))")
        self.snapshot.mkdir(parents=True, exist_ok=True)
        with self._lock:
            index_path = self.snapshot / "index.bin"
            self.index.save(index_path)
            digest = _file_sha(index_path)
            manifest = {"version": MANIFEST_VERSION, "root": str(self.root), "tenant": self.tenant,
                        "tokenizer": self._tokenizer_id(),
                        "index_sha256": digest, "files": self._files}
            write_atomic(self.snapshot / "manifest.json", json.dumps(manifest).encode())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
        if self.snapshot is not None and self._started:   # (not after a start that failed)
            self.save()

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- scanning -----------------------------------------------------------------------------

    def _walk(self) -> Iterable[tuple[str, Path]]:
        """(relative path, absolute path) of candidate files; skips are counted."""
        seen_dirs: set[tuple[int, int]] = set()
        stack = [self.root]
        while stack:
            d = stack.pop()
            try:
                st = d.stat()
            except OSError as e:
                self._skip(self._rel(d), f"unreadable folder: {e.strerror or e}")
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen_dirs:
                loop = d.is_symlink() and d.resolve() in {p.resolve() for p in d.parents}
                self._skip(self._rel(d), "symlink loop" if loop else "duplicate folder (symlink)")
                continue
            seen_dirs.add(key)
            try:
                with os.scandir(d) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError as e:
                self._skip(self._rel(d), f"unreadable folder: {e.strerror or e}")
                continue
            subdirs = []
            for entry in entries:
                path = Path(entry.path)
                rel = self._rel(path)
                try:
                    is_dir = entry.is_dir(follow_symlinks=True)
                except OSError:
                    is_dir = False
                if self._ignore.ignored(rel, is_dir):
                    continue
                if is_dir:
                    subdirs.append(path)
                else:
                    yield rel, path
            stack.extend(reversed(subdirs))

    def _scan(self, progress: bool) -> None:
        listed = list(self._walk())
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(listed), unit="file", desc=f"indexing {self.root.name}", file=sys.stderr)
        present = set()
        batch: list[tuple[str, Path]] = []
        for rel, path in listed:
            present.add(rel)
            batch.append((rel, path))
            if len(batch) >= 64:
                self._index_files(batch)
                if bar is not None:
                    bar.update(len(batch))
                batch = []
        if batch:
            self._index_files(batch)
            if bar is not None:
                bar.update(len(batch))
        if bar is not None:
            bar.close()
        with self._lock:   # files in a loaded snapshot that are gone now
            for rel in [r for r in self._files if r not in present]:
                self._forget(rel)

    def _read(self, rel: str, path: Path) -> tuple[str, os.stat_result] | None:
        """The file's text, or None (counted as skipped with the reason)."""
        try:
            st = path.stat()
        except FileNotFoundError:
            self._skip(rel, "vanished before it was read" if not path.is_symlink() else "broken symlink")
            return None
        except OSError as e:
            self._skip(rel, "symlink loop" if e.errno == 40 else f"unreadable: {e.strerror or e}")
            return None
        if not stat.S_ISREG(st.st_mode):
            self._skip(rel, "not a regular file")
            return None
        if st.st_size > self.max_file_bytes:
            self._skip(rel, f"over {self.max_file_bytes} bytes")
            return None
        try:
            with open(path, "rb") as f:
                data = f.read(self.max_file_bytes + 1)
        except FileNotFoundError:
            self._skip(rel, "vanished before it was read")
            return None
        except OSError as e:
            self._skip(rel, f"unreadable: {e.strerror or e}")
            return None
        if b"\0" in data[:SNIFF_BYTES]:
            self._skip(rel, "binary")
            return None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            self._skip(rel, "binary")   # not UTF-8 text
            return None
        return text, st

    def _index_files(self, batch: Sequence[tuple[str, Path]]) -> None:
        """Read, chunk, tokenize (batched) and index files; unchanged files are left alone."""
        work = []
        for rel, path in batch:
            with self._lock:
                old = self._files.get(rel)
            if old is not None and not old.get("racy"):
                try:
                    st = path.stat()
                    if st.st_size == old["size"] and st.st_mtime_ns == old["mtime_ns"]:
                        continue   # unchanged since the snapshot / last index
                except OSError:
                    pass
            got = self._read(rel, path)
            if got is None:
                with self._lock:
                    if rel not in self._overlays:
                        self._forget(rel)
                continue
            text, st = got
            racy = st.st_mtime_ns >= time.time_ns() - RACY_NS   # (size, mtime) may not see the next write
            sha = hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()
            if old is not None and old["sha"] == sha:
                with self._lock:
                    old["size"], old["mtime_ns"] = st.st_size, st.st_mtime_ns
                    _set_racy(old, racy)
                continue
            self.skipped_paths.pop(rel, None)
            chunks = chunk_text(text, rel, max_lines=self.max_chunk_lines)
            work.append((rel, st, sha, chunks, racy))
        if not work:
            return
        flat = [c for _, _, _, chunks, _ in work for c in chunks]
        ids = self.tokenizer.encode_batch(flat) if flat else []
        k = 0
        for rel, st, sha, chunks, racy in work:
            toks = ids[k:k + len(chunks)]
            k += len(chunks)
            self._replace(rel, st, sha, chunks, toks)
            with self._lock:
                f = self._files.get(rel)
                if f is not None and f["sha"] == sha:
                    _set_racy(f, racy)

    def _replace(self, rel: str, st, sha: str, chunks: list[str], toks: list[list[int]]) -> None:
        """Swap a file's documents for its new chunks, keeping the chunks that did not change."""
        with self._lock:
            if rel in self._overlays:
                return   # an overlay arrived while the disk copy was read: the editor's text wins
            old = self._files.get(rel)
            old_docs = set(old["docs"]) if old else set()
            docs, seen = [], Counter()
            for chunk, ids in zip(chunks, toks):
                h = hashlib.sha1(chunk.encode("utf-8", "surrogatepass")).hexdigest()[:16]
                seen[h] += 1
                doc_id = f"{self._prefix}{rel}\x1f{h}\x1f{seen[h]}"
                docs.append(doc_id)
                if doc_id not in old_docs and ids:
                    self.index.add_document(doc_id, ids, tenant=self.tenant)
            for doc_id in old_docs - set(docs):
                self.index.remove_document(doc_id)
            self._files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha": sha, "docs": docs,
                                "doc_tokens": [len(t) for t in toks], "tokens": sum(len(t) for t in toks)}

    def _replace_chunks(self, rel: str, chunks: list[str], *, size: int, mtime_ns: int, sha: str) -> None:
        """``_replace`` for one file's text (overlays): chunks whose document is already indexed
        keep it and are not tokenized again. Call with ``_lock`` held."""
        old = self._files.get(rel)
        old_docs = dict(zip(old["docs"], old.get("doc_tokens") or [None] * len(old["docs"]))) if old else {}
        docs, counts, seen, new = [], [], Counter(), []
        for chunk in chunks:
            h = hashlib.sha1(chunk.encode("utf-8", "surrogatepass")).hexdigest()[:16]
            seen[h] += 1
            doc_id = f"{self._prefix}{rel}\x1f{h}\x1f{seen[h]}"
            docs.append(doc_id)
            counts.append(old_docs.get(doc_id))
            if doc_id not in old_docs:
                new.append((len(docs) - 1, chunk))
        ids = self.tokenizer.encode_batch([c for _, c in new]) if new else []
        for (i, _), toks in zip(new, ids):
            counts[i] = len(toks)
            if toks:
                self.index.add_document(docs[i], toks, tenant=self.tenant)
        for doc_id in set(old_docs) - set(docs):
            self.index.remove_document(doc_id)
        self._files[rel] = {"size": size, "mtime_ns": mtime_ns, "sha": sha, "docs": docs,
                            "doc_tokens": [c or 0 for c in counts], "tokens": sum(c or 0 for c in counts)}

    def _forget(self, rel: str) -> None:
        old = self._files.pop(rel, None)
        if old:
            for doc_id in old["docs"]:
                self.index.remove_document(doc_id)

    def _skip(self, rel: str, reason: str) -> None:
        self.skipped[reason.split(":")[0]] += 1
        self.skipped_paths[rel] = reason

    def _rel(self, path: Path) -> str:
        try:
            rel = path.relative_to(self.root).as_posix()
            return "" if rel == "." else rel
        except ValueError:
            return path.as_posix()

    # ---- watching -----------------------------------------------------------------------------

    def _start_watching(self) -> None:
        """One non-recursive watch per folder that is not ignored: ignored trees (.venv, build
        output, node_modules) are never watched, so their churn (a fresh venv compiling .pyc
        files on first import) cannot flood inotify or the updater. New folders get watches as
        their events arrive (in the updater thread); deleted ones lose them."""
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer

        ws = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event):
                if event.event_type in ("opened", "closed_no_write"):
                    return
                if event.is_directory and event.event_type in ("modified", "closed"):
                    return   # a folder's own metadata; the files in it report their changes
                ws._queue.put((event.event_type, event.src_path, getattr(event, "dest_path", "") or "",
                               event.is_directory))

        root = str(self.root)

        class RootHandler(FileSystemEventHandler):   # on the parent folder: the root's own fate
            def on_any_event(self, event):
                dest = getattr(event, "dest_path", "") or ""
                if event.is_directory and root in (event.src_path, dest) and event.event_type in (
                        "created", "deleted", "moved"):
                    ws._queue.put((event.event_type, event.src_path, dest, True))

        self._handler = Handler()
        self._watches: dict[str, Any] = {}
        self._observer = Observer()
        self._observer.daemon = True
        self._watch_tree(self.root)
        if self.root.parent != self.root:
            # the root deleted, recreated or replaced (rm -rf and a fresh clone, a deploy's rename)
            # is only seen from its parent: its own watches die with the old folder
            try:
                self._observer.schedule(RootHandler(), str(self.root.parent), recursive=False)
            except OSError:   # an unreadable parent: the root's own replacement goes unseen
                pass
        self._observer.start()

    def _rewatch_root(self) -> None:
        """The root was deleted, recreated or replaced: drop the watches under it (they watch
        the old folders) and the cached ``.gitignore`` rules, and watch the tree now there."""
        for key in list(self._watches):
            try:
                self._observer.unschedule(self._watches.pop(key))
            except (KeyError, OSError):
                pass
        self._ignore.clear()
        if self.root.is_dir():
            self._watch_tree(self.root)

    def _watch_tree(self, folder: Path) -> None:
        for dirpath, dirnames, _ in os.walk(folder):
            base = Path(dirpath)
            dirnames[:] = [d for d in dirnames if not self._ignore.ignored(self._rel(base / d), True)]
            rel = self._rel(base)
            if rel in self._watches or rel.startswith("../") or rel.startswith("/"):
                continue
            try:
                self._watches[rel] = self._observer.schedule(self._handler, str(base), recursive=False)
            except OSError:  # gone meanwhile, or out of inotify watches: its files are still scanned
                pass

    def _unwatch_tree(self, rel: str) -> None:
        for key in [k for k in self._watches if k == rel or k.startswith(rel + "/")]:
            try:
                self._observer.unschedule(self._watches.pop(key))
            except (KeyError, OSError):
                pass

    def _updater(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            self._busy.set()
            items = [item]
            # coalesce a burst: keep draining until the queue stays quiet for `debounce`
            deadline = time.monotonic() + max(self.debounce * 10, 0.2)
            while time.monotonic() < deadline:
                try:
                    nxt = self._queue.get(timeout=self.debounce)
                except queue.Empty:
                    break
                items.append(nxt)
            stop = any(x is None for x in items)
            paths: set[str] = set()
            root = str(self.root)
            for x in items:
                if x is None:
                    continue
                kind, src, dest, is_dir = x
                if is_dir and root in (src, dest) and self._observer is not None:
                    # the root itself deleted, (re)created or moved: watch and scan what is there now
                    try:
                        self._rewatch_root()
                    except Exception as e:  # noqa: BLE001 - watching is best effort; scanning still works
                        print(f"[agentspec] workspace watch update failed: {e!r}", file=sys.stderr, flush=True)
                    paths.add(root + os.sep)
                    continue
                if not is_dir and Path(src).name == ".gitignore" and self._observer is not None:
                    self._watch_tree(Path(src).parent)   # folders it no longer ignores need watches
                if is_dir and self._observer is not None:
                    try:
                        if kind in ("deleted", "moved"):
                            self._unwatch_tree(self._rel(Path(src)))
                        for p in (src if kind == "created" else "", dest):
                            rel = self._rel(Path(p)) if p else None
                            if rel is not None and not self._ignore.ignored(rel, True) and Path(p).is_dir():
                                self._watch_tree(Path(p))
                    except Exception as e:  # noqa: BLE001 - watching is best effort; scanning still works
                        print(f"[agentspec] workspace watch update failed: {e!r}", file=sys.stderr, flush=True)
                for p in (src, dest):
                    if p:
                        paths.add(p)
                        if is_dir or kind == "moved":
                            paths.add(p + os.sep)   # a folder: everything under it
            try:
                self._apply(paths)
            except Exception as e:  # never let the updater die: report and carry on
                print(f"[agentspec] workspace update failed: {e!r}", file=sys.stderr, flush=True)
            finally:
                for _ in items:
                    self._queue.task_done()
                self._busy.clear()
            if stop:
                return

    def _apply(self, paths: set[str]) -> None:
        """Bring the index in line with the disk for these paths (files or folders)."""
        files: set[str] = set()
        for p in paths:
            path = Path(p.rstrip(os.sep)) if p.endswith(os.sep) else Path(p)
            rel = self._rel(path)
            if rel.startswith("../") or rel.startswith("/"):
                continue
            if path.name == ".gitignore":   # the rules changed: look at that folder again
                parent = Path(rel).parent.as_posix()
                parent = "" if parent == "." else parent
                self._ignore.forget(parent)
                path = path.parent
                rel = parent
                p = str(path) + os.sep
            if p.endswith(os.sep) or path.is_dir():
                prefix = rel.rstrip("/") + "/" if rel else ""
                with self._lock:
                    files.update(r for r in self._files if r.startswith(prefix))
                if path.is_dir() and (not rel or not self._ignore.ignored(rel, True)):
                    files.update(r for r, _ in self._walk_under(path))
            else:
                files.add(rel)
        todo = []
        with self._lock:
            files -= self._overlays.keys()   # an editor's unsaved text shadows the disk
        for rel in sorted(files):
            path = self.root / rel
            if not path.exists() and not path.is_symlink() or self._ignore.ignored(rel, False) or path.is_dir():
                with self._lock:
                    if rel not in self._overlays:
                        self._forget(rel)
            else:
                todo.append((rel, path))
        if todo:
            self._index_files(todo)
        self.updates += len(files)

    def _walk_under(self, folder: Path) -> Iterable[tuple[str, Path]]:
        for dirpath, dirnames, filenames in os.walk(folder):
            base = Path(dirpath)
            dirnames[:] = [d for d in dirnames if not self._ignore.ignored(self._rel(base / d), True)]
            for name in filenames:
                rel = self._rel(base / name)
                if not self._ignore.ignored(rel, False):
                    yield rel, base / name

    # ---- snapshot -----------------------------------------------------------------------------

    def _load_snapshot(self) -> None:
        """Load the snapshot when it is whole, of this version, tree, tenant and tokenizer; else
        say why on stderr and in ``summary()["snapshot_refused"]``, and index from scratch (the
        next ``save()`` writes a good one). Nothing is loaded before everything is checked."""
        manifest_path = self.snapshot / "manifest.json"
        index_path = self.snapshot / "index.bin"
        if not manifest_path.exists() and not index_path.exists():
            return   # none yet
        manifest, why = self._check_manifest(manifest_path, index_path)
        if why is None:
            try:
                self.index.load(index_path)
            except (OSError, ValueError) as e:
                why = f"index.bin not loadable: {e}"
        if why is not None:
            self.stats["snapshot_refused"] = why
            print(f"[agentspec] workspace snapshot {self.snapshot} not used ({why}); indexing from scratch",
                  file=sys.stderr, flush=True)
            return
        self._files = manifest["files"]
        self.stats["loaded_from_snapshot"] = True

    def _check_manifest(self, manifest_path: Path, index_path: Path) -> tuple[dict, str | None]:
        """(the manifest, None) when the snapshot can be loaded, else ({}, why not)."""
        for path in (manifest_path, index_path):
            if not path.is_file():
                return {}, f"{path.name} is missing"
        try:
            manifest = json.loads(manifest_path.read_bytes())
        except OSError as e:
            return {}, f"manifest.json unreadable: {e.strerror or e}"
        except ValueError as e:
            return {}, f"manifest.json is not valid JSON (truncated?): {e}"
        if not isinstance(manifest, dict):
            return {}, "manifest.json is not a JSON object"
        if manifest.get("version") != MANIFEST_VERSION:
            return {}, f"manifest version {manifest.get('version')!r}; this agentspec reads version {MANIFEST_VERSION}"
        for key, want in (("root", str(self.root)), ("tenant", self.tenant), ("tokenizer", self._tokenizer_id())):
            if manifest.get(key) != want:
                return {}, f"written for another {key} ({manifest.get(key)!r}, not {want!r})"
        try:
            digest = _file_sha(index_path)
        except OSError as e:
            return {}, f"index.bin unreadable: {e.strerror or e}"
        if manifest.get("index_sha256") != digest:
            return {}, "index.bin does not match the manifest (truncated, or written apart from it)"
        files = manifest.get("files")
        if not isinstance(files, dict):
            return {}, "manifest.json has no file table"
        for rel, f in files.items():
            if not (isinstance(f, dict) and isinstance(f.get("size"), int) and isinstance(f.get("mtime_ns"), int)
                    and isinstance(f.get("sha"), str) and isinstance(f.get("docs"), list)
                    and all(isinstance(d, str) for d in f["docs"])):
                return {}, f"manifest.json has a bad entry for {rel!r}"
        return manifest, None

    def _tokenizer_id(self) -> str:
        """Which tokenizer made the snapshot's token ids: its vocabulary size and the ids of a
        probe text (another model's tokenizer gives other ids: its snapshot would draft garbage)."""
        probe = "def f(x):\n    return x  # ünïcödé, 123\n"
        ids = self.tokenizer.encode_batch([probe])[0]
        digest = hashlib.sha1(json.dumps([int(t) for t in ids]).encode()).hexdigest()[:16]
        return f"{getattr(self.tokenizer, 'vocab_size', None)}:{digest}"


def _set_racy(entry: dict, racy: bool) -> None:
    if racy:
        entry["racy"] = True
    else:
        entry.pop("racy", None)


def _parents(rel: str) -> list[str]:
    """The folders above a relative path, outermost first: ``a/b/c.py`` -> ``["a", "a/b"]``."""
    parts = rel.split("/")[:-1]
    return ["/".join(parts[:i + 1]) for i in range(len(parts))]


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
