"""The CUDA stand-in (tests/sglang/standin_cuda) op by op, on CPU tensors.

References: a line-by-line transliteration of the CUDA kernel it replaces (sampled verification:
``TreeSpeculativeSamplingTargetOnly`` in the wheel's ``sgl_kernel/speculative/sampling.cuh``) plus a
statistical test that the tokens it emits follow the target distribution; the CPU stand-in's ops
(checked against SGLang's specs in test_standin.py) for the tree ops, which the CUDA stand-in routes
to the wheel's Triton kernels (run here in Triton's interpreter); FlashInfer's renorm semantics and
SGLang's own torch RMSNorm for the rest.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from helpers.sglang import require_sglang

require_sglang()   # before anything that imports SGLang
import torch

import sgl_kernel as cpu_standin   # the CPU stand-in .venv-sglang has installed

STANDIN = Path(__file__).parent / "standin_cuda"
if str(STANDIN) not in sys.path:
    sys.path.append(str(STANDIN))   # after site-packages: `sgl_kernel` stays the CPU stand-in here

from agentspec_sglang_cuda_standin import ops  # noqa: E402
from test_standin import _build_tree, _eagle_draft, _reconstruct, interpreted, random_tree, tree_mask_of  # noqa: E402


def cuda_sgl_kernel():
    """The CUDA stand-in's ``sgl_kernel`` package, loaded under another name (this process's
    ``sgl_kernel`` is the CPU stand-in)."""
    name = "agentspec_cuda_sgl_kernel"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, STANDIN / "sgl_kernel" / "__init__.py",
                                                      submodule_search_locations=[str(STANDIN / "sgl_kernel")])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# ---------------------------------------------------------------------------------------------
# tree_speculative_sampling_target_only
# ---------------------------------------------------------------------------------------------

def links(parents: list[int], b: int) -> tuple[list[int], list[int], list[int]]:
    """retrive_index / next_token / next_sibling of one request's tree (parents before children)."""
    n = len(parents)
    children = [[k for k in range(n) if parents[k] == i] for i in range(n)]
    nxt = [c[0] if c else -1 for c in children]
    sib = [-1] * n
    for c in children:
        for x, y in zip(c, c[1:]):
            sib[x] = y
    return [b * n + i for i in range(n)], nxt, sib


def kernel_reference(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                     retrive_next_sibling, uniform_samples, uniform_final, target_probs, draft_probs,
                     threshold_single, threshold_acc):
    """TreeSpeculativeSamplingTargetOnly (sampling.cuh), one block per request, written over Python
    lists from the CUDA source: the same variables, branches and in-place writes."""
    bs, n = candidates.shape
    num_spec = accept_index.shape[1]
    d = target_probs.shape[-1]
    tp = target_probs.reshape(-1).tolist()
    dp = draft_probs.reshape(-1).tolist()
    pred = predicts.tolist()
    acc_idx = accept_index.reshape(-1).tolist()
    acc_num = accept_token_num.tolist()
    cand = candidates.reshape(-1).tolist()
    ridx = retrive_index.reshape(-1).tolist()
    rnt = retrive_next_token.reshape(-1).tolist()
    rns = retrive_next_sibling.reshape(-1).tolist()
    us = uniform_samples.reshape(-1).tolist()
    uf = uniform_final.reshape(-1).tolist()
    threshold_acc = max(threshold_acc, 1e-9)
    for bx in range(bs):
        prob_acc = 0.0
        cur_prob_offset = bx * n * d
        coin = us[bx * n]
        last_accepted_retrive_idx = ridx[bx * n]
        acc_idx[bx * num_spec] = last_accepted_retrive_idx
        num_accepted_tokens = 0
        cur_index = 0
        for _j in range(1, num_spec):
            cur_index = rnt[bx * n + cur_index]
            while cur_index != -1:
                draft_index = ridx[bx * n + cur_index]
                draft_token_id = cand[bx * n + cur_index]
                target_prob_single = tp[cur_prob_offset + draft_token_id]
                prob_acc += target_prob_single
                if target_prob_single > 0 and (coin < prob_acc / threshold_acc
                                               or target_prob_single >= threshold_single):
                    prob_acc = 0.0
                    cur_prob_offset = (bx * n + cur_index) * d
                    coin = us[bx * n + cur_index]
                    pred[last_accepted_retrive_idx] = draft_token_id
                    num_accepted_tokens += 1
                    acc_idx[bx * num_spec + num_accepted_tokens] = draft_index
                    last_accepted_retrive_idx = draft_index
                    break
                dp[cur_prob_offset + draft_token_id] = tp[cur_prob_offset + draft_token_id]
                cur_index = rns[bx * n + cur_index]
            if cur_index == -1:
                break
        acc_num[bx] = num_accepted_tokens
        coin = uf[bx]
        q = tp[cur_prob_offset:cur_prob_offset + d]
        p = dp[cur_prob_offset:cur_prob_offset + d] if num_accepted_tokens != num_spec - 1 else [0.0] * d
        relu = [max(a - b, 0.0) for a, b in zip(q, p)]
        u = coin * sum(relu)
        sampled_id, last_valid_id, aggregate = d, -1, 0.0   # DeviceSamplingFromProb, x > 0 valid
        for i, x in enumerate(relu):
            if x > 0:
                aggregate += x
                last_valid_id = i
                if aggregate > u and sampled_id == d:
                    sampled_id = i
        if sampled_id == d:
            sampled_id = d - 1 if last_valid_id == -1 else last_valid_id
        pred[last_accepted_retrive_idx] = sampled_id
    return (torch.tensor(pred, dtype=predicts.dtype), torch.tensor(acc_idx, dtype=accept_index.dtype).view(bs, num_spec),
            torch.tensor(acc_num, dtype=accept_token_num.dtype), torch.tensor(dp).view_as(draft_probs))


def sampling_case(trees, vocab, g, *, peaked=False):
    """A batch of draft trees with random tokens (from a small vocabulary, so that drafts hit) and
    random target distributions (some tokens with zero mass)."""
    bs, n = len(trees), len(trees[0])
    ridx, nxt, sib = (torch.tensor(x, dtype=torch.int64) for x in zip(*(links(p, b) for b, p in enumerate(trees))))
    candidates = torch.randint(0, vocab, (bs, n), generator=g)
    logits = torch.randn(bs, n, vocab, generator=g) * (4.0 if peaked else 1.5)
    logits[torch.rand(bs, n, vocab, generator=g) < 0.2] = float("-inf")
    logits[..., 0] = logits[..., 0].clamp(min=-5)   # every row keeps some mass
    target_probs = torch.softmax(logits, -1)
    coins = torch.rand(bs, n, generator=g)
    final = torch.rand(bs, generator=g)
    return dict(candidates=candidates, retrive_index=ridx, retrive_next_token=nxt, retrive_next_sibling=sib,
                uniform_samples=coins, uniform_samples_for_final_sampling=final, target_probs=target_probs)


def run_sampling(fn, case, num_spec, threshold_single=1.0, threshold_acc=1.0):
    bs, n = case["candidates"].shape
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, num_spec), -1, dtype=torch.int32)
    accept_num = torch.full((bs,), -5, dtype=torch.int32)
    draft_probs = torch.zeros_like(case["target_probs"])
    fn(predicts, accept_index, accept_num, case["candidates"], case["retrive_index"], case["retrive_next_token"],
       case["retrive_next_sibling"], case["uniform_samples"], case["uniform_samples_for_final_sampling"],
       case["target_probs"], draft_probs, threshold_single, threshold_acc)
    return predicts, accept_index, accept_num, draft_probs


def reference_outputs(case, num_spec, threshold_single=1.0, threshold_acc=1.0):
    bs, n = case["candidates"].shape
    return kernel_reference(torch.zeros(bs * n, dtype=torch.int32), torch.full((bs, num_spec), -1, dtype=torch.int32),
                            torch.full((bs,), -5, dtype=torch.int32), case["candidates"], case["retrive_index"],
                            case["retrive_next_token"], case["retrive_next_sibling"], case["uniform_samples"],
                            case["uniform_samples_for_final_sampling"], case["target_probs"],
                            torch.zeros_like(case["target_probs"]), threshold_single, threshold_acc)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("thresholds", [(1.0, 1.0), (0.4, 0.6)])
def test_tree_speculative_sampling_matches_the_kernel(seed, thresholds):
    g = torch.Generator().manual_seed(seed)
    bs, n, vocab = 16, 8, 3
    trees = [random_tree(n) for _ in range(bs)]
    trees[0] = [-1] + list(range(n - 1))   # a chain
    trees[1] = [-1] + [0] * (n - 1)        # a star
    case = sampling_case(trees, vocab, g, peaked=seed % 2 == 1)
    for num_spec in (n, 3, 1):             # the tree's depth, a shorter walk, the root only
        ours = run_sampling(ops.tree_speculative_sampling_target_only, case, num_spec, *thresholds)
        ref = reference_outputs(case, num_spec, *thresholds)
        for name, got, want in zip(("predicts", "accept_index", "accept_token_num", "draft_probs"), ours, ref):
            assert torch.equal(got, want.to(got.dtype)), (name, num_spec, got, want)
    assert int(ours[2].max()) >= 0
    full = run_sampling(ops.tree_speculative_sampling_target_only, case, n, *thresholds)
    assert int(full[2].max()) >= 2, "no walk went past depth 1: the case does not exercise the tree"


def test_tree_speculative_sampling_through_sglang():
    """SGLang's own entry point (kernels/ops/speculative/sampling.py) with the plugin's patch of
    ``_jit_sampling_module`` runs the torch version, keyword arguments and all."""
    from agentspec_sglang_cuda_standin import _patch_sampling
    from sglang.kernels.ops.speculative import sampling

    g = torch.Generator().manual_seed(7)
    n = 6
    case = sampling_case([random_tree(n) for _ in range(4)], 4, g)
    saved = sampling._jit_sampling_module
    try:
        _patch_sampling(sampling)

        def through_sglang(predicts, accept_index, accept_num, candidates, ridx, nxt, sib, coins, final, tp, dp, ts, ta):
            sampling.tree_speculative_sampling_target_only(
                predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=candidates,
                retrive_index=ridx, retrive_next_token=nxt, retrive_next_sibling=sib, uniform_samples=coins,
                uniform_samples_for_final_sampling=final, target_probs=tp, draft_probs=dp, threshold_single=ts,
                threshold_acc=ta, deterministic=True)

        got = run_sampling(through_sglang, case, n)
    finally:
        sampling._jit_sampling_module = saved
    for a, b in zip(got, reference_outputs(case, n)):
        assert torch.equal(a, b.to(a.dtype))


def chi_square_p(counts: dict[int, int], probs: list[float]) -> float:
    from scipy.stats import chisquare

    support = [t for t, p in enumerate(probs) if p > 0]
    total = sum(counts.values())
    assert all(t in support for t in counts), f"a token of zero target mass was emitted: {counts}"
    observed = [counts.get(t, 0) for t in support]
    expected = [probs[t] * total for t in support]
    return float(chisquare(observed, [e * total / sum(expected) for e in expected]).pvalue)


def test_tree_speculative_sampling_follows_the_target_distribution():
    """Many independent coins over one tree: the first emitted token must follow the root's target
    distribution, and the token after an accepted draft must follow that draft's row. Root children
    A, B, C (C has zero target mass), A's children D, E, B's child A."""
    A, B, C, D, E = 0, 1, 5, 2, 3
    parents = [-1, 0, 0, 0, 1, 1, 2]
    tokens = [4, A, B, C, D, E, A]
    rows = [[0.30, 0.25, 0.20, 0.10, 0.15, 0.00],   # after the root
            [0.05, 0.10, 0.40, 0.30, 0.15, 0.00],   # after A (node 1)
            [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],   # after B (node 2)
            [1 / 6] * 6, [1 / 6] * 6, [1 / 6] * 6, [1 / 6] * 6]
    trials, n = 20000, len(parents)
    g = torch.Generator().manual_seed(2024)
    ridx, nxt, sib = (torch.tensor(x, dtype=torch.int64) for x in zip(*(links(parents, b) for b in range(trials))))
    case = dict(candidates=torch.tensor([tokens] * trials), retrive_index=ridx, retrive_next_token=nxt,
                retrive_next_sibling=sib, uniform_samples=torch.rand(trials, n, generator=g),
                uniform_samples_for_final_sampling=torch.rand(trials, generator=g),
                target_probs=torch.tensor(rows).expand(trials, n, 6).contiguous())
    predicts, accept_index, accept_num, _ = run_sampling(ops.tree_speculative_sampling_target_only, case, 4)
    first = predicts.view(trials, n)[:, 0].tolist()          # the token emitted at the root
    counts: dict[int, int] = {}
    for t in first:
        counts[t] = counts.get(t, 0) + 1
    assert chi_square_p(counts, rows[0]) > 1e-3, counts
    # after A (accepted at node 1), and after B (node 2): the next token follows that node's row
    for node, token in ((1, A), (2, B)):
        mask = accept_index[:, 1] == node + torch.arange(trials, dtype=torch.int32) * n
        assert all(first[i] == token for i in torch.nonzero(mask).view(-1).tolist()[:50])
        second = predicts.view(trials, n)[mask][:, node].tolist()
        sc: dict[int, int] = {}
        for t in second:
            sc[t] = sc.get(t, 0) + 1
        assert len(second) > 2000
        assert chi_square_p(sc, rows[node]) > 1e-3, (node, sc)
    assert int(accept_num.max()) == 2   # the tree's depth


# ---------------------------------------------------------------------------------------------
# the tree ops, routed to the wheel's Triton kernels
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def triton_tree(monkeypatch):
    """sglang.kernels.ops.speculative.tree with the plugin's _jit_tree_module (Triton kernels run
    by the interpreter)."""
    from agentspec_sglang_cuda_standin import _patch_tree
    from sglang.kernels.ops.speculative import reconstruct_tree, spec_tree, tree

    for mod, name in ((spec_tree, "sgl_build_tree_kernel_efficient_triton"),
                      (spec_tree, "verify_tree_greedy_kernel_triton"),
                      (reconstruct_tree, "_reconstruct_tree_mask_kernel")):
        monkeypatch.setattr(mod, name, interpreted(getattr(mod, name)))
    monkeypatch.setattr(tree, "_jit_tree_module", tree._jit_tree_module)
    _patch_tree(tree)
    return tree


@pytest.mark.parametrize("topk,steps,n", [(1, 4, 5), (2, 3, 6), (4, 4, 8)])
def test_build_tree_routes_to_triton(triton_tree, topk, steps, n):
    g = torch.Generator().manual_seed(10 * topk + n)
    seq_lens = torch.tensor([7, 1, 30], dtype=torch.int64)
    parent_list, top_scores_index = _eagle_draft(seq_lens.numel(), topk, steps, n, g)
    ours = _build_tree(triton_tree.build_tree_kernel_efficient, parent_list, top_scores_index, seq_lens, topk, steps, n, 0)
    ref = _build_tree(cpu_standin.build_tree_kernel_efficient_cpu, parent_list, top_scores_index, seq_lens, topk,
                      steps, n, 0)
    for got, want in zip(ours, ref):
        assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(3))
def test_verify_tree_greedy_and_reconstruct_route_to_triton(triton_tree, seed):
    g = torch.Generator().manual_seed(seed)
    bs, n = 4, 8
    mask = torch.stack([tree_mask_of(random_tree(n)) for _ in range(bs)])
    seq_lens = torch.tensor([3, 0, 9, 4], dtype=torch.int64)
    ours = _reconstruct(triton_tree.reconstruct_indices_from_tree_mask, mask, seq_lens, n)
    ref = _reconstruct(cpu_standin.speculative.reconstruct_indices_from_tree_mask, mask, seq_lens, n)
    for got, want in zip(ours, ref):
        assert torch.equal(got, want)
    _, ridx, nxt, sib = ref
    candidates = torch.randint(0, 3, (bs, n), generator=g)
    target = torch.randint(0, 3, (bs, n), generator=g)

    def run(fn):
        out = (torch.zeros(bs * n, dtype=torch.int32), torch.full((bs, n), -1, dtype=torch.int32),
               torch.empty(bs, dtype=torch.int32))
        fn(out[0], out[1], out[2], candidates, ridx.view(bs, n), nxt.view(bs, n), sib.view(bs, n), target)
        return out

    for got, want in zip(run(triton_tree.verify_tree_greedy), run(cpu_standin.verify_tree_greedy_cpu)):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# renorm (the wheel's Triton kernels) and RMSNorm (torch)
# ---------------------------------------------------------------------------------------------

def renorm_reference(probs: torch.Tensor, top_k=None, top_p=None) -> torch.Tensor:
    """FlashInfer's top_k_renorm_probs / top_p_renorm_probs, row by row: keep the top_k largest
    probabilities, or the fewest largest whose mass reaches top_p; ties with the smallest kept
    value are kept too; renormalise."""
    out = torch.zeros_like(probs, dtype=torch.float64)
    for r, row in enumerate(probs.double().tolist()):
        order = sorted(row, reverse=True)
        if top_k is not None:
            pivot = order[min(int(top_k[r]), len(order)) - 1]
        else:
            mass, pivot = 0.0, order[-1]
            for v in order:
                mass += v
                if mass >= float(top_p[r]) - 1e-12:
                    pivot = v
                    break
        kept = [v if v >= pivot else 0.0 for v in row]
        out[r] = torch.tensor(kept) / sum(kept)
    return out


def test_renorm_routes_to_the_wheels_triton(monkeypatch):
    from sglang.kernels.ops.sampling import renorm_triton

    for name in ("_mask_and_partial_sum_kernel", "_normalize_kernel"):
        monkeypatch.setattr(renorm_triton, name, interpreted(getattr(renorm_triton, name)))
    # the kernels check for a CUDA tensor up front; the math is what is tested here
    monkeypatch.setattr(renorm_triton, "_prepare_probs", lambda probs: probs.float().contiguous())
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(5, 300, generator=g) * 2, -1)
    probs[1, :4] = probs[1, 10]   # ties at a pivot
    probs = probs / probs.sum(-1, keepdim=True)
    top_k = torch.tensor([1, 11, 50, 300, 1 << 30])
    top_p = torch.tensor([0.05, 0.5, 0.9, 0.999, 1.0])
    k_got = ops.top_k_renorm_prob(probs, top_k)
    p_got = ops.top_p_renorm_prob(probs, top_p)
    assert torch.allclose(k_got.double(), renorm_reference(probs, top_k=top_k), atol=1e-6)
    assert torch.allclose(p_got.double(), renorm_reference(probs, top_p=top_p), atol=1e-6)
    # the CUDA stand-in's sgl_kernel names are these functions
    sk = cuda_sgl_kernel()
    assert sk.top_k_renorm_prob is ops.top_k_renorm_prob and sk.top_p_renorm_prob is ops.top_p_renorm_prob


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_and_fused_add(dtype):
    from sglang.srt.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 64, generator=g) * 3).to(dtype)
    res = torch.randn(7, 64, generator=g).to(dtype)
    w = (torch.rand(64, generator=g) + 0.5).to(dtype)
    eps = 1e-5
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)

    def ref(v):
        v = v.double()
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    out = ops.rmsnorm(x, w, eps)
    assert out.dtype == dtype and torch.allclose(out.double(), ref(x), **tol)
    buf = torch.empty_like(x)
    assert ops.rmsnorm(x, w, eps, out=buf) is buf and torch.equal(buf, out)
    xi, ri = x.clone(), res.clone()
    ops.fused_add_rmsnorm(xi, ri, w, eps)
    assert torch.equal(ri, (x.float() + res.float()).to(dtype))
    assert torch.allclose(xi.double(), ref(x.float() + res.float()), **tol)
    # SGLang's own torch path (what SGLANG_FORCE_FUSED_OP_BACKEND=torch runs) agrees
    norm = RMSNorm(64, eps=eps).to(dtype)
    norm.weight.data.copy_(w)
    assert torch.allclose(norm.forward_native(x.clone()).double(), out.double(), **tol)
    nx, nr = norm.forward_native(x.clone(), res.clone())
    assert torch.allclose(nx.double(), xi.double(), **tol) and torch.allclose(nr.double(), ri.double(), **tol)


# ---------------------------------------------------------------------------------------------
# the names that are only imported
# ---------------------------------------------------------------------------------------------

def test_import_only_names_raise_naming_themselves():
    sk = cuda_sgl_kernel()
    assert sk.AGENTSPEC_CUDA_STANDIN and not getattr(sk, "AGENTSPEC_STANDIN", False)
    for dotted in sk.IMPORT_ONLY:
        obj = sk
        for part in dotted.split("."):
            obj = getattr(obj, part)
        with pytest.raises(sk.NotProvidedError, match=rf"^sgl_kernel\.{dotted} is not provided"):
            obj(torch.zeros(1))
    for dotted in sk.CALLED:
        obj = sk
        for part in dotted.split("."):
            obj = getattr(obj, part)
        assert callable(obj) and not getattr(obj, "agentspec_not_provided", False), dotted
    assert sk.utils.is_arch_support_pdl() is False
    # no name beyond those two lists: an unknown one is an AttributeError (an ImportError at
    # `from sgl_kernel import x`), so SGLang's own try/except fallbacks keep working
    with pytest.raises(AttributeError):
        sk.fp8_scaled_mm  # noqa: B018
    with pytest.raises(ImportError):
        exec("from agentspec_cuda_sgl_kernel import scalar_type", {})
