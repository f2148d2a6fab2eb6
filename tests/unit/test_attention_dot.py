"""agentspec.kernels._cpu attention's bfloat16-product mode (``decode_attention`` /
``segment_attention`` with ``dot=True``): decode and verification rows of the GGUF models on
AVX512-BF16 CPUs, VDPBF16PS for q . k and p @ v. Against a float64 reference, and the contract
exactness rests on: a draft-tree node gets the bits of the same token decoded plainly (keys at other
slots, other rows, groups, segments, threads, a float32 or bfloat16 cache of the same values)."""

from __future__ import annotations

import math

import pytest
import torch

from agentspec.kernels import cpu_attention, cpu_isa
from agentspec.kernels.tree import tree_mask

pytestmark = pytest.mark.skipif(not cpu_attention.dot_runs(),
                                reason="needs AVX512-BF16 and the native kernels (ISA level avx512bf16)")

SHAPES = [(12, 2, 128), (14, 2, 64), (9, 3, 64), (16, 2, 128), (4, 4, 64)]   # 6, 7, 3, 8, 1 heads per kv head


def bf16_values(*shape, g, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(dtype)


def reference(q, k, v, mask, L):
    """float64 attention of q [H, T, D] over the visible keys of k, v [Hkv, >= L, D]: [T, H, D]"""
    H, T, D = q.shape
    G = H // k.shape[0]
    kd = k[:, :L].double().repeat_interleave(G, 0)
    vd = v[:, :L].double().repeat_interleave(G, 0)
    s = q.double() @ kd.transpose(1, 2) / math.sqrt(D)
    if mask is not None:
        s = s.masked_fill(~mask[:, :L], float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(0, 1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-kv{s[1]}-d{s[2]}")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_matches_float64_attention(shape, kv_dtype):
    H, Hkv, D = shape
    g = torch.Generator().manual_seed(H * D)
    for L, T in ((1, 1), (5, 2), (70, 3), (777, 8), (2000, 1)):
        k = bf16_values(Hkv, L + 40, D, g=g, dtype=kv_dtype)
        v = bf16_values(Hkv, L + 40, D, g=g, dtype=kv_dtype)
        q = bf16_values(H, T, D, g=g, scale=2.0)
        mask = torch.rand(T, L, generator=g) > 0.3
        mask[:, 0] = True
        got = cpu_attention.decode_attention(q, k, v, mask, L, dot=True)
        # the weights in bfloat16 (2^-9 of each): about 1e-3 of |o| <= ~3
        assert (got.double() - reference(q, k, v, mask, L)).abs().max().item() < 0.02, (L, T)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-kv{s[1]}-d{s[2]}")
def test_a_draft_node_gets_the_bits_of_plain_decoding(shape):
    """A chain of draft rows verified at once equals each token decoded alone; a tree node whose
    ancestors sit at scattered tree slots equals the same token with them at consecutive slots;
    row groups and thread counts change nothing."""
    H, Hkv, D = shape
    g = torch.Generator().manual_seed(11 + H)
    for L0 in (1, 63, 64, 1000, 3001):
        k = bf16_values(Hkv, L0 + 64, D, g=g)
        v = bf16_values(Hkv, L0 + 64, D, g=g)
        q = bf16_values(H, 8, D, g=g, scale=2.0)
        plain = [cpu_attention.decode_attention(q[:, t:t + 1], k, v, None, L0 + t + 1, dot=True)[0] for t in range(8)]
        m = torch.zeros(8, L0 + 8, dtype=torch.bool)
        m[:, :L0] = True
        m[:, L0:] = tree_mask(list(range(-1, 7)))
        for group in (0, 1, 3, 8):
            for threads in (1, 2, 3):
                chain = cpu_attention.decode_attention(q, k, v, m, L0 + 8, dot=True, group=group, threads=threads)
                assert all(torch.equal(chain[t], plain[t]) for t in range(8)), (L0, group, threads)
        # a node at tree slot L0 + 6 with ancestors at L0 + 1, L0 + 4 (an odd and an even count of keys)
        for anc in ([1, 4, 6], [2, 6]):
            slots = [L0 + a for a in anc]
            k2, v2 = k.clone(), v.clone()
            for i, s in enumerate(slots):
                k2[:, L0 + i], v2[:, L0 + i] = k[:, s], v[:, s]
            mt = torch.zeros(1, L0 + 7, dtype=torch.bool)
            mt[0, :L0] = True
            mt[0, slots] = True
            node = cpu_attention.decode_attention(q[:, :1], k, v, mt, L0 + 7, dot=True)
            alone = cpu_attention.decode_attention(q[:, :1], k2, v2, None, L0 + len(slots), dot=True)
            assert torch.equal(node, alone), (L0, anc)


def test_a_bfloat16_cache_gives_the_bits_of_a_float32_one_holding_the_same_values():
    g = torch.Generator().manual_seed(5)
    k, v = bf16_values(2, 900, 128, g=g), bf16_values(2, 900, 128, g=g)
    q = bf16_values(12, 4, 128, g=g)
    a = cpu_attention.decode_attention(q, k, v, None, 870, dot=True)
    b = cpu_attention.decode_attention(q, k.to(torch.bfloat16), v.to(torch.bfloat16), None, 870, dot=True)
    assert torch.equal(a, b)


def test_segments_give_each_request_the_bits_it_gets_alone():
    """Continuous batching: several requests' rows in one call attend as each would alone."""
    g = torch.Generator().manual_seed(9)
    H, Hkv, D = 12, 2, 128
    segs, alone, qs, kvs, off = [], [], [], [], 0
    for L0, T in ((700, 1), (1500, 4), (64, 3)):
        k = bf16_values(Hkv, L0 + T + 8, D, g=g)
        v = bf16_values(Hkv, L0 + T + 8, D, g=g)
        q = bf16_values(H, T, D, g=g)
        kn, vn = bf16_values(Hkv, T, D, g=g), bf16_values(Hkv, T, D, g=g)
        m = torch.zeros(T, L0 + T, dtype=torch.bool)
        m[:, :L0] = True
        m[:, L0:] = tree_mask(list(range(-1, T - 1)))
        k1, v1 = k.clone(), v.clone()
        k1[:, L0:L0 + T], v1[:, L0:L0 + T] = kn, vn
        alone.append(cpu_attention.decode_attention(q, k1, v1, m, L0 + T, dot=True))
        segs.append((k, v, L0 + T, m, off, T))
        qs.append(q)
        kvs.append(torch.stack([kn, vn]))
        off += T
    out = cpu_attention.segment_attention(torch.cat(qs, 1), torch.cat(kvs, 2).contiguous(), segs, dot=True)
    assert torch.equal(out, torch.cat(alone))


def test_below_avx512bf16_the_mode_is_refused_by_name():
    level = cpu_isa.active()
    try:
        cpu_isa.set_isa("avx512")
        assert not cpu_attention.dot_runs()
        q = torch.zeros(12, 1, 128)
        k = torch.zeros(2, 8, 128)
        with pytest.raises(RuntimeError, match="avx512bf16"):
            cpu_attention.decode_attention(q, k, k, None, 4, dot=True)
    finally:
        cpu_isa.set_isa(level)
