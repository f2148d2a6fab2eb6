"""Statistics by draft source: a merged draft's nodes keep the source of the drafter that proposed
them, through every cut the engine makes, and drafted / accepted tokens are counted by that source
from the decode step to the acceptance log and ``agentspec stats``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import pytest

from agentspec.cli import main
from agentspec.drafting import (
    EMPTY_DRAFT,
    AcceptanceTracker,
    Draft,
    FallbackDrafter,
    MergedDrafter,
    cut_for_cost,
    drop_unlikely,
)
from agentspec.drafting.combine import merge_drafts
from agentspec.decode.results import GenerationStats
from agentspec.decode.step import Decoder
from agentspec.decode.policy import DraftPolicy, main_chain
from agentspec.telemetry import (
    AcceptanceRecord,
    TenantLogSink,
    format_table,
    read_records,
    record_from_stats,
    summarize,
)


def _sources(d: Draft) -> list[str]:
    return [d.source_of(i) for i in range(len(d))]


# ---- drafts ----------------------------------------------------------------------------------


def test_a_draft_without_node_sources_names_its_source_everywhere():
    d = Draft.chain([1, 2, 3], 0.9, source="suffix:request")
    assert d.node_sources is None and _sources(d) == ["suffix:request"] * 3
    with pytest.raises(ValueError, match="node sources"):
        Draft([1, 2], [-1, 0], [0.9, 0.9], 0.0, "x", ["a"]).validate(8)


def test_merge_credits_each_node_to_the_draft_that_gave_its_best_survival():
    a = Draft.chain([1, 2, 3], [0.9, 0.5, 0.9], source="suffix:request")
    b = Draft.chain([1, 2, 7], [0.6, 0.9, 0.9], source="eagle3")   # 1: a's (0.9); 1-2: b's (0.54 > 0.45)
    c = Draft.chain([4], 0.3, source="prompt_lookup")
    m = merge_drafts([a, b, c], 8, source="merged")
    m.validate(8)
    assert m.source == "merged" and len(m.node_sources) == len(m)
    got = {(m.token_ids[i], m.parents[i] >= 0 and m.token_ids[m.parents[i]]): m.source_of(i) for i in range(len(m))}
    assert got == {(1, False): "suffix:request", (2, 1): "eagle3", (3, 2): "suffix:request", (7, 2): "eagle3",
                   (4, False): "prompt_lookup"}
    # ties go to the earlier draft
    same = Draft.chain([1, 2], 0.8, source="second")
    assert set(_sources(merge_drafts([Draft.chain([1, 2], 0.8, source="first"), same], 8))) == {"first"}
    assert set(_sources(merge_drafts([same, Draft.chain([1, 2], 0.8, source="first")], 8))) == {"second"}
    # a draft that is itself merged keeps its nodes' sources in a further merge
    again = merge_drafts([m, Draft.chain([9], 0.1, source="lookahead")], 8)
    assert sorted(_sources(again)) == sorted([*_sources(m), "lookahead"])
    # one draft through the merge: itself, with its own sources
    assert merge_drafts([EMPTY_DRAFT, a], 2) == a.prefix(2) and _sources(merge_drafts([a], 8)) == _sources(a)
    assert merge_drafts([m], 8).node_sources == m.node_sources


def test_fallback_merge_names_each_side():
    class Fixed:
        def __init__(self, draft):
            self.draft = draft

        def start(self, req_id, prompt, *, tenant="default"):
            pass

        def extend(self, req_id, tokens):
            pass

        def propose(self, req_id, budget):
            return self.draft.prefix(budget)

        def stop(self, req_id):
            pass

    p, f = Draft.chain([1, 2], 0.4), Draft.chain([5, 6], 0.9, source="eagle3")
    d = FallbackDrafter(Fixed(p), Fixed(f), mode="merge").propose("r", 8)
    assert d.source == "primary+eagle3"
    assert {(t, d.source_of(i)) for i, t in enumerate(d.token_ids)} == {
        (1, "primary"), (2, "primary"), (5, "eagle3"), (6, "eagle3")}
    m = MergedDrafter(Fixed(Draft.chain([1], 0.9, source="a")), Fixed(Draft.chain([2], 0.8, source="b")))
    assert _sources(m.propose("r", 8)) == ["a", "b"]


def test_cuts_keep_each_nodes_source():
    # a's chain 1-2-3 (likely); b's chain 5-6 and its child 4 of node 1 (tokens unique: a token names its node)
    a = Draft.chain([1, 2, 3], 0.9, source="a")
    b = Draft([5, 1, 6, 4], [-1, -1, 0, 1], [0.5, 0.1, 0.5, 1.0], 0.0, "b")
    m = merge_drafts([a, b], 8)
    want = {1: "a", 2: "a", 3: "a", 5: "b", 6: "b", 4: "b"}
    assert {t: m.source_of(i) for i, t in enumerate(m.token_ids)} == want

    def keeps(d: Draft) -> Draft:
        d.validate(len(m))
        assert [d.source_of(i) for i in range(len(d))] == [want[t] for t in d.token_ids]
        return d

    for k in range(len(m) + 1):
        keeps(m.prefix(k))
    assert keeps(drop_unlikely(m, 0.3)).token_ids == [1, 2, 3, 5]
    assert 1 < len(keeps(cut_for_cost(m, 0.3))) < len(m)
    chain = keeps(main_chain(m))
    assert chain.token_ids == [1, 2, 3] and chain.parents == [-1, 0, 1]
    assert chain.score == pytest.approx(Draft.chain([1, 2, 3], 0.9).score)
    for policy in (DraftPolicy(budget=8, min_prob=0.3, row_cost=0.2), DraftPolicy(budget=8, chain_only=True)):
        keeps(policy.shape(m))
    # a single-source draft stays free of node sources through every cut
    plain = Draft.chain([1, 2, 3], 0.5, source="s")
    for d in (plain.prefix(2), drop_unlikely(plain, 0.2), cut_for_cost(plain, 0.5), main_chain(plain)):
        assert d.node_sources is None and d.source == "s"


# ---- the decode step's counts -------------------------------------------------------------------


def _seq() -> SimpleNamespace:
    return SimpleNamespace(stats=GenerationStats(prompt_tokens=1), tracker=AcceptanceTracker())


def test_count_by_node_source():
    m = merge_drafts([Draft.chain([1, 2], 0.9, source="suffix:request"), Draft.chain([5, 6, 7], 0.5, source="eagle3"),
                      Draft.chain([1, 9], [0.1, 0.9], source="")], 8, source="suffix:request+eagle3")
    # rows: 0 the root, 1 + i the node i; accept 1 then 2 (suffix), then nothing, then 5 (eagle3)
    rows = {t: i + 1 for i, t in enumerate(m.token_ids)}
    seq = _seq()
    Decoder._count(seq, m, [0] * (len(m) + 1), [0, rows[1], rows[2]])
    Decoder._count(seq, m, [0] * (len(m) + 1), [0])
    Decoder._count(seq, m, [0] * (len(m) + 1), [0, rows[5]])
    Decoder._count(seq, EMPTY_DRAFT, [0], [0])
    Decoder._count(seq, Draft.chain([3, 4], 0.9, source="prompt_lookup"), [0, 1, 2], [0, 1])
    s = seq.stats
    assert s.steps == 5 and s.draft_tokens == 3 * 6 + 2 and s.accepted_tokens == 4
    assert s.draft_sources == {"suffix:request+eagle3": 3, "prompt_lookup": 1}
    assert s.source_steps == {"suffix:request": 3, "eagle3": 3, "unknown": 3, "prompt_lookup": 1}
    assert s.source_drafted == {"suffix:request": 6, "eagle3": 9, "unknown": 3, "prompt_lookup": 2}
    assert s.source_accepted == {"suffix:request": 2, "eagle3": 1, "unknown": 0, "prompt_lookup": 1}
    assert sum(s.source_drafted.values()) == s.draft_tokens and sum(s.source_accepted.values()) == s.accepted_tokens


# ---- the log and agentspec stats ---------------------------------------------------------------


def _stats(**by_source: tuple[int, int, int]) -> GenerationStats:
    return GenerationStats(
        prompt_tokens=10, completion_tokens=20, spec_enabled=True, steps=6,
        draft_tokens=sum(d for _, d, _ in by_source.values()), accepted_tokens=sum(a for _, _, a in by_source.values()),
        acceptance_lengths=[3] * 6, draft_depths=[4] * 6, draft_sources={"+".join(by_source): 6},
        source_steps={k: v[0] for k, v in by_source.items()}, source_drafted={k: v[1] for k, v in by_source.items()},
        source_accepted={k: v[2] for k, v in by_source.items()}, seconds=0.5)


def test_record_carries_counts_by_source_and_old_records_load():
    rec = record_from_stats(_stats(suffix=(6, 20, 10), eagle3=(5, 10, 2)), request_id="r1", tenant="acme")
    assert rec.by_source == {"suffix": [6, 20, 10], "eagle3": [5, 10, 2]}
    assert msgspec.json.decode(msgspec.json.encode(rec), type=AcceptanceRecord) == rec
    # a record written before by_source existed
    old = {k: v for k, v in msgspec.to_builtins(rec).items() if k != "by_source"}
    back = msgspec.json.decode(json.dumps(old), type=AcceptanceRecord)
    assert back.by_source == {} and back.draft_tokens == 30


def test_summarize_by_source():
    recs = [record_from_stats(_stats(suffix=(6, 20, 10), eagle3=(5, 10, 2)), request_id="r1", tenant="acme"),
            record_from_stats(_stats(suffix=(6, 30, 20)), request_id="r2", tenant="acme", route="apply")]
    # older records: one draft source is credited with everything, several with nothing
    old = msgspec.structs.replace(recs[1], request_id="r3", by_source={})
    recs.append(old)
    recs.append(msgspec.structs.replace(old, request_id="r4", draft_sources={"suffix": 3, "eagle3": 3}))
    s = summarize(recs)
    acme = s["tenants"][0]
    assert acme["by_source"] == [
        {"source": "suffix", "steps": 18, "draft_tokens": 80, "accepted_tokens": 50, "acceptance_rate": 50 / 80},
        {"source": "eagle3", "steps": 5, "draft_tokens": 10, "accepted_tokens": 2, "acceptance_rate": 0.2}]
    assert [r["route"] for r in s["routes"]] == ["apply", "default"]
    assert [x["source"] for x in s["routes"][1]["by_source"]] == ["suffix", "eagle3"]
    assert s["by_route"][0]["by_source"][0]["draft_tokens"] == 60
    assert summarize([msgspec.structs.replace(old, draft_sources={})])["tenants"][0]["by_source"] == []
    text = format_table(s).splitlines()
    at = text.index("")
    assert text[at + 1].split() == ["tenant", "route", "source", "steps", "drafted", "accepted", "accept"]
    assert ["acme", "*", "eagle3", "5", "10", "2", "20.0%"] in [x.split() for x in text[at + 2:]]
    assert "" not in format_table(summarize([recs[-1]])).splitlines()   # no per-source data: no second table


def test_stats_cli_shows_sources(tmp_path, capsys):
    sink = TenantLogSink(tmp_path / "logs", background=False)
    sink.write(record_from_stats(_stats(**{"suffix:request": (6, 20, 10), "eagle3": (5, 10, 2)}),
                                 request_id="r1", tenant="acme"))
    old = msgspec.to_builtins(record_from_stats(_stats(prompt_lookup=(6, 8, 4)), request_id="r0", tenant="beta"))
    del old["by_source"]
    with open(sink.path("beta"), "ab") as f:
        f.write(json.dumps(old).encode() + b"\n")
    assert {r.tenant: r.by_source for r in read_records(tmp_path / "logs")}["beta"] == {}
    args = ["stats", "--log-dir", str(tmp_path / "logs")]
    assert main(args) == 0
    lines = [x.split() for x in capsys.readouterr().out.splitlines()]
    assert ["tenant", "route", "source", "steps", "drafted", "accepted", "accept"] in lines
    assert ["acme", "default", "suffix:request", "6", "20", "10", "50.0%"] in lines
    assert ["acme", "default", "eagle3", "5", "10", "2", "20.0%"] in lines
    assert ["beta", "default", "prompt_lookup", "6", "8", "4", "50.0%"] in lines
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    acme, beta = data["tenants"]
    assert [(x["source"], x["draft_tokens"], x["accepted_tokens"]) for x in acme["by_source"]] == [
        ("suffix:request", 20, 10), ("eagle3", 10, 2)]
    assert beta["by_source"] == [{"source": "prompt_lookup", "steps": 6, "draft_tokens": 8, "accepted_tokens": 4,
                                  "acceptance_rate": 0.5}]
