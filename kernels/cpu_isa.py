"""Which CPU kernel variant runs here, and the machine facts benchmarks and caches record.

The native kernels (``agentspec.kernels._cpu``) come in ISA variants, each computing the same
bits: ``avx512bf16`` (the VDPBF16PS instruction), ``avx512`` and ``avx2`` (its emulation with
512- / 256-bit vectors and FMA), ``neon`` (Arm) and ``scalar`` (portable C++). The best variant the
CPU runs is chosen at import; ``AGENTSPEC_CPU_ISA=avx2|scalar|...`` caps it (a machine with
AVX512-BF16 can then test and benchmark the lower paths), ``set_isa`` does the same in tests.
"""

from __future__ import annotations

import functools
import os
import platform

__all__ = ["ISA_LEVELS", "active", "apply_env", "best", "bf16_native", "has_bf16_instructions", "machine_info", "set_isa", "supported", "usable_cpus"]

ISA_LEVELS = ("scalar", "neon", "avx2", "avx512", "avx512bf16")


_ENV = "AGENTSPEC_CPU_ISA"


def _cpu():
    import torch  # noqa: F401  (first: the extension uses the libgomp.so.1 that torch's wheel loads)

    try:
        from . import _cpu as mod
    except ImportError:  # not built
        return None
    return mod


def supported() -> list[str]:
    """ISA variants this CPU can execute, lowest first (``["scalar"]`` without the extension)."""
    mod = _cpu()
    if mod is None:
        return ["scalar"]
    return [name for i, name in enumerate(ISA_LEVELS) if mod.isa_runs(i)]


def best() -> str:
    """The best variant this CPU runs."""
    return supported()[-1]


def active() -> str:
    """The ISA variant the bfloat16 kernels run now."""
    mod = _cpu()
    return "scalar" if mod is None else ISA_LEVELS[mod.isa()]


def set_isa(name: str | None) -> str:
    """Run the kernels at the best variant up to ``name`` (None: the best this CPU runs); returns
    the active variant. ``name`` must be one of ``ISA_LEVELS``."""
    mod = _cpu()
    if name is not None and name not in ISA_LEVELS:
        raise ValueError(f"unknown CPU ISA {name!r}: use one of {', '.join(ISA_LEVELS)}")
    if mod is None:
        return "scalar"
    if name is None:
        mod.set_isa(-1)
    else:
        cap = ISA_LEVELS.index(name)
        mod.set_isa(max(i for i in range(cap + 1) if mod.isa_runs(i)))
    return active()


def apply_env() -> str:
    """Apply ``$AGENTSPEC_CPU_ISA`` (a cap; unset or empty: the best); returns the active variant.
    An unknown name is an error naming the value."""
    value = os.environ.get(_ENV, "").strip().lower()
    if value and value not in ISA_LEVELS:
        raise ValueError(f"{_ENV}={value!r} is not a CPU ISA: use one of {', '.join(ISA_LEVELS)}")
    return set_isa(value or None)


def has_bf16_instructions() -> bool:
    """Whether the CPU has bfloat16 dot-product instructions (AVX512-BF16, AMX or Arm BF16)."""
    flags = set(_cpuinfo()[1])
    return bool({"avx512_bf16", "amx_bf16"} & flags) or ("bf16" in flags and platform.machine() in ("aarch64", "arm64"))


def bf16_native() -> bool:
    """Whether the kernels run uncapped on a CPU with bfloat16 dot-product instructions, and so (we
    take it) torch's bfloat16 GEMM runs at full speed; elsewhere prefill multiplies in float32
    (``Transformer.set_gemm_float32``). A cap below the best level behaves as a CPU without them."""
    return active() == best() and has_bf16_instructions()


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, tuple[str, ...]]:
    """(CPU model name, flags) from /proc/cpuinfo (read once: they do not change)."""
    model = platform.processor() or platform.machine()
    flags: tuple[str, ...] = ()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                if line.startswith(("flags", "Features")):
                    flags = tuple(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model, flags


def usable_cpus() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (containers,
    CI runners: ``cpu.max`` of cgroup v2 or ``cpu.cfs_quota_us`` of v1), at least 1."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = None
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            q, period = f.read().split()[:2]
            if q != "max":
                quota = int(q) / int(period)
    except (OSError, ValueError):
        try:
            with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
                q = int(f.read())
            with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
                period = int(f.read())
            if q > 0 and period > 0:
                quota = q / period
        except (OSError, ValueError):
            pass
    if quota is not None:
        n = min(n, max(1, int(quota + 0.5)))
    return max(1, n)


def machine_info() -> dict:
    """CPU model, the flags that matter for the kernels, cores usable by this process, kernel ISA."""
    model, flags = _cpuinfo()
    keep = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni", "asimd", "bf16", "sve"}
    return {"cpu": model, "flags": sorted(keep & set(flags)), "isa": active(),
            "cpus_usable": usable_cpus(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}
