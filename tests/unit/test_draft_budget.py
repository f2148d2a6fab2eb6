"""How much of a draft gets verified: cost cut, survival floor, per-request calibration."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentspec import SpecConfig
from agentspec.drafting.draft import AcceptanceTracker, Draft, cut_for_cost, drop_unlikely
from agentspec.errors import ConfigError


@st.composite
def drafts(draw):
    n = draw(st.integers(0, 24))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    probs = [draw(st.floats(0.0, 1.0)) for _ in range(n)]
    return Draft([draw(st.integers(0, 50)) for _ in range(n)], parents, probs, 0.0, "t")


def survivals(d: Draft) -> list[float]:
    s: list[float] = []
    for p, q in zip(d.parents, d.probs):
        s.append(q * (s[p] if p >= 0 else 1.0))
    return s


@given(drafts(), st.floats(0.0, 1.0), st.floats(0.1, 3.0))
def test_cut_for_cost_keeps_the_best_prefix(d, row_cost, trust):
    cut = cut_for_cost(d, row_cost, trust)
    cut.validate(len(d))
    k = len(cut)
    assert cut.token_ids == d.token_ids[:k] and cut.parents == d.parents[:k]
    if row_cost <= 0:
        assert k == len(d)
        return
    surv = survivals(d)

    def value(j):
        return (1.0 + trust * sum(surv[:j])) / (1.0 + row_cost * max(j - 1, 0))

    best = max(value(j) for j in range(len(d) + 1))
    assert value(k) == pytest.approx(best, rel=1e-12)
    if k < len(d):   # a cut draft's score is recomputed; an uncut one is returned as is
        assert cut.score == pytest.approx(sum(surv[:k]))


@given(drafts(), st.floats(0.0, 1.0))
def test_drop_unlikely_keeps_exactly_the_likely_subtree(d, floor):
    out = drop_unlikely(d, floor)
    out.validate(len(d))
    surv = survivals(d)
    kept: set[int] = set()
    for i, p in enumerate(d.parents):
        if (floor <= 0 or surv[i] >= floor) and (p < 0 or p in kept):
            kept.add(i)
    assert out.token_ids == [d.token_ids[i] for i in sorted(kept)]
    assert out.probs == [d.probs[i] for i in sorted(kept)]


def test_tracker_trust_follows_what_came_true():
    t = AcceptanceTracker()
    assert t.trust == 1.0
    for _ in range(30):
        t.update(2.0, 10)      # the drafter was timid: everything it drafted was accepted
    assert t.trust > 4.0
    for _ in range(60):
        t.update(5.0, 0)       # now nothing comes true
    assert t.trust < 0.05


def test_spec_config_row_cost_is_validated():
    assert SpecConfig().row_cost is None and SpecConfig(row_cost=0.0).row_cost == 0.0
    for bad in (-0.1, 11.0, "0.1", True):
        with pytest.raises(ConfigError, match="row_cost"):
            SpecConfig(row_cost=bad)
