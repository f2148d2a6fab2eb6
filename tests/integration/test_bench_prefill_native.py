"""benchmarks/bench_kernels.py prefill-native and dot-attention: the native prompt attention against SDPA, one layer
at two models' shapes and the bundled model prefilling after a cached history, both kernels in the
report with the plan that ran; refused by name below AVX512-BF16. What the numbers are is not
tested (no wall-clock asserts)."""

from __future__ import annotations

import json

import pytest

from agentspec.backends.embedded.weights import bundled_model_path
from agentspec.kernels import cpu_attention
from benchmarks.bench_kernels import main


def test_prefill_native_reports_both_kernels(tmp_path, restore_isa, monkeypatch):
    if not cpu_attention.prefill_bf16_runs():
        with pytest.raises(SystemExit, match="AVX512-BF16"):
            main(["prefill-native"])
        return
    out = tmp_path / "p.json"
    assert main(["prefill-native", "--contexts", "16", "--chunk", "40", "--repeat", "1", "--model",
                 str(bundled_model_path()), "--history", "100", "--new", "30", "--rounds", "1", "--threads", "1",
                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert {x["shape"] for x in r["layer"]} == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}
    assert all(x["native_ms"] > 0 and x["sdpa_ms"] > 0 for x in r["layer"])
    (row,) = r["model"]["prefill"]
    assert (row["history"], row["new"]) == (100, 30) and row["native_s"] > 0 and row["sdpa_s"] > 0
    assert r["machine"]["kernel_plan"]["prefill_attention"] == "native"
    monkeypatch.setenv("AGENTSPEC_CPU_ISA", "avx512")   # capped below the kernel's level: refused by name
    with pytest.raises(SystemExit, match="AVX512-BF16"):
        main(["prefill-native"])


def test_dot_attention_reports_the_four_kernel_and_cache_pairs(tmp_path, restore_isa, monkeypatch):
    """bench_kernels dot-attention: the float32 kernel and its bfloat16-product mode over float32
    and bfloat16 caches, each context and row count; refused by name below AVX512-BF16."""
    if not cpu_attention.dot_runs():
        with pytest.raises(SystemExit, match="AVX512-BF16"):
            main(["dot-attention"])
        return
    out = tmp_path / "d.json"
    assert main(["dot-attention", "--contexts", "40,130", "--rows", "1,3", "--repeat", "1", "--rounds", "1",
                 "--threads", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [(x["context"], x["rows"]) for x in r["results"]] == [(40, 1), (40, 3), (130, 1), (130, 3)]
    for x in r["results"]:
        assert len(x["ms_a_layer"]) == 4 and all(v > 0 for v in x["ms_a_layer"].values())
        assert x["speedup_vs_float32_kernel_float32_cache"]["float32 kernel, float32 cache"] == 1.0
    monkeypatch.setenv("AGENTSPEC_CPU_ISA", "avx512")
    with pytest.raises(SystemExit, match="AVX512-BF16"):
        main(["dot-attention"])


def test_verify_step_reports_each_row_count_and_its_attention(tmp_path):
    """bench_kernels verify-step on the bundled model: one forward per row count after a short
    context, its attention's part within it."""
    out = tmp_path / "v.json"
    assert main(["verify-step", "--model", str(bundled_model_path()), "--context", "300", "--rows", "1,3",
                 "--repeat", "1", "--threads", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [x["rows"] for x in r["results"]] == [1, 3] and r["context"] == 300
    assert all(x["step_ms"] > 0 and 0 <= x["attention_ms"] <= x["step_ms"] for x in r["results"])
    assert r["machine"]["kernel_plan"]
