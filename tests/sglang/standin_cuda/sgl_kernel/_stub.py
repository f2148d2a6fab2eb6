"""Names SGLang imports from ``sgl_kernel`` on its CUDA path but never calls there."""

from __future__ import annotations


class NotProvidedError(NotImplementedError):
    """A ``sgl_kernel`` op the CUDA stand-in only names: SGLang imports it at module level, and the
    path the stand-in supports (a Llama-family model, Triton attention,
    SGLANG_FORCE_FUSED_OP_BACKEND=torch, no HiCache, no quantization) never calls it."""


def not_provided(qualname: str, why: str):
    """A function named like the op that raises NotProvidedError naming it and why it is absent."""
    short = qualname.rsplit(".", 1)[-1]

    def op(*args, **kwargs):
        raise NotProvidedError(
            f"{qualname} is not provided by agentspec's CUDA stand-in for sgl_kernel ({why}); "
            "the stand-in serves a Llama-family model on the Triton attention backend with "
            "SGLANG_FORCE_FUSED_OP_BACKEND=torch: see tests/sglang/standin_cuda/README.md")

    op.__name__ = op.__qualname__ = short
    op.__module__ = qualname.rsplit(".", 1)[0]
    op.agentspec_not_provided = True
    return op
