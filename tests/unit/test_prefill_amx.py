"""The AMX prefill attention (kernels/csrc/prefill_amx.cpp): accuracy against a float32
reference, a row's bits independent of the chunk it is computed in and of the thread count, the
packed cache it writes, bad arguments, and the engine taking it for prompts (skipped on CPUs
without AMX-BF16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentspec.kernels import cpu_attention
from test_cpu_attention import _packed_cache, _random_model  # (pytest puts this folder on sys.path)

pytestmark = pytest.mark.skipif(
    not (cpu_attention.available() and cpu_attention._cpu.prefill_amx_available()),
    reason="no AMX-BF16 on this CPU (or the kernels are not built)")

H, HKV, D = 9, 3, 64


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
    from agentspec.engine.model import KVCache, ModelArgs

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
    chunks are canonical: agentspec/engine/prefix_cache.py.)"""
    args, model = _random_model()  # tests/unit/test_cpu_attention.py's 3-layer bf16 model
    ids = torch.randint(0, args.vocab_size, (600,), generator=torch.Generator().manual_seed(3))

    def run(bounds):
        c = _packed_cache(args, 768)
        for s, e in zip(bounds, bounds[1:]):
            logits = model(ids[s:e], torch.arange(s, e), c, prefill=True)
            c.commit(list(range(e - s)))
        return logits, c

    calls = []
    real = cpu_attention.prefill_attention
    monkeypatch.setattr(cpu_attention, "prefill_attention", lambda *a, **kw: calls.append(a[5]) or real(*a, **kw))
    amx_logits, amx_cache = run([0, 256, 512, 600])
    assert sorted(set(calls)) == [0, 256, 512]  # every chunk, every layer, on AMX
    monkeypatch.setattr(cpu_attention, "_PREFILL_AMX", False)
    sdpa_logits, _ = run([0, 256, 512, 600])
    assert (amx_logits - sdpa_logits).abs().max().item() < 0.05 * sdpa_logits.abs().max().item()
    monkeypatch.setattr(cpu_attention, "_PREFILL_AMX", True)
    again_logits, again_cache = run([0, 256, 512, 600])  # deterministic
    assert torch.equal(again_logits, amx_logits)
    assert torch.equal(again_cache.k[:, :, :600], amx_cache.k[:, :, :600])
    assert torch.equal(again_cache.kt2[:, :, :, :600], amx_cache.kt2[:, :, :, :600])


def test_the_bundled_model_reports_and_runs_it(engine, rewrite_prompts, monkeypatch):
    """The engine says which prefill attention ran (start-up line, benchmark JSON), and on a real
    rewrite prompt the AMX path's next token and logits agree with the SDPA path's."""
    assert engine.kernel_info()["prefill_attention"] == "amx"
    ids = torch.tensor(max(rewrite_prompts, key=len)[:700])

    def last_logits():
        cache = engine.new_cache(768)
        with torch.inference_mode():
            for s in range(0, len(ids), 256):
                e = min(s + 256, len(ids))
                out = engine.model(ids[s:e], torch.arange(s, e), cache, logits_rows=slice(-1, None), prefill=True)
                cache.commit(list(range(e - s)))
        return out[0]

    amx = last_logits()
    monkeypatch.setattr(cpu_attention, "_PREFILL_AMX", False)
    sdpa = last_logits()
    # bf16 rounding differs between the two kernels and compounds over 30 layers: a few percent
    # of the logits' range (a wrong kernel is off by the whole range)
    assert (amx - sdpa).abs().max().item() < 0.05 * sdpa.abs().max().item()
    assert amx.argmax() == sdpa.argmax()


def test_a_model_with_more_than_4_query_heads_per_kv_head_falls_back():
    """The kernel keeps one score tile per query head of a kv head (at most 4): other models'
    prompts take SDPA instead of failing."""
    from agentspec.engine.model import KVCache, ModelArgs, Transformer

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
