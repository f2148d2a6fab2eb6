"""The kernel plan's choices (agentspec/backends/embedded/plan.py), for machines this one is not:
the facts are given, so the AMX, AVX2-only and no-extension plans are checked anywhere."""

from __future__ import annotations

import pytest
import torch

from agentspec.backends.embedded.plan import Facts, KernelPlan, Settings

AMX = Facts(extension=True, linear_kernels=True, amx=True, isa="avx512bf16", top_isa=True)
AMX_CAPPED = Facts(extension=True, linear_kernels=True, amx=True, isa="avx512", top_isa=False)
AVX512BF16 = Facts(extension=True, linear_kernels=True, amx=False, isa="avx512bf16", top_isa=True)
AVX2 = Facts(extension=True, linear_kernels=True, amx=False, isa="avx2", top_isa=False)
NONE = Facts(extension=False, linear_kernels=False, amx=False, isa="scalar", top_isa=False)

SMOL = dict(head_dim=64, n_heads=9, n_kv_heads=3, head_k=576)     # SmolLM2-135M
QWEN15 = dict(head_dim=128, n_heads=12, n_kv_heads=2, head_k=1536)  # Qwen2.5-Coder-1.5B


def plan(facts, shape=SMOL, *, dtype=torch.bfloat16, kv=torch.float32, packed=True, amx_weights=True, gemm_f32=False,
         settings=Settings()):
    return KernelPlan.choose(device=torch.device("cpu"), dtype=dtype, kv_dtype=kv, packed=packed,
                             amx_weights=amx_weights, gemm_f32=gemm_f32, settings=settings, facts=facts, **shape)


def rows(p):
    return (p.rows_path, p.rows_attention, p.rows_linears, p.rows_norms, p.head)


def prefill(p):
    return (p.prefill_attention, p.prefill_linears)


def test_amx_at_the_top_level_runs_everything_on_tiles():
    p = plan(AMX)
    assert rows(p) == ("fused", "amx", "amx", "native", "amx") and prefill(p) == ("amx", "amx") and p.kv_packed


def test_a_cap_below_the_top_level_leaves_the_tiles():
    p = plan(AMX_CAPPED)
    assert rows(p) == ("fused", "rows", "vector", "torch", "vector") and prefill(p) == ("sdpa", "bfloat16")


def test_avx512_bf16_without_amx_and_avx2():
    assert rows(plan(AVX512BF16)) == ("fused", "rows", "vector", "torch", "vector")
    assert prefill(plan(AVX512BF16)) == ("native", "bfloat16")
    p = plan(AVX2, gemm_f32=True)   # no bfloat16 dot products: prompts multiply in float32
    assert rows(p) == ("fused", "rows", "vector", "torch", "vector") and prefill(p) == ("torch", "float32")
    assert p.torch_linears == "float32"


def test_avx512_bf16_prompts_take_the_native_kernel_where_it_runs():
    """AVX512-BF16 without AMX: prompt attention on the VDPBF16PS kernel (head_dim 64 and 128, a
    float32 or bfloat16 cache, up to 8 query heads per kv head, the GGUF models' quantized linears
    included); capped below, on AMX CPUs, asked for SDPA, or off the native kernels: SDPA."""
    assert prefill(plan(AVX512BF16, QWEN15)) == ("native", "bfloat16")
    assert prefill(plan(AVX512BF16, QWEN15, kv=torch.bfloat16)) == ("native", "bfloat16")
    assert plan(AVX512BF16, QWEN15, packed=False).prefill_attention == "native"
    assert prefill(plan(AMX_CAPPED, QWEN15)) == ("sdpa", "bfloat16")
    assert prefill(plan(AMX, QWEN15)) == ("sdpa", "bfloat16")
    assert prefill(plan(AVX2, QWEN15)) == ("sdpa", "bfloat16")
    assert prefill(plan(AVX512BF16, QWEN15, settings=Settings(prefill_attention="sdpa"))) == ("sdpa", "bfloat16")
    assert prefill(plan(AVX512BF16, QWEN15, settings=Settings(native_attention=False))) == ("sdpa", "bfloat16")
    assert prefill(plan(AVX512BF16, dict(head_dim=64, n_heads=18, n_kv_heads=2, head_k=1152))) == ("sdpa", "bfloat16")
    assert plan(AVX512BF16, QWEN15).prefill_fallback == "native"


def test_head_dim_128_takes_the_layered_path_with_the_packed_linears_and_native_attention():
    p = plan(AMX, QWEN15)
    assert rows(p) == ("layered", "dot", "vector", "torch", "vector") and not p.kv_packed
    assert p.layered_linears == "vector" and p.layered_attention == "native" and prefill(p) == ("sdpa", "bfloat16")
    assert p.rows_dot
    # other head_dims have no native kernel: torch attention
    p = plan(AVX2, dict(head_dim=96, n_heads=8, n_kv_heads=2, head_k=768))
    assert rows(p) == ("layered", "torch", "vector", "torch", "vector") and p.layered_attention == "torch"


def test_the_plan_says_why_a_part_falls_back():
    assert plan(AMX).why == () and plan(AVX512BF16).why == ()   # each machine's best: nothing to explain
    p = plan(AMX, QWEN15)
    layered = "fused rows: head_dim 128 (the fused bfloat16 kernels take 64): layered rows, native attention"
    assert p.why == (layered, "AMX decode linears: they run on the fused rows path only",
                     "AMX prefill: head_dim 128 (64 only)")
    assert "[fused rows: head_dim 128" in p.describe()
    assert plan(AVX2, QWEN15).why == (layered,)
    assert plan(AVX2, dict(head_dim=96, n_heads=8, n_kv_heads=2, head_k=768)).why == (
        "native attention: head_dim 96 has no native kernel yet (64, 128): torch attention",)
    assert "query heads per kv head (native: 1-8)" in plan(AVX512BF16, dict(head_dim=64, n_heads=18, n_kv_heads=2,
                                                                             head_k=1152)).why[0]
    assert plan(AMX, dict(head_dim=64, n_heads=10, n_kv_heads=2, head_k=640)).why == (
        "AMX prefill: 5 query heads per kv head (AMX prefill: 1-4)",)
    assert "not built" in plan(NONE, packed=False).why[0]
    # a setting that asks for a slower kernel is not a fallback
    assert plan(AMX, settings=Settings(decode_linears="vector", prefill_attention="sdpa")).why == ()


def test_float32_models_and_no_extension():
    p = plan(AMX, dtype=torch.float32, packed=False)
    assert rows(p) == ("layered", "native", "torch", "torch", "torch") and prefill(p) == ("torch", "float32")
    p = plan(NONE, packed=False)
    assert rows(p) == ("layered", "torch", "torch", "torch", "torch") and prefill(p) == ("sdpa", "bfloat16")


@pytest.mark.parametrize("settings,want_rows,want_prefill", [
    (Settings(decode_attention="rows"), ("fused", "rows", "amx", "native", "amx"), ("amx", "amx")),
    (Settings(decode_linears="vector"), ("fused", "amx", "vector", "native", "vector"), ("amx", "amx")),
    (Settings(prefill_attention="blockwise"), ("fused", "amx", "amx", "native", "amx"), ("blockwise", "bfloat16")),
    (Settings(prefill_attention="sdpa"), ("fused", "amx", "amx", "native", "amx"), ("sdpa", "bfloat16")),
    (Settings(fused=False), ("layered", "dot", "vector", "torch", "vector"), ("amx", "amx")),
    (Settings(fused=False, decode_attention="float32"), ("layered", "native", "vector", "torch", "vector"),
     ("amx", "amx")),
    (Settings(native_attention=False), ("layered", "torch", "vector", "torch", "vector"), ("sdpa", "bfloat16")),
])
def test_settings_steer_the_choice(settings, want_rows, want_prefill):
    p = plan(AMX, settings=settings)
    assert rows(p) == want_rows and prefill(p) == want_prefill


def test_layered_rows_of_bfloat16_models_take_bfloat16_products_at_avx512bf16():
    """Decode / verify rows off the fused path (head_dim 128: the 1.5B; a bfloat16 cache): the
    native kernel's bfloat16-product mode where the CPU has AVX512-BF16 and the model's queries,
    keys and values are bfloat16; the float32 kernel below that level, for float32 models, or when
    AGENTSPEC_DECODE_ATTENTION=float32 asks for it."""
    for kv in (torch.float32, torch.bfloat16):
        assert plan(AVX512BF16, QWEN15, kv=kv).rows_attention == "dot"
        assert plan(AVX512BF16, kv=kv, settings=Settings(fused=False)).rows_attention == "dot"
        assert plan(AMX_CAPPED, QWEN15, kv=kv).rows_attention == "native"
        assert plan(AVX2, QWEN15, kv=kv).rows_attention == "native"
    assert plan(AVX512BF16, QWEN15, dtype=torch.float32, packed=False).rows_attention == "native"
    p = plan(AVX512BF16, QWEN15, settings=Settings(decode_attention="float32"))
    assert p.rows_attention == "native" and not p.rows_dot and p.layered_attention == "native"
    assert plan(AVX512BF16).rows_attention == "rows"   # the fused path keeps its own kernels


def test_more_than_4_query_heads_per_kv_head_keep_prompts_off_amx():
    p = plan(AMX, dict(head_dim=64, n_heads=10, n_kv_heads=2, head_k=640))
    assert prefill(p) == ("sdpa", "bfloat16") and p.rows_attention == "amx"   # decode takes up to 8


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("AGENTSPEC_DECODE_LINEARS", "vector")
    monkeypatch.setenv("AGENTSPEC_CPU_FUSED", "0")
    s = Settings.from_env()
    assert s.decode_linears == "vector" and not s.fused and s.native_attention
    monkeypatch.setenv("AGENTSPEC_PREFILL_ATTENTION", "flash")
    with pytest.raises(ValueError, match="AGENTSPEC_PREFILL_ATTENTION='flash'"):
        Settings.from_env()


def test_the_plan_says_itself():
    p = plan(AMX)
    assert "amx" in p.describe() and dict(p.table())["decode/verify rows: attention"] == "amx"
    assert p.to_dict()["rows_linears"] == "amx"


def test_a_model_asks_for_the_plan_of_the_facts_it_is_given():
    from helpers.models import random_model

    args, model = random_model(packed_linears=True)
    assert model.plan(AVX2).rows_attention == "rows"
    assert model.plan(AMX).rows_linears == ("amx" if model.layers[0].amx_linears else "vector")


def test_a_step_never_verifies_more_rows_than_the_decode_kernels_take():
    from agentspec.backends.embedded.model import SMALL_T
    from agentspec.decode.policy import MAX_STEP_ROWS

    assert MAX_STEP_ROWS <= SMALL_T


def test_quantized_weights_run_the_quantized_linears_everywhere():
    """A GGUF file's weights kept quantized: every projection and the head run the quantized
    linears (rows and prompts); the rest of the plan is the shape's (prompt attention on the
    VDPBF16PS kernel with AVX512-BF16, else SDPA; on AMX it stays on SDPA) and the plan says which quantized linears take the AMX-INT8 tiles."""
    for facts, shape, path in ((AVX512BF16, SMOL, "fused"), (AVX2, QWEN15, "layered"), (AMX, SMOL, "fused")):
        p = KernelPlan.choose(device=torch.device("cpu"), dtype=torch.bfloat16, kv_dtype=torch.float32, packed=True,
                              amx_weights=False, gemm_f32=False, settings=Settings(), facts=facts, quantized=True,
                              **shape)
        assert (p.rows_path, p.rows_linears, p.head, p.prefill_linears) == (path, "quantized", "quantized", "quantized")
        assert p.layered_linears == "quantized" == p.torch_linears
        assert p.prefill_attention == ("native" if facts is AVX512BF16 else "sdpa")
        assert ("AMX-INT8 tiles take prompt chunks of Q6_K" in " ".join(p.why)) == facts.amx
        assert "quantized" in p.describe()
