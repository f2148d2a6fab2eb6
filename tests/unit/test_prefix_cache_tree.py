"""The prefix cache's radix tree and LRU eviction (agentspec.backends.embedded.prefix_cache), against a plain
reference; and the premise of its exactness argument: prefill matmuls do not depend on the
thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.backends.embedded.model import prefill_attention, prefill_attention_sdpa
from agentspec.backends.embedded.prefix_cache import PrefixCache

C = 4  # chunk tokens in these tests


def _payload(ids, tag="x"):
    return lambda j: ((tag, tuple(ids[:(j + 1) * C])), 10)


def test_lookup_matches_the_longest_cached_chunk_prefix():
    pc = PrefixCache(1000, chunk_tokens=C)
    ids = list(range(13))                      # 3 whole chunks and one token
    assert pc.insert("t", ids, 3, _payload(ids)) == 3
    assert len(pc) == 3 and pc.bytes == 30
    hit = pc.lookup("t", ids)
    assert hit.tokens == 12 and [p[1] for p in hit.payloads] == [tuple(ids[:4]), tuple(ids[:8]), tuple(ids[:12])]
    pc.release(hit)
    # a prompt that diverges inside chunk 2 reuses chunks 0-1
    other = ids[:9] + [99, 98, 97, 96]
    hit = pc.lookup("t", other)
    assert hit.tokens == 8
    pc.release(hit)
    # max_chunks caps the hit (the engine keeps the last token to prefill)
    hit = pc.lookup("t", ids[:12], max_chunks=(12 - 1) // C)
    assert hit.tokens == 8
    pc.release(hit)
    assert pc.stats.inserted_chunks == 3
    # inserting again adds nothing and never asks for a payload
    assert pc.insert("t", ids, 3, lambda j: pytest.fail("asked for a cached chunk")) == 0


def _tail_payload(ids, tag="x"):
    return lambda j: ((tag, tuple(ids[:min((j + 1) * C, len(ids))])), 10)


def test_to_the_token_a_prompt_keeps_its_partial_chunk_and_a_lookup_reads_into_chunks():
    pc = PrefixCache(1000, chunk_tokens=C)
    first = list(range(10))                      # 2 whole chunks and 2 tokens
    assert pc.insert("t", first, 2, _tail_payload(first), tail=True) == 3
    # the next turn extends the prompt: the whole earlier prompt is served, the partial chunk in part
    nxt = first + [50, 51, 52, 53, 54]
    hit = pc.lookup("t", nxt, max_tokens=len(nxt) - 1)
    assert (hit.tokens, hit.tail) == (10, 2) and hit.payloads[-1][1] == tuple(first)
    pc.release(hit)
    # a whole chunk serves any prefix of itself; the hit stops where the ids leave it, and at max_tokens
    assert pc.insert("t", nxt, 3, _tail_payload(nxt), tail=True) == 2   # chunk 2 whole, then a 3-token tail
    # ... and the partial leaf that chunk 2 now holds is gone
    assert sorted(len(k) for k in pc._roots["t"].children[(0, 1, 2, 3)].children[(4, 5, 6, 7)].children) == [4]
    hit = pc.lookup("t", first + [50, 99], max_tokens=100)
    assert (hit.tokens, hit.tail) == (11, 3)
    pc.release(hit)
    hit = pc.lookup("t", nxt, max_tokens=9)
    assert (hit.tokens, hit.tail) == (9, 1)
    pc.release(hit)
    # whole chunks only without max_tokens (a prefill that is not split-invariant)
    assert _hit(pc, "t", first + [50, 99]) == 8
    # a partial chunk another child already starts with adds nothing
    assert pc.insert("t", nxt[:9], 2, lambda j: pytest.fail("asked for a held partial chunk"), tail=True) == 0
    assert all(nd.pins == 0 for nd in pc._lru.values())


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "lookup"]), st.sampled_from(["a", "b"]),
                              st.lists(st.integers(0, 2), min_size=1, max_size=14)), max_size=30),
       budget=st.integers(10, 80))
def test_to_the_token_against_a_reference(ops, budget):
    """With partial chunks: a hit's payloads are prefixes of what was inserted for that tenant,
    the last one read only as far as the ids agree; the budget holds; nothing stays pinned."""
    pc = PrefixCache(budget, chunk_tokens=C)
    inserted: set[tuple[str, tuple[int, ...]]] = set()
    for op, tenant, ids in ops:
        if op == "insert":
            pc.insert(tenant, ids, len(ids) // C, _tail_payload(ids), tail=True)
            inserted |= {(tenant, tuple(ids[:min((j + 1) * C, len(ids))])) for j in range(-(-len(ids) // C))}
        else:
            hit = pc.lookup(tenant, ids, max_tokens=len(ids) - 1)
            for j, (_, p) in enumerate(hit.payloads):
                assert (tenant, p) in inserted
                last = j == len(hit.payloads) - 1 and hit.tail
                n = j * C + hit.tail if last else len(p)
                assert list(p[:n]) == ids[:n]
            assert hit.tokens <= max(len(ids) - 1, 0)
            pc.release(hit)
        assert pc.bytes == 10 * len(pc) <= budget
    assert all(nd.pins == 0 for nd in pc._lru.values())


def test_tenants_are_isolated_unless_shared():
    ids = list(range(8))
    pc = PrefixCache(1000, chunk_tokens=C)
    pc.insert("a", ids, 2, _payload(ids))
    assert pc.lookup("b", ids).tokens == 0
    assert pc.lookup("a", ids).tokens == 8
    shared = PrefixCache(1000, chunk_tokens=C, shared=True)
    shared.insert("a", ids, 2, _payload(ids))
    assert shared.lookup("b", ids).tokens == 8


def _hit(pc, tenant, ids) -> int:
    """Tokens a lookup matches (released at once)."""
    hit = pc.lookup(tenant, ids)
    pc.release(hit)
    return hit.tokens


def test_lru_eviction_takes_least_recent_leaves_and_spares_pinned():
    pc = PrefixCache(40, chunk_tokens=C)       # room for 4 chunks of 10 bytes
    a, b, c, d, e = ([x] * 8 for x in (1, 2, 3, 4, 5))
    pc.insert("t", a, 2, _payload(a, "a"))
    pc.insert("t", b, 2, _payload(b, "b"))
    assert len(pc) == 4
    assert _hit(pc, "t", a) == 8               # a is now more recent than b
    pc.insert("t", c, 1, _payload(c, "c"))     # evicts b's leaf chunk; b's first chunk stays
    assert pc.stats.evicted_chunks == 1 and _hit(pc, "t", b) == 4 and _hit(pc, "t", c) == 4
    pinned = pc.lookup("t", a)                 # a request copying from a: never evicted
    pc.insert("t", d, 2, _payload(d, "d"))     # evicts the least recent unpinned leaves: c, then b
    assert _hit(pc, "t", a) == 8 and _hit(pc, "t", d) == 8
    assert _hit(pc, "t", b) == 0 and _hit(pc, "t", c) == 0 and pc.stats.evicted_chunks == 3
    pc.insert("t", e, 1, _payload(e, "e"))     # a's leaf is pinned: d's leaf goes
    assert _hit(pc, "t", a) == 8 and _hit(pc, "t", d) == 4 and _hit(pc, "t", e) == 4
    assert pc.bytes == 40
    pc.release(pinned)
    pc.clear()
    assert len(pc) == pc.bytes == 0 and _hit(pc, "t", a) == 0


def test_a_chunk_larger_than_the_budget_is_not_stored():
    pc = PrefixCache(5, chunk_tokens=C)
    assert pc.insert("t", [1] * 4, 1, lambda j: ("big", 10)) == 0 and len(pc) == 0


def test_bad_budget_is_refused():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="capacity_bytes"):
            PrefixCache(bad)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "lookup"]), st.sampled_from(["a", "b"]),
                              st.lists(st.integers(0, 2), min_size=0, max_size=12)), max_size=30),
       budget=st.integers(10, 80))
def test_against_a_reference(ops, budget):
    """Whatever is looked up is a true prefix of something inserted for that tenant, with the
    payload inserted for it; the budget holds; a tree stays prefix-closed."""
    pc = PrefixCache(budget, chunk_tokens=C)
    inserted: dict[tuple[str, tuple[int, ...]], object] = {}
    for op, tenant, ids in ops:
        if op == "insert":
            def payload(j, ids=ids):
                key = tuple(ids[:(j + 1) * C])
                return key, 10
            pc.insert(tenant, ids, len(ids) // C, payload)
            for j in range(len(ids) // C):
                inserted[(tenant, tuple(ids[:(j + 1) * C]))] = tuple(ids[:(j + 1) * C])
        else:
            hit = pc.lookup(tenant, ids)
            for j, p in enumerate(hit.payloads):
                assert p == tuple(ids[:(j + 1) * C]) and (tenant, p) in inserted
            pc.release(hit)
        assert pc.bytes == 10 * len(pc) <= budget
    assert all(nd.pins == 0 for nd in pc._lru.values())


def test_prefill_runs_on_a_fixed_thread_count():
    """The exactness argument needs a prefill chunk to compute the same bits every time. On some
    CPUs a GEMM's bits depend on the thread count (oneDNN's bfloat16 GEMM with AMX: K=1536 on 1
    vs 2 threads), and the thread governor changes the count between forwards under load: so
    prefill runs on the governor's full team whatever its current count."""
    from agentspec.backends.embedded.threads import ThreadGovernor

    threads = torch.get_num_threads()
    gov = ThreadGovernor(2, enabled=False)
    try:
        gov.threads = 1
        gov.apply()
        seen = []
        with gov.full_team():
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())
        assert seen == [2, 1]
    finally:
        torch.set_num_threads(threads)


def test_prefill_attention_does_not_depend_on_the_thread_count():
    """Attention kernels of the prefill (the blockwise one and SDPA's flash kernel with the
    additive chunk mask) give the same bits on any thread count."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        mask = torch.zeros(256, 512, dtype=torch.bfloat16)
        mask[:, 256:].masked_fill_(torch.ones(256, 256, dtype=torch.bool).triu(1), float("-inf"))
        q, k, v = (torch.randn(9, 256, 64).bfloat16(), torch.randn(3, 512, 64).bfloat16(),
                   torch.randn(3, 512, 64).bfloat16())
        for fn in (prefill_attention, prefill_attention_sdpa):
            outs = []
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                outs.append(fn(q, k, v, start=256))
            assert all(torch.equal(outs[0], o) for o in outs[1:])
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True))
            outs.append(F.scaled_dot_product_attention(q[None], k[None, :, :256], v[None, :, :256], is_causal=True,
                                                       enable_gqa=True))
        assert all(torch.equal(outs[i], outs[i + 2]) for i in range(len(outs) - 2))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fn", [prefill_attention, prefill_attention_sdpa])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_attention_equals_the_whole_prompt(fn, kv_dtype):
    """Both block paths over any piece of a prompt after a prefix -- starting or ending inside a
    block, one row, the whole -- give the same bits as those rows of the whole-prompt call: every
    block runs at its whole shapes, padded (what lets the prefix cache reuse any prefix)."""
    torch.manual_seed(1)
    q = torch.randn(9, 600, 64).bfloat16()
    k, v = torch.randn(3, 600, 64).to(kv_dtype), torch.randn(3, 600, 64).to(kv_dtype)
    whole = fn(q, k, v)
    for s, e in ((256, 512), (512, 600), (300, 600), (0, 1), (1, 2), (127, 129), (599, 600), (130, 131)):
        part = fn(q[:, s:e].contiguous(), k[:, :e].contiguous(), v[:, :e].contiguous(), start=s)
        assert torch.equal(part, whole[:, s:e]), (s, e)
