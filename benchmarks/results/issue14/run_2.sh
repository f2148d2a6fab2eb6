#!/usr/bin/env bash
set -u
cd /work/main
PY=.venv/bin/python
NEW=$(git rev-parse --short main)
for k in 3 4 5; do
  for rev in old new; do
    if [ $rev = old ]; then git checkout -q 2d12989; else git checkout -q main; fi
    echo "== $rev $k $(git rev-parse --short HEAD) $(date +%T)"
    $PY benchmarks/bench_e2e.py --prompts 6 --repeats 3 --no-hf --no-deterministic --vllm-python /none \
        --llamacpp-python /none --out /tmp/bench14/e2e_${rev}_${k}.json > /tmp/bench14/e2e_${rev}_${k}.log 2>&1
    echo "e2e done $(date +%T) rc=$?"
    if [ $k != 5 ]; then
      $PY benchmarks/bench_throughput.py --concurrency 1,8 --vllm-python /none --no-sequential \
          --out /tmp/bench14/tp_${rev}_${k}.json > /tmp/bench14/tp_${rev}_${k}.log 2>&1
      echo "tp done $(date +%T) rc=$?"
    fi
  done
done
git checkout -q main
$PY benchmarks/replay.py --methods agentspec,prompt_lookup --out /tmp/bench14/replay_new2.json > /tmp/bench14/replay_new2.log 2>&1
echo "ALL DONE $(date +%T)"
