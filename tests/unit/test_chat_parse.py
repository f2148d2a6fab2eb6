"""The output parser (agentspec.chat.parse) and the formats' grammars (agentspec.chat.formats):
text and tool calls out of a turn's text, however it is split into deltas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.chat import FORMATS, CallArgs, CallEnd, CallStart, Conversation, Message, OutputParser, Text, Tool
from agentspec.chat.formats import detect_format

HERMES = FORMATS["hermes"]
TOOLS = ("Write", "Read")


def run(text: str, cuts: list[int] | None = None, fmt=HERMES, tools=TOOLS):
    p = OutputParser(fmt, tools)
    events = []
    points = [0, *(cuts or []), len(text)]
    for a, b in zip(points, points[1:]):
        events += p.push(text[a:b])
    events += p.finish()
    return p, events


def _args_of(events, index):
    return "".join(e.delta for e in events if isinstance(e, CallArgs) and e.index == index)


TAGGED = ('I will write it.\n<tool_call>\n{"name": "Write", "arguments": {"path": "a.py", "content": '
          '"print(\\"}{\\")\\n"}}\n</tool_call>\n<tool_call>\n{"name": "Read", "arguments": {"path": "b"}}\n'
          '</tool_call>')


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(TAGGED)), max_size=12))
def test_tagged_calls_whatever_the_deltas(cuts):
    p, events = run(TAGGED, sorted(cuts))
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [
        ("Write", {"path": "a.py", "content": 'print("}{")\n'}), ("Read", {"path": "b"})]
    assert "".join(e.text for e in events if isinstance(e, Text)) == "I will write it.\n"
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [s.name for s in starts] == ["Write", "Read"] and [s.index for s in starts] == [0, 1]
    assert all(s.id.startswith("call_") for s in starts) and len({s.id for s in starts}) == 2
    # the streamed fragments add up to the arguments as written, and each call ends once
    assert [_args_of(events, i) for i in (0, 1)] == [c.arguments for c in p.calls]
    assert [e.index for e in events if isinstance(e, CallEnd)] == [0, 1] and not p.incomplete


@pytest.mark.parametrize("text", [
    '{"name": "Write", "arguments": {"path": "x"}}',
    '```json\n{"name": "Write", "arguments": {"path": "x"}}\n```',
    '  \n{"name": "Write", "parameters": {"path": "x"}}',
    '[{"name": "Write", "arguments": {"path": "x"}}]',
    '```json\n{"name": "Write", "arguments": {"path": "x"}}',   # a fence the turn did not close
])
def test_bare_and_fenced_json_is_a_call_when_it_names_a_declared_tool(text):
    p, events = run(text, [3, 9, 20])
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [("Write", {"path": "x"})]
    assert not any(isinstance(e, Text) for e in events)


@pytest.mark.parametrize("text", [
    '{"name": "Delete", "arguments": {"path": "x"}}',        # not a declared tool
    '{"answer": 42}',
    '```python\nprint(1)\n```',
    'Use <tool_ carefully',
])
def test_text_that_only_looks_like_a_call_is_text(text):
    p, events = run(text, [1, 5])
    assert not p.calls and "".join(e.text for e in events if isinstance(e, Text)) == text


def test_text_is_released_as_soon_as_it_cannot_be_a_call():
    p = OutputParser(HERMES, TOOLS)
    assert p.push('{"name": "Wr') == []            # may still be a call to Write
    out = p.push('ong", "x": 1}')                   # names no declared tool: text, at once
    assert "".join(e.text for e in out) == '{"name": "Wrong", "x": 1}'
    q = OutputParser(HERMES, TOOLS)
    assert [e.text for e in q.push("Hello <tool")] == ["Hello "]   # the marker's start is held


def test_a_call_cut_off_is_never_returned():
    p, events = run('<tool_call>\n{"name": "Write", "arguments": {"path": "a.py", "content": "pri')
    assert not p.calls and p.incomplete
    assert [e.name for e in events if isinstance(e, CallStart)] == ["Write"]
    assert not any(isinstance(e, CallEnd) for e in events)


def test_a_call_without_its_closing_tag_completes_at_the_end():
    p, _ = run('<tool_call>\n{"name": "Write", "arguments": {"path": "a"}}\n')
    assert [(c.name, c.arguments) for c in p.calls] == [("Write", '{"path": "a"}')] and not p.incomplete


def test_json_state_tracks_strings_and_the_argument_being_written():
    p = OutputParser(HERMES, TOOLS)
    p.push('<tool_call>\n{"name": "Write", "arguments": {"path": "a", "content": "x = \\"{')
    assert p.in_call and p.in_string and p.argument == "content"
    p.push('\\""}}')
    assert not p.in_string


def test_without_tools_everything_is_text():
    p, events = run(TAGGED, [4], tools=())
    assert not p.calls and "".join(e.text for e in events) == TAGGED


def test_mistral_list_and_llama_object():
    p, _ = run('[TOOL_CALLS][{"name": "Write", "arguments": {"path": "a"}}, {"name": "Read", "arguments": {}}]',
               fmt=FORMATS["mistral"])
    assert [c.name for c in p.calls] == ["Write", "Read"]
    p, _ = run('<|python_tag|>{"name": "Read", "parameters": {"path": "b"}}', fmt=FORMATS["llama3"])
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [("Read", {"path": "b"})]


def test_format_rows_come_from_the_template():
    assert detect_format("{% for tool in tools %}<tool_call>{% endfor %}").name == "hermes"
    assert detect_format("{{ tools }}[TOOL_CALLS]").name == "mistral"
    assert detect_format('{{ tools }}<|start_header_id|>ipython "parameters"').name == "llama3"
    assert detect_format("{{ messages }}") is None and detect_format(None) is None


def _conv(choice="auto", **kw):
    tools = [Tool(name="Write", parameters={"type": "object", "properties": {"path": {"type": "string"}}}),
             Tool(name="Read", parameters={"type": "object"})]
    return Conversation(messages=[Message(role="user", content="hi")], tools=tools, tool_choice=choice, **kw)


def test_grammars_per_tool_choice():
    special = {"<tool_call>": 7, "</tool_call>": 8}.get
    forced = HERMES.grammar(_conv("required"), special)
    assert "start: calls" in forced and "<[7]>" in forced and "<[8]>" in forced and '" call)*' in forced
    one = HERMES.grammar(_conv("required", parallel_tool_calls=False), special)
    assert "calls: call\n" in one
    named = HERMES.grammar(_conv("function", forced_tool="Read"), special)
    assert '"const": "Read"' in named and '"const": "Write"' not in named
    auto = HERMES.grammar(_conv("auto"), special)
    assert "start: tag* TEXT" in auto and "tag: TEXT <[7]> body" in auto and "bare_trig" in auto
    # a marker that is not one token: kept out of free text by the grammar itself
    none = HERMES.grammar(_conv("none"), lambda s: None)
    assert "& ~/" in none and "tool_call" in none
    # the call's JSON as json.dumps writes it (the template's tojson): re-rendered, the same text
    assert '"item_separator": ", "' in forced and '"whitespace_flexible": false' in forced


def test_auto_grammar_holds_a_bare_or_fenced_call_to_its_tool():
    """On a real tokenizer (the bundled model's: its vocabulary has no <tool_call> token, so the
    marker is text, kept out of free text by the grammar): free text passes; an answer that starts
    like a call must name an offered tool and follow its schema, bare or in a json fence."""
    from agentspec.decode.constraint import ConstraintFactory
    from helpers.grammars import bundled_tokenizer

    tok = bundled_tokenizer()
    factory = ConstraintFactory(tok, vocab=49152)
    tools = [Tool(name="Write", parameters={"type": "object", "properties": {"p": {"type": "string"}},
                                            "required": ["p"], "additionalProperties": False})]
    conv = Conversation(messages=[Message(role="user", content="hi")], tools=tools, parallel_tool_calls=False)
    grammar = HERMES.grammar(conv, lambda s: tok.backend.token_to_id(s))

    def legal(text: str) -> tuple[bool, bool]:
        c = factory.compile(grammar)
        ids = tok.encode(text)
        n = c.legal_prefix(ids)
        c.consume(ids[:n])
        return n == len(ids), c.stopped

    assert legal("Sure, here it is.") == (True, False)
    assert legal('{"a": 1}') == (True, False)                    # JSON that is no call stays text
    assert legal('{"name": "Write", "arguments": {"p": "x"}}') == (True, True)   # one call, then the end
    assert legal('```json\n{"name": "Write", "arguments": {"p": "x"}}\n```') == (True, True)
    assert legal('{"name": "Delete", "arguments": {}}')[0] is False   # not an offered tool
    assert legal('{"name": "Write", "arguments": {"q": 1}}')[0] is False   # not its schema
    assert legal('Ok.\n<tool_call>\n{"name": "Write", "arguments": {"p": "x"}}\n</tool_call>')[0]
    assert legal("Ok. <tool_call> free text")[0] is False            # the marker starts a call


BARE_TWO = ('```json\n{"name": "Write", "arguments": {"path": "a.py", "content": "x = {\\"k\\": 1}\\n"}}\n```\n'
            '{"name": "Read", "arguments": {"path": "b"}}')


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(BARE_TWO)), max_size=12))
def test_bare_calls_stream_their_arguments(cuts):
    p, events = run(BARE_TWO, sorted(cuts))
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [
        ("Write", {"path": "a.py", "content": 'x = {"k": 1}\n'}), ("Read", {"path": "b"})]
    assert not any(isinstance(e, Text) for e in events) and not p.incomplete
    assert [_args_of(events, i) for i in (0, 1)] == [c.arguments for c in p.calls]
    # streamed: the first call's start and some of its arguments come before the turn ends
    q = OutputParser(HERMES, TOOLS)
    early = q.push(BARE_TWO[:60])
    assert isinstance(early[0], CallStart) and early[0].name == "Write" and any(isinstance(e, CallArgs) for e in early)
