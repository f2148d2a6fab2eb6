"""The APIs coding agents speak, through the vendors' own SDKs against a real server on loopback:
OpenAI Chat Completions with tools and structured output, Anthropic Messages, OpenAI Responses.

The model is a small random-weight Qwen2.5 checkpoint that transformers writes with Qwen2.5-Coder's
own chat template and tool-call tokens (``helpers.families``: no download). Its free text is noise,
so every call here is forced (``tool_choice`` required or named) and its arguments held to a schema
with a single answer: the grammar makes the call well formed in the family's own format, and the
test checks every wire shape around it. Speculation is on by default; each shape is compared with
``speculation: false`` (plain decoding) token for token.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from helpers.families import write_family
from helpers.serve import Server

KEY = "sk-agents-test-key"
WRITE_SCHEMA = {"type": "object", "properties": {"path": {"type": "string", "enum": ["hello.py"]},
                                                 "mode": {"type": "string", "enum": ["create", "overwrite"]}},
                "required": ["path", "mode"], "additionalProperties": False}
READ_SCHEMA = {"type": "object", "properties": {"path": {"type": "string", "enum": ["README.md"]}},
               "required": ["path"], "additionalProperties": False}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "Write", "description": "Write a file",
                                                  "parameters": WRITE_SCHEMA}},
                {"type": "function", "function": {"name": "Read", "description": "Read a file",
                                                  "parameters": READ_SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "Write", "description": "Write a file", "input_schema": WRITE_SCHEMA},
                   {"name": "Read", "description": "Read a file", "input_schema": READ_SCHEMA}]
RESPONSES_TOOLS = [{"type": "function", "name": "Write", "description": "Write a file", "parameters": WRITE_SCHEMA},
                   {"type": "function", "name": "Read", "description": "Read a file", "parameters": READ_SCHEMA}]
ASK = [{"role": "user", "content": "Create hello.py that prints hello."}]
CONTEXT = 12288


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    model = write_family(root / "qwen-tools", "qwen2-tools", dim=64, layers=2, heads=2, kv_heads=1, hidden=128)
    config = f"""
[[tenants]]
name = "agent"
api_keys = ["{KEY}"]
"""
    # agent CLIs' prompts run past the default 8192 tokens: the window the model allows, asked for
    srv = Server(root, config=config, args=["--model", str(model), "--max-context", str(CONTEXT)])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    # Anthropic's SDK sends the key as x-api-key and its version header; base URL without /v1
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)


def _stream_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or ():
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert slot["id"] is None, "a call's id comes once, with its name"
                slot["id"], slot["name"] = tc.id, tc.function.name
            slot["arguments"] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    return calls, finish, content


# ---- OpenAI Chat Completions ------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Write"}}])
def test_chat_tool_call_forced(oai, choice):
    r = oai.chat.completions.create(model="qwen", messages=ASK, tools=OPENAI_TOOLS, tool_choice=choice,
                                    max_tokens=80, temperature=0, parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    (call,) = ch.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WRITE_SCHEMA if call.function.name == "Write" else READ_SCHEMA)
    if isinstance(choice, dict):
        assert call.function.name == "Write"
    assert r.model != "qwen"   # any name is served by the one model, and the response says which

    plain = oai.chat.completions.create(model="qwen", messages=ASK, tools=OPENAI_TOOLS, tool_choice=choice,
                                        max_tokens=80, temperature=0, parallel_tool_calls=False,
                                        extra_body={"speculation": False})
    (pcall,) = plain.choices[0].message.tool_calls
    assert (pcall.function.name, pcall.function.arguments) == (call.function.name, call.function.arguments)
    assert plain.usage.completion_tokens == r.usage.completion_tokens

    stream = oai.chat.completions.create(model="qwen", messages=ASK, tools=OPENAI_TOOLS, tool_choice=choice,
                                         max_tokens=80, temperature=0, parallel_tool_calls=False, stream=True,
                                         stream_options={"include_usage": True})
    calls, finish, content = _stream_calls(stream)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_chat_tool_result_answered_and_rendered_as_the_model_wrote_it(oai, server):
    first = oai.chat.completions.create(model="qwen", messages=ASK, tools=OPENAI_TOOLS,
                                        tool_choice={"type": "function", "function": {"name": "Write"}},
                                        max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None,
                      "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "wrote hello.py (1 line)"}]
    r = oai.chat.completions.create(model="qwen", messages=history, tools=OPENAI_TOOLS, tool_choice="required",
                                    max_tokens=80, temperature=0, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    # the history's prompt is the first prompt, the call exactly as generated, the result: the
    # call's tokens re-rendered are what the model produced (the prefix cache hits the whole turn)
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_chat_response_format_json_schema(oai):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    kw = dict(model="qwen", messages=[{"role": "user", "content": "Is 7 prime? Answer in JSON."}], max_tokens=60,
              temperature=0, response_format={"type": "json_schema",
                                              "json_schema": {"name": "verdict", "schema": schema, "strict": True}})
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    plain = oai.chat.completions.create(**kw, extra_body={"speculation": False})
    assert plain.choices[0].message.content == r.choices[0].message.content
    obj = oai.chat.completions.create(model="qwen", messages=ASK, max_tokens=40, temperature=0,
                                      response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    assert text.startswith("{") and (obj.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))


def test_chat_tool_errors_name_the_field(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="qwen", messages=ASK, tools=OPENAI_TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "Delete"}})
    assert e.value.body["param"] == "tool_choice" and "Delete" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="qwen", messages=ASK, tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    bad_args = ASK + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                            "function": {"name": "Write", "arguments": "{not json"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="qwen", messages=bad_args, tools=OPENAI_TOOLS)
    assert e.value.body["param"] == "messages[1].tool_calls[0].arguments"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="qwen", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                   "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}})
    assert e.value.body["param"] == "response_format", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="qwen", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert e.value.body["code"] == "unsupported_content"


def test_chat_max_tokens_past_the_context_is_clamped(oai):
    r = oai.chat.completions.create(model="qwen", messages=ASK, tools=OPENAI_TOOLS, tool_choice="required",
                                    max_tokens=32000, temperature=0, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"


# ---- Anthropic Messages -----------------------------------------------------------------------

def test_messages_tool_use(claude):
    kw = dict(model="claude-haiku-4-5", max_tokens=80, system="You are a coding agent.", messages=ASK,
              tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "Write"},
              extra_body={"temperature": 0})   # (today's Messages API has no temperature: the default samples)
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use" and m.role == "assistant" and m.id.startswith("msg_")
    (block,) = [b for b in m.content if b.type == "tool_use"]
    assert block.name == "Write" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, WRITE_SCHEMA)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0 and m.usage.output_tokens > 0

    with claude.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    (sblock,) = [b for b in final.content if b.type == "tool_use"]
    assert (sblock.name, sblock.input) == (block.name, block.input) and final.stop_reason == "tool_use"

    # the result goes back as a tool_result block in a user turn, with text beside it
    follow = claude.messages.create(**{**kw, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                                       "messages": ASK + [
                                           {"role": "assistant", "content": m.content},
                                           {"role": "user", "content": [
                                               {"type": "tool_result", "tool_use_id": block.id,
                                                "content": [{"type": "text", "text": "done"}], "is_error": False},
                                               {"type": "text", "text": "Now read the README.",
                                                "cache_control": {"type": "ephemeral"}}]}]})
    assert follow.stop_reason == "tool_use"
    # the same history again: its prompt is served from the prefix cache
    again = claude.messages.create(**{**kw, "messages": ASK, "tool_choice": {"type": "tool", "name": "Write"}})
    assert again.usage.cache_read_input_tokens > 0


def test_messages_count_tokens_stop_reasons_and_errors(claude, server):
    n = claude.messages.count_tokens(model="any", messages=ASK, tools=ANTHROPIC_TOOLS)
    assert n.input_tokens > 50   # the tools' system prompt is rendered
    m = claude.messages.create(model="any", max_tokens=3, messages=ASK, extra_body={"temperature": 0})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="any", max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
            model="any", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    # no [DONE] on this wire: named events only
    with httpx.stream("POST", server.base + "/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                      json={"model": "x", "max_tokens": 4, "stream": True, "messages": ASK}) as r:
        body = r.read().decode()
    assert body.startswith("event: message_start\n") and "[DONE]" not in body and "event: ping" in body


# ---- OpenAI Responses ---------------------------------------------------------------------------

def test_responses_function_call(oai):
    kw = dict(model="gpt-5-codex", input="Create hello.py.", instructions="You are a coding agent.",
              tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "Write"}, max_output_tokens=80,
              temperature=0, store=False, parallel_tool_calls=False)
    r = oai.responses.create(**kw)
    assert r.status == "completed", r
    (item,) = [o for o in r.output if o.type == "function_call"]
    assert item.name == "Write" and item.call_id.startswith("call_") and item.id.startswith("fc_")
    jsonschema.validate(json.loads(item.arguments), WRITE_SCHEMA)

    events = list(oai.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.function_call_arguments.delta" in kinds and "response.output_item.done" in kinds
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(d.name, d.arguments) for d in done] == [(item.name, item.arguments)]

    # the call and its output go back as items
    follow = oai.responses.create(**{**kw, "tool_choice": "required", "input": [
        {"role": "user", "content": "Create hello.py."},
        {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments},
        {"type": "function_call_output", "call_id": item.call_id, "output": "ok"}]})
    assert any(o.type == "function_call" for o in follow.output)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="x", input="hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="x", input="hi", tools=[{"type": "custom", "name": "apply_patch"}])
    assert "custom" in e.value.body["message"]


# ---- what real agent CLIs send by default ------------------------------------------------------

def test_max_context_flag_and_context_errors_name_each_wires_field(oai, claude, server):
    """``--max-context`` widens the window past the default 8192 (Codex's prompt is ~9k tokens, Claude
    Code's ~12k); a prompt past it is refused naming the field that holds it on each wire."""
    assert httpx.get(server.base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()[
        "data"][0]["max_model_len"] == CONTEXT
    r = oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "hello " * 9000}], max_tokens=1)
    assert r.usage.prompt_tokens > 8192
    long = "hello " * (CONTEXT + 100)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="x", input=long, max_output_tokens=1)
    assert (e.value.body["param"], e.value.body["code"]) == ("input", "context_length_exceeded")
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="x", max_tokens=1, messages=[{"role": "user", "content": long}])
    assert "context window" in e.value.body["error"]["message"]


def test_messages_as_claude_code_sends_them(claude):
    """Claude Code's defaults: a system turn after the user's (its environment), ``context_management``
    clearing thinking (a no-op: earlier thinking is dropped anyway), ``thinking`` adaptive with
    ``display``, ``output_config.effort``, a ``defer_loading`` tool (not in the model's context)."""
    kw = dict(model="claude-sonnet-4-5", max_tokens=80, system=[{"type": "text", "text": "You are a coding agent."}],
              messages=ASK + [{"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /tmp",
                                                               "cache_control": {"type": "ephemeral"}}]}],
              tools=ANTHROPIC_TOOLS + [{"name": "Placeholder", "description": "deferred", "defer_loading": True,
                                        "input_schema": {"type": "object"}}],
              tool_choice={"type": "any", "disable_parallel_tool_use": True},
              extra_body={"temperature": 0, "context_management": {
                  "edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                  "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"}})
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    (block,) = [b for b in m.content if b.type == "tool_use"]
    assert block.name in ("Write", "Read")   # never the deferred tool: it is not offered
    # the system turn is rendered (more tokens than without it); the deferred tool is not
    without = claude.messages.count_tokens(model="x", messages=ASK, system=kw["system"], tools=ANTHROPIC_TOOLS)
    n = claude.messages.count_tokens(model="x", messages=kw["messages"], system=kw["system"], tools=kw["tools"])
    assert n.input_tokens > without.input_tokens
    assert claude.messages.count_tokens(model="x", messages=ASK, system=kw["system"],
                                        tools=kw["tools"]).input_tokens == without.input_tokens
    # an edit that would change the prompt is refused by name
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(**{**kw, "extra_body": {"context_management": {
            "edits": [{"type": "clear_tool_uses_20250919"}]}}})
    assert "clear_tool_uses_20250919" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:   # a system turn holds text only
        claude.messages.create(**{**kw, "messages": ASK + [{"role": "system", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]})
    assert "system turn" in e.value.body["error"]["message"]


def test_responses_as_codex_sends_them(oai):
    """Codex's defaults: a ``namespace`` tool (its sub-agent tools), the hosted ``web_search`` (accepted,
    not offered), ``client_metadata``, ``include`` and ``reasoning`` hints. A namespace's tool is
    offered as ``namespace.name`` and its call comes back with ``namespace`` and the bare name."""
    tools = [{"type": "namespace", "name": "files", "description": "File tools.",
              "tools": [{**t, "strict": False} for t in RESPONSES_TOOLS]},
             {"type": "web_search", "external_web_access": False}]
    kw = dict(model="gpt-5-codex", input=[{"type": "message", "role": "developer",
                                           "content": [{"type": "input_text", "text": "You are a coding agent."}]},
                                          {"type": "message", "role": "user",
                                           "content": [{"type": "input_text", "text": "Create hello.py."}]}],
              tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=80, temperature=0,
              store=False, include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
              extra_body={"client_metadata": {"x-codex-turn-metadata": "{}"}})
    r = oai.responses.create(**kw)
    (item,) = [o for o in r.output if o.type == "function_call"]
    assert item.name in ("Write", "Read") and item.namespace == "files"
    assert [t["name"] for t in r.model_dump()["tools"]] == ["files.Write", "files.Read"]
    events = list(oai.responses.create(**kw, stream=True))
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert (done.name, done.namespace, done.arguments) == (item.name, "files", item.arguments)
    # the call goes back with its namespace: rendered as the call the model made
    follow = oai.responses.create(**{**kw, "input": kw["input"] + [
        {"type": "function_call", "call_id": item.call_id, "namespace": "files", "name": item.name,
         "arguments": item.arguments},
        {"type": "function_call_output", "call_id": item.call_id, "output": "ok"}]})
    assert follow.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as e:   # other hosted tools are still refused by name
        oai.responses.create(model="x", input="hi", tools=[{"type": "image_generation"}])
    assert e.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="x", input="hi", tools=[{"type": "function", "name": "f", "tools": []}])
    assert e.value.body["param"] == "tools[0].tools"
