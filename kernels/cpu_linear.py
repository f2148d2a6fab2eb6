"""Row-invariant bfloat16 linear layers for decode / verify rows on CPU (native: ``_cpu.linear_bf16``).

``PackedLinear(weight)`` keeps a ``[N, K]`` bfloat16 weight in 16-column panels of bfloat16
pairs (``[ceil(N/16), K/2, 16, 2]``, the operand layout of AVX512-BF16's ``VDPBF16PS``) and
computes ``x @ weight.T`` for a few rows at close to memory bandwidth, with the instruction or an
emulation of it (AVX-512, AVX2 + FMA, NEON or scalar: the same bits; ``cpu_isa``). Each output element is
one fixed-order float32 reduction over the column pairs, rounded once to bfloat16, so a row's
result is the same bits whatever else shares the call (see kernels/csrc/linear.cpp): the
engine's decode and verify forwards need no padding row, and a draft-tree node, the same token
in plain decoding and the same row in a batch of requests agree by construction.
"""

from __future__ import annotations

import torch

from .cpu_attention import _cpu, available

__all__ = ["PackedLinear", "amx_linear_supported", "argmax_rows", "linear_supported", "pack_weight", "unpack_weight"]

def linear_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``PackedLinear`` can serve a ``dtype`` model on ``device`` here (the extension built
    with the linears, bfloat16, CPU). Whether decode rows use it is the kernel plan's call
    (agentspec.backends.embedded.plan: AGENTSPEC_CPU_LINEAR, AGENTSPEC_DECODE_LINEARS)."""
    return available() and hasattr(_cpu, "linear_bf16") and dtype == torch.bfloat16 and torch.device(device).type == "cpu"


def amx_linear_supported(weight: torch.Tensor) -> bool:
    """Whether ``PackedLinear(weight).prefill`` can run here: a CPU (and OS) with AMX-BF16 and K a
    multiple of 32 (whether a forward takes it is the kernel plan's call)."""
    return (linear_supported(weight.dtype, weight.device) and weight.shape[1] % 32 == 0
            and _cpu.prefill_amx_available())


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` ``[M]`` int64 for logits ``x`` ``[M, N]``: the same index as torch's
    (the first of the maximum; a NaN counts as the maximum). bfloat16 rows on CPU are read once,
    natively (kernels/csrc/argmax.cpp: torch's bfloat16 argmax is ~2.5x slower than its float32
    one); anything else goes to torch."""
    if (_cpu is None or not hasattr(_cpu, "argmax_bf16") or x.dtype != torch.bfloat16 or x.dim() != 2
            or x.device.type != "cpu" or x.shape[0] == 0 or x.shape[1] == 0):
        return x.argmax(dim=-1)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _cpu.argmax_bf16(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bfloat16 (K even) -> ``[ceil(N/16), K/2, 16, 2]``: panel p, pair k, lane l holds
    ``weight[16p + l, 2k : 2k + 2]`` (rows past N are zero)."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
        raise ValueError(f"pack_weight needs a bfloat16 [N, K] weight with K even, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    N, K = weight.shape
    Np = -(-N // 16) * 16
    w = weight.detach()
    if Np != N:
        w = torch.cat([w, w.new_zeros(Np - N, K)])
    return w.view(Np // 16, 16, K // 2, 2).transpose(1, 2).contiguous()


def unpack_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``pack_weight``'s inverse: ``[ceil(N/16), K/2, 16, 2]`` -> the ``[N, K]`` weight, a new
    contiguous tensor with the same values (a model that keeps only the packed copy multiplies
    prompt chunks with torch's GEMM over this, one projection at a time)."""
    P, K2, _, _ = packed.shape
    return packed.transpose(1, 2).reshape(P * 16, K2 * 2)[:n]


class PackedLinear:
    """``y = x @ weight.T`` (no bias) for bfloat16 rows ``x [M, K]`` -> ``[M, N]`` bfloat16."""

    __slots__ = ("N", "K", "packed")

    def __init__(self, weight: torch.Tensor):
        self.N, self.K = weight.shape
        self.packed = pack_weight(weight)

    def weight(self) -> torch.Tensor:
        """The ``[N, K]`` weight, unpacked into a new tensor (``unpack_weight``)."""
        return unpack_weight(self.packed, self.N)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.K or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError(f"x must be bfloat16 [M, {self.K}], got {tuple(x.shape)} {x.dtype}")
        if x.stride(1) != 1 or x.stride(0) % 2:
            x = x.contiguous()
        M = x.shape[0]
        if out is None:
            out = torch.empty(M, self.N, dtype=torch.bfloat16)
        elif (out.dim() != 2 or out.shape != (M, self.N) or out.dtype != torch.bfloat16 or out.stride(1) != 1
              or out.device.type != "cpu"):
            raise ValueError(f"out must be bfloat16 [{M}, {self.N}] with unit column stride, got "
                             f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
        _cpu.linear_bf16(x.data_ptr(), x.stride(0), M, self.packed.data_ptr(), self.N, self.K, out.data_ptr(),
                         out.stride(0))
        return out

    def prefill(self, x: torch.Tensor, *, residual: torch.Tensor | None = None, silu: bool = False,
                threads: int = 0) -> torch.Tensor:
        """``x @ weight.T`` for a prompt chunk's rows on AMX tiles (``amx_linear_supported``), from
        the same packed weight: each output is one float32 tile accumulation over 32-column
        blocks in ascending order, rounded once to bfloat16, so a row's result does not depend
        on the other rows or the thread count. Not ``__call__``'s bits.

        ``residual`` ``[M, N]`` bfloat16: returns ``residual + x @ weight.T`` (each rounded to
        bfloat16, as torch adds them). ``silu``: the weight is
        ``[gate; up]`` (``w_gate_up``) and the result ``silu(gate) * up`` ``[M, N/2]``, rounded as
        torch rounds it in bfloat16, without the ``[M, N]`` intermediate. ``threads``: 0 = OpenMP's
        default (the result is the same bits for any count)."""
        if x.dim() != 2 or x.shape[1] != self.K or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError(f"x must be bfloat16 [M, {self.K}], got {tuple(x.shape)} {x.dtype}")
        if x.stride(1) != 1:
            x = x.contiguous()
        M = x.shape[0]
        if residual is not None and (residual.shape != (M, self.N) or residual.dtype != torch.bfloat16
                                     or residual.stride(1) != 1):
            raise ValueError(f"residual must be bfloat16 [{M}, {self.N}] with unit column stride")
        mode = 1 if residual is not None else 2 if silu else 0  # linear_amx's PLAIN / RESIDUAL / SILU
        out = torch.empty(M, self.N // 2 if mode == 2 else self.N, dtype=torch.bfloat16)
        _cpu.linear_amx(x.data_ptr(), x.stride(0), M, self.packed.data_ptr(), self.N, self.K, out.data_ptr(),
                        out.stride(0), threads, mode, 0 if residual is None else residual.data_ptr(),
                        0 if residual is None else residual.stride(0))
        return out
