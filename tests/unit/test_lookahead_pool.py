"""The lookahead drafter's per-tenant n-gram pool keeps to its ``tenant_tokens`` budget: the
keys added to least recently are forgotten first, and the pool stays usable."""

from __future__ import annotations

import pytest

from agentspec.drafting import LookaheadDrafter


def _pool_tokens(la: LookaheadDrafter, tenant: str) -> int:
    pool = la._tenant_pools[tenant]
    held = sum(len(g) for q in pool.grams.values() for g in q)
    assert getattr(pool, "tokens", held) == held   # the running count is the real one
    return held


def _run(la: LookaheadDrafter, rid: str, tokens: list[int], tenant: str = "t") -> None:
    la.start(rid, [0, 0], tenant=tenant)
    la.extend(rid, tokens)
    la.stop(rid)


def test_tenant_pool_holds_at_most_tenant_tokens():
    la = LookaheadDrafter(key=2, gram=4, tenant_tokens=40)
    for r in range(20):   # 20 requests of distinct outputs: far more n-grams than 40 tokens hold
        _run(la, f"r{r}", [1000 * (r + 1) + i for i in range(30)])
        assert _pool_tokens(la, "t") <= 40
    assert _pool_tokens(la, "t") > 40 - 4   # full, less one continuation at most
    # the newest output drafts; the oldest is forgotten
    la.start("new", [20018, 20019], tenant="t")   # among the last request's 10 most recent keys
    assert la.propose("new", 4).token_ids == [20020, 20021, 20022, 20023]
    la.stop("new")
    la.start("old", [1005, 1006], tenant="t")
    assert la.propose("old", 4).token_ids == []
    la.stop("old")


def test_tenant_budget_is_per_tenant_and_reuse_refreshes_a_key():
    la = LookaheadDrafter(key=1, gram=2, per_key=2, tenant_tokens=6)
    _run(la, "a", [1, 2, 3, 4, 5], tenant="x")            # keys 1..3 (continuations of 2 tokens): 6 tokens
    _run(la, "b", [7, 8, 9, 7, 8, 9, 7, 8], tenant="y")   # another tenant's pool: its own budget
    assert _pool_tokens(la, "x") == 6 and _pool_tokens(la, "y") <= 6
    _run(la, "c", [0, 1, 2, 3], tenant="x")               # key 1 again (the same gram), then key 0...
    assert _pool_tokens(la, "x") <= 6
    keys = list(la._tenant_pools["x"].grams)
    assert (1,) in keys and (3,) not in keys              # the refreshed key stays, the oldest went
    # a continuation replaced in a full deque (per_key) is no longer counted
    la2 = LookaheadDrafter(key=1, gram=1, per_key=2, tenant_tokens=100)
    _run(la2, "a", [5, 1, 5, 2, 5, 3, 5, 4])
    assert _pool_tokens(la2, "t") == len(la2._tenant_pools["t"].grams[(5,)]) + sum(
        len(q) for k, q in la2._tenant_pools["t"].grams.items() if k != (5,))


def test_defaults_and_bad_budgets():
    la = LookaheadDrafter()
    _run(la, "a", list(range(100, 400)))
    assert 0 < _pool_tokens(la, "t") <= la.tenant_tokens == 1 << 16
    for bad in ({"tenant_tokens": 0}, {"max_keys": 0}):
        with pytest.raises(ValueError, match="tenant_tokens and max_keys"):
            LookaheadDrafter(**bad)
