"""Triton kernels for tree attention and tree verification (layout: ``agentspec.kernels.tree``).

Imported lazily by ``agentspec.kernels.tree`` (triton is optional). On CPU they run under
Triton's interpreter when ``TRITON_INTERPRET=1`` is set before this module is imported.
Each kernel is tested for equality against its torch reference in ``tree.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tree import check_layout

__all__ = ["greedy_verify_batch", "sampling_verify_batch", "tree_attention"]


@triton.jit
def _tree_attention_kernel(
    parents_ptr,   # [N] local parent rows
    offsets_ptr,   # [B + 1]
    mask_ptr,      # [B, W, W] uint8, zeroed
    depth_ptr,     # [N]
    W,
):
    b = tl.program_id(0)
    i = tl.program_id(1)
    start = tl.load(offsets_ptr + b)
    T = tl.load(offsets_ptr + b + 1) - start
    row = mask_ptr + (b.to(tl.int64) * W + i) * W
    if i < T:
        # walk from row i up to the root, marking every ancestor
        j = i.to(tl.int64)
        d = -1
        while j >= 0:
            tl.store(row + j, 1)
            j = tl.load(parents_ptr + start + j).to(tl.int64)
            d += 1
        tl.store(depth_ptr + start + i, d)
    else:
        tl.store(row + i, 1)   # padding rows see only themselves


@triton.jit
def _greedy_kernel(
    tokens_ptr,    # [N]
    parents_ptr,   # [N]
    target_ptr,    # [N] target argmax after each row
    offsets_ptr,   # [B + 1]
    paths_ptr,     # [B, W] int64, filled with -1
    lengths_ptr,   # [B]
    bonus_ptr,     # [B]
    W,
):
    b = tl.program_id(0)
    start = tl.load(offsets_ptr + b)
    T = tl.load(offsets_ptr + b + 1) - start
    path = paths_ptr + b.to(tl.int64) * W
    tl.store(path, 0)
    node = start - start          # current local row (0: the root)
    n = node + 1                  # rows on the path
    want = tl.load(target_ptr + start)
    # rows in index order: children come after their parent, siblings in order, so one pass
    # over the rows finds the first matching child of each node on the path
    for j in range(1, T):
        par = tl.load(parents_ptr + start + j)
        tok = tl.load(tokens_ptr + start + j)
        if (par == node) & (tok == want):
            tl.store(path + n, j)
            n += 1
            node = par * 0 + j
            want = tl.load(target_ptr + start + j)
    tl.store(lengths_ptr + b, n)
    tl.store(bonus_ptr + b, want)


@triton.jit
def _sampling_kernel(
    tokens_ptr,    # [N]
    parents_ptr,   # [N]
    probs_ptr,     # [N, V] float32 processed target distribution per row
    u_accept_ptr,  # [N] float32
    u_bonus_ptr,   # [N] float32
    offsets_ptr,   # [B + 1]
    paths_ptr,     # [B, W] int64, filled with -1
    lengths_ptr,   # [B]
    bonus_ptr,     # [B]
    W,
    V,
    stride_p,
    TB: tl.constexpr,        # power of two >= W
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(offsets_ptr + b)
    T = tl.load(offsets_ptr + b + 1) - start
    idx = tl.arange(0, TB)
    in_tree = idx < T
    toks = tl.load(tokens_ptr + start + idx, mask=in_tree, other=-1)      # [TB]
    pars = tl.load(parents_ptr + start + idx, mask=in_tree, other=-2)     # [TB]
    path = paths_ptr + b.to(tl.int64) * W
    tl.store(path, 0)
    node = (start - start).to(tl.int64)
    n = node + 1
    mass = tl.load(u_accept_ptr + start) * 0.0 + 1.0   # p-mass not yet rejected at `node`
    for j in range(1, T):
        par = tl.load(parents_ptr + start + j)
        if par == node:
            tok = tl.load(tokens_ptr + start + j)
            # an earlier sibling with the same token was rejected: p'(tok) = 0
            dup = tl.sum(((pars == node) & (toks == tok) & (idx < j)).to(tl.int32), axis=0) > 0
            q = tl.load(probs_ptr + (start + node).to(tl.int64) * stride_p + tok)
            q = tl.where(dup, 0.0, q)
            u = tl.load(u_accept_ptr + start + j)
            if u * mass < q:                               # accept with probability q / mass
                tl.store(path + n, j)
                n += 1
                node = par * 0 + j
                mass = mass * 0.0 + 1.0
            else:
                mass = tl.maximum(mass - q, 0.0)
    tl.store(lengths_ptr + b, n)
    # bonus: every child of `node` was rejected; inverse CDF of the residual (children zeroed)
    base = probs_ptr + (start + node).to(tl.int64) * stride_p
    threshold = tl.load(u_bonus_ptr + start + node) * mass
    is_child = (pars == node) & in_tree                                    # [TB]
    carry = mass * 0.0
    first = n * 0           # tokens whose cumulative residual <= threshold
    last = n * 0 - 1        # last token with residual mass
    best = mass * 0.0 - 1.0
    best_i = n * 0          # argmax of the row (fallback when no residual is left)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        inv = offs < V
        p = tl.load(base + offs, mask=inv, other=0.0)                      # [BLOCK_V]
        hit = tl.sum(((offs[:, None] == toks[None, :]) & is_child[None, :]).to(tl.int32), axis=1) > 0
        r = tl.where(hit, 0.0, p)
        cdf = tl.cumsum(r, axis=0) + carry
        first += tl.sum(((cdf <= threshold) & inv).to(tl.int64), axis=0)
        last = tl.maximum(last, tl.max(tl.where(r > 0, offs, -1), axis=0).to(tl.int64))
        pm = tl.where(inv, p, -1.0)
        block_best = tl.max(pm, axis=0)
        block_i = tl.min(tl.where(pm == block_best, offs, V), axis=0).to(tl.int64)
        better = block_best > best
        best_i = tl.where(better, block_i, best_i)
        best = tl.where(better, block_best, best)
        carry = tl.max(tl.where(inv, cdf, carry), axis=0)
    fallback = tl.where(last >= 0, last, best_i)
    tl.store(bonus_ptr + b, tl.where(first < V, first, fallback))


# True when the kernels were decorated under TRITON_INTERPRET=1 (they then take CPU tensors)
INTERPRETED = type(_greedy_kernel).__name__ == "InterpretedFunction"


def _int(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int64).contiguous()


def _check_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {[str(t.device) for t in tensors]}")
    if dev.type != "cuda" and not INTERPRETED:
        raise ValueError(f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {dev}")


def tree_attention(parents: torch.Tensor, offsets: torch.Tensor, *, width: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    _check_device(parents, offsets)
    check_layout(parents, offsets)
    parents, offsets = _int(parents), _int(offsets)
    B = offsets.numel() - 1
    W = int(offsets.diff().max()) if B else 0
    if width is not None:
        if width < W:
            raise ValueError(f"width {width} is smaller than the largest tree ({W} rows)")
        W = width
    mask = torch.zeros(B, W, W, dtype=torch.bool, device=parents.device)
    depth = torch.zeros(parents.numel(), dtype=torch.int64, device=parents.device)
    if B and W:
        _tree_attention_kernel[(B, W)](parents, offsets, mask.view(torch.uint8), depth, W,
                                       enable_fp_fusion=False)
    return mask, depth


def greedy_verify_batch(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor,
                        offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_device(tokens, parents, target, offsets)
    check_layout(parents, offsets)
    if tokens.shape != parents.shape or target.shape != parents.shape:
        raise ValueError(f"tokens, parents and target must all be [N], got {tuple(tokens.shape)}, "
                         f"{tuple(parents.shape)}, {tuple(target.shape)}")
    tokens, parents, target, offsets = _int(tokens), _int(parents), _int(target), _int(offsets)
    B = offsets.numel() - 1
    W = int(offsets.diff().max()) if B else 0
    dev = tokens.device
    paths = torch.full((B, W), -1, dtype=torch.int64, device=dev)
    lengths = torch.empty(B, dtype=torch.int64, device=dev)
    bonus = torch.empty(B, dtype=torch.int64, device=dev)
    if B:
        _greedy_kernel[(B,)](tokens, parents, target, offsets, paths, lengths, bonus, W,
                             enable_fp_fusion=False)
    return paths, lengths, bonus


def sampling_verify_batch(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor,
                          u_accept: torch.Tensor, u_bonus: torch.Tensor, offsets: torch.Tensor,
                          *, block_v: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_device(tokens, parents, probs, u_accept, u_bonus, offsets)
    check_layout(parents, offsets)
    N = parents.numel()
    if tokens.shape != (N,) or u_accept.shape != (N,) or u_bonus.shape != (N,):
        raise ValueError(f"tokens, u_accept and u_bonus must be [N] = [{N}], got {tuple(tokens.shape)}, "
                         f"{tuple(u_accept.shape)}, {tuple(u_bonus.shape)}")
    if probs.dim() != 2 or probs.shape[0] != N or probs.stride(1) != 1:
        raise ValueError(f"probs must be [N, V] with N = {N} and contiguous rows, got shape "
                         f"{tuple(probs.shape)}, strides {probs.stride()}")
    if probs.dtype != torch.float32:
        raise ValueError(f"probs must be float32, got {probs.dtype}")
    tokens, parents, offsets = _int(tokens), _int(parents), _int(offsets)
    u_accept, u_bonus = u_accept.float().contiguous(), u_bonus.float().contiguous()
    B = offsets.numel() - 1
    W = int(offsets.diff().max()) if B else 0
    dev = tokens.device
    V = probs.shape[1]
    paths = torch.full((B, W), -1, dtype=torch.int64, device=dev)
    lengths = torch.empty(B, dtype=torch.int64, device=dev)
    bonus = torch.empty(B, dtype=torch.int64, device=dev)
    if B:
        _sampling_kernel[(B,)](tokens, parents, probs, u_accept, u_bonus, offsets, paths, lengths, bonus,
                               W, V, probs.stride(0), TB=max(16, triton.next_power_of_2(W)),
                               BLOCK_V=min(block_v, max(16, triton.next_power_of_2(V))),
                               enable_fp_fusion=False)  # plain mul and add, as the torch reference does
    return paths, lengths, bonus
