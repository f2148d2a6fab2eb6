"""Tree masks, positions and verification: torch references and dispatchers.

One tree (lists): ``with_root``, ``tree_depths``, ``tree_mask``.

Batched (ragged) layout, shared with the Triton kernels in ``tree_triton``: request b owns rows
``offsets[b]:offsets[b + 1]`` of the flat tensors, in the order the engine forwards them: its
row 0 is the root (the last committed token) and row i + 1 is draft token i. Parents are local
to the request: -1 for the root, otherwise a row index < the child's (``with_root``).
``W`` is the largest tree (``max T_b``). Verification returns ``(paths, lengths, bonus)``:

    paths    # [B, W] int64  accepted local rows, root first, -1 after lengths[b]
    lengths  # [B]    int64  rows on the path = acceptance length (accepted draft tokens + 1)
    bonus    # [B]    int64  the target's token after the last accepted row

Each batched function has a torch reference (``*_torch``, any device) and a Triton kernel
(``*_triton``, CUDA, or CPU under ``TRITON_INTERPRET=1``); the plain name dispatches: Triton
for CUDA tensors, the reference elsewhere. The single-request math is ``agentspec.decode.verify``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "check_layout",
    "greedy_verify_batch",
    "greedy_verify_batch_torch",
    "greedy_verify_batch_triton",
    "tree_depths",
    "tree_mask",
    "verify_rows",
    "with_root",
]


def with_root(parents: Sequence[int]) -> list[int]:
    """Parents of ``[root] + draft`` given the draft's parents (-1 = root): ``[-1, p0+1, ...]``."""
    return [-1] + [p + 1 for p in parents]


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node; roots (parent -1) have depth 0. Parents come before children."""
    depth: list[int] = []
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def verify_rows(token_ids: Sequence[int], parents: Sequence[int], root: int, width: int, *,
                pad: str = "orphan") -> tuple[list[int], list[int], list[int]]:
    """A draft (``token_ids`` and ``parents``, -1 = the root) as the ``width`` rows a verify
    forward of fixed width takes: ``(tokens, parents, depths)`` with the root first (parent -1,
    depth 0), then the draft's first ``width - 1`` nodes (parents precede children, so any
    prefix is a tree), then padding: ``pad="orphan"`` rows repeat the root's token with parent -2
    (in no tree: each sees only itself); ``"root_child"`` rows are token 0 children of the root
    (SGLang NGRAM's padding). The embedded engine builds its rows with ``with_root`` /
    ``tree_depths`` and pads its own way (``decode.step``); every fixed-width row set is built here."""
    if pad not in ("orphan", "root_child"):
        raise ValueError(f"pad must be 'orphan' or 'root_child', got {pad!r}")
    n = min(len(token_ids), width - 1)
    tokens = [root, *token_ids[:n]]
    par = with_root(parents[:n])
    depths = tree_depths(par)
    k = width - len(tokens)
    if pad == "orphan":
        return tokens + [root] * k, par + [-2] * k, depths + [1] * k
    return tokens + [0] * k, par + [0] * k, depths + [1] * k


def tree_mask(parents: Sequence[int], *, device=None) -> torch.Tensor:
    """``[T, T]`` bool: ``mask[i, j]`` is True when j is i or an ancestor of i."""
    T = len(parents)
    m = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] = m[p]
        m[i, i] = True
    return m.to(device) if device is not None else m


# ---------------------------------------------------------------------------------- dispatch


def greedy_verify_batch(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor,
                        offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification of every request (``agentspec.decode.verify.greedy_verify``);
    ``target [N]`` is the target's argmax after each row."""
    fn = greedy_verify_batch_triton if tokens.is_cuda else greedy_verify_batch_torch
    return fn(tokens, parents, target, offsets)


def _triton():
    try:
        from . import tree_triton
    except ImportError as e:
        if not (e.name or "").startswith("triton"):
            raise
        raise ImportError(
            "the Triton tree kernels need triton: pip install triton"
        ) from e
    return tree_triton


def greedy_verify_batch_triton(tokens, parents, target, offsets):
    """Triton version of ``greedy_verify_batch``."""
    return _triton().greedy_verify_batch(tokens, parents, target, offsets)


# --------------------------------------------------------------------------- torch references


class _Padded:
    """The ragged batch as padded ``[B, W]`` views (requests walk in lockstep over columns)."""

    def __init__(self, parents: torch.Tensor, offsets: torch.Tensor) -> None:
        check_layout(parents, offsets)
        dev = parents.device
        self.offsets = offsets.long()
        self.start = self.offsets[:-1]                                   # [B]
        self.lengths = self.offsets.diff()                               # [B]
        self.B = self.lengths.numel()
        self.W = int(self.lengths.max()) if self.B else 0
        self.col = torch.arange(self.W, device=dev)                      # [W]
        self.valid = self.col < self.lengths[:, None]                    # [B, W]
        self.rows = torch.where(self.valid, self.start[:, None] + self.col, 0)  # [B, W] flat row
        self.parents = torch.where(self.valid, parents.long()[self.rows], -2)    # [B, W]

    def gather(self, x: torch.Tensor, fill) -> torch.Tensor:
        """``x [N]`` -> ``[B, W]`` with ``fill`` in padding."""
        return torch.where(self.valid, x[self.rows], fill)


def check_layout(parents: torch.Tensor, offsets: torch.Tensor) -> None:
    """Raise ValueError unless ``offsets`` and ``parents`` describe well-formed ragged trees."""
    if parents.dim() != 1 or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"parents must be [N] and offsets [B + 1], got shapes "
                         f"{tuple(parents.shape)} and {tuple(offsets.shape)}")
    if parents.is_floating_point() or offsets.is_floating_point():
        raise ValueError(f"parents and offsets must be integer tensors, got {parents.dtype} and {offsets.dtype}")
    off = offsets.long()
    if int(off[0]) != 0 or int(off[-1]) != parents.numel() or bool((off.diff() < 1).any()):
        raise ValueError(f"offsets must start at 0, grow by >= 1 (every tree has a root) and end at "
                         f"N = {parents.numel()}, got {off.tolist()[:8]}{'...' if off.numel() > 8 else ''}")
    local = torch.arange(parents.numel(), device=parents.device) - torch.repeat_interleave(off[:-1], off.diff())
    p = parents.long()
    bad = torch.where(local == 0, p != -1, (p < 0) | (p >= local))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"parents[{i}] = {int(p[i])} (row {int(local[i])} of its tree) must be "
                         f"{'-1 for a root' if int(local[i]) == 0 else f'in [0, {int(local[i])})'}")


def greedy_verify_batch_torch(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor,
                              offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of ``greedy_verify_batch``: all requests walk their rows in lockstep;
    a row is taken when its parent is the current node and its token is the target there
    (rows in index order, so the first matching child wins)."""
    if tokens.shape != parents.shape or target.shape != parents.shape:
        raise ValueError(f"tokens, parents and target must all be [N], got {tuple(tokens.shape)}, "
                         f"{tuple(parents.shape)}, {tuple(target.shape)}")
    pad = _Padded(parents, offsets)
    tok = pad.gather(tokens.long(), -1)                                  # [B, W]
    target = target.long()
    node = torch.zeros(pad.B, dtype=torch.int64, device=tokens.device)   # current local row
    paths = torch.full((pad.B, pad.W), -1, dtype=torch.int64, device=tokens.device)
    paths[:, 0] = 0
    lengths = torch.ones(pad.B, dtype=torch.int64, device=tokens.device)
    b = torch.arange(pad.B, device=tokens.device)
    for j in range(1, pad.W):
        want = target[pad.start + node]
        take = (pad.parents[:, j] == node) & (tok[:, j] == want)
        paths[b[take], lengths[take]] = j
        lengths += take
        node = torch.where(take, j, node)
    return paths, lengths, target[pad.start + node]
