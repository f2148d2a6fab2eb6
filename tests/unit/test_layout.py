"""The repository's top-level folders never shadow installed packages.

``kernels/`` and ``integrations/`` install as ``agentspec.kernels`` and ``agentspec.integrations``;
PyPI's ``kernels`` (Hugging Face's, which transformers imports) and ``integrations`` own those
top-level names. The repository root must therefore be off ``sys.path`` in the test process, in
every Python it starts, and in a benchmark run as ``python -m benchmarks.X`` from the root.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHADOWS = ("kernels", "integrations")

PROBE = """
import importlib.util, json, sys
out = {}
for name in %r:
    spec = importlib.util.find_spec(name)
    out[name] = None if spec is None else [str(p) for p in (spec.submodule_search_locations or [spec.origin])]
print(json.dumps(out))
""" % (SHADOWS,)


def _in_repository(locations: list[str] | None) -> bool:
    return any(Path(p).resolve().is_relative_to(ROOT / name) for p in locations or [] for name in SHADOWS)


def _where(name: str) -> list[str] | None:
    spec = importlib.util.find_spec(name)
    return None if spec is None else [str(p) for p in (spec.submodule_search_locations or [spec.origin])]


@pytest.mark.parametrize("name", SHADOWS)
def test_the_test_process_does_not_import_the_repository_folder(name):
    assert not _in_repository(_where(name)), (name, _where(name))
    assert all(Path(p or os.curdir).resolve() != ROOT for p in sys.path), sys.path


def test_child_pythons_started_from_the_root_do_not_either():
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert not any(_in_repository(v) for v in found.values()), found


def test_a_benchmark_run_from_the_root_takes_the_root_off_sys_path():
    """``python -m benchmarks.X`` finds the package through the root, which then leaves sys.path
    (and PYTHONSAFEPATH keeps it off in the children)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    code = "import benchmarks, os\n" + PROBE + "assert os.environ['PYTHONSAFEPATH'] == '1'\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert not any(_in_repository(v) for v in found.values()), found


def test_transformers_imports_with_hugging_faces_kernels_installed():
    """What broke a fresh clone: transformers imports `kernels` at import time."""
    pytest.importorskip("transformers")
    import transformers.activations  # noqa: F401

    if importlib.util.find_spec("kernels") is not None:
        import kernels

        assert not Path(kernels.__file__).resolve().is_relative_to(ROOT / "kernels"), kernels.__file__
