"""The converted-weight cache (agentspec.backends.embedded.model_cache): keyed by content, bounded,
least recently used out first, listed and cleared by ``agentspec cache``. No model here: entries
are folders of plain files (tests/integration/test_model_cache.py converts the real GGUF)."""

from __future__ import annotations

import json
import os
import time

import pytest

from agentspec import cli
from agentspec.backends.embedded import model_cache
from agentspec.errors import ModelLoadError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AGENTSPEC_CACHE_MAX_GB", raising=False)
    return tmp_path / "cache" / "models"


def _entry(cache, name: str, size: int, used: float, *, complete: bool = True):
    d = cache / name
    d.mkdir(parents=True)
    (d / "model-00000.safetensors").write_bytes(b"x" * size)
    if complete:
        (d / "config.json").write_text("{}")
    (d / "last_used").write_text("")
    os.utime(d / "last_used", (used, used))
    return d


def test_same_content_same_entry_whatever_the_path(cache, tmp_path):
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    os.utime(b, (1_000_000, 1_000_000))   # another mtime: the old path+mtime key made two entries
    assert model_cache.entry_dir(a, 2) == model_cache.entry_dir(b, 2)
    assert model_cache.entry_dir(a, 2) != model_cache.entry_dir(a, 3)   # a new converter, a new entry
    c = tmp_path / "c" / "m.gguf"
    c.parent.mkdir()
    c.write_bytes(b"GGUF" + bytes(10))
    assert model_cache.entry_dir(c, 2) != model_cache.entry_dir(a, 2)


def test_a_known_file_is_not_hashed_again_until_it_changes(cache, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"one")
    first = model_cache.content_digest(f)
    index = json.loads((cache / "sources.json").read_text())
    index[str(f.resolve())]["sha256"] = "remembered"   # what the index says wins while the file is unchanged
    (cache / "sources.json").write_text(json.dumps(index))
    assert model_cache.content_digest(f) == "remembered"
    f.write_bytes(b"two!")   # new size and mtime: hashed again
    second = model_cache.content_digest(f)
    assert second not in ("remembered", first)


def test_eviction_removes_least_recently_used_first_and_keeps_the_one_in_use(cache):
    now = time.time()
    old = _entry(cache, "old", 4000, now - 300)
    mid = _entry(cache, "mid", 4000, now - 200)
    new = _entry(cache, "new", 4000, now - 100)
    removed = model_cache.evict(9000, keep=(old,))   # old is in use: mid goes, though old is older
    assert [e.name for e in removed] == ["mid"]
    assert old.exists() and new.exists() and not mid.exists()
    removed = model_cache.evict(0, keep=(new,))
    assert [e.name for e in removed] == ["old"] and new.exists()


def test_half_written_folders_go_after_an_hour(cache):
    now = time.time()
    stale = _entry(cache, "m-abc-v2.tmp-1", 10, now - 7200, complete=False)
    fresh = _entry(cache, "m-def-v2.tmp-2", 10, now - 60, complete=False)
    removed = model_cache.evict(10**12)
    assert [e.name for e in removed] == [stale.name] and fresh.exists()


def test_limit_from_the_environment(cache, monkeypatch):
    assert model_cache.cache_limit_bytes() == 20 * 10**9
    monkeypatch.setenv("AGENTSPEC_CACHE_MAX_GB", "1.5")
    assert model_cache.cache_limit_bytes() == 1_500_000_000
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv("AGENTSPEC_CACHE_MAX_GB", bad)
        with pytest.raises(ModelLoadError, match="AGENTSPEC_CACHE_MAX_GB"):
            model_cache.cache_limit_bytes()


def test_summary_says_what_it_holds(cache):
    _entry(cache, "a", 3_000_000, time.time())
    line = model_cache.summary()
    assert line.startswith("model cache: 1 entry, 3.0 MB of 20.00 GB at ") and str(cache) in line


def test_cli_lists_and_clears(cache, capsys):
    now = time.time()
    _entry(cache, "first", 100, now - 10)
    _entry(cache, "second", 200, now)
    assert cli.main(["cache", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in listed["entries"]] == ["second", "first"] and listed["total_bytes"] >= 300
    assert cli.main(["cache", "list"]) == 0
    assert "second" in capsys.readouterr().out
    assert cli.main(["cache", "clear", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no model cache entry named 'nope'" in err and "first" in err
    assert cli.main(["cache", "clear", "first"]) == 0
    assert [e.name for e in model_cache.entries()] == ["second"]
    assert cli.main(["cache", "clear"]) == 0
    assert "removed 1 entry" in capsys.readouterr().out and model_cache.entries() == []
