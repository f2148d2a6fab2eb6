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


# ---- reuse to the token: a quantized model, whose prefill is split-invariant ---------------------

@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A random K-quant Qwen2 GGUF (head_dim 128, as the Qwen2.5 coders; its projections kept
    quantized): the prefill path the real GGUF files take (quantized linears, the blockwise
    prompt attention), split-invariant, so the prefix cache reuses any prefix."""
    from helpers.families import write_family, write_quantized_pair

    root = tmp_path_factory.mktemp("quantized-prefix")
    folder = write_family(root / "qwen2", "qwen2", dim=256, heads=2, kv_heads=1, hidden=512)
    path = write_quantized_pair(folder, root / "qwen2.gguf", {"ffn_down.weight": "Q6_K"})
    eng = agentspec.Engine.embedded(model=str(path), quiet=True, weights="quantized")
    assert eng.model.prefill_split_invariant(eng.new_cache(8))
    return eng


def _isa_levels():
    from agentspec.kernels import cpu_isa

    return [isa for isa in cpu_isa.supported() if isa != "scalar"] or ["scalar"]


@pytest.mark.parametrize("isa_level", _isa_levels())
def test_quantized_prefill_gives_the_same_bits_however_the_prompt_is_split(quantized, isa_level, restore_isa):
    """Every KV row and the last row's logits, bit for bit, for a prompt prefilled in canonical
    chunks and in pieces that start and end anywhere (inside a block, a single token): the premise
    of reusing a prefix to the token, on every kernel ISA level."""
    import torch

    cpu_isa = restore_isa
    if cpu_isa.ISA_LEVELS.index(isa_level) > cpu_isa.ISA_LEVELS.index(cpu_isa.active()):
        pytest.skip(f"kernels capped at {cpu_isa.active()}")
    cpu_isa.set_isa(isa_level)
    eng = quantized
    g = torch.Generator().manual_seed(3)
    n = 700
    ids = torch.randint(10, eng.vocab_size - 10, (n,), generator=g)

    def prefill(bounds):
        cache = eng.new_cache(n + 8)
        with torch.inference_mode():
            for a, b in zip(bounds, bounds[1:]):
                logits = eng.model(ids[a:b], torch.arange(a, b), cache, logits_rows=slice(-1, None), prefill=True)
                cache.commit(list(range(b - a)))
        return logits, cache

    ref_logits, ref = prefill([0, 256, 512, n])
    for bounds in ([0, n], [0, 1, 2, 300, 301, n], [0, 100, 256, 290, 600, 699, n], [0, 511, 513, n]):
        logits, cache = prefill(bounds)
        assert torch.equal(logits, ref_logits), bounds
        assert torch.equal(cache.k[:, :, :n], ref.k[:, :, :n]) and torch.equal(cache.v[:, :, :n], ref.v[:, :, :n])


def test_quantized_turns_reuse_the_whole_previous_prompt_and_equal_no_cache(quantized):
    """An agent loop on the quantized model: each turn reuses all of the last turn's prompt (not
    only its whole chunks), greedy and seeded sampled outputs equal to the uncached ones, with
    speculation on and off; a prompt that leaves an earlier one inside a chunk reuses up to there."""
    eng = quantized
    rec = next(load_records(AGENT_TURNS))
    turns = [eng.encode(m) for m in conversation_turns(prompt_messages(rec["prompt"]))[:3]]
    eng.configure_prefix_cache(0)
    greedy = [eng.generate(ids, max_tokens=MAX_TOKENS, spec=None).token_ids for ids in turns]
    sampled = eng.generate(turns[-1], max_tokens=MAX_TOKENS, spec=None, **SAMPLED).token_ids
    cut = turns[1][:len(turns[0]) + 37]   # leaves turn 2's prompt in the middle of a chunk
    cut_ref = eng.generate(cut, max_tokens=MAX_TOKENS, spec=None).token_ids
    eng.configure_prefix_cache()
    gens = [eng.generate(ids, max_tokens=MAX_TOKENS, spec=None) for ids in turns]
    assert [g.token_ids for g in gens] == greedy
    common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(turns, turns[1:])]
    assert [g.stats.cached_tokens for g in gens] == [0, *common]
    assert any(c % CHUNK_TOKENS for c in common)   # past the last whole chunk: to the token
    gens = [eng.generate(ids, max_tokens=MAX_TOKENS) for ids in turns]   # warm, speculating
    assert [g.token_ids for g in gens] == greedy
    assert all(g.stats.cached_tokens == len(ids) - 1 for ids, g in zip(turns, gens))
    g = eng.generate(turns[-1], max_tokens=MAX_TOKENS, **SAMPLED)
    assert g.token_ids == sampled and g.stats.cached_tokens == len(turns[-1]) - 1
    g = eng.generate(cut, max_tokens=MAX_TOKENS, spec=None)
    assert g.token_ids == cut_ref and g.stats.cached_tokens == len(cut) - 1
    with BatchEngine(eng, background=False) as batch:
        gens = batch.generate_many([*turns, cut], max_tokens=MAX_TOKENS)
    assert [g.token_ids for g in gens] == [*greedy, cut_ref]
