"""Triton kernel for tree verification (layout: ``agentspec.kernels.tree``).

Imported lazily by ``agentspec.kernels.tree`` (triton is optional). On CPU they run under
Triton's interpreter when ``TRITON_INTERPRET=1`` is set before this module is imported.
Each kernel is tested for equality against its torch reference in ``tree.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tree import check_layout

__all__ = ["greedy_verify_batch"]


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
