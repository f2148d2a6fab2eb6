#!/usr/bin/env bash
# GPU run (second lease), part 1 of 2: as eagle3_prep.sh, but the native build runs in the
# background (its own session, so it outlives this call) while part 2 trains on the GPU; the
# first head (.dev/init) is staged to continue training from. Carry: .dev/whl .dev/gguf.aa .dev/init
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .dev/whl/*.whl || exit 1
mkdir -p /tmp/m /tmp/init /tmp/repo && cp .dev/gguf.aa /tmp/m/ && cp .dev/init/* /tmp/init/
cp -r agentspec kernels suffix_index CMakeLists.txt pyproject.toml README.md /tmp/repo/
cd /tmp/repo && PYTHONPATH=/tmp/site CMAKE_BUILD_PARALLEL_LEVEL=16 setsid nohup python3 -m pip install -q --no-index \
  --no-deps --no-build-isolation --no-compile --target /tmp/site2 . > /tmp/build.log 2>&1 < /dev/null &
sleep 2; echo started
