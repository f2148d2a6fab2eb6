"""The ops the CUDA stand-in implements: pure torch, or routed to the SGLang wheel's own Triton kernels.

Each one keeps the signature, dtypes and in-place outputs of the op it replaces (the calls are in
SGLang 0.5.23; README.md beside this package names each call site):

* ``rmsnorm`` / ``fused_add_rmsnorm``: FlashInfer's RMSNorm kernels as ``sgl_kernel`` exports them
  (float32 math, output in the input dtype; the fused one adds in float32, stores the sum into
  ``residual`` and normalises the unrounded sum into ``input``);
* ``tree_speculative_sampling_target_only``: ``TreeSpeculativeSamplingTargetOnly`` in the wheel's
  ``kernels/jit/include/sgl_kernel/speculative/sampling.cuh`` (a compiled kernel that needs
  FlashInfer's headers); reached through ``TORCH_SAMPLING_MODULE.sample``;
* the tree ops of ``sglang.kernels.ops.speculative.tree`` (``build_tree_kernel_efficient``,
  ``verify_tree_greedy``, ``reconstruct_indices_from_tree_mask``, compiled from ``tree.cuh`` at
  first use): ``TRITON_TREE_MODULE`` calls the wheel's Triton versions of the same ops
  (``spec_tree.py``, ``reconstruct_tree.py``);
* ``top_k_renorm_prob`` / ``top_p_renorm_prob``: the wheel's Triton versions
  (``sampling/renorm_triton.py``, FlashInfer's pivot semantics).
"""

from __future__ import annotations

import numpy as np
import torch


# ---------------------------------------------------------------------------------------------
# RMSNorm (sgl_kernel.rmsnorm / fused_add_rmsnorm)
# ---------------------------------------------------------------------------------------------

def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
            enable_pdl: bool | None = None) -> torch.Tensor:
    """out = input / sqrt(mean(input^2, -1) + eps) * weight (float32 math); input [tokens, hidden]."""
    x = input.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if out is None:
        return y.to(input.dtype)
    out.copy_(y)
    return out


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: bool | None = None) -> None:
    """In place: residual = input + residual; input = rmsnorm(that sum) (the float32 sum, before
    it is rounded into residual's dtype)."""
    x = input.float() + residual.float()
    residual.copy_(x)
    input.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float())


# ---------------------------------------------------------------------------------------------
# top-k / top-p renormalisation (sgl_kernel.top_k_renorm_prob / top_p_renorm_prob, and the
# flashinfer.sampling names sglang.kernels.ops.sampling.renorm resolves lazily on CUDA)
# ---------------------------------------------------------------------------------------------

def top_k_renorm_prob(probs: torch.Tensor, top_k) -> torch.Tensor:
    """probs [rows, vocab] -> each row's top_k probabilities (ties at the pivot kept), renormalised."""
    from sglang.kernels.ops.sampling.renorm_triton import top_k_renorm_probs_triton

    return top_k_renorm_probs_triton(probs, top_k)


def top_p_renorm_prob(probs: torch.Tensor, top_p) -> torch.Tensor:
    """probs [rows, vocab] -> each row's top-p nucleus (FlashInfer's threshold), renormalised."""
    from sglang.kernels.ops.sampling.renorm_triton import top_p_renorm_probs_triton

    return top_p_renorm_probs_triton(probs, top_p)


# ---------------------------------------------------------------------------------------------
# sampled tree verification (speculative_sampling::TreeSpeculativeSamplingTargetOnly)
# ---------------------------------------------------------------------------------------------

def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,             # int32 [bs * n], mutable
    accept_index: torch.Tensor,         # int32 [bs, num_spec], mutable
    accept_token_num: torch.Tensor,     # int32 [bs], mutable
    candidates: torch.Tensor,           # int64 [bs, n]: node i's draft token (node 0: the last committed token)
    retrive_index: torch.Tensor,        # int64 [bs, n]: node i's flat row (b * n + i)
    retrive_next_token: torch.Tensor,   # int64 [bs, n]: node i's first child, -1 for none
    retrive_next_sibling: torch.Tensor,  # int64 [bs, n]: node i's next sibling, -1 for none
    uniform_samples: torch.Tensor,      # float32 [bs, n]: the acceptance coin drawn at each node
    uniform_samples_for_final_sampling: torch.Tensor,  # float32 [bs]
    target_probs: torch.Tensor,         # float32 [bs, n, vocab]: the target's distribution after node i
    draft_probs: torch.Tensor,          # float32 [bs, n, vocab], mutable (zeros from the caller)
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> None:
    """Verify each request's draft tree against the target's distributions (no draft model
    probabilities), as the CUDA kernel does, one request at a time:

    From the root, with coin = uniform_samples[b, 0] and acc = 0, the children of the last
    accepted node are tried in sibling order; child c adds q(c) = target_probs[b, last, token(c)]
    to acc and is accepted when q(c) > 0 and (coin < acc / threshold_acc or q(c) >=
    threshold_single). On acceptance predicts[row(last)] = token(c), the walk descends to c, acc
    is reset and the coin becomes uniform_samples[b, c]; a rejected child's q(c) is copied into
    draft_probs[b, last, token(c)]. The walk ends when no child is accepted or num_spec - 1
    tokens were accepted. Then one token is drawn at the last accepted node from
    relu(target_probs - draft_probs) (draft_probs ignored when the walk ran to num_spec - 1, the
    bonus position): the first vocabulary index whose inclusive prefix sum exceeds
    uniform_samples_for_final_sampling[b] * total, falling back to the last positive entry (then
    vocab - 1). With threshold 1, 1 this accepts each sibling with exactly the target mass not
    yet spent on its earlier siblings: the emitted tokens follow the target distribution.

    The tree walk is sequential and data dependent: it runs on the host over the n x n target
    probabilities of the candidate tokens (one transfer); the residual draw runs on the device."""
    bs, n = candidates.shape
    num_spec = accept_index.shape[1]
    vocab = target_probs.shape[-1]
    if bs == 0:
        return
    dev = target_probs.device
    # q_rows[b, r, i] = target_probs[b, r, candidates[b, i]]: every node's token under every row
    q_rows = torch.gather(target_probs, 2, candidates.to(torch.int64).unsqueeze(1).expand(bs, n, n))
    q_host = q_rows.cpu().numpy().astype(np.float32)
    cand = candidates.cpu().tolist()
    ridx = retrive_index.reshape(bs, n).cpu().tolist()
    nxt = retrive_next_token.reshape(bs, n).cpu().tolist()
    sib = retrive_next_sibling.reshape(bs, n).cpu().tolist()
    coins = uniform_samples.reshape(bs, n).cpu().numpy().astype(np.float32)
    t_single = np.float32(threshold_single)
    t_acc = np.float32(max(np.float32(threshold_acc), np.float32(1e-9)))

    acc_rows = [[-1] * num_spec for _ in range(bs)]
    n_acc = [0] * bs
    pred_pos: list[int] = []     # predicts[pos] = tok for accepted drafts
    pred_tok: list[int] = []
    rejected: list[tuple[int, int, int]] = []   # (b, row, token): draft_probs[b, row, token] = q
    last_rows = [0] * bs         # local node of the last accepted token (its probability row)
    last_flat = [0] * bs         # its retrive_index (the row of predicts to fill)
    for b in range(bs):
        row = 0
        last = ridx[b][0]
        acc_rows[b][0] = last
        coin = coins[b, 0]
        prob_acc = np.float32(0.0)
        k = 0
        cur = 0
        for _ in range(1, num_spec):
            cur = nxt[b][cur]
            while cur != -1:
                q = q_host[b, row, cur]
                prob_acc = np.float32(prob_acc + q)
                if q > 0 and (coin < np.float32(prob_acc / t_acc) or q >= t_single):
                    prob_acc = np.float32(0.0)
                    pred_pos.append(last)
                    pred_tok.append(cand[b][cur])
                    k += 1
                    last = ridx[b][cur]
                    acc_rows[b][k] = last
                    row = cur
                    coin = coins[b, cur]
                    break
                rejected.append((b, row, cand[b][cur]))
                cur = sib[b][cur]
            if cur == -1:
                break
        n_acc[b] = k
        last_rows[b] = row
        last_flat[b] = last

    if rejected:
        rb, rr, rt = (torch.tensor(x, dtype=torch.int64, device=dev) for x in zip(*rejected))
        draft_probs[rb, rr, rt] = target_probs[rb, rr, rt]
    if pred_pos:
        predicts.view(-1)[torch.tensor(pred_pos, dtype=torch.int64, device=dev)] = torch.tensor(
            pred_tok, dtype=predicts.dtype, device=dev)
    # accept_index[b, :k+1] only (the kernel leaves the rest as the caller filled it)
    ab = [b for b in range(bs) for _ in range(n_acc[b] + 1)]
    aj = [j for b in range(bs) for j in range(n_acc[b] + 1)]
    av = [acc_rows[b][j] for b, j in zip(ab, aj)]
    accept_index[torch.tensor(ab, device=dev), torch.tensor(aj, device=dev)] = torch.tensor(
        av, dtype=accept_index.dtype, device=dev)
    accept_token_num.copy_(torch.tensor(n_acc, dtype=accept_token_num.dtype))

    # the residual draw at each request's last accepted node: relu(q - p), p = 0 at the bonus position
    b_idx = torch.arange(bs, device=dev)
    rows = torch.tensor(last_rows, dtype=torch.int64, device=dev)
    q = target_probs[b_idx, rows]                                            # [bs, vocab]
    bonus = torch.tensor([k == num_spec - 1 for k in n_acc], device=dev)
    p = torch.where(bonus.unsqueeze(1), torch.zeros_like(q), draft_probs[b_idx, rows])
    relu = torch.clamp(q - p, min=0)
    cdf = torch.cumsum(relu.double(), dim=-1)                                # [bs, vocab]
    u = uniform_samples_for_final_sampling.reshape(bs).double() * cdf[:, -1]
    above = cdf > u.unsqueeze(1)
    idx = torch.arange(vocab, device=dev)
    first_above = torch.where(above, idx, vocab).amin(-1)
    last_valid = torch.where(relu > 0, idx, -1).amax(-1)
    fallback = torch.where(last_valid >= 0, last_valid, torch.full_like(last_valid, vocab - 1))
    sampled = torch.where(first_above < vocab, first_above, fallback)
    predicts.view(-1)[torch.tensor(last_flat, dtype=torch.int64, device=dev)] = sampled.to(predicts.dtype)


class _TorchSamplingModule:
    """What ``sglang.kernels.ops.speculative.sampling._jit_sampling_module(vec_size,
    deterministic)`` returns: an object whose ``sample`` is the compiled kernel's entry point."""

    @staticmethod
    def sample(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
               retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
               draft_probs, threshold_single, threshold_acc):
        tree_speculative_sampling_target_only(
            predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
            retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
            draft_probs, threshold_single, threshold_acc)


TORCH_SAMPLING_MODULE = _TorchSamplingModule()


# ---------------------------------------------------------------------------------------------
# draft-tree ops (sglang.kernels.ops.speculative.tree._jit_tree_module) -> the wheel's Triton
# ---------------------------------------------------------------------------------------------

class _TritonTreeModule:
    """What ``sglang.kernels.ops.speculative.tree._jit_tree_module()`` returns: the three entry
    points of ``tree.cuh``, each served by the wheel's Triton kernel of the same contract."""

    @staticmethod
    def build_tree_kernel_efficient(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrive_index, retrive_next_token, retrive_next_sibling, topk, depth,
                                    draft_token_num, tree_mask_mode):
        from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode, sgl_build_tree_kernel_triton

        # (QLEN_ONLY_BITPACKING raises NotImplementedError there: the Triton attention backend
        # reads the FULL_MASK layout, eagle_utils.default_tree_mask_mode on CUDA)
        sgl_build_tree_kernel_triton(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                     retrive_index, retrive_next_token, retrive_next_sibling, topk, depth,
                                     draft_token_num, TreeMaskMode(int(tree_mask_mode)))

    @staticmethod
    def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
        from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

        verify_tree_greedy_triton(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                  retrive_next_token, retrive_next_sibling, target_predict)

    @staticmethod
    def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrive_index,
                                           retrive_next_token, retrive_next_sibling, batch_size,
                                           draft_token_num):
        from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_triton

        reconstruct_indices_from_tree_mask_triton(tree_mask, verified_seq_len, positions, retrive_index,
                                                  retrive_next_token, retrive_next_sibling, batch_size,
                                                  draft_token_num)


TRITON_TREE_MODULE = _TritonTreeModule()


def is_arch_support_pdl() -> bool:
    """sgl_kernel.utils.is_arch_support_pdl: False, so that the Triton attention backend launches
    its kernels without programmatic dependent launch (a Hopper+ launch attribute the stand-in's
    kernels do not use)."""
    return False
