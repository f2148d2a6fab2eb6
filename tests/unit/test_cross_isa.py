"""The Arm (NEON) bodies of the bf16 linear and of the quantized linears, bit for bit against the
scalar ones, under qemu-user.

This machine cannot run aarch64 code natively: the tests cross-compile standalone harnesses
(tests/native/*_isa_check.cpp: the kernel bodies of kernels/csrc, no Python) and run them with
qemu-aarch64. Skipped, with the reason, where the cross compiler or qemu is missing
(``apt-get install g++-aarch64-linux-gnu qemu-user``). The quantized harness also runs natively on
x86 (its AVX2 and AVX512-VNNI bodies), where a mismatch shows up without an emulator."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.extended   # extended tier: the Arm bodies under qemu (make test-extended installs the cross compiler and qemu-user)

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64")
HOST_CXX = shutil.which("g++")


def _build_and_run(cxx: str, harness: str, tmp_path: Path, *, static: bool, runner: list[str]) -> int:
    """Compile tests/native/``harness``, run it (under ``runner``: qemu, or nothing), and return how
    many outputs it checked; fails on a mismatch or a harness that did not say "ok"."""
    exe = tmp_path / Path(harness).stem
    subprocess.run([cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Wno-psabi", *(["-static"] if static else []),
                    str(ROOT / "tests" / "native" / harness), "-o", str(exe)],
                   check=True, capture_output=True, text=True, timeout=300)
    r = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stdout + r.stderr
    return int(r.stdout.split()[1])


QUANT_OUTPUTS = 319872   # qlinear_isa_check per body: 8 layouts x 2 inputs x 357 rows x (16 + 40) outputs


@pytest.mark.skipif(CXX is None or QEMU is None, reason="needs aarch64-linux-gnu-g++ and qemu-aarch64")
def test_neon_linear_equals_scalar_bitwise(tmp_path):
    assert _build_and_run(CXX, "linear_isa_check.cpp", tmp_path, static=True, runner=[QEMU]) > 6000


@pytest.mark.skipif(CXX is None or QEMU is None, reason="needs aarch64-linux-gnu-g++ and qemu-aarch64")
def test_neon_quantized_linear_equals_scalar_bitwise(tmp_path):
    """qneon::panels against qscalar::panels: every repacked layout, plain and norm-fused rows."""
    assert _build_and_run(CXX, "qlinear_isa_check.cpp", tmp_path, static=True, runner=[QEMU]) >= QUANT_OUTPUTS


@pytest.mark.skipif(HOST_CXX is None or platform.machine() != "x86_64", reason="needs g++ on x86_64")
def test_x86_quantized_linear_bodies_equal_scalar_bitwise_standalone(tmp_path):
    """The same harness natively: the AVX2 body and, where the CPU has them, the AVX512-VNNI and
    AMX-INT8 ones (the latter takes Q6_K calls of 64 rows or more)."""
    assert _build_and_run(HOST_CXX, "qlinear_isa_check.cpp", tmp_path, static=False, runner=[]) >= QUANT_OUTPUTS


@pytest.mark.skipif(CXX is None, reason="needs aarch64-linux-gnu-g++")
def test_kernels_compile_for_aarch64(tmp_path):
    """Every native kernel source builds for Arm (no x86-only attributes outside x86 guards).
    -O0 and the sources side by side: whether it compiles is the question, not the code."""
    import sysconfig

    import nanobind

    nb = Path(nanobind.__file__).parent
    sources = sorted((ROOT / "kernels" / "csrc").glob("*.cpp"))  # what CMakeLists.txt compiles
    assert {"module.cpp", "attention.cpp", "qkv_attention.cpp", "linear.cpp"} <= {p.name for p in sources}
    procs = {}
    for src in sources:
        procs[src.name] = subprocess.Popen(
            [CXX, "-std=c++17", "-O0", "-fopenmp", "-Wall", "-Wno-psabi", "-c",
             str(src), "-o", str(tmp_path / (src.name + ".o")),
             f"-I{nb / 'include'}", f"-I{nb / 'ext' / 'robin_map' / 'include'}",
             f"-I{sysconfig.get_paths()['include']}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for src, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (src, err[-3000:])
