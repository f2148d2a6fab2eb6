"""A thinking model's thoughts through the three wire APIs, with the vendors' SDKs against a real
server on loopback: Chat Completions' ``reasoning_content``, Messages' ``thinking`` blocks,
Responses' ``reasoning`` items -- streamed and not, equal with speculation on and off -- and the
switches that turn thinking off (``chat_template_kwargs.enable_thinking``, ``reasoning_effort:
"none"``, ``thinking: {"type": "disabled"}``, ``reasoning: {"effort": "none"}``), reaching
Qwen3's own chat template; thoughts sent back render where the template puts them.

The models are small random-weight Qwen3 checkpoints (``helpers.families``) with Qwen3's chat
template and its ``<think>`` / ``<tool_call>`` tokens: ``qwen3-think`` leaves the block to the
model (Qwen3), ``qwen3-opened`` opens it in the prompt (Qwen3-2507 Thinking, DeepSeek-R1). A random
model never closes a block, so everything it writes after an opened block is thought: the tests
check where it goes and that nothing is lost.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from helpers.families import write_family
from helpers.serve import Server

KEY = "sk-reasoning-test-key"
READ = {"type": "object", "properties": {"path": {"type": "string", "enum": ["README.md"]}},
        "required": ["path"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "Read", "description": "Read a file", "parameters": READ}}]
ASK = [{"role": "user", "content": "What does the README say?"}]
CONFIG = f"""
[[tenants]]
name = "agent"
api_keys = ["{KEY}"]
"""


def _server(tmp_path_factory, family):
    root = tmp_path_factory.mktemp(family)
    model = write_family(root / family, family, dim=64, layers=2, heads=2, kv_heads=1, hidden=128)
    return Server(root, config=CONFIG, args=["--model", str(model)])


@pytest.fixture(scope="module")
def think(tmp_path_factory):
    srv = _server(tmp_path_factory, "qwen3-think")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def opened(tmp_path_factory):
    srv = _server(tmp_path_factory, "qwen3-opened")
    yield srv
    srv.stop()


def _oai(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key=KEY, max_retries=0)


def _claude(srv):
    return anthropic.Anthropic(base_url=srv.base, api_key=KEY, max_retries=0)


# ---- thinking off: every API's switch reaches the template -------------------------------------

def test_each_apis_switch_turns_thinking_off(think):
    oai, claude = _oai(think), _claude(think)
    kw = dict(model="qwen3", messages=ASK, max_tokens=4, temperature=0)
    on = oai.chat.completions.create(**kw).usage.prompt_tokens
    # Qwen3's template writes an empty block, <think>\n\n</think>\n\n, when thinking is off: more prompt tokens
    off = oai.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on
    assert not getattr(off.choices[0].message, "reasoning_content", None)
    effort = oai.chat.completions.create(**kw, reasoning_effort="none")
    assert effort.usage.prompt_tokens == off.usage.prompt_tokens
    assert oai.chat.completions.create(**kw, reasoning_effort="high").usage.prompt_tokens == on

    m_on = claude.messages.count_tokens(model="q", messages=ASK).input_tokens
    m_off = claude.messages.count_tokens(model="q", messages=ASK, thinking={"type": "disabled"}).input_tokens
    m_en = claude.messages.count_tokens(model="q", messages=ASK,
                                        thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens
    assert (m_on, m_off, m_en) == (on, off.usage.prompt_tokens, on)

    r = oai.responses.create(model="q", input=ASK[0]["content"], max_output_tokens=4, temperature=0,
                             reasoning={"effort": "none"})
    assert r.usage.input_tokens == off.usage.prompt_tokens and r.reasoning.effort == "none"

    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"tools": []}})
    assert e.value.body["param"] == "chat_template_kwargs.tools"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": "no"}})
    assert e.value.body["param"] == "chat_template_kwargs.enable_thinking"


def test_a_forced_call_with_thinking_off_and_left_on(think):
    """Off: the template closed the block, the grammar holds the answer to the call. Left to the
    model: the grammar admits a block first; speculation equals plain decoding either way."""
    oai = _oai(think)
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {}):
        kw = dict(model="q", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0,
                  parallel_tool_calls=False)
        r = oai.chat.completions.create(**kw, extra_body={**extra, "spec_stats": True})
        plain = oai.chat.completions.create(**kw, extra_body={**extra, "speculation": False})
        a, b = r.choices[0].message, plain.choices[0].message
        assert (a.content, getattr(a, "reasoning_content", None)) == (b.content, getattr(b, "reasoning_content", None))
        assert [(c.function.name, c.function.arguments) for c in a.tool_calls or ()] == \
            [(c.function.name, c.function.arguments) for c in b.tool_calls or ()]
        if extra:   # no thoughts possible: a call, held to its schema
            assert not getattr(a, "reasoning_content", None) and r.choices[0].finish_reason == "tool_calls"
            (call,) = a.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), READ)


# ---- thoughts out: every API's shape, streamed and not -----------------------------------------

def test_chat_reasoning_content(opened):
    oai = _oai(opened)
    kw = dict(model="q", messages=ASK, max_tokens=24, temperature=0)
    r = oai.chat.completions.create(**kw)
    msg = r.choices[0].message
    # the prompt opened the block and the model never closed it: all of it is thought, none answer
    assert msg.reasoning_content and msg.content == "" and r.choices[0].finish_reason == "length"
    plain = oai.chat.completions.create(**kw, extra_body={"speculation": False})
    assert plain.choices[0].message.reasoning_content == msg.reasoning_content
    thought, content = "", ""
    for chunk in oai.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            d = chunk.choices[0].delta
            thought += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
    assert (thought, content) == (msg.reasoning_content, "")


def test_messages_thinking_block(opened):
    claude = _claude(opened)
    kw = dict(model="claude-sonnet-4-5", max_tokens=24, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024},
              extra_body={"temperature": 0})
    m = claude.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking"] and m.stop_reason == "max_tokens"
    assert m.content[0].thinking and m.content[0].signature == ""
    with claude.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking"] and final.content[0].thinking == m.content[0].thinking
    assert "content_block_start" in kinds and kinds[-1] == "message_stop"


def test_responses_reasoning_item(opened):
    oai = _oai(opened)
    kw = dict(model="gpt-5-codex", input="What does the README say?", max_output_tokens=24, temperature=0,
              store=False)
    r = oai.responses.create(**kw)
    assert r.status == "incomplete" and [o.type for o in r.output] == ["reasoning"]
    (item,) = r.output
    assert item.id.startswith("rs_") and item.summary == [] and item.content[0].type == "reasoning_text"
    assert item.content[0].text and r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(oai.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done == item.content[0].text
    assert kinds.index("response.output_item.added") < kinds.index("response.reasoning_text.delta") \
        < kinds.index("response.output_item.done") < kinds.index("response.completed")


# ---- thoughts back in: rendered where the template shows them, the same through every API -------

def test_thoughts_sent_back_render_the_same_through_every_api(think):
    """Qwen3's template shows an assistant turn's thoughts after the last user message (inside a
    tool loop): a turn's thoughts sent back as reasoning_content, a thinking block or a reasoning
    item make the same prompt, longer than the same turn without them."""
    oai, claude = _oai(think), _claude(think)
    thought = "The README is the place to look."
    args = '{"path": "README.md"}'

    def chat(with_thought: bool) -> int:
        assistant = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "Read", "arguments": args}}]}
        if with_thought:
            assistant["reasoning_content"] = thought
        msgs = ASK + [assistant, {"role": "tool", "tool_call_id": "call_1", "content": "# Demo"}]
        return oai.chat.completions.create(model="q", messages=msgs, tools=TOOLS, max_tokens=1,
                                           temperature=0).usage.prompt_tokens

    with_, without = chat(True), chat(False)
    assert with_ > without
    tools = [{"name": "Read", "description": "Read a file", "input_schema": READ}]
    messages = ASK + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": thought, "signature": "sig"},
        {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "README.md"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "# Demo"}]}]
    assert claude.messages.count_tokens(model="q", messages=messages, tools=tools).input_tokens == with_
    r = oai.responses.create(model="q", max_output_tokens=1, temperature=0, input=[
        ASK[0],
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": thought}]},
        {"type": "function_call", "call_id": "call_1", "name": "Read", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "# Demo"}],
        tools=[{"type": "function", "name": "Read", "description": "Read a file", "parameters": READ}])
    assert r.usage.input_tokens == with_
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="q", max_tokens=1, messages=[{"role": "user", "content": "hi",
                                                                         "reasoning_content": "x"}])
    assert e.value.body["param"] == "messages[0].reasoning_content"
