"""The SDK's HTTP side without a server: error envelopes -> exceptions, retries with backoff on
429 / 503 / connection errors, server-sent events, sessions, rewrite's atomic write and the
mini-swe-agent adapter's protocol, over ``httpx.MockTransport``. The real server and the
in-process engine are tested in tests/integration/test_sdk.py."""

from __future__ import annotations

import json
import os
import stat

import httpx
import pytest

import agentspec
from agentspec.sdk import (
    APIConnectionError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ChatResult,
    Client,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    ServiceUnavailableError,
)
from agentspec.sdk import _http
from agentspec.sdk.errors import AgentSpecAPIError, FileChangedError, InternalServerError, error_for_status

CHAT = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                  "prompt_tokens_details": {"cached_tokens": 3}},
        "spec": {"enabled": True, "reason": "", "route": "default", "steps": 1, "draft_tokens": 4,
                 "accepted_tokens": 2, "mean_acceptance_length": 3.0, "acceptance_rate": 0.5,
                 "draft_sources": {"suffix": 1}, "prefill_ms": 1.0, "decode_ms": 2.0, "tokens_per_second": 9.0,
                 "a_field_added_later": 1}}


def envelope(message, type="invalid_request_error", param=None, code=None):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    slept = []
    monkeypatch.setattr(_http.time, "sleep", slept.append)
    return slept


def client_for(handler, **kw) -> Client:
    return Client("http://agentspec.test/v1", api_key="sk-1", http_client=httpx.Client(
        transport=httpx.MockTransport(handler)), **kw)


def test_chat_sends_the_protocol_body_and_parses_a_typed_result():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["url"] = str(request.url)
        seen["auth"] = request.headers["authorization"]
        seen["body"] = json.loads(request.content)
        return httpx.Response(200, json=CHAT)

    with client_for(handler) as c:
        r = c.chat("hi", temperature=0, max_tokens=8, prediction="old", session_id="s1", speculation=False)
    assert seen["url"] == "http://agentspec.test/v1/chat/completions" and seen["auth"] == "Bearer sk-1"
    assert seen["body"] == {"messages": [{"role": "user", "content": "hi"}], "spec_stats": True, "temperature": 0,
                            "max_tokens": 8, "prompt_cache_key": "s1", "speculation": False,
                            "prediction": {"type": "content", "content": "old"}}
    assert isinstance(r, ChatResult) and r.text == "hello" and r.finish_reason == "stop" and r.session_id == "s1"
    assert r.usage.cached_tokens == 3 and r.usage.total_tokens == 6
    assert r.spec.mean_acceptance_length == 3.0 and r.spec.draft_sources == {"suffix": 1}
    assert r.ttft_ms is None and r.latency_ms >= 0 and r.message == {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize("status,cls", [(400, BadRequestError), (401, AuthenticationError),
                                        (403, PermissionDeniedError), (404, NotFoundError),
                                        (413, RequestTooLargeError), (500, InternalServerError),
                                        (504, InternalServerError), (418, AgentSpecAPIError)])
def test_error_envelopes_map_to_the_openai_named_classes(status, cls):
    body = envelope("prompt of 9 tokens does not fit the context window of 8 tokens", param="messages",
                    code="context_length_exceeded")
    with client_for(lambda r: httpx.Response(status, json=body), max_retries=0) as c:
        with pytest.raises(cls) as e:
            c.chat("hi")
    err = e.value
    assert type(err) is cls and isinstance(err, agentspec.AgentSpecError)
    assert err.status == status and err.param == "messages" and err.code == "context_length_exceeded"
    assert "context window of 8 tokens" in str(err) and err.type == "invalid_request_error"


def test_a_non_json_error_body_still_raises_by_status():
    with client_for(lambda r: httpx.Response(502, text="<html>bad gateway</html>"), max_retries=0) as c:
        with pytest.raises(InternalServerError, match="bad gateway") as e:
            c.chat("hi")
    assert e.value.status == 502 and e.value.code is None


@pytest.mark.parametrize("status,cls", [(429, RateLimitError), (503, ServiceUnavailableError)])
def test_429_and_503_are_retried_with_backoff_then_raised(status, cls, no_sleep):
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(status, json=envelope("busy", type="server_error", code="overloaded"))

    with client_for(handler, max_retries=3) as c:
        with pytest.raises(cls):
            c.chat("hi")
    assert len(calls) == 4 and len(no_sleep) == 3
    assert no_sleep == sorted(no_sleep) and all(0 < s <= _http.MAX_BACKOFF_S for s in no_sleep)


def test_retry_after_is_honoured_and_a_retry_can_succeed(no_sleep):
    responses = [httpx.Response(429, headers={"Retry-After": "2"}, json=envelope("slow down")),
                 httpx.Response(200, json=CHAT)]
    with client_for(lambda r: responses.pop(0)) as c:
        assert c.chat("hi").text == "hello"
    assert no_sleep == [2.0]


def test_other_4xx_are_not_retried():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(400, json=envelope("bad"))

    with client_for(handler, max_retries=5) as c, pytest.raises(BadRequestError):
        c.chat("hi")
    assert len(calls) == 1


def test_connection_errors_are_retried_read_timeouts_are_not(no_sleep):
    calls = []

    def refuse(request):
        calls.append(1)
        raise httpx.ConnectError("connection refused", request=request)

    with client_for(refuse, max_retries=2) as c, pytest.raises(APIConnectionError, match="refused"):
        c.chat("hi")
    assert len(calls) == 3

    calls.clear()

    def slow(request):
        calls.append(1)
        raise httpx.ReadTimeout("timed out", request=request)

    with client_for(slow, max_retries=2) as c, pytest.raises(APITimeoutError):
        c.chat("hi", timeout=0.5)
    assert len(calls) == 1


def sse(*events) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def chunk(content=None, finish=None, **extra):
    delta = {} if content is None else {"content": content}
    return {"id": "chatcmpl-2", "model": "m", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def test_a_stream_yields_text_and_assembles_the_result():
    body = sse(chunk(""), chunk("hel"), chunk("lo"), chunk(None, "length", spec=CHAT["spec"]),
               {"id": "chatcmpl-2", "model": "m", "choices": [], "usage": CHAT["usage"]})
    seen = {}

    def handler(request):
        seen["body"] = json.loads(request.content)
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    with client_for(handler) as c:
        with c.chat("hi", stream=True) as s:
            parts = list(s)
        r = s.result
    assert seen["body"]["stream"] is True and seen["body"]["stream_options"] == {"include_usage": True}
    assert parts == ["hel", "lo"] and r.text == "hello" and r.finish_reason == "length"
    assert r.id == "chatcmpl-2" and r.usage.prompt_tokens == 5 and r.spec.steps == 1
    assert r.ttft_ms is not None and r.ttft_ms <= r.latency_ms


def test_an_error_event_inside_a_stream_raises():
    body = sse(chunk("a"), envelope("request timed out", type="server_error", code="timeout"))
    with client_for(lambda r: httpx.Response(200, content=body)) as c:
        s = c.chat("hi", stream=True)
        with pytest.raises(InternalServerError, match="timed out") as e:
            s.final()
    assert e.value.status == 504 and e.value.code == "timeout"


def test_base_url_with_or_without_v1_and_from_the_environment(monkeypatch):
    assert _http.api_root("http://h:1/v1/") == "http://h:1" == _http.api_root("http://h:1")
    monkeypatch.setenv("AGENTSPEC_BASE_URL", "http://h:2")
    monkeypatch.setenv("AGENTSPEC_API_KEY", "sk-env")
    with Client() as c:
        assert not c.in_process and c._transport.root == "http://h:2"
        assert c._transport.headers["Authorization"] == "Bearer sk-env"


def test_error_for_status_without_a_status_uses_the_code():
    assert error_for_status(None, envelope("x", code="overloaded")).status == 503
    assert isinstance(error_for_status(None, envelope("x", code="overloaded")), ServiceUnavailableError)
    assert error_for_status(None, envelope("x")).status == 500


def test_session_keeps_history_and_id_and_rolls_back_a_failed_turn():
    bodies = []
    fail = []

    def handler(request):
        bodies.append(json.loads(request.content))
        if fail:
            return httpx.Response(400, json=envelope("prompt of 9000 tokens does not fit the context window of "
                                                     "8192 tokens", code="context_length_exceeded"))
        return httpx.Response(200, json=CHAT)

    with client_for(handler) as c, c.session(system="be terse", temperature=0) as s:
        s.chat("one")
        s.add("user", "observation: ok")
        s.chat("two")
        assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "user", "user", "assistant"]
        assert all(b["prompt_cache_key"] == s.id and b["temperature"] == 0 for b in bodies)
        assert bodies[1]["messages"][:3] == s.messages[:3]
        before = list(s.messages)
        fail.append(1)
        with pytest.raises(BadRequestError, match="8192"):
            s.chat("three")
        assert s.messages == before and len(s.results) == 2
        with pytest.raises(TypeError, match="max_token"):
            s.chat("x", max_token=3)
    with client_for(handler) as c, pytest.raises(TypeError, match="tempreature"):
        c.session(tempreature=0)


def apply_handler(merged, finish="stop"):
    def handler(request):
        body = json.loads(request.content)
        assert set(body) >= {"code", "instruction"}
        return httpx.Response(200, json={"id": "apply-1", "object": "apply", "model": "m", "merged_code": merged,
                                         "finish_reason": finish, "usage": CHAT["usage"], "spec": CHAT["spec"]})
    return handler


def test_rewrite_returns_a_diff_and_writes_only_when_asked(tmp_path):
    f = tmp_path / "a.py"
    f.write_text("x = 1\n")
    f.chmod(0o640)
    with client_for(apply_handler("x = 2\n")) as c:
        r = c.rewrite(f, "set x to 2")
        assert not r.written and f.read_text() == "x = 1\n" and r.changed
        assert "-x = 1\n+x = 2\n" in r.diff and r.diff.startswith("--- a/a.py\n+++ b/a.py\n")
        r = c.rewrite(f, "set x to 2", write=True)
    assert r.written and f.read_text() == "x = 2\n" and stat.S_IMODE(os.stat(f).st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.py"]   # no temporary file left
    with client_for(apply_handler("x = 3\n", finish="length")) as c:
        r = c.rewrite(f, "cut off", write=True)
    assert not r.written and f.read_text() == "x = 2\n"    # a merge cut off at max_tokens is not written


def test_rewrite_refuses_to_overwrite_a_file_changed_meanwhile(tmp_path):
    f = tmp_path / "a.py"
    f.write_text("x = 1\n")
    inner = apply_handler("x = 2\n")

    def handler(request):
        f.write_text("x = 9\n")   # someone edits the file while the model works
        return inner(request)

    with client_for(handler) as c, pytest.raises(FileChangedError):
        c.rewrite(f, "set x to 2", write=True)
    assert f.read_text() == "x = 9\n"


def test_minisweagent_model_protocol():
    from agentspec.sdk.minisweagent import AgentSpecModel

    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=CHAT)

    with client_for(handler) as c:
        m = AgentSpecModel(c, model_kwargs={"temperature": 0}, cost_per_token=0.5)
        out = m.query([{"role": "system", "content": "s", "extra": {"x": 1}}, {"role": "user", "content": "u"}])
        m.query([{"role": "user", "content": "again"}], max_tokens=4)
    assert out["content"] == "hello" and out["extra"]["cost"] == 3.0
    assert out["extra"]["response"]["spec"]["mean_acceptance_length"] == 3.0
    assert m.n_calls == 2 and m.cost == 6.0
    assert bodies[0]["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert bodies[0]["temperature"] == 0 and bodies[1]["max_tokens"] == 4
    assert bodies[0]["prompt_cache_key"] == bodies[1]["prompt_cache_key"] == m.session_id
    assert m.get_template_vars()["n_model_calls"] == 2 and "model" in m.serialize()["info"]["config"]


def test_lazy_exports():
    assert agentspec.Client is Client and agentspec.AsyncClient.__module__ == "agentspec.sdk.client"


def test_async_client_retries_streams_and_maps_errors(monkeypatch):
    import asyncio

    from agentspec.sdk import AsyncClient

    async def no_sleep(s):
        slept.append(s)

    slept: list[float] = []
    monkeypatch.setattr(_http.asyncio, "sleep", no_sleep)
    responses = [httpx.Response(503, json=envelope("full", code="overloaded")), httpx.Response(200, json=CHAT),
                 httpx.Response(200, content=sse(chunk("hel"), chunk("lo", "stop"))),
                 httpx.Response(404, json=envelope("no such model", type="not_found_error", param="model"))]

    async def main():
        async with AsyncClient("http://agentspec.test", http_client=httpx.AsyncClient(
                transport=httpx.MockTransport(lambda r: responses.pop(0)))) as c:
            r = await c.chat("hi")
            s = await c.chat("hi", stream=True)
            parts = [d async for d in s]
            with pytest.raises(NotFoundError):
                await c.chat("hi", model="nope")
            return r, parts, s.result

    r, parts, final = asyncio.run(main())
    assert r.text == "hello" and len(slept) == 1
    assert parts == ["hel", "lo"] and final.text == "hello" and final.finish_reason == "stop"


class _Body(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body that records whether it was closed (sync or async)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.closed = False

    def __iter__(self):
        yield self.data

    async def __aiter__(self):
        yield self.data

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


def test_closing_a_stream_before_reading_it_closes_the_response():
    import asyncio

    from agentspec.sdk import AsyncClient

    bodies: list[_Body] = []

    def handler(request):
        bodies.append(_Body(sse(chunk("hel"), chunk("lo", "stop"))))
        return httpx.Response(200, stream=bodies[-1])

    with client_for(handler) as c:
        with c.chat("hi", stream=True):
            pass
        with pytest.raises(RuntimeError), c.chat("hi", stream=True):
            raise RuntimeError("the caller failed before reading")
        c.chat("hi", stream=True).close()
    assert [b.closed for b in bodies] == [True] * 3

    async def main():
        async with AsyncClient("http://agentspec.test", http_client=httpx.AsyncClient(
                transport=httpx.MockTransport(handler))) as c:
            async with await c.chat("hi", stream=True):
                pass

    bodies.clear()
    asyncio.run(main())
    assert [b.closed for b in bodies] == [True]


def test_a_stream_cut_off_before_done_raises_instead_of_finishing():
    """A stream whose lines end without ``data: [DONE]`` (a proxy cut it, the server died) is not
    a finished answer: ``APIConnectionError``, never a result with finish_reason "stop"."""
    import asyncio

    from agentspec.sdk import AsyncClient

    cut = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (chunk("pa"), chunk("r")))
    apply_cut = b"data: " + json.dumps({"id": "apply-1", "object": "apply.chunk", "model": "m", "delta": "def",
                                        "completion_tokens": 1, "steps": 1}).encode() + b"\n\n"
    with client_for(lambda r: httpx.Response(200, content=cut)) as c:
        s = c.chat("hi", stream=True)
        with pytest.raises(APIConnectionError, match=r"\[DONE\]"):
            s.final()
        assert s.result is None and s.text == "par"
    with client_for(lambda r: httpx.Response(200, content=apply_cut)) as c:
        with pytest.raises(APIConnectionError):
            c.apply(code="x = 1\n", instruction="x", stream=True).final()

    async def main():
        async with AsyncClient("http://agentspec.test", http_client=httpx.AsyncClient(
                transport=httpx.MockTransport(lambda r: httpx.Response(200, content=cut)))) as c:
            s = await c.chat("hi", stream=True)
            with pytest.raises(APIConnectionError):
                await s.final()
            return s

    assert asyncio.run(main()).result is None


def test_a_response_without_a_finish_reason_is_not_taken_for_stop():
    no_finish = {**CHAT, "choices": [{"index": 0, "message": {"role": "assistant", "content": "hel"}}]}
    with client_for(lambda r: httpx.Response(200, json=no_finish)) as c, \
            pytest.raises(AgentSpecAPIError, match="no finish_reason"):
        c.chat("hi")
    with client_for(lambda r: httpx.Response(200, content=sse(chunk("hel"), chunk("lo")))) as c, \
            pytest.raises(AgentSpecAPIError, match="no finish_reason"):
        c.chat("hi", stream=True).final()
    body = {"id": "apply-1", "object": "apply", "model": "m", "merged_code": "", "usage": CHAT["usage"]}
    with client_for(lambda r: httpx.Response(200, json=body)) as c, \
            pytest.raises(AgentSpecAPIError, match="no finish_reason"):
        c.apply(code="x = 1\n", instruction="x")


@pytest.mark.parametrize("code,cls", [("timeout", InternalServerError), ("overloaded", ServiceUnavailableError),
                                      ("internal_error", InternalServerError), (None, APIConnectionError)])
def test_a_streamed_session_turn_that_fails_midway_leaves_the_history(code, cls):
    """An error event after the stream started (504, 503, 500) or a cut-off stream: the turn's
    user message is taken out again, so the next turn does not send two user messages in a row."""
    bodies = []
    failing = sse(chunk("a"), envelope("it failed", type="server_error", code=code)) if code else \
        b"data: " + json.dumps(chunk("a")).encode() + b"\n\n"

    def handler(request):
        bodies.append(json.loads(request.content))
        if len(bodies) == 1:
            return httpx.Response(200, content=failing)
        return httpx.Response(200, json=CHAT)

    with client_for(handler) as c, c.session(system="be terse") as s:
        with pytest.raises(cls), s.chat("one", stream=True) as st:
            st.final()
        assert s.messages == [{"role": "system", "content": "be terse"}] and s.results == []
        s.chat("two")
    assert [m["role"] for m in bodies[1]["messages"]] == ["system", "user"]
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant"]


def test_a_streamed_session_turn_closed_before_its_end_leaves_the_history():
    import asyncio

    from agentspec.sdk import AsyncClient

    body = sse(chunk("hel"), chunk("lo", "stop"), {"id": "chatcmpl-2", "model": "m", "choices": [],
                                                    "usage": CHAT["usage"]})
    with client_for(lambda r: httpx.Response(200, content=body)) as c, c.session(system="be terse") as s:
        with s.chat("closed before reading", stream=True):
            pass
        assert s.messages == [{"role": "system", "content": "be terse"}]
        with s.chat("closed after one delta", stream=True) as st:
            assert next(iter(st)) == "hel"
            s.add("user", "an observation added while the stream was open")
        assert [m["content"] for m in s.messages] == ["be terse", "an observation added while the stream was open"]
        with s.chat("read to the end", stream=True) as st:
            for _ in st:
                break
            assert st.final().text == "hello"   # a loop left early is not a stream closed
        assert [m["role"] for m in s.messages] == ["system", "user", "user", "assistant"]

    async def main():
        async with AsyncClient("http://agentspec.test", http_client=httpx.AsyncClient(
                transport=httpx.MockTransport(lambda r: httpx.Response(200, content=body)))) as c:
            s = c.session(system="be terse")
            async with await s.chat("closed before reading", stream=True):
                pass
            before = list(s.messages)
            st = await s.chat("read", stream=True)
            await st.final()
            await st.aclose()   # after the end: the turn stays
            return before, s.messages

    before, after = asyncio.run(main())
    assert before == [{"role": "system", "content": "be terse"}]
    assert [m["role"] for m in after] == ["system", "user", "assistant"]
