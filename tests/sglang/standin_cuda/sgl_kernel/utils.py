"""``sgl_kernel.utils``: the one helper SGLang's CUDA path calls from it."""

from agentspec_sglang_cuda_standin.ops import is_arch_support_pdl

__all__ = ["is_arch_support_pdl"]
