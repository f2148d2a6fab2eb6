"""Process settings that must be in place before torch is imported (``agentspec/__init__``).

OpenMP waits passively (``OMP_WAIT_POLICY=PASSIVE``, unless set): libgomp's default spins a
waiting thread for up to 300,000 iterations between parallel regions, and a decode step has ~150
regions. When another process takes one of the two cores, the spinning threads compete with it
as CPU hogs, each region waits for a descheduled thread, and plain decoding fell to 0.3-1.6 tok/s
here (0.4 on the AVX2 machine of issue 13); a thread that sleeps while it waits is woken ahead of
the hog, and the same run kept 42-43 tok/s (benchmarks/bench_contention.py has the figures).

``AGENTSPEC_CPU_ISA`` caps agentspec's native kernels (``agentspec.kernels.cpu_isa``); so that a
machine with AVX-512 behaves as the lower machine would as a whole, it caps torch's own kernels
the same way (ATen's ``ATEN_CPU_CAPABILITY`` and oneDNN's ``ONEDNN_MAX_CPU_ISA``) unless those are
set already. Both are read once, when torch loads: setting the variable after torch was imported
caps agentspec's kernels only.
"""

from __future__ import annotations

import os

# AGENTSPEC_CPU_ISA -> (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA)
_TORCH_CAPS = {
    "scalar": ("default", "SSE41"),
    "avx2": ("avx2", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE"),
}


def apply() -> None:
    if os.environ.get("OMP_WAIT_POLICY") == "":
        del os.environ["OMP_WAIT_POLICY"]  # set but empty: libgomp's own default (benchmarks compare)
    else:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    isa = os.environ.get("AGENTSPEC_CPU_ISA", "").strip().lower()
    if isa in _TORCH_CAPS:
        aten, onednn = _TORCH_CAPS[isa]
        os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
