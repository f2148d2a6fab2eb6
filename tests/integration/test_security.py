"""Security controls through a real server (SECURITY.md lists each with its test): API keys are
never logged, /health and /metrics carry no prompt text, log lines cannot be forged through
request fields, and one tenant's prompts never become another tenant's prefix-cache hits or
log records."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers.serve import Server

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "sk-tenant-a-secret-7781", "sk-tenant-b-secret-9902"
CANARY = "zebra-orchid-canary-5531"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("security")
    logs = tmp / "logs"
    config = (f'[server]\nlog_dir = "{logs}"\n\n[[tenants]]\nname = "a"\napi_keys = ["{KEY_A}"]\n\n'
              f'[[tenants]]\nname = "b"\napi_keys = ["{KEY_B}"]\n')
    s = Server(tmp, config=config, name="security")
    s.logs = logs
    yield s
    s.stop()


def post(server, key: str, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.base + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def lines_of(path, at_least: int, timeout: float = 30.0) -> list[str]:
    """The log's lines once it has ``at_least`` (records are written by a background writer)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= at_least or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def long_prompt() -> str:
    return (f"Project notes {CANARY}.\n" + "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n"
                                                   for i in range(60)))


def test_one_tenants_prompt_is_never_another_tenants_cache_hit_or_log(server):
    body = {"messages": [{"role": "user", "content": long_prompt()}], "max_tokens": 2, "temperature": 0}
    first, again = post(server, KEY_A, body), post(server, KEY_A, body)
    assert first.status_code == again.status_code == 200
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0   # A's own prompt is reused
    other = post(server, KEY_B, body)
    assert other.status_code == 200
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # never from A's entries
    records_b = lines_of(server.logs / "b.jsonl", 1)
    assert records_b and all(json.loads(r)["tenant"] == "b" for r in records_b)
    assert CANARY not in "".join(p.read_text() for p in server.logs.glob("*.jsonl*"))   # no prompt text in logs


def test_keys_are_never_logged_and_health_metrics_carry_no_prompts(server):
    post(server, KEY_A, {"messages": [{"role": "user", "content": f"say {CANARY}"}], "max_tokens": 2})
    bad = post(server, "sk-wrong-key-000000", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert bad.status_code == 401 and "sk-wrong-key-000000" not in bad.text
    health = httpx.get(server.base + "/health").text
    metrics = httpx.get(server.base + "/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text
    for text in (health, metrics):
        assert CANARY not in text and KEY_A not in text and KEY_B not in text
    server.stderr.seek(0)
    logged = server.stderr.read() + "".join(p.read_text() for p in server.logs.glob("*.jsonl*"))
    for secret in (KEY_A, KEY_B, "sk-wrong-key-000000"):
        assert secret not in logged


def test_newlines_in_request_fields_cannot_forge_log_lines(server):
    forged = 'x"}\n{"tenant": "b", "request_id": "forged", "mat": 99}\n'
    before = len(lines_of(server.logs / "a.jsonl", 3))   # the earlier tests' records of tenant a
    r = post(server, KEY_A, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": forged})
    assert r.status_code in (200, 400)
    lines = lines_of(server.logs / "a.jsonl", before + (r.status_code == 200))
    assert len(lines) == before + (r.status_code == 200)
    for line in lines:
        rec = json.loads(line)   # every line is one whole record of this tenant
        assert rec["tenant"] == "a" and rec["request_id"] != "forged"


def test_a_public_bind_without_keys_refuses_to_start(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "agentspec", "serve", "--host", "0.0.0.0", "--port", "1"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0 and "--insecure-no-auth" in r.stderr and "api_keys" in r.stderr
