"""Grammar-constrained decoding is exact with speculation: with a grammar, speculative output
equals plain constrained decoding token for token (greedy and seeded sampling), on the real
model, for a JSON schema, a Lark grammar and a lazy tool-call grammar, one request at a time and
batched, and the output follows the grammar."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from agentspec import Draft, SpecConfig
from agentspec.backends.embedded.backend import EmbeddedBackend
from agentspec.backends.embedded.batch import BatchEngine
from agentspec.backends.protocol import GenerationRequest, collect
from agentspec.decode.constraint import Constraint
from agentspec.errors import InvalidRequestError

from helpers.grammars import (LARK_STATEMENT, LARK_STATEMENT_START, PERSON_SCHEMA, TOOL_ARGS_SCHEMA, json_grammar,
                              lark_grammar, tool_call_grammar)

pytestmark = pytest.mark.slow

# fixed step costs: the batches here need no profile (the budget policy is not what is tested)
STEP_COSTS = {1: 0.02, 2: 0.021, 33: 0.03, 264: 0.12}

# the model's answer holds escapes (\" and \n) in its strings
JSON_PROMPT = 'JSON for the engineer "Al \\"Q\\" Smith" from Rome, zip 100, skills C and Go, quote: a\\nb'

LARK_PROMPT = "Write a short program: lines like `let x = 1 + 2;` each on its own line, and finish with the word end."
TOOL_MESSAGES = [
    {"role": "system", "content": 'You call tools by writing <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'},
    {"role": "user", "content": "Read main.py"},
    {"role": "assistant", "content": '<tool_call>{"name": "read_file", "arguments": {"path": "main.py"}}</tool_call>'},
    {"role": "user", "content": "List the folder src"},
    {"role": "assistant", "content": '<tool_call>{"name": "list_dir", "arguments": {"path": "src"}}</tool_call>'},
    {"role": "user", "content": "Now read setup.py"},
]
MAX_TOKENS = 64
FREE_TOKENS = 24   # the same prompts without the grammar: enough to see the grammar change them


class ReferenceTreeDrafter:
    """Drafts what a recorded output says comes next (while the output follows it) as a tree
    with a decoy beside every token: half of the decoys random tokens (grammar-illegal nearly
    always: pruned), half tokens of the recorded output or of ``extra`` (often legal: they
    reach verification and the masked target turns them down). Deep accepted paths whose
    rows each need their own grammar state, and, through ``extra`` (the output without the
    grammar), draft tokens that only the mask refuses."""

    def __init__(self, reference: list[int], *, vocab: int, seed: int, extra: list[int] = ()) -> None:
        self.reference = list(reference)
        self.pool = self.reference + list(extra)
        self.extra = list(extra)
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.out: dict[str, list[int]] = {}

    def start(self, req_id, prompt, *, tenant="default"):
        self.out[req_id] = []

    def extend(self, req_id, tokens):
        self.out[req_id].extend(tokens)

    def stop(self, req_id):
        self.out.pop(req_id, None)

    def propose(self, req_id, budget):
        out, ref, rng = self.out[req_id], self.reference, self.rng
        n = len(out)
        chain = ref[n:n + max(budget // 2, 1)] if ref[:n] == out else [rng.choice(self.pool) for _ in range(3)]
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for i, t in enumerate(chain):
            if len(tokens) + 2 > budget:
                break
            if self.extra and n + i < len(self.extra) and self.extra[n + i] != t:
                decoy = self.extra[n + i]   # what the model says here without the grammar
            else:
                decoy = rng.choice(self.pool) if rng.random() < 0.5 else rng.randrange(self.vocab)
            if decoy == t:
                decoy = (t + 1) % self.vocab
            pair = [decoy, t] if rng.random() < 0.5 else [t, decoy]
            for tok in pair:
                tokens.append(tok)
                parents.append(parent)
            parent = len(tokens) - (1 if pair[1] == t else 2)
        return Draft(tokens, parents, [0.5] * len(tokens), source="reference-tree")


@pytest.fixture(scope="module")
def grammars():
    return {"json": json_grammar(), "lark": lark_grammar(), "tool": tool_call_grammar()}


@pytest.fixture(scope="module")
def cases(engine, grammars):
    """(name, prompt ids, grammar) for every kind of grammar."""
    return [("json", engine.encode(JSON_PROMPT), grammars["json"]),
            ("lark", engine.encode(LARK_PROMPT), grammars["lark"]),
            ("tool", engine.encode(TOOL_MESSAGES), grammars["tool"])]


@pytest.fixture(scope="module")
def plain(engine, cases):
    """Plain constrained greedy decoding of every case (the references), and the same prompts
    without the grammar."""
    return {name: (engine.generate(ids, max_tokens=MAX_TOKENS, spec=None, grammar=g),
                   engine.generate(ids, max_tokens=FREE_TOKENS, spec=None))
            for name, ids, g in cases}


def _check_follows(name: str, g) -> None:
    """The output is what its grammar describes (complete ones parse and validate)."""
    text = g.text
    if name == "json":
        assert g.finish_reason == "stop", f"{name}: JSON not complete in {MAX_TOKENS} tokens: {text!r}"
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    elif name == "lark":
        # statements, then "end"; a small model may still be writing statements when the budget
        # ends (how many it writes depends on the CPU's rounding): then every statement but the
        # last is whole and the last is a statement's or "end"'s beginning
        *whole, last = text.split("\n")
        assert whole and all(LARK_STATEMENT.fullmatch(line + "\n") for line in whole), text
        if g.finish_reason == "stop":
            assert last == "end", text
        else:
            assert g.finish_reason == "length" and len(g.token_ids) == MAX_TOKENS, g.finish_reason
            assert "end".startswith(last) or LARK_STATEMENT_START.fullmatch(last), text
    else:
        start = text.index("<tool_call>") + len("<tool_call>")
        body = text[start:text.index("</tool_call>", start)]
        jsonschema.validate(json.loads(body), TOOL_ARGS_SCHEMA)


def test_plain_constrained_output_follows_the_grammar(plain):
    for name, (g, free) in plain.items():
        _check_follows(name, g)
        assert g.token_ids[:FREE_TOKENS] != free.token_ids, f"{name}: the grammar changed nothing (no mask tested)"
        assert g.stats.grammar_seconds > 0 and not g.stats.spec_enabled
    assert '\\"' in plain["json"][0].text and "\\n" in plain["json"][0].text   # escapes in its strings


def test_greedy_speculation_equals_plain_constrained_decoding(engine, cases, plain, monkeypatch):
    """The engine's own drafters, and a tree drafter that knows the answer (deep accepted paths,
    decoys the mask turns down): the same tokens as plain constrained decoding."""
    masks = []
    full = Constraint.masked_argmax

    def counting(self, logits):
        masks.append(1)
        return full(self, logits)

    monkeypatch.setattr(Constraint, "masked_argmax", counting)
    accepted = 0
    for name, ids, grammar in cases:
        ref, free = plain[name]
        for drafter in (None, ReferenceTreeDrafter(ref.token_ids, vocab=engine.vocab_size, seed=3,
                                                   extra=free.token_ids)):
            g = engine.generate(ids, max_tokens=MAX_TOKENS, spec=SpecConfig(budget=16, row_cost=0.0), grammar=grammar,
                                drafter=drafter)
            assert g.token_ids == ref.token_ids, f"{name} ({'tree' if drafter else 'default'} drafter)"
            assert g.text == ref.text and g.finish_reason == ref.finish_reason
            assert g.stats.spec_enabled
            if drafter is not None:
                accepted += g.stats.accepted_tokens
    assert accepted > 0.6 * sum(len(r.token_ids) for r, _ in plain.values())
    assert masks, "no verified row needed the full mask"


def test_the_walk_masks_targets_even_without_pruning(engine, cases, plain, monkeypatch):
    """Pruning drafts to their legal part only saves rows: with it turned off, draft tokens the
    grammar refuses reach verification (the model's unconstrained choices) and the masked
    targets turn them down; the output is the same."""
    monkeypatch.setattr(Constraint, "legal", lambda self, draft: draft)
    for name, ids, grammar in cases[:1]:   # the JSON schema
        ref, free = plain[name]
        drafter = ReferenceTreeDrafter(free.token_ids, vocab=engine.vocab_size, seed=9, extra=ref.token_ids)
        g = engine.generate(ids, max_tokens=MAX_TOKENS, spec=SpecConfig(budget=12, row_cost=0.0), grammar=grammar,
                            drafter=drafter)
        assert g.token_ids == ref.token_ids, name
        assert g.stats.draft_tokens > g.stats.accepted_tokens


def test_seeded_sampling_with_a_grammar_is_the_same_with_and_without_speculation(engine, cases):
    opts = dict(max_tokens=40, temperature=0.8, top_p=0.95, top_k=50, seed=1234)
    for name, ids, grammar in cases[:1]:   # the JSON schema
        ref = engine.generate(ids, spec=None, grammar=grammar, **opts)
        assert ref.stats.seed == 1234
        for drafter in (None, ReferenceTreeDrafter(ref.token_ids, vocab=engine.vocab_size, seed=5)):
            g = engine.generate(ids, spec=SpecConfig(budget=12, row_cost=0.0), grammar=grammar, drafter=drafter, **opts)
            assert g.token_ids == ref.token_ids, name
            if drafter is not None:
                assert g.stats.accepted_tokens > 0
        if ref.finish_reason == "stop":
            jsonschema.validate(json.loads(ref.text), PERSON_SCHEMA)


@pytest.mark.parametrize("verify", ["reference", "batched"])
def test_batched_constrained_requests_equal_plain_decoding(engine, cases, plain, verify):
    """Several constrained requests in flight together, with an unconstrained one beside them
    (with ``verify="batched"`` it alone goes through the batched greedy verification; the
    constrained ones walk their trees with masked targets)."""
    prompts = [ids for _, ids, _ in cases] + [cases[0][1]]
    per = [{"grammar": g} for _, _, g in cases] + [{"max_tokens": FREE_TOKENS}]
    with BatchEngine(engine, step_costs=STEP_COSTS, background=False, verify=verify) as be:
        out = be.generate_many(prompts, per_prompt=per, max_tokens=MAX_TOKENS, spec=SpecConfig(row_cost=0.0))
    want = [plain[name][0] for name, _, _ in cases] + [plain[cases[0][0]][1]]
    bad = [i for i, (a, r) in enumerate(zip(out, want)) if a.token_ids != r.token_ids]
    assert not bad, f"batched constrained output differs from plain decoding on requests {bad}"
    assert sum(g.stats.accepted_tokens for g in out[:-1]) > 0


def test_the_backend_compiles_the_grammar_at_submit(engine, cases, plain):
    with EmbeddedBackend(engine, max_queue=4, max_batch=4) as backend:
        for bad in ("start: foo\nfoo: bar", '{"grammars": [{"json_schema": {"type": "integer", "minimum": 3, '
                                            '"maximum": 1}}]}'):
            with pytest.raises(InvalidRequestError) as e:
                backend.submit(GenerationRequest(prompt_ids=cases[0][1], max_tokens=8, grammar=bad),
                               on_tokens=lambda t: None, on_done=lambda g, err: None)
            assert e.value.param == "grammar"
            assert backend.health()["waiting"] == 0 and backend.health()["running"] == 0
        name, ids, grammar = cases[2]
        g = collect(backend.stream(GenerationRequest(prompt_ids=ids, max_tokens=MAX_TOKENS, grammar=grammar)))
    assert g.token_ids == plain[name][0].token_ids


def test_with_the_kernels_capped_at_avx2(engine, cases, plain, restore_isa):
    """Once below the CPU's best level: speculative constrained output is the plain constrained
    output of that level. (Decode and verification rows compute the same bits at every level; a
    prompt's attention may not: AVX512-BF16's prompt kernel has its own.)"""
    cpu_isa = restore_isa
    if "avx2" not in cpu_isa.supported():
        pytest.skip("this CPU does not run the avx2 kernels")
    cpu_isa.set_isa("avx2")
    name, ids, grammar = cases[1]
    ref = engine.generate(ids, max_tokens=MAX_TOKENS, spec=None, grammar=grammar)
    drafter = ReferenceTreeDrafter(ref.token_ids, vocab=engine.vocab_size, seed=1)
    g = engine.generate(ids, max_tokens=MAX_TOKENS, spec=SpecConfig(budget=16, row_cost=0.0), grammar=grammar,
                        drafter=drafter)
    assert g.token_ids == ref.token_ids and g.stats.accepted_tokens > 0


def test_the_default_drafters_with_the_outputs_format_forced_tokens_included(engine, cases, plain):
    """The server's default drafters (the suffix index and escape-aware copying) told how the
    output reads, and the grammar's forced tokens proposed as drafts: the same tokens as plain
    constrained decoding, and the forced stretches are accepted."""
    from agentspec.backends.protocol import OutputFormat
    from agentspec.drafting.registry import DEFAULT_DRAFTERS

    drafter = engine.drafter_for(DEFAULT_DRAFTERS)
    formats = {"json": OutputFormat(json=True), "lark": None,
               "tool": OutputFormat(tool_format="hermes", tools=("read_file", "list_dir"))}
    forced = 0
    for name, ids, grammar in cases:
        ref = plain[name][0]
        g = engine.generate(ids, max_tokens=MAX_TOKENS, spec=SpecConfig(budget=16, row_cost=0.0), grammar=grammar,
                            drafter=drafter, output=formats[name])
        assert g.token_ids == ref.token_ids, name
        forced += g.stats.source_accepted.get("grammar", 0)
    assert forced > 0
