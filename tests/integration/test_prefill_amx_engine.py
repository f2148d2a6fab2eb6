"""The bundled model's prompt prefill on the AMX path (kernels/csrc/amx.cpp through
Block.forward_amx): a prompt's logits and KV bits do not depend on how it is split into forwards,
so the prefix cache's chunks are the same whichever way a prompt was prefilled (skipped on CPUs
without AMX-BF16, and under an ISA cap below avx512bf16)."""

from __future__ import annotations

import pytest
import torch

from agentspec.kernels import cpu_attention

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (cpu_attention.available() and cpu_attention._cpu.prefill_amx_available()),
    reason="no AMX-BF16 on this CPU (or the kernels are not built)")]

H, HKV = 9, 3   # the bundled model's query and key/value heads


def _skip_unless_prompts_take_amx() -> None:
    if not cpu_attention.prefill_amx_runs(torch.bfloat16, H, HKV):
        pytest.skip("the bf16 kernels are capped below avx512bf16: prompts do not take the AMX path")


def test_the_bundled_models_prefill_does_not_depend_on_how_the_prompt_is_split(engine, rewrite_prompts):
    """On the AMX path end to end (Block.forward_amx) every prefill row is split-invariant: one
    forward over the prompt, the canonical 256-token chunks, 1024-token forwards (what
    Decoder.prefill takes here) and odd 16-aligned pieces give the same logits and the same KV
    bits, so the prefix cache's chunks are the same whichever way a prompt was prefilled."""
    _skip_unless_prompts_take_amx()
    assert engine.kernel_info()["kernel_plan"]["prefill_linears"] == "amx"
    ids = torch.tensor([t for p in sorted(rewrite_prompts, key=len, reverse=True) for t in p][:1100])
    n = len(ids)
    assert n == 1100
    assert engine.model.prefill_row_invariant(engine.new_cache(n + 16))

    def run(bounds):
        cache = engine.new_cache(n + 16)
        with torch.inference_mode():
            for s, e in zip(bounds, bounds[1:]):
                out = engine.model(ids[s:e], torch.arange(s, e), cache, logits_rows=slice(-1, None), prefill=True)
                cache.commit(list(range(e - s)))
        return out, cache

    ref, rc = run(list(range(0, n, 256)) + [n])
    for bounds in ([0, n], [0, 1024, n], [0, 16, 400, 528, 1040, n]):
        out, c = run(bounds)
        assert torch.equal(out, ref), bounds
        assert torch.equal(c.k[:, :, :n], rc.k[:, :, :n]) and torch.equal(c.v[:, :, :n], rc.v[:, :, :n]), bounds
        assert torch.equal(c.kt2[..., :n, :], rc.kt2[..., :n, :]), bounds
