"""A model's thoughts ahead of its answer (Qwen3, QwQ, DeepSeek-R1: ``<think>`` ... ``</think>``):
the parser sends them as reasoning events, whatever the deltas, and the grammar of a constrained
turn admits them ahead of what it holds -- on a tokenizer where the tags are text (the bundled
model's) and on one where they are tokens of their own (Qwen3's)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.chat import (FORMATS, CallStart, Conversation, Message, OutputParser, Reasoning, ReasoningFormat,
                            Text, Tool, detect_reasoning)

HERMES = FORMATS["hermes"]
THINK = ReasoningFormat()
CALL = '<tool_call>\n{"name": "Read", "arguments": {"path": "a.py"}}\n</tool_call>'


def run(text: str, cuts=(), *, opened=None, tools=("Read",), fmt=HERMES):
    p = OutputParser(fmt, tools, reasoning=THINK, opened=opened)
    events = []
    points = [0, *cuts, len(text)]
    for a, b in zip(points, points[1:]):
        events += p.push(text[a:b])
    events += p.finish()
    return p, events


THOUGHT_THEN_CALL = "<think>\nThe user wants a.py.\n\nRead it first.\n</think>\n\n" + CALL


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, len(THOUGHT_THEN_CALL)), max_size=10))
def test_thoughts_then_a_call_whatever_the_deltas(cuts):
    p, events = run(THOUGHT_THEN_CALL, sorted(cuts))
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == "The user wants a.py.\n\nRead it first."
    assert p.reasoning and "".join(p.reasoning) == "The user wants a.py.\n\nRead it first."
    assert not any(isinstance(e, Text) for e in events)
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [("Read", {"path": "a.py"})]
    # the thoughts come before the call starts
    kinds = [type(e) for e in events]
    assert kinds.index(CallStart) > max(i for i, k in enumerate(kinds) if k is Reasoning)


OPENED = "\nIt is a greeting.\n</think>\n\nHello! How can I help?"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(OPENED)), max_size=8))
def test_thoughts_the_prompt_opened(cuts):
    p, events = run(OPENED, sorted(cuts), opened=True, tools=())
    assert "".join(p.reasoning) == "It is a greeting."
    assert "".join(p.content) == "Hello! How can I help?"


@pytest.mark.parametrize("text,opened,thought,answer", [
    ("Hello <think>x</think>", None, "", "Hello <think>x</think>"),   # thoughts come first or not at all
    ("<thi", None, "", "<thi"),                                        # a prefix of the tag, then the end
    ("<think>\ncut off by max_tokens", None, "cut off by max_tokens", ""),
    ("  <think>a</think>b", None, "a", "b"),
    ("<think>x</think>y", False, "", "<think>x</think>y"),            # the prompt closed them: all answer
    ("no tags at all", True, "no tags at all", ""),                    # opened and never closed
])
def test_edges(text, opened, thought, answer):
    for cuts in ([], list(range(1, len(text)))):   # whole, and one character at a time
        p, _ = run(text, cuts, opened=opened, tools=())
        assert ("".join(p.reasoning), "".join(p.content)) == (thought, answer)


def test_detect_and_opened():
    assert detect_reasoning("{{ '<think>' }}...{{ '</think>' }}") == THINK
    assert detect_reasoning("{{ messages }}") is None and detect_reasoning(None) is None
    assert THINK.opened("<|im_start|>assistant\n<think>\n") is True
    assert THINK.opened("<|im_start|>assistant\n<think>\n\n</think>\n\n") is False
    assert THINK.opened("<|im_start|>assistant\n") is None


def _conv(choice="required", schema=None):
    tools = [Tool(name="Read", parameters={"type": "object", "properties": {"path": {"type": "string"}},
                                           "required": ["path"], "additionalProperties": False})]
    return Conversation(messages=[Message(role="user", content="hi")], tools=tools if schema is None else [],
                        tool_choice=choice if schema is None else "auto", response_schema=schema,
                        parallel_tool_calls=False)


def _tokenizers():
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from agentspec.backends.tokenizer import Tokenizer
    from helpers.families import QWEN3_TEMPLATE, QWEN3_TOKENS
    from helpers.grammars import bundled_tokenizer

    text = bundled_tokenizer()
    hf = HFTokenizer.from_str(text.backend.to_str())
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN3_TOKENS])
    tokens = Tokenizer(hf, eos_token_ids=text.eos_token_ids, chat_template=QWEN3_TEMPLATE)
    return {"tags as text": text, "tags as tokens": tokens}


@pytest.mark.parametrize("which", ["tags as text", "tags as tokens"])
def test_a_constrained_turn_admits_thoughts_first(which):
    from agentspec.decode.constraint import ConstraintFactory

    tok = _tokenizers()[which]
    factory = ConstraintFactory(tok, vocab=tok.vocab_size)

    def token_id(s):
        t = tok.backend.token_to_id(s)
        return t if isinstance(t, int) else None

    assert (token_id("</think>") is not None) == (which == "tags as tokens")

    def legal(grammar: str, text: str) -> tuple[bool, bool]:
        c = factory.compile(grammar)
        ids = tok.encode(text)
        n = c.legal_prefix(ids)
        c.consume(ids[:n])
        return n == len(ids), c.stopped

    forced = HERMES.grammar(_conv("required"), token_id)
    free = THINK.with_reasoning(forced, opened=False, token_id=token_id)
    opened = THINK.with_reasoning(forced, opened=True, token_id=token_id)
    thought = "I should read a.py.\nThe tags < and </ are fine in here: {\"x\"}.\n"
    assert legal(free, CALL) == (True, True)                                  # no thoughts
    assert legal(free, "<think>\n" + thought + "</think>\n\n" + CALL) == (True, True)
    assert legal(free, "Sure!")[0] is False                                   # still a forced call
    assert legal(free, "<think>\nhm</think>\n\nSure!")[0] is False            # ... after the thoughts too
    assert legal(opened, thought + "</think>\n\n" + CALL) == (True, True)
    assert legal(opened, thought + "still thinking")[0] is True               # free until </think>
    assert legal(opened, "x</think>\n\nSure!")[0] is False
    schema = HERMES.grammar(_conv(schema={"type": "object", "properties": {"a": {"type": "integer"}},
                                          "required": ["a"], "additionalProperties": False}), token_id)
    answer = THINK.with_reasoning(schema, opened=False, token_id=token_id)
    assert legal(answer, '<think>\nan int\n</think>\n\n{"a": 1}') == (True, True)
    assert legal(answer, '{"a": 1}') == (True, True)
    assert legal(answer, '<think>\nan int\n</think>\n\n{"a": "x"}')[0] is False
