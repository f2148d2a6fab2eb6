#!/usr/bin/env bash
# GPU run (second lease), part 2 of 2: continue training the first head (--init) on the larger
# distilled set, then the e2e benchmark on CUDA (tokenized prompts carried: the recorded traffic
# is not on that machine; bench_e2e --dump-prompts writes them, keyed agent_turns and rewrites; the
# run used the earlier benchmarks/bench_eagle3.py). Carry: .dev/gguf.b .dev/data .dev/prompts.json
set -x
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
cat /tmp/m/gguf.aa .dev/gguf.b > /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
M=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /tmp/data && for f in .dev/data/*.jsonl.gz; do gunzip -c $f > /tmp/data/$(basename $f .gz); done
ln -sfn ../kernels agentspec/kernels
timeout ${TRAIN_TIMEOUT:-280} python3 -m agentspec train-eagle3 --target $M --distilled /tmp/data/*.jsonl \
  --out /tmp/head --work /tmp/work --device cuda --epochs ${EPOCHS:-3} --time-limit ${TRAIN_SECONDS:-170} \
  --batch-rows 16384 --lr ${LR:-0.0004} --init /tmp/init 2>&1 | tr '\r' '\n' | grep -v "^train: \|^features: \|^dequant" | tee $OUT/train.log
cp /tmp/work/summary.json $OUT/ 2>/dev/null
cp /tmp/head/config.json $OUT/head_config.json && split -b 12000000 /tmp/head/model.safetensors $OUT/head.st.
tail -3 /tmp/build.log; ls /tmp/site2/suffix_index/
cp /tmp/site2/suffix_index/_core*.so suffix_index/ && cp /tmp/site2/agentspec/kernels/_cpu*.so kernels/
timeout ${BENCH_TIMEOUT:-100} python3 benchmarks/bench_e2e.py --model $M --eagle3 /tmp/head --device cuda \
  --prompts-file .dev/prompts.json --workloads agent_turns,rewrites --concurrency 1,8 --budgets fixed \
  --peers none --repeats 1 --max-tokens 96 --drafters none,suffix,suffix+eagle3 \
  --out $OUT/e2e_gpu.json 2>&1 | grep "bench_e2e\]\|Error" | tee $OUT/bench.log
ls -la $OUT
