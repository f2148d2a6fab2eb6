"""Real coding-agent CLIs against ``agentspec serve`` on a real coder model: each runs headless in a
scratch git repository, is asked to create a file, and must do it through its own tool calls
(the model's call parsed by the server, run by the CLI, its result sent back and answered).

Opt-in: ``make test-agents`` installs the CLIs at pinned versions into .agents/
(scripts/setup_agents.sh), fetches Qwen2.5-Coder-1.5B-Instruct Q4_K_M and runs this file;
``AGENTSPEC_TEST_MODEL`` picks another model (scripts/fetch_model.py's names). Nothing is installed
here: a CLI missing from .agents/ (or ``AGENTSPEC_AGENTS_DIR``) is skipped, naming the setup step.
Each CLI gets its own HOME with telemetry, update checks and model-catalogue fetches off, and
``AGENTSPEC_AGENT_TIMEOUT`` seconds (default 1800: a CPU prefills an agent's 7k-19k-token prompt
in minutes). The settings are the ones docs/agents.md gives.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.serve import Server

ROOT = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("AGENTSPEC_TEST_MODEL", "qwen2.5-coder-1.5b")
AGENTS = Path(os.environ.get("AGENTSPEC_AGENTS_DIR", ROOT / ".agents")) / "node_modules" / ".bin"
TIMEOUT = float(os.environ.get("AGENTSPEC_AGENT_TIMEOUT", "1800"))
CONTEXT = 32768   # Qwen2.5-Coder's window: the CLIs' prompts run past the default 8192
TASK = "Create a file hello.py that prints hello world"

# the suite's per-test timeout is far shorter than a CLI's run (and the first test's includes the server's start)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT + 900)]


def _needs(name: str):
    """Skip (before the server starts) when the CLI is not installed."""
    return pytest.mark.skipif(not os.access(AGENTS / name, os.X_OK),
                              reason=f"{name} is not installed in {AGENTS.parent.parent}: run "
                                     "`bash scripts/setup_agents.sh` (make test-agents does)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("fetch_model", ROOT / "scripts" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fetch_model"] = mod
    spec.loader.exec_module(mod)
    path = mod.fetch(MODEL)
    # a CPU may take longer than the default 600 s request timeout to prefill Claude Code's or Qwen Code's prompt
    srv = Server(tmp_path_factory.mktemp("agent-server"), config="[server]\nrequest_timeout_s = 3600\n", timeout=600,
                 args=["--model", str(path), "--max-context", str(CONTEXT)])
    yield srv
    srv.stop()


def _records(server: Server) -> list[dict]:
    log = server.cwd / "logs" / "default.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _repo(tmp_path: Path) -> tuple[Path, dict]:
    """A scratch git repository and a HOME of its own for the CLI."""
    repo, home = tmp_path / "repo", tmp_path / "home"
    repo.mkdir()
    home.mkdir()
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], cwd=repo, check=True)
    (repo / "README.md").write_text("# scratch\n")
    subprocess.run(git + ["add", "README.md"], cwd=repo, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "init"], cwd=repo, check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "CLAUDE_", "CODEX_"))}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"), NO_COLOR="1",
               PWD=str(repo))   # opencode looks for its project config from $PWD, not the working directory
    return repo, env


def _run(cmd: list, repo: Path, env: dict, server: Server, endpoint: str) -> str:
    before = len(_records(server))
    try:
        r = subprocess.run([str(c) for c in cmd], cwd=repo, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=TIMEOUT)
        out = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        out = f"timed out after {TIMEOUT:.0f} s\n" + (e.stdout or b"").decode(errors="replace") \
            + (e.stderr or b"").decode(errors="replace")
    turns = [r for r in _records(server)[before:] if r["endpoint"] == endpoint]
    hello = repo / "hello.py"
    assert hello.is_file(), f"no hello.py; the CLI said:\n{out[-4000:]}\nserver turns: {len(turns)}"
    ran = subprocess.run([sys.executable, str(hello)], capture_output=True, text=True, timeout=60)
    assert "hello" in ran.stdout.lower(), (hello.read_text(), ran.stdout, ran.stderr)
    # the file came from a tool call: the call's turn, then a turn answering its result
    assert sum(t["finish_reason"] == "stop" for t in turns) >= 2, turns
    assert max(t["prompt_tokens"] for t in turns) > 2000   # the CLI's own system prompt and tools
    return out


@_needs("opencode")
def test_opencode(server, tmp_path):
    opencode = AGENTS / "opencode"
    repo, env = _repo(tmp_path)
    (repo / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"agentspec": {
            "npm": "@ai-sdk/openai-compatible", "name": "agentspec",
            "options": {"baseURL": server.base + "/v1", "apiKey": "none", "timeout": False},
            "models": {"qwen": {"name": "Qwen2.5-Coder", "tool_call": True, "temperature": True,
                                "limit": {"context": CONTEXT, "output": 1024}}}}},
        "model": "agentspec/qwen", "small_model": "agentspec/qwen",
        "agent": {"build": {"temperature": 0}}, "autoupdate": False, "share": "disabled"}))
    env.update(OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_SHARE="1",
               OPENCODE_DISABLE_LSP_DOWNLOAD="1", OPENCODE_DISABLE_DEFAULT_PLUGINS="1", OPENCODE_DISABLE_CLAUDE_CODE="1")
    _run([opencode, "run", "--title", "hello", TASK], repo, env, server, "chat.completions")


@_needs("codex")
def test_codex(server, tmp_path):
    codex = AGENTS / "codex"
    repo, env = _repo(tmp_path)
    home = Path(env["HOME"]) / ".codex"
    home.mkdir()
    (home / "config.toml").write_text(f'''model = "qwen"
model_provider = "agentspec"
model_context_window = {CONTEXT}
approval_policy = "never"
sandbox_mode = "workspace-write"
check_for_update_on_startup = false

[model_providers.agentspec]
name = "agentspec"
base_url = "{server.base}/v1"
wire_api = "responses"
env_key = "AGENTSPEC_API_KEY"

[analytics]
enabled = false

[otel]
exporter = "none"
''')
    env.update(CODEX_HOME=str(home), AGENTSPEC_API_KEY="none")
    _run([codex, "exec", "--skip-git-repo-check", TASK], repo, env, server, "responses")


@_needs("claude")
def test_claude_code(server, tmp_path):
    claude = AGENTS / "claude"
    repo, env = _repo(tmp_path)
    env.update(ANTHROPIC_BASE_URL=server.base, ANTHROPIC_AUTH_TOKEN="none", ANTHROPIC_MODEL="qwen",
               ANTHROPIC_SMALL_FAST_MODEL="qwen", CLAUDE_CONFIG_DIR=str(Path(env["HOME"]) / ".claude"),
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1",
               DISABLE_ERROR_REPORTING="1")
    _run([claude, "-p", TASK, "--permission-mode", "acceptEdits"], repo, env, server, "messages")


@_needs("qwen")
def test_qwen_code(server, tmp_path):
    qwen = AGENTS / "qwen"
    repo, env = _repo(tmp_path)
    settings = Path(env["HOME"]) / ".qwen"
    settings.mkdir()
    (settings / "settings.json").write_text(json.dumps({
        "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True}}))
    env.update(OPENAI_BASE_URL=server.base + "/v1", OPENAI_API_KEY="none", OPENAI_MODEL="qwen",
               QWEN_CODE_SUPPRESS_YOLO_WARNING="1",
               # a stream may live 900 s by default: a CPU's prefill of Qwen Code's 17k-token prompt can take longer
               QWEN_STREAM_MAX_LIFETIME_MS=str(int(TIMEOUT * 1000)))
    _run([qwen, "--auth-type", "openai", "--approval-mode", "yolo", "--max-session-turns", "6", TASK],
         repo, env, server, "chat.completions")
