"""The hybrid (``--speculative-algorithm AGENTSPEC_EAGLE3``) in real SGLang on this CPU: SGLang's
EAGLE-3 worker with this repo's head, whose steps verify the suffix index's draft where it expects
more than the head's.

Two engines in all: SGLang without speculation (greedy references and sampled outputs for the
distribution test; it shuts down first), then one hybrid engine shared by every test (verify width
8: the head's chain of 7, or up to 7 suffix nodes). float32 (see test_agentspec_engine.py).
"""

from __future__ import annotations

import secrets
import warnings
from collections import Counter

import pytest

from helpers.sglang import require_sglang

require_sglang()   # before anything that imports SGLang

from agentspec.integrations.sglang.config import (  # noqa: E402
    HYBRID_ALGORITHM,
    SOURCE_KEY,
    cache_salt,
    read_source_records,
    request_params,
)
from helpers.sglang import MODEL, ROOT, engine_kwargs, real_prompts  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

HEAD = ROOT / "agentspec" / "heads" / "smollm2-135m-instruct-eagle3"
D = 8
MAX_TOKENS = 40
HYBRID = dict(speculative_algorithm=HYBRID_ALGORITHM, speculative_draft_model_path=str(HEAD),
              speculative_num_steps=D - 1, speculative_eagle_topk=1, speculative_num_draft_tokens=D)
SAMPLES = 60          # sampled requests per engine for the distribution test
SAMPLE_TOKENS = 4


def gen(engine, ids, *, max_tokens=MAX_TOKENS, temperature=0.0, seed=None, salt=None, **policy):
    sp = {"temperature": temperature, "max_new_tokens": max_tokens}
    if seed is not None:
        sp["sampling_seed"] = seed
    if policy:
        sp["custom_params"] = request_params(**policy)
    kw = {} if salt is None else {"cache_salt": salt}
    r = engine.generate(input_ids=list(ids), sampling_params=sp, **kw)
    return list(r["output_ids"]), r["meta_info"]


def start(**spec):
    import sglang

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sglang.Engine(**engine_kwargs(**spec))


@pytest.fixture(scope="module")
def prompts():
    if not (MODEL / "config.json").is_file():
        pytest.fail(f"no converted model at {MODEL}: run scripts/setup_sglang.sh")
    if not (HEAD / "config.json").is_file():
        pytest.fail(f"no EAGLE-3 head at {HEAD}")
    groups = real_prompts()
    return {"rewrites": groups["rewrites"][:3], "agent": groups["agent"][:3]}


@pytest.fixture(scope="module")
def reference(prompts):
    """SGLang without speculation: greedy outputs, and sampled outputs of one agent prompt."""
    eng = start()
    try:
        greedy = {wl: [gen(eng, p)[0] for p in ps] for wl, ps in prompts.items()}
        p = prompts["agent"][0]
        sampled = [gen(eng, p, max_tokens=SAMPLE_TOKENS, temperature=1.0, seed=1000 + s)[0] for s in range(SAMPLES)]
        return {"greedy": greedy, "sampled": sampled}
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def hybrid(reference):
    eng = start(**HYBRID)
    yield eng
    eng.shutdown()


def sources(meta) -> dict[str, list[int]]:
    return read_source_records(meta.get(SOURCE_KEY))


def test_greedy_output_identical_and_counts_add_up(prompts, reference, hybrid):
    """Every output equals SGLang's without speculation; per step and request the drafted and
    accepted tokens by source add up to SGLang's own totals; both drafters are used."""
    totals: Counter = Counter()
    accept = {}
    for wl, ps in prompts.items():
        for i, p in enumerate(ps):
            out, meta = gen(hybrid, p, tenant=f"exact-{wl}-{i}")
            assert out == reference["greedy"][wl][i], f"{wl}[{i}] differs from SGLang without speculation"
            by = sources(meta)
            assert sum(v[2] for v in by.values()) == meta["spec_num_correct_drafts"], (wl, i, by, meta)
            values = meta[SOURCE_KEY]
            assert len(values) >= len(out), (len(values), len(out))
            steps = sum(1 for v in values[:len(out) + 1] if v)
            assert steps <= meta["spec_verify_ct"], (steps, meta["spec_verify_ct"])
            for src, (s, d, a) in by.items():
                assert 0 <= a <= d and s <= meta["spec_verify_ct"], (src, s, d, a)
                totals[(src, "accepted")] += a
            accept.setdefault(wl, []).append(meta["spec_accept_length"])
    assert totals[("suffix", "accepted")] > 0 and totals[("eagle3", "accepted")] > 0, totals
    rewrites = accept["rewrites"]
    assert sum(rewrites) / len(rewrites) > 2.0, accept


def test_request_drafters_choose_the_source(prompts, reference, hybrid):
    p, want = prompts["agent"][1], reference["greedy"]["agent"][1]
    only_head, m_head = gen(hybrid, p, tenant="only-head", drafters=["eagle3"])
    only_suffix, m_suffix = gen(hybrid, p, tenant="only-suffix", drafters=["suffix"])
    merged, m_merged = gen(hybrid, p, tenant="merged", drafters=["suffix", "eagle3"])
    assert only_head == only_suffix == merged == want
    assert set(sources(m_head)) <= {"eagle3"} and sources(m_head), m_head
    assert set(sources(m_suffix)) <= {"suffix"}, m_suffix
    assert sum(v[2] for v in sources(m_merged).values()) == m_merged["spec_num_correct_drafts"]


def test_speculation_off_drafts_nothing(prompts, reference, hybrid):
    p = prompts["rewrites"][0]
    out, meta = gen(hybrid, p, tenant="off", spec=False)
    assert out == reference["greedy"]["rewrites"][0]
    assert sources(meta) == {}, meta.get(SOURCE_KEY)
    assert meta.get("spec_num_correct_drafts", 0) == 0, meta
    _, on = gen(hybrid, p, tenant="on")
    assert on["spec_num_correct_drafts"] > 0, on


def test_sampled_request_follows_the_target_distribution(prompts, reference, hybrid):
    """Two-sample chi-square on the tokens at positions 2 and 3 (the first ones a verify step
    produces) against SGLang without speculation, same seeds. A greedy verify would put every
    sample on the argmax."""
    from scipy.stats import chi2_contingency

    p = prompts["agent"][0]
    ours = [gen(hybrid, p, max_tokens=SAMPLE_TOKENS, temperature=1.0, seed=1000 + s, tenant="sampled")[0]
            for s in range(SAMPLES)]
    theirs = reference["sampled"]
    for pos in (1, 2):
        a = Counter(o[pos] for o in ours if len(o) > pos)
        b = Counter(o[pos] for o in theirs if len(o) > pos)
        common = [t for t in set(a) | set(b) if a[t] + b[t] >= 5]
        rest_a = sum(n for t, n in a.items() if t not in common)
        rest_b = sum(n for t, n in b.items() if t not in common)
        table = [[a[t] for t in common] + [rest_a], [b[t] for t in common] + [rest_b]]
        table = [list(col) for col in zip(*[c for c in zip(*table) if sum(c) > 0])]
        if len(table[0]) < 2:
            assert a == b or not common, (pos, a, b)
            continue
        _, pvalue, _, _ = chi2_contingency(table)
        assert pvalue > 1e-3, (pos, a, b, pvalue)
    # not all greedy: the target's distribution at those positions has more than one token
    assert len({tuple(o) for o in ours}) > 1


def test_tenant_isolation_with_a_canary(hybrid):
    """Tenant A's prompt carries a canary; with the tenants' cache salts (what ``agentspec serve``
    sends) tenant B asking the same gets no prefix-cache hit and no drafts from A's output, while A
    asking again hits both."""
    from agentspec.backends.embedded.engine import EmbeddedEngine

    canary = f"CANARY-{secrets.token_hex(6)}"
    tok = EmbeddedEngine(quiet=True)
    ids = tok.encode([{"role": "user", "content": f"Write a short Python function named check that returns the "
                       f"string {canary!r}, with a docstring."}])
    first, _ = gen(hybrid, ids, max_tokens=48, tenant="alice", salt=cache_salt("alice"))
    again, a = gen(hybrid, ids, max_tokens=48, tenant="alice", salt=cache_salt("alice"))
    other, b = gen(hybrid, ids, max_tokens=48, tenant="bob", salt=cache_salt("bob"))
    assert first == again == other
    assert a["cached_tokens"] >= len(ids) - 8, a          # A's own prefix is cached
    assert b["cached_tokens"] == 0, b                       # B never hits A's cached prompt
    by_a, by_b = sources(a), sources(b)
    acc_a = by_a.get("suffix", [0, 0, 0])[2]
    acc_b = by_b.get("suffix", [0, 0, 0])[2]
    assert acc_a >= len(again) // 2, by_a                  # A drafts its own earlier output
    assert acc_b < acc_a - 10, (by_a, by_b)                 # B has only its own prompt to draft from


def test_records_carry_by_source_and_stats_show_them(prompts, hybrid):
    """The front's reading of a real hybrid response (``SGLangBackend``'s) gives the acceptance
    record the embedded backend writes: ``by_source`` steps / drafted / accepted, and
    ``agentspec stats`` lists them."""
    from agentspec.decode.results import GenerationStats
    from agentspec.integrations.sglang.backend import SGLangBackend
    from agentspec.telemetry import record_from_stats
    from agentspec.telemetry.report import format_table, summarize

    out, meta = gen(hybrid, prompts["rewrites"][1], tenant="records")
    stats = GenerationStats(prompt_tokens=len(prompts["rewrites"][1]), completion_tokens=len(out), spec_enabled=True)
    stats.accepted_tokens = meta["spec_num_correct_drafts"]
    SGLangBackend._read_sources(stats, meta)
    rec = record_from_stats(stats, request_id="r1", tenant="records")
    assert set(rec.by_source) <= {"suffix", "eagle3"} and rec.by_source, rec.by_source
    assert sum(v[2] for v in rec.by_source.values()) == rec.accepted_tokens
    assert sum(v[1] for v in rec.by_source.values()) == rec.draft_tokens
    text = format_table(summarize([rec]))
    for src in rec.by_source:
        assert src in text, text
