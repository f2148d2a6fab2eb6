#!/usr/bin/env bash
# agentspec on SGLang across GPU nodes: N `agentspec serve --backend sglang` workers per node, and
# one front that keeps a tenant's (or a session's) requests on one worker. See README.md here.
#
#   deploy/sglang-router/launch.sh workers          # on every GPU node: N workers, one per GPU group
#   deploy/sglang-router/launch.sh router URL...    # on the front node: nginx (default) or sglang-router
#   deploy/sglang-router/launch.sh stop             # stop what this script started on this node
#   DRY_RUN=1 deploy/sglang-router/launch.sh workers  # print each worker's folder and command; start nothing
#
# Environment (defaults in brackets):
#   MODEL          Hugging Face folder SGLang loads                   [/models/Qwen2.5-Coder-7B-Instruct]
#   CONFIG         server TOML (tenants with api_keys: required, the workers bind 0.0.0.0)  [./server.toml]
#   REPO           workspace to index (every worker indexes every tenant's workspace)       [.]
#                  (relative paths in MODEL, CONFIG, REPO and AGENTSPEC are from where this is run:
#                  they are made absolute before each worker starts in its own folder)
#   WORKERS        workers on this node                                [1]
#   GPUS_PER_WORKER  GPUs per worker (--tp)                            [1]
#   BASE_PORT      first worker port; worker i listens on BASE_PORT+i  [8001]
#   WORKER_ARGS    extra `agentspec serve` arguments                   [--draft-tokens 8]
#   BACKEND_ARGS   backend arguments; empty: the embedded CPU engine (to try this on one machine)
#                                                                      [--backend sglang --model $MODEL]
#   BIND           address the workers bind                            [0.0.0.0]
#   ROUTER         nginx | sglang-router (see README: sglang-router 0.3.2 does not carry agentspec's API)
#                                                                      [nginx]
#   ROUTER_HOST / ROUTER_PORT   where the front listens                [0.0.0.0 / 8000]
#   RUN_DIR        per-worker working dirs (logs/, pid files)          [./run]
#   DRY_RUN        1: print each worker's folder and command instead of starting it  [0]
set -euo pipefail

# `path` made absolute from the current directory (a path that does not exist yet too); each
# worker runs in its own folder, where a relative path would name something else
absolute() {
    case "$1" in
    /*) printf '%s\n' "$1" ;;
    *) printf '%s\n' "$PWD/${1#./}" ;;
    esac
}

MODEL="${MODEL:-/models/Qwen2.5-Coder-7B-Instruct}"
[ ! -e "$MODEL" ] || MODEL="$(absolute "$MODEL")"   # a local folder (not a hub id)
CONFIG="$(absolute "${CONFIG:-server.toml}")"
REPO="${REPO:-.}"
if [ -d "$REPO" ]; then REPO="$(cd "$REPO" && pwd)"; else REPO="$(absolute "$REPO")"; fi
WORKERS="${WORKERS:-1}"
GPUS_PER_WORKER="${GPUS_PER_WORKER:-1}"
BASE_PORT="${BASE_PORT:-8001}"
WORKER_ARGS="${WORKER_ARGS---draft-tokens 8}"
BACKEND_ARGS="${BACKEND_ARGS---backend sglang --model $MODEL}"
BIND="${BIND:-0.0.0.0}"
ROUTER="${ROUTER:-nginx}"
ROUTER_HOST="${ROUTER_HOST:-0.0.0.0}"
ROUTER_PORT="${ROUTER_PORT:-8000}"
RUN_DIR="$(mkdir -p "${RUN_DIR:-$PWD/run}" && cd "${RUN_DIR:-$PWD/run}" && pwd)"
HERE="$(cd "$(dirname "$0")" && pwd)"
AGENTSPEC="${AGENTSPEC:-agentspec}"
case "$AGENTSPEC" in */*) AGENTSPEC="$(absolute "$AGENTSPEC")" ;; esac   # a path, not a name on PATH
DRY_RUN="${DRY_RUN:-0}"

wait_healthy() {  # URL SECONDS PIDFILE
    local deadline=$((SECONDS + $2))
    until curl -fsS -o /dev/null "$1/health" 2>/dev/null; do
        kill -0 "$(cat "$3")" 2>/dev/null || { echo "launch: the worker at $1 exited: see ${3%/pid}/serve.log" >&2; return 1; }
        [ "$SECONDS" -lt "$deadline" ] || { echo "launch: $1 not healthy after $2 s" >&2; return 1; }
        sleep 2
    done
}

workers() {
    [ -f "$CONFIG" ] || { echo "launch: no config at $CONFIG (tenants with api_keys)" >&2; exit 2; }
    [ -d "$REPO" ] || { echo "launch: REPO is not a directory: $REPO (the workspace the workers index)" >&2; exit 2; }
    local i
    for ((i = 0; i < WORKERS; i++)); do
        local port=$((BASE_PORT + i)) dir="$RUN_DIR/worker-$i"
        local first=$((i * GPUS_PER_WORKER)) gpus
        gpus="$(seq -s, "$first" $((first + GPUS_PER_WORKER - 1)))"
        # own working dir: `log_dir = "logs"` (relative) gives each worker its own logs/, so no two
        # processes append to and rotate the same <tenant>.jsonl; `agentspec stats --log-dir run/worker-i/logs`
        local tp=()
        [ -z "$BACKEND_ARGS" ] || tp=(--tp "$GPUS_PER_WORKER")
        # shellcheck disable=SC2086  # BACKEND_ARGS / WORKER_ARGS are word lists
        local argv=("$AGENTSPEC" serve --host "$BIND" --port "$port" --config "$CONFIG" --repo "$REPO"
                    $BACKEND_ARGS "${tp[@]}" $WORKER_ARGS)
        if [ "$DRY_RUN" = 1 ]; then
            printf 'worker %d: cd %q && CUDA_VISIBLE_DEVICES=%q' "$i" "$dir" "$gpus"
            printf ' %q' "${argv[@]}"
            printf '\n'
            continue
        fi
        mkdir -p "$dir"
        (cd "$dir" && CUDA_VISIBLE_DEVICES="$gpus" exec "${argv[@]}" >"$dir/serve.log" 2>&1) &
        echo $! >"$dir/pid"
        echo "worker $i: pid $(cat "$dir/pid"), port $port, GPUs $gpus, logs $dir"
    done
    [ "$DRY_RUN" != 1 ] || return 0
    for ((i = 0; i < WORKERS; i++)); do
        wait_healthy "http://127.0.0.1:$((BASE_PORT + i))" "${START_TIMEOUT_S:-900}" "$RUN_DIR/worker-$i/pid"
    done
    echo "workers healthy"
}

router() {
    [ "$#" -gt 0 ] || { echo "usage: launch.sh router http://node1:8001 http://node1:8002 http://node2:8001 ..." >&2; exit 2; }
    case "$ROUTER" in
    nginx)
        # consistent hash on X-Session-ID, else on the API key (= the tenant): see README.md
        local servers="" url
        for url in "$@"; do servers+="        server ${url#http://} max_fails=3 fail_timeout=10s;"$'\n'; done
        mkdir -p "$RUN_DIR/nginx/logs" "$RUN_DIR/nginx/tmp"
        sed -e "s|@LISTEN@|$ROUTER_HOST:$ROUTER_PORT|" -e "s|@RUN_DIR@|$RUN_DIR/nginx|g" \
            "$HERE/nginx.conf" | awk -v s="$servers" '{ if ($0 == "@SERVERS@") printf "%s", s; else print }' \
            >"$RUN_DIR/nginx/nginx.conf"
        nginx -p "$RUN_DIR/nginx" -c "$RUN_DIR/nginx/nginx.conf" -t -q
        nginx -p "$RUN_DIR/nginx" -c "$RUN_DIR/nginx/nginx.conf"
        echo "nginx on $ROUTER_HOST:$ROUTER_PORT -> $*"
        ;;
    sglang-router)
        # --policy manual: sticky routing by the X-SMG-Routing-Key header (cache_aware is prefix-based
        # and ignores it). Chat bodies are re-serialized by the router: see README.md for what breaks.
        python -m sglang_router.launch_router --host "$ROUTER_HOST" --port "$ROUTER_PORT" \
            --worker-urls "$@" --policy manual --assignment-mode min_load --max-idle-secs 14400 \
            --health-check-endpoint /health --prometheus-port "${ROUTER_PROMETHEUS_PORT:-29000}" \
            >"$RUN_DIR/router.log" 2>&1 &
        echo $! >"$RUN_DIR/router.pid"
        echo "sglang-router (pid $(cat "$RUN_DIR/router.pid")) on $ROUTER_HOST:$ROUTER_PORT -> $*"
        ;;
    *) echo "launch: ROUTER must be nginx or sglang-router, got $ROUTER" >&2; exit 2 ;;
    esac
}

stop() {
    local f
    if [ -f "$RUN_DIR/nginx/logs/nginx.pid" ]; then
        nginx -p "$RUN_DIR/nginx" -c "$RUN_DIR/nginx/nginx.conf" -s quit || true
    fi
    for f in "$RUN_DIR"/router.pid "$RUN_DIR"/worker-*/pid; do
        [ -f "$f" ] || continue
        kill "$(cat "$f")" 2>/dev/null || true   # SIGTERM: each worker writes its queued log records first
        rm -f "$f"
    done
}

cmd="${1:-}"
shift || true
case "$cmd" in
workers) workers ;;
router) router "$@" ;;
stop) stop ;;
*) sed -n '2,9p' "$0"; exit 2 ;;
esac
