"""``sgl_kernel`` stand-in for SGLang 0.5.23's CUDA path (no sglang-kernel, no FlashInfer).

TEST INFRASTRUCTURE ONLY: the GPU check kit (benchmarks/gpu/kit) installs it where
sglang-kernel cannot be brought (it is built against another torch). Two kinds of names:

* ops SGLang calls on the supported path, implemented in torch or by the wheel's own Triton
  kernels (``agentspec_sglang_cuda_standin.ops``): ``rmsnorm``, ``fused_add_rmsnorm``,
  ``top_k_renorm_prob``, ``top_p_renorm_prob``, ``utils.is_arch_support_pdl``;
* names SGLang imports at module level but never calls there: each raises
  ``NotProvidedError`` naming itself when called.

The rest of the CUDA path (the speculative tree ops, sampled verification, the KV-cache store)
is compiled by SGLang itself at first use; the plugin in ``agentspec_sglang_cuda_standin``
routes those to torch / Triton. README.md beside this package lists every name with the SGLang
file:line that imports or calls it.
"""

from __future__ import annotations

from agentspec_sglang_cuda_standin.ops import fused_add_rmsnorm, rmsnorm, top_k_renorm_prob, top_p_renorm_prob

from . import kvcacheio, quantization, utils  # noqa: F401
from ._stub import NotProvidedError, not_provided

__version__ = "0.0.0+agentspec.cuda.standin"
AGENTSPEC_CUDA_STANDIN = True   # the plugin acts only when this module is sgl_kernel

_FORCED_TORCH = "SGLANG_FORCE_FUSED_OP_BACKEND=torch runs this layer in torch"
silu_and_mul = not_provided("sgl_kernel.silu_and_mul", _FORCED_TORCH)
gelu_and_mul = not_provided("sgl_kernel.gelu_and_mul", _FORCED_TORCH)
gelu_tanh_and_mul = not_provided("sgl_kernel.gelu_tanh_and_mul", _FORCED_TORCH)
gemma_rmsnorm = not_provided("sgl_kernel.gemma_rmsnorm", "Gemma norms only")
gemma_fused_add_rmsnorm = not_provided("sgl_kernel.gemma_fused_add_rmsnorm", "Gemma norms only")
moe_sum = not_provided("sgl_kernel.moe_sum", "mixture-of-experts models only")
moe_sum_reduce = not_provided("sgl_kernel.moe_sum_reduce", "mixture-of-experts models only")
int8_scaled_mm = not_provided("sgl_kernel.int8_scaled_mm", "int8-quantized models only")

CALLED = ("rmsnorm", "fused_add_rmsnorm", "top_k_renorm_prob", "top_p_renorm_prob", "utils.is_arch_support_pdl")
IMPORT_ONLY = ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "gemma_rmsnorm", "gemma_fused_add_rmsnorm",
               "moe_sum", "moe_sum_reduce", "int8_scaled_mm") + tuple(
    f"quantization.{n}" for n in quantization.__all__) + tuple(f"kvcacheio.{n}" for n in kvcacheio.__all__)

__all__ = ["NotProvidedError", "fused_add_rmsnorm", "gelu_and_mul", "gelu_tanh_and_mul", "gemma_fused_add_rmsnorm",
           "gemma_rmsnorm", "int8_scaled_mm", "moe_sum", "moe_sum_reduce", "rmsnorm", "silu_and_mul",
           "top_k_renorm_prob", "top_p_renorm_prob"]
