"""The agent APIs on the real coder model (``make test-models``; ``AGENTSPEC_TEST_MODEL`` picks the
0.5B or the 1.5B): through the openai SDK, tool calls streamed and not with ``tool_choice`` named
and required, a tool result answered, a ``json_schema`` response that parses and validates;
through the anthropic SDK, ``/v1/messages`` with tools, streamed and not; through the Responses
API, a function tool. Every greedy answer with speculation equals plain decoding's."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest

from helpers.serve import Server

ROOT = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("AGENTSPEC_TEST_MODEL", "qwen2.5-coder-0.5b")
pytestmark = pytest.mark.slow

WRITE = {"type": "object", "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
         "required": ["file_path", "content"], "additionalProperties": False}
READ = {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "Write", "description": "Write a file to the local filesystem.",
                                           "parameters": WRITE}},
         {"type": "function", "function": {"name": "Read", "description": "Read a file from the local filesystem.",
                                           "parameters": READ}}]
SYSTEM = "You are a coding agent. Use the tools to change files."
ASK = [{"role": "system", "content": SYSTEM},
       {"role": "user", "content": "Create hello.py with a main function that prints 'hello, world'."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("fetch_model", ROOT / "scripts" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fetch_model"] = mod
    spec.loader.exec_module(mod)
    path = mod.fetch(MODEL)
    srv = Server(tmp_path_factory.mktemp("agents"), config=None, args=["--model", str(path)], timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=600)


def _streamed(oai, **kw):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            slot = calls.setdefault(tc.index, {"name": None, "arguments": ""})
            slot["name"] = tc.function.name or slot["name"]
            slot["arguments"] += tc.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Write"}}])
def test_chat_tool_calls_streamed_and_not(oai, choice):
    kw = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0,
              parallel_tool_calls=False)
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WRITE if call.function.name == "Write" else READ)
    assert call.function.name == "Write" and args["file_path"] and "hello" in args["content"].lower(), args
    plain = oai.chat.completions.create(**kw, extra_body={"speculation": False})
    assert plain.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    calls, finish = _streamed(oai, **kw)
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls.values()] == [
        (call.function.name, call.function.arguments)]


def test_chat_tool_result_answered(oai):
    first = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                                        temperature=0, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                           "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "File created successfully."}]
    kw = dict(model="m", messages=history, tools=TOOLS, max_tokens=120, temperature=0)
    r = oai.chat.completions.create(**kw)
    ch = r.choices[0]
    # what the model says next is its own (the 0.5B repeats its call as bare JSON until max_tokens)
    assert ch.message.content or ch.message.tool_calls
    # the history's cached prefix: the first turn's prompt at least
    assert r.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2
    plain = oai.chat.completions.create(**kw, extra_body={"speculation": False})
    assert plain.choices[0].message.content == ch.message.content


def test_chat_json_schema_response(oai):
    schema = {"type": "object", "properties": {"language": {"type": "string"},
                                               "lines": {"type": "integer", "minimum": 0}},
              "required": ["language", "lines"], "additionalProperties": False}
    kw = dict(model="m", max_tokens=80, temperature=0, messages=[
        {"role": "user", "content": "How many lines is `print('hi')` and in which language? Answer as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "info", "schema": schema, "strict": True}})
    r = oai.chat.completions.create(**kw)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert oai.chat.completions.create(**kw, extra_body={"speculation": False}).choices[0].message.content == \
        r.choices[0].message.content


def test_messages_with_tools_streamed_and_not(server):
    claude = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0, timeout=600)
    kw = dict(model="claude-sonnet-4-5", max_tokens=200, system=SYSTEM, messages=ASK[1:],
              tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                      "input_schema": t["function"]["parameters"]} for t in TOOLS],
              tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    (block,) = [b for b in m.content if b.type == "tool_use"]
    jsonschema.validate(block.input, WRITE if block.name == "Write" else READ)
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(block.name, block.input)]


def test_responses_function_tool(oai):
    r = oai.responses.create(model="gpt-5-codex", instructions=SYSTEM, input=ASK[1]["content"], max_output_tokens=200,
                             temperature=0, store=False, parallel_tool_calls=False,
                             tools=[{"type": "function", **t["function"]} for t in TOOLS], tool_choice="required")
    (item,) = [o for o in r.output if o.type == "function_call"]
    jsonschema.validate(json.loads(item.arguments), WRITE if item.name == "Write" else READ)
    assert r.status == "completed"


# a small file of this repository, read with line numbers (as agents show a file) and rewritten
REWRITE_FILE = "agentspec/drafting/suffix.py"


def test_a_write_that_copies_the_read_file_is_drafted_through_its_escapes(oai):
    """The turn after a Read: the model rewrites the file as a Write call (named), its content the
    file JSON-escaped. The escape-aware drafter copies it (its drafts accepted), and the answer
    equals plain decoding's."""
    text = (ROOT / REWRITE_FILE).read_text()
    numbered = "".join(f"{i:6d}\t{line}\n" for i, line in enumerate(text.splitlines(), 1))
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Rename the class SuffixDrafter to IndexDrafter in {REWRITE_FILE}."},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "Read", "arguments": json.dumps({"file_path": REWRITE_FILE})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": numbered}]
    kw = dict(model="m", messages=messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "Write"}},
              max_tokens=900, temperature=0, parallel_tool_calls=False)
    r = oai.chat.completions.create(**kw, extra_body={"spec_stats": True})
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    (call,) = r.choices[0].message.tool_calls
    plain = oai.chat.completions.create(**kw, extra_body={"speculation": False})
    assert plain.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    # the model copied the file's code (escaped in the call; the 0.5B drops the docstring and the
    # blank lines), and the copies were drafted
    content = json.loads(call.function.arguments)["content"]
    copied = [line for line in text.splitlines() if len(line) > 30 and line in content]
    assert len(copied) >= 5, content
    spec = r.model_extra["spec"]
    steps, drafted, accepted = spec["by_source"]["json_copy"]
    assert accepted > 0.2 * r.usage.completion_tokens, spec   # (the 0.5B: 37 of 132, its copy abridged)
    assert spec["by_source"]["grammar"][2] > 0, spec
