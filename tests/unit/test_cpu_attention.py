"""agentspec.kernels._cpu decode attention: against a float64 torch reference, and bitwise
identity of a draft-tree node with the same token computed as a plain decoding row."""

from __future__ import annotations

import math
import random

import pytest
import torch

from agentspec.kernels import cpu_attention
from agentspec.kernels.tree import tree_mask

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="agentspec.kernels._cpu not built")

H, HKV, D = 9, 3, 64


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


def test_large_scores_are_stable():
    g = torch.Generator().manual_seed(2)
    T, L = 4, 300
    k, v = make_cache(g, 512)
    q = torch.randn(H, T, D, generator=g) * 40.0  # scores in the hundreds: softmax near one-hot
    out = cpu_attention.decode_attention(q, k, v, None, L)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, k, v, None, L), rtol=1e-4, atol=1e-4)


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


def test_thread_count_does_not_change_bits():
    g = torch.Generator().manual_seed(3)
    T, L = 11, 1000
    k, v = make_cache(g, 1024)
    q = torch.randn(H, T, D, generator=g)
    outs = [cpu_attention.decode_attention(q, k, v, None, L, threads=n) for n in (1, 2, 3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


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


def test_engine_uses_the_native_kernel(monkeypatch):
    """Guards the dispatch: once `supports` was handed the whole cache instead of one layer and
    the engine silently fell back to small_attention. Decode / verify forwards run the fused
    QKVAttention once per layer; with it off (AGENTSPEC_CPU_FUSED=0) the native attention alone."""
    from agentspec.engine.model import KVCache, ModelArgs, Segment, Transformer

    args = ModelArgs(dim=576, n_layers=2, n_heads=9, n_kv_heads=3, hidden_dim=64, vocab_size=50, max_seq_len=256)
    model = Transformer(args).eval()
    calls = {"decode": 0, "segments": 0, "fused": 0}
    real_decode, real_segments = cpu_attention.decode_attention, cpu_attention.segment_attention
    real_call = cpu_attention.QKVAttention.__call__
    monkeypatch.setattr(cpu_attention, "decode_attention",
                        lambda *a, **k: calls.__setitem__("decode", calls["decode"] + 1) or real_decode(*a, **k))
    monkeypatch.setattr(cpu_attention, "segment_attention",
                        lambda *a, **k: calls.__setitem__("segments", calls["segments"] + 1) or real_segments(*a, **k))
    monkeypatch.setattr(cpu_attention.QKVAttention, "__call__",
                        lambda *a, **k: calls.__setitem__("fused", calls["fused"] + 1) or real_call(*a, **k))
    for fused in (True, False):
        monkeypatch.setattr(cpu_attention, "_FUSED", fused)
        cache = KVCache(args, 64, dtype=torch.float32, device=torch.device("cpu"))
        model(torch.arange(5), torch.arange(5), cache)
        cache.commit(list(range(5)))
        mask = torch.ones(2, 7, dtype=torch.bool)
        model(torch.tensor([1, 2]), torch.tensor([5, 6]), cache, mask)
        seg_mask = torch.ones(2, 7, dtype=torch.bool)
        model.forward_segments(torch.tensor([1, 2]), torch.tensor([5, 6]), [Segment(cache=cache, rows=2, mask=seg_mask)])
        if fused:
            assert calls == {"decode": 0, "segments": 0, "fused": 2 * args.n_layers}
        else:
            assert calls == {"decode": args.n_layers, "segments": args.n_layers, "fused": 2 * args.n_layers}


def _random_model(dtype):
    from agentspec.engine.model import ModelArgs, Transformer

    args = ModelArgs(dim=576, n_layers=3, n_heads=9, n_kv_heads=3, hidden_dim=256, vocab_size=300,
                     max_seq_len=1024)
    torch.manual_seed(0)
    model = Transformer(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
        for layer in model.layers:  # norms near 1, as trained models have
            layer.attn_norm.weight.normal_(1, 0.1)
            layer.ffn_norm.weight.normal_(1, 0.1)
    return args, model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_attention_equals_torch_rotary_and_native_attention(dtype, monkeypatch):
    """QKVAttention (rotary, cache writes and attention in one native call per layer) gives the
    same bits as torch's rotary + cache writes + decode_attention: logits, keys, values, and the
    transposed keys equal the keys, through a tree step, a branch commit and a second step."""
    from agentspec.engine.model import KVCache

    from agentspec.kernels.tree import tree_depths

    args, model = _random_model(dtype)
    ids = torch.randint(0, args.vocab_size, (300,))
    caches, logits = {}, {}
    for fused in (True, False):
        monkeypatch.setattr(cpu_attention, "_FUSED", fused)
        cache = KVCache(args, 400, dtype=torch.float32, device=torch.device("cpu"))
        model(ids, torch.arange(300), cache, logits_rows=slice(-1, None))
        cache.commit(list(range(300)))
        out = []
        for step in range(2):
            parents = [-1, 0, 1, 1, 2, 3, 0, 6, 7]
            T = len(parents)
            start = cache.length
            pos = torch.tensor([start + d for d in tree_depths(parents)])
            tok = torch.randint(0, args.vocab_size, (T,), generator=torch.Generator().manual_seed(step))
            mask = torch.zeros(T, start + T, dtype=torch.bool)
            mask[:, :start] = True
            mask[:, start:] = tree_mask(parents)
            out.append(model(tok, pos, cache, mask))
            cache.commit([0, 1, 3, 5])  # a branch: slots move down
        caches[fused], logits[fused] = cache, out
    for a, b in zip(logits[True], logits[False]):
        assert torch.equal(a, b)
    n = caches[True].length
    assert torch.equal(caches[True].k[:, :, :n], caches[False].k[:, :, :n])
    assert torch.equal(caches[True].v[:, :, :n], caches[False].v[:, :, :n])
    for c in caches.values():
        assert torch.equal(c.kt[..., :n], c.k[:, :, :n].transpose(2, 3))


def test_fused_segments_equal_each_request_alone(monkeypatch):
    """forward_segments with the fused attention: each request's logits and cache as when it
    runs alone through forward (and as the unfused path)."""
    from agentspec.engine.model import KVCache, Segment

    args, model = _random_model(torch.bfloat16)
    lens, rows = [40, 257, 130], [3, 1, 6]
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(cpu_attention, "_FUSED", fused)
        caches = []
        for i, n in enumerate(lens):
            c = KVCache(args, n + 16, dtype=torch.float32, device=torch.device("cpu"))
            model(torch.arange(n) % args.vocab_size, torch.arange(n), c, logits_rows=slice(-1, None))
            c.commit(list(range(n)))
            caches.append(c)
        toks = torch.arange(sum(rows)) + 7
        pos = torch.cat([torch.arange(n, n + r) for n, r in zip(lens, rows)])
        segs = [Segment(cache=c, rows=r, mask=torch.ones(r, n + r, dtype=torch.bool).tril(n))
                for c, n, r in zip(caches, lens, rows)]
        results[fused] = (model.forward_segments(toks, pos, segs), caches)
    alone = []
    monkeypatch.setattr(cpu_attention, "_FUSED", True)
    off = 0
    for n, r in zip(lens, rows):
        c = KVCache(args, n + 16, dtype=torch.float32, device=torch.device("cpu"))
        model(torch.arange(n) % args.vocab_size, torch.arange(n), c, logits_rows=slice(-1, None))
        c.commit(list(range(n)))
        mask = torch.ones(r, n + r, dtype=torch.bool).tril(n)
        alone.append(model(torch.arange(off, off + r) + 7, torch.arange(n, n + r), c, mask))
        off += r
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][0], torch.cat(alone))
    for c1, c2 in zip(results[True][1], results[False][1]):
        L = c1.length + 6
        assert torch.equal(c1.k[:, :, :L], c2.k[:, :, :L]) and torch.equal(c1.kt[..., :L], c1.k[:, :, :L].transpose(2, 3))
