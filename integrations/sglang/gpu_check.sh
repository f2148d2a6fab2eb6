#!/usr/bin/env bash
# GPU runbook for the SGLang backend: run as is on a machine with CUDA and SGLang installed
# (pip install -e '.[sglang]' from this clone, into an environment with SGLang's CUDA build).
#
#   bash integrations/sglang/gpu_check.sh [OUT_DIR]
#
#   MODEL=/path/to/hf-folder   target model (default: the bundled SmolLM2-135M-Instruct, converted)
#   DRAFT_TOKENS=8             SGLang's verify width for NGRAM and AGENTSPEC
#   AGENT=8 REWRITES=8         prompts per workload from DATA (default benchmarks/data, the shipped sample)
#
# What it does, each step's output under OUT_DIR (default gpu_check_out/):
#   1. environment: GPU, torch, SGLang and agentspec versions, that the AGENTSPEC plugin registers;
#   2. exactness, acceptance and throughput: benchmarks/bench_sglang.py on real rewrite and agent
#      prompts with SGLang without speculation, NGRAM, AGENTSPEC and EAGLE-3 (this repo's head);
#      every speculative output must be identical to the plain one (greedy);
#   3. the server: `agentspec serve --backend sglang` started, timed, asked once with the openai
#      client (chat, stream) and stopped.
# It exits non-zero if the plugin does not register, an output differs, or the server fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
DATA="${DATA:-benchmarks/data}"
say() { echo "[gpu_check] $*" >&2; }

say "1/3 environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt" >&2
"$PY" - <<'PY' | tee "$OUT/env.json"
import json, torch, sglang, agentspec
from agentspec.integrations.sglang.plugin import load
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
load()
algo = SpeculativeAlgorithm.from_string("AGENTSPEC")
assert algo.is_ngram() and not algo.has_draft_kv(), algo
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "sglang": sglang.__version__,
                  "agentspec": agentspec.__version__, "gpu": torch.cuda.get_device_name(0),
                  "algorithm": repr(algo)}))
PY

if [ -z "${MODEL:-}" ]; then
    MODEL="$OUT/SmolLM2-135M-Instruct"
    [ -f "$MODEL/config.json" ] || "$PY" -m agentspec.integrations.sglang.convert "$MODEL"
fi

say "2/3 exactness, acceptance, throughput (none, ngram, agentspec, eagle3)"
"$PY" benchmarks/bench_sglang.py --device cuda --model "$MODEL" --data "$DATA" \
    --methods none,ngram,agentspec,eagle3 --draft-tokens "${DRAFT_TOKENS:-8}" \
    --agent "${AGENT:-8}" --rewrites "${REWRITES:-8}" --max-tokens 256 --out "$OUT/bench_sglang_gpu.json"
"$PY" - "$OUT/bench_sglang_gpu.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["results"]
bad = [(m, wl, e["identical_to_none"]) for m, wls in r.items() if m not in ("none", "ratios")
       for wl, e in wls.items() if isinstance(e, dict) and "identical_to_none" in e
       and e["identical_to_none"].split("/")[0] != e["identical_to_none"].split("/")[1]]
print(json.dumps(r.get("ratios", {}), indent=1), file=sys.stderr)
if bad:
    sys.exit(f"[gpu_check] outputs differ from SGLang without speculation: {bad}")
PY

say "3/3 agentspec serve --backend sglang"
PORT="${PORT:-18431}"
start=$(date +%s.%N)
"$PY" -m agentspec serve --backend sglang --model "$MODEL" --device cuda --port "$PORT" --repo . \
    --insecure-no-auth > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 $SERVER 2>/dev/null || { cat "$OUT/serve.log" >&2; exit 1; }
    sleep 0.5
done
ready=$(echo "$(date +%s.%N) - $start" | bc)
"$PY" - "$PORT" "$ready" <<'PY' | tee "$OUT/serve.json"
import json, sys, time, openai
c = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="none")
msgs = [{"role": "user", "content": "Rewrite in Python 3 with type hints:\ndef add(a, b):\n    return a + b\n"}]
t = time.perf_counter()
r = c.chat.completions.create(model="x", messages=msgs, temperature=0, max_tokens=128)
dt = time.perf_counter() - t
s = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
    model="x", messages=msgs, temperature=0, max_tokens=128, stream=True) if ch.choices)
assert s == r.choices[0].message.content, "stream differs from non-stream"
print(json.dumps({"ready_s": float(sys.argv[2]), "chat_s": round(dt, 3), "completion_tokens": r.usage.completion_tokens}))
PY
kill $SERVER
wait $SERVER 2>/dev/null || true
say "done: $OUT"
