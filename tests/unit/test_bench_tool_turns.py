"""benchmarks/tool_turns.py: the recorded rewrites (here the tests' own sample, the same format as
the full set) become the turn an agent sends after reading the file, in both wire forms, each a
body the server's own request types take."""

from __future__ import annotations

import json

import msgspec
import pytest

from agentspec.api.anthropic import MessagesRequest, conversation as messages_conversation
from agentspec.api.handling import openai_conversation
from agentspec.api.protocol import ChatCompletionRequest
from benchmarks.harness import FIXTURE
from benchmarks.tool_turns import SYSTEM, numbered, tool_turns


@pytest.fixture(scope="module")
def turns():
    return list(tool_turns(FIXTURE, None, max_chars=10**9, held_out=False))


def test_every_recorded_rewrite_is_a_turn(turns):
    records = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]
    assert len(turns) == len(records) > 0
    for t, rec in zip(turns, records):
        assert t.id == rec["id"] and t.new == rec["response"]
        assert t.instruction and "\n```" not in t.instruction and f"`{t.path}`" in rec["prompt"]
        assert t.old in rec["prompt"]   # (empty where the commit creates the file)
    assert sum(bool(t.old) for t in turns) > len(turns) // 2


def test_the_chat_form_reads_the_file_then_asks_for_the_change(turns):
    for t in turns:
        for write_only in (False, True):
            body = t.chat_request(write_only=write_only)
            req = msgspec.convert({"model": "m", **body}, ChatCompletionRequest)
            conv = openai_conversation(req)
            assert [m.role for m in conv.messages] == ["system", "user", "assistant", "tool"]
            assert conv.messages[0].content == SYSTEM
            (call,) = conv.messages[2].tool_calls
            assert call.name == "Read" and json.loads(call.arguments) == {"file_path": t.path}
            assert conv.messages[3].content == numbered(t.old)
            names = [x.name for x in conv.tools]
            assert names == (["Write"] if write_only else ["Read", "Edit", "Write"])
            assert conv.tool_choice == ("required" if write_only else "auto")


def test_the_messages_form_is_the_same_turn(turns):
    t = turns[0]
    for write_only in (False, True):
        req = msgspec.convert({"model": "m", "max_tokens": 64, **t.messages_request(write_only=write_only)},
                              MessagesRequest)
        conv = messages_conversation(req)
        chat = openai_conversation(msgspec.convert({"model": "m", **t.chat_request(write_only=write_only)},
                                                   ChatCompletionRequest))
        assert [m.role for m in conv.messages] == [m.role for m in chat.messages]
        assert conv.messages[-1].content == chat.messages[-1].content
        assert [x.name for x in conv.tools] == [x.name for x in chat.tools]
        assert conv.tool_choice == chat.tool_choice


def test_numbered_is_cat_n():
    assert numbered("a\n\nb") == "     1\ta\n     2\t\n     3\tb\n"
