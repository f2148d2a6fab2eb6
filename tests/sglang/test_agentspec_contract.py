"""The AGENTSPEC worker's draft contract against SGLang's own NGRAM corpus, and its CPU sampling.

No engine here: the contract is checked on the arrays both produce for identical inputs
(``NgramCorpus.batch_get`` is what ``NGRAMWorker._prepare_draft_tokens`` returns), and the
verify-row sampler is checked statistically against the distribution it must follow.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from helpers.sglang import require_sglang

require_sglang()   # before anything that imports SGLang
import torch

from agentspec.integrations.sglang.worker import ancestor_mask, draft_rows, sample_rows_as_argmax
from suffix_index import SuffixIndex

D = 8


def parents_from_mask(m: np.ndarray) -> list[int]:
    """Each row's parent: the largest ancestor before it (SGLang's reconstruct_indices rule)."""
    out = []
    for i in range(m.shape[0]):
        anc = [j for j in range(i) if m[i, j]]
        out.append(anc[-1] if anc else -1)
    return out


def check_tree(tokens: np.ndarray, mask: np.ndarray, roots: list[int], bs: int) -> None:
    assert tokens.shape == (bs * D,)
    assert mask.shape == (bs * D * D,)
    m = mask.reshape(bs, D, D).astype(bool)
    t = tokens.reshape(bs, D)
    for b in range(bs):
        assert t[b, 0] == roots[b], "row 0 is the last committed token"
        assert m[b, 0].tolist() == [True] + [False] * (D - 1)
        assert not np.triu(m[b], 1).any(), "parents precede children"
        par = parents_from_mask(m[b])
        for i in range(1, D):
            assert par[i] >= 0, "every node hangs under the root"
            want = m[b, par[i]].copy()
            want[i] = True
            assert (m[b, i] == want).all(), "mask row = parent's row + itself (ancestor-or-self)"


def ngram_corpus():
    try:
        from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

        return NgramCorpus(max_trie_depth=18, draft_token_num=D)
    except Exception as e:  # noqa: BLE001 - the JIT build needs g++ and tvm-ffi
        pytest.skip(f"SGLang's NgramCorpus could not be built here: {e!r}")


def ours(contexts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    idx = SuffixIndex(vocab_size=50000)
    toks, masks = [], []
    for i, ctx in enumerate(contexts):
        idx.start(f"r{i}", ctx[:-1])
        idx.extend(f"r{i}", ctx[-1:])
        d = idx.propose(f"r{i}", D - 1)
        rows, par = draft_rows(d.token_ids, d.parents, ctx[-1], D)
        toks.append(rows)
        masks.append(ancestor_mask(par))
    return np.asarray(toks, dtype=np.int64).reshape(-1), np.stack(masks).reshape(-1)


CONTEXTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7],               # a repeat: both continue 8, 9, 10, ...
    [100, 200, 300, 100, 200, 301, 100, 200],            # two continuations after "100 200"
    [42, 43, 44, 45],                                    # nothing to match: root + padding
]


def test_rows_and_mask_match_sglangs_ngram_corpus_contract():
    corpus = ngram_corpus()
    corpus.batch_put([list(c) for c in CONTEXTS])
    corpus.synchronize()
    tails = [c[-18:] for c in CONTEXTS]
    ng_tokens, ng_mask = corpus.batch_get([f"q{i}" for i in range(len(CONTEXTS))], tails, [len(c) for c in CONTEXTS])
    ng_tokens = np.asarray(ng_tokens)
    ng_mask = np.asarray(ng_mask)
    my_tokens, my_mask = ours(CONTEXTS)
    roots = [c[-1] for c in CONTEXTS]
    check_tree(ng_tokens, ng_mask, roots, len(CONTEXTS))   # the contract, read off SGLang's own output
    check_tree(my_tokens, my_mask, roots, len(CONTEXTS))   # ours fills the same contract
    assert my_tokens.dtype == np.int64 and ng_tokens.dtype.kind == "i"
    # both find the repeat: the first chain continues the earlier occurrence
    assert ng_tokens[1:4].tolist() == my_tokens[1:4].tolist() == [8, 9, 10]
    # both branch after "100 200": 300 and 301 are children of the root
    for toks, mask in ((ng_tokens, ng_mask), (my_tokens, my_mask)):
        t = toks.reshape(3, D)[1]
        par = parents_from_mask(mask.reshape(3, D, D)[1].astype(bool))
        kids = {int(t[i]) for i in range(1, D) if par[i] == 0}
        assert {300, 301} <= kids
    # nothing to match: our row is the root and padding (token 0 under the root), NGRAM's convention
    assert my_tokens.reshape(3, D)[2, 1:].tolist() == [0] * (D - 1)


def test_draft_rows_truncate_to_the_width_and_keep_a_tree():
    tokens = list(range(1, 21))
    parents = [-1] + list(range(19))            # a chain of 20
    rows, par = draft_rows(tokens, parents, 999, D)
    assert rows == [999, 1, 2, 3, 4, 5, 6, 7]
    assert par == [-1, 0, 1, 2, 3, 4, 5, 6]
    rows, par = draft_rows([], [], 7, D)        # speculation off: root only, padded
    assert rows == [7] + [0] * 7 and par == [-1] + [0] * 7
    m = ancestor_mask([-1, 0, 0, 1, 3])
    assert m.astype(int).tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                      [1, 1, 0, 1, 1]]


def fake_batch(top_k: int, top_p: float, temperature: float, width: int, greedy_first: bool):
    reqs = [types.SimpleNamespace(sampling_params=types.SimpleNamespace(top_k=1)),
            types.SimpleNamespace(sampling_params=types.SimpleNamespace(top_k=top_k))]
    if not greedy_first:
        reqs = reqs[1:]
    n = len(reqs)
    info = types.SimpleNamespace(
        acc_additive_penalties=None, logit_bias=None, acc_scaling_penalties=None,
        temperatures=torch.full((n, 1), temperature), top_ks=torch.tensor([r.sampling_params.top_k for r in reqs]),
        top_ps=torch.full((n,), top_p), min_ps=torch.zeros(n), need_min_p_sampling=False, sampling_seed=None)
    return types.SimpleNamespace(reqs=reqs, sampling_info=info,
                                 spec_info=types.SimpleNamespace(positions=torch.arange(n * width)))


def test_sampled_rows_follow_the_target_distribution_and_greedy_rows_stay():
    """Each verify row of a sampled request becomes a one-hot at a token drawn from the row's
    temperature/top-p distribution; chi-square against that distribution (fails on a wrong
    temperature, a wrong top-p cut or a greedy pick)."""
    torch.manual_seed(0)
    width, vocab, temp, top_p = 4, 6, 0.7, 0.9
    base = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0])
    p = torch.softmax(base / temp, -1)
    sp, order = torch.sort(p, descending=True)
    keep = (torch.cumsum(sp, 0) - sp) <= top_p
    want = torch.zeros_like(p)
    want[order[keep]] = sp[keep]
    want /= want.sum()
    n = 4000
    counts = torch.zeros(vocab)
    greedy_rows = torch.randn(width, vocab)
    for _ in range(n // width):
        logits = torch.cat([greedy_rows.clone(), base.repeat(width, 1)])
        batch = fake_batch(top_k=1 << 30, top_p=top_p, temperature=temp, width=width, greedy_first=True)
        sample_rows_as_argmax(logits, batch, width, [False, True])
        assert torch.equal(logits[:width], greedy_rows), "a greedy request's rows are untouched"
        picked = logits[width:].argmax(-1)
        assert torch.isinf(logits[width:]).sum() == width * (vocab - 1)
        counts += torch.bincount(picked, minlength=vocab).float()
    support = want > 0
    assert counts[~support].sum() == 0, "top-p cut tokens are never drawn"
    expected = want[support] * counts.sum()
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    # 4 degrees of freedom at most here: p = 0.001 critical value 18.47
    assert chi2 < 18.47, (counts / counts.sum(), want)
