#!/usr/bin/env bash
# The coding-agent CLIs that tests/models/test_agent_clis.py runs against `agentspec serve`, at pinned
# versions, from the npm registry into .agents/ (ignored by git): opencode, Codex CLI, Claude Code and
# Qwen Code. Nothing is installed globally; nothing is fetched at test time. Node.js and npm must be
# on PATH (Debian: apt-get install nodejs npm). The native binaries (opencode, Claude Code, Codex) come
# in per-platform npm packages; opencode's and Claude Code's install scripts link them into place.
#
#     bash scripts/setup_agents.sh            # install (again, if a pin changed)
#     AGENTS_DIR=/elsewhere bash scripts/setup_agents.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${AGENTS_DIR:-.agents}"
pins=(opencode-ai@1.18.33 @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.332 @qwen-code/qwen-code@0.24.4)

if ! command -v npm >/dev/null 2>&1; then
    echo "setup_agents: npm not found: install Node.js 20 or later (Debian: apt-get install nodejs npm)" >&2
    exit 1
fi
stamp="$dir/.pins"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ] && [ -x "$dir/node_modules/.bin/opencode" ]; then
    echo "setup_agents: $dir has ${pins[*]}"
    exit 0
fi
mkdir -p "$dir"
npm install --prefix "$dir" --no-fund --no-audit --loglevel=error "${pins[@]}"
echo "${pins[*]}" > "$stamp"
for bin in opencode codex claude qwen; do
    "$dir/node_modules/.bin/$bin" --version >/dev/null 2>&1 || echo "setup_agents: $bin does not start here" >&2
done
echo "setup_agents: ${pins[*]} in $dir"
