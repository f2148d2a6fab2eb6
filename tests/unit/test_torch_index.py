"""scripts/torch_index.py: where setup.sh installs torch from (the CPU index only on Linux x86_64
without an NVIDIA GPU, and never over an index, find-links or wheel the machine is configured with)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "torch_index.py"
_spec = importlib.util.spec_from_file_location("torch_index", SCRIPT)
ti = importlib.util.module_from_spec(_spec)
sys.modules["torch_index"] = ti   # dataclasses resolve the module by name
_spec.loader.exec_module(ti)

# a plain Linux x86_64 machine: no GPU, no torch yet, pip on PyPI's defaults
BARE = ti.Facts(torch_index_url="", pip_sources=(), torch_installed="", machine="linux-x86_64", nvidia=False)
CPU = ("--index-url", ti.CPU_INDEX)


def facts(**kw) -> ti.Facts:
    return dataclasses.replace(BARE, **kw)


@pytest.mark.parametrize("f, args, why", [
    (BARE, CPU, "no NVIDIA GPU"),
    (facts(nvidia=True), (), "CUDA"),
    (facts(machine="darwin-arm64"), (), "darwin-arm64"),
    (facts(machine="linux-aarch64"), (), "linux-aarch64"),
    (facts(pip_sources=("global.find-links",)), (), "global.find-links"),
    (facts(pip_sources=("PIP_INDEX_URL",), nvidia=True), (), "PIP_INDEX_URL"),
    (facts(torch_installed="2.13.0+cpu"), (), "already installed"),
    (facts(torch_installed="2.13.0"), (), "already installed"),
    (facts(torch_installed="2.5.1"), CPU, "no NVIDIA GPU"),          # another version: 2.13.0 still to fetch
    (facts(torch_index_url="https://mirror.example/whl"), ("--index-url", "https://mirror.example/whl"), "TORCH_INDEX_URL"),
    # $TORCH_INDEX_URL over everything, pip's configuration included
    (facts(torch_index_url="file:///w", pip_sources=("PIP_FIND_LINKS",), torch_installed="2.13.0"),
     ("--index-url", "file:///w"), "TORCH_INDEX_URL"),
])
def test_decide(f, args, why):
    d = ti.decide(f)
    assert d.pip_args == args and why in d.reason


def test_pip_sources_from_env_and_config():
    config = "\n".join([
        ":env:.find-links='/opt/wheels'",                      # repeats $PIP_FIND_LINKS
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
        "global.find-links='/opt/wheels'",
        "user.index-url=''",                                   # set to nothing: not a source
        "global.constraint='/etc/pip/constraints.txt'",
    ])
    env = {"PIP_FIND_LINKS": "/opt/wheels", "PIP_CERT": "x", "PIP_INDEX_URL": ""}
    assert ti.pip_sources(env, config) == ("PIP_FIND_LINKS", "global.extra-index-url", "global.find-links")
    assert ti.pip_sources({}, "global.cert='/x'\n") == ()
    assert ti.pip_sources({"PIP_NO_INDEX": "1"}, "") == ("PIP_NO_INDEX",)


def run_script(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def test_script_prints_the_decision(tmp_path):
    """The real script on this machine's python: what it prints follows from the environment
    it is given (no pip configuration files: PIP_CONFIG_FILE=/dev/null, so only the variables count)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "TORCH_INDEX_URL"}
    base["PIP_CONFIG_FILE"] = os.devnull
    r = run_script({**base, "TORCH_INDEX_URL": "https://mirror.example/whl"})
    assert r.returncode == 0 and r.stdout.split() == ["--index-url", "https://mirror.example/whl"]
    assert "TORCH_INDEX_URL" in r.stderr
    r = run_script({**base, "PIP_FIND_LINKS": str(tmp_path)})
    assert r.returncode == 0 and r.stdout == ""
    assert "PIP_FIND_LINKS" in r.stderr or "already installed" in r.stderr
