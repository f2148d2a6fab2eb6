"""Whether the embedded engine speculates by default on its device.

Greedy speculation is exact only when a token's logits are the same bits whether its row is
verified among a draft's rows or decoded alone. On CPU the engine's native kernels are
row-invariant, or its plain steps are padded to match (``decode.step``). On CUDA the engine runs
torch's matmuls, attention and reductions, whose kernels (cuBLAS picks one by the number of rows,
among others) make a row's bits depend on how many rows share the forward: verified tokens can
differ from plain decoding where the target's top two logits are nearly tied (seen on an H200:
agent-turn outputs with suffix + EAGLE-3 speculation not identical to plain decoding). So on CUDA
speculation is off by default, with the reason in every request's record (``spec_reason``), unless
the engine runs ``deterministic=True`` (fixed-shape forwards: the same kernels for every step,
exact by construction) or the caller opts in knowing the outputs may differ
(``speculate_on_cuda=True`` or ``AGENTSPEC_CUDA_SPECULATION=1``).
"""

from __future__ import annotations

import os

OPT_IN_ENV = "AGENTSPEC_CUDA_SPECULATION"

CUDA_REASON = ("off on CUDA: verification is not row-invariant there (torch/cuBLAS kernels depend on how many "
               "rows share a forward), so greedy output with speculation could differ from plain decoding; "
               "deterministic=True makes it exact, speculate_on_cuda=True or AGENTSPEC_CUDA_SPECULATION=1 "
               "turns it on as it is")


def spec_off_reason(device_type: str, *, deterministic: bool, opt_in: bool | None = None,
                    environ: dict | None = None) -> str | None:
    """None where speculation may run by default on ``device_type`` ("cpu", "cuda", ...), else
    why it is off. ``opt_in`` None: ``$AGENTSPEC_CUDA_SPECULATION`` ("1"/"true" opt in)."""
    if device_type != "cuda" or deterministic:
        return None
    if opt_in is None:
        opt_in = (environ if environ is not None else os.environ).get(OPT_IN_ENV, "").strip().lower() in ("1", "true", "yes")
    return None if opt_in else CUDA_REASON
