"""``agentspec.decode.constraint`` on the bundled model's tokenizer: masks, the greedy shortcut,
draft pruning (a lazy trigger inside a draft too) and grammar errors."""

from __future__ import annotations

import random

import pytest
import torch

from agentspec.backends.protocol import GenerationRequest, check_request
from agentspec.decode.constraint import Constraint, ConstraintFactory
from agentspec.drafting.draft import Draft
from agentspec.errors import InvalidRequestError

from helpers.grammars import bundled_tokenizer, json_grammar, lark_grammar, tool_call_grammar

VOCAB = 49152   # the bundled model's logits width (its tokenizer's size too)


@pytest.fixture(scope="module")
def tok():
    return bundled_tokenizer()


@pytest.fixture(scope="module")
def factory(tok):
    return ConstraintFactory(tok, vocab=VOCAB)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text)


def _states(factory, tok):
    """(label, constraint) at a few grammar states: start, inside a string, after an escape, in
    the middle of a number, complete; a lark grammar; a lazy grammar before and after its trigger."""
    prefixes = ['', '{"', '{"name": "Ada', '{"name": "A \\"', '{"name": "A", "role": "engineer", "address": {"city": "x", "zip": 12']
    for compact in (True, False):
        g = json_grammar(compact=compact)
        for p in prefixes:
            c = factory.compile(g)
            c.consume(_ids(tok, p))
            yield f"json {'compact' if compact else 'free'} {p!r}", c
    c = factory.compile(lark_grammar())
    c.consume(_ids(tok, "let x = 1"))
    yield "lark", c
    for p in ("Let me look", "Let me look.<tool_call>{\"name\": \"read"):
        c = factory.compile(tool_call_grammar())
        c.consume(_ids(tok, p))
        yield f"lazy {p!r}", c


def test_the_one_token_check_is_the_mask_bit(factory, tok):
    """``allows(t)`` agrees with the full mask on every token of the vocabulary, at states of each
    kind of grammar, those where the grammar forces bytes included (compact JSON after ``{``:
    the mask keeps ``{"`` and refuses ``{``, which ``validate_tokens`` alone would take): the
    greedy shortcut reads the very set the mask holds."""
    forced = wider = 0
    for label, c in _states(factory, tok):
        ff = bool(c.matcher.compute_ff_bytes())
        forced += ff
        mask = c.mask()
        c._bits, c._ids, c.masks = None, None, 0   # again: the check must not lean on a mask already made
        assert mask.shape == (VOCAB,) and mask.dtype == torch.bool
        assert 0 < int(mask.sum()) < VOCAB or label.startswith("lazy"), label
        allowed = [t for t in range(VOCAB) if c.allows(t)]
        assert allowed == mask.nonzero().flatten().tolist(), label
        assert (c.masks == 1) == ff, label   # only a state with forced bytes needed the mask
        # where validate_tokens alone says more than the mask allows: only where bytes are forced
        more = any(c.matcher.validate_tokens([t]) == 1 and not mask[t] for t in range(VOCAB))
        assert ff or not more, label
        wider += more
    assert forced >= wider >= 1


def test_masked_argmax_and_the_shortcut(factory, tok):
    """The row's argmax, when allowed, is the masked argmax (first index of the maximum kept);
    otherwise the masked argmax is the best allowed token. Ties included; a mask that allows
    most tokens and one that allows a few take different reads of the logits: the same answer."""
    rng = torch.Generator().manual_seed(0)
    checked_short = checked_full = 0
    wide = narrow = 0
    for label, c in _states(factory, tok):
        mask = c.mask()
        allowed = mask.nonzero().flatten()
        wide += len(allowed) > VOCAB // 2
        narrow += len(allowed) <= VOCAB // 2
        for trial in range(20):
            logits = torch.randn(VOCAB, generator=rng).to(torch.bfloat16)
            if trial % 2:   # make the winner an allowed token, with an allowed tie after it
                a = allowed[trial % len(allowed)]
                logits[a] = 10.0
                later = allowed[allowed > a]
                if len(later):
                    logits[later[0]] = 10.0
            if trial % 4 == 3:   # a refused token ties with the allowed winner, before it
                refused = (~mask).nonzero().flatten()
                if len(refused):
                    logits[refused[0]] = 10.0
            masked = c.masked(logits)
            assert masked.dtype == torch.float32 and masked.shape == logits.shape
            assert torch.isinf(masked[~mask]).all() and torch.equal(masked[mask], logits[mask].float())
            reference = int(logits.masked_fill(~mask, float("-inf")).argmax())
            best = c.masked_argmax(logits)
            assert best == reference == int(masked.argmax()), label
            assert mask[best]
            top = int(logits.argmax())
            if c.allows(top):
                assert best == top
                checked_short += 1
            else:
                checked_full += 1
    assert checked_short > 20 and checked_full > 20 and wide and narrow


def test_consume_finish_and_eos(factory, tok):
    c = factory.compile(json_grammar({"type": "object", "properties": {"a": {"type": "integer"}},
                                      "required": ["a"], "additionalProperties": False}))
    assert not c.stopped and c.mask().sum() < 10
    c.consume(_ids(tok, '{"a": 12}'))
    assert c.stopped and not c.finished
    assert c.mask().nonzero().flatten().tolist() == sorted(tok.eos_token_ids)   # only EOS now
    assert c.end_token in tok.eos_token_ids
    with pytest.raises(RuntimeError, match="refused token"):
        c.consume(_ids(tok, "x"))
    d = factory.compile(lark_grammar())
    d.consume([*_ids(tok, "let x = 1;\n"), c.end_token, *_ids(tok, "garbage")])   # EOS ends it: the rest is ignored
    assert d.finished and d.stopped
    assert d.legal_prefix(_ids(tok, "let")) == 0


def _tree(tok, paths: list[tuple[str, list[str]]]):
    """A draft tree from text pieces: each entry (parent path key, pieces) hangs a chain of the
    pieces' tokens under the node that ends the parent key ("" = the root)."""
    tokens, parents, ends = [], [], {"": -1}
    for key, pieces in paths:
        parent = ends[key]
        text = key
        for piece in pieces:
            for t in _ids(tok, piece):
                tokens.append(t)
                parents.append(parent)
                parent = len(tokens) - 1
            text += piece
            ends[text] = parent
    return tokens, parents


def _paths(draft: Draft) -> list[list[int]]:
    out = []
    for i in range(len(draft.token_ids)):
        path, j = [], i
        while j >= 0:
            path.append(draft.token_ids[j])
            j = draft.parents[j]
        out.append(path[::-1])
    return out


def test_pruning_a_hand_made_tree(factory, tok):
    c = factory.compile(json_grammar())
    c.consume(_ids(tok, '{"name": "Ada", "role": '))
    tokens, parents = _tree(tok, [
        ("", ['"engineer"', ', "address"']),            # legal, then legal
        ('"engineer"', [', "skills"']),                  # illegal: address comes first
        ("", ['"pilot"']),                               # illegal enum value (from its 'p' on)
        ("", ['"manager"', "}"]),                        # legal, then illegal (missing fields)
    ])
    n = len(tokens)
    sources = [f"n{i}" for i in range(n)]   # each node named: where it went is readable after pruning
    draft = Draft(tokens, parents, [0.5 + i / 1000 for i in range(n)], 0.0, "test", sources)
    draft.validate(n)
    before = c.mask()
    pruned = c.legal(draft)
    assert torch.equal(c.mask(), before)   # the state is left as it was
    pruned.validate(n)
    kept = [int(name[1:]) for name in pruned.node_sources]
    # every kept node is legal, every dropped one is not (checked node by node)
    all_paths = _paths(draft)
    assert kept == [i for i, p in enumerate(all_paths) if c.legal_prefix(p) == len(p)]
    assert 0 < len(kept) < n
    # tokens, probabilities and parents went with their nodes
    for k, i in enumerate(kept):
        assert pruned.token_ids[k] == draft.token_ids[i] and pruned.probs[k] == draft.probs[i]
        p = pruned.parents[k]
        assert (p == -1) == (draft.parents[i] == -1)
        assert p == -1 or kept[p] == draft.parents[i]
    assert pruned.score == pytest.approx(sum(pruned.survival()))
    assert c.legal(Draft([], [], [], 0.0, "")).token_ids == []
    # all legal: the same draft back
    ok = Draft(*_tree(tok, [("", ['"engineer"'])]), [1.0] * len(_ids(tok, '"engineer"')))
    assert c.legal(ok) is ok


def test_pruning_random_trees_matches_node_by_node(factory, tok):
    """Random trees over a few plausible tokens: a node survives iff its root path is legal."""
    rng = random.Random(5)
    c = factory.compile(lark_grammar())
    c.consume(_ids(tok, "let a = 1"))
    pool = sorted({t for s in (" + ", " * ", ";\n", "let", " b", "2", "3", " = ", "end", "x", "1") for t in _ids(tok, s)})
    for _ in range(30):
        n = rng.randrange(1, 40)
        parents = [rng.randrange(-1, i) for i in range(n)]
        tokens = [rng.choice(pool) for _ in range(n)]
        draft = Draft(tokens, parents, [0.5] * n)
        pruned = c.legal(draft)
        pruned.validate(n)
        want = sorted(tuple(p) for p in _paths(draft) if c.legal_prefix(p) == len(p))
        assert sorted(map(tuple, _paths(pruned))) == want


def test_a_lazy_trigger_inside_a_draft(factory, tok):
    """A tool-call grammar: free text until the text trigger ``<tool_call>``, then JSON. A draft
    path that crosses the trigger keeps its free text and its legal JSON, and loses the node
    where the JSON goes wrong; a branch that never triggers is kept whole."""
    c = factory.compile(tool_call_grammar())
    c.consume(_ids(tok, "I will read it"))
    good = ['.', '<tool_call>', '{"name": "read_file", "arguments": {"path": "a.py"}}', '</tool_call>']
    tokens, parents = _tree(tok, [
        ("", good),
        (".<tool_call>", ['{"name": "delete"']),            # not a tool name
        ("", [" and then", " think about it"]),            # never triggers: free text
    ])
    draft = Draft(tokens, parents, [0.8] * len(tokens))
    pruned = c.legal(draft)
    kept = {tok.decode(p) for p in _paths(pruned)}
    assert "." + "".join(good[1:]) in kept                   # the whole tool call
    assert " and then think about it" in kept
    bad = ".<tool_call>" + '{"name": "delete"'
    assert bad not in kept
    assert '.<tool_call>{"name": "' in kept                 # up to where "delete" goes wrong
    assert not any(k.startswith('.<tool_call>{"name": "d') for k in kept)
    # the trigger really switched the grammar on: after it, free text is refused
    c2 = factory.compile(tool_call_grammar())
    c2.consume(_ids(tok, "I will read it.<tool_call>"))
    assert c2.legal_prefix(_ids(tok, " hello")) == 0 and c2.mask().sum() < 100


def test_bad_grammars_are_invalid_requests_naming_grammar(factory):
    for bad in ("start: foo\nfoo: bar", "%%%", '{"grammars": [{"json_schema": {"type": "nonsense"}}]}'):
        with pytest.raises(InvalidRequestError) as e:
            factory.compile(bad)
        assert e.value.param == "grammar" and str(e.value).startswith("grammar:"), str(e.value)
    for bad in ("", "  ", 12, None):
        with pytest.raises(InvalidRequestError) as e:
            factory.compile(bad)
        assert e.value.param == "grammar"
    # the request check refuses a grammar that is not a string before anything compiles it
    for bad in (12, "", ["start: x"]):
        with pytest.raises(InvalidRequestError) as e:
            check_request(GenerationRequest(prompt_ids=[1, 2], max_tokens=4, grammar=bad), vocab_size=VOCAB,
                          max_context=100)
        assert e.value.param == "grammar"
    ok = check_request(GenerationRequest(prompt_ids=[1, 2], max_tokens=4, grammar="start: \"x\""), vocab_size=VOCAB,
                       max_context=100)
    assert ok.grammar == 'start: "x"'
    assert GenerationRequest(prompt_ids=[1], max_tokens=1).grammar is None


def test_one_llguidance_tokenizer_per_factory(tok):
    f = ConstraintFactory(tok, vocab=VOCAB + 64)   # logits wider than the tokenizer: the mask covers them
    assert f.ll_tokenizer is f.ll_tokenizer
    c = f.compile(lark_grammar())
    assert isinstance(c, Constraint) and c.vocab == VOCAB + 64
    mask = c.mask()
    assert mask.shape == (VOCAB + 64,) and not mask[VOCAB:].any()
    assert c.seconds >= 0 and c.matcher is not None


def test_masked_rows_keep_the_allowed_logits_bit_for_bit(factory, tok):
    """``masked`` and ``masked_argmax`` read the logits in numpy: the allowed entries are the
    very float32 values ``logits.float()`` gives, for each dtype a model's head returns
    (infinities, NaN and -0.0 included), and the argmax is torch's masked one."""
    c = factory.compile(json_grammar())
    c.consume(_ids(tok, '{"name": "Al'))   # inside a string: nearly every token allowed
    mask = c.mask()
    assert mask.sum() > VOCAB // 2
    x = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 50
    allowed = mask.nonzero().flatten()
    x[allowed[:4]] = torch.tensor([float("inf"), float("-inf"), -0.0, 3e38])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        logits = x.to(dtype)
        m = c.masked(logits)
        assert torch.equal(m[mask].view(torch.int32), logits.float()[mask].view(torch.int32)), dtype
        assert c.masked_argmax(logits) == int(logits.masked_fill(~mask, float("-inf")).argmax()), dtype
        if dtype != torch.float32:
            assert logits.dtype == dtype   # the caller's row is left as it was
    nan = x.clone()
    nan[allowed[10]] = float("nan")
    assert c.masked_argmax(nan) == int(nan.masked_fill(~mask, float("-inf")).argmax())
