"""benchmarks/bench_kernels.py prefill-native: the native prompt attention against SDPA, one layer
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
