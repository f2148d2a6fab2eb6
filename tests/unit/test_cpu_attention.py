"""agentspec.kernels._cpu decode attention: against a float64 torch reference, and bitwise
identity of a draft-tree node with the same token computed as a plain decoding row."""

from __future__ import annotations

import math

import random
import sys

import pytest

from agentspec.backends.embedded.plan import Settings
import torch

from agentspec.kernels import cpu_attention, cpu_linear
from agentspec.kernels.tree import tree_mask

from helpers.models import packed_cache, random_model

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="agentspec.kernels._cpu not built")

H, HKV, D = 9, 3, 64


@pytest.fixture(params=[(9, 3, 64), (12, 2, 128), (14, 2, 64), (10, 2, 128), (16, 2, 64)],
                ids=["hd64", "hd128", "hd64-g7", "hd128-g5", "hd64-g8"])
def shape(request, monkeypatch):
    """The float32 kernel's head shapes: SmolLM2's (head_dim 64, 3 query heads per kv head),
    Qwen2.5-Coder-1.5B's (128, 6: two passes of the inner loops, 4 + 2 heads) and -0.5B's (64, 7:
    4 + 3), and 5 and 8 query heads per kv head (4 + 1, 4 + 4); the tests below read H, HKV and D
    from the module."""
    mod = sys.modules[__name__]
    for name, value in zip(("H", "HKV", "D"), request.param):
        monkeypatch.setattr(mod, name, value)
    return request.param


def reference(q, k, v, mask, L):
    """float64 softmax attention, GQA: query head h reads kv head h // (H // Hkv). -> [T, H, D]"""
    Hq, T, _ = q.shape
    G = Hq // k.shape[0]
    kk = k[:, :L].double().repeat_interleave(G, dim=0)
    vv = v[:, :L].double().repeat_interleave(G, dim=0)
    s = torch.matmul(q.double(), kk.transpose(1, 2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask[:, :L], -math.inf)
    return torch.matmul(torch.softmax(s, dim=-1), vv).transpose(0, 1)


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def make_cache(g: torch.Generator, cap: int):
    k = torch.randn(HKV, cap, D, generator=g)
    v = torch.randn(HKV, cap, D, generator=g)
    return k, v


@pytest.mark.usefixtures("shape")
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 13, 16, 17, 33, 40])
def test_matches_float64_reference_with_tree_masks(T):
    g = torch.Generator().manual_seed(T)
    rng = random.Random(T)
    for start in (0, 1, 7, 250, 1201):
        L = start + T
        cap = L + rng.randrange(0, 300)
        k, v = make_cache(g, cap)
        q = torch.randn(H, T, D, generator=g) * 2.0
        mask = torch.zeros(T, L, dtype=torch.bool)
        mask[:, :start] = True
        mask[:, start:] = tree_mask(random_parents(rng, T))
        out = cpu_attention.decode_attention(q, k, v, mask, L)
        torch.testing.assert_close(out.double(), reference(q, k, v, mask, L), rtol=2e-5, atol=2e-5)
        out_all = cpu_attention.decode_attention(q, k, v, None, L)
        torch.testing.assert_close(out_all.double(), reference(q, k, v, None, L), rtol=2e-5, atol=2e-5)


@pytest.mark.usefixtures("shape")
def test_wide_mask_noncontiguous_q_and_sparse_rows():
    g = torch.Generator().manual_seed(1)
    T, L = 6, 517
    k, v = make_cache(g, 768)
    q = torch.randn(T, H, D, generator=g).transpose(0, 1)  # [H, T, D] as the model makes it
    mask = torch.zeros(T, 768, dtype=torch.bool)            # wider than L (fixed key_len)
    mask[:, :L] = torch.rand(T, L, generator=g) < 0.3
    mask[0, :] = False
    mask[0, 400] = True                                     # one visible key: exactly v
    out = cpu_attention.decode_attention(q, k, v, mask, L)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, L), rtol=2e-5, atol=2e-5)
    assert torch.equal(out[0], v[:, 400].repeat_interleave(H // HKV, dim=0))


@pytest.mark.usefixtures("shape")
def test_large_scores_are_stable():
    g = torch.Generator().manual_seed(2)
    T, L = 4, 300
    k, v = make_cache(g, 512)
    q = torch.randn(H, T, D, generator=g) * 40.0  # scores in the hundreds: softmax near one-hot
    out = cpu_attention.decode_attention(q, k, v, None, L)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, k, v, None, L), rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("shape")
@pytest.mark.parametrize("start", [0, 5, 127, 128, 300, 1199])
def test_tree_node_equals_plain_row_bitwise(start):
    """A node's output in a tree forward equals the same token's in a plain 2-row forward, where
    its ancestors' keys sit at consecutive slots after the prefix instead of at tree slots."""
    g = torch.Generator().manual_seed(start)
    rng = random.Random(start)
    n = 24
    parents = random_parents(rng, n)
    cap = start + n + 64
    k, v = make_cache(g, cap)
    q = torch.randn(H, n, D, generator=g)
    mask = torch.zeros(n, start + n, dtype=torch.bool)
    mask[:, :start] = True
    mask[:, start:] = tree_mask(parents)
    tree_out = cpu_attention.decode_attention(q, k, v, mask, start + n)
    for i in range(n):
        chain = [j for j in range(n) if mask[i, start + j]]  # ancestors and i, in depth order
        depth = len(chain) - 1
        pk = k.clone()
        pv = v.clone()
        pk[:, start:start + depth + 1] = k[:, [start + j for j in chain]]
        pv[:, start:start + depth + 1] = v[:, [start + j for j in chain]]
        # plain decoding: the token at slot p = start + depth, plus a padding row at p + 1
        p = start + depth
        pk[:, p + 1] = torch.randn(HKV, D, generator=g)
        pv[:, p + 1] = torch.randn(HKV, D, generator=g)
        pq = torch.stack([q[:, i], torch.randn(H, D, generator=g)], dim=1)
        pm = torch.zeros(2, p + 2, dtype=torch.bool)
        pm[:, :p] = True
        pm[0, p] = True
        pm[1, p + 1] = True
        plain_out = cpu_attention.decode_attention(pq, pk, pv, pm, p + 2)
        assert torch.equal(plain_out[0], tree_out[i]), f"node {i} (depth {depth})"
        # and with no mask, as the committed prefix + this token alone
        alone = cpu_attention.decode_attention(q[:, i:i + 1], pk, pv, None, p + 1)
        assert torch.equal(alone[0], tree_out[i])


@pytest.mark.usefixtures("shape")
def test_thread_count_does_not_change_bits():
    g = torch.Generator().manual_seed(3)
    T, L = 11, 1000
    k, v = make_cache(g, 1024)
    q = torch.randn(H, T, D, generator=g)
    outs = [cpu_attention.decode_attention(q, k, v, None, L, threads=n) for n in (1, 2, 3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.usefixtures("shape")
def test_segment_attention_equals_each_segment_alone():
    """Several requests in one native call: each gets the bits it gets alone, and the new keys /
    values land at its cache slots [L - T, L)."""
    g = torch.Generator().manual_seed(5)
    sizes = [(37, 1), (300, 5), (1, 2), (129, 33)]   # (committed, rows)
    R = sum(t for _, t in sizes)
    q = torch.randn(H, R, D, generator=g)
    kv = torch.randn(2, HKV, R, D, generator=g)
    caches, segs, off = [], [], 0
    for start, T in sizes:
        k = torch.randn(HKV, 512, D, generator=g)
        v = torch.randn(HKV, 512, D, generator=g)
        mask = torch.zeros(T, start + T, dtype=torch.bool)
        mask[:, :start] = True
        mask[:, start:] = tree_mask([-1] + [random.Random(T).randrange(i) for i in range(1, T)])
        caches.append((k.clone(), v.clone()))
        segs.append((k, v, start + T, mask, off, T))
        off += T
    out = cpu_attention.segment_attention(q, kv, segs)
    for (k0, v0), (k, v, L, mask, o, T) in zip(caches, segs):
        assert torch.equal(k[:, L - T:L], kv[0, :, o:o + T]) and torch.equal(v[:, L - T:L], kv[1, :, o:o + T])
        assert torch.equal(k[:, :L - T], k0[:, :L - T])
        alone = cpu_attention.decode_attention(q[:, o:o + T].contiguous(), k, v, mask, L)
        assert torch.equal(out[o:o + T], alone)


@pytest.mark.usefixtures("shape")
@pytest.mark.usefixtures("shape")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rows_sharing_the_cache_reads_get_the_bits_of_each_row_alone(kv_dtype):
    """Rows of one request share each block of keys and chunk of values they read (groups of 1 to 8
    rows, the kernel's choice by default: one pass per kv head where the threads allow): whatever
    the grouping, each row gets the bits it gets alone. Rows that see different prefixes (a masked
    prefix, a pad row that sees only itself, trees whose branches end at different depths) and
    contexts that end mid-block and mid-chunk."""
    g = torch.Generator().manual_seed(21)
    rng = random.Random(21)
    for start, T in ((0, 5), (63, 9), (200, 17), (1000, 13), (500, 3), (300, 7)):
        L = start + T
        k, v = (x.to(kv_dtype) for x in make_cache(g, L + 16))
        q = torch.randn(H, T, D, generator=g)
        mask = torch.zeros(T, L, dtype=torch.bool)
        mask[:, :start] = True
        mask[:, start:] = tree_mask(random_parents(rng, T))
        if start:
            mask[1, :start // 2] = False        # a row with a masked prefix
            mask[T - 1, :] = False              # a pad row: only itself
            mask[T - 1, L - 1] = True
        alone = torch.cat([cpu_attention.decode_attention(q[:, t:t + 1].contiguous(), k, v, mask[t:t + 1], L)
                           for t in range(T)])
        for group in (0, 1, 2, 3, 8):
            for threads in (1, 2):
                out = cpu_attention.decode_attention(q, k, v, mask, L, threads=threads, group=group)
                assert torch.equal(out, alone), (start, T, group, threads)
        segs = [(k.clone(), v.clone(), L, mask, 0, T)]
        kv = torch.stack([k[:, L - T:L], v[:, L - T:L]]).float().contiguous()
        for group in (0, 1, 8):
            assert torch.equal(cpu_attention.segment_attention(q, kv, segs, group=group), alone), (start, T, group)


@pytest.mark.usefixtures("shape")
def test_each_query_head_gets_the_bits_it_gets_alone():
    """A kv head's query heads go through the kernel's inner loops a few at a time (7 = 4 + 3):
    each head's output equals, bit for bit, that head computed alone against its kv head (one
    query head, one kv head), on tree masks, all-visible rows and a masked prefix."""
    G = H // HKV
    g = torch.Generator().manual_seed(G)
    rng = random.Random(G)
    for start, T in ((0, 3), (300, 9), (1100, 1)):
        L = start + T
        k, v = make_cache(g, L + 5)
        q = torch.randn(H, T, D, generator=g)
        mask = torch.zeros(T, L, dtype=torch.bool)
        mask[:, start // 3:start] = True
        mask[:, start:] = tree_mask(random_parents(rng, T))
        for m in (mask, None):
            out = cpu_attention.decode_attention(q, k, v, m, L)
            for h in range(H):
                kv = h // G
                alone = cpu_attention.decode_attention(q[h:h + 1], k[kv:kv + 1], v[kv:kv + 1], m, L)
                assert torch.equal(alone[:, 0], out[:, h]), (start, T, h)


@pytest.mark.parametrize("heads", [(9, 3), (14, 2), (8, 1)], ids=["g3", "g7", "g8"])
def test_fused_each_query_head_gets_the_bits_it_gets_alone(heads, monkeypatch):
    """The bfloat16 rows kernel (QKVAttention, head_dim 64) takes a kv head's query heads a few
    at a time too: each head's output equals that head alone (its q, its kv head's k and v, a
    cache holding only that kv head), bit for bit, on every kind of segment of _segments_case."""
    from agentspec.backends.embedded.model import ModelArgs

    mod = sys.modules[__name__]
    monkeypatch.setattr(mod, "H", heads[0])
    monkeypatch.setattr(mod, "HKV", heads[1])
    monkeypatch.setattr(mod, "D", 64)
    h_, hkv_, G = heads[0], heads[1], heads[0] // heads[1]
    segs, qkv, cos, sin = _segments_case(11)
    q_w = h_ * D
    # each head's inputs before the call writes the rows' keys / values into the caches
    singles = []
    for h in range(h_):
        kv = h // G
        rows = torch.cat([qkv[:, h * D:(h + 1) * D], qkv[:, q_w + kv * D:q_w + (kv + 1) * D],
                          qkv[:, q_w + (hkv_ + kv) * D:q_w + (hkv_ + kv + 1) * D]], 1).contiguous()
        args1 = ModelArgs(dim=64, n_layers=2, n_heads=1, n_kv_heads=1, hidden_dim=256, vocab_size=300,
                          max_seq_len=2048)
        segs1 = []
        for c, P, L, mask, T in segs:
            c1 = packed_cache(args1, c.capacity)
            c1.k[:, 0, :P] = c.k[:, kv, :P]
            c1.v[:, 0, :P] = c.v[:, kv, :P]
            cpu_attention.sync_packed(c1, range(P))
            segs1.append((c1, P, L, mask, T))
        singles.append((rows, segs1))
    together = cpu_attention.QKVAttention(segs, cos, sin, n_heads=h_, n_kv_heads=hkv_, head_dim=D,
                                          mode="rows")(qkv, 1).clone()
    for h, (rows, segs1) in enumerate(singles):
        alone = cpu_attention.QKVAttention(segs1, cos, sin, n_heads=1, n_kv_heads=1, head_dim=D, mode="rows")(rows, 1)
        assert torch.equal(alone, together[:, h * D:(h + 1) * D]), h


@pytest.mark.parametrize("T", [1, 2, 3, 17])
def test_bfloat16_cache_equals_a_float32_cache_of_its_values(T):
    """A bfloat16 cache is read as the floats it holds: the bits of a float32 cache holding the same
    values, with and without a tree mask (one or two rows transpose keys per block, more share a
    transposed copy: the same values either way)."""
    g = torch.Generator().manual_seed(10 + T)
    rng = random.Random(T)
    for start in (0, 15, 64, 700):
        L = start + T
        k, v = (x.to(torch.bfloat16) for x in make_cache(g, L + 40))
        q = torch.randn(H, T, D, generator=g)
        mask = torch.zeros(T, L, dtype=torch.bool)
        mask[:, :start] = True
        mask[:, start:] = tree_mask(random_parents(rng, T))
        for m in (mask, None):
            out = cpu_attention.decode_attention(q, k, v, m, L)
            assert torch.equal(out, cpu_attention.decode_attention(q, k.float(), v.float(), m, L))


@pytest.mark.usefixtures("shape")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_isa_level_gives_the_float32_kernel_the_same_bits(kv_dtype, restore_isa):
    """The float32 kernel runs at the vector width of the level's registers (16 floats at AVX-512,
    8 at AVX2, 4 at the scalar level's SSE2); every level this CPU runs gives the best one's bits:
    one row and groups of rows (a block of keys transposed at a time, and a shared transposed copy),
    tree masks, no mask, contexts that end inside a 16-key chunk, and segments."""
    cpu_isa = restore_isa
    levels = cpu_isa.supported()
    g = torch.Generator().manual_seed(31)
    rng = random.Random(31)
    cases = []
    for start, T, group in ((0, 1, 0), (5, 3, 1), (190, 8, 0), (700, 7, 2), (1203, 5, 1), (64, 16, 0)):
        L = start + T
        k, v = (x.to(kv_dtype) for x in make_cache(g, L + 23))
        q = torch.randn(H, T, D, generator=g) * 4
        mask = torch.zeros(T, L, dtype=torch.bool)
        mask[:, :start] = True
        mask[:, start:] = tree_mask(random_parents(rng, T))
        cases.append((q, k, v, mask, L, group))
    kv_new = torch.randn(2, HKV, 6, D, generator=g)
    q_seg = torch.randn(H, 6, D, generator=g)
    outs = {}
    for isa in levels:
        assert cpu_isa.set_isa(isa) == isa
        got = [cpu_attention.decode_attention(q, k, v, m, L, group=group)
               for q, k, v, mask, L, group in cases for m in (mask, None)]
        segs = [(k.clone(), v.clone(), L, mask[-T:], off, T)
                for (q, k, v, mask, L, _), off, T in zip(cases[2:4], (0, 4), (4, 2))]
        got.append(cpu_attention.segment_attention(q_seg, kv_new, segs))
        got.extend(s[0] for s in segs)   # the new keys written into each cache
        outs[isa] = got
    best = outs[levels[-1]]
    for isa, got in outs.items():
        for i, (a, b) in enumerate(zip(got, best)):
            assert torch.equal(a, b), f"{isa} differs from {levels[-1]} (output {i})"


@pytest.mark.usefixtures("shape")
def test_bfloat16_segments_round_new_keys_as_torch_and_equal_each_alone():
    g = torch.Generator().manual_seed(6)
    sizes = [(40, 1), (257, 3), (0, 2)]
    R = sum(t for _, t in sizes)
    q = torch.randn(H, R, D, generator=g)
    kv = torch.randn(2, HKV, R, D, generator=g) * 3.0
    segs, off = [], 0
    for start, T in sizes:
        k = torch.randn(HKV, 320, D, generator=g).to(torch.bfloat16)
        v = torch.randn(HKV, 320, D, generator=g).to(torch.bfloat16)
        mask = torch.ones(T, start + T, dtype=torch.bool).tril(start)
        segs.append((k, v, start + T, mask, off, T))
        off += T
    out = cpu_attention.segment_attention(q, kv, segs)
    for k, v, L, mask, o, T in segs:
        assert torch.equal(k[:, L - T:L], kv[0, :, o:o + T].to(torch.bfloat16))
        assert torch.equal(v[:, L - T:L], kv[1, :, o:o + T].to(torch.bfloat16))
        assert torch.equal(out[o:o + T], cpu_attention.decode_attention(q[:, o:o + T].contiguous(), k, v, mask, L))
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        k32 = torch.zeros(HKV, 320, D)
        cpu_attention.segment_attention(q[:, :1].contiguous(), kv[:, :, :1].contiguous(),
                                        [segs[0], (k32, k32.clone(), 41, segs[0][3], 0, 1)])


def test_engine_uses_the_native_kernel(monkeypatch):
    """Guards the dispatch: once `supports` was handed the whole cache instead of one layer and
    the engine silently fell back to small_attention. A bfloat16 model over a packed cache runs
    the fused QKVAttention once per layer; with it off (AGENTSPEC_CPU_FUSED=0), or for a float32
    model, the native float32 attention."""
    from agentspec.backends.embedded.model import KVCache, ModelArgs, Transformer
    from agentspec.backends.embedded.model import Segment

    args = ModelArgs(dim=576, n_layers=2, n_heads=9, n_kv_heads=3, hidden_dim=64, vocab_size=50, max_seq_len=256)
    calls = {"decode": 0, "segments": 0, "fused": 0}
    real_decode, real_segments = cpu_attention.decode_attention, cpu_attention.segment_attention
    real_call = cpu_attention.QKVAttention.__call__
    monkeypatch.setattr(cpu_attention, "decode_attention",
                        lambda *a, **k: calls.__setitem__("decode", calls["decode"] + 1) or real_decode(*a, **k))
    monkeypatch.setattr(cpu_attention, "segment_attention",
                        lambda *a, **k: calls.__setitem__("segments", calls["segments"] + 1) or real_segments(*a, **k))
    monkeypatch.setattr(cpu_attention.QKVAttention, "__call__",
                        lambda *a, **k: calls.__setitem__("fused", calls["fused"] + 1) or real_call(*a, **k))
    for dtype, fused, want in [
        (torch.bfloat16, True, {"decode": 0, "segments": 0, "fused": 2}),
        (torch.bfloat16, False, {"decode": 1, "segments": 1, "fused": 0}),
        (torch.float32, True, {"decode": 1, "segments": 1, "fused": 0}),
    ]:
        calls.update(decode=0, segments=0, fused=0)
        model = Transformer(args).eval().to(dtype)
        model.set_kernel_settings(Settings(fused=fused))
        cache = KVCache(args, 64, dtype=torch.float32, device=torch.device("cpu"), packed=True)
        model(torch.arange(5), torch.arange(5), cache)
        cache.commit(list(range(5)))
        mask = torch.ones(2, 7, dtype=torch.bool)
        model(torch.tensor([1, 2]), torch.tensor([5, 6]), cache, mask)
        seg_mask = torch.ones(2, 7, dtype=torch.bool)
        model.forward_segments(torch.tensor([1, 2]), torch.tensor([5, 6]), [Segment(cache=cache, rows=2, mask=seg_mask)])
        assert calls == {k: v * args.n_layers for k, v in want.items()}, (dtype, fused)


def _assert_packed_consistent(c, n):
    """kt2 / vp hold exactly the bfloat16 values of k / v for slots [0, n)."""
    L, Hkv, cap, D = c.k.shape
    k = c.k[:, :, :n].to(torch.bfloat16)
    v = c.v[:, :, :n].to(torch.bfloat16)
    assert torch.equal(k.float(), c.k[:, :, :n]) and torch.equal(v.float(), c.v[:, :, :n])  # bf16 values
    assert torch.equal(c.kt2[:, :, :, :n].permute(0, 1, 3, 2, 4).reshape(L, Hkv, n, D), k)
    vv = c.vp.permute(0, 1, 2, 4, 3).reshape(L, Hkv, cap, D)[:, :, :n]
    assert torch.equal(vv, v)


def test_fused_attention_matches_float_attention_and_keeps_packed_copies(monkeypatch):
    """QKVAttention (bfloat16 model): logits close to the float32 native path (bf16 dot products
    and p rounded to bf16 are the only differences), keys / values equal (rotary rounded as torch
    rounds it), and the packed copies equal the cache through tree steps and branch commits."""
    from agentspec.kernels.tree import tree_depths

    args, model = random_model()
    ids = torch.randint(0, args.vocab_size, (300,), generator=torch.Generator().manual_seed(3))
    caches, logits = {}, {}
    for fused in (True, False):
        model.set_kernel_settings(Settings(fused=fused))
        cache = packed_cache(args, 400)
        model(ids, torch.arange(300), cache, logits_rows=slice(-1, None))
        cache.commit(list(range(300)))
        out = []
        for step in range(3):
            parents = [-1, 0, 1, 1, 2, 3, 0, 6, 7]
            T = len(parents)
            start = cache.length
            pos = torch.tensor([start + d for d in tree_depths(parents)])
            tok = torch.randint(0, args.vocab_size, (T,), generator=torch.Generator().manual_seed(step))
            mask = torch.zeros(T, start + T, dtype=torch.bool)
            mask[:, :start] = True
            mask[:, start:] = tree_mask(parents)
            out.append(model(tok, pos, cache, mask))
            _assert_packed_consistent(cache, start + T)
            cache.commit([0, 1, 3, 5])  # a branch: slots move down
            _assert_packed_consistent(cache, cache.length)
        caches[fused], logits[fused] = cache, out
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, rtol=0.02, atol=0.02)
    # the first step's keys / values are equal; later ones differ by the attention's rounding
    assert torch.equal(caches[True].k[0, :, :310], caches[False].k[0, :, :310])


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# torch's own bfloat16 GEMM (oneDNN) is row-invariant only where the CPU multiplies bfloat16 natively
# (AVX512-BF16, AMX); on an AVX-512 CPU without it a row's bits depend on the other rows of the GEMM.
# The engine's native linears (every GGUF file, ``packed_linears``) do not have this limit.
_TORCH_BF16_NOT_ROW_INVARIANT = sys.platform.startswith("linux") and bool(_cpu_flags()) and not (
    {"avx512_bf16", "amx_bf16"} & _cpu_flags())

# the packed linears' decode kernels: "vector" everywhere, "amx" where the tiles run (else it is "vector" again)
LINEAR_CASES = [pytest.param(False, "vector", marks=pytest.mark.xfail(
                    _TORCH_BF16_NOT_ROW_INVARIANT, reason="torch's bfloat16 GEMM is not row-invariant on a CPU "
                    "without AVX512-BF16 / AMX (the native packed linears are)", strict=False)),
                (True, "vector"), (True, "amx")]


@pytest.mark.parametrize("packed_linears,decode_linears", LINEAR_CASES)
def test_fused_tree_node_equals_plain_decoding_row_bitwise(packed_linears, decode_linears, monkeypatch):
    """The exactness property on the fused path: a chain decoded one token per forward (as the
    engine runs plain decoding: two rows with torch's linears, one row with the native
    row-invariant ones) and the same chain inside a draft tree, among siblings at other slots,
    give bit-identical logits; with an odd and an even prefix length; with the packed linears on
    vector units and on AMX tiles."""
    args, model = random_model(packed_linears)
    model.set_kernel_settings(Settings(decode_linears=decode_linears))
    n = 1 if packed_linears else 2
    for P in (257, 300):
        ids = torch.randint(0, args.vocab_size, (P,), generator=torch.Generator().manual_seed(P))
        chain = [5, 17, 42, 99, 7]
        # plain decoding
        plain = packed_cache(args, P + 16)
        model(ids, torch.arange(P), plain, logits_rows=slice(-1, None))
        plain.commit(list(range(P)))
        rows = []
        for tok in chain:
            s = plain.length
            assert model.row_invariant(plain) == packed_linears
            mask = torch.zeros(n, s + n, dtype=torch.bool)
            mask[:, :s] = True
            mask[0, s] = True
            mask[n - 1, s + n - 1] = True
            rows.append(model(torch.tensor([tok] * n), torch.tensor([s] * n), plain, mask)[0])
            plain.commit([0])
        # the chain at tree slots 0, 2, 4, 5, 7 among distractors
        parents = [-1, 0, 0, 2, 2, 4, 5, 5, 7]
        toks = [chain[0], 3, chain[1], 8, chain[2], chain[3], 11, chain[4], 13]
        from agentspec.kernels.tree import tree_depths
        tree = packed_cache(args, P + 16)
        model(ids, torch.arange(P), tree, logits_rows=slice(-1, None))
        tree.commit(list(range(P)))
        mask = torch.zeros(len(toks), P + len(toks), dtype=torch.bool)
        mask[:, :P] = True
        mask[:, P:] = tree_mask(parents)
        pos = torch.tensor([P + d for d in tree_depths(parents)])
        out = model(torch.tensor(toks), pos, tree, mask)
        for r, slot in zip(rows, [0, 2, 4, 5, 7]):
            assert torch.equal(r, out[slot])


def test_every_isa_level_gives_the_same_bits(restore_isa, monkeypatch):
    """Attention and linears: every ISA level this CPU runs (the AVX512-BF16 instruction, its
    AVX-512 / AVX2 / NEON / scalar emulations) computes the same logits and cache, bit for bit.
    (The prompt's prefill runs through SDPA at every level and decode through the VDPBF16PS
    kernels: the AMX kernels run only at the top level, with their own bits, and
    test_prefill_amx.py / test_amx_decode_* test them.) With the defaults (AMX where it runs),
    every level below the top computes the VDPBF16PS bits."""
    cpu_isa = restore_isa
    levels = cpu_isa.supported()
    args, model = random_model(packed_linears=True)
    # the AMX kernels have their own bits: prompts on SDPA, decode attention and linears on VDPBF16PS
    model.set_kernel_settings(Settings(prefill_attention="sdpa", decode_attention="rows", decode_linears="vector"))
    ids = torch.randint(0, args.vocab_size, (200,), generator=torch.Generator().manual_seed(9))
    outs = {}
    for isa in levels:
        assert cpu_isa.set_isa(isa) == isa
        c = packed_cache(args, 256)
        model(ids[:190], torch.arange(190), c, logits_rows=slice(-1, None))
        c.commit(list(range(190)))
        outs[isa] = (model(ids[190:], torch.arange(190, 200), c, None), c.k.clone(), c.kt2.clone())
    best = outs[levels[-1]]
    for isa, out in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(out, best)), f"{isa} differs from {levels[-1]}"


def test_isa_cap_and_bad_names(restore_isa):
    cpu_isa = restore_isa
    assert cpu_isa.set_isa("scalar") == "scalar"
    assert cpu_isa.active() == "scalar"
    # a cap above what the CPU runs gives the best level at or below it
    assert cpu_isa.set_isa("avx512bf16") == cpu_isa.best()
    with pytest.raises(ValueError, match="unknown CPU ISA 'sse9'"):
        cpu_isa.set_isa("sse9")
    assert cpu_isa.set_isa(None) == cpu_isa.best() == cpu_isa.active()


@pytest.mark.parametrize("packed_linears,decode_linears", LINEAR_CASES)
def test_fused_segments_equal_each_request_alone(packed_linears, decode_linears, monkeypatch):
    """forward_segments with the fused attention: each request's logits and cache as when it
    runs alone through forward (packed linears on vector units and on AMX tiles)."""
    from agentspec.backends.embedded.model import Segment

    args, model = random_model(packed_linears)
    model.set_kernel_settings(Settings(decode_linears=decode_linears))
    lens, rows = [40, 257, 130], [3, 1, 6]

    def prefilled(n):
        c = packed_cache(args, n + 16)
        model(torch.arange(n) % args.vocab_size, torch.arange(n), c, logits_rows=slice(-1, None))
        c.commit(list(range(n)))
        return c

    caches = [prefilled(n) for n in lens]
    toks = torch.arange(sum(rows)) + 7
    pos = torch.cat([torch.arange(n, n + r) for n, r in zip(lens, rows)])
    segs = [Segment(cache=c, rows=r, mask=torch.ones(r, n + r, dtype=torch.bool).tril(n))
            for c, n, r in zip(caches, lens, rows)]
    together = model.forward_segments(toks, pos, segs)
    alone, off = [], 0
    for n, r in zip(lens, rows):
        c = prefilled(n)
        alone.append(model(torch.arange(off, off + r) + 7, torch.arange(n, n + r), c,
                           torch.ones(r, n + r, dtype=torch.bool).tril(n)))
        off += r
        _assert_packed_consistent(c, n + r)
    assert torch.equal(together, torch.cat(alone))
    for c, n, r in zip(caches, lens, rows):
        _assert_packed_consistent(c, n + r)


def _segments_case(seed: int):
    """Segments for QKVAttention: random bfloat16 keys / values in packed caches and the rows'
    q|k|v, with draft-tree masks (after odd and even prefixes), a chain, a row that sees only
    part of the prefix, a mask-less segment and a one-row (plain decoding) segment."""
    from agentspec.backends.embedded.model import ModelArgs

    args = ModelArgs(dim=H * D, n_layers=2, n_heads=H, n_kv_heads=HKV, hidden_dim=256, vocab_size=300,
                     max_seq_len=2048)
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    segs, qkv_rows = [], []
    for P, T, kind in [(1000, 9, "tree"), (257, 16, "tree"), (64, 5, "chain"), (130, 3, "gaps"),
                       (700, 4, "none"), (511, 1, "one")]:
        cap = (P + T + 15) // 16 * 16 + 16
        c = packed_cache(args, cap)
        c.k[:, :, :P] = torch.randn(2, HKV, P, D, generator=g).bfloat16().float()
        c.v[:, :, :P] = torch.randn(2, HKV, P, D, generator=g).bfloat16().float()
        cpu_attention.sync_packed(c, range(P))
        L = P + T
        if kind == "tree":
            mask = torch.zeros(T, L, dtype=torch.bool)
            mask[:, :P] = True
            mask[:, P:] = tree_mask(random_parents(rng, T))
        elif kind == "gaps":
            mask = torch.ones(T, L, dtype=torch.bool).tril(P)
            mask[1, 3:90] = False   # a row that sees only part of the prefix
            mask[2, :P - 1] = False
        elif kind in ("chain", "one"):
            mask = torch.ones(T, L, dtype=torch.bool).tril(P)
        else:
            mask = None
        segs.append((c, P, L, mask, T))
        qkv_rows.append(torch.randn(T, (H + 2 * HKV) * D, generator=g))
    qkv = torch.cat(qkv_rows).bfloat16()
    R = qkv.shape[0]
    ang = torch.rand(R, D // 2, generator=g) * 6.28
    cos = torch.cat([ang.cos(), ang.cos()], 1).bfloat16()
    sin = torch.cat([ang.sin(), ang.sin()], 1).bfloat16()
    return segs, qkv, cos, sin


amx_decode = pytest.mark.skipif(not cpu_attention.decode_amx_runs(),
                                reason="no AMX here (or the kernels are capped below avx512bf16)")


def _amx_vs(monkeypatch, modes, seed=5):
    out = {}
    for mode in modes:
        segs, qkv, cos, sin = _segments_case(seed)
        att = cpu_attention.QKVAttention(segs, cos, sin, n_heads=H, n_kv_heads=HKV, head_dim=D, threads=2, mode=mode)
        out[mode] = att(qkv, 0).clone(), segs
    return out


@amx_decode
def test_amx_decode_matches_the_vdpbf16ps_kernel_closely(monkeypatch):
    """The AMX decode kernel against the per-row VDPBF16PS kernel on tree masks, chains, partial
    prefixes, mask-less and one-row segments: the same attention up to the bf16 output's
    rounding (the tiles sum a block in another order), and the same caches."""
    out = _amx_vs(monkeypatch, ("rows", "amx"))
    a, b = out["amx"][0].float(), out["rows"][0].float()
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=0.02, atol=0.01)
    assert (a != b).float().mean() < 0.05  # rounding differences only
    for (c1, *_), (c2, *_) in zip(out["amx"][1], out["rows"][1]):
        assert torch.equal(c1.kt2, c2.kt2) and torch.equal(c1.vp, c2.vp)


@amx_decode
def test_amx_decode_rows_are_invariant_to_their_company(monkeypatch):
    """A row's AMX output bits depend on its own keys only: the segments of one call equal each
    segment alone, and each row of a chain equals that row computed alone (one row, its own
    mask), whatever the rows sharing its tile and whichever of its blocks came from the packed
    values (the shared prefix of a segment shrinks with the rows that join it)."""
    segs, qkv, cos, sin = _segments_case(7)
    together = cpu_attention.QKVAttention(segs, cos, sin, n_heads=H, n_kv_heads=HKV, head_dim=D)(qkv, 1).clone()
    off = 0
    for c, P, L, mask, T in segs:
        rows = slice(off, off + T)
        alone = cpu_attention.QKVAttention([(c, P, L, mask, T)], cos[rows], sin[rows], n_heads=H, n_kv_heads=HKV,
                                           head_dim=D)(qkv[rows].contiguous(), 1)
        assert torch.equal(alone, together[rows])
        if mask is not None:  # each row on its own: slot P + t of the same cache, its own mask row
            for t in range(T):
                r = slice(off + t, off + t + 1)
                one = cpu_attention.QKVAttention([(c, P + t, L, mask[t:t + 1], 1)], cos[r], sin[r], n_heads=H,
                                                 n_kv_heads=HKV, head_dim=D)(qkv[r].contiguous(), 1)
                assert torch.equal(one[0], together[off + t]), (P, T, t)
        off += T


@amx_decode
def test_amx_decode_linears_run_and_match_the_vector_ones_closely(monkeypatch):
    """Where the tiles run, decode / verify rows project on them (``PackedLinear.prefill``, the
    head included; ``__call__`` not at all), and their logits agree with the VDPBF16PS linears'
    up to rounding (the tiles sum in another order). AGENTSPEC_DECODE_LINEARS=vector (and an
    ISA cap) keep the vector ones."""
    from agentspec.kernels import cpu_isa

    args, model = random_model(packed_linears=True)
    ids = torch.randint(0, args.vocab_size, (300,), generator=torch.Generator().manual_seed(3))
    calls = {"amx": 0, "vector": 0}
    prefill, call = cpu_linear.PackedLinear.prefill, cpu_linear.PackedLinear.__call__

    def count(kind, fn):
        def wrapped(self, *a, **k):
            calls[kind] += 1
            return fn(self, *a, **k)
        return wrapped

    monkeypatch.setattr(cpu_linear.PackedLinear, "prefill", count("amx", prefill))
    monkeypatch.setattr(cpu_linear.PackedLinear, "__call__", count("vector", call))
    logits = {}
    for mode in ("vector", "amx"):
        model.set_kernel_settings(Settings(decode_linears=mode))
        assert model.decode_linears_amx() == (mode == "amx")
        c = packed_cache(args, 320)
        model(ids[:290], torch.arange(290), c, logits_rows=slice(-1, None))
        c.commit(list(range(290)))
        for k in calls:
            calls[k] = 0
        logits[mode] = model(ids[290:], torch.arange(290, 300), c, torch.ones(10, 300, dtype=torch.bool).tril(290))
        n_lin = 4 * args.n_layers + 1
        assert calls == ({"amx": n_lin, "vector": 0} if mode == "amx" else {"amx": 0, "vector": n_lin})
    torch.testing.assert_close(logits["amx"], logits["vector"], rtol=0.05, atol=0.05)
    assert not torch.equal(logits["amx"], logits["vector"])   # the tiles' own bits, so the switch matters
    prev = cpu_isa.active()
    try:
        cpu_isa.set_isa("avx512")
        assert not model.decode_linears_amx()
    finally:
        cpu_isa.set_isa(prev)
