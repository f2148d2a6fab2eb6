"""The SDK against a real `agentspec serve` process and in-process (the embedded engine in this
process): the same calls, the same result types and fields, the same exceptions. The real
bundled model; one server and one in-process engine for the module."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import msgspec
import pytest
from helpers.serve import Server

import agentspec
from agentspec.sdk import (
    APIConnectionError,
    ApplyResult,
    AsyncClient,
    BadRequestError,
    ChatResult,
    Client,
    CompletionResult,
    NotFoundError,
    PermissionDeniedError,
)
from agentspec.sdk.client import new_session_id

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CODE = '''def add(a, b):
    return a + b


def sub(a, b):
    return a - b
'''
PROMPT = "Name one prime number."


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdk_repo")
    (root / "calc.py").write_text(CODE)
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    (root / ".venv").mkdir()
    (root / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (root / ".gitignore").write_text(".env\n")
    (root / ".env").write_text("API_TOKEN=secret\n")
    return root


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("sdk_server"), config=None, repo=repo, name="sdk")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def clients(server, repo):
    remote = Client(server.base + "/v1", max_retries=0, timeout=120)
    local = Client(repo=repo)
    local.chat("hi", max_tokens=1, temperature=0)   # load the engine, start its scheduler thread (module-owned)
    yield {"server": remote, "inproc": local}
    remote.close()
    local.close()


@pytest.fixture(params=["server", "inproc"])
def client(request, clients) -> Client:
    return clients[request.param]


def fields(result) -> dict:
    """A result's fields and their types, values aside."""
    return {k: type(v).__name__ for k, v in msgspec.structs.asdict(result).items()
            if k not in ("usage", "spec")} | {"usage": sorted(msgspec.structs.asdict(result.usage)),
                                              "spec": sorted(msgspec.structs.asdict(result.spec))}


def test_both_modes_return_the_same_greedy_text_and_the_same_shape(clients):
    out = {mode: c.chat(PROMPT, max_tokens=12, temperature=0) for mode, c in clients.items()}
    a, b = out["server"], out["inproc"]
    assert isinstance(a, ChatResult) and isinstance(b, ChatResult)
    assert a.text == b.text and a.text and a.model == b.model == MODEL
    assert a.usage == b.usage and a.usage.completion_tokens == 12 and a.finish_reason == "length"
    assert fields(a) == fields(b)
    for r in (a, b):
        assert r.spec.enabled and r.spec.steps > 0 and r.spec.mean_acceptance_length >= 1.0
        assert r.spec.tokens_per_second > 0 and r.latency_ms > 0 and r.id.startswith("chatcmpl-")


def test_stream_matches_the_plain_call(client):
    plain = client.chat(PROMPT, max_tokens=12, temperature=0, speculation=False)
    with client.chat(PROMPT, max_tokens=12, temperature=0, stream=True) as s:
        parts = list(s)
    r = s.result
    assert "".join(parts) == r.text == plain.text and len(parts) > 1
    assert 0 < r.ttft_ms <= r.latency_ms and r.usage.completion_tokens == 12 and r.spec.steps > 0
    assert not plain.spec.enabled and "speculation = false" in plain.spec.reason


def test_complete_with_text_and_token_ids(client):
    r = client.complete("def fibonacci(n):", max_tokens=8, temperature=0)
    assert isinstance(r, CompletionResult) and r.usage.completion_tokens == 8 and r.text
    s = client.complete([1, 9690, 198], max_tokens=4, temperature=0, stream=True)
    assert s.final().usage.prompt_tokens == 3


def test_apply_code_and_workspace_path(client):
    r = client.apply(code=CODE, instruction="Rename sub to subtract.", temperature=0, max_tokens=48)
    assert isinstance(r, ApplyResult) and r.merged_code and r.spec.draft_tokens > 0
    assert r.usage.accepted_prediction_tokens is not None
    p = client.apply(path="calc.py", instruction="Rename sub to subtract.", max_tokens=48, stream=True).final()
    assert p.path == "calc.py" and p.merged_code and p.ttft_ms > 0 and p.usage.completion_tokens <= 48
    with pytest.raises(PermissionDeniedError) as e:
        client.apply(path="../outside.py", instruction="x")
    assert e.value.status == 403 and e.value.code == "path_outside_workspace"
    with pytest.raises(NotFoundError):
        client.apply(path="missing.py", instruction="x")
    for path in (".git/config", ".venv/pyvenv.cfg", ".env"):   # what the workspace ignores: refused too
        with pytest.raises(PermissionDeniedError) as e:
            client.apply(path=path, instruction="x")
        assert e.value.status == 403 and e.value.code == "path_ignored", path


def test_rewrite_writes_atomically_and_returns_a_diff(client, tmp_path):
    f = tmp_path / "calc.py"
    f.write_text(CODE)
    r = client.rewrite(f, "Rename sub to subtract.", write=True, max_tokens=64)
    assert r.written == (r.diff != "" and r.result.finish_reason == "stop")
    assert f.read_text() == (r.merged_code if r.written else CODE)
    if r.diff:
        assert r.diff.startswith("--- a/calc.py\n+++ b/calc.py\n")


def test_session_keeps_the_conversation_and_its_id(client):
    with client.session(system="You answer in one short sentence.", temperature=0, max_tokens=8) as s:
        a = s.chat("What is 2 + 2?")
        s.add("user", "Observation: the command printed 4.")
        b = s.chat("And 3 + 3?", stream=True).final()
    assert a.session_id == b.session_id == s.id
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "user", "user", "assistant"]
    assert s.messages[-1]["content"] == b.text and b.usage.prompt_tokens > a.usage.prompt_tokens


def test_bad_input_raises_the_same_exceptions(client):
    with pytest.raises(BadRequestError) as e:
        client.chat("hi " * 9000, max_tokens=4)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded" and "8192" in str(e.value)
    with client.session() as s:
        s.chat("hi", max_tokens=1, temperature=0)
        before = list(s.messages)
        with pytest.raises(BadRequestError, match="context window of 8192"):
            s.chat("hi " * 9000, max_tokens=4)
        assert s.messages == before
    with pytest.raises(BadRequestError) as e:
        client.chat("hi", max_tokens=0)
    assert e.value.param == "max_tokens"
    # any model name is served by the one model (agents name models the server does not have)
    assert client.chat("hi", model="gpt-4", max_tokens=1).model == MODEL
    with pytest.raises(BadRequestError, match="tool-call format"):   # the bundled model has none
        client.chat("hi", extra_body={"tools": [{"type": "function", "function": {"name": "f"}}]})
    assert client.models()[0]["id"] == MODEL and client.health()["status"] == "ok"


@pytest.mark.parametrize("mode", ["server", "inproc"])
def test_async_client(mode, server, clients):
    engine = clients["inproc"]._transport._state.backend.engine
    expected = clients["server"].chat(PROMPT, max_tokens=8, temperature=0).text

    async def main():
        kw = {"engine": engine} if mode == "inproc" else {}
        async with AsyncClient(server.base if mode == "server" else None, max_retries=0, **kw) as c:
            r = await c.chat(PROMPT, max_tokens=8, temperature=0)
            s = await c.chat(PROMPT, max_tokens=8, temperature=0, stream=True)
            parts = [d async for d in s]
            async with c.session(temperature=0, max_tokens=4) as sess:
                await sess.chat("Hi")
            with pytest.raises(BadRequestError):
                await c.chat("hi", max_tokens=0)
            return r, parts, s.result, sess

    r, parts, final, sess = asyncio.run(main())
    assert r.text == final.text == "".join(parts) == expected and final.ttft_ms > 0
    assert len(sess.messages) == 2


def test_minisweagent_adapter_real_call(server):
    from agentspec.sdk.minisweagent import AgentSpecModel

    m = AgentSpecModel(base_url=server.base, model_kwargs={"temperature": 0, "max_tokens": 8})
    try:
        out = m.query([{"role": "system", "content": "Reply with one bash command.", "extra": {}},
                       {"role": "user", "content": "List the files."}])
    finally:
        m.close()
    assert isinstance(out["content"], str) and out["content"]
    assert m.n_calls == 1 and m.cost == 0.0 and out["extra"]["response"]["usage"]["completion_tokens"] == 8


def test_top_level_names():
    assert agentspec.Client is Client and agentspec.AsyncClient is AsyncClient


@pytest.mark.extended
def test_inproc_agent_loop_writes_records_and_reuses_the_prefix_cache_as_served(clients, server, tmp_path):
    """In-process mode runs the server's request layer: one acceptance record per request in the
    tenant's log (sessions named in them), and a session's second turn takes the same prefix-cache
    hit as the same conversation through HTTP."""
    import json
    import secrets

    from agentspec.config import ServerConfig

    engine = clients["inproc"]._transport._state.backend.engine
    config = msgspec.convert({"server": {"log_dir": str(tmp_path / "logs")}}, ServerConfig)
    system = f"You answer briefly. Conversation {secrets.token_hex(4)}."   # no earlier prompt shares its prefix
    cached = {}
    with Client(engine=engine, config=config) as local:
        local.chat(PROMPT, max_tokens=4, temperature=0)
        for mode, c in (("inproc", local), ("server", clients["server"])):
            with c.session(system=system, temperature=0, max_tokens=8) as s:
                first = s.chat("What is 2 + 2? " * 40)
                second = s.chat("And 3 + 3?", stream=True).final()
            cached[mode] = (first.usage.cached_tokens, second.usage.cached_tokens, s.id)
        local.apply(code=CODE, update="def sub(a, b):\n    return b - a\n", max_tokens=16)
    assert cached["inproc"][:2] == cached["server"][:2]
    assert cached["inproc"][1] > 0, "the session's second turn reused nothing"
    records = [json.loads(line) for line in (tmp_path / "logs" / "default.jsonl").read_text().splitlines()]
    assert [r["endpoint"] for r in records] == ["chat.completions"] * 3 + ["apply"]
    assert [r["session"] for r in records[1:3]] == [cached["inproc"][2]] * 2
    assert all(r["tenant"] == "default" and r["finish_reason"] in ("stop", "length") for r in records)


# ---- streams that end early: closed by the caller, or cut off on the way ------------------------------------

LONG = "Count from 1 to 500, one number per line."
LONG_MAX = 400   # far more tokens than a cancelled request gets to make


def _logged_config(log_dir: Path):
    from agentspec.config import ServerConfig

    return msgspec.convert({"server": {"log_dir": str(log_dir)}}, ServerConfig)


@pytest.fixture(scope="module")
def logged(server, clients, tmp_path_factory):
    """Per mode: a client and the acceptance log its requests go to (the server's: ``logs/`` in
    its working folder; in process: a config's ``log_dir``)."""
    log_dir = tmp_path_factory.mktemp("sdk_inproc_logs")
    engine = clients["inproc"]._transport._state.backend.engine
    local = Client(engine=engine, config=_logged_config(log_dir))
    local.chat("hi", max_tokens=1, temperature=0)   # its state's threads start here (module-owned)
    yield {"server": (clients["server"], server.cwd / "logs" / "default.jsonl"),
           "inproc": (local, log_dir / "default.jsonl")}
    local.close()


def _record_of(log: Path, session: str, timeout: float = 60) -> dict:
    """The acceptance record of the (one) request of ``session``, once its job has ended."""
    deadline = time.monotonic() + timeout
    while True:
        for line in log.read_text().splitlines() if log.exists() else ():
            try:
                r = json.loads(line)
            except ValueError:   # a line being written
                continue
            if r.get("session") == session:
                return r
        assert time.monotonic() < deadline, f"no record of session {session} in {log}"
        time.sleep(0.05)


def _assert_cancelled(log: Path, sessions: list[str]) -> None:
    for sid in sessions:
        rec = _record_of(log, sid)
        assert rec["finish_reason"] == "cancelled" and rec["completion_tokens"] < LONG_MAX, rec


@pytest.mark.parametrize("mode", ["server", "inproc"])
def test_closing_a_stream_cancels_its_request_whether_or_not_it_was_read(mode, logged):
    c, log = logged[mode]
    sessions = [new_session_id() for _ in range(3)]
    kw = dict(max_tokens=LONG_MAX, temperature=0, stream=True)
    with c.chat(LONG, session_id=sessions[0], **kw):
        pass                                   # closed before the first read
    with pytest.raises(RuntimeError), c.chat(LONG, session_id=sessions[1], **kw):
        raise RuntimeError("the caller failed before reading")
    with c.chat(LONG, session_id=sessions[2], **kw) as s:
        assert next(iter(s))                   # closed after the first delta
    _assert_cancelled(log, sessions)


@pytest.mark.parametrize("mode", ["server", "inproc"])
def test_closing_an_async_stream_cancels_its_request_whether_or_not_it_was_read(mode, server, clients, tmp_path):
    engine = clients["inproc"]._transport._state.backend.engine
    sessions = [new_session_id() for _ in range(2)]
    kw = dict(max_tokens=LONG_MAX, temperature=0, stream=True)

    async def main():
        opts = {"engine": engine, "config": _logged_config(tmp_path)} if mode == "inproc" else {}
        async with AsyncClient(server.base if mode == "server" else None, max_retries=0, **opts) as c:
            async with await c.chat(LONG, session_id=sessions[0], **kw):
                pass
            s = await c.chat(LONG, session_id=sessions[1], **kw)
            await s.aclose()
            _assert_cancelled(tmp_path / "default.jsonl" if mode == "inproc" else
                              server.cwd / "logs" / "default.jsonl", sessions)

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["server", "inproc"])
def test_a_session_turn_streamed_and_closed_early_leaves_the_history(mode, logged):
    c, _ = logged[mode]
    with c.session(system="You answer in one short sentence.", temperature=0, max_tokens=8) as s:
        with s.chat("Closed before reading.", stream=True):
            pass
        with s.chat("Closed after one delta.", stream=True) as st:
            assert next(iter(st))
        assert s.messages == [{"role": "system", "content": "You answer in one short sentence."}]
        r = s.chat("What is 2 + 2?", stream=True).final()
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant"] and s.results == [r]
    assert s.messages[1]["content"] == "What is 2 + 2?"


class _CuttingProxy:
    """A proxy on loopback in front of the real server that relays a stream's first ``keep``
    data lines, then ends its response cleanly: no ``[DONE]``, as a proxy that cut it or a server
    that died would. Non-streamed responses are relayed whole."""

    def __init__(self, upstream: str, keep: int) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with httpx.Client(timeout=120) as http, http.stream(
                        "POST", upstream + self.path, content=body,
                        headers={"Content-Type": "application/json"}) as r:
                    self.send_response(r.status_code)
                    self.send_header("Content-Type", r.headers["content-type"])
                    self.end_headers()   # HTTP/1.0, no Content-Length: the body ends when the connection does
                    data = 0
                    for line in r.iter_lines():
                        data += line.startswith("data:")
                        if data > keep:
                            break
                        self.wfile.write(line.encode() + b"\n")

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="cutting-proxy", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture(scope="module")
def cut(server):
    proxy = _CuttingProxy(server.base, keep=4)
    yield proxy
    proxy.close()


def test_a_stream_cut_off_before_its_end_raises_not_finishes(cut):
    """A cut stream is not a finished answer: ``APIConnectionError``, no result, never a
    finish_reason "stop" for the text so far (chat and apply), and a session turn rolled back."""
    with Client(cut.base, max_retries=0, timeout=120) as c:
        s = c.chat(PROMPT, max_tokens=40, temperature=0, stream=True)
        with pytest.raises(APIConnectionError, match=r"\[DONE\]"):
            s.final()
        assert s.result is None
        with pytest.raises(APIConnectionError):
            c.apply(code=CODE, instruction="Rename sub to subtract.", max_tokens=48, stream=True).final()
        with c.session(system="You answer in one short sentence.", temperature=0, max_tokens=40) as sess:
            with pytest.raises(APIConnectionError):
                sess.chat("What is 2 + 2?", stream=True).final()
            assert [m["role"] for m in sess.messages] == ["system"]
            r = sess.chat("What is 2 + 2?", max_tokens=8)   # non-streamed: relayed whole
        assert [m["role"] for m in sess.messages] == ["system", "user", "assistant"] and r.text
