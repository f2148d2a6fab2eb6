"""The native suffix index against its plain-Python reference, and its public contract."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentspec.drafting import Draft, SuffixDrafter, default_drafter
from suffix_index import MAX_TOKEN_ID, Proposal, SuffixIndex
from suffix_index.reference import ReferenceIndex

# ------------------------------------------------------------------------------------------------
# property test: native == reference on random streams with edits, documents, history, eviction

ALPHABET = st.integers(0, 5)     # a small alphabet: many repeats, long and short matches


@st.composite
def scenarios(draw):
    params = dict(
        min_ngram=draw(st.integers(1, 2)),
        max_ngram=draw(st.integers(2, 4)),
        max_candidates=draw(st.integers(1, 6)),
        min_candidates=draw(st.integers(1, 4)),
        max_agreement=draw(st.integers(2, 10)),
        max_branches=draw(st.integers(1, 5)),
        min_draft=draw(st.integers(1, 6)),
        min_survival=draw(st.sampled_from([0.0, 0.01, 0.2])),
        arena_weight=draw(st.sampled_from([1.0, 0.5])),
        history_tokens=draw(st.integers(0, 40)),
    )
    ops = []
    live: list[str] = []
    serial = 0
    for _ in range(draw(st.integers(5, 40))):
        kind = draw(st.sampled_from(["start", "extend", "copy", "propose", "candidates", "stop", "doc", "rmdoc"]))
        if kind == "start" or not live and kind in ("extend", "copy", "propose", "candidates", "stop"):
            serial += 1
            rid = f"r{serial}"
            live.append(rid)
            ops.append(("start", rid, draw(st.lists(ALPHABET, max_size=30)), draw(st.sampled_from(["a", "b"]))))
        elif kind == "extend":
            ops.append(("extend", draw(st.sampled_from(live)), draw(st.lists(ALPHABET, min_size=1, max_size=6))))
        elif kind == "copy":
            # a rewrite: copy a stretch of the prompt, with an edit somewhere
            ops.append(("copy", draw(st.sampled_from(live)), draw(st.integers(0, 30)), draw(st.integers(1, 12)),
                        draw(st.lists(ALPHABET, max_size=3))))
        elif kind in ("propose", "candidates"):
            ops.append((kind, draw(st.sampled_from(live)), draw(st.integers(0, 12))))
        elif kind == "stop":
            rid = draw(st.sampled_from(live))
            live.remove(rid)
            ops.append(("stop", rid))
        elif kind == "doc":
            ops.append(("doc", f"d{draw(st.integers(0, 3))}", draw(st.lists(ALPHABET, max_size=25)),
                        draw(st.sampled_from(["a", "b"]))))
        else:
            ops.append(("rmdoc", f"d{draw(st.integers(0, 3))}"))
    return params, ops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_native_core_agrees_with_reference(scenario):
    params, ops = scenario
    native = SuffixIndex(**params)
    ref = ReferenceIndex(**params)
    prompts: dict[str, list[int]] = {}
    for op in ops:
        kind = op[0]
        if kind == "start":
            _, rid, prompt, tenant = op
            native.start(rid, prompt, tenant=tenant)
            ref.start(rid, prompt, tenant)
            prompts[rid] = prompt
        elif kind in ("extend", "copy"):
            rid = op[1]
            if kind == "extend":
                toks = op[2]
            else:
                _, _, at, n, edit = op
                src = prompts[rid] or [0]
                at %= len(src)
                toks = src[at:at + n] + edit + src[at + n:at + 2 * n]
            native.extend(rid, np.asarray(toks, dtype=np.int32))
            ref.extend(rid, toks)
        elif kind == "propose":
            _, rid, budget = op
            d = native.propose(rid, budget)
            assert tuple(d) == ref.propose(rid, budget)    # the same plain tuple as the reference
            Draft(*d, "suffix").validate(budget)
        elif kind == "candidates":
            rid = op[1]
            assert native.candidates(rid) == ref.candidates(rid)
        elif kind == "stop":
            native.stop(op[1])
            ref.stop(op[1])
        elif kind == "doc":
            _, doc, toks, tenant = op
            native.add_document(doc, toks, tenant=tenant)
            ref.add_document(doc, toks, tenant)
        else:
            assert native.remove_document(op[1]) == ref.remove_document(op[1])
    for name, t in ref.tenants.items():
        assert native.history_tokens(name) == t.history


# ------------------------------------------------------------------------------------------------
# behaviour


def test_defaults_copy_a_rewrite_and_resync_after_an_edit():
    ix = SuffixIndex()
    old = list(range(100, 160))
    ix.start("r", old + [7, 8, 9])
    ix.extend("r", old[:10])
    d = ix.propose("r", 32)
    assert d.token_ids[:16] == old[10:26]          # copies the file it is rewriting
    assert isinstance(d, Proposal) and d.score > 0
    # an edit: new tokens, then the old text again from line 30 on
    ix.extend("r", [5, 6] + old[30:32])
    d = ix.propose("r", 8)
    assert d.token_ids[:6] == old[32:38]           # re-synchronised right after the edit
    ix.stop("r")


def test_history_feeds_later_requests_of_the_same_tenant_only():
    canary = [901, 902, 903, 904, 905, 906, 907, 908]
    ix = SuffixIndex()
    ix.start("first", [1, 2, 3], tenant="alice")
    ix.extend("first", [50, 51] + canary)
    ix.stop("first")
    assert ix.history_tokens("alice") == 10
    ix.start("alice2", [9, 9, 50, 51], tenant="alice")
    assert ix.propose("alice2", 8).token_ids[:8] == canary
    ix.start("bob", [9, 9, 50, 51], tenant="bob")
    assert not set(ix.propose("bob", 32).token_ids) & set(canary)


def test_documents_are_tenant_scoped_replaced_and_removed():
    canary = [701, 702, 703, 704, 705]
    ix = SuffixIndex()
    ix.add_document("a.py", [10, 11, 12] + canary, tenant="alice")
    ix.start("a", [10, 11, 12], tenant="alice")
    ix.start("b", [10, 11, 12], tenant="bob")
    assert ix.propose("a", 5).token_ids == canary
    assert not set(ix.propose("b", 32).token_ids) & set(canary)
    ix.add_document("a.py", [10, 11, 12, 1, 2, 3], tenant="alice")      # replaced
    assert ix.propose("a", 3).token_ids == [1, 2, 3]
    assert ix.remove_document("a.py") is True
    assert ix.remove_document("a.py") is False
    assert ix.propose("a", 3).token_ids == []


def test_eviction_under_a_budget_never_breaks_an_active_request():
    ix = SuffixIndex(history_tokens=50)
    prompt = list(range(1000, 1040))
    ix.start("active", prompt, tenant="t")
    ix.extend("active", prompt[:5])
    for k in range(30):   # other requests finish and push the tenant's history over its budget
        ix.start(f"o{k}", [1, 2], tenant="t")
        ix.extend(f"o{k}", list(range(2000 + 20 * k, 2020 + 20 * k)))
        ix.stop(f"o{k}")
        assert ix.history_tokens("t") <= 50
        pos = 5 + k
        assert ix.propose("active", 4).token_ids == prompt[pos:pos + 4]
        ix.extend("active", [prompt[pos]])
    # the newest outputs survive, the oldest are gone
    ix.start("late", [2000 + 20 * 29, 2001 + 20 * 29], tenant="t")
    assert ix.propose("late", 3).token_ids == [2002 + 20 * 29, 2003 + 20 * 29, 2004 + 20 * 29]
    ix.start("early", [2000, 2001], tenant="t")
    assert ix.propose("early", 3).token_ids == []


def test_memory_is_bounded_per_indexed_token():
    rng = np.random.default_rng(0)
    ix = SuffixIndex()
    for k in range(20):
        ix.add_document(f"d{k}", rng.integers(0, 49152, 10_000), tenant="t")
    per_token = ix.nbytes / 200_000
    assert per_token <= 64, per_token


def test_save_load_round_trip(tmp_path):
    ix = SuffixIndex()
    ix.add_document("doc", list(range(300, 340)), tenant="a")
    ix.start("r", [1, 2, 3], tenant="a")
    ix.extend("r", [4, 5, 6, 7, 8, 9])
    ix.stop("r")
    path = tmp_path / "index.snap"
    ix.save(path)
    again = SuffixIndex()
    again.load(path)
    for index in (ix, again):
        index.start("q", [300, 301, 302], tenant="a")
        index.start("h", [4, 5], tenant="a")
    assert ix.propose("q", 10) == again.propose("q", 10) and again.propose("q", 10).token_ids == list(range(303, 311))
    assert ix.propose("h", 4) == again.propose("h", 4) and again.propose("h", 4).token_ids == [6, 7, 8, 9]
    assert again.history_tokens("a") == 6


def test_failed_save_leaves_the_old_snapshot_loadable(tmp_path, monkeypatch):
    ix = SuffixIndex()
    ix.add_document("doc", [1, 2, 3, 4], tenant="a")
    path = tmp_path / "index.snap"
    ix.save(path)
    ix.add_document("doc2", [5, 6, 7, 8], tenant="a")

    def crash(*args, **kwargs):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        ix.save(path)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["index.snap"]      # no temp file left behind
    again = SuffixIndex()
    again.load(path)
    again.start("q", [1, 2], tenant="a")
    assert again.propose("q", 2).token_ids == [3, 4]
    again.start("q2", [5, 6], tenant="a")
    assert again.propose("q2", 2).token_ids == []                      # doc2 was never saved


def test_damaged_snapshot_is_refused_and_changes_nothing(tmp_path):
    ix = SuffixIndex()
    ix.add_document("doc", [1, 2, 3, 4], tenant="a")
    path = tmp_path / "index.snap"
    ix.save(path)
    data = path.read_bytes()
    (tmp_path / "short").write_bytes(data[:-3])
    (tmp_path / "junk").write_bytes(b"not a snapshot at all")
    other = SuffixIndex()
    other.add_document("keep", [9, 8, 7], tenant="a")
    for bad in ("short", "junk"):
        with pytest.raises(ValueError, match=bad):
            other.load(tmp_path / bad)
    other.start("q", [9, 8], tenant="a")
    assert other.propose("q", 1).token_ids == [7]


# ------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "tokens, match",
    [
        (np.array([1.0, 2.0]), "integer dtype"),
        (np.array([True, False]), "integer dtype"),
        ([1, -3], "token id -3"),
        ([1, 2**31], f"token id {2**31}"),
        (np.array([1, 2**40], dtype=np.int64), f"token id {2**40}"),
        ([1, 2**70], "out of range"),
        ([1, 2.5], "2.5"),
        ("abc", "str"),
        (np.zeros((2, 2), dtype=np.int32), "one-dimensional"),
    ],
)
def test_bad_tokens_raise_value_error_naming_the_value(tokens, match):
    ix = SuffixIndex()
    with pytest.raises(ValueError, match=match):
        ix.start("r", tokens)
    ix.start("r", [1, 2, 3])
    with pytest.raises(ValueError, match=match):
        ix.extend("r", tokens)
    with pytest.raises(ValueError, match=match):
        ix.add_document("d", tokens)


def test_bad_calls_raise_value_error():
    ix = SuffixIndex(vocab_size=100)
    with pytest.raises(ValueError, match="token id 100"):
        ix.start("r", [1, 100])
    ix.start("r", np.array([1, 2, 3], dtype=np.uint16))
    with pytest.raises(ValueError, match="'r' already started"):
        ix.start("r", [1])
    for call in (lambda: ix.extend("nope", [1]), lambda: ix.propose("nope", 4), lambda: ix.stop("nope")):
        with pytest.raises(ValueError, match="unknown request id 'nope'"):
            call()
    with pytest.raises(ValueError, match="budget must be an integer >= 0, got -1"):
        ix.propose("r", -1)
    assert ix.propose("r", 0) == Proposal([], [], [], 0.0)
    with pytest.raises(ValueError, match="max_ngram"):
        SuffixIndex(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="max_candidates"):
        SuffixIndex(max_candidates=-1)
    with pytest.raises(ValueError, match="doc_id"):
        ix.add_document("", [1])
    assert MAX_TOKEN_ID == 2**31 - 1


def test_default_drafter_is_the_suffix_drafter():
    d = default_drafter()
    assert isinstance(d, SuffixDrafter)
    d.start("r", [5, 6, 7, 5, 6])
    d.extend("r", [7])
    draft = d.propose("r", 2)
    assert isinstance(draft, Draft) and draft.source == "suffix" and draft.token_ids[:2] == [5, 6]
    assert tuple(d.index.propose("r", 2)) == (draft.token_ids, draft.parents, draft.probs, draft.score)
    d.stop("r")

    class Workspace:
        index = SuffixIndex()

    ws = Workspace()
    ws.index.add_document("f", [1, 2, 3, 4])
    d = default_drafter(workspace=ws)
    assert d.index is ws.index
    d.start("r", [1, 2])
    assert d.propose("r", 2).token_ids == [3, 4]
    with pytest.raises(ValueError, match="workspace must have an `index`"):
        default_drafter(workspace=object())


def test_lookahead_pool_and_merged_drafter():
    from agentspec.drafting import LookaheadDrafter, MergedDrafter

    la = LookaheadDrafter(key=2, gram=4)
    la.start("r", [1, 2, 3])
    la.extend("r", [10, 11, 12, 13, 14, 15, 16, 10, 11])   # generated: "10 11" seen before
    assert la.propose("r", 4).token_ids == [12, 13, 14, 15]
    la.stop("r")
    la.start("s", [7, 10, 11], tenant="default")          # the tenant's outputs feed later requests
    assert la.propose("s", 2).token_ids == [12, 13]
    la.start("other", [7, 10, 11], tenant="elsewhere")
    assert la.propose("other", 4).token_ids == []

    m = MergedDrafter(SuffixDrafter(), LookaheadDrafter(key=1, gram=3))
    m.start("r", [5, 6, 7, 8, 5])
    m.extend("r", [9, 9, 9, 5])   # suffix: 5 -> 6 7 8 ...; lookahead: 5 was followed by 9 9 9
    d = m.propose("r", 8)
    d.validate(8)
    roots = {t for t, p in zip(d.token_ids, d.parents) if p == -1}
    assert roots == {6, 9}
    m.stop("r")
