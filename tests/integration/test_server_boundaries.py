"""The server's boundaries through real servers on loopback (SECURITY.md names each test):

- the server's own files (its config file, ``log_dir``, the cache folder) are no tenant's, even
  inside the workspace: ``/v1/apply`` refuses them with 403 naming the rule, and no workspace
  indexes them;
- a server without API keys answers only loopback ``Host`` names (DNS rebinding) and only JSON
  bodies (a web page's text/plain or form post), and a deeply nested body is a 400, not a 500;
- ``/metrics`` gives a tenant its own series only (an operator key reads all);
- log files are 0600 in a 0700 folder;
- a tenant flooding the queue does not hold another tenant's request behind the flood;
- ``agentspec lsp --tcp`` with a token refuses a peer that does not send it.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.serve import Server, free_port

pytestmark = pytest.mark.slow

ACME, GLOBEX, OPS = "sk-acme-boundary-5512", "sk-globex-boundary-7790", "sk-operator-metrics-3318"


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """Two tenants whose workspace is the folder the server runs in: its config file and its
    logs/ are inside the workspace."""
    ws = tmp_path_factory.mktemp("boundaries")
    (ws / "main.py").write_text("def main():\n    return 'boundary-main-egret'\n")
    (ws / "cfg_link.py").symlink_to(ws / "keyed.toml")
    config = (f'[server]\nlog_dir = "logs"\nmetrics_api_keys = ["{OPS}"]\n\n'
              f'[[tenants]]\nname = "acme"\napi_keys = ["{ACME}"]\n\n'
              f'[[tenants]]\nname = "globex"\napi_keys = ["{GLOBEX}"]\n')
    s = Server(ws, config=config, repo=ws, name="keyed")
    for key in (ACME, GLOBEX):   # a record in each tenant's log
        r = httpx.post(s.base + "/v1/completions", headers=_auth(key), json={"prompt": "a", "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while not all((ws / "logs" / f"{t}.jsonl").exists() for t in ("acme", "globex")) and time.monotonic() < deadline:
        time.sleep(0.05)
    s.ws = ws
    yield s
    s.stop()


@pytest.mark.parametrize("path,rule", [("keyed.toml", "config file"), ("logs/acme.jsonl", "log_dir"),
                                       ("logs/globex.jsonl", "log_dir"), ("cfg_link.py", "config file"),
                                       ("./logs/../keyed.toml", "config file")])
def test_the_servers_own_files_are_no_tenants(keyed, path, rule):
    for key in (ACME, GLOBEX):
        r = httpx.post(keyed.base + "/v1/apply", headers=_auth(key), timeout=60,
                       json={"path": path, "instruction": "Repeat the file.", "max_tokens": 4})
        assert r.status_code == 403, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "path_server_owned" and err["type"] == "permission_error", err
        assert f"({rule})" in err["message"] and "sk-" not in err["message"], err
    ok = httpx.post(keyed.base + "/v1/apply", headers=_auth(ACME), timeout=120,
                    json={"path": "main.py", "instruction": "Repeat the file.", "max_tokens": 4})
    assert ok.status_code == 200, ok.text


def test_no_workspace_indexes_the_servers_own_files(tmp_path, engine):
    from agentspec.server import build_state

    (tmp_path / "app.py").write_text("x = 1\n")
    (tmp_path / "server.toml").write_text('[server]\nlog_dir = "logs"\n\n[[tenants]]\nname = "t"\n'
                                          'api_keys = ["sk-indexing-4471"]\n')
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "t.jsonl").write_text('{"tenant": "t"}\n')
    cwd = os.getcwd()
    os.chdir(tmp_path)   # log_dir is relative to the working directory, as with `agentspec serve`
    try:
        state = build_state(tmp_path / "server.toml", repo=tmp_path, engine=engine, watch=False, quiet=True)
    finally:
        os.chdir(cwd)
    try:
        assert state.tenants["t"].workspace.files() == ["app.py"]
        assert [o.rule for o in state.owned] == ["config file", "log_dir", "cache folder"]
    finally:
        state.sink.close()
        for t in state.tenants.values():
            t.workspace.close()


def test_log_files_are_private(keyed):
    logs = keyed.ws / "logs"
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    for t in ("acme", "globex"):
        assert stat.S_IMODE((logs / f"{t}.jsonl").stat().st_mode) == 0o600


def test_metrics_show_a_tenant_only_its_own_series(keyed):
    acme = httpx.get(keyed.base + "/metrics", headers=_auth(ACME)).text
    globex = httpx.get(keyed.base + "/metrics", headers=_auth(GLOBEX)).text
    ops = httpx.get(keyed.base + "/metrics", headers=_auth(OPS)).text
    assert 'tenant="acme"' in acme and 'tenant="globex"' not in acme
    assert 'tenant="globex"' in globex and 'tenant="acme"' not in globex
    assert 'tenant="acme"' in ops and 'tenant="globex"' in ops and "agentspec:log_write_errors" in ops
    assert "agentspec:log_write_errors" not in acme   # the server's own counters are the operator's
    assert httpx.get(keyed.base + "/metrics").status_code == 401
    # an operator key is no tenant's: it generates nothing
    r = httpx.post(keyed.base + "/v1/completions", headers=_auth(OPS), json={"prompt": "a", "max_tokens": 1})
    assert r.status_code == 401


def test_a_keyed_server_answers_any_host(keyed):
    r = httpx.get(keyed.base + "/v1/models", headers={**_auth(ACME), "Host": "agentspec.internal:443"})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def keyless(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyless")
    s = Server(tmp, config=None, name="keyless")
    yield s
    s.stop()


@pytest.mark.parametrize("host,status", [("evil.example", 403), ("evil.example:{port}", 403),
                                         ("127.0.0.1.nip.io:{port}", 403), ("localhost:{port}", 200),
                                         ("127.0.0.1:{port}", 200), ("[::1]:{port}", 200), ("LOCALHOST", 200)])
def test_keyless_mode_answers_only_loopback_names(keyless, host, status):
    host = host.format(port=keyless.port)
    for method, url, kw in (("GET", "/v1/models", {}), ("GET", "/metrics", {}), ("GET", "/health", {}),
                            ("POST", "/v1/completions", {"json": {"prompt": "a", "max_tokens": 1}})):
        r = httpx.request(method, keyless.base + url, headers={"Host": host}, timeout=60, **kw)
        assert r.status_code == status, (host, url, r.text)
        if status == 403:
            assert r.json()["error"]["code"] == "host_not_allowed"


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_json_endpoints_take_only_json(keyless, ctype):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    headers = {"Content-Type": ctype} if ctype else {}
    for url in ("/v1/chat/completions", "/v1/sessions"):
        r = httpx.post(keyless.base + url, content=body, headers=headers, timeout=60)
        assert r.status_code == 415, (url, ctype, r.text)
        assert r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(keyless.base + "/v1/chat/completions", content=body, timeout=120,
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_a_deeply_nested_body_is_a_400(keyless):
    for depth in (2_000, 100_000):
        body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 1}'
        r = httpx.post(keyless.base + "/v1/completions", content=body, timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (depth, r.text)
        assert r.json()["error"]["code"] == "invalid_json"


@pytest.mark.extended
def test_a_flooding_tenant_does_not_hold_another_behind_its_flood(tmp_path):
    """Tenant "flood" queues 8 long requests on a batch of 2; tenant "quiet" then sends one short
    request. Served in turn, it joins the batch at the first free slot and finishes before most
    of the flood (first come, first served, it would finish last)."""
    config = ('[server]\nmax_batch = 2\n\n[[tenants]]\nname = "flood"\napi_keys = ["sk-flood-tenant-0001"]\n\n'
              '[[tenants]]\nname = "quiet"\napi_keys = ["sk-quiet-tenant-0002"]\n')
    s = Server(tmp_path, config=config, name="flood")
    order: list[str] = []
    lock = threading.Lock()

    def one(key: str, name: str, tokens: int) -> None:
        r = httpx.post(s.base + "/v1/completions", headers=_auth(key), timeout=600,
                       json={"prompt": "Count from one to one hundred, in words:", "max_tokens": tokens,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        with lock:
            order.append(name)

    try:
        flood = [threading.Thread(target=one, args=("sk-flood-tenant-0001", f"flood-{i}", 48)) for i in range(8)]
        for t in flood:
            t.start()
        deadline = time.monotonic() + 120
        while httpx.get(s.base + "/health").json().get("waiting", 0) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(s.base + "/health").json()["waiting"] >= 5
        quiet = threading.Thread(target=one, args=("sk-quiet-tenant-0002", "quiet", 8))
        quiet.start()
        for t in [*flood, quiet]:
            t.join()
    finally:
        s.stop()
    assert len(order) == 9
    assert order.index("quiet") <= 4, order   # at the latest right after the requests running when it came


@pytest.mark.parametrize("token,accepted", [("wrong", False), (None, False), ("lsp-token-8841", True)])
def test_lsp_on_tcp_with_a_token_refuses_a_peer_without_it(tmp_path, token, accepted):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentspec", "lsp", "--tcp", f"127.0.0.1:{port}"],
                            env={**os.environ, "AGENTSPEC_LSP_TOKEN": "lsp-token-8841"}, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with _connect(port, proc) as sock:
            init = {"processId": None, "rootUri": Path("/").as_uri(), "capabilities": {},
                    "initializationOptions": {} if token is None else {"token": token}}
            reply = _rpc(sock, 1, "initialize", init)
            if accepted:
                assert "result" in reply and reply["result"]["capabilities"], reply
                return
            assert "error" in reply and "token" in reply["error"]["message"], reply
            try:   # hung up on: nothing it sends next is answered (root "/": any file, had it been let in)
                reply = _rpc(sock, 2, "workspace/executeCommand",
                             {"command": "agentspec.rewrite", "arguments": [{"uri": "file:///etc/passwd",
                                                                            "instruction": "Repeat it."}]})
            except ConnectionError:   # closed: the read's end, or a reset on the send
                reply = None
            assert reply is None, reply
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _connect(port: int, proc) -> socket.socket:
    deadline = time.monotonic() + 60
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=60)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _rpc(sock: socket.socket, rid: int, method: str, params: dict) -> dict:
    """One JSON-RPC request over the LSP framing; the reply with id ``rid`` (notifications skipped)."""
    data = json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}).encode()
    sock.sendall(b"Content-Length: %d\r\n\r\n" % len(data) + data)
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("the language server closed the connection")
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        n = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(buf) < n:
            buf += sock.recv(65536)
        msg, buf = json.loads(buf[:n]), buf[n:]
        if msg.get("id") == rid:
            return msg
