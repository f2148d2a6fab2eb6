"""Request fields the server does not implement are refused by name (400, an OpenAI error body
naming ``param``), never accepted and ignored; what it does take still decodes."""

from __future__ import annotations

import json

import pytest

from agentspec.api.handling import _prediction_text
from agentspec.api.protocol import (
    GREEDY_BELOW,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
    sampling_temperature,
)

MSGS = [{"role": "user", "content": "a"}]


def _check(body: dict, type=ChatCompletionRequest):
    req = decode_body(json.dumps(body).encode(), type)
    req.check_unsupported()
    return req


def _refused(body: dict, type=ChatCompletionRequest) -> APIError:
    with pytest.raises(APIError) as info:
        _check(body, type)
    e = info.value
    assert e.status == 400 and set(e.body()["error"]) == {"message", "type", "param", "code"}
    return e


def _chat(**kw) -> dict:
    return {"messages": MSGS, **kw}


def _completion(**kw) -> dict:
    return {"prompt": "a", **kw}


@pytest.mark.parametrize("type,body", [(ChatCompletionRequest, _chat), (CompletionRequest, _completion)])
def test_continuous_usage_stats_is_refused_not_ignored(type, body):
    e = _refused(body(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}), type)
    assert (e.param, e.code) == ("stream_options.continuous_usage_stats", "unsupported_parameter")
    assert "include_usage" in e.message   # what to use instead
    req = _check(body(stream=True, stream_options={"continuous_usage_stats": False, "include_usage": True}), type)
    assert req.stream_options.include_usage


@pytest.mark.parametrize("type,body", [(ChatCompletionRequest, _chat), (CompletionRequest, _completion)])
@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_need_a_stream(type, body, stream):
    """As OpenAI: stream_options shape a stream; without one they would be dropped."""
    extra = {} if stream is None else {"stream": stream}
    e = _refused(body(stream_options={"include_usage": True}, **extra), type)
    assert (e.param, e.code) == ("stream_options", "invalid_value")
    assert "stream: true" in e.message
    _check(body(stream=True, stream_options={"include_usage": True}), type)
    _check(body(stream=False, stream_options=None), type)


@pytest.mark.parametrize("value", [1, 5, 20])
def test_chat_top_logprobs_is_refused(value):
    e = _refused(_chat(top_logprobs=value))
    assert (e.param, e.code) == ("top_logprobs", "unsupported_parameter")


@pytest.mark.parametrize("value", [None, 0])
def test_chat_top_logprobs_none_is_taken(value):
    assert _check(_chat(top_logprobs=value)).top_logprobs == value


@pytest.mark.parametrize("type,body,value", [
    (CompletionRequest, _completion, 0),   # completions: 0 still asks for the sampled token's logprob
    (CompletionRequest, _completion, 3),
    (CompletionRequest, _completion, True),
    (ChatCompletionRequest, _chat, True),
    (ChatCompletionRequest, _chat, 0),
])
def test_logprobs_are_refused(type, body, value):
    e = _refused(body(logprobs=value), type)
    assert (e.param, e.code) == ("logprobs", "unsupported_parameter")
    assert repr(value) in e.message


@pytest.mark.parametrize("type,body", [(ChatCompletionRequest, _chat), (CompletionRequest, _completion)])
@pytest.mark.parametrize("value", [None, False])
def test_logprobs_off_is_taken(type, body, value):
    assert _check(body(logprobs=value), type).logprobs is value


def test_a_message_name_is_taken():
    # given to the chat template (OpenAI clients such as AutoGen send one on every message)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a", "name": "alice"}]
    assert _check({"messages": msgs}).messages[1].name == "alice"
    _check({"messages": [{"role": "user", "content": "a", "name": None}]})


def test_a_temperature_near_zero_samples_as_greedy():
    """Logits / 1e-320 overflow to inf (NaN probabilities): below GREEDY_BELOW is greedy, 0."""
    assert GREEDY_BELOW == 1e-5
    for t in (5e-324, 1e-320, 1e-300, 9.99e-6):
        assert sampling_temperature(t) == 0.0
    for t in (0.0, 1e-5, 0.5, 2.0):
        assert sampling_temperature(t) == t


def test_a_prediction_past_the_context_is_refused_before_tokenizing():
    """A prediction longer than 32 characters per token of the window cannot fit it however it
    tokenizes: refused by its length, so no tokenizer, per-token check or diff runs on it."""
    ctx = 100
    ok = decode_body(json.dumps(_chat(prediction={"type": "content", "content": "x" * 32 * ctx})).encode(),
                     ChatCompletionRequest)
    assert _prediction_text(ok, ctx) == "x" * 32 * ctx
    for content in ("x" * (32 * ctx + 1), [{"type": "text", "text": "x" * 2000}, {"type": "text", "text": "y" * 1201}]):
        req = decode_body(json.dumps(_chat(prediction={"type": "content", "content": content})).encode(),
                          ChatCompletionRequest)
        with pytest.raises(APIError) as info:
            _prediction_text(req, ctx)
        e = info.value
        assert (e.status, e.param, e.code) == (400, "prediction", "context_length_exceeded")
        assert "3201 characters" in e.message and "100 tokens" in e.message
    assert _prediction_text(decode_body(json.dumps(_chat()).encode(), ChatCompletionRequest), ctx) is None


def test_the_engine_takes_a_temperature_near_zero_as_greedy():
    """``check_sampling``, which every engine request passes (the API, the SDK in process,
    ``Engine.generate``): a positive temperature under GREEDY_BELOW is 0, never a divisor that
    makes the logits infinite."""
    from agentspec.backends.protocol import GREEDY_BELOW, check_sampling

    assert check_sampling(max_tokens=1, temperature=1e-320).temperature == 0.0
    assert check_sampling(max_tokens=1, temperature=GREEDY_BELOW / 2).temperature == 0.0
    assert check_sampling(max_tokens=1, temperature=GREEDY_BELOW).temperature == GREEDY_BELOW
