"""The AMX prefill attention (kernels/csrc/amx.cpp): accuracy against a float32
reference, a row's bits independent of the chunk it is computed in and of the thread count, the
packed cache it writes, bad arguments (skipped on CPUs without AMX-BF16); the bundled
model's prefill on it is tested in tests/integration/test_prefill_amx_engine.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentspec.kernels import cpu_attention
from helpers.models import packed_cache, random_model

pytestmark = pytest.mark.skipif(
    not (cpu_attention.available() and cpu_attention._cpu.prefill_amx_available()),
    reason="no AMX-BF16 on this CPU (or the kernels are not built)")

H, HKV, D = 9, 3, 64


def _skip_unless_prompts_take_amx() -> None:
    """The engine-level tests need the AMX path to run now: it does not under an ISA cap below
    avx512bf16 (AGENTSPEC_CPU_ISA=avx2 and the like), where prompts take SDPA."""
    if not cpu_attention.prefill_amx_runs(torch.bfloat16, H, HKV):
        pytest.skip("the bf16 kernels are capped below avx512bf16: prompts do not take the AMX path")


class _Cache:
    """The packed half of a KVCache layer: what prefill_attention reads and writes."""

    def __init__(self, cap: int):
        self.packed = True
        self.capacity = cap
        self.kt2 = torch.zeros(1, HKV, D // 2, cap, 2, dtype=torch.bfloat16)
        self.vp = torch.zeros(1, HKV, cap // 2, D, 2, dtype=torch.bfloat16)


def _qkv(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(H, n, D, generator=g) * 2).bfloat16()
    k = (torch.randn(HKV, n, D, generator=g) * 2).bfloat16()
    v = torch.randn(HKV, n, D, generator=g).bfloat16()
    return q, k, v


def _chunked(q, k, v, cache, bounds, threads=0):
    outs = []
    for s, e in zip(bounds, bounds[1:]):
        outs.append(cpu_attention.prefill_attention(q[:, s:e], k[:, s:e], v[:, s:e], cache, 0, s, threads=threads))
    return torch.cat(outs)


def _reference(q, k, v):
    n = q.shape[1]
    o = F.scaled_dot_product_attention(q.double().unsqueeze(0), k.double().unsqueeze(0), v.double().unsqueeze(0),
                                       is_causal=True, enable_gqa=True)[0]
    return o.transpose(0, 1).reshape(n, H * D)


def test_matches_float64_reference_as_closely_as_sdpa_bf16():
    n = 1000
    q, k, v = _qkv(n)
    out = _chunked(q, k, v, _Cache(1024), [0, 256, 512, 768, n])
    ref = _reference(q, k, v)
    sdpa = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
                                          enable_gqa=True)[0].transpose(0, 1).reshape(n, H * D)
    err = (out.double() - ref).abs().max().item()
    err_sdpa = (sdpa.double() - ref).abs().max().item()
    assert err <= 1.5 * err_sdpa + 1e-3, (err, err_sdpa)
    assert err < 0.02


def test_a_rows_bits_do_not_depend_on_its_chunk_or_the_thread_count():
    n = 700
    q, k, v = _qkv(n, seed=1)
    whole = _chunked(q, k, v, _Cache(768), [0, n])
    for bounds in ([0, 256, 512, n], [0, 16, 48, 256, 272, 688, n], list(range(0, n, 16)) + [n]):
        assert torch.equal(_chunked(q, k, v, _Cache(768), bounds), whole), bounds
    assert torch.equal(_chunked(q, k, v, _Cache(768), [0, 256, 512, n], threads=1), whole)
    # a chunk recomputed over a cache that already holds later keys: they stay invisible
    c = _Cache(768)
    _chunked(q, k, v, c, [0, n])
    assert torch.equal(cpu_attention.prefill_attention(q[:, 256:512], k[:, 256:512], v[:, 256:512], c, 0, 256),
                       whole[256:512])


def test_writes_the_packed_copies_the_decode_kernels_read():
    from agentspec.backends.embedded.model import KVCache, ModelArgs

    args = ModelArgs(dim=576, n_layers=1, n_heads=H, n_kv_heads=HKV, hidden_dim=256, vocab_size=300,
                     max_seq_len=1024)
    n = 301
    q, k, v = _qkv(n, seed=2)
    amx = KVCache(args, 512, dtype=torch.float32, device=torch.device("cpu"), packed=True)
    cpu_attention.prefill_attention(q, k, v, amx, 0, 0)
    ref = KVCache(args, 512, dtype=torch.float32, device=torch.device("cpu"), packed=True)
    ref.write(0, 0, k.float(), v.float())
    ref.sync(range(n))
    assert torch.equal(amx.kt2[:, :, :, :n], ref.kt2[:, :, :, :n])
    assert torch.equal(amx.vp[:, :, : n // 2], ref.vp[:, :, : n // 2])
    assert torch.equal(amx.vp[:, :, n // 2, :, 0], ref.vp[:, :, n // 2, :, 0])  # the odd slot's pair half


def test_bad_arguments_are_refused():
    q, k, v = _qkv(40)
    c = _Cache(256)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_attention.prefill_attention(q[:, 8:40], k[:, 8:40], v[:, 8:40], c, 0, 8)
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_attention.prefill_attention(q, k, v, c, 0, 224)
    with pytest.raises(TypeError, match="bfloat16"):
        cpu_attention.prefill_attention(q.float(), k, v, c, 0, 0)
    with pytest.raises(ValueError, match="shapes"):
        cpu_attention.prefill_attention(q, k[:, :20], v, c, 0, 0)


def test_the_model_prefills_through_it_and_matches_the_sdpa_path(monkeypatch):
    """A random bf16 model over a packed cache: a prompt's canonical chunks take the AMX path; its
    logits agree with the SDPA path's to bf16 accuracy, and a rerun gives the same bits. (Other
    chunk boundaries would change the bits through torch's GEMM, which is why the engine's prompt
    chunks are canonical: agentspec/backends/embedded/prefix_cache.py.)"""
    _skip_unless_prompts_take_amx()
    args, model = random_model()  # tests/unit/test_cpu_attention.py's 3-layer bf16 model
    ids = torch.randint(0, args.vocab_size, (600,), generator=torch.Generator().manual_seed(3))

    def run(bounds):
        c = packed_cache(args, 768)
        for s, e in zip(bounds, bounds[1:]):
            logits = model(ids[s:e], torch.arange(s, e), c, prefill=True)
            c.commit(list(range(e - s)))
        return logits, c

    calls = []
    real = cpu_attention.prefill_attention
    monkeypatch.setattr(cpu_attention, "prefill_attention", lambda *a, **kw: calls.append(a[5]) or real(*a, **kw))
    amx_logits, amx_cache = run([0, 256, 512, 600])
    assert sorted(set(calls)) == [0, 256, 512]  # every chunk, every layer, on AMX
    settings = model.kernel_settings
    model.set_kernel_settings(settings.with_(prefill_attention="sdpa"))
    sdpa_logits, _ = run([0, 256, 512, 600])
    assert (amx_logits - sdpa_logits).abs().max().item() < 0.05 * sdpa_logits.abs().max().item()
    model.set_kernel_settings(settings)
    again_logits, again_cache = run([0, 256, 512, 600])  # deterministic
    assert torch.equal(again_logits, amx_logits)
    assert torch.equal(again_cache.k[:, :, :600], amx_cache.k[:, :, :600])
    assert torch.equal(again_cache.kt2[:, :, :, :600], amx_cache.kt2[:, :, :, :600])


def test_a_model_with_more_than_4_query_heads_per_kv_head_falls_back():
    """The kernel keeps one score tile per query head of a kv head (at most 4): other models'
    prompts take SDPA instead of failing."""
    _skip_unless_prompts_take_amx()
    from agentspec.backends.embedded.model import KVCache, ModelArgs, Transformer

    args = ModelArgs(dim=640, n_layers=1, n_heads=10, n_kv_heads=2, hidden_dim=128, vocab_size=100,
                     max_seq_len=512)
    assert not cpu_attention.prefill_amx_supported(_Cache(256), torch.bfloat16, 10, 2)
    assert cpu_attention.prefill_amx_supported(_Cache(256), torch.bfloat16, 9, 3)
    torch.manual_seed(0)
    model = Transformer(args).eval().to(torch.bfloat16)
    c = KVCache(args, 256, dtype=torch.float32, device=torch.device("cpu"), packed=True)
    out = model(torch.arange(40), torch.arange(40), c, logits_rows=slice(-1, None), prefill=True)
    assert out.shape == (1, 100) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="1 to 4 times"):
        q = torch.zeros(10, 16, 64, dtype=torch.bfloat16)
        kv = torch.zeros(2, 16, 64, dtype=torch.bfloat16)
        c2 = _Cache(256)
        cpu_attention.prefill_attention(q, kv, kv, c2, 0, 0)


# --- the rest of a prompt chunk's layer on AMX: projections, norms, rotary (Block.forward_amx) ---

def _packed_linear(n: int, k: int, seed: int):
    from agentspec.kernels import cpu_linear

    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()
    return w, cpu_linear.PackedLinear(w)


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (64, 40)])
def test_amx_linear_is_accurate_and_row_and_thread_invariant(k, n):
    w, lin = _packed_linear(n, k, seed=k + n)
    x = torch.randn(203, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = lin.prefill(x)
    ref = F.linear(x.double(), w.double())
    err = (out.double() - ref).abs().max().item()
    err_torch = (F.linear(x, w).double() - ref).abs().max().item()
    assert err <= err_torch * 1.01 + 1e-6, (err, err_torch)  # one float32 sum, rounded once: as torch's
    for a, b in ((0, 1), (5, 37), (16, 48), (190, 203)):  # any rows, any tile position
        assert torch.equal(lin.prefill(x[a:b]), out[a:b]), (a, b)
    assert torch.equal(lin.prefill(x, threads=1), out)


def test_amx_linear_epilogues_round_as_torch_does():
    """``residual``: residual + x W^T, each rounded to bf16 as torch adds them; ``silu``:
    silu(gate) * up of the [gate; up] projection, as torch computes it in bf16."""
    w, lin = _packed_linear(576, 1536, seed=5)
    x = torch.randn(77, 1536, generator=torch.Generator().manual_seed(2)).bfloat16()
    r = torch.randn(77, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(lin.prefill(x, residual=r), r + lin.prefill(x))
    wg, glin = _packed_linear(2 * 1536, 576, seed=6)
    h = torch.randn(77, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    gate, up = glin.prefill(h).chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = glin.prefill(h, silu=True)
    # the exp differs from torch's in the last float32 bits: at most rarely one bf16 step
    diff = (got.float() - ref.float()).abs()
    assert (diff > 0).float().mean().item() < 1e-3
    assert (diff <= ref.float().abs() * 2 ** -7 + 1e-30).all()


def test_amx_linear_refuses_bad_shapes():
    w, lin = _packed_linear(64, 48, seed=7)  # K = 48: not whole 32-column tiles
    with pytest.raises(ValueError, match="multiple of 32"):
        lin.prefill(torch.zeros(4, 48, dtype=torch.bfloat16))
    w, lin = _packed_linear(48, 64, seed=8)
    with pytest.raises(ValueError, match="SILU needs N a multiple of 32"):
        lin.prefill(torch.zeros(4, 64, dtype=torch.bfloat16), silu=True)
    with pytest.raises(ValueError, match="residual"):
        lin.prefill(torch.zeros(4, 64, dtype=torch.bfloat16), residual=torch.zeros(4, 47, dtype=torch.bfloat16))


def test_native_rms_norm_matches_torch():
    x = (torch.randn(300, 576, generator=torch.Generator().manual_seed(9)) * 3).bfloat16()
    w = (torch.rand(576, generator=torch.Generator().manual_seed(10)) + 0.5).bfloat16()
    got = cpu_attention.rms_norm(x, w, 1e-5)
    ref = F.rms_norm(x, (576,), w, 1e-5)
    diff = (got.float() - ref.float()).abs()
    assert (diff > 0).float().mean().item() < 1e-3  # the mean's summation order differs
    assert (diff <= ref.float().abs() * 2 ** -7).all()
    assert torch.equal(cpu_attention.rms_norm(x[17:40], w, 1e-5), got[17:40])  # row-wise


def test_qkv_attention_is_rotary_then_prefill_attention_bit_for_bit():
    """prefill_qkv_attention (rotary, cache writes and attention in one call) equals torch's
    rotary (model.apply_rope in bf16), KVCache.write and prefill_attention: output, float32 cache
    and packed copies."""
    from agentspec.backends.embedded.model import KVCache, ModelArgs
    from agentspec.kernels.rope import apply_rope, rope_cos_sin

    args = ModelArgs(dim=576, n_layers=1, n_heads=H, n_kv_heads=HKV, hidden_dim=256, vocab_size=300,
                     max_seq_len=1024)
    a = KVCache(args, 640, dtype=torch.float32, device=torch.device("cpu"), packed=True)
    b = KVCache(args, 640, dtype=torch.float32, device=torch.device("cpu"), packed=True)
    g = torch.Generator().manual_seed(11)
    for start, T in ((0, 256), (256, 256), (512, 93)):
        qkv = (torch.randn(T, (H + 2 * HKV) * D, generator=g) * 2).bfloat16()
        cos, sin = (t.bfloat16() for t in rope_cos_sin(10000.0, D, torch.arange(start, start + T)))
        q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
        q = apply_rope(q.view(T, H, D).transpose(0, 1), cos, sin)
        k = apply_rope(k.view(T, HKV, D).transpose(0, 1), cos, sin)
        v = v.view(T, HKV, D).transpose(0, 1)
        a.write(0, start, k, v)
        want = cpu_attention.prefill_attention(q, k, v, a, 0, start)
        got = cpu_attention.prefill_qkv_attention(qkv, cos, sin, b, 0, start, n_heads=H, n_kv_heads=HKV)
        assert torch.equal(got, want), start
    n = 605
    assert torch.equal(a.k[:, :, :n], b.k[:, :, :n]) and torch.equal(a.v[:, :, :n], b.v[:, :, :n])
    assert torch.equal(a.kt2[..., :n, :], b.kt2[..., :n, :])
    assert torch.equal(a.vp[:, :, : n // 2], b.vp[:, :, : n // 2])
