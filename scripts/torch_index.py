"""Where scripts/setup.sh installs torch==2.13.0 from.

PyPI's default torch wheel for Linux x86_64 is the CUDA build (several GB, with the CUDA
libraries). On such a machine without an NVIDIA GPU the CPU build from PyTorch's CPU index is
the one to install; everywhere else pip's own choice is right. An index, find-links or wheel the
machine is already configured with always wins, and ``$TORCH_INDEX_URL`` over everything:

1. ``$TORCH_INDEX_URL`` set: that index;
2. torch 2.13.0 already installed: nothing to fetch;
3. pip configured with an index or local wheels (``$PIP_INDEX_URL``, ``$PIP_EXTRA_INDEX_URL``,
   ``$PIP_FIND_LINKS``, ``$PIP_NO_INDEX``, or the same settings in ``pip config list``): pip's
   configuration, untouched;
4. not Linux x86_64: PyPI's default (CPU-only on macOS and Windows, the right build on Arm);
5. an NVIDIA driver present (``/proc/driver/nvidia`` or a working ``nvidia-smi``): PyPI's
   default, the CUDA build;
6. otherwise: ``--index-url https://download.pytorch.org/whl/cpu``.

Run with the venv's python: prints the pip options (one a line; none for pip's own choice) on
stdout and which way it went on stderr. Standard library only.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TORCH_VERSION = "2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# pip settings that say where packages come from, as environment variables and config keys
PIP_ENV = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX")
PIP_KEYS = ("index-url", "extra-index-url", "find-links", "no-index")


@dataclass(frozen=True)
class Facts:
    """What the decision rests on (``gather`` reads them from this machine)."""

    torch_index_url: str       # $TORCH_INDEX_URL ("" when unset)
    pip_sources: tuple[str, ...]  # pip's configured sources, named: ("PIP_FIND_LINKS", "global.extra-index-url")
    torch_installed: str       # the installed torch's version ("" when none)
    machine: str               # "<sys.platform>-<machine>": "linux-x86_64", "darwin-arm64"
    nvidia: bool               # an NVIDIA driver answers


@dataclass(frozen=True)
class Decision:
    pip_args: tuple[str, ...]  # added to `pip install torch==2.13.0`
    reason: str


def decide(f: Facts) -> Decision:
    """Where torch comes from, given ``f`` (the order in the module docstring)."""
    if f.torch_index_url:
        return Decision(("--index-url", f.torch_index_url), f"from $TORCH_INDEX_URL ({f.torch_index_url})")
    if f.torch_installed.split("+")[0] == TORCH_VERSION:
        return Decision((), f"torch {f.torch_installed} is already installed")
    if f.pip_sources:
        return Decision((), f"from pip's configured sources ({', '.join(f.pip_sources)}), left as they are")
    if f.machine != "linux-x86_64":
        return Decision((), f"PyPI's default build for {f.machine}")
    if f.nvidia:
        return Decision((), "an NVIDIA driver is present: PyPI's default (CUDA) build")
    return Decision(("--index-url", CPU_INDEX),
                    f"no NVIDIA GPU: the CPU build from {CPU_INDEX} (set TORCH_INDEX_URL to choose another index)")


def pip_sources(env: Mapping[str, str], pip_config: str) -> tuple[str, ...]:
    """The configured package sources: the ``PIP_ENV`` variables set in ``env``, then the
    ``PIP_KEYS`` settings in ``pip_config`` (``pip config list`` output: ``global.find-links='/opt/wheels'``;
    its ``:env:`` lines repeat the variables and are left out)."""
    out = [name for name in PIP_ENV if env.get(name)]
    for line in pip_config.splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.startswith(":env:") and key.rpartition(".")[2] in PIP_KEYS and value.strip("'\" "):
            out.append(key)
    return tuple(out)


def nvidia_present() -> bool:
    if Path("/proc/driver/nvidia").exists():
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def gather(env: Mapping[str, str] = os.environ) -> Facts:
    """The facts on this machine, for the python running this (the venv's)."""
    try:
        config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                env=dict(env), timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        config = ""
    try:
        installed = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        installed = ""
    return Facts(torch_index_url=env.get("TORCH_INDEX_URL", ""), pip_sources=pip_sources(env, config),
                 torch_installed=installed, machine=f"{sys.platform}-{platform.machine().lower()}",
                 nvidia=nvidia_present())


def main() -> int:
    d = decide(gather())
    print(f"[setup] torch {TORCH_VERSION}: {d.reason}", file=sys.stderr, flush=True)
    for arg in d.pip_args:
        print(arg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
