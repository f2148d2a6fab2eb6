#!/usr/bin/env bash
# old (2d12989) vs new (main) back to back, alternating, same machine, same session
set -u
cd /work/main
PY=.venv/bin/python
for k in 1 2; do
  for rev in old new; do
    if [ $rev = old ]; then git checkout -q 2d12989; else git checkout -q main; fi
    echo "== $rev $k $(git rev-parse --short HEAD) $(date +%T)"
    $PY benchmarks/bench_e2e.py --prompts 6 --repeats 2 --no-hf --no-deterministic --vllm-python /none \
        --llamacpp-python /none --out /tmp/bench14/e2e_${rev}_${k}.json > /tmp/bench14/e2e_${rev}_${k}.log 2>&1
    echo "e2e done $(date +%T) rc=$?"
    $PY benchmarks/bench_throughput.py --concurrency 1,8 --vllm-python /none --no-sequential \
        --out /tmp/bench14/tp_${rev}_${k}.json > /tmp/bench14/tp_${rev}_${k}.log 2>&1
    echo "tp done $(date +%T) rc=$?"
    if [ $k = 1 ]; then
      $PY benchmarks/replay.py --methods agentspec,prompt_lookup --out /tmp/bench14/replay_${rev}.json > /tmp/bench14/replay_${rev}.log 2>&1
      echo "replay done $(date +%T) rc=$?"
    fi
  done
done
git checkout -q main
echo "ALL DONE $(date +%T)"
