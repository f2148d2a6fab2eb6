"""The GPU check kit (benchmarks/gpu/kit) run dry on this CPU.

- SGLang's CUDA-path modules import with the CUDA stand-in as ``sgl_kernel`` (torch told CUDA is
  present), and each of the stand-in plugin's patches takes (``import_check.py --fake-cuda``);
- the kit's parts are planned, cut and joined back byte for byte, and stashing checks them;
- the staged kit (``kit.py stage``, when ``build/gpu_kit`` holds one) fits each run's limit beside
  the repository's own files, and its wheels install for CPython 3.12 (when one is on this machine).
"""

from __future__ import annotations

import glob
import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.sglang import require_sglang

require_sglang()

ROOT = Path(__file__).resolve().parents[2]
KIT_DIR = ROOT / "benchmarks" / "gpu" / "kit"
STAGED = ROOT / "build" / "gpu_kit"
sys.path.insert(0, str(KIT_DIR))
import kit  # noqa: E402


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "sglang" / "standin_cuda"), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def test_cuda_path_imports_with_the_standin(tmp_path):
    out = tmp_path / "import_check.json"
    r = subprocess.run([sys.executable, str(KIT_DIR / "import_check.py"), "--fake-cuda", "--out", str(out)],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    record = json.loads(out.read_text()) if out.is_file() else {}
    assert r.returncode == 0 and record.get("ok"), (record.get("error"), r.stderr[-3000:])
    checks = record["checks"]
    for name in ("imports", "SGLang takes its CUDA path", "tree ops -> Triton", "sampled verification -> torch",
                 "top_k_renorm_prob -> Triton", "top_p_renorm_prob -> Triton", "store_cache off", "dual GEMM off SM100",
                 "AGENTSPEC registers as NGRAM-like", "AGENTSPEC_EAGLE3 registers as EAGLE3-like"):
        assert checks[name]["ok"], name
    assert record["sgl_kernel"].startswith(str(ROOT / "tests" / "sglang" / "standin_cuda"))
    for key, value in (("SGLANG_FORCE_FUSED_OP_BACKEND", "torch"), ("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python"),
                       ("SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", "1")):
        assert checks[f"env {key}"]["ok"], key


def test_plan_parts_fills_each_run():
    mib = kit.MIB
    assert kit.plan_parts(10 * mib, 100 * mib, 40 * mib) == [30 * mib, 40 * mib, 30 * mib]
    assert kit.plan_parts(10 * mib, 20 * mib, 40 * mib) == [20 * mib]
    assert kit.plan_parts(39 * mib, 1, 40 * mib) == [1]
    with pytest.raises(ValueError, match="base part"):
        kit.plan_parts(40 * mib, 1, 40 * mib)
    assert kit.part_budget(20 * mib) == 64 * mib - 20 * mib - kit.MARGIN


def _fake_kit(tmp_path: Path, payload: bytes, sizes: list[int]) -> tuple[Path, Path, dict]:
    """A kit whose 'GGUF' is ``payload``, xz-packed and cut at ``sizes`` (the staging path)."""
    out = tmp_path / "gpu_kit"
    (out / "base" / "model_files").mkdir(parents=True)
    (out / "base" / "model_files" / "config.json").write_text("{}")
    (out / "base" / "prompts.json").write_text("{}")
    src = tmp_path / "model.gguf"
    src.write_bytes(payload)
    packed = tmp_path / "model.gguf.xz"
    packed.write_bytes(lzma.compress(payload))
    sizes = kit.plan_parts(100, packed.stat().st_size, sizes[0]) if len(sizes) == 1 else sizes
    names = [f"model.{i + 1}" for i in range(len(sizes))]
    kit.split_file(packed, sizes, [out / n / f"model.gguf.xz.{n}" for n in names])
    manifest = {"model": {"gguf": "model.gguf", "gguf_bytes": len(payload), "gguf_sha256": kit.sha256(src),
                          "parts": [{"name": n, "file": f"model.gguf.xz.{n}", "bytes": s,
                                     "sha256": kit.sha256(out / n / f"model.gguf.xz.{n}")} for n, s in zip(names, sizes)]},
                "model_files": {"files": {}}}
    (out / "base" / "MANIFEST.json").write_text(json.dumps(manifest))
    return out, tmp_path / "gpu_state", manifest


def test_parts_join_back_over_several_runs(tmp_path):
    payload = os.urandom(50_000) + bytes(50_000)
    out, state, manifest = _fake_kit(tmp_path, payload, [200])
    names = [p["name"] for p in manifest["model"]["parts"]]
    assert len(names) >= 3
    # run 1 brings base and model.1, each later run one part; the machine keeps state/ between runs
    held = tmp_path / "held"
    shutil.move(str(out), held)
    out.mkdir()
    shutil.copytree(held / "base", out / "base")
    shutil.copytree(held / names[0], out / names[0])
    assert kit.stash(out, state) == {"have": names[:1], "missing": names[1:]}
    with pytest.raises(FileNotFoundError, match="not on this machine yet"):
        kit.assemble(out, state)
    for n in names[1:]:
        shutil.rmtree(out)   # a later run: only its own part travels
        out.mkdir()
        shutil.copytree(held / n, out / n)
        kit.stash(out, state)
    gguf = kit.assemble(out, state)
    assert gguf.read_bytes() == payload
    assert (state / "model_files" / "config.json").is_file() and (state / "prompts.json").is_file()


def test_a_damaged_part_is_refused(tmp_path):
    out, state, manifest = _fake_kit(tmp_path, os.urandom(4000), [150])
    part = manifest["model"]["parts"][1]
    p = out / part["name"] / part["file"]
    data = bytearray(p.read_bytes())
    data[0] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256 differs"):
        kit.stash(out, state)


def test_check_size_fails_over_the_limit(tmp_path):
    out, _, _ = _fake_kit(tmp_path, os.urandom(3000), [120])
    rows = kit.check_size(out, budget=10**6, travel=0)
    assert [r["carry"][0].rsplit("/", 1)[-1] for r in rows][:2] == ["base", "model.2"]
    assert rows[0]["carry"][1].endswith("model.1") and all(r["fits"] for r in rows)
    rows = kit.check_size(out, budget=150, travel=0)
    assert not all(r["fits"] for r in rows)


@pytest.mark.skipif(not (STAGED / "base" / "MANIFEST.json").is_file(),
                    reason="no staged kit in build/gpu_kit (python benchmarks/gpu/kit/kit.py stage)")
def test_the_staged_kit_fits_each_run():
    r = subprocess.run([sys.executable, str(KIT_DIR / "kit.py"), "check-size", "--out", str(STAGED)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((STAGED / "base" / "MANIFEST.json").read_text())
    assert {p["name"] for p in manifest["model"]["parts"]} == {p.name for p in STAGED.glob("model.*")}
    for p in manifest["model"]["parts"]:
        assert (STAGED / p["name"] / p["file"]).stat().st_size == p["bytes"]
    wheels = {w["file"].split("-")[0].lower().replace("_", "-") for w in manifest["wheels"]}
    wanted = {line.split("==")[0].lower().replace("_", "-") for line in kit.wheel_requirements()}
    assert wanted <= wheels, wanted - wheels
    assert not any(".so" in n for n in _tar_names(STAGED / "base" / "sglang.tar.xz", ".so"))


def _tar_names(path: Path, needle: str) -> list[str]:
    import tarfile

    with tarfile.open(path, "r:xz") as t:
        return [m.name for m in t.getmembers() if needle in m.name]


def _python312() -> str | None:
    found = shutil.which("python3.12")
    if found and subprocess.run([found, "-V"], capture_output=True).returncode == 0:
        return found
    cands = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))
    return cands[-1] if cands else None


@pytest.mark.skipif(not (STAGED / "base" / "MANIFEST.json").is_file() or _python312() is None,
                    reason="needs a staged kit in build/gpu_kit and a CPython 3.12 on this machine")
def test_the_staged_wheels_install_on_cpython_312(tmp_path):
    """pip for CPython 3.12 accepts every wheel of the kit (tags, one version each), offline."""
    py = _python312()
    r = subprocess.run([py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index", "--no-deps",
                        "--no-compile", "--target", str(tmp_path / "site"), *glob.glob(str(STAGED / "base" / "wheels" / "*.whl"))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    site = tmp_path / "site"
    for mod in ("fastapi", "pydantic_core", "zmq", "msgspec", "orjson", "pybase64", "setproctitle", "tvm_ffi",
                "openai", "partial_json_parser", "IPython", "gguf", "dill", "soundfile", "xgrammar", "tree_sitter"):
        assert (site / mod).is_dir() or (site / f"{mod}.py").is_file() or list(site.glob(f"{mod}*.so")), mod
    # the extension modules are CPython 3.12 (or stable-ABI) builds
    for so in site.rglob("*.so"):
        assert "cpython-311" not in so.name, so
