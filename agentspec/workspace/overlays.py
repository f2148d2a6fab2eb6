"""Editor overlays: an unsaved buffer indexed in place of the file on disk.

While a path has an overlay the watcher leaves it alone (``Workspace._apply`` skips it, and a
disk read that races an overlay loses); ``drop_overlay`` indexes the disk copy again. Only the
chunks that changed are tokenized again, so an overlay per keystroke is cheap.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

from .chunking import chunk_text
from .ignore import IgnoreRules, relative


class EditorOverlays:
    """``Workspace``'s overlay methods (a mixin over the workspace's file table, lock and index)."""

    # what the mixin uses of the Workspace, besides its methods _doc_ids, _forget and _apply
    root: Path
    tenant: str
    tokenizer: Any
    index: Any
    max_file_bytes: int
    max_chunk_lines: int
    _ignore: IgnoreRules
    _files: dict[str, dict]
    _overlays: dict[str, int]
    _lock: threading.RLock

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
        if self._ignore.ignored_file(rel):
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

    def _overlay_rel(self, path: str | os.PathLike) -> str:
        p = Path(path)
        if not p.is_absolute():
            p = self.root / p
        p = Path(os.path.normpath(p))
        rel = relative(self.root, p)
        if not rel or rel.startswith("../") or rel.startswith("/") or Path(rel).is_absolute():
            raise ValueError(f"{str(path)!r} is not a file under the workspace root {str(self.root)!r}")
        return rel

    def _replace_chunks(self, rel: str, chunks: list[str], *, size: int, mtime_ns: int, sha: str) -> None:
        """``_replace`` for one file's text: chunks whose document is already indexed keep it and
        are not tokenized again. Call with ``_lock`` held."""
        old = self._files.get(rel)
        old_docs = dict(zip(old["docs"], old.get("doc_tokens") or [None] * len(old["docs"]))) if old else {}
        docs = self._doc_ids(rel, chunks)
        counts = [old_docs.get(doc_id) for doc_id in docs]
        new = [(i, chunk) for i, (doc_id, chunk) in enumerate(zip(docs, chunks)) if doc_id not in old_docs]
        ids = self.tokenizer.encode_batch([c for _, c in new]) if new else []
        for (i, _), toks in zip(new, ids):
            counts[i] = len(toks)
            if toks:
                self.index.add_document(docs[i], toks, tenant=self.tenant)
        for doc_id in set(old_docs) - set(docs):
            self.index.remove_document(doc_id)
        self._files[rel] = {"size": size, "mtime_ns": mtime_ns, "sha": sha, "docs": docs,
                            "doc_tokens": [c or 0 for c in counts], "tokens": sum(c or 0 for c in counts)}
