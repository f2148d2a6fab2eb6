"""The sgl_kernel stand-in (tests/sglang/standin) against SGLang's own semantics.

References, in order of preference: the wheel's own Triton kernels of the same ops, run in Triton's
CPU interpreter (conftest.py imports them under TRITON_INTERPRET=1); the specs SGLang writes down (the
docstring of reconstruct_tree.py, VerifyTreeGreedy in eagle.cuh, the host-side tree links in
ngram_worker.py); and for attention, an explicit softmax(QK^T / sqrt(d)) V over a dense mask.
"""

from __future__ import annotations

import math
import types

import pytest

from helpers.sglang import require_sglang

require_sglang()   # before anything that imports SGLang
import torch

import sgl_kernel
from sgl_kernel.speculative import reconstruct_indices_from_tree_mask

GEN = torch.Generator().manual_seed(1234)


def interpreted(kernel):
    """The wheel's @triton.jit kernel, run by Triton's interpreter on CPU tensors (conftest.py
    imported triton and these modules under TRITON_INTERPRET=1; a kernel decorated without it is
    re-wrapped, which works as long as triton.language itself was imported in interpreter mode)."""
    from triton.runtime.interpreter import InterpretedFunction

    return kernel if isinstance(kernel, InterpretedFunction) else InterpretedFunction(kernel.fn)


def randint(lo, hi, shape, dtype=torch.int64):
    return torch.randint(lo, hi, shape, generator=GEN, dtype=dtype)


def random_tree(n: int) -> list[int]:
    """parents of a random draft tree: node 0 is the root, parent[i] < i."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=GEN)) for i in range(1, n)]


def tree_mask_of(parents: list[int]) -> torch.Tensor:
    """mask[i, j]: j is i or an ancestor of i (what the NGRAM corpus emits)."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            m[i, j] = True
            j = parents[j]
    return m


# ---------------------------------------------------------------------------------------------
# cache-location ops vs the wheel's Triton kernels
# ---------------------------------------------------------------------------------------------

def _pool(num_reqs=6, pool_len=64):
    req_to_token = randint(0, 4096, (num_reqs, pool_len), dtype=torch.int32)
    req_pool_indices = torch.tensor([4, 1, 5, 2], dtype=torch.int64)
    start = torch.tensor([3, 0, 17, 40], dtype=torch.int64)
    end = start + torch.tensor([8, 5, 1, 8], dtype=torch.int64)
    return req_to_token, req_pool_indices, start, end


def test_assign_extend_cache_locs_matches_triton():
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs

    req_to_token, rpi, start, end = _pool()
    total = int((end - start).sum())
    ours = torch.full((total,), -7, dtype=torch.int64)
    ref = ours.clone()
    sgl_kernel.assign_extend_cache_locs_cpu(rpi, req_to_token, start, end, ours, req_to_token.shape[1])
    interpreted(assign_extend_cache_locs)[(4,)](rpi, req_to_token, start, end, ref, req_to_token.shape[1], 4)
    assert torch.equal(ours, ref)
    expected = torch.cat([req_to_token[r, s:e] for r, s, e in zip(rpi, start, end)]).to(torch.int64)
    assert torch.equal(ours, expected)


def test_assign_req_to_token_pool_matches_triton():
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool

    req_to_token, rpi, start, end = _pool()
    total = int((end - start).sum())
    out_cache_loc = randint(0, 4096, (total,))
    ours, ref = req_to_token.clone(), req_to_token.clone()
    sgl_kernel.assign_req_to_token_pool_cpu(rpi, ours, start, end, out_cache_loc, ours.shape[1])
    interpreted(assign_req_to_token_pool)[(4,)](rpi, ref, start, end, out_cache_loc, ref.shape[1], 4)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, req_to_token)


def test_assign_draft_cache_locs_contiguous_matches_triton():
    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous

    req_to_token, rpi, start, _ = _pool()
    topk, steps = 2, 3
    ours = torch.full((4 * topk * steps,), -7, dtype=torch.int64)
    ref = ours.clone()
    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(rpi, req_to_token, start, ours,
                                                      req_to_token.shape[1], topk, steps)
    interpreted(assign_draft_cache_locs_contiguous)[(4,)](rpi, req_to_token, start, ref, req_to_token.shape[1],
                                             topk, steps, BS=4)
    assert torch.equal(ours, ref)


def test_fill_bonus_tokens_matches_triton():
    from sglang.kernels.ops.speculative.eagle import fill_bonus_tokens

    bs, stride = 5, 4
    accept_tokens = randint(0, 1000, (bs * stride,), dtype=torch.int32)
    accept_lens = torch.tensor([1, 4, 2, 3, 1], dtype=torch.int32)
    ours = torch.zeros(bs, dtype=torch.int32)
    ref = ours.clone()
    sgl_kernel.fill_bonus_tokens_cpu(accept_tokens, accept_lens, ours, stride)
    interpreted(fill_bonus_tokens)[(bs,)](accept_tokens, accept_lens, ref, stride)
    assert torch.equal(ours, ref)


def test_fill_accept_out_cache_loc_matches_triton():
    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc

    accept_index = torch.tensor([[0, 2, 3, -1], [4, -1, -1, -1], [8, 9, 11, 15]], dtype=torch.int32)
    out_cache_loc = randint(0, 4096, (16,))
    size = accept_index.numel()
    ours = torch.zeros(size, dtype=torch.int64)
    ref = ours.clone()
    sgl_kernel.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, ours)
    interpreted(fill_accept_out_cache_loc)[(size,)](accept_index, out_cache_loc, ref, 16)
    assert torch.equal(ours, ref)
    kept = accept_index[accept_index != -1].long()
    assert torch.equal(ours[: kept.numel()], out_cache_loc[kept])


def test_copy_all_layer_kv_cache_copies_rows_of_every_buffer():
    buffers = [torch.randn(32, 3, 8, dtype=torch.bfloat16, generator=GEN) for _ in range(2)]
    buffers.append(torch.randn(32, 5, generator=GEN))
    before = [b.clone() for b in buffers]
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in buffers])
    # overlapping source and target sets: every row must be read before any is written
    tgt = torch.tensor([3, 4, 5, 0], dtype=torch.int64)
    src = torch.tensor([4, 5, 9, 0], dtype=torch.int64)
    sgl_kernel.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    for b, old in zip(buffers, before):
        expected = old.clone()
        expected[tgt] = old[src]
        assert torch.equal(b, expected)


# ---------------------------------------------------------------------------------------------
# NGRAM tree metadata and greedy verification
# ---------------------------------------------------------------------------------------------

def _reconstruct(fn, mask, seq_lens, n):
    bs = seq_lens.numel()
    outs = [torch.full((bs * n,), -9, dtype=torch.int64) for _ in range(4)]
    fn(mask.reshape(-1), seq_lens, outs[0], outs[1].view(bs, n), outs[2].view(bs, n),
       outs[3].view(bs, n), bs, n)
    return outs


def _docstring_reference(mask, seq_lens, n):
    """The spec in sglang/kernels/ops/speculative/reconstruct_tree.py's docstring, literally."""
    bs = seq_lens.numel()
    pos, ridx, nxt, sib = ([0] * (bs * n) for _ in range(4))
    for b in range(bs):
        anc = [[bool(mask[b, i, j]) and j < i for j in range(n)] for i in range(n)]
        parent = [max((j for j in range(i) if anc[i][j]), default=-1) for i in range(n)]
        for t in range(n):
            pos[b * n + t] = sum(anc[t]) + int(seq_lens[b])
            ridx[b * n + t] = b * n + t
            nxt[b * n + t] = min((k for k in range(t + 1, n) if anc[k][t]), default=-1)
            sib[b * n + t] = -1 if parent[t] < 0 else min(
                (k for k in range(t + 1, n) if parent[k] == parent[t]), default=-1)
    return [torch.tensor(x) for x in (pos, ridx, nxt, sib)]


@pytest.mark.parametrize("n", [1, 2, 8, 13])
def test_reconstruct_indices_from_tree_mask(n, monkeypatch):
    from sglang.kernels.ops.speculative import reconstruct_tree
    from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_triton
    from sglang.srt.speculative.ngram_worker import _derive_tree_links

    bs = 4
    trees = [random_tree(n) for _ in range(bs)]
    trees[0] = [-1] + list(range(n - 1))  # a chain
    trees[1] = [-1] + [0] * (n - 1)       # a star
    mask = torch.stack([tree_mask_of(p) for p in trees])
    seq_lens = torch.tensor([5, 0, 100, 37], dtype=torch.int64)
    ours = _reconstruct(reconstruct_indices_from_tree_mask, mask, seq_lens, n)
    monkeypatch.setattr(reconstruct_tree, "_reconstruct_tree_mask_kernel",
                        interpreted(reconstruct_tree._reconstruct_tree_mask_kernel))
    triton_ref = _reconstruct(reconstruct_indices_from_tree_mask_triton, mask, seq_lens, n)
    for got, ref in zip(ours, triton_ref):
        assert torch.equal(got, ref)
    for got, ref in zip(ours, _docstring_reference(mask, seq_lens, n)):
        assert torch.equal(got, ref)
    next_token, next_sibling = _derive_tree_links(mask.numpy(), bs, n)
    assert torch.equal(ours[2], next_token.reshape(-1))
    assert torch.equal(ours[3], next_sibling.reshape(-1))
    # position = depth in the tree past the verified prefix
    depth = [[0 if p == -1 else None for p in t] for t in trees]
    for b, t in enumerate(trees):
        for i in range(n):
            depth[b][i] = 0 if t[i] == -1 else depth[b][t[i]] + 1
        assert ours[0].view(bs, n)[b].tolist() == [int(seq_lens[b]) + d for d in depth[b]]


def _greedy_reference(trees, candidates, target_predict, num_spec):
    """Greedy tree acceptance as eagle.cuh's VerifyTreeGreedy defines it, written from the tree:
    from the root, at each depth accept the lowest-numbered child whose draft token equals the
    target's argmax at the last accepted node; stop when none does."""
    bs, n = candidates.shape
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, num_spec), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    for b, parents in enumerate(trees):
        last, node, k = b * n, 0, 0
        accept_index[b, 0] = last
        while k + 1 < num_spec:
            want = int(target_predict.view(-1)[last])
            child = next((c for c in range(n) if parents[c] == node and int(candidates[b, c]) == want), None)
            if child is None:
                break
            predicts[last] = want
            k += 1
            node, last = child, b * n + child
            accept_index[b, k] = last
        accept_num[b] = k
        predicts[last] = target_predict.view(-1)[last]
    return predicts, accept_index, accept_num


@pytest.mark.parametrize("seed", range(6))
def test_verify_tree_greedy(seed, monkeypatch):
    from sglang.kernels.ops.speculative import spec_tree
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

    monkeypatch.setattr(spec_tree, "verify_tree_greedy_kernel_triton",
                        interpreted(spec_tree.verify_tree_greedy_kernel_triton))

    g = torch.Generator().manual_seed(seed)
    bs, n, vocab = 4, 8, 3   # a tiny vocabulary, so that drafts often match
    trees = [random_tree(n) for _ in range(bs)]
    mask = torch.stack([tree_mask_of(p) for p in trees])
    _, retrieve_index, next_token, next_sibling = _reconstruct(
        reconstruct_indices_from_tree_mask, mask, torch.zeros(bs, dtype=torch.int64), n)
    candidates = torch.randint(0, vocab, (bs, n), generator=g)
    target_predict = torch.randint(0, vocab, (bs, n), generator=g)
    num_spec = n

    def run(fn):
        predicts = torch.zeros(bs * n, dtype=torch.int32)
        accept_index = torch.full((bs, num_spec), -1, dtype=torch.int32)
        accept_num = torch.empty(bs, dtype=torch.int32)
        fn(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
           candidates=candidates, **args, target_predict=target_predict)
        return predicts, accept_index, accept_num

    args = dict(retrive_index=retrieve_index.view(bs, n), retrive_next_token=next_token.view(bs, n),
                retrive_next_sibling=next_sibling.view(bs, n))
    ours = run(sgl_kernel.verify_tree_greedy_cpu)
    args = dict(retrieve_index=retrieve_index.view(bs, n), retrieve_next_token=next_token.view(bs, n),
                retrieve_next_sibling=next_sibling.view(bs, n))
    triton_ref = run(verify_tree_greedy_triton)
    for got, ref in zip(ours, triton_ref):
        assert torch.equal(got, ref)
    for got, ref in zip(ours, _greedy_reference(trees, candidates, target_predict, num_spec)):
        assert torch.equal(got, ref)


# ---------------------------------------------------------------------------------------------
# EAGLE: draft tree -> verify metadata, and the multi-step draft decode's per-branch KV rows
# ---------------------------------------------------------------------------------------------

def _eagle_draft(bs, topk, steps, n, g):
    """SGLang's own draft-tree bookkeeping (spec_utils.select_top_k_tokens, as draft_forward runs
    it, then eagle_utils.organize_draft_results) on random draft probabilities: the
    (parent_list, top_scores_index) that build_tree_kernel_efficient receives."""
    from sglang.srt.speculative import spec_utils
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    later = getattr(spec_utils._select_top_k_tokens_later, "_torchdynamo_orig_callable",
                    spec_utils._select_top_k_tokens_later)  # skip torch.compile: same function
    topk_p = torch.rand(bs, topk, generator=g).sort(-1, descending=True).values
    topk_index = torch.randint(0, 50, (bs, topk), generator=g)
    scores, score_list, token_list, parents_list = None, [], [], []
    for i in range(steps):
        if i == 0:
            _, _, scores, info = spec_utils._select_top_k_tokens_first(topk_p, topk_index, None, topk)
        else:
            _, _, scores, info = later(i, topk_p, topk_index, None, scores, topk)
        score_list.append(info[0])
        token_list.append(info[1])
        parents_list.append(info[2])
        topk_p = torch.rand(bs * topk, topk, generator=g).sort(-1, descending=True).values
        topk_index = torch.randint(0, 50, (bs * topk, topk), generator=g)
    parent_list, top_scores_index, _ = organize_draft_results(score_list, token_list, parents_list, n)
    return parent_list, top_scores_index


def _build_tree(fn, parent_list, top_scores_index, seq_lens, topk, steps, n, mode):
    bs = seq_lens.numel()
    if mode == 2:
        width = 4 if n > 16 else (2 if n > 8 else 1)
        mask = torch.zeros(bs * n, dtype=[torch.uint8, torch.int16, torch.int32][width // 2])
    elif mode == 1:
        mask = torch.ones(bs * n * n, dtype=torch.bool)
    else:
        mask = torch.ones(int(seq_lens.sum()) * n + bs * n * n, dtype=torch.bool)
    positions = torch.full((bs * n,), -9, dtype=torch.int64)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.int64)
    fn(parent_list, top_scores_index, seq_lens, mask, positions, retrieve[0], retrieve[1], retrieve[2],
       topk, steps, n, mode)
    return mask, positions, retrieve[0], retrieve[1], retrieve[2]


@pytest.mark.parametrize("topk,steps,n", [(1, 4, 5), (1, 1, 2), (2, 3, 6), (4, 4, 8), (4, 2, 3), (3, 5, 13)])
def test_build_tree_kernel_efficient(topk, steps, n, monkeypatch):
    from sglang.kernels.ops.speculative import spec_tree
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode, sgl_build_tree_kernel_triton

    monkeypatch.setattr(spec_tree, "sgl_build_tree_kernel_efficient_triton",
                        interpreted(spec_tree.sgl_build_tree_kernel_efficient_triton))
    g = torch.Generator().manual_seed(100 * topk + 10 * steps + n)
    seq_lens = torch.tensor([7, 1, 30], dtype=torch.int64)
    bs = seq_lens.numel()
    parent_list, top_scores_index = _eagle_draft(bs, topk, steps, n, g)
    for mode in (TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY):
        ours = _build_tree(sgl_kernel.build_tree_kernel_efficient_cpu, parent_list, top_scores_index,
                           seq_lens, topk, steps, n, int(mode))
        ref = _build_tree(sgl_build_tree_kernel_triton, parent_list, top_scores_index, seq_lens,
                          topk, steps, n, mode)
        for got, want in zip(ours, ref):
            assert torch.equal(got, want)
    # the QLEN_ONLY mask is the ancestor-or-self closure that NGRAM's reconstruct spec reads: it
    # must give back the same positions and links (reconstruct_tree.py's docstring)
    mask, positions, ridx, nxt, sib = ours
    again = _reconstruct(reconstruct_indices_from_tree_mask, mask.view(bs, n, n), seq_lens, n)
    for got, want in zip(again, (positions, ridx, nxt, sib)):
        assert torch.equal(got, want.reshape(-1))
    assert bool(mask.view(bs, n, n)[:, :, 0].all())  # every node sees the root (bonus token)
    # QLEN_ONLY_BITPACKING (CUDA-only: build_tree_efficient_partial_packed): the same rows as bits
    packed = _build_tree(sgl_kernel.build_tree_kernel_efficient_cpu, parent_list, top_scores_index,
                         seq_lens, topk, steps, n, int(TreeMaskMode.QLEN_ONLY_BITPACKING))
    bits = packed[0].view(torch.uint8).view(bs * n, -1).long()
    rows = sum(bits[:, k] << (8 * k) for k in range(bits.shape[1]))
    expected = (mask.view(bs * n, n).long() << torch.arange(n)).sum(-1)
    assert torch.equal(rows, expected)
    for got, want in zip(packed[1:], ours[1:]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("topk,steps", [(1, 4), (4, 4), (2, 3), (3, 1)])
def test_build_draft_decode_metadata(topk, steps):
    """Row b*topk+k of the table, read up to seq_b + step + 1 at draft decode step `step`, must be
    request b's prefix then the slots its branch k was written to at steps 0..step: the KV indices
    the wheel's generate_draft_decode_kv_indices (Triton, interpreted) gives each (b, k) row, and
    the slots assign_draft_cache_locs_contiguous + per_step_draft_out_cache_loc hand to the
    draft forward."""
    from sglang.kernels.ops.speculative.cache_locs import (
        assign_draft_cache_locs_contiguous, generate_draft_decode_kv_indices)
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc
    from sglang.srt.utils import next_power_of_2

    req_to_token, rpi, _, _ = _pool()
    pool_len = req_to_token.shape[1]
    seq_lens = torch.tensor([3, 1, 17, 40], dtype=torch.int64)
    bs = seq_lens.numel()
    table = sgl_kernel.build_draft_decode_metadata_cpu(req_to_token, rpi, seq_lens, topk, steps, pool_len)
    assert table.shape == (bs * topk, pool_len) and table.dtype == req_to_token.dtype

    out_cache_loc = torch.empty(bs * topk * steps, dtype=torch.int64)
    interpreted(assign_draft_cache_locs_contiguous)[(bs,)](rpi, req_to_token, seq_lens, out_cache_loc,
                                                           pool_len, topk, steps, BS=4)
    per_step = per_step_draft_out_cache_loc(out_cache_loc, bs, topk, steps)   # [steps, bs*topk]

    kv_indices = torch.full((steps, int(seq_lens.sum()) * topk + bs * topk * steps), -7, dtype=torch.int64)
    kv_indptr = torch.zeros((steps, bs * topk + 1), dtype=torch.int64)
    interpreted(generate_draft_decode_kv_indices)[(steps, bs, topk)](
        rpi, req_to_token, seq_lens, kv_indices, kv_indptr, seq_lens.repeat_interleave(topk),
        pool_len, kv_indices.shape[1], kv_indptr.shape[1], next_power_of_2(bs),
        next_power_of_2(steps), next_power_of_2(bs * topk), 1)
    for step in range(steps):
        lens = seq_lens.repeat_interleave(topk) + step + 1
        for z in range(bs * topk):
            b = z // topk
            got = table[z, : int(lens[z])].long()
            ref = kv_indices[step, int(kv_indptr[step, z]):int(kv_indptr[step, z + 1])]
            assert torch.equal(got, ref)
            written = per_step[: step + 1, z]
            prefix = req_to_token[int(rpi[b]), : int(seq_lens[b])].long()
            assert torch.equal(got, torch.cat([prefix, written]))


# ---------------------------------------------------------------------------------------------
# attention over the paged KV cache
# ---------------------------------------------------------------------------------------------

H, HKV, D = 6, 2, 16


def _reference_attention(q, k, v, visible, scale):
    """q [H, D], k/v [L, HKV, D], visible [L] -> [H, D]: softmax(q k^T * scale) v per head (GQA)."""
    out = torch.empty(H, D)
    for h in range(H):
        kh, vh = k[:, h // (H // HKV)].float(), v[:, h // (H // HKV)].float()
        s = (kh @ q[h].float()) * scale
        s[~visible] = -math.inf
        out[h] = torch.softmax(s, 0) @ vh
    return out


def _kv_pool(seq_lens, dtype):
    size = 256
    k_buffer = torch.randn(size, HKV, D, generator=GEN).to(dtype)
    v_buffer = torch.randn(size, HKV, D, generator=GEN).to(dtype)
    req_to_token = torch.zeros(8, 128, dtype=torch.int32)
    perm = torch.randperm(size - 1, generator=GEN) + 1
    used = 0
    rpi = torch.tensor([6, 2, 3][: len(seq_lens)], dtype=torch.int64)
    for r, L in zip(rpi.tolist(), seq_lens):
        req_to_token[r, :L] = perm[used:used + L].to(torch.int32)
        used += L
    return k_buffer, v_buffer, req_to_token, rpi


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", [False, True])
def test_extend_attention(dtype, tree):
    ext = [5, 8, 3]
    seq = [12, 8, 30]   # prefixes 7, 0, 27
    k_buffer, v_buffer, req_to_token, rpi = _kv_pool(seq, dtype)
    trees = [random_tree(e) for e in ext]
    masks = [tree_mask_of(p) for p in trees]
    tree_mask = torch.cat([m.reshape(-1) for m in masks]) if tree else None
    n_tok = sum(ext)
    q = torch.randn(n_tok, H, D, generator=GEN).to(dtype)
    # the backend writes the extend K/V into the buffers before the call and also passes them
    start = torch.tensor([0, ext[0], ext[0] + ext[1]], dtype=torch.int32)
    k_ext = torch.cat([k_buffer[req_to_token[r, s - e:s].long()] for r, s, e in zip(rpi.tolist(), seq, ext)])
    v_ext = torch.cat([v_buffer[req_to_token[r, s - e:s].long()] for r, s, e in zip(rpi.tolist(), seq, ext)])
    o = torch.zeros_like(q)
    scale = D ** -0.5
    torch.ops.sgl_kernel.extend_attention_cpu(
        q, k_ext, v_ext, o, k_buffer, v_buffer, 1.0, 1.0, req_to_token, rpi,
        torch.tensor(seq, dtype=torch.int64), torch.tensor(ext, dtype=torch.int32), start, max(ext),
        scale, 0.0, False, 0, None, None, tree_mask, True)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for i, (r, L, e) in enumerate(zip(rpi.tolist(), seq, ext)):
        locs = req_to_token[r, :L].long()
        prefix = L - e
        for t in range(e):
            visible = torch.zeros(L, dtype=torch.bool)
            visible[:prefix] = True
            if tree:
                visible[prefix:] = masks[i][t]
            else:
                visible[prefix:prefix + t + 1] = True
            ref = _reference_attention(q[int(start[i]) + t], k_buffer[locs], v_buffer[locs], visible, scale)
            torch.testing.assert_close(o[int(start[i]) + t].float(), ref, **tol)


def test_extend_attention_logit_cap_and_sinks():
    seq, ext = [9], [4]
    k_buffer, v_buffer, req_to_token, rpi = _kv_pool(seq, torch.float32)
    q = torch.randn(4, H, D, generator=GEN)
    sinks = torch.randn(H, generator=GEN)
    o = torch.zeros_like(q)
    cap, scale = 0.5, 0.3
    torch.ops.sgl_kernel.extend_attention_cpu(
        q, None, None, o, k_buffer, v_buffer, 1.0, 1.0, req_to_token, rpi, torch.tensor(seq),
        torch.tensor(ext, dtype=torch.int32), torch.tensor([0], dtype=torch.int32), 4, scale, cap,
        False, 0, None, sinks, None, True)
    locs = req_to_token[int(rpi[0]), :9].long()
    for t in range(4):
        for h in range(H):
            kh, vh = k_buffer[locs, h // (H // HKV)], v_buffer[locs, h // (H // HKV)]
            s = cap * torch.tanh((kh @ q[t, h]) * scale / cap)
            s = s[: 5 + t + 1]
            p = torch.softmax(torch.cat([s, sinks[h:h + 1]]), 0)[:-1]
            torch.testing.assert_close(o[t, h], p @ vh[: 5 + t + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_writes_kv_then_attends(dtype):
    seq = [12, 1, 30]
    k_buffer, v_buffer, req_to_token, rpi = _kv_pool(seq, dtype)
    bs = len(seq)
    q = torch.randn(bs, H, D, generator=GEN).to(dtype)
    k_new = torch.randn(bs, HKV, D, generator=GEN).to(dtype)
    v_new = torch.randn(bs, HKV, D, generator=GEN).to(dtype)
    loc = torch.stack([req_to_token[r, L - 1].long() for r, L in zip(rpi.tolist(), seq)])
    o = torch.zeros(bs, H, D, dtype=dtype)
    attn_logits = torch.empty(bs, H, 8, D + 1)
    scale = D ** -0.5
    torch.ops.sgl_kernel.decode_attention_cpu(
        q, k_buffer, v_buffer, 1.0, 1.0, o, k_new, v_new, loc, attn_logits, req_to_token, rpi,
        torch.tensor(seq, dtype=torch.int64), scale, 0.0, False, 0, None, None)
    assert torch.equal(k_buffer[loc], k_new) and torch.equal(v_buffer[loc], v_new)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for b, (r, L) in enumerate(zip(rpi.tolist(), seq)):
        locs = req_to_token[r, :L].long()
        ref = _reference_attention(q[b], k_buffer[locs], v_buffer[locs], torch.ones(L, dtype=torch.bool), scale)
        torch.testing.assert_close(o[b].float(), ref, **tol)


# ---------------------------------------------------------------------------------------------
# what SGLang sees: the op set, and the platform plugin
# ---------------------------------------------------------------------------------------------

def test_op_surface():
    # no convert_weight_packed: SGLang's linear layers must stay on their torch fallback
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
    from sglang.srt.utils.common import cpu_has_amx_support

    assert not cpu_has_amx_support()
    for name in ("assign_extend_cache_locs_cpu", "assign_req_to_token_pool_cpu",
                 "assign_draft_cache_locs_contiguous_cpu", "fill_bonus_tokens_cpu",
                 "fill_accept_out_cache_loc_cpu", "verify_tree_greedy_cpu",
                 "copy_all_layer_kv_cache_cpu", "build_tree_kernel_efficient_cpu",
                 "build_draft_decode_metadata_cpu"):
        assert callable(getattr(sgl_kernel, name))
    assert hasattr(torch.ops.sgl_kernel, "extend_attention_cpu")
    assert hasattr(torch.ops.sgl_kernel, "decode_attention_cpu")


def test_plugin_keeps_intel_amx_backend():
    from importlib.metadata import entry_points

    from sglang.srt.arg_groups.overrides import _attention_backend_platform_fallbacks
    from sglang.srt.runtime_context import get_platform

    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "agentspec_cpu_standin"]
    platform = get_platform()
    overrides = object.__getattribute__(platform, "_overrides")
    saved = dict(overrides)
    view = types.SimpleNamespace(attention_backend="intel_amx", device="cpu")
    try:
        overrides.pop("has_amx", None)
        if not platform.has_amx:  # this machine has no AMX: SGLang would fall back to torch_native
            assert _attention_backend_platform_fallbacks(view) == {"attention_backend": "torch_native"}
        ep.load()()
        assert platform.has_amx
        assert _attention_backend_platform_fallbacks(view) == {}
    finally:
        overrides.clear()
        overrides.update(saved)
