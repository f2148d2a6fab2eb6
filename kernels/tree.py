"""Tree attention mask and positions from a parent list (torch reference)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["tree_depths", "tree_mask", "with_root"]


def with_root(parents: Sequence[int]) -> list[int]:
    """Parents of ``[root] + draft`` given the draft's parents (-1 = root): ``[-1, p0+1, ...]``."""
    return [-1] + [p + 1 for p in parents]


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node; roots (parent -1) have depth 0. Parents come before children."""
    depth: list[int] = []
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def tree_mask(parents: Sequence[int], *, device=None) -> torch.Tensor:
    """``[T, T]`` bool: ``mask[i, j]`` is True when j is i or an ancestor of i."""
    T = len(parents)
    m = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] = m[p]
        m[i, i] = True
    return m.to(device) if device is not None else m
