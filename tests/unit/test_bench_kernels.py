"""benchmarks/bench_kernels.py quant-linears: the bundled model's quantized linears timed at the AVX2
level beside the peak loop of the AVX2 body's own instructions (benchmarks/native/int8_peak.cpp,
compiled and run for real), and its refusals of bad arguments. What the numbers are is not tested
(no wall-clock asserts): that they are there, and how they relate."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from agentspec.backends.embedded.weights import bundled_model_path
from agentspec.kernels import cpu_isa
from benchmarks.bench_kernels import PEAK_SOURCE, main

pytestmark = pytest.mark.skipif("avx2" not in cpu_isa.supported() or not shutil.which("c++"),
                                reason="needs an x86 CPU with AVX2 and a C++ compiler")


@pytest.mark.extended   # (benchmark tooling, seconds: the extended tier)
def test_quant_linears_reports_the_body_against_its_peak(tmp_path, restore_isa):
    out = tmp_path / "q.json"
    assert main(["quant-linears", "--model", str(bundled_model_path()), "--rows", "1,4", "--isas", "avx2",
                 "--repeat", "1", "--threads", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["layers"] == 30 and r["products_per_row"] > 100_000_000   # SmolLM2-135M: 30 layers, ~106M
    assert set(r["types"]) == {"qkv", "o", "gate_up", "down"}
    peak = r["peak_loops"]["avx2"]
    assert peak["loop"] == "avx2" and peak["threads"] == 1 and peak["gmacs_per_s"] > 0
    assert [(c["isa"], c["body"], c["rows"]) for c in r["results"]] == [("avx2", "avx2", 1), ("avx2", "avx2", 4)]
    for c in r["results"]:
        assert c["of_peak"] == round(c["gmacs_per_s"] / peak["gmacs_per_s"], 3)
        assert set(c["ms_per_projection"]) == set(r["types"]) and c["ms"] >= sum(c["ms_per_projection"].values()) * 0.999
    assert r["machine"]["cpu"]
    assert cpu_isa.active() == restore_isa.active()   # the level was put back


@pytest.mark.parametrize("argv,msg", [
    (["--rows", "0"], "--rows: integers >= 1"),
    (["--rows", "a,b"], "--rows takes comma-separated integers"),
    (["--isas", "amx"], "--isas amx: not an ISA level this CPU runs"),
])
def test_quant_linears_refuses_bad_arguments_by_name(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        main(["quant-linears", "--model", str(bundled_model_path()), *argv])


def test_quant_linears_refuses_a_missing_model(tmp_path):
    with pytest.raises(SystemExit, match="no such GGUF file"):
        main(["quant-linears", "--model", str(tmp_path / "none.gguf")])


def test_peak_loop_program_checks_its_arguments(tmp_path):
    exe = tmp_path / "int8_peak"
    subprocess.run(["c++", "-O2", "-std=c++17", "-pthread", str(PEAK_SOURCE), "-o", str(exe)], check=True)
    for args in ([], ["avx3", "1", "1"], ["avx2", "0", "1"], ["avx2", "1", "-1"]):
        p = subprocess.run([str(exe), *args], capture_output=True, text=True)
        assert p.returncode == 2 and "int8_peak" in p.stderr, (args, p.stderr)
    p = subprocess.run([str(exe), "avx2", "2", "0.05"], capture_output=True, text=True, check=True)
    r = json.loads(p.stdout)
    assert r["loop"] == "avx2" and r["threads"] == 2 and r["gmacs_per_s"] > 0


def test_verify_groups_reports_both_ways_with_the_same_bits(tmp_path):
    out = tmp_path / "v.json"
    assert main(["verify-groups", "--contexts", "100", "--shapes", "2x3", "--repeat", "1", "--rounds", "1",
                 "--threads", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    (c,) = r["results"]
    assert (c["context"], c["requests"], c["rows_each"]) == (100, 2, 3) and c["same_bits"] is True
    assert c["one_row_ms"] > 0 and c["grouped_ms"] > 0 and c["speedup"] > 0
    assert r["machine"]["cpu"]

