"""A workspace's persisted index: ``index.bin`` and ``manifest.json`` in a snapshot folder.

The manifest names the index file's SHA-256, the tree (root), tenant and tokenizer it was made
for, and the file table (path -> size, mtime, hash, chunk document ids). It is written last and
atomically (``suffix_index.atomic``), so a crash mid-save leaves either the old snapshot or one
that ``load_snapshot`` refuses with a reason; nothing is loaded before everything is checked.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from suffix_index.atomic import write_atomic

MANIFEST_VERSION = 1


def write_snapshot(folder: Path, index: Any, files: dict, *, root: Path, tenant: str, tokenizer: Any) -> None:
    """Save ``index`` to ``folder/index.bin``, then the manifest naming its hash."""
    folder.mkdir(parents=True, exist_ok=True)
    index_path = folder / "index.bin"
    index.save(index_path)
    manifest = {"version": MANIFEST_VERSION, "root": str(root), "tenant": tenant,
                "tokenizer": tokenizer_id(tokenizer),
                "index_sha256": file_sha(index_path), "files": files}
    write_atomic(folder / "manifest.json", json.dumps(manifest).encode())


def load_snapshot(folder: Path, index: Any, *, root: Path, tenant: str,
                  tokenizer: Any) -> tuple[dict | None, str | None]:
    """Load ``folder``'s index into ``index`` when the snapshot is whole and of this version,
    tree, tenant and tokenizer. Returns (the file table, None) when loaded, (None, None) when
    there is no snapshot yet, (None, why not) when it was refused (``index`` untouched)."""
    manifest_path = folder / "manifest.json"
    index_path = folder / "index.bin"
    if not manifest_path.exists() and not index_path.exists():
        return None, None   # none yet
    manifest, why = check_manifest(manifest_path, index_path, root=root, tenant=tenant, tokenizer=tokenizer)
    if why is None:
        try:
            index.load(index_path)
        except (OSError, ValueError) as e:
            why = f"index.bin not loadable: {e}"
    if why is not None:
        return None, why
    return manifest["files"], None


def check_manifest(manifest_path: Path, index_path: Path, *, root: Path, tenant: str,
                   tokenizer: Any) -> tuple[dict, str | None]:
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
    for key, want in (("root", str(root)), ("tenant", tenant), ("tokenizer", tokenizer_id(tokenizer))):
        if manifest.get(key) != want:
            return {}, f"written for another {key} ({manifest.get(key)!r}, not {want!r})"
    try:
        digest = file_sha(index_path)
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


def tokenizer_id(tokenizer: Any) -> str:
    """Which tokenizer made the snapshot's token ids: its vocabulary size and the ids of a
    probe text (another model's tokenizer gives other ids: its snapshot would draft garbage)."""
    probe = "def f(x):\n    return x  # ünïcödé, 123\n"
    ids = tokenizer.encode_batch([probe])[0]
    digest = hashlib.sha1(json.dumps([int(t) for t in ids]).encode()).hexdigest()[:16]
    return f"{getattr(tokenizer, 'vocab_size', None)}:{digest}"


def file_sha(path: Path) -> str:
    """The SHA-256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
