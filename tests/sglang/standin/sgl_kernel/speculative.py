"""``sgl_kernel.speculative`` stand-in: NGRAM verify metadata from the draft-tree mask."""

from __future__ import annotations

import torch


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrive_index,
                                       retrive_next_token, retrive_next_sibling, batch_size,
                                       draft_token_num):
    """In place, per request b and node t (n = draft_token_num; the spec in the docstring of
    sglang/kernels/ops/speculative/reconstruct_tree.py):
    tree_mask[b, i, j] (row-major, flat) marks j an ancestor of i; ancestors = mask & (j < i);
    positions[b, t] = #ancestors(t) + verified_seq_len[b]; retrive_index[b, t] = b*n + t;
    parent(t) = max{j < t ancestor} else -1; retrive_next_token[b, t] = min{k > t: t ancestor
    of k} else -1; retrive_next_sibling[b, t] = min{k > t: parent(k) == parent(t)} else -1, and
    -1 for a root."""
    bs, n = batch_size, draft_token_num
    if bs == 0:
        return
    m = tree_mask.reshape(-1)[: bs * n * n].view(bs, n, n).to(torch.bool)
    idx = torch.arange(n)
    anc = m & (idx[None, None, :] < idx[None, :, None])             # [b, i, j]: j < i ancestor
    depth = anc.sum(-1)                                              # [b, i]
    positions.view(-1)[: bs * n] = (depth + verified_seq_len.view(bs, 1).to(torch.int64)).reshape(-1).to(positions.dtype)
    retrive_index.view(-1)[: bs * n] = torch.arange(bs * n, dtype=retrive_index.dtype)
    parent = torch.where(anc.any(-1), (anc * idx).amax(-1), torch.full_like(depth, -1))   # [b, i]
    big = torch.full((bs, n, n), n, dtype=torch.int64)
    rows = idx.view(1, n, 1).expand(bs, n, n)
    first_child = torch.where(anc, rows, big).amin(1)              # over i for column t
    next_token = torch.where(first_child < n, first_child, torch.full_like(first_child, -1))
    same = (parent[:, :, None] == parent[:, None, :]) & (idx[:, None] > idx[None, :])    # [b, k, t]
    first_sib = torch.where(same, rows, big).amin(1)
    next_sib = torch.where((parent >= 0) & (first_sib < n), first_sib, torch.full_like(first_sib, -1))
    retrive_next_token.view(-1)[: bs * n] = next_token.reshape(-1).to(retrive_next_token.dtype)
    retrive_next_sibling.view(-1)[: bs * n] = next_sib.reshape(-1).to(retrive_next_sibling.dtype)
