#!/usr/bin/env bash
# The GPU check of SGLang with agentspec's drafters, on a CUDA machine that has torch, Triton, a C++
# compiler, CMake, ninja, nanobind and scikit-build-core but no SGLang, no sglang-kernel, no
# FlashInfer and no network. Everything else comes in the staged kit (kit.py stage, README.md).
#
#   bash benchmarks/gpu/kit/gpu_run.sh smoke     # run 1: carry build/gpu_kit/base + build/gpu_kit/model.1
#   bash benchmarks/gpu/kit/gpu_run.sh setup     # run 1 without the smoke engines (install and keep the parts)
#   bash benchmarks/gpu/kit/gpu_run.sh store     # run 2..k-1: carry the next build/gpu_kit/model.N
#   bash benchmarks/gpu/kit/gpu_run.sh measure   # run k: carry the last build/gpu_kit/model.N
#   bash benchmarks/gpu/kit/gpu_run.sh all       # one run, where the whole kit can be brought
#
# The runs must land on the same machine (it keeps build/gpu_state/ and what was installed); a run
# that finds its predecessors' state missing says so and stops.
#   smoke:   installs the kit (the wheels into this Python, SGLang's Python tree under
#            build/gpu_state/site, agentspec built here with its C++ extensions, the CUDA stand-in),
#            checks the imports and the stand-in's patches on the real GPU, then one greedy request
#            per workload and one sampled request for each of none / NGRAM / AGENTSPEC / EAGLE3 /
#            AGENTSPEC_EAGLE3 on a model of the bundled model's shape with random weights.
#   measure: joins the model parts into the bundled GGUF, converts it, then
#            benchmarks/bench_sglang.py at concurrency 1 and 16 (deterministic inference, Triton
#            attention, CUDA graphs off, none's top-2 log-probs for the divergence report) and
#            `agentspec serve --backend sglang` asked by the openai client (serve_check.py).
# Output under $OUT (the device tool sets it; default build/gpu_out): gpu_run.log, summary.json
# (machine, versions, each step's result), smoke.json / bench_sglang_gpu.json, serve.json, serve.log.
# Exit status: non-zero when a step failed.
#   KIT=build/gpu_kit STATE=build/gpu_state PYTHON=python3   METHODS=none,ngram,agentspec,eagle3,hybrid
#   MAX_TOKENS=96 CONCURRENCY=1,16 C1_PROMPTS=4 (per workload at c=1; c=16 runs all 16) DRAFT_TOKENS=8
#   FP32_LM_HEAD=1 (SGLang's float32 logits)   SMOKE_TIMEOUT=330 BENCH_TIMEOUT=420 SERVE_TIMEOUT=150: seconds each step may take (a run has 600 in
#   all); a step cut off is recorded as failed, and bench_sglang's report holds the methods it finished
set -uo pipefail
cd "$(dirname "$0")/../../.."
MODE="${1:-smoke}"
KIT="${KIT:-build/gpu_kit}"
STATE="${STATE:-build/gpu_state}"
OUT="${OUT:-build/gpu_out}"
PY="${PYTHON:-python3}"
METHODS="${METHODS:-none,ngram,agentspec,eagle3,hybrid}"
HEAD_DIR="$PWD/agentspec/heads/smollm2-135m-instruct-eagle3"
mkdir -p "$OUT" "$STATE"
exec > >(tee -a "$OUT/gpu_run.log") 2>&1
T0=$SECONDS
say() { echo "[gpu_run +$((SECONDS - T0))s] $*"; }
STEPS="$STATE/steps-$MODE.jsonl"
: > "$STEPS"
step() {   # step NAME STATUS [DETAIL]: one line of summary.json's steps; returns non-zero when STATUS is
    "$PY" -c 'import json,sys; print(json.dumps({"mode": sys.argv[1], "step": sys.argv[2], "ok": sys.argv[3] == "0", "detail": sys.argv[4]}))' \
        "$MODE" "$1" "$2" "${3:-}" >> "$STEPS"
    if [ "$2" = 0 ]; then say "ok: $1"; return 0; fi
    say "FAILED: $1 ${3:-}"
    return 1
}
FAILED=0
reap() {   # what a step cut off by its time limit left running (SGLang's scheduler and detokenizer)
    pkill -9 -f 'sglang::' 2>/dev/null
    pkill -9 -f 'agentspec serve' 2>/dev/null
    return 0
}

export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
export SGLANG_FORCE_FUSED_OP_BACKEND=torch SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
export PYTHONPATH="$PWD/$STATE/site${PYTHONPATH:+:$PYTHONPATH}"
SGL_ARGS=(--device cuda --attention-backend triton --deterministic --disable-cuda-graph
          --draft-tokens "${DRAFT_TOKENS:-8}" --eagle3 "$HEAD_DIR")
[ "${FP32_LM_HEAD:-0}" = 1 ] && SGL_ARGS+=(--fp32-lm-head)

machine_record() {
    "$PY" - "$OUT/summary.json" "$STEPS" "$STATE" <<'PY'
import json, os, platform, subprocess, sys
def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"{cmd[0]}: {e}"
rec = {"gpu": run("nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm", "--format=csv"),
       "nvcc": run("nvcc", "--version").splitlines()[-1:] , "python": sys.version.split()[0],
       "platform": platform.platform(), "cpus": os.cpu_count()}
for mod in ("torch", "triton", "transformers", "sglang", "agentspec", "tvm_ffi", "xgrammar"):
    try:
        m = __import__(mod)
        rec[mod] = getattr(m, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        rec[mod] = f"not importable: {type(e).__name__}: {e}"
try:
    import torch
    rec["torch_cuda"] = torch.version.cuda
    rec["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
except Exception as e:  # noqa: BLE001
    rec["device"] = str(e)
steps = [json.loads(l) for l in open(sys.argv[2])] if os.path.exists(sys.argv[2]) else []
for name in ("import_check.json", "model.json", "stash.json"):
    p = os.path.join(sys.argv[3], name)
    if os.path.exists(p):
        rec[name.split(".")[0]] = json.load(open(p))
json.dump({"machine": rec, "steps": steps, "ok": all(s["ok"] for s in steps)}, open(sys.argv[1], "w"), indent=1)
PY
}

install() {
    local key
    # what is installed depends on the kit and on this tree's sources (a run may bring edited ones)
    key="$( { cat "$KIT/base/MANIFEST.json" 2>/dev/null || cat "$STATE/MANIFEST.json"
              find agentspec suffix_index kernels integrations tests/sglang/standin_cuda CMakeLists.txt pyproject.toml \
                   -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.h' -o -name '*.inc' -o -name '*.txt' -o -name '*.toml' \) \
                   -not -path '*/__pycache__/*' -not -path '*/build/*' -not -path '*.egg-info/*' -print0 \
                   | LC_ALL=C sort -z | xargs -0 sha256sum; } | sha256sum | cut -d' ' -f1)"
    if [ -f "$STATE/installed" ] && [ "$(cat "$STATE/installed")" = "$key" ]; then
        say "kit already installed on this machine"; return 0
    fi
    if [ ! -f "$KIT/base/MANIFEST.json" ]; then
        say "no kit here: carry build/gpu_kit/base (this machine is not the one an earlier run set up)"
        return 1
    fi
    say "installing $(ls "$KIT"/base/wheels/*.whl | wc -l) wheels"
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile "$KIT"/base/wheels/*.whl || return 1
    say "SGLang's Python tree -> $STATE/site"
    rm -rf "$STATE/site" && mkdir -p "$STATE/site" && tar -xJf "$KIT/base/sglang.tar.xz" -C "$STATE/site" || return 1
    say "agentspec (its C++ extensions built here) and the CUDA stand-in"
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-build-isolation \
        --config-settings=build-dir="$STATE/cmake/{wheel_tag}" . || return 1
    # from a copy: setuptools leaves build/ and *.egg-info beside the sources it builds, which would
    # change this key and reinstall everything on the next run
    local copy
    copy="$(mktemp -d)" && cp -r tests/sglang/standin_cuda "$copy/" && rm -rf "$copy"/standin_cuda/build "$copy"/standin_cuda/*.egg-info
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-build-isolation \
        "$copy/standin_cuda" || return 1
    rm -rf "$copy"
    (cd /tmp && "$PY" -c 'import suffix_index._core, agentspec.kernels._cpu, sgl_kernel, sglang; assert sgl_kernel.AGENTSPEC_CUDA_STANDIN') || return 1
    echo "$key" > "$STATE/installed"
}

stash() {
    "$PY" benchmarks/gpu/kit/kit.py stash --kit "$KIT" --state "$STATE" > "$STATE/stash.json"
    local rc=$?
    say "model parts: $(cat "$STATE/stash.json" 2>/dev/null)"
    return $rc
}

smoke() {
    install; step install $? || return 1
    stash; step stash $?
    "$PY" benchmarks/gpu/kit/import_check.py --out "$STATE/import_check.json" > /dev/null
    step "import check (real CUDA)" $? "$(tail -c 300 "$STATE/import_check.json" 2>/dev/null | tr '\n' ' ')"
    "$PY" benchmarks/gpu/kit/kit.py smoke-model --kit "$KIT" --state "$STATE" --out "$STATE/smoke_model"
    step "random-weight model" $? || return 1
    "$PY" - "$STATE/prompts.json" "$STATE/prompts_smoke.json" <<'PY'
import json, sys
sets = json.load(open(sys.argv[1]))
json.dump({k: v[:1] for k, v in sets.items()}, open(sys.argv[2], "w"))
PY
    say "smoke: one greedy request per workload (c=1, then both at once) and one sampled, per method"
    timeout -k 15 "${SMOKE_TIMEOUT:-330}" \
    "$PY" -P benchmarks/bench_sglang.py "${SGL_ARGS[@]}" --model "$STATE/smoke_model" --methods "$METHODS" \
        --prompts-file "$STATE/prompts_smoke.json" --max-tokens 24 --concurrency 1,2 --sampled 1 \
        --reference-logprobs --out "$OUT/smoke.json" > /dev/null
    local rc=$?
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && say "smoke cut off after ${SMOKE_TIMEOUT:-330}s"
    reap
    "$PY" - "$OUT/smoke.json" "$METHODS" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
want = sys.argv[2].split(",")
ran = [m for m in want if m in r["results"]]
print(json.dumps({"ran": ran, "errors": r["errors"],
                  "identical": {m: {k: v.get("identical_to_none") for k, v in e.items() if isinstance(v, dict) and "identical_to_none" in v}
                                for m, e in r["results"].items()}}))
sys.exit(0 if ran == want and not r["errors"] else 1)
PY
    local ran=$?
    [ $rc -ne 0 ] && ran=$rc
    step "smoke: every method started and answered (random weights: outputs not compared)" $ran
    return $ran
}

measure() {
    install; step install $? || return 1
    stash; step stash $?
    local gguf
    gguf="$("$PY" benchmarks/gpu/kit/kit.py assemble --kit "$KIT" --state "$STATE")"
    step "bundled GGUF joined from its parts" $? "$gguf" || return 1
    "$PY" benchmarks/gpu/kit/kit.py hf-model --kit "$KIT" --state "$STATE" --gguf "$gguf" \
        --out "$STATE/model" > "$STATE/model.json"
    step "converted to a Hugging Face folder" $? "$(cat "$STATE/model.json")" || return 1
    say "measure: ${METHODS} at concurrency ${CONCURRENCY:-1,16}"
    timeout -k 15 "${BENCH_TIMEOUT:-420}" \
    "$PY" -P benchmarks/bench_sglang.py "${SGL_ARGS[@]}" --model "$STATE/model" --methods "$METHODS" \
        --prompts-file "$STATE/prompts.json" --max-tokens "${MAX_TOKENS:-96}" --concurrency "${CONCURRENCY:-1,16}" \
        --c1-prompts "${C1_PROMPTS:-4}" \
        --reference-logprobs --sampled 2 --out "$OUT/bench_sglang_gpu.json" > /dev/null
    local rc=$?
    reap
    step "bench_sglang ran" $rc "$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "cut off after ${BENCH_TIMEOUT:-420}s")"
    "$PY" - "$OUT/bench_sglang_gpu.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
bad = {m: {k: v["identical_to_none"] for k, v in e.items() if isinstance(v, dict) and "identical_to_none" in v
           and v["identical_to_none"].split("/")[0] != v["identical_to_none"].split("/")[1]}
       for m, e in r["results"].items() if m != "ratios"}
bad = {m: v for m, v in bad.items() if v}
print(json.dumps({"errors": r["errors"], "not_identical": bad, "divergences": len(r.get("divergences", []))}))
sys.exit(1 if bad or r["errors"] else 0)
PY
    step "every greedy output identical to no speculation" $?
    timeout -k 15 "${SERVE_TIMEOUT:-150}" \
    "$PY" benchmarks/gpu/kit/serve_check.py --model "$STATE/model" --out "$OUT/serve.json" \
        --log "$OUT/serve.log" -- --device cuda --speculative agentspec --repo . \
        --sglang-arg attention_backend=triton --sglang-arg disable_cuda_graph=true \
        --sglang-arg enable_deterministic_inference=true
    rc=$?
    reap
    step "agentspec serve --backend sglang: chat, stream, /v1/apply" $rc
}

case "$MODE" in
    smoke) smoke || FAILED=1 ;;
    setup)   # run 1 when device time is short: install and keep the parts, no engine started
        install; step install $? || FAILED=1
        [ $FAILED = 0 ] && { stash; step stash $? || FAILED=1; } ;;
    store)
        if [ ! -f "$STATE/installed" ]; then
            say "this machine has no installed kit: the smoke run (with build/gpu_kit/base) must come first, on the same machine"
            step "state from the earlier runs" 1; FAILED=1
        else
            stash; step stash $? || FAILED=1
        fi ;;
    measure) measure || FAILED=1 ;;
    all) smoke || FAILED=1; measure || FAILED=1 ;;
    *) echo "usage: $0 smoke|setup|store|measure|all" >&2; exit 2 ;;
esac
grep -q '"ok": false' "$STEPS" && FAILED=1
machine_record
say "done ($MODE): $([ $FAILED = 0 ] && echo ok || echo FAILED) -> $OUT"
exit $FAILED
