"""The contract every drafter keeps (the ``Drafter`` protocol), checked on every registered
drafter (a drafter registered later is tested here automatically) and on the combinators.

Valid trees within the budget, the start/extend/stop lifecycle, drafts that continue the
committed sequence, and tenant isolation (nothing of tenant A's ever reaches tenant B's drafts).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.config import DRAFTERS, RouteRule
from agentspec.drafting import (EMPTY_DRAFT, BatchDrafter, Draft, Drafter, FallbackDrafter, HiddenStateDrafter,
                                MergedDrafter, build_drafter, propose_all, wants_hidden_states)
from agentspec.drafting.registry import DEFAULT_DRAFTERS, drafter_names, parse_drafters, registered
from agentspec.errors import ConfigError
from agentspec.api.routing import Router
from suffix_index import SuffixIndex

VOCAB = 50_000
BUDGETS = (1, 2, 8, 32, 200)
# registered drafters that never draft from the prompt (only from generated text); every other
# drafter must propose the continuation of a repetitive prompt
PROMPT_BLIND = {"lookahead"}


def _index() -> SuffixIndex:
    return SuffixIndex(vocab_size=VOCAB)


def _cases() -> list[tuple[str, Callable[[], Drafter], bool]]:
    """(id, factory of a fresh drafter, sees the prompt)."""
    cases: list[tuple[str, Callable[[], Drafter], bool]] = []
    # draft heads read the target's hidden states: their contract runs on the real engine
    # (tests/integration/test_eagle3_engine.py, test_eagle3_routes.py)
    for e in registered():
        if e.needs_engine:
            continue
        cases.append((e.name, lambda e=e: e.make(index=_index()), e.name not in PROMPT_BLIND))

    def reg(name: str) -> Drafter:
        return [e for e in registered() if e.name == name][0].make(index=_index())

    cases += [
        ("merged:suffix+lookahead", lambda: MergedDrafter(reg("suffix"), reg("lookahead")), True),
        ("fallback:lookahead>prompt_lookup", lambda: FallbackDrafter(reg("lookahead"), reg("prompt_lookup")), True),
        ("fallback-merge:suffix>lookahead", lambda: FallbackDrafter(reg("suffix"), reg("lookahead"), mode="merge"),
         True),
        ("fallback-min:prompt_lookup>suffix",
         lambda: FallbackDrafter(reg("prompt_lookup"), reg("suffix"), min_expected=3.0), True),
        ("build:suffix>lookahead", lambda: build_drafter(["suffix>lookahead"], index=_index()), True),
        ("build:prompt_lookup,lookahead", lambda: build_drafter(["prompt_lookup", "lookahead"]), True),
    ]
    return cases


CASES = _cases()
IDS = [c[0] for c in CASES]


@pytest.fixture(params=CASES, ids=IDS)
def case(request):
    name, make, sees_prompt = request.param
    return name, make(), sees_prompt


def _pattern(seed: int, n: int = 12, lo: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return rng.sample(range(lo, lo + 5000), n)   # distinct tokens: the continuation is unambiguous


def _paths(d: Draft) -> list[list[int]]:
    out: list[list[int]] = []
    for i, p in enumerate(d.parents):
        out.append((out[p] if p >= 0 else []) + [d.token_ids[i]])
    return out


def _assert_continues(d: Draft, expected: list[int]) -> None:
    for path in _paths(d):
        assert path == expected[:len(path)], f"draft path {path} does not continue {expected[:len(path)]}"


def test_registry_is_the_one_list():
    names = drafter_names()
    assert set(names) >= {"suffix", "lookahead", "prompt_lookup"}
    assert DRAFTERS == names
    # a route that names no drafters leaves the backend's default (the embedded engine's DEFAULT_DRAFTERS)
    assert DEFAULT_DRAFTERS == ("suffix", "json_copy") and Router().resolve(endpoint="completions", tenant="t", model="m",
                                                                 temperature=0.0).drafters is None
    for e in registered():
        assert e.description and "\n" not in e.description
        if e.needs_engine:   # a draft head: refused without the engine whose states it reads
            with pytest.raises(ValueError, match="engine"):
                build_drafter([e.name], index=_index())
            continue
        assert isinstance(e.make(index=_index()), Drafter)


def test_build_drafter_shapes():
    idx = _index()
    assert type(build_drafter(["suffix"], index=idx)).__name__ == "SuffixDrafter"
    assert build_drafter("suffix", index=idx).index is idx
    # "lookahead" alone is the lookahead drafter alone
    assert type(build_drafter(["lookahead"])).__name__ == "LookaheadDrafter"
    m = build_drafter(["suffix", "lookahead"], index=idx)
    assert isinstance(m, MergedDrafter) and [type(d).__name__ for d in m.drafters] == ["SuffixDrafter",
                                                                                        "LookaheadDrafter"]
    f = build_drafter(["suffix>lookahead>prompt_lookup"], index=idx)
    assert isinstance(f, FallbackDrafter) and isinstance(f.fallback, FallbackDrafter)
    assert type(f.primary).__name__ == "SuffixDrafter" and type(f.fallback.fallback).__name__ == "PromptLookupDrafter"
    assert parse_drafters(["suffix > lookahead", "prompt_lookup"]) == (("suffix", "lookahead"), ("prompt_lookup",))


@pytest.mark.parametrize("names, match", [
    (["eagle9"], "eagle9"), (["suffix>eagle9"], "eagle9"), (["suffix>"], "empty"), ([], "empty"),
    (["suffix", "suffix>lookahead"], "more than once"),
])
def test_bad_drafter_names(names, match):
    with pytest.raises(ValueError, match=match):
        build_drafter(names)
    if names:
        with pytest.raises(ConfigError, match=match):
            RouteRule(name="r", drafters=names)


def test_unknown_drafter_error_lists_known_names():
    with pytest.raises(ConfigError, match=r"unknown drafter 'nope'.*known:.*suffix.*lookahead.*prompt_lookup"):
        RouteRule(name="r", drafters=["nope"])
    RouteRule(name="ok", drafters=["suffix>lookahead", "prompt_lookup"])


# ---- the contract, on every drafter -----------------------------------------------------------

def test_trees_within_budget(case):
    name, d, _ = case
    pat = _pattern(1)
    d.start("r", pat * 4, tenant="t")
    d.extend("r", pat * 2)
    for budget in BUDGETS:
        draft = d.propose("r", budget)
        draft.validate(budget)
        assert len(draft) <= budget and draft.score >= 0
    assert len(d.propose("r", 0)) == 0
    d.stop("r")


def test_lifecycle(case):
    name, d, _ = case
    pat = _pattern(2)
    d.start("r", pat, tenant="t")
    with pytest.raises(ValueError):
        d.start("r", pat, tenant="t")        # already started
    rng = random.Random(0)
    d.extend("r", [rng.randrange(VOCAB) for _ in range(5000)])   # extend with many tokens
    d.extend("r", [])
    d.propose("r", 16).validate(16)
    d.stop("r")
    with pytest.raises(ValueError, match="unknown request"):
        d.propose("r", 8)                    # refused after stop
    d.start("r", pat * 3, tenant="t")        # the same id again
    d.extend("r", pat)
    d.propose("r", 8).validate(8)
    d.stop("r")
    # several requests at once
    for k in range(4):
        d.start(f"q{k}", _pattern(10 + k) * 3, tenant=f"t{k % 2}")
    for k in range(4):
        d.extend(f"q{k}", _pattern(10 + k))
        d.propose(f"q{k}", 8).validate(8)
    for k in range(4):
        d.stop(f"q{k}")


def test_drafts_continue_generated_repetition(case):
    name, d, _ = case
    pat = _pattern(3)
    d.start("r", [7, 8, 9], tenant="t")
    d.extend("r", pat * 3 + pat[:4])
    draft = d.propose("r", 8)
    assert len(draft) > 0, f"{name} proposes nothing on a repeated output"
    _assert_continues(draft, pat[4:] + pat)


def test_drafts_continue_repetitive_prompt(case):
    name, d, sees_prompt = case
    pat = _pattern(4)
    d.start("r", pat * 4 + pat[:3], tenant="t")
    draft = d.propose("r", 16)
    draft.validate(16)
    _assert_continues(draft, pat[3:] + pat)
    if sees_prompt:
        assert len(draft) > 0, f"{name} does not draft from the prompt"
        assert draft.token_ids[0] == pat[3]


def test_tenant_isolation(case):
    name, d, _ = case
    secret = _pattern(5, n=40, lo=20_000)       # tenant A's distinctive prompt and output
    out = _pattern(6, n=40, lo=30_000)
    d.start("a", secret, tenant="A")
    d.extend("a", out)
    d.stop("a")
    # B's prompt ends where, in A's sequence, `out[4:]` follows
    probe = [1, 2, 3] + secret[-8:] + out[:4]
    d.start("b", probe, tenant="B")
    leaked = set(out[4:])
    for budget in BUDGETS:
        draft = d.propose("b", budget)
        assert not leaked & set(draft.token_ids), f"{name}: tenant A's output reached tenant B's draft"
    d.extend("b", out[4:5])   # even once B's own context lines up with A's sequence
    draft = d.propose("b", 32)
    assert not set(out[5:]) & set(draft.token_ids), f"{name}: tenant A's output reached tenant B's draft"
    d.stop("b")


def test_tenant_history_is_kept_within_the_tenant():
    """The isolation test has teeth: the same probe under tenant A does draft A's output."""
    d = build_drafter(["suffix"], index=_index())
    secret, out = _pattern(5, n=40, lo=20_000), _pattern(6, n=40, lo=30_000)
    d.start("a", secret, tenant="A")
    d.extend("a", out)
    d.stop("a")
    d.start("a2", [1, 2, 3] + secret[-8:] + out[:4], tenant="A")
    assert d.propose("a2", 8).token_ids[:1] == [out[4]]


@pytest.mark.parametrize("name, make", [(c[0], c[1]) for c in CASES], ids=IDS)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_random_sequences(name, make, data):
    d = make()
    alphabet = data.draw(st.integers(2, 40))
    tok = st.integers(0, alphabet - 1)
    prompt = data.draw(st.lists(tok, max_size=60))
    req = "h"
    d.start(req, prompt, tenant=data.draw(st.sampled_from(["x", "y"])))
    for _ in range(data.draw(st.integers(1, 6))):
        d.extend(req, data.draw(st.lists(tok, max_size=20)))
        budget = data.draw(st.sampled_from((0,) + BUDGETS))
        draft = d.propose(req, budget)
        draft.validate(budget)
        assert all(0 <= t < alphabet for t in draft.token_ids)
        assert all(0.0 <= p <= 1.0 + 1e-9 for p in draft.probs)
    d.stop(req)


# ---- Draft helpers ------------------------------------------------------------------------------

def _tree() -> Draft:
    # root -> 0 (0.9) -> 1 (0.5) -> 3 (0.5); root -> 2 (0.4)
    return Draft([10, 11, 12, 13], [-1, 0, -1, 1], [0.9, 0.5, 0.4, 0.5], 0.0, "t")


def test_survival_and_prefix():
    d = _tree()
    assert d.survival() == pytest.approx([0.9, 0.45, 0.4, 0.225])
    assert d.expected() == pytest.approx(1.975)
    assert d.prefix(10) is d and d.prefix(4) is d
    assert d.prefix(0) is EMPTY_DRAFT
    p = d.prefix(2)
    p.validate(2)
    assert p.token_ids == [10, 11] and p.score == pytest.approx(1.35) and p.source == "t"
    assert Draft.chain([1, 2, 3], 0.5).survival() == pytest.approx([0.5, 0.25, 0.125])


@given(st.lists(st.tuples(st.integers(0, 5), st.floats(0.0, 1.0)), max_size=30), st.integers(0, 35))
def test_prefix_is_a_tree_with_consistent_score(nodes, k):
    parents = [(-1 if i == 0 else (r % (i + 1)) - 1) for i, (r, _) in enumerate(nodes)]
    d = Draft(list(range(len(nodes))), parents, [p for _, p in nodes], 0.0, "h")
    p = d.prefix(k)
    p.validate(max(k, 0))
    assert p.survival() == d.survival()[:len(p)]
    if 0 < k < len(d):
        assert p.score == pytest.approx(sum(d.survival()[:k]))


# ---- combinators ------------------------------------------------------------------------------

class _Fixed:
    """A drafter that proposes a fixed draft (for the combinators)."""

    def __init__(self, draft: Draft) -> None:
        self.draft, self.reqs, self.calls = draft, set(), 0

    def start(self, req_id, prompt, *, tenant="default"):
        if req_id in self.reqs:
            raise ValueError(f"request {req_id!r} already started")
        self.reqs.add(req_id)

    def extend(self, req_id, tokens):
        if req_id not in self.reqs:
            raise ValueError(f"unknown request id {req_id!r}")

    def propose(self, req_id, budget):
        if req_id not in self.reqs:
            raise ValueError(f"unknown request id {req_id!r}")
        self.calls += 1
        return self.draft.prefix(budget)

    def stop(self, req_id):
        self.reqs.discard(req_id)


def test_fallback_switch_and_merge():
    weak = Draft.chain([1, 2, 3], 0.3, source="weak")
    strong = Draft.chain([5, 6, 7, 8], 0.9, source="strong")
    for primary, fallback, want in ((weak, strong, "strong"), (strong, weak, "strong"), (EMPTY_DRAFT, weak, "weak"),
                                    (weak, EMPTY_DRAFT, "weak")):
        f = FallbackDrafter(_Fixed(primary), _Fixed(fallback))
        f.start("r", [1])
        assert f.propose("r", 8).source == want
    # unnamed sources say which side they came from
    f = FallbackDrafter(_Fixed(Draft.chain([1], 0.1)), _Fixed(Draft.chain([2], 0.9)))
    f.start("r", [1])
    assert f.propose("r", 8).source == "fallback"
    # min_expected: the fallback is asked only when the primary is below it
    fb = _Fixed(strong)
    f = FallbackDrafter(_Fixed(Draft.chain([1, 2], 1.0, source="p")), fb, min_expected=1.5)
    f.start("r", [1])
    assert f.propose("r", 8).source == "p" and fb.calls == 0
    f = FallbackDrafter(_Fixed(Draft.chain([1, 2], 1.0, source="p")), fb, min_expected=3.0)
    f.start("r2", [1])
    assert f.propose("r2", 8).source == "strong" and fb.calls == 1
    # merge: siblings under the root, within the budget
    f = FallbackDrafter(_Fixed(weak), _Fixed(strong), mode="merge")
    f.start("r", [1])
    m = f.propose("r", 5)
    m.validate(5)
    assert m.source == "weak+strong" and set(m.token_ids) & {1} and set(m.token_ids) & {5}
    assert m.token_ids[0] == 5   # best first
    with pytest.raises(ValueError, match="mode"):
        FallbackDrafter(_Fixed(weak), _Fixed(strong), mode="both")


def test_fallback_lifecycle_reaches_both():
    a, b = _Fixed(EMPTY_DRAFT), _Fixed(EMPTY_DRAFT)
    f = FallbackDrafter(a, b)
    f.start("r", [1, 2])
    assert a.reqs == b.reqs == {"r"}
    f.extend("r", [3])
    f.stop("r")
    assert not a.reqs and not b.reqs
    b.reqs.add("x")   # the fallback refuses: the primary's start is undone
    with pytest.raises(ValueError):
        f.start("x", [1])
    assert "x" not in a.reqs


# ---- optional capabilities --------------------------------------------------------------------

class _Batch(_Fixed):
    hidden_layers = (2, 15, 28)

    def __init__(self, draft):
        super().__init__(draft)
        self.batches, self.seen = 0, []

    def propose_batch(self, req_ids, budgets):
        self.batches += 1
        return [self.propose(r, b) for r, b in zip(req_ids, budgets)]

    def observe_hidden(self, req_id, tokens, hidden):
        self.seen.append((req_id, list(tokens), sorted(hidden)))


def test_optional_protocols_and_propose_all():
    chain = Draft.chain([4, 5, 6], 0.8, source="x")
    plain, batch = _Fixed(chain), _Batch(chain)
    assert not isinstance(plain, BatchDrafter) and not isinstance(plain, HiddenStateDrafter)
    assert isinstance(batch, BatchDrafter) and isinstance(batch, HiddenStateDrafter)
    assert wants_hidden_states(plain) == () and wants_hidden_states(batch) == (2, 15, 28)
    for d in (plain, batch):
        d.start("a", [1])
        d.start("b", [1])
        drafts = propose_all(d, ["a", "b"], [2, 0])
        assert [len(x) for x in drafts] == [2, 0]
    assert batch.batches == 1 and plain.calls == 2
    assert propose_all(plain, [], []) == []
    with pytest.raises(ValueError, match="differ in length"):
        propose_all(plain, ["a"], [1, 2])
    batch.observe_hidden("a", [7], {2: None, 15: None, 28: None})
    assert batch.seen == [("a", [7], [2, 15, 28])]
    # the built-in drafters work through propose_all too
    for e in registered():
        if e.needs_engine:
            continue
        d = e.make(index=_index())
        d.start("r", _pattern(8) * 3)
        assert len(propose_all(d, ["r"], [4])) == 1
