#!/usr/bin/env bash
# GPU run, part 2 of 2: the model file whole again, an EAGLE-3 head trained on the distilled
# records (agentspec train-eagle3 --device cuda), then the e2e benchmark on CUDA with it (the run
# used the earlier benchmarks/bench_eagle3.py: 8 agent-turn and 4 rewrite prompts; bench_e2e takes
# one prompt count per run, so it runs once per workload).
# Carry: .dev/gguf.ab .dev/data ; the head comes back split in $OUT (files <= 16 MB).
set -x
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
ln -sfn ../kernels agentspec/kernels
cp /tmp/site2/suffix_index/_core*.so suffix_index/ && cp /tmp/site2/agentspec/kernels/_cpu*.so kernels/
cat /tmp/m/gguf.aa .dev/gguf.ab > /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
M=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /tmp/data && for f in .dev/data/*.jsonl.gz; do gunzip -c $f > /tmp/data/$(basename $f .gz); done
ls -la /tmp/data
timeout ${TRAIN_TIMEOUT:-330} python3 -m agentspec train-eagle3 --target $M --distilled /tmp/data/*.jsonl \
  --out /tmp/head --work /tmp/work --device cuda --epochs ${EPOCHS:-12} --time-limit ${TRAIN_SECONDS:-200} \
  --batch-rows 16384 2>&1 | tr '\r' '\n' | grep -v "^train: \|^features: " | tee $OUT/train.log
cp /tmp/work/summary.json $OUT/ 2>/dev/null
cp /tmp/head/config.json $OUT/head_config.json && split -b 12000000 /tmp/head/model.safetensors $OUT/head.st.
for w in agent_turns:8 rewrites:4; do
  timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_e2e.py --model $M --eagle3 /tmp/head --device cuda \
    --workloads ${w%:*} --prompts ${w#*:} --drafters none,suffix,suffix+eagle3,eagle3 --concurrency 1,8 \
    --budgets fixed --peers none --repeats ${REPEATS:-1} --out $OUT/e2e_gpu_${w%:*}.json 2>&1 \
    | grep "bench_e2e\]\|Error\|error" | tee -a $OUT/bench.log
done
ls -la $OUT
