"""benchmarks/bench_grammar.py's grammars and samples agree: each sample follows its grammar on
the bundled tokenizer (the benchmark times masks along it and stops at a refused token)."""

from __future__ import annotations

import json

import llguidance

from agentspec.decode.constraint import ConstraintFactory
from benchmarks.bench_grammar import EDIT_SAMPLE, EDIT_SCHEMA, TOOL_SAMPLE, tool_call_grammar

from helpers.grammars import bundled_tokenizer


def test_the_samples_follow_their_grammars():
    tok = bundled_tokenizer()
    factory = ConstraintFactory(tok, vocab=tok.vocab_size)
    for grammar, sample in ((llguidance.LLMatcher.grammar_from_json_schema(EDIT_SCHEMA), json.dumps(EDIT_SAMPLE)),
                            (tool_call_grammar(tok), TOOL_SAMPLE)):
        c = factory.compile(grammar)
        ids = tok.encode(sample)
        assert c.legal_prefix(ids) == len(ids)
    assert '[lazy]: TEXT "<tool_call>"' in tool_call_grammar(tok)   # SmolLM2 spells <tool_call> as text
