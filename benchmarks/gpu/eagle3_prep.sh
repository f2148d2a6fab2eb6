#!/usr/bin/env bash
# GPU run, part 1 of 2 (see benchmarks/gpu/README.md): install the carried wheels, build this
# package's native parts (suffix index, CPU kernels) for the machine's Python, stage the first
# half of the model file. Carry: .dev/whl .dev/gguf.aa
set -x
nvidia-smi -L; python3 -V; nproc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .dev/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
t0=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --target /tmp/site2 . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
ls /tmp/site2/suffix_index /tmp/site2/agentspec/kernels | grep "\.so"
mkdir -p /tmp/m && cp .dev/gguf.aa /tmp/m/
python3 -c "import torch, msgspec, gguf, tokenizers, jinja2, safetensors, tqdm; print(torch.__version__, torch.cuda.is_available())"
