"""Per-tenant rate and concurrency limits through a real server: 429 with Retry-After for the
tenant over its limit, never for another tenant."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from helpers.serve import Server

pytestmark = pytest.mark.slow

CONFIG = '''
[[tenants]]
name = "capped"
api_keys = ["sk-capped-0001"]
max_concurrent = 1
requests_per_minute = 4

[[tenants]]
name = "free"
api_keys = ["sk-free-00001"]
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("limits"), config=CONFIG, name="limits")
    yield s
    s.stop()


def chat(base: str, key: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                      json={"messages": [{"role": "user", "content": "Count from one to fifty."}],
                            "max_tokens": max_tokens, "temperature": 0})


def test_concurrency_cap_then_rate_cap_with_retry_after(server):
    results = {}
    slow = threading.Thread(target=lambda: results.setdefault("slow", chat(server.base, "sk-capped-0001", 200)))
    slow.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # until the first request is running
            if httpx.get(server.base + "/health").json().get("running"):
                break
            time.sleep(0.02)
        r = chat(server.base, "sk-capped-0001")
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"] == "1"
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        assert "max_concurrent = 1" in err["message"]
        assert chat(server.base, "sk-free-00001").status_code == 200   # another tenant is not held back
    finally:
        slow.join(300)
    assert results["slow"].status_code == 200
    # 2 of its 4 per minute were started (the slow one, and the refused one was never started)
    assert chat(server.base, "sk-capped-0001").status_code == 200
    assert chat(server.base, "sk-capped-0001").status_code == 200
    assert chat(server.base, "sk-capped-0001").status_code == 200
    r = chat(server.base, "sk-capped-0001")
    assert r.status_code == 429 and "requests_per_minute = 4" in r.json()["error"]["message"]
    assert 1 <= int(r.headers["Retry-After"]) <= 60
