"""The ``Workspace``: a repository's files as documents of one tenant in a ``SuffixIndex``.

It owns the file table (path -> size, mtime, hash, chunk document ids) and keeps the index in
line with it: files are read (``scan``), cut into chunks (``chunking``), tokenized in batches
and added; a changed file swaps only the chunks that changed. The other jobs live beside it:
``ignore`` (which files count), ``overlays`` (an editor's unsaved buffers), ``watcher`` (file
events -> queue -> the updater thread), ``snapshot`` (the persisted index and manifest).
"""

from __future__ import annotations

import functools
import hashlib
import os
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .chunking import chunk_text
from .ignore import DEFAULT_IGNORE, IgnoreRules, OwnedPath, owned_identity, rel_under, relative
from .overlays import EditorOverlays
from .scan import read_text, walk, walk_under
from .snapshot import load_snapshot, write_snapshot
from .watcher import Watcher, make_watcher, run_updater

__all__ = ["Workspace"]

# A file whose mtime is this close to the moment it was read may be written again without its
# (size, mtime) changing (coarse file-system clocks: 1-2 s on some; a clock tick on others), so
# that pair does not prove it unchanged: its next event re-reads it and compares the hash.
RACY_NS = 2_000_000_000


class Workspace(EditorOverlays):
    """A repository indexed into a ``SuffixIndex`` for one tenant, optionally watched.

    Options:
      tenant: whose requests may draft from these files (default "default").
      watch: follow edits with a file watcher (default True; ``watcher.make_watcher``).
      tokenizer: the engine's tokenizer (``engine.tokenizer``); default the bundled model's.
      index: a ``SuffixIndex`` to add to (default: a new one; ``ws.index``).
      ignore: patterns (gitignore syntax) ignored besides ``.gitignore`` files.
      max_file_bytes: larger files are skipped (default 1 MB).
      max_chunk_lines: chunk size cap in lines (default 80).
      snapshot: a folder for the persisted index (loaded at start, written by save()/close()).
      exclude: the server's own paths (``OwnedPath``: config file, log folder, caches), never
        indexed or read for a tenant, wherever they are; the snapshot folder is always one.
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
        exclude: Sequence[OwnedPath] = (),
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
            from ..backends.embedded.weights import load_checkpoint

            tokenizer = load_checkpoint(quiet=True).tokenizer
        self.tokenizer = tokenizer
        self.index = index if index is not None else SuffixIndex(vocab_size=getattr(tokenizer, "vocab_size", None))
        self.max_file_bytes = int(max_file_bytes)
        self.max_chunk_lines = int(max_chunk_lines)
        self.snapshot = Path(snapshot) if snapshot is not None else None
        self.debounce = float(debounce)
        owned = list(exclude)
        if self.snapshot is not None:
            owned.append(OwnedPath.of("snapshot folder", self.snapshot))
        self._ignore = IgnoreRules(self.root, ignore, owned)
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
        self._watcher: Watcher | None = None
        self._thread = None
        if progress is None:
            progress = sys.stderr.isatty()
        t0 = time.perf_counter()
        self._started = False
        if watch:   # watching before the scan: a file written while the scan reads it is queued and read again
            self._watcher = make_watcher(self.root, self._ignore, self._queue)
            self._watcher.start()
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
            updater = functools.partial(run_updater, self._queue, self._watcher, self._apply, self._busy,
                                        debounce=self.debounce)
            self._thread = threading.Thread(target=updater, name="agentspec-workspace", daemon=True)
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

    def ignored(self, path: str | os.PathLike) -> bool:
        """Whether the workspace ignores the file ``path`` (absolute or relative to the root;
        normalized, symlinks not followed): matched by a ``.gitignore`` file or the ignore list
        (``DEFAULT_IGNORE`` unless given), or inside an ignored folder (``.git/``, ``.venv/``, a
        gitignored ``build/``). Such files are never indexed, and ``POST /v1/apply`` refuses them
        (403). ValueError for a path outside the root."""
        return self._ignore.ignored_file(rel_under(self.root, path))

    def owned_rule(self, path: str | os.PathLike, *, st: os.stat_result | None = None) -> str | None:
        """The rule naming the server-owned path ``path`` (absolute or relative to the root; as
        given or resolved) falls under ("config file", "log_dir", ...), or None. With ``st`` (the
        stat of the file ``path``, fully resolved, as opened) another name for one counts too: a
        hard link (``ignore.owned_identity``)."""
        p = Path(path)
        p = p if p.is_absolute() else self.root / p
        rule = self._ignore.owned_rule(p)
        if rule is None and st is not None:
            rule = owned_identity(self._ignore.owned, st, p, self.root)
        return rule

    def save(self) -> None:
        """Write the snapshot (index + manifest) atomically, if ``snapshot`` was given."""
        if self.snapshot is None:
            raise ValueError("this workspace has no snapshot folder (Workspace(..., snapshot=DIR))")
        with self._lock:
            write_snapshot(self.snapshot, self.index, self._files, root=self.root, tenant=self.tenant,
                           tokenizer=self.tokenizer)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.stop(timeout=5)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
        if self.snapshot is not None and self._started:   # (not after a start that failed)
            self.save()

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- indexing -----------------------------------------------------------------------------

    def _scan(self, progress: bool) -> None:
        listed = list(walk(self.root, self._ignore, self._skip))
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
            got = read_text(rel, path, rules=self._ignore, max_bytes=self.max_file_bytes, skip=self._skip)
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
            docs = self._doc_ids(rel, chunks)
            for doc_id, ids in zip(docs, toks):
                if doc_id not in old_docs and ids:
                    self.index.add_document(doc_id, ids, tenant=self.tenant)
            for doc_id in old_docs - set(docs):
                self.index.remove_document(doc_id)
            self._files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha": sha, "docs": docs,
                                "doc_tokens": [len(t) for t in toks], "tokens": sum(len(t) for t in toks)}

    def _doc_ids(self, rel: str, chunks: list[str]) -> list[str]:
        """The document id of each chunk of ``rel``: the tenant, root, path, the chunk's hash and
        its count among equal chunks, so an unchanged chunk keeps its document."""
        docs, seen = [], Counter()
        for chunk in chunks:
            h = hashlib.sha1(chunk.encode("utf-8", "surrogatepass")).hexdigest()[:16]
            seen[h] += 1
            docs.append(f"{self._prefix}{rel}\x1f{h}\x1f{seen[h]}")
        return docs

    def _forget(self, rel: str) -> None:
        old = self._files.pop(rel, None)
        if old:
            for doc_id in old["docs"]:
                self.index.remove_document(doc_id)

    def _skip(self, rel: str, reason: str) -> None:
        self.skipped[reason.split(":")[0]] += 1
        self.skipped_paths[rel] = reason

    def _apply(self, paths: set[str]) -> None:
        """Bring the index in line with the disk for these paths (files or folders)."""
        files: set[str] = set()
        for p in paths:
            path = Path(p.rstrip(os.sep)) if p.endswith(os.sep) else Path(p)
            rel = relative(self.root, path)
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
                    files.update(r for r, _ in walk_under(self.root, path, self._ignore))
            else:
                files.add(rel)
        todo = []
        with self._lock:
            files -= self._overlays.keys()   # an editor's unsaved text shadows the disk
        for rel in sorted(files):
            path = self.root / rel
            if (not path.exists() and not path.is_symlink() or self._ignore.ignored(rel, False) or path.is_dir()
                    or self._ignore.link_refusal(path)):
                with self._lock:
                    if rel not in self._overlays:
                        self._forget(rel)
            else:
                todo.append((rel, path))
        if todo:
            self._index_files(todo)
        self.updates += len(files)

    def _load_snapshot(self) -> None:
        """Load the snapshot when it is whole, of this version, tree, tenant and tokenizer; else
        say why on stderr and in ``summary()["snapshot_refused"]``, and index from scratch (the
        next ``save()`` writes a good one)."""
        files, why = load_snapshot(self.snapshot, self.index, root=self.root, tenant=self.tenant,
                                   tokenizer=self.tokenizer)
        if why is not None:
            self.stats["snapshot_refused"] = why
            print(f"[agentspec] workspace snapshot {self.snapshot} not used ({why}); indexing from scratch",
                  file=sys.stderr, flush=True)
            return
        if files is not None:
            self._files = files
            self.stats["loaded_from_snapshot"] = True


def _set_racy(entry: dict, racy: bool) -> None:
    if racy:
        entry["racy"] = True
    else:
        entry.pop("racy", None)
