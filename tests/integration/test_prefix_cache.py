"""The prefix cache is exact: an agent loop's turns give the same tokens with cache hits as
without the cache (greedy and seeded sampled; single requests and batches; speculation on and
off), whatever eviction did; tenants do not share entries unless told to.

Multi-turn prompts: the first turns of an agent trajectory from the shipped agent turns
(``benchmarks/data/agent_turns.jsonl``: a scripted shell agent over this repository's files, in the
recorded traffic's format), each turn's prompt extending the last.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import agentspec
from agentspec.backends.embedded.batch import BatchEngine
from agentspec.backends.embedded.prefix_cache import CHUNK_TOKENS, PrefixCache
from agentspec.errors import ConfigError
from agentspec.traces import conversation_turns, load_records, prompt_messages

pytestmark = pytest.mark.slow

AGENT_TURNS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "agent_turns.jsonl"
MAX_TOKENS = 16
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 7}


@pytest.fixture(scope="module")
def turns(engine) -> list[list[int]]:
    """The first trajectory's first three turns (of about 690, 910 and 1180 tokens: the first
    holds more than two cache chunks, what the tenant test shares)."""
    rec = next(load_records(AGENT_TURNS))
    prompts = [engine.encode(m) for m in conversation_turns(prompt_messages(rec["prompt"]))[:3]]
    assert len(prompts) == 3 and len(prompts[0]) > 2 * CHUNK_TOKENS
    assert all(len(a) < len(b) and b[:len(a) - 8] == a[:len(a) - 8] for a, b in zip(prompts, prompts[1:]))
    return prompts


@pytest.fixture(scope="module")
def reference(engine, turns):
    """Outputs without the cache: greedy for every turn, seeded sampled for the last."""
    engine.configure_prefix_cache(0)
    greedy = [engine.generate(ids, max_tokens=MAX_TOKENS, spec=None).token_ids for ids in turns]
    sampled = engine.generate(turns[-1], max_tokens=MAX_TOKENS, spec=None, **SAMPLED).token_ids
    yield greedy, sampled
    engine.configure_prefix_cache()


def _fresh(engine, **kw) -> PrefixCache:
    engine.configure_prefix_cache(**kw)
    return engine.prefix_cache


def test_single_requests_with_hits_equal_no_cache(engine, turns, reference):
    greedy, sampled = reference
    pc = _fresh(engine)
    gens = [engine.generate(ids, max_tokens=MAX_TOKENS, spec=None) for ids in turns]
    assert [g.token_ids for g in gens] == greedy
    assert gens[0].stats.cached_tokens == 0
    for prev, ids, g in zip(turns, turns[1:], gens[1:]):   # a later turn reuses the last one's whole chunks
        assert g.stats.cached_tokens == (len(prev) // CHUNK_TOKENS) * CHUNK_TOKENS > 0
    assert pc.stats.hits == 2 and pc.stats.cached_tokens == sum(g.stats.cached_tokens for g in gens)
    # warm cache, speculation on: every turn hits, same tokens
    gens = [engine.generate(ids, max_tokens=MAX_TOKENS) for ids in turns]
    assert [g.token_ids for g in gens] == greedy
    assert all(g.stats.cached_tokens == ((len(ids) - 1) // CHUNK_TOKENS) * CHUNK_TOKENS
               for ids, g in zip(turns, gens))
    assert gens[0].stats.spec_enabled
    # seeded sampling: the same tokens with a hit
    g = engine.generate(turns[-1], max_tokens=MAX_TOKENS, **SAMPLED)
    assert g.token_ids == sampled and g.stats.cached_tokens > 0


def test_batches_with_hits_equal_no_cache(engine, turns, reference):
    greedy, sampled = reference
    _fresh(engine)
    with BatchEngine(engine, background=False) as batch:
        # cold: the turns join in order, each prefill leaving its chunks for the next
        gens = batch.generate_many(turns, max_tokens=MAX_TOKENS, spec=None)
        assert [g.token_ids for g in gens] == greedy
        assert gens[0].stats.cached_tokens == 0 and all(g.stats.cached_tokens > 0 for g in gens[1:])
        # warm, speculating, a sampled request alongside
        gens = batch.generate_many([*turns, turns[-1]], max_tokens=MAX_TOKENS,
                                   per_prompt=[{}, {}, {}, SAMPLED])
        assert [g.token_ids for g in gens] == [*greedy, sampled]
        assert all(g.stats.cached_tokens > 0 for g in gens)


def test_eviction_under_a_tiny_budget_never_changes_output(engine, turns, reference):
    greedy, _ = reference
    chunk = engine.prefix_cache_chunk_bytes()
    # 4 chunks (below the start-up minimum, which only ConfigError guards): two tenants evict each other
    engine.prefix_cache = pc = PrefixCache(4 * chunk)
    for tenant in ("x", "y"):
        gens = [engine.generate(ids, max_tokens=MAX_TOKENS, spec=None, tenant=tenant) for ids in turns[:2]]
        assert [g.token_ids for g in gens] == greedy[:2]
        assert pc.bytes <= pc.capacity_bytes
    assert pc.stats.evicted_chunks > 0 and pc.stats.hits > 0


def test_tenants_do_not_share_entries_unless_shared(engine, turns):
    ids = turns[0][:2 * CHUNK_TOKENS + 1]
    _fresh(engine)
    a = engine.generate(ids, max_tokens=MAX_TOKENS, spec=None, tenant="a")
    b = engine.generate(ids, max_tokens=MAX_TOKENS, spec=None, tenant="b")
    again = engine.generate(ids, max_tokens=MAX_TOKENS, spec=None, tenant="a")
    assert (a.stats.cached_tokens, b.stats.cached_tokens) == (0, 0) and again.stats.cached_tokens > 0
    _fresh(engine, shared=True)
    a = engine.generate(ids, max_tokens=MAX_TOKENS, spec=None, tenant="a")
    b = engine.generate(ids, max_tokens=MAX_TOKENS, spec=None, tenant="b")
    assert b.stats.cached_tokens == 2 * CHUNK_TOKENS and b.token_ids == a.token_ids


def test_budget_smaller_than_one_request_refuses_to_start(engine):
    need = (engine.max_context // CHUNK_TOKENS) * engine.prefix_cache_chunk_bytes()
    with pytest.raises(ConfigError, match="smaller than one request"):
        agentspec.Engine.embedded(quiet=True, max_context=1024, prefix_cache_bytes=1000)
    with pytest.raises(ConfigError, match="prefix_cache_bytes"):
        engine.configure_prefix_cache(need - 1)
    engine.configure_prefix_cache(need)
    assert engine.prefix_cache.capacity_bytes == need
    engine.configure_prefix_cache(0)
    assert engine.prefix_cache is None
    engine.configure_prefix_cache()   # the default: sized to the machine
    assert engine.prefix_cache is not None and engine.prefix_cache.capacity_bytes <= 4 << 30
