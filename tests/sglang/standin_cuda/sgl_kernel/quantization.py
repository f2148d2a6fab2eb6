"""``sgl_kernel.quantization``: imported for GGUF-quantized models (srt/layers/quantization/gguf.py),
never called for an unquantized checkpoint."""

from ._stub import not_provided

__all__ = ["ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8"]
for _name in __all__:
    globals()[_name] = not_provided(f"sgl_kernel.quantization.{_name}", "GGUF-quantized models only")
