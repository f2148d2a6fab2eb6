"""The prefix cache's radix tree and LRU eviction (agentspec.backends.embedded.prefix_cache), against a plain
reference; and the premise of its exactness argument: prefill matmuls do not depend on the
thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.backends.embedded.model import prefill_attention
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
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(prefill_attention(q, k, v, start=256))
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


def test_chunked_prefill_attention_equals_the_whole_prompt():
    """``prefill_attention`` over a chunk after a prefix: the same bits as those rows of the
    whole-prompt call (blocks aligned to absolute positions)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(9, 600, 64).bfloat16(), torch.randn(3, 600, 64).bfloat16(), torch.randn(3, 600, 64).bfloat16()
    whole = prefill_attention(q, k, v)
    for s, e in ((256, 512), (512, 600), (300, 600)):
        part = prefill_attention(q[:, s:e].contiguous(), k[:, :e].contiguous(), v[:, :e].contiguous(), start=s)
        assert torch.equal(part, whole[:, s:e])
