"""Process settings that must be in place before torch is imported (``agentspec/__init__``).

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
    isa = os.environ.get("AGENTSPEC_CPU_ISA", "").strip().lower()
    if isa in _TORCH_CAPS:
        aten, onednn = _TORCH_CAPS[isa]
        os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
