"""A minimal Llama-family transformer (gpt-fast style) with a KV cache for tree verification.

One ``forward`` serves prefill, plain decoding and draft-tree verification: it takes the new
tokens, their positions and an attention mask over ``cache[:start] + new tokens``, writes the new
keys/values at slots ``[start, start + T)`` and returns logits for every new token.
"""

from __future__ import annotations

import functools

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import cpu_attention, cpu_linear, rope
from ...kernels.rope import apply_rope, rope_cos_sin
from .plan import Facts, KernelPlan, Settings

__all__ = ["KVCache", "ModelArgs", "Segment", "Transformer"]


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = True
    head_dim: int = 0  # 0: dim // n_heads
    family: str = "llama"    # model_type: llama, mistral, qwen2, qwen3 (backends.embedded.families)
    qkv_bias: bool = False   # biases on the q/k/v projections (Qwen2)
    qk_norm: bool = False    # RMSNorm over each head of q and k before the rotary embedding (Qwen3)
    # rope scaling as transformers' rope_parameters ((key, value) pairs, sorted; () = none):
    # rope_type linear / llama3 / yarn / dynamic and their fields (engine.rope)
    rope_scaling: tuple = ()
    # llama.cpp's rope_freqs: per-frequency divisors (GGUF files of Llama 3.1+); () = none
    rope_freq_factors: tuple = ()

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        else:  # from JSON: [[key, value], ...]
            object.__setattr__(self, "rope_scaling", tuple(tuple(kv) for kv in self.rope_scaling))
        object.__setattr__(self, "rope_freq_factors", tuple(float(x) for x in self.rope_freq_factors))

    @property
    def rope_parameters(self) -> dict:
        return dict(self.rope_scaling)

    def to_dict(self) -> dict:
        return asdict(self)


class KVCache(nn.Module):
    """Keys and values of every layer: ``[n_layers, n_kv_heads, capacity, head_dim]`` each.

    The engine keeps it float32 by default: decode-time attention (``small_attention``) then
    gives a row the same result whatever the cache length or the other rows of its forward.
    bfloat16 (the engine's ``kv_dtype``) halves the bytes a step reads; the native kernels
    (``cpu_attention.decode_attention``) keep it exact, the torch fallback does not (its ``p @ v``
    chunk GEMMs change with the row count).

    ``length`` counts committed tokens. A forward writes its T new tokens at ``[length, length+T)``
    without committing them; ``commit`` keeps a subset of those slots (the accepted path),
    moving them to ``[length, length + len(keep))``.

    ``packed`` (a bfloat16 model on CPU with the native kernels): the cache also keeps packed
    bfloat16 copies of its keys and values, ``kt2`` ``[n_layers, n_kv_heads, head_dim/2,
    capacity, 2]`` and ``vp`` ``[n_layers, n_kv_heads, capacity/2, head_dim, 2]``, which the
    native decode attention reads (``cpu_attention.QKVAttention`` writes all three itself;
    after torch writes or moves slots, ``sync`` re-derives the copies).
    """

    def __init__(self, args: ModelArgs, capacity: int, *, dtype: torch.dtype, device: torch.device,
                 packed: bool = False):
        super().__init__()
        capacity = round_up(capacity, KEY_CHUNK)  # small_attention reads whole key chunks
        shape = (args.n_layers, args.n_kv_heads, capacity, args.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.packed = bool(packed)
        if self.packed:
            if not cpu_attention.packed_supported(dtype, torch.device(device), args.head_dim):
                raise ValueError("a packed KV cache needs float32 on CPU, head_dim 64 and the native kernels")
            L, Hkv, D = args.n_layers, args.n_kv_heads, args.head_dim
            self.kt2 = torch.zeros(L, Hkv, D // 2, capacity, 2, dtype=torch.bfloat16)
            self.vp = torch.zeros(L, Hkv, capacity // 2, D, 2, dtype=torch.bfloat16)
        self.capacity = capacity
        self.length = 0

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values ``[n_kv_heads, T, head_dim]`` of T new tokens at slots ``[start, start+T)``
        (a packed cache needs ``sync`` of those slots afterwards)."""
        end = start + k.shape[1]
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v

    def sync(self, slots) -> None:
        """Re-derive the packed copies of ``slots`` (every layer) from ``k`` / ``v``."""
        if self.packed:
            cpu_attention.sync_packed(self, slots)

    def reset(self) -> None:
        self.length = 0

    def read(self, start: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of slots ``[start, end)``, every layer, in ``dtype``:
        ``[n_layers, n_kv_heads, end - start, head_dim]`` each (a prefix cache's chunk)."""
        return (self.k[:, :, start:end].to(dtype, copy=True).contiguous(),
                self.v[:, :, start:end].to(dtype, copy=True).contiguous())

    def load(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values ``[n_layers, n_kv_heads, T, head_dim]`` (a ``read`` copy) into slots
        ``[start, start + T)``, packed copies included; commits nothing."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.sync(range(start, end))

    def commit(self, keep: list[int]) -> None:
        """Commit the uncommitted slots ``length + keep[i]`` (ascending) as the next tokens."""
        n = len(keep)
        if keep != list(range(n)):  # a branch was accepted: move its slots down
            src = torch.tensor(keep, device=self.k.device) + self.length
            dst = torch.arange(self.length, self.length + n, device=self.k.device)
            self.k[:, :, dst] = self.k[:, :, src]
            self.v[:, :, dst] = self.v[:, :, src]
            self.sync(dst)
        self.length += n


@dataclass
class Segment:
    """One request's rows in a multi-request forward (``Transformer.forward_segments``): ``rows``
    tokens written at ``cache[cache.length : cache.length + rows]``, attending as ``mask`` says."""

    cache: KVCache
    rows: int
    mask: torch.Tensor   # [rows, cache.length + rows] bool
    offset: int = 0      # first row in the batch (set by ``forward_segments``)


def skip_init(cls, *args, **kwargs):
    """``cls(*args, **kwargs)`` with uninitialised parameters on CPU (built on the meta device,
    then allocated): for weights loaded right after. (torch.nn.utils.skip_init does the same, but
    importing torch.nn.utils pulls in torch._dynamo: ~2 s of start-up, as does nn.Embedding's init
    on the meta device, so the embedding is given an empty weight instead.)"""
    return cls(*args, device="meta", **kwargs).to_empty(device="cpu")


class QuantEmbedding(nn.Module):
    """The token embedding of a model whose weights stay quantized: each forward dequantizes the
    rows it looks up (``cpu_quant.QuantLinear.rows``: the gguf dequantizer's values, rounded to
    the model's dtype as a dense embedding would hold them), from the output head's own
    quantized copy where the embeddings are tied. ``weight`` dequantizes the whole table (once,
    on demand: tools and draft heads that need it)."""

    def __init__(self, lin, dtype: torch.dtype):
        super().__init__()
        self.lin = lin
        self.dtype = dtype
        self._dense: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lin.rows(tokens).to(self.dtype).view(*tokens.shape, self.lin.K)

    @property
    def weight(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = self.lin.dequantize().to(self.dtype)
        return self._dense


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(args: ModelArgs, *, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[max_seq_len, head_dim]`` in float32 (Hugging Face ``rotate_half`` layout), with
    the checkpoint's rope scaling (``engine.rope``)."""
    scaling = args.rope_parameters
    inv = rope.inv_freq(args.rope_base, args.head_dim, scaling, args.rope_freq_factors)
    return rope_cos_sin(args.rope_base, args.head_dim, torch.arange(args.max_seq_len), device=device, inv=inv,
                        scale=rope.attention_factor(scaling))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, *, init_weights: bool = True):
        super().__init__()
        self.args = args
        hd = args.head_dim
        self.q_size = args.n_heads * hd
        self.kv_size = args.n_kv_heads * hd
        lin = partial(nn.Linear, bias=False) if init_weights else partial(skip_init, nn.Linear, bias=False)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.wqkv = lin(args.dim, self.q_size + 2 * self.kv_size)
        self.wo = lin(self.q_size, args.dim)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.w_gate_up = lin(args.dim, 2 * args.hidden_dim)
        self.w_down = lin(args.hidden_dim, args.dim)
        # Qwen2: biases on q/k/v, added to the fused projection's output
        self.qkv_bias = nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size)) if args.qkv_bias else None
        # Qwen3: RMSNorm over each head of q and of k (weights [head_dim]), before the rotary embedding
        self.q_norm = RMSNorm(hd, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(hd, args.norm_eps) if args.qk_norm else None
        # (wqkv, wo, w_gate_up, w_down) as cpu_linear.PackedLinear, set by Transformer.pack_linears
        self.packed: tuple | None = None
        # prompt chunks on the AMX path also project on AMX tiles (PackedLinear.prefill)
        self.amx_linears = False
        # torch-path linears of a bfloat16 model multiply in float32 (Transformer.set_gemm_float32)
        self.gemm_f32 = False

    def proj(self, kind: str, i: int, x: torch.Tensor, *, residual: torch.Tensor | None = None,
             silu: bool = False, norm: "RMSNorm | None" = None, norm_fn=None) -> torch.Tensor:
        """Projection ``i`` (0 wqkv, 1 wo, 2 w_gate_up, 3 w_down) of ``x`` with the linear kernel
        ``kind`` (the plan's): "amx" (``PackedLinear.prefill``: tiles, the epilogue fused),
        "vector" (``PackedLinear``: the row-invariant native linears), "float32" (torch's GEMM
        with weights and rows widened to float32 and the result rounded to bfloat16 once: exact,
        for CPUs whose bfloat16 GEMM is slow), or the model's dtype ("bfloat16", ...: torch's
        GEMM). Then the epilogue, rounded as torch rounds it: ``silu`` (the weight is
        ``[gate; up]``: ``silu(gate) * up``), ``residual`` (``residual + y``). ``norm``: the
        input's RMSNorm, fused into the activation quantization of "quantized"
        (``cpu_quant.QuantLinear``), else applied first (``norm_fn(x, norm)``; default torch's)."""
        if norm is not None and kind != "quantized":
            x = norm_fn(x, norm) if norm_fn is not None else norm(x)
        if kind == "amx":
            return self.packed[i].prefill(x, residual=residual, silu=silu)
        if kind == "quantized":
            y = self.packed[i](x, norm=None if norm is None else (norm.weight, norm.eps))
        elif kind == "vector":
            y = self.packed[i](x)
        elif kind == "float32" and x.dtype == torch.bfloat16:
            y = F.linear(x.float(), self.weight(i).float()).to(torch.bfloat16)
        else:
            y = F.linear(x, self.weight(i))
        if silu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return y if residual is None else residual + y

    def weight(self, i: int) -> torch.Tensor:
        """Projection ``i``'s ``[out, in]`` weight: the module's own, or, where
        ``Transformer.pack_linears(keep_weights=False)`` dropped it, unpacked from the packed copy
        for this forward (the same values, so the same bits)."""
        m = (self.wqkv, self.wo, self.w_gate_up, self.w_down)[i]
        if m.weight.numel() == 0 and self.packed is not None:
            return self.packed[i].weight()
        return m.weight

    def _qkv_post(self, qkv: torch.Tensor) -> torch.Tensor:
        """The fused projection's output ``[T, q_size + 2 kv_size]`` with the family's extras
        before the rotary embedding: Qwen2's q/k/v biases, Qwen3's per-head q/k norms. Row-wise
        (a row's bits depend on that row only), so every path (torch, native, AMX) shares it."""
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        if self.q_norm is not None:
            T, D = qkv.shape[0], self.args.head_dim
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = F.rms_norm(q.reshape(T, -1, D), (D,), self.q_norm.weight, self.q_norm.eps).view(T, -1)
            k = F.rms_norm(k.reshape(T, -1, D), (D,), self.k_norm.weight, self.k_norm.eps).view(T, -1)
            qkv = torch.cat([q, k, v], dim=-1)
        return qkv

    def _qkv(self, x, cos, sin, lin: str):
        """x: [T, dim] -> q [H, T, D], k [Hkv, T, D] (rotated), v [Hkv, T, D]; ``lin``: the
        projection's kernel (``proj``)."""
        a = self.args
        T = x.shape[0]
        qkv = self._qkv_post(self.proj(lin, 0, x, norm=self.attn_norm))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(T, a.n_heads, a.head_dim).transpose(0, 1), cos, sin)
        k = apply_rope(k.view(T, a.n_kv_heads, a.head_dim).transpose(0, 1), cos, sin)
        return q, k, v.view(T, a.n_kv_heads, a.head_dim).transpose(0, 1)

    def forward(self, x, layer: int, cache: KVCache, start: int, cos, sin, mask, causal: bool, key_len: int,
                plan: KernelPlan, chunk: bool = False, amx: bool = False):
        # x: [T, dim]; cos/sin: [T, head_dim]; mask: [T, start + T] bool, or None with `causal`;
        # chunk: a prompt chunk after a prefix (T > SMALL_T rows, ``mask`` the plain causal one);
        # amx: a prompt (chunk) whose attention runs on AMX tiles (``Transformer.forward``)
        T = x.shape[0]
        rows = not causal and not chunk and T <= SMALL_T  # decode / verify rows, not a prefill
        if amx and plan.prefill_linears == "amx":
            return self.forward_amx(x, layer, cache, start, cos, sin)
        lin = plan.layered_linears if rows else plan.torch_linears
        q, k, v = self._qkv(x, cos, sin, lin)
        cache.write(layer, start, k, v)
        prefill = plan.prefill_fallback   # a prompt chunk that does not take the AMX path
        if amx:
            # the causal attention of the chunk's rows over keys [0, start + T) with AMX tiles,
            # reading (and first writing) the packed cache; a row's bits do not depend on the
            # chunk it is in (kernels/csrc/amx.cpp). [T, H * D]
            o = cpu_attention.prefill_attention(q, k, v, cache, layer, start)
        elif (causal or chunk) and prefill == "native":
            # VDPBF16PS flash kernel over the cache (the chunk's keys written above): float32 scores
            # and sums, weights in bf16; a row's bits do not depend on the chunk. [T, H * D]
            o = cpu_attention.prefill_bf16(q, cache.k[layer], cache.v[layer], start)
        elif (causal or chunk) and prefill == "sdpa":
            # prefill in bf16 through SDPA's CPU flash kernel, one call per block of queries at the
            # block's own shapes: split-invariant (``prefill_attention_sdpa``). The keys come back
            # from the cache (float32 copies of bf16 values: the cast back is exact)
            o = prefill_attention_sdpa(q, cache.k[layer, :, :start + T], cache.v[layer, :, :start + T], start=start)
        elif (causal or chunk) and prefill == "blockwise":
            # the same blocks through matmuls in the cache's dtype (``prefill_attention``): also
            # split-invariant. Plain and speculative decoding share the prefill, so the choice
            # cannot break their identity
            o = prefill_attention(q, cache.k[layer, :, :start + T], cache.v[layer, :, :start + T], start=start)
        elif causal or chunk or T > SMALL_T:
            qa = q.to(cache.k.dtype)  # attention runs in the cache's dtype (float32 by default)
            keys = cache.k[layer, :, :key_len]               # [Hkv, L, D]
            values = cache.v[layer, :, :key_len]
            o = F.scaled_dot_product_attention(
                qa.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                attn_mask=mask, is_causal=causal, enable_gqa=True,
            ).squeeze(0)                                      # [H, T, D]
        elif plan.layered_attention == "native" and cache.k.dtype in cpu_attention.CACHE_DTYPES:
            # native exact kernel (float32 or bfloat16 cache on CPU, float32 queries): [T, H, D], rows first
            o = cpu_attention.decode_attention(q.to(torch.float32), cache.k[layer], cache.v[layer], mask, key_len,
                                               dot=plan.rows_dot)
            o = o.view(T, self.q_size).to(x.dtype)
        else:
            qa = q.to(cache.k.dtype)
            o = small_attention(qa, cache.k[layer], cache.v[layer], mask, key_len)
        if o.dim() == 3:
            o = o.to(x.dtype).transpose(0, 1).reshape(T, self.q_size)
        return self._mlp(self.proj(lin, 1, o, residual=x), lin)

    def forward_amx(self, x, layer: int, cache: KVCache, start: int, cos, sin):
        """A prompt chunk on AMX tiles (``Transformer.forward``'s ``amx``): the projections are
        ``PackedLinear.prefill`` (the residual adds and ``silu(gate) * up`` in their epilogues,
        rounded as torch rounds them); the norms, the rotary embedding, the cache writes and the
        attention native (``cpu_attention.rms_norm``, ``prefill_qkv_attention``): no torch
        elementwise op is left in the layer. Every step is row-wise or row-invariant, so a row's
        bits do not depend on the chunk it is in or the thread count."""
        a = self.args
        wqkv, wo, w_gate_up, w_down = self.packed
        qkv = self._qkv_post(wqkv.prefill(cpu_attention.rms_norm(x, self.attn_norm.weight, self.attn_norm.eps)))
        o = cpu_attention.prefill_qkv_attention(qkv, cos, sin, cache, layer, start, n_heads=a.n_heads,
                                                n_kv_heads=a.n_kv_heads)
        x = wo.prefill(o, residual=x)
        h = cpu_attention.rms_norm(x, self.ffn_norm.weight, self.ffn_norm.eps)
        return w_down.prefill(w_gate_up.prefill(h, silu=True), residual=x)

    def forward_native(self, x, layer: int, attn: "cpu_attention.QKVAttention", plan: KernelPlan):
        """Decode / verify rows with the native attention (rotary, cache writes and attention in
        one call per layer): the same bits as ``forward``, with a few torch calls per layer. The
        projections as the plan says (``rows_linears``): on AMX tiles ("amx": the residual adds
        and ``silu(gate) * up`` in their epilogues, rounded as the torch ops round them), the
        native row-invariant linears ("vector"), or torch's; a row's bits then do not depend on
        the other rows (but with torch's). The norms as the plan says (``rows_norms``): native
        (``cpu_attention.rms_norm``, row-wise: ~0.2 ms of torch dispatch per call saved, twice
        per layer) or torch's."""
        lin = plan.rows_linears if plan.rows_linears != "torch" else "plain"
        if plan.rows_norms == "native":
            def norm(x, m):
                return cpu_attention.rms_norm(x, m.weight, m.eps)
        else:
            def norm(x, m):
                return F.rms_norm(x, (x.shape[-1],), m.weight, m.eps)
        qkv = self._qkv_post(self.proj(lin, 0, x, norm=self.attn_norm, norm_fn=norm))
        x = self.proj(lin, 1, attn(qkv, layer), residual=x)
        return self.proj(lin, 3, self.proj(lin, 2, x, norm=self.ffn_norm, norm_fn=norm, silu=True), residual=x)

    def _mlp(self, x, lin: str):
        return self.proj(lin, 3, self.proj(lin, 2, x, norm=self.ffn_norm, silu=True), residual=x)


    def forward_segments(self, x, layer: int, segs: list["Segment"], cos, sin, plan: KernelPlan):
        """Several requests' decode/verify rows in one pass: the linear layers see every row at
        once (a row's result does not depend on the others: see ``small_attention``), attention
        runs per request over its own cache. x: [R, dim] rows of all segments, in order."""
        R = x.shape[0]
        lin = plan.layered_linears
        q, k, v = self._qkv(x, cos, sin, lin)
        if plan.layered_attention == "native" and segs[0].cache.k.dtype in cpu_attention.CACHE_DTYPES:
            # one native call for every segment: writes the new keys/values, then attends
            kv = torch.stack([k, v]).to(torch.float32).contiguous()       # [2, Hkv, R, D]
            o = cpu_attention.segment_attention(
                q.to(torch.float32), kv,
                [(sg.cache.k[layer], sg.cache.v[layer], sg.cache.length + sg.rows, sg.mask, sg.offset, sg.rows)
                 for sg in segs], dot=plan.rows_dot)                      # [R, H, D]
            o = o.view(R, self.q_size).to(x.dtype)
        else:
            outs = []
            for sg in segs:
                cache, start, off, T = sg.cache, sg.cache.length, sg.offset, sg.rows
                cache.write(layer, start, k[:, off:off + T], v[:, off:off + T])
                qa = q[:, off:off + T].to(cache.k.dtype)
                outs.append(small_attention(qa, cache.k[layer], cache.v[layer], sg.mask, start + T))
            o = torch.cat(outs, dim=1).to(x.dtype).transpose(0, 1).reshape(R, self.q_size)
        return self._mlp(self.proj(lin, 1, o, residual=x), lin)


PREFILL_BLOCK = 32   # queries per prompt-attention block: a chunk that starts or ends inside a block pays
# for the whole block (an agent's turn after a cached history: both ends), so the block is small; SDPA's CPU
# flash kernel runs 32-query blocks internally anyway, so a 32-row call costs a quarter of a 128-row one


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int = 0) -> torch.Tensor:
    """Causal attention over a prompt (or a chunk of one), blockwise: each block of PREFILL_BLOCK
    queries attends to the keys up to its end only. q: [H, T, D], the tokens at positions
    ``[start, start + T)``; k, v: [Hkv, start + T, D], every key from position 0; GQA groups are
    folded into the query rows. Computed in k's dtype (the cache's: float32 by default), the
    result in q's.

    Split-invariant: blocks sit at absolute positions (multiples of PREFILL_BLOCK) and every
    block's matmuls and softmax run at the whole block's shapes, ``[B, end]`` -- a block the
    chunk fills only in part (the chunk starts or ends inside it) is padded, queries with zeros
    and keys past the chunk with zeros masked out (their weight exactly 0). A row's bits then
    depend on its own query and the keys up to it, not on how the prompt was split into forwards:
    a prompt prefilled in any pieces gives the same bits (the prefix cache reuses any prefix)."""
    H, T, D = q.shape
    Hkv = k.shape[0]
    G = H // Hkv
    qg = (q.to(k.dtype) * (D ** -0.5)).view(Hkv, G, T, D)
    out = torch.empty(Hkv, G, T, D, dtype=k.dtype, device=q.device)
    B = PREFILL_BLOCK
    future = torch.ones(B, B, dtype=torch.bool, device=q.device).triu_(1)
    end_all = start + T
    s = start
    while s < end_all:
        b0 = s // B * B                   # the block [b0, b0 + B) holds rows [s, e)
        e = min(b0 + B, end_all)
        full = b0 + B
        if s == b0 and e == full:
            qb = qg[:, :, s - start:e - start].reshape(Hkv, G * B, D)
            kb, vb = k[:, :full], v[:, :full]
        else:   # padded to the whole block: the same shapes, so the same bits for the rows it has
            qpad = qg.new_zeros(Hkv, G, B, D)
            qpad[:, :, s - b0:e - b0] = qg[:, :, s - start:e - start]
            qb = qpad.view(Hkv, G * B, D)
            kb, vb = k.new_zeros(Hkv, full, D), v.new_zeros(Hkv, full, D)
            kb[:, :e], vb[:, :e] = k[:, :e], v[:, :e]
        scores = torch.bmm(qb, kb.transpose(1, 2)).view(Hkv, G, B, full)
        scores[..., b0:full].masked_fill_(future, float("-inf"))
        p = torch.softmax(scores, dim=-1).view(Hkv, G * B, full)
        ob = torch.bmm(p, vb).view(Hkv, G, B, D)
        out[:, :, s - start:e - start] = ob[:, :, s - b0:e - b0]
        s = e
    return out.view(H, T, D).to(q.dtype)


@functools.lru_cache(maxsize=16)
def _block_mask(b0: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[B, b0 + B]`` additive mask of the query block at ``b0``: every key before it, the causal
    triangle within it (built once per block and shared by the layers: SDPA would convert a
    boolean mask on every call)."""
    B = PREFILL_BLOCK
    m = torch.zeros(B, b0 + B, dtype=dtype, device=device)
    m[:, b0:].masked_fill_(torch.ones(B, B, dtype=torch.bool, device=device).triu_(1), float("-inf"))
    return m


def prefill_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int = 0) -> torch.Tensor:
    """``prefill_attention`` through SDPA's CPU flash kernel, in q's dtype: one call per block of
    PREFILL_BLOCK queries at absolute positions, each at the whole block's shapes (queries
    ``[B]``, keys ``[0, block end)``, a partial block padded with zeros, its padding keys masked
    out), so a row's bits do not depend on how the prompt was split into forwards. (The flash
    kernel is deterministic for given shapes: each query block runs on one thread over the key
    blocks in order.) As fast as one SDPA call over the chunk here (2 cores, AVX-512)."""
    H, T, D = q.shape
    Hkv = k.shape[0]
    B = PREFILL_BLOCK
    end_all = start + T
    last = -(-end_all // B) * B
    kq = k[:, :end_all].to(q.dtype)
    vq = v[:, :end_all].to(q.dtype)
    if last > end_all:   # keys of the last block's padding: zeros (masked out, weight exactly 0)
        kq = torch.cat([kq, kq.new_zeros(Hkv, last - end_all, D)], dim=1)
        vq = torch.cat([vq, vq.new_zeros(Hkv, last - end_all, D)], dim=1)
    out = torch.empty(H, T, D, dtype=q.dtype, device=q.device)
    s = start
    while s < end_all:
        b0 = s // B * B
        e = min(b0 + B, end_all)
        full = b0 + B
        if s == b0 and e == full:
            qb = q[:, s - start:e - start]
        else:
            qb = q.new_zeros(H, B, D)
            qb[:, s - b0:e - b0] = q[:, s - start:e - start]
        mask = _block_mask(b0, q.dtype, q.device)
        ob = F.scaled_dot_product_attention(qb.unsqueeze(0), kq[:, :full].unsqueeze(0), vq[:, :full].unsqueeze(0),
                                            attn_mask=mask, enable_gqa=True).squeeze(0)
        out[:, s - start:e - start] = ob[:, s - b0:e - b0]
        s = e
    return out


SMALL_T = 128  # up to this many new tokens, attention runs as plain matmuls (decode/verify)
# (the rows one request verifies in one forward, decode.policy.MAX_STEP_ROWS, must not exceed it:
# past SMALL_T the forward leaves the row-invariant decode kernels, and forward_segments refuses
# larger segments; tests/unit/test_plan.py checks the two)


KEY_CHUNK = 256  # the key axis of decode attention is padded to a multiple of this
PV_CHUNK = 128   # old keys' p @ v runs as one float32 GEMM per chunk of this many keys


def small_attention(
    q: torch.Tensor,          # [H, T, D]
    k: torch.Tensor,          # [Hkv, Lc, D]  cache slots, Lc >= round_up(L, KEY_CHUNK)
    v: torch.Tensor,          # [Hkv, Lc, D]
    mask: torch.Tensor | None,  # [T, L] bool; None = all L keys visible
    L: int,                   # keys in use; the last T are this call's own (a draft tree)
) -> torch.Tensor:            # [H, T, D]
    """Attention for a few queries over a long cache: GQA groups folded into the query rows.

    On CPU this beats SDPA's flash kernel for decode and tree verification. It is written so
    that a token's result does not depend on what shares its forward: not on the number of
    rows, not on the number of keys, and not on where its ancestors sit in a draft tree. The
    last point matters because a tree node's ancestors occupy tree slots, not the slots their
    positions would have in plain decoding, and a float GEMM's rounding depends on where in
    its reduction the nonzero terms fall. So, for a row at position ``pos``:

    - keys older than ``c = PV_CHUNK * (pos // PV_CHUNK - 1)`` are committed tokens at their
      own positions in every case: ``p @ v`` over them runs as one float32 GEMM per fixed
      PV_CHUNK-key chunk, chunks summed in a fixed pairwise order;
    - the newer keys (the last 128-256 positions and the tree) are reduced in float64, whose
      sum does not depend on the order of its terms before the final rounding to float32.

    Scores are computed over the key axis padded to KEY_CHUNK (padding masked out); the
    softmax runs in float32 with its denominator summed in float64. Rows are grouped by ``c``;
    a GEMM gets at least 4 rows (small-M CPU kernels round differently), so a lone row is
    doubled. With a float32 cache this keeps greedy speculation equal to plain decoding, for
    chains and trees (README, "Exactness"); a bfloat16 cache does not (see ``KVCache``).
    """
    H, T, D = q.shape
    Hkv = k.shape[0]
    G = H // Hkv
    Lp = round_up(max(L, 1), KEY_CHUNK)
    qg = q.reshape(Hkv, G * T, D)                          # query head h = kv * G + g
    # the scale goes on q (elementwise, so row-invariant); scores are masked in place
    scores = torch.bmm(qg * (1.0 / math.sqrt(D)), k[:, :Lp].transpose(1, 2))  # [Hkv, G*T, Lp]
    if scores.dtype != torch.float32:
        scores = scores.float()
    hidden = torch.ones(T, Lp, dtype=torch.bool, device=q.device)
    if mask is None:
        hidden[:, :L] = False
    else:
        hidden[:, :L] = ~mask
    scores.view(Hkv, G, T, Lp).masked_fill_(hidden, -math.inf)
    # softmax with an order-insensitive denominator: a tree node's visible keys sit at other
    # slots than the same token's keys in plain decoding, and a vectorised float32 sum would
    # associate them differently; a float64 sum rounds to the same float32 either way
    e = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
    p = e.div_(e.sum(dim=-1, keepdim=True, dtype=torch.float64).to(e.dtype)).to(v.dtype)
    p = p.view(Hkv, G, T, Lp)
    # each row's position: the tree slots it sees are its ancestors and itself
    start = L - T
    if mask is None:
        pos = [L - 1] * T
    else:
        depth = mask[:, start:L].sum(dim=1).clamp_(min=1) - 1
        pos = (depth + start).tolist()
    cut = [max(0, (x // PV_CHUNK - 1) * PV_CHUNK) for x in pos]
    out = torch.empty(Hkv, G, T, D, dtype=torch.float32, device=q.device)
    for c in sorted(set(cut)):
        rows = [r for r in range(T) if cut[r] == c]
        idx = torch.tensor(rows if len(rows) > 1 else rows * 2, device=q.device)
        R = idx.numel()
        pr = p.index_select(2, idx).reshape(Hkv, G * R, Lp)
        # keys past L have p == 0 exactly: leaving them out changes no float64 sum
        res = torch.bmm(pr[:, :, c:L].double(), v[:, c:L].double()).float()   # [Hkv, G*R, D]
        if c > 0:
            n = c // PV_CHUNK
            pc = pr[:, :, :c].reshape(Hkv, G * R, n, PV_CHUNK).transpose(1, 2).reshape(Hkv * n, G * R, PV_CHUNK)
            vc = v[:, :c].reshape(Hkv * n, PV_CHUNK, D)
            res = _ordered_sum(torch.bmm(pc, vc).view(Hkv, n, G * R, D)) + res
        res = res.view(Hkv, G, R, D)
        out[:, :, rows] = res[:, :, :len(rows)] if len(rows) > 1 else res[:, :, :1]
    return out.view(H, T, D)


def _ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 in a fixed pairwise order that depends only on its length."""
    while parts.shape[1] > 1:
        n = parts.shape[1]
        head = parts[:, 0:n - 1:2] + parts[:, 1:n:2]
        parts = torch.cat([head, parts[:, n - 1:]], dim=1) if n % 2 else head
    return parts[:, 0]


def causal_mask(start: int, T: int, device) -> torch.Tensor:
    """``[T, start + T]`` bool: every new token sees the prefix and the new tokens before it."""
    m = torch.ones(T, start + T, dtype=torch.bool, device=device)
    m[:, start:] = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return m


class Transformer(nn.Module):
    Segment = Segment   # the record forward_segments takes (the decode step builds them through the model)

    def __init__(self, args: ModelArgs, *, init_weights: bool = True):
        """``init_weights=False``: the projections (``skip_init``) and the embedding are left
        uninitialised for a caller that loads every weight next (``EmbeddedEngine``: the random
        init of 135M parameters took ~1.2 s of a ~3 s start-up)."""
        super().__init__()
        self.args = args
        self.embed = (nn.Embedding(args.vocab_size, args.dim) if init_weights
                      else nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim)))
        self.layers = nn.ModuleList(Block(args, init_weights=init_weights) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = None
        if not args.tie_embeddings:
            self.lm_head = (nn.Linear(args.dim, args.vocab_size, bias=False) if init_weights
                            else skip_init(nn.Linear, args.dim, args.vocab_size, bias=False))
        self.head_packed: cpu_linear.PackedLinear | None = None
        # the projections and the head are cpu_quant.QuantLinear (a GGUF file's weights, kept
        # quantized: ``set_quantized``), in ``Block.packed`` / ``head_packed``
        self.quantized = False
        # what the kernels are asked to do (the environment's unless set: ``set_kernel_settings``)
        # and the plan chosen from it, per ISA level (``plan``)
        self.kernel_settings: Settings = Settings.from_env()
        self.kv_dtype = torch.float32   # the KV caches' dtype (the engine's ``kv_dtype``): the plan reads it
        self._plans: dict = {}
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,      # [T] int64
        positions: torch.Tensor,   # [T] int64
        cache: KVCache,
        mask: torch.Tensor | None = None,  # [T, key_len] bool; None = causal
        *,
        logits_rows: torch.Tensor | slice | None = None,  # which rows need logits (None: all)
        key_len: int | None = None,  # attend over cache slots [0, key_len) (default: start + T)
        hidden_layers: Sequence[int] = (),  # also return these layers' outputs (see below)
        prefill: bool = False,     # prompt tokens (causal, ``mask`` None): the prefill kernels at any T
        float_logits: bool = True,  # False: the logits in the head's own dtype (see ``_logits``)
    ) -> torch.Tensor | tuple[torch.Tensor, dict[int, torch.Tensor]]:  # [rows, vocab] float32
        """Logits of ``logits_rows``. With ``hidden_layers`` (layer indices), returns
        ``(logits, {layer: [T, dim]})``: each named layer's output (the residual stream after the
        layer) for every row, as a draft head such as EAGLE-3 reads them. Nothing is kept or
        copied when none is asked for.

        ``prefill``: the rows are a chunk of a prompt after ``cache.length`` prompt tokens
        (``Decoder.prefill``'s canonical chunks): torch's GEMM and ``prefill_attention``
        whatever the chunk's length, as for the first chunk; without it a short chunk after a
        prefix would take the decode kernels."""
        start = cache.length
        if start + tokens.shape[0] > cache.capacity:
            raise RuntimeError(f"KV cache overflow: {start} + {tokens.shape[0]} > {cache.capacity}")
        dtype = self.norm.weight.dtype
        x = self.embed(tokens)
        cos = self.rope_cos[positions].to(dtype)
        sin = self.rope_sin[positions].to(dtype)
        T = tokens.shape[0]
        causal = False
        chunk = False  # a prompt chunk after a prefix (``Decoder.prefill``'s canonical chunks)
        plan = self.plan()
        # prompt attention on AMX tiles where the plan says so (a packed cache, chunks at
        # multiples of 16 positions); else SDPA's flash kernel or the blockwise path below
        amx = (mask is None and (start == 0 and T > 1 or start > 0 and (prefill or T > SMALL_T))
               and start % 16 == 0 and plan.prefill_attention == "amx" and getattr(cache, "packed", False))
        if amx:
            chunk = start > 0
            causal = start == 0
        elif mask is None and start > 0 and (prefill or T > SMALL_T):
            mask = causal_mask(start, T, tokens.device)   # (the block paths make their own)
            chunk = True
        elif mask is None and T > 1:
            if start == 0:
                causal = True  # prefill from an empty cache: the same block paths
            else:
                mask = causal_mask(start, T, tokens.device)
        key_len = start + T if key_len is None else key_len
        a = self.args
        fused = not causal and not chunk and T <= SMALL_T and plan.fused and getattr(cache, "packed", False)
        want = _check_layers(hidden_layers, len(self.layers))
        hidden: dict[int, torch.Tensor] = {}
        if fused:
            attn = cpu_attention.QKVAttention([(cache, start, key_len, mask, T)], cos, sin, n_heads=a.n_heads,
                                              n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                              mode=plan.rows_attention)
            x = self._layers(x, want, hidden, lambda layer, x, i: layer.forward_native(x, i, attn, plan))
        else:
            x = self._layers(x, want, hidden,
                             lambda layer, x, i: layer(x, i, cache, start, cos, sin, mask, causal, key_len, plan,
                                                       chunk, amx))
            if not amx:  # the AMX kernel wrote the packed copies itself
                cache.sync(range(start, start + T))
        if logits_rows is not None:
            x = x[logits_rows]
        logits = self._logits(x, plan, fused=fused, to_float=float_logits)
        return (logits, hidden) if want else logits

    def _layers(self, x: torch.Tensor, want: frozenset[int], hidden: dict[int, torch.Tensor], run) -> torch.Tensor:
        """``x`` through every layer (``run(layer, x, i)``), keeping the outputs of ``want`` in ``hidden``."""
        for i, layer in enumerate(self.layers):
            x = run(layer, x, i)
            if i in want:
                hidden[i] = x
        return x

    def _logits(self, x: torch.Tensor, plan: KernelPlan | None = None, *, fused: bool = False,
                to_float: bool = True) -> torch.Tensor:
        """Final norm and output projection (tied embeddings unless lm_head), in float32.
        ``fused``: rows of the fused decode path, which take the plan's head (``plan.head``: on
        AMX tiles after the native norm, or the packed head); other rows take the packed head
        up to ``SMALL_T`` rows, else torch's GEMM. ``to_float`` False: the projection's own
        output (bfloat16 for a bfloat16 model), not converted. The values are the same (float32
        holds every bfloat16 exactly), so an argmax is the same index; a greedy step skips the
        conversion (at a batch's rows, [R, vocab] float32 is tens of MB written and freed every
        step)."""
        plan = self.plan() if plan is None else plan
        cast = (lambda t: t.float()) if to_float else (lambda t: t)
        if self.quantized:   # the final norm fused into the head's input; float32 logits (llama.cpp's too):
            # rounded to bfloat16, near-equal logits tie and the lowest id would win a greedy step
            return self.head_packed(x, norm=(self.norm.weight, self.norm.eps), dtype=torch.float32)
        if fused and plan.head == "amx":
            return cast(self.head_packed.prefill(cpu_attention.rms_norm(x, self.norm.weight, self.norm.eps)))
        if self.head_packed is not None and (fused or x.shape[0] <= SMALL_T):
            return cast(self.head_packed(self.norm(x)))
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        if w.numel() == 0:   # pack_linears(keep_weights=False) kept only the packed head
            w = self.head_packed.weight()
        if plan.torch_linears == "float32" and x.dtype == torch.bfloat16:
            return F.linear(self.norm(x).float(), w.float())
        return cast(F.linear(self.norm(x), w))

    # ---- the kernel plan ----------------------------------------------------------------------

    def set_kernel_settings(self, settings: Settings) -> None:
        """Ask the kernels for ``settings`` (``plan.Settings``) from now on (tests and
        benchmarks compare kernels on one model; the engine sets the environment's once)."""
        self.kernel_settings = settings
        self._plans.clear()

    def set_kv_dtype(self, dtype: torch.dtype) -> None:
        """The dtype of the KV caches this model's forwards get (the engine's ``kv_dtype``): the
        plan's attention choices read it."""
        self.kv_dtype = dtype
        self._plans.clear()

    def plan(self, facts: Facts | None = None) -> KernelPlan:
        """The kernel plan for the ISA level the native kernels run at now (``plan.KernelPlan``:
        chosen once per level and settings, then looked up)."""
        facts = Facts.now() if facts is None else facts
        key = (facts, self.kernel_settings)
        got = self._plans.get(key)
        if got is None:
            a, w = self.args, self.norm.weight    # the model's dtype and device
            head = self.head_packed
            got = self._plans[key] = KernelPlan.choose(
                device=w.device, dtype=w.dtype, kv_dtype=self.kv_dtype, head_dim=a.head_dim, n_heads=a.n_heads,
                n_kv_heads=a.n_kv_heads, packed=head is not None, amx_weights=self.layers[0].amx_linears,
                head_k=head.K if head is not None else 0, gemm_f32=self.layers[0].gemm_f32,
                settings=self.kernel_settings, facts=facts, weight_copies=self.weight_copies,
                quantized=self.quantized)
        return got

    def native_decode_norm(self) -> bool:
        """Whether the fused decode / verify rows take their norms natively (the plan's
        ``rows_norms``)."""
        return self.plan().rows_norms == "native"

    def decode_linears_amx(self) -> bool:
        """Whether the fused decode / verify rows project on AMX tiles now (the plan's
        ``rows_linears``: every projection packed and AMX-capable, the head included, and a
        bfloat16 GEMM, at the top ISA level). Decided per ISA level, so every row of a forward
        (and every forward while the level stays) takes the same kernel."""
        return self.plan().rows_linears == "amx"

    def prefill_row_invariant(self, cache: KVCache) -> bool:
        """Whether prompt chunks over ``cache`` run the AMX path end to end (``Block.forward_amx``:
        AMX attention and AMX projections, native norms and rotary), where every prefill row's
        bits depend on its own tokens and the keys before it alone, not on how the prompt is
        split into forwards (``Decoder.prefill`` then takes several canonical chunks per
        forward: the same bits, the weights streamed once per forward)."""
        return self.plan().prefill_linears == "amx" and getattr(cache, "packed", False)

    def prefill_split_invariant(self, cache: KVCache) -> bool:
        """Whether a prompt row's bits over ``cache`` depend on its own tokens and the keys before
        it alone, not on where the prompt was cut into forwards, to the token: the quantized
        linears (row by row, any row count) with the blockwise prefill attention on a CPU (every
        query block at its whole block's shapes: ``prefill_attention`` /
        ``prefill_attention_sdpa``; ``cpu_attention.prefill_bf16``, row by row). The prefix cache then reuses any prefix of a prompt
        (``prefix_cache``, "Reuse to the token"); ``tests/integration/test_prefix_cache.py``
        checks the bits."""
        plan = self.plan()
        amx = plan.prefill_attention == "amx" and getattr(cache, "packed", False)
        return (plan.device == "cpu" and self.quantized and plan.prefill_linears == "quantized" and not amx
                and plan.prefill_fallback in ("native", "sdpa", "blockwise"))

    def set_gemm_float32(self, on: bool) -> None:
        """Torch-path linears (prefill) of a bfloat16 model multiply in float32 (``Block.proj``'s
        "float32"): for CPUs without bfloat16 dot products. Decode rows use the native linears
        either way."""
        for layer in self.layers:
            layer.gemm_f32 = bool(on)
        self._plans.clear()

    def pack_linears(self, keep_weights: bool = True) -> bool:
        """Give decode / verify forwards on the native attention path (a bfloat16 model on CPU
        with a packed KV cache) the native row-invariant linears (``cpu_linear.PackedLinear``),
        which keep a second, panel-packed copy of every projection. Prefill keeps torch's GEMM.
        Returns whether they are on (False where the kernels do not run).

        ``keep_weights=False``: the packed copy is the only one. Each projection's weight is
        freed as soon as it is packed (peak: the model plus one projection), and torch-path
        forwards (prompt chunks off the AMX path) unpack one projection at a time
        (``Block.weight``): the same values, so the same bits, for a copy of the weights per
        prompt forward. For models that do not fit in memory twice."""
        w = self.embed.weight
        st, facts = self.kernel_settings, Facts.now()
        if not (st.native_linears and st.native_attention and facts.linear_kernels and w.dtype == torch.bfloat16
                and w.device.type == "cpu"):
            return False
        self._plans.clear()
        for layer in self.layers:
            mods = (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
            layer.amx_linears = facts.amx and all(m.weight.shape[1] % 32 == 0 for m in mods)
            packed = []
            for m in mods:
                packed.append(cpu_linear.PackedLinear(m.weight))
                if not keep_weights:
                    _drop_weight(m)
            layer.packed = tuple(packed)
        self.head_packed = cpu_linear.PackedLinear(w if self.lm_head is None else self.lm_head.weight)
        if not keep_weights and self.lm_head is not None:
            _drop_weight(self.lm_head)
        return True

    def drop_projections(self) -> None:
        """Free every projection's (and an untied head's) torch weight before the model moves to
        its dtype: a model whose projections come quantized (``set_quantized``) never holds them."""
        for layer in self.layers:
            for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
                _drop_weight(m)
        if self.lm_head is not None:
            _drop_weight(self.lm_head)
        _drop_weight(self.embed)

    def set_quantized(self, linears: dict) -> None:
        """The projections as quantized linears (``cpu_quant.QuantLinear``, by our parameter name,
        e.g. ``layers.0.wqkv.weight``, ``head`` for the output projection and, where the
        embeddings are not tied, ``embed`` for the token embedding): every decode, verify and
        prefill row multiplies with them (the plan's "quantized" linears); a row's bits depend on
        that row alone. The embedding looks its rows up from ``embed`` (tied: ``head``).
        Call ``drop_projections`` first."""
        for i, layer in enumerate(self.layers):
            layer.packed = tuple(linears[f"layers.{i}.{n}.weight"] for n in ("wqkv", "wo", "w_gate_up", "w_down"))
            layer.amx_linears = False
        self.head_packed = linears["head"]
        self.embed = QuantEmbedding(linears.get("embed", linears["head"]), self.norm.weight.dtype)
        self.quantized = True
        self._plans.clear()

    def linear_weight_bytes(self) -> int:
        """Bytes of the projections ``pack_linears`` packs (each layer's four and the output head)."""
        if self.quantized:
            return sum(lin.nbytes for layer in self.layers for lin in layer.packed) + self.head_packed.nbytes
        mods = [m for layer in self.layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return sum(m.weight.numel() * m.weight.element_size() for m in mods) + head.numel() * head.element_size()

    @property
    def weight_copies(self) -> int:
        """2 where the torch weights are kept beside the packed copy, else 1."""
        return 1 if self.head_packed is not None and self.layers[0].wqkv.weight.numel() == 0 else 2

    def row_invariant(self, cache: KVCache) -> bool:
        """Whether a decode / verify row's logits over ``cache`` are the same bits however many
        rows share its forward (so a plain decoding step needs no padding row): the fused path
        with packed linears, or the quantized linears (their norms fused in) with the native
        attention on the layered path, where every other op is elementwise."""
        if self.head_packed is None:
            return False
        plan = self.plan()
        if self.quantized and not plan.fused:
            return plan.layered_attention == "native" and cache.k.dtype in cpu_attention.CACHE_DTYPES
        return plan.fused and getattr(cache, "packed", False)

    @torch.inference_mode()
    def forward_segments(
        self,
        tokens: torch.Tensor,      # [R] int64: every segment's rows, in order
        positions: torch.Tensor,   # [R] int64
        segs: list[Segment],
        hidden_layers: Sequence[int] = (),
        float_logits: bool = True,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[int, torch.Tensor]]:  # [R, vocab] float32
        """Decode/verify rows of several requests, each with its own KV cache, in one forward.
        ``hidden_layers``, ``float_logits``: as in ``forward`` (then ``(logits, {layer: [R, dim]})``)."""
        off = 0
        for sg in segs:
            if sg.cache.length + sg.rows > sg.cache.capacity:
                raise RuntimeError(f"KV cache overflow: {sg.cache.length} + {sg.rows} > {sg.cache.capacity}")
            if sg.rows > SMALL_T:
                raise ValueError(f"a segment has {sg.rows} rows; at most {SMALL_T}")
            sg.offset = off
            off += sg.rows
        if off != tokens.shape[0]:
            raise ValueError(f"segments cover {off} rows, tokens has {tokens.shape[0]}")
        dtype = self.norm.weight.dtype
        x = self.embed(tokens)
        cos = self.rope_cos[positions].to(dtype)
        sin = self.rope_sin[positions].to(dtype)
        a = self.args
        plan = self.plan()
        want = _check_layers(hidden_layers, len(self.layers))
        hidden: dict[int, torch.Tensor] = {}
        fused = plan.fused and all(getattr(sg.cache, "packed", False) for sg in segs)
        if fused:
            attn = cpu_attention.QKVAttention(
                [(sg.cache, sg.cache.length, sg.cache.length + sg.rows, sg.mask, sg.rows) for sg in segs], cos, sin,
                n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, mode=plan.rows_attention)
            x = self._layers(x, want, hidden, lambda layer, x, i: layer.forward_native(x, i, attn, plan))
        else:
            x = self._layers(x, want, hidden, lambda layer, x, i: layer.forward_segments(x, i, segs, cos, sin, plan))
            for sg in segs:
                sg.cache.sync(range(sg.cache.length, sg.cache.length + sg.rows))
        logits = self._logits(x, plan, fused=fused, to_float=float_logits)
        return (logits, hidden) if want else logits

    def param_count(self) -> int:
        """Parameters of the model (a projection kept only in packed form counts its weight)."""
        n = sum(p.numel() for p in self.parameters())
        if self.quantized:
            lins = [lin for layer in self.layers for lin in layer.packed] + [self.head_packed]
            if self.embed.lin is not self.head_packed:
                lins.append(self.embed.lin)
            return n + sum(lin.N * lin.K for lin in lins)
        if self.weight_copies == 1:
            n += sum(lin.N * lin.K for layer in self.layers for lin in layer.packed)
            if self.lm_head is not None:
                n += self.head_packed.N * self.head_packed.K
        return n


def _drop_weight(m: nn.Linear) -> None:
    """Free ``m``'s weight (``pack_linears(keep_weights=False)``): an empty parameter of its dtype."""
    m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)


def _check_layers(layers: Sequence[int], n: int) -> frozenset[int]:
    want = frozenset(int(i) for i in layers)
    if any(not 0 <= i < n for i in want):
        raise ValueError(f"hidden_layers {sorted(want)} must be layer indices in [0, {n})")
    return want


def round_up(n: int, m: int) -> int:
    return int(math.ceil(n / m) * m)
