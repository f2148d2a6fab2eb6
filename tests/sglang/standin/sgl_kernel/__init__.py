"""Pure-torch stand-in for the ``sgl_kernel`` ops SGLang 0.5.23's CPU path calls.

TEST INFRASTRUCTURE ONLY (installed into .venv-sglang by scripts/setup_sglang.sh, never part of
agentspec). SGLang's CPU path (``SGLANG_USE_CPU_ENGINE=1``) imports these from ``sgl_kernel``, whose
CPU build is not published; each function here reproduces the contract of the op it replaces, as
SGLang calls it (same positional order, same in-place outputs):

* cache-location ops: the Triton kernels of the same name in ``sglang.kernels.ops.speculative``
  (``assign_extend_cache_locs``, ``assign_draft_cache_locs_contiguous``, ``fill_bonus_tokens``,
  ``fill_accept_out_cache_loc``) and ``sglang.srt.mem_cache.allocation.assign_req_to_token_pool``;
* ``verify_tree_greedy_cpu``: ``VerifyTreeGreedy`` in the wheel's jit ``speculative/eagle.cuh``;
* ``build_tree_kernel_efficient_cpu`` (EAGLE): ``build_tree_efficient`` /
  ``build_tree_efficient_partial_packed`` in the same file (Triton twin in spec_tree.py);
* ``build_draft_decode_metadata_cpu`` (EAGLE multi-step draft): the KV rows of
  ``generate_draft_decode_kv_indices`` in ``sglang.kernels.ops.speculative.cache_locs``;
* ``copy_all_layer_kv_cache_cpu``: ``copy_all_layer_kv_cache_tiled`` (raw buffer pointers);
* ``speculative.reconstruct_indices_from_tree_mask``: the spec in the docstring of
  ``sglang/kernels/ops/speculative/reconstruct_tree.py``;
* ``torch.ops.sgl_kernel.extend_attention_cpu`` / ``decode_attention_cpu``: attention over the paged
  KV cache as ``intel_amx_backend.py`` calls it (GQA, optional tree mask, logit cap, sinks,
  sliding window), computed in float32.

Deliberately absent: ``convert_weight_packed`` (SGLang then keeps every linear layer on its torch
fallback: ``cpu_has_amx_support()`` stays False) and every other fused CPU kernel.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import speculative  # noqa: F401  (sgl_kernel.speculative.reconstruct_indices_from_tree_mask)

__version__ = "0.0.0+agentspec.standin"
AGENTSPEC_STANDIN = True  # the plugin checks this: it acts only when this module is sgl_kernel


# ---------------------------------------------------------------------------------------------
# cache-location ops (speculative decoding bookkeeping)
# ---------------------------------------------------------------------------------------------

def _ints(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).tolist()


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """out_cache_loc = concat_i req_to_token[req_pool_indices[i], start[i]:end[i]]."""
    rows = req_to_token.view(-1, pool_len)
    out = 0
    for r, s, e in zip(_ints(req_pool_indices), _ints(start_offset), _ints(end_offset)):
        n = e - s
        if n > 0:
            out_cache_loc[out:out + n] = rows[r, s:e].to(out_cache_loc.dtype)
            out += n


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """The inverse: req_to_token[req_pool_indices[i], start[i]:end[i]] = next slice of out_cache_loc."""
    rows = req_to_token.view(-1, pool_len)
    src = 0
    for r, s, e in zip(_ints(req_pool_indices), _ints(start_offset), _ints(end_offset)):
        n = e - s
        if n > 0:
            rows[r, s:e] = out_cache_loc[src:src + n].to(req_to_token.dtype)
            src += n


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc,
                                           pool_len, topk, speculative_num_steps):
    """Request i's topk*steps slots from seq_lens[i] on, to out_cache_loc[i*topk*steps:]."""
    rows = req_to_token.view(-1, pool_len)
    n = topk * speculative_num_steps
    for i, (r, s) in enumerate(zip(_ints(req_pool_indices), _ints(seq_lens))):
        out_cache_loc[i * n:(i + 1) * n] = rows[r, s:s + n].to(out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus_tokens[i] = accept_tokens.flat[i*accept_stride + accept_lens[i] - 1]."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(_ints(accept_lens)):
        bonus_tokens[i] = flat[i * accept_stride + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact: the k-th entry of accept_index that is not -1 sends out_cache_loc[it] to slot k."""
    idx = accept_index.reshape(-1)
    kept = idx[idx != -1].to(torch.int64)
    accept_out_cache_loc[:kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """VerifyTreeGreedy (eagle.cuh): walk each request's draft tree from the root, at each depth
    accepting the first child (then its siblings in order) whose token equals the target's
    greedy prediction at the last accepted node. In place: predicts[flat node] = accepted token
    (and the bonus token at the last accepted node), accept_index[b, :k+1] = accepted flat nodes
    (root first), accept_token_num[b] = k (accepted drafts, bonus not counted)."""
    bs, num_draft = candidates.shape
    num_spec = accept_index.shape[1]
    cand = candidates.tolist()
    ridx = retrive_index.reshape(bs, num_draft).tolist()
    nxt = retrive_next_token.reshape(bs, num_draft).tolist()
    sib = retrive_next_sibling.reshape(bs, num_draft).tolist()
    target = target_predict.reshape(-1).tolist()
    pred_flat = predicts.view(-1)
    for b in range(bs):
        last = ridx[b][0]
        accept_index[b, 0] = last
        accepted = 0
        cur = 0
        for _ in range(1, num_spec):
            cur = nxt[b][cur]
            while cur != -1:
                if cand[b][cur] == target[last]:
                    pred_flat[last] = target[last]
                    accepted += 1
                    accept_index[b, accepted] = ridx[b][cur]
                    last = ridx[b][cur]
                    break
                cur = sib[b][cur]
            if cur == -1:
                break
        accept_token_num[b] = accepted
        pred_flat[last] = target[last]


_FULL_MASK, _QLEN_ONLY, _QLEN_ONLY_BITPACKING = 0, 1, 2


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask,
                                    positions, retrive_index, retrive_next_token,
                                    retrive_next_sibling, topk, depth, draft_token_num,
                                    tree_mask_mode):
    """EAGLE draft tree -> verify metadata, in place: ``build_tree_efficient`` /
    ``build_tree_efficient_partial_packed`` in the wheel's jit ``speculative/eagle.cuh`` (the
    Triton twin: ``sgl_build_tree_kernel_efficient_triton`` in spec_tree.py). Per request b
    (n = draft_token_num, node 0 = the bonus/root token, node i > 0 = selected_index[b, i-1]):
    parent(i) = root when selected_index[b, i-1] // topk == 0, else the node whose
    selected_index equals parent_list[b, selected_index[b, i-1] // topk] (searched among the
    n-1 selected, as Triton does). retrive_index[b, i] = b*n + i; children are linked by
    walking i = n-1 .. 1: each new child of p becomes retrive_next_token[p] and the previous one
    its retrive_next_sibling (so the lists end up in increasing node order); positions = seq_len
    + depth. tree_mask row i: column 0 (root), i itself and its ancestors set, other tree
    columns cleared; FULL_MASK rows are seq_len + n wide after the previous requests' rows (the
    prefix columns are not touched), QLEN_ONLY rows are n wide, QLEN_ONLY_BITPACKING rows are
    1/2/4 little-endian bytes with bit j for column j (OR-ed in: the caller zero-fills)."""
    bs = verified_seq_len.numel()
    n = int(draft_token_num)
    if bs == 0:
        return
    sel = selected_index.reshape(bs, -1).tolist() if n > 1 else [[] for _ in range(bs)]
    par = parent_list.reshape(bs, -1).tolist()
    seq = _ints(verified_seq_len)
    pos_flat, ridx_flat = positions.view(-1), retrive_index.view(-1)
    nxt_flat, sib_flat = retrive_next_token.view(-1), retrive_next_sibling.view(-1)

    def parent_pos(b, cur):  # node index (1..n-1) of the parent of selected cur (0-based), 0 root
        tb = sel[b][cur] // topk
        if tb == 0:
            return 0
        tok = par[b][tb]
        for pp in range(n - 1):
            if sel[b][pp] == tok:
                return pp + 1
        return None  # "invalid eagle tree": ignored, as the kernels do

    if tree_mask_mode == _QLEN_ONLY_BITPACKING:
        width = 4 if n > 16 else (2 if n > 8 else 1)
        mask_bytes = tree_mask.view(torch.uint8).view(-1)
    else:
        mask_bytes = tree_mask.view(-1)
    seq_tree_idx = 0
    for b in range(bs):
        s = seq[b]
        base = b * n
        # links (thread 0 of the kernel)
        pos_flat[base] = s
        nxt = [int(x) for x in nxt_flat[base:base + n].tolist()]
        sib = [int(x) for x in sib_flat[base:base + n].tolist()]
        for i in range(n - 1, 0, -1):
            ridx_flat[base + i] = base + i
            p = parent_pos(b, i - 1)
            if p is None:
                continue
            if nxt[p] != -1:
                sib[i] = nxt[p]
            nxt[p] = i
        ridx_flat[base] = base
        nxt_flat[base:base + n] = torch.tensor(nxt, dtype=nxt_flat.dtype)
        sib_flat[base:base + n] = torch.tensor(sib, dtype=sib_flat.dtype)
        # mask rows and depths (threads 1..n-1)
        for t in range(n):
            cols = [0]
            position = 0
            if t > 0:
                cur = t - 1
                for _ in range(depth):
                    position += 1
                    cols.append(cur + 1)
                    p = parent_pos(b, cur)
                    if p is None or p == 0:
                        break
                    cur = p - 1
                pos_flat[base + t] = position + s
            if tree_mask_mode == _QLEN_ONLY_BITPACKING:
                start = (base + t) * width
                bits = 0
                for c in cols:
                    bits |= 1 << c
                for k in range(width):
                    mask_bytes[start + k] |= (bits >> (8 * k)) & 0xFF
            else:
                if tree_mask_mode == _FULL_MASK:
                    start = seq_tree_idx + (s + n) * t + s
                else:
                    start = n * n * b + n * t
                row = torch.zeros(n, dtype=torch.bool)
                row[cols] = True
                mask_bytes[start:start + n] = row.to(mask_bytes.dtype)
        seq_tree_idx += s * n + n * n


def build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens, topk,
                                    speculative_num_steps, pool_len):
    """The per-branch req_to_token of EAGLE's multi-step draft decode, as
    ``IntelAMXMultiStepDraftBackend`` uses it (row bs*topk, read with req_pool_indices =
    arange(bs*topk) and seq_lens = seq_lens.repeat_interleave(topk) + step + 1): row b*topk + k
    = request b's prefix req_to_token[pool_b, :seq_b], then its branch-k draft slots
    req_to_token[pool_b, seq_b + k*num_steps + j] for j < num_steps (the layout
    ``assign_draft_cache_locs_contiguous`` allocates and ``per_step_draft_out_cache_loc`` writes;
    the kv-index semantics of ``generate_draft_decode_kv_indices`` in cache_locs.py with
    page_size 1). Returns a new [bs*topk, pool_len] tensor of req_to_token's dtype (0 past the
    used entries)."""
    rows = req_to_token.view(-1, pool_len)
    bs = req_pool_indices.numel()
    steps = int(speculative_num_steps)
    out = torch.zeros((bs * topk, pool_len), dtype=req_to_token.dtype, device=req_to_token.device)
    for b, (r, s) in enumerate(zip(_ints(req_pool_indices), _ints(seq_lens))):
        for k in range(topk):
            row = out[b * topk + k]
            row[:s] = rows[r, :s]
            m = min(steps, pool_len - s)
            if m > 0:
                row[s:s + m] = rows[r, s + k * steps:s + k * steps + m]
    return out


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every buffer i (raw base pointer data_ptrs[i], row size strides[i] bytes): row tgt[j] =
    row src[j], all rows read before any is written (as the Triton kernel, safe in place)."""
    tgt = tgt_loc.reshape(-1).to(torch.int64)
    src = src_loc.reshape(-1).to(torch.int64)
    if tgt.numel() == 0:
        return
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for base, stride in zip(_ints(data_ptrs), _ints(strides)):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(base)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf[tgt] = buf[src].clone()


# ---------------------------------------------------------------------------------------------
# attention over the paged KV cache (torch.ops.sgl_kernel.*_attention_cpu)
# ---------------------------------------------------------------------------------------------

def _attend(q, k, v, q_pos, k_pos, allowed, sm_scale, logit_cap, window, sinks):
    """q [Lq,H,D], k/v [Lk,Hkv,D*], allowed [Lq,Lk] bool -> [Lq,H,Dv] float32."""
    h, hkv = q.shape[1], k.shape[1]
    if h != hkv:
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * sm_scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    if window > 0:  # sliding_window_size + 1: a query sees the keys less than `window` behind it
        allowed = allowed & ((q_pos[:, None] - k_pos[None, :]) < window)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(h, 1, 1).expand(h, s.shape[1], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p)  # a query row with no visible key yields zeros, not NaN
    return torch.einsum("hqk,khd->qhd", p, v.float())


def extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale,
                     req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc,
                     max_len_extend, sm_scale, logit_cap, is_cross_attn, sliding_window_size,
                     encoder_lens, sinks, tree_mask, is_causal):
    """Extend (prefill / verify): request i's extend tokens q_extend[start_i : start_i + ext_i]
    attend to its prefix (req_to_token[pool_i, : seq_i - ext_i] of the KV buffers) plus its
    extend tokens (k_extend/v_extend, or the buffers when those are None), causally, or through
    tree_mask: per request a row-major [ext_i, ext_i] bool block (cumulative offsets) saying
    which extend tokens each extend token sees."""
    if is_cross_attn:
        raise NotImplementedError("agentspec sgl_kernel stand-in: cross-attention")
    mask_off = 0
    for i, (r, seq, ext, start) in enumerate(zip(_ints(req_pool_indices), _ints(seq_lens),
                                                 _ints(extend_seq_lens), _ints(extend_start_loc))):
        prefix = seq - ext
        locs = req_to_token[r, :seq].to(torch.int64)
        if k_extend is not None and v_extend is not None:
            k = torch.cat([k_buffer[locs[:prefix]].float() * k_scale, k_extend[start:start + ext].float()])
            v = torch.cat([v_buffer[locs[:prefix]].float() * v_scale, v_extend[start:start + ext].float()])
        else:
            k = k_buffer[locs].float() * k_scale
            v = v_buffer[locs].float() * v_scale
        if tree_mask is not None:
            local = tree_mask[mask_off:mask_off + ext * ext].view(ext, ext).to(torch.bool)
            mask_off += ext * ext
        elif is_causal:
            local = torch.ones(ext, ext, dtype=torch.bool).tril_()
        else:
            local = torch.ones(ext, ext, dtype=torch.bool)
        allowed = torch.cat([torch.ones(ext, prefix, dtype=torch.bool), local], dim=1)
        q_pos = torch.arange(prefix, seq)
        k_pos = torch.arange(seq)
        out = _attend(q_extend[start:start + ext], k, v, q_pos, k_pos, allowed, sm_scale,
                      logit_cap, sliding_window_size, sinks)
        o_extend[start:start + ext] = out.to(o_extend.dtype)


def decode_attention(query, k_cache, v_cache, k_scale, v_scale, output, key, value, loc,
                     attn_logits, req_to_token, req_pool_indices, seq_lens, sm_scale, logit_cap,
                     is_cross_attn, sliding_window_size, encoder_lens, sinks):
    """Decode: first writes the new key/value (when given) at `loc` of the KV buffers (the
    backend leaves that to this kernel), then request b's one query token attends to
    req_to_token[pool_b, :seq_b]. attn_logits is the real kernel's scratch: unused."""
    if is_cross_attn:
        raise NotImplementedError("agentspec sgl_kernel stand-in: cross-attention")
    if key is not None and value is not None and loc is not None:
        dst = loc.to(torch.int64)
        k_cache[dst] = key.view(-1, *k_cache.shape[1:]).to(k_cache.dtype)
        v_cache[dst] = value.view(-1, *v_cache.shape[1:]).to(v_cache.dtype)
    for b, (r, seq) in enumerate(zip(_ints(req_pool_indices), _ints(seq_lens))):
        locs = req_to_token[r, :seq].to(torch.int64)
        k = k_cache[locs].float() * k_scale
        v = v_cache[locs].float() * v_scale
        allowed = torch.ones(1, seq, dtype=torch.bool)
        out = _attend(query[b:b + 1], k, v, torch.tensor([seq - 1]), torch.arange(seq), allowed,
                      sm_scale, logit_cap, sliding_window_size, sinks)
        output[b] = out[0].to(output.dtype)


_LIB = torch.library.Library("sgl_kernel", "DEF")
_LIB.define(
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
    "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
    "int? max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn, "
    "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, "
    "bool is_causal) -> ()")
_LIB.define(
    "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, "
    "float v_scale, Tensor(c!) output, Tensor? key, Tensor? value, Tensor? loc, "
    "Tensor(d!) attn_logits, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
    "float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, "
    "Tensor? encoder_lens, Tensor? sinks) -> ()")
_LIB.impl("extend_attention_cpu", extend_attention, "CPU")
_LIB.impl("decode_attention_cpu", decode_attention, "CPU")


__all__ = [
    "assign_extend_cache_locs_cpu", "assign_req_to_token_pool_cpu",
    "assign_draft_cache_locs_contiguous_cpu", "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu", "verify_tree_greedy_cpu", "build_tree_kernel_efficient_cpu",
    "build_draft_decode_metadata_cpu",
    "copy_all_layer_kv_cache_cpu", "extend_attention", "decode_attention", "speculative",
]
