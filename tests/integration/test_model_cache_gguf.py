"""The bundled GGUF through the converted-weight cache: one entry per content, whatever the path
(each checkout or venv has its own copy of the file), bounded, said at start-up."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import tqdm

from agentspec.backends.embedded import model_cache
from agentspec.backends.embedded.weights import bundled_model_path, load_checkpoint

pytestmark = pytest.mark.slow


def test_two_copies_of_the_model_share_one_entry_and_old_ones_are_evicted(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("AGENTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AGENTSPEC_CACHE_MAX_GB", "0.001")   # 1 MB: smaller than any converted model
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)   # the progress bar without its monitor thread
    models = tmp_path / "cache" / "models"
    stale = models / "SmolLM2-135M-Instruct.Q4_1-0123456789abcdef"   # the old path+mtime layout
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    (stale / "model-head.safetensors").write_bytes(bytes(4096))
    os.utime(stale / "config.json", (time.time() - 3600,) * 2)

    copies = []
    for i, name in enumerate(("venv-a", "venv-b")):
        p = tmp_path / name / bundled_model_path().name
        p.parent.mkdir()
        shutil.copyfile(bundled_model_path(), p)
        os.utime(p, (1_700_000_000 + i, 1_700_000_000 + i))
        copies.append(p)

    first = load_checkpoint(copies[0]).state_dict()
    err = capfd.readouterr().err
    assert "converted" in err and "removed SmolLM2-135M-Instruct.Q4_1-0123456789abcdef" in err, err
    second = load_checkpoint(copies[1]).state_dict()
    err = capfd.readouterr().err
    assert "converted" not in err and "model cache: 1 entry" in err, err   # the start-up line
    assert first.keys() == second.keys() and all((first[k] == second[k]).all() for k in first)

    (entry,) = model_cache.entries()
    assert entry.complete and entry.bytes > 1_000_000   # kept: it is the one in use, limit or not
    assert set(entry.sources) == {str(p.resolve()) for p in copies}
