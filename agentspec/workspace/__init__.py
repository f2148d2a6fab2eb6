"""A repository, indexed for drafting and kept current while it is edited.

``Workspace(root)`` walks the tree (respecting ``.gitignore`` files and an ignore list; binary,
oversized, non-regular, unreadable and vanished files are skipped with a reason), cuts files at
definition boundaries (tree-sitter), tokenizes the chunks with the engine's tokenizer and adds
them as documents of its tenant to a ``suffix_index.SuffixIndex``. With ``watch=True`` a file
watcher (one inotify reader thread on Linux, watchdog's observer elsewhere) feeds file events to a
queue; one updater thread drains it, coalesces bursts and re-indexes only the chunks that changed. Nothing on a request's path touches the file system:
requests only read the index.

    with agentspec.Workspace(".", tokenizer=engine.tokenizer) as ws:
        engine = agentspec.Engine.embedded(workspace=ws)

With ``snapshot=DIR`` the index and a manifest (path -> size, mtime, hash, chunk ids) are
written atomically by ``save()`` and at ``close()``, and loaded at start; files changed since
are re-indexed.

One module per job:
  workspace.py  the ``Workspace``: file table, chunk documents in the index, lifecycle
  ignore.py     ignore rules (``.gitignore`` files, ``DEFAULT_IGNORE``) and relative paths
  scan.py       walking the tree and reading files as text, skips with reasons
  chunking.py   cutting text into chunks at definition boundaries (tree-sitter)
  overlays.py   editors' unsaved buffers indexed in place of the disk
  watcher.py    file events (inotify, watchdog) -> queue -> the updater thread
  snapshot.py   the persisted index and manifest, written crash-safe
"""

from .chunking import LANGUAGES, chunk_text, language_for
from .ignore import DEFAULT_IGNORE, OwnedPath, ignore_checker, is_ignored
from .workspace import Workspace

__all__ = ["Workspace", "DEFAULT_IGNORE", "OwnedPath", "ignore_checker", "is_ignored", "LANGUAGES", "chunk_text", "language_for"]
