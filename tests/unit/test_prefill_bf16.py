"""agentspec.kernels._cpu prefill_bf16: prompt attention with AVX512-BF16's VDPBF16PS over a float32
or bfloat16 cache of bfloat16 values (the GGUF models' prompts). Against a float64 reference, and
the property the prefix cache rests on: a row's bits do not depend on the chunk it was prefilled
in, the other rows or the thread count."""

from __future__ import annotations

import math

import pytest
import torch

from agentspec.kernels import cpu_attention

pytestmark = pytest.mark.skipif(not cpu_attention.prefill_bf16_runs(),
                                reason="needs AVX512-BF16 and the native kernels (ISA level avx512bf16)")

SHAPES = [(12, 2, 128), (14, 2, 64), (9, 3, 64), (16, 2, 128), (4, 4, 64)]   # 6, 7, 3, 8, 1 heads per kv head


def make(g, H, Hkv, D, L, cap, kv_dtype=torch.float32):
    k = torch.randn(Hkv, cap, D, generator=g).to(torch.bfloat16).to(kv_dtype)
    v = torch.randn(Hkv, cap, D, generator=g).to(torch.bfloat16).to(kv_dtype)
    q = (torch.randn(H, L, D, generator=g) * 2).to(torch.bfloat16)
    return q, k, v


def reference(q, k, v, start):
    """float64 causal attention of q's rows (positions start ..) over keys 0 .. their position: [T, H * D]"""
    H, T, D = q.shape
    Hkv = k.shape[0]
    L = start + T
    kd = k[:, :L].double().repeat_interleave(H // Hkv, 0)
    vd = v[:, :L].double().repeat_interleave(H // Hkv, 0)
    s = q.double() @ kd.transpose(1, 2) / math.sqrt(D)
    s = s.masked_fill(torch.arange(L)[None] > torch.arange(start, L)[:, None], float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(0, 1).reshape(T, H * D)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-kv{s[1]}-d{s[2]}")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_matches_float64_attention(shape, kv_dtype):
    H, Hkv, D = shape
    g = torch.Generator().manual_seed(H * D)
    for start, T in ((0, 1), (0, 37), (37, 5), (64, 64), (300, 129)):
        q, k, v = make(g, H, Hkv, D, T, start + T + 70, kv_dtype)
        got = cpu_attention.prefill_bf16(q, k, v, start)
        want = reference(q, k, v, start)
        # the output's bfloat16 rounding (2^-9 of |o| <= ~3) and the weights' in bfloat16
        assert (got.double() - want).abs().max().item() < 0.03, (start, T)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-kv{s[1]}-d{s[2]}")
def test_a_rows_bits_do_not_depend_on_its_chunk(shape):
    """A prompt prefilled whole and in pieces (cut at any position, blocks of 64 keys or not) gives
    every row the same bits; so does a chunk started at a later position over the same cache."""
    H, Hkv, D = shape
    g = torch.Generator().manual_seed(7 + H)
    start, T = 150, 203
    q, k, v = make(g, H, Hkv, D, T, start + T + 40)
    whole = cpu_attention.prefill_bf16(q, k, v, start)
    for cuts in ((1,), (17, 64), (63, 64, 65, 130), (5, 6, 7, 8, 200)):
        pieces, a = [], 0
        for b in (*cuts, T):
            pieces.append(cpu_attention.prefill_bf16(q[:, a:b], k, v, start + a))
            a = b
        assert torch.equal(torch.cat(pieces), whole), cuts
    # keys past the chunk hold other values: no effect on the chunk's rows
    k2, v2 = k.clone(), v.clone()
    k2[:, start + 100:] = 7.0
    v2[:, start + 100:] = -3.0
    assert torch.equal(cpu_attention.prefill_bf16(q[:, :100], k2, v2, start), whole[:100])


def test_thread_count_does_not_change_bits():
    g = torch.Generator().manual_seed(3)
    q, k, v = make(g, 14, 2, 64, 90, 600)
    outs = [cpu_attention.prefill_bf16(q, k, v, 410, threads=n) for n in (1, 2, 3)]
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_bad_input_is_refused_with_the_reason(restore_isa):
    g = torch.Generator().manual_seed(1)
    q, k, v = make(g, 12, 2, 128, 8, 64)
    with pytest.raises(TypeError, match="bfloat16 q"):
        cpu_attention.prefill_bf16(q.float(), k, v, 0)
    with pytest.raises(ValueError, match="shapes"):
        cpu_attention.prefill_bf16(q, k, v, 60)   # past the capacity
    with pytest.raises(ValueError, match="head_dim"):
        cpu_attention.prefill_bf16(q[..., :96].contiguous(), k[..., :96].contiguous(), v[..., :96].contiguous(), 0)
    restore_isa.set_isa("avx512")
    assert not cpu_attention.prefill_bf16_runs()
    with pytest.raises(ValueError, match="AVX512-BF16"):
        cpu_attention.prefill_bf16(q, k, v, 0)
