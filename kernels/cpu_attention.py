"""Exact decode / tree-verification attention on CPU (native: ``agentspec.kernels._cpu``).

``decode_attention`` computes, for every query row and head, softmax attention over the row's
visible keys (mask true) of one layer's float32 or bfloat16 KV cache (bfloat16 values are read
as the floats they are: the same arithmetic as a float32 cache holding them). It visits those keys in ascending slot
order with reductions whose shape depends only on that visible sequence, so a draft-tree node
gets the same bits as the same token in plain decoding (its ancestors sit at tree slots there,
at consecutive slots here); see kernels/csrc/attention.cpp. ``available()`` is False when the
extension is not built; callers then use ``agentspec.backends.embedded.model.small_attention``.
"""

from __future__ import annotations

import torch  # first: the extension uses the libgomp.so.1 that torch's wheel loads

try:
    from . import _cpu
except ImportError:  # not built (e.g. a source checkout without the extension)
    _cpu = None

__all__ = ["DECODE_MODES", "QKVAttention", "available", "bf16_hardware", "decode_amx_runs", "decode_attention", "dot_runs",
           "packed_supported", "prefill_amx_runs", "prefill_amx_supported", "prefill_attention", "segment_attention",
           "supports", "sync_packed"]

# QKVAttention's kernels for decode / verify rows (kernels/csrc/qkv_attention*.cpp):
#   amx   on AMX tiles, all of a request's rows at once ("AMX decode"), where the CPU has AMX and
#         the kernels run at the top ISA level (avx512bf16); elsewhere the kernel runs "rows"
#   rows  one task per (row, kv head), VDPBF16PS (or its emulation at lower ISA levels)
# Both give a draft-tree node the bits of the same token decoded plainly; amx's differ from rows'
# (its tiles sum in another order). Which one runs is the kernel plan's choice
# (agentspec.backends.embedded.plan: AGENTSPEC_DECODE_ATTENTION).
DECODE_MODES = {"rows": 0, "amx": 1}


def decode_amx_runs() -> bool:
    """Whether QKVAttention's "amx" mode runs on AMX tiles here now (else it runs "rows")."""
    return available() and bool(_cpu.decode_amx_runs())


def available() -> bool:
    """Whether the native extension is built (whether its kernels run is the kernel plan's call)."""
    return _cpu is not None


# head_dims the float32-query kernel (``decode_attention``, ``segment_attention``: a float32 or
# bfloat16 cache) takes; the bfloat16 rows kernels over packed copies (``QKVAttention``, prefill)
# take 64 only
FLOAT32_HEAD_DIMS = (64, 128)
CACHE_DTYPES = (torch.float32, torch.bfloat16)   # the caches decode_attention / segment_attention read


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``decode_attention`` handles queries like ``q`` (any float dtype: cast to float32
    first) over the cache ``k`` (else use the torch path)."""
    return (
        available()
        and q.device.type == "cpu" and k.device.type == "cpu" and k.dtype in CACHE_DTYPES
        and q.shape[-1] in FLOAT32_HEAD_DIMS and q.shape[0] % k.shape[0] == 0 and q.shape[0] // k.shape[0] <= 8
    )


def _mask_arg(mask: torch.Tensor | None, T: int, L: int):
    """A mask ``[T, >= L]`` bool (None: every key visible) as the kernels take it:
    ``(mask with unit column stride, data pointer or 0, row stride)``."""
    if mask is None:
        return None, 0, 0
    if mask.dtype != torch.bool or mask.shape[0] != T or mask.shape[1] < L:
        raise ValueError(f"mask must be bool [T, >= L]: {tuple(mask.shape)}, {mask.dtype}")
    if mask.stride(1) != 1:
        mask = mask.contiguous()
    return mask, mask.data_ptr(), mask.stride(0)


def decode_attention(
    q: torch.Tensor,            # [H, T, D] float32, unit stride in D
    k: torch.Tensor,            # [Hkv, capacity, D] float32 or bfloat16, contiguous (one layer of the cache)
    v: torch.Tensor,            # [Hkv, capacity, D]
    mask: torch.Tensor | None,  # [T, >= L] bool; None = all L keys visible
    L: int,                     # keys in use: slots [0, L)
    *,
    threads: int = 0,           # 0: torch's OpenMP thread count
    group: int = 0,             # rows that share each read of the cache (1-8; 0: the kernel's choice).
                                # Any grouping gives the same bits.
    dot: bool = False,          # the bfloat16-product mode (``dot_runs()``): q . k and p @ v with
                                # AVX512-BF16's VDPBF16PS, the weights rounded to bfloat16; for caches
                                # holding bfloat16 values (a float32 one's values are rounded)
) -> torch.Tensor:              # [T, H, D] float32 (rows first: the layout the output projection reads)
    H, T, D = q.shape
    Hkv, cap, Dk = k.shape
    if Dk != D or v.shape != k.shape or not (0 < L <= cap):
        raise ValueError(f"shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, L {L}")
    if q.dtype != torch.float32 or k.dtype not in CACHE_DTYPES or v.dtype != k.dtype:
        raise TypeError(f"decode_attention needs a float32 q and a float32 or bfloat16 k, v: {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if q.stride(2) != 1:
        q = q.contiguous()
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("k and v must be contiguous")
    out = torch.empty(T, H, D, dtype=torch.float32)
    mask, mask_ptr, mask_st = _mask_arg(mask, T, L)
    _cpu.attention(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), cap,
                   mask_ptr, mask_st, out.data_ptr(), H, Hkv, T, L, D, threads, k.dtype == torch.bfloat16, group,
                   _dot(dot))
    return out


def dot_runs() -> bool:
    """Whether ``decode_attention`` / ``segment_attention``'s ``dot`` mode runs at the ISA level set
    now (avx512bf16: the VDPBF16PS instruction)."""
    return available() and hasattr(_cpu, "attention_dot_runs") and bool(_cpu.attention_dot_runs())


def _dot(dot: bool) -> bool:
    if dot and not dot_runs():
        raise RuntimeError("the bfloat16-product attention (dot=True) needs AVX512-BF16: ISA level avx512bf16")
    return bool(dot)


def segment_attention(
    q: torch.Tensor,            # [H, R, D] float32: every segment's query rows, unit stride in D
    kv_new: torch.Tensor,       # [2, Hkv, R, D] float32 contiguous: the rows' new keys and values
    segments: list,             # per segment: (k [Hkv, cap, D], v [Hkv, cap, D], L, mask [T, >= L] bool, row_off, T);
                                # every cache float32, or every cache bfloat16
    *,
    threads: int = 0,
    group: int = 0,             # as decode_attention's
    dot: bool = False,          # as decode_attention's
) -> torch.Tensor:              # [R, H, D] float32
    """Several requests' rows in one native call (continuous batching): writes each segment's new
    keys/values at its cache slots ``[L - T, L)`` (rounded as torch rounds them into a bfloat16
    cache), then attends exactly as ``decode_attention`` would for that segment alone."""
    H, R, D = q.shape
    if kv_new.dtype != torch.float32 or q.dtype != torch.float32 or not kv_new.is_contiguous():
        raise TypeError("segment_attention needs float32 q and a contiguous float32 kv_new")
    if q.stride(2) != 1:
        q = q.contiguous()
    Hkv = kv_new.shape[1]
    rows = []
    kv_dtype = segments[0][0].dtype if segments else torch.float32
    for k, v, L, mask, off, T in segments:
        if not (k.is_contiguous() and v.is_contiguous()) or k.dtype != kv_dtype or v.dtype != kv_dtype \
                or kv_dtype not in CACHE_DTYPES:
            raise ValueError("cache layers must be contiguous, all float32 or all bfloat16")
        if mask.dtype != torch.bool or mask.shape[0] != T or mask.shape[1] < L or mask.stride(1) != 1:
            raise ValueError(f"mask must be bool [T, >= L] with unit column stride: {tuple(mask.shape)}")
        rows.append((k.data_ptr(), v.data_ptr(), k.shape[1], L, mask.data_ptr(), mask.stride(0), off, T))
    segs = torch.tensor(rows, dtype=torch.int64)
    out = torch.empty(R, H, D, dtype=torch.float32)
    _cpu.attention_segments(q.data_ptr(), q.stride(0), q.stride(1), kv_new[0].data_ptr(), kv_new[1].data_ptr(),
                            kv_new.stride(1), kv_new.stride(2), segs.data_ptr(), len(rows), out.data_ptr(), H, Hkv,
                            D, threads, kv_dtype == torch.bfloat16, group, _dot(dot))
    return out


def packed_supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether a KV cache of ``dtype`` on ``device`` can keep the packed copies QKVAttention reads."""
    return available() and dtype == torch.float32 and torch.device(device).type == "cpu" and head_dim == 64


def sync_packed(cache, slots) -> None:
    """Re-derive a packed cache's bfloat16 copies of ``slots`` (every layer) from its float32 k / v."""
    sl = torch.as_tensor(list(slots) if not isinstance(slots, torch.Tensor) else slots, dtype=torch.int64).cpu()
    if sl.numel() == 0:
        return
    sl = sl.contiguous()
    L, Hkv, cap, D = cache.k.shape
    _cpu.sync_packed(cache.k.data_ptr(), cache.v.data_ptr(), cache.kt2.data_ptr(), cache.vp.data_ptr(), cap, L, Hkv,
                     D, sl.data_ptr(), sl.numel())


def prefill_amx_runs(dtype: torch.dtype, n_heads: int, n_kv_heads: int) -> bool:
    """Whether the AMX prompt attention can serve a model of ``dtype`` with these head counts here
    now: bfloat16, 1-4 query heads per kv head, a CPU with AMX-BF16 (the OS granting the tile
    state) and the kernels not capped below AVX512-BF16 (``cpu_isa.set_isa``). (Whether prompts
    take it is the kernel plan's call: AGENTSPEC_PREFILL_ATTENTION.)"""
    return (available() and dtype == torch.bfloat16 and n_kv_heads > 0
            and n_heads % n_kv_heads == 0 and n_heads // n_kv_heads <= 4
            and _cpu.prefill_amx_available() and _cpu.isa() == 4)


def prefill_amx_supported(cache, dtype: torch.dtype, n_heads: int, n_kv_heads: int) -> bool:
    """``prefill_amx_runs`` over ``cache``: which must keep the packed copies."""
    return getattr(cache, "packed", False) and prefill_amx_runs(dtype, n_heads, n_kv_heads)


def prefill_attention(
    q: torch.Tensor,   # [H, T, D] bfloat16 (rotated), unit stride in D
    k: torch.Tensor,   # [Hkv, T, D] bfloat16 (rotated): the chunk's keys
    v: torch.Tensor,   # [Hkv, T, D] bfloat16
    cache,             # packed KVCache
    layer: int,
    start: int,        # the chunk's first position: a multiple of 16
    *,
    threads: int = 0,
) -> torch.Tensor:     # [T, H * D] bfloat16 (the output projection's input)
    """Causal attention of a prompt chunk at positions ``[start, start + T)`` over every key from
    position 0, with AMX tiles (kernels/csrc/amx.cpp); first writes the chunk's keys and
    values into the layer's packed copies ``kt2`` / ``vp`` (the float32 ``k`` / ``v`` are the
    caller's to write). A row's bits do not depend on the chunk it sits in or the thread count."""
    H, T, D = q.shape
    Hkv = k.shape[0]
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        raise TypeError("prefill_attention needs bfloat16 q, k, v")
    if k.shape != (Hkv, T, D) or v.shape != k.shape:
        raise ValueError(f"shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(T, H * D, dtype=torch.bfloat16)
    _cpu.prefill_attention(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                           v.data_ptr(), v.stride(0), v.stride(1), cache.kt2[layer].data_ptr(),
                           cache.vp[layer].data_ptr(), cache.capacity, start, T, H, Hkv, D, out.data_ptr(), threads)
    return out


def prefill_bf16_runs() -> bool:
    """Whether ``prefill_bf16`` runs at the ISA level set now (AVX512-BF16: ``avx512bf16``)."""
    return available() and hasattr(_cpu, "prefill_bf16_runs") and _cpu.prefill_bf16_runs()


def prefill_bf16(
    q: torch.Tensor,   # [H, T, D] bfloat16 (rotated), unit stride in D
    k: torch.Tensor,   # [Hkv, capacity, D] float32 or bfloat16, contiguous: one layer of the cache
    v: torch.Tensor,   # [Hkv, capacity, D]
    start: int,        # the chunk's first position; its keys and values already at slots [start, start + T)
    *,
    threads: int = 0,
) -> torch.Tensor:     # [T, H * D] bfloat16 (the output projection's input)
    """Causal attention of a prompt chunk at positions ``[start, start + T)`` over every key from
    position 0, with AVX512-BF16's VDPBF16PS (kernels/csrc/prefill_bf16.cpp): float32 scores,
    sums and outputs, the softmax weights rounded to bfloat16. For caches that hold bfloat16
    values (a float32 cache of them is read exactly). A row's bits do not depend on the chunk it
    sits in or the thread count."""
    H, T, D = q.shape
    Hkv, cap, Dk = k.shape
    if q.dtype != torch.bfloat16 or k.dtype not in CACHE_DTYPES or v.dtype != k.dtype:
        raise TypeError(f"prefill_bf16 needs a bfloat16 q and a float32 or bfloat16 cache: {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if Dk != D or v.shape != k.shape or not (0 <= start and start + T <= cap):
        raise ValueError(f"shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, start {start}")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("k and v must be contiguous")
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty(T, H * D, dtype=torch.bfloat16)
    _cpu.prefill_bf16(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), cap,
                      k.dtype == torch.bfloat16, start, T, H, Hkv, D, out.data_ptr(), threads)
    return out


def prefill_qkv_attention(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) D] bfloat16: the fused projection's output (not rotated)
    cos: torch.Tensor,  # [T, D] bfloat16: the chunk's positions
    sin: torch.Tensor,
    cache,              # packed KVCache
    layer: int,
    start: int,         # the chunk's first position: a multiple of 16
    *,
    n_heads: int,
    n_kv_heads: int,
    threads: int = 0,
) -> torch.Tensor:      # [T, H * D] bfloat16
    """``prefill_attention`` from the fused ``q|k|v`` projection in one native call: the rotary
    embedding of q and k (rounded as torch rounds it in bfloat16), the chunk's keys and values
    written at slots ``[start, start + T)`` of the cache's float32 ``k`` / ``v`` and packed copies,
    then the AMX attention. The same bits as rotating with torch and calling ``prefill_attention``."""
    T = qkv.shape[0]
    D = cache.k.shape[-1]
    if qkv.dtype != torch.bfloat16 or qkv.dim() != 2 or qkv.shape[1] != (n_heads + 2 * n_kv_heads) * D:
        raise ValueError(f"qkv must be bfloat16 [T, {(n_heads + 2 * n_kv_heads) * D}], got {tuple(qkv.shape)}")
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cos, sin = (c.to(torch.bfloat16).contiguous() for c in (cos, sin))
    if cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(f"cos/sin must be [{T}, {D}]: {tuple(cos.shape)}, {tuple(sin.shape)}")
    out = torch.empty(T, n_heads * D, dtype=torch.bfloat16)
    _cpu.prefill_qkv_attention(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                               cache.k[layer].data_ptr(), cache.v[layer].data_ptr(), cache.kt2[layer].data_ptr(),
                               cache.vp[layer].data_ptr(), cache.capacity, start, T, n_heads, n_kv_heads, D,
                               out.data_ptr(), threads)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of bfloat16 rows ``[M, dim]`` natively (prompt chunks on the AMX path): float32
    statistics, rounded as torch rounds ``F.rms_norm`` in bfloat16; row-wise."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm needs bfloat16 x [M, dim] and weight [dim]: {tuple(x.shape)}, {tuple(weight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _cpu.rms_norm_rows(x.data_ptr(), x.stride(0), x.shape[0], weight.contiguous().data_ptr(), x.shape[1], float(eps),
                       out.data_ptr(), out.stride(0))
    return out


def bf16_hardware() -> bool:
    """Whether this CPU has AVX512-BF16 (QKVAttention and the linears then use the instruction,
    unless ``cpu_isa.set_isa`` caps them lower)."""
    return available() and _cpu.isa_runs(4)


class QKVAttention:
    """The attention of every decoder layer in one decode / verify forward of a bfloat16 model,
    natively: from the fused ``q|k|v`` projection ``[R, (H + 2 Hkv) D]`` to the output
    projection's input ``[R, H D]``, both bfloat16. Per row: rotary embedding (rounded as torch
    rounds it in bfloat16), the new key / value written at the row's slot of the float32 cache
    and of its packed bfloat16 copies, then exact attention with bfloat16 dot products (see
    kernels/csrc/qkv_attention.cpp).

    Built once per forward (``segments``: per request ``(cache, start, L, mask, T)``: its ``T``
    rows go to slots ``[start, start + T)`` and attend over ``[0, L)`` as ``mask`` [T, >= L]
    bool says, None = all), then called once per layer. The returned tensor is one buffer,
    overwritten by the next call."""

    def __init__(self, segments, cos: torch.Tensor, sin: torch.Tensor, *, n_heads: int, n_kv_heads: int,
                 head_dim: int, threads: int = 0, mode: str = "amx"):
        rows = []
        self._keep = []   # masks made contiguous here must outlive the calls
        R = 0
        for cache, start, L, mask, T in segments:
            if not getattr(cache, "packed", False):
                raise ValueError("QKVAttention needs a packed KV cache (KVCache(..., packed=True))")
            mask, mask_ptr, mask_st = _mask_arg(mask, T, L)
            self._keep.append(mask)
            rows.append((cache.k.data_ptr(), cache.v.data_ptr(), cache.kt2.data_ptr(), cache.vp.data_ptr(),
                         cache.capacity, L, mask_ptr, mask_st, R, T, start))
            R += T
        self.segs = torch.tensor(rows, dtype=torch.int64)
        self.cos = cos.to(torch.bfloat16).contiguous()
        self.sin = sin.to(torch.bfloat16).contiguous()
        if self.cos.shape != (R, head_dim) or self.sin.shape != (R, head_dim):
            raise ValueError(f"cos/sin must be [{R}, {head_dim}]: {tuple(cos.shape)}")
        self.out = torch.empty(R, n_heads * head_dim, dtype=torch.bfloat16)
        self.R, self.H, self.Hkv, self.D = R, n_heads, n_kv_heads, head_dim
        self.threads = threads
        if mode not in DECODE_MODES:
            raise ValueError(f"mode must be one of {', '.join(DECODE_MODES)}, got {mode!r}")
        self.mode = DECODE_MODES[mode]
        self._args = (self.cos.data_ptr(), self.sin.data_ptr(), self.cos.stride(0), self.segs.data_ptr(), len(rows))

    def __call__(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        if qkv.dtype != torch.bfloat16 or qkv.shape != (self.R, (self.H + 2 * self.Hkv) * self.D) or qkv.stride(1) != 1:
            raise ValueError(f"qkv must be bfloat16 [{self.R}, {(self.H + 2 * self.Hkv) * self.D}], unit column stride")
        cp, sp, cst, segp, S = self._args
        _cpu.qkv_attention(qkv.data_ptr(), qkv.stride(0), cp, sp, cst, segp, S, layer,
                           self.out.data_ptr(), self.out.stride(0), self.H, self.Hkv, self.D, self.threads,
                           self.mode)
        return self.out
