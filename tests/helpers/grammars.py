"""Grammars for the constrained-decoding tests (tests/unit/test_constraint.py,
tests/integration/test_constrained_exactness.py) and the bundled model's tokenizer without its
weights."""

from __future__ import annotations

import functools
import re

__all__ = ["LARK_GRAMMAR", "LARK_STATEMENT", "LARK_STATEMENT_START", "PERSON_SCHEMA", "TOOL_ARGS_SCHEMA",
           "bundled_tokenizer", "json_grammar", "lark_grammar", "tool_call_grammar"]

# a nested object, an enum, an array, a string that may hold escapes (short strings: a small
# model's output completes within a test's few dozen tokens)
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "role": {"enum": ["engineer", "manager", "designer"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
        "quote": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "role", "address", "skills", "quote"],
    "additionalProperties": False,
}

# a tool call's JSON (Hermes style: {"name": ..., "arguments": {...}})
TOOL_ARGS_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["read_file", "list_dir"]},
        "arguments": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}

# a small language: "let x = 1 + 2;" lines, then "end"
LARK_GRAMMAR = r"""
start: stmt+ "end"
stmt: "let " NAME " = " expr ";\n"
expr: atom (OP atom)*
atom: NAME | NUMBER
OP: " + " | " * " | " - "
NAME: /[a-z][a-z0-9_]{0,8}/
NUMBER: /[0-9]{1,4}/
"""
# LARK_GRAMMAR's statement as a regex (an oracle independent of the grammar engine), whole and begun
_NAME = r"[a-z][a-z0-9_]{0,8}"
_ATOM = rf"(?:{_NAME}|[0-9]{{1,4}})"
LARK_STATEMENT = re.compile(rf"let {_NAME} = {_ATOM}(?: [+*-] {_ATOM})*;\n")
LARK_STATEMENT_START = re.compile(r"(?:l|le|let|let [a-z0-9_ =+*-]*;?)")


def json_grammar(schema: dict | None = None, *, compact: bool = True) -> str:
    """``schema`` (default ``PERSON_SCHEMA``) as an llguidance grammar; ``compact``: one space
    after ``,`` and ``:`` and no other whitespace (fewer tokens than free layout)."""
    import llguidance

    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "} if compact else None
    return llguidance.LLMatcher.grammar_from_json_schema(PERSON_SCHEMA if schema is None else schema,
                                                         defaults=options)


def lark_grammar() -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(LARK_GRAMMAR)


def tool_call_grammar(trigger: str = "<tool_call>") -> str:
    """Free text, where ``trigger`` (a text trigger: a lazy lexeme) starts a tool call whose JSON
    follows ``TOOL_ARGS_SCHEMA`` up to ``</tool_call>``; then free text again."""
    import json

    end = trigger.replace("<", "</", 1)
    return (
        "start: ( f_call )* f_end\n"
        "f_end: TEXT\n"
        "TEXT: /(.|\\n)*/\n"
        f"f_call_hd[lazy]: TEXT {json.dumps(trigger)}\n"
        f"f_call: f_call_hd \"\\n\"? %json {json.dumps(TOOL_ARGS_SCHEMA)} \"\\n\"? {json.dumps(end)}\n"
    )


@functools.cache
def bundled_tokenizer():
    """The bundled SmolLM2's tokenizer, read from its GGUF header (no weights loaded)."""
    from agentspec.backends.embedded.weights import _GGUF, bundled_model_path

    return _GGUF(bundled_model_path(), quiet=True).tokenizer()
