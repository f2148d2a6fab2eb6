"""Small JSON files both backends keep or read: the model cache's records and a checkpoint
folder's ``config.json``."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["read_json_object", "write_json_atomic"]


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` when the file is missing, unreadable, not JSON or not an
    object (a record that can be rebuilt, or a config whose fields then take their defaults)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json_atomic(path: Path, data: dict, *, tmp_mark: str = ".tmp-") -> bool:
    """Write ``data`` to ``path`` atomically (a temp file named ``<name><tmp_mark>...`` beside it,
    renamed over it). False when it cannot be written: a cache that cannot be written is not an
    error."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + tmp_mark, dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        return False
    return True
