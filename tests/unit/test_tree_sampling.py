"""Exact tree speculative sampling (agentspec.verify) and its batched torch reference
(agentspec.kernels): equality on random trees, and chi-square tests that the emitted tokens
follow the target distribution (with negative controls that show the test has power)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.kernels import pack_trees, sampling_verify_batch, sampling_verify_batch_torch
from agentspec.verify import greedy_verify, process_logits, sampling_verify, sampling_walk

V = 8
# root children: tokens 2, 5, 2 (a duplicate: never accepted once the first 2 is rejected), 7;
# second level under the first 2 and under 5; a third level under 3
TOKENS = [0, 2, 5, 2, 7, 3, 1, 4, 6]
PARENTS = [-1, 0, 0, 0, 0, 1, 1, 2, 5]
CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=5, top_p=0.9),
]


def _target(seed: int = 0):
    """A toy target: logits after the root, after each first token, and for deeper rows."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randn(V, generator=g) * 1.5
    second = torch.randn(V, V, generator=g) * 1.5          # [first token, V]
    deeper = torch.randn(len(TOKENS), V, generator=g) * 1.5
    # make the drafted tokens likely, so that steps accept one, two and three tokens
    first[[2, 5, 7]] += torch.tensor([4.0, 3.0, 0.5])
    second[2, [3, 1]] += 2.5
    second[5, 4] += 2.0
    deeper[5, 6] += 3.0
    return first, second, deeper


def _row_logits(first, second, deeper) -> torch.Tensor:
    """``[T, V]``: the target logits after each node of the test tree."""
    rows = []
    for i, p in enumerate(PARENTS):
        if p < 0:
            rows.append(first)
        elif PARENTS[p] < 0:                                 # a child of the root: depth 1
            rows.append(second[TOKENS[i]])
        else:
            rows.append(deeper[i])
    return torch.stack(rows)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (outcomes with zero
    probability must never occur; bins expecting < 5 are pooled)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "an outcome with zero target probability was emitted"
    exp = probs * n
    big = exp >= 5
    obs_b = torch.cat([counts[big], counts[~big & (probs > 0)].sum().reshape(1)])
    exp_b = torch.cat([exp[big], exp[~big & (probs > 0)].sum().reshape(1)])
    keep = exp_b > 0
    obs_b, exp_b = obs_b[keep], exp_b[keep]
    stat = ((obs_b - exp_b) ** 2 / exp_b).sum()
    df = obs_b.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _draws(cfg: dict, n: int, seed: int, *, accept_all: bool = False, bonus_ignores_rejections: bool = False):
    """``n`` verification steps of the test tree with the batched reference. Returns the first
    two emitted tokens ``[n, 2]`` (when a step emits one token, the second is sampled from the
    target after it, as the next step would) and the expected joint distribution ``[V, V]``."""
    first, second, deeper = _target()
    probs = process_logits(_row_logits(first, second, deeper), **cfg)          # [T, V]
    p0 = process_logits(first, **cfg)                                           # [V]
    p1 = process_logits(second, **cfg)                                          # [V, V]
    T = len(TOKENS)
    tok, par, off = pack_trees([(TOKENS, PARENTS)] * n)
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(2, n * T, generator=g)
    if accept_all:                                     # wrong: accept any child with p > 0
        u[0] = 0.0
    paths, lengths, bonus = sampling_verify_batch(tok, par, probs.repeat(n, 1), u[0], u[1], off)
    t1 = torch.where(lengths > 1, torch.tensor(TOKENS)[paths[:, 1].clamp(min=0)], bonus)
    if bonus_ignores_rejections:                       # wrong: bonus at the root drawn from p, not the residual
        t1 = torch.where(lengths > 1, t1, torch.multinomial(p0, n, replacement=True, generator=g))
    nxt = torch.multinomial(p1[t1], 1, generator=g)[:, 0]
    t2 = torch.where(lengths > 2, torch.tensor(TOKENS)[paths[:, 2].clamp(min=0)],
                     torch.where(lengths == 2, bonus, nxt))
    return torch.stack([t1, t2], 1), p0[:, None] * p1


def _joint_counts(pairs: torch.Tensor) -> torch.Tensor:
    return torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).reshape(V, V)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_tree_sampling_reproduces_target_distribution(cfg):
    pairs, joint = _draws(cfg, 25_000, seed=1)
    counts = _joint_counts(pairs)
    assert _chi2_pvalue(counts.sum(1), joint.sum(1)) > 1e-4      # first token
    assert _chi2_pvalue(counts, joint) > 1e-4                    # first two tokens jointly


@pytest.mark.parametrize("wrong", ["accept_all", "bonus_ignores_rejections"])
def test_chi_square_catches_a_wrong_sampler(wrong):
    pairs, joint = _draws(CONFIGS[0], 20_000, seed=1, **{wrong: True})
    counts = _joint_counts(pairs)
    assert _chi2_pvalue(counts.sum(1), joint.sum(1)) < 1e-6


def test_single_request_reference_reproduces_target_distribution():
    """``sampling_walk`` itself (not the batched reference), fewer draws."""
    cfg = CONFIGS[3]
    first, second, deeper = _target()
    probs = process_logits(_row_logits(first, second, deeper), **cfg)
    p0, p1 = process_logits(first, **cfg), process_logits(second, **cfg)
    g = torch.Generator().manual_seed(3)
    n = 6000
    u = torch.rand(n, 2, len(TOKENS), generator=g)
    pairs = []
    for k in range(n):
        path, bonus = sampling_walk(TOKENS, PARENTS, probs, u[k, 0], u[k, 1])
        emitted = [TOKENS[i] for i in path[1:]] + [bonus]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(p1[emitted[0]], 1, generator=g)))
        pairs.append(emitted[:2])
    counts = _joint_counts(torch.tensor(pairs))
    joint = p0[:, None] * p1
    assert _chi2_pvalue(counts.sum(1), joint.sum(1)) > 1e-4
    assert _chi2_pvalue(counts, joint) > 1e-4


def test_sampling_verify_seeded_runs_repeat():
    logits = _row_logits(*_target())
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(11)
        runs.append([sampling_verify(TOKENS, PARENTS, logits, temperature=0.8, top_p=0.9, generator=g)
                     for _ in range(20)])
    assert runs[0] == runs[1]
    a = [_draws(CONFIGS[1], 500, seed=5)[0] for _ in range(2)]
    assert torch.equal(a[0], a[1])


def test_sampling_verify_defaults():
    # every public default is called: no top-k/top-p, no generator
    path, bonus = sampling_verify(TOKENS, PARENTS, _row_logits(*_target()), temperature=1.0)
    assert path[0] == 0 and 0 <= bonus < V
    for p, c in zip(path, path[1:]):
        assert PARENTS[c] == p


def test_process_logits_matches_the_engine_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p = torch.softmax(logits, -1)
    assert torch.allclose(process_logits(logits, temperature=1.0), p)
    k2 = process_logits(logits, temperature=1.0, top_k=2)
    assert torch.allclose(k2, torch.cat([p[:2] / p[:2].sum(), torch.zeros(2)]))
    top = process_logits(logits, temperature=1.0, top_p=0.8)    # smallest prefix reaching 0.8: 2 tokens
    assert torch.allclose(top, k2)
    assert process_logits(logits, temperature=0.0).tolist() == [1.0, 0.0, 0.0, 0.0]
    ties = process_logits(torch.tensor([1.0, 3.0, 3.0, 0.0]), temperature=1.0, top_k=1)
    assert ties[1] == ties[2] == 0.5                            # ties with the k-th are kept
    batch = process_logits(torch.stack([logits, logits.flip(0)]), temperature=0.5, top_k=3, top_p=0.9)
    assert torch.allclose(batch[1], process_logits(logits.flip(0), temperature=0.5, top_k=3, top_p=0.9))


def test_draws_follow_the_engine_sampler():
    """An empty draft emits one token from the same distribution as the engine's ``sample``."""
    from agentspec.engine.embedded import sample

    logits = torch.tensor([0.5, 2.0, 1.0, -1.0, 1.5])
    cfg = dict(temperature=0.8, top_p=0.9, top_k=4)
    g = torch.Generator().manual_seed(2)
    n = 3000
    ours = torch.bincount(torch.tensor([sampling_verify([0], [-1], logits[None], **cfg, generator=g)[1]
                                        for _ in range(n)]), minlength=5)
    assert _chi2_pvalue(ours, process_logits(logits, **cfg)) > 1e-4
    theirs = torch.bincount(torch.tensor([sample(logits, cfg["temperature"], cfg["top_p"], cfg["top_k"], g)
                                          for _ in range(n)]), minlength=5)
    assert _chi2_pvalue(theirs, process_logits(logits, **cfg)) > 1e-4


# ------------------------------------------------------------------ equality on random trees


@st.composite
def dyadic_batches(draw, max_trees=4, max_nodes=9, vocab=6):
    """Random trees with probabilities in 1/64ths and uniforms in 1/256ths: every sum and
    product the samplers form is exact in float32, so all implementations must agree."""
    trees, rows = [], []
    for _ in range(draw(st.integers(1, max_trees))):
        n = draw(st.integers(1, max_nodes))
        parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
        tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
        trees.append((tokens, parents))
        for _ in range(n):
            cuts = sorted(draw(st.lists(st.integers(0, 64), min_size=vocab - 1, max_size=vocab - 1)))
            rows.append([b - a for a, b in zip([0, *cuts], [*cuts, 64])])
    N = len(rows)
    u = draw(st.lists(st.integers(0, 255), min_size=2 * N, max_size=2 * N))
    probs = torch.tensor(rows, dtype=torch.float32) / 64
    uniforms = torch.tensor(u, dtype=torch.float32).reshape(2, N) / 256
    return trees, probs, uniforms[0], uniforms[1]


def _per_request(trees, probs, ua, ub, fn):
    out, start = [], 0
    for tokens, parents in trees:
        end = start + len(tokens)
        out.append(fn(tokens, parents, probs[start:end], ua[start:end], ub[start:end]))
        start = end
    return out


def _as_lists(paths, lengths, bonus):
    return [(paths[b, :lengths[b]].tolist(), int(bonus[b])) for b in range(lengths.numel())]


@given(dyadic_batches())
@settings(max_examples=200, deadline=None)
def test_batched_reference_equals_sampling_walk(batch):
    trees, probs, ua, ub = batch
    tok, par, off = pack_trees(trees)
    paths, lengths, bonus = sampling_verify_batch_torch(tok, par, probs, ua, ub, off)
    assert (paths[torch.arange(paths.shape[1]) >= lengths[:, None]] == -1).all()
    assert _as_lists(paths, lengths, bonus) == _per_request(trees, probs, ua, ub, sampling_walk)


@given(dyadic_batches())
@settings(max_examples=100, deadline=None)
def test_point_mass_targets_reduce_to_greedy(batch):
    """With one-hot target rows (temperature 0) tree sampling is greedy verification."""
    trees, probs, ua, ub = batch
    target = probs.argmax(-1)
    onehot = process_logits(probs, temperature=0.0)
    got = _per_request(trees, onehot, ua, ub, sampling_walk)
    want, start = [], 0
    for tokens, parents in trees:
        want.append(greedy_verify(tokens, parents, target[start:start + len(tokens)].tolist()))
        start += len(tokens)
    assert got == want


def test_sampling_walk_edge_cases():
    probs = torch.tensor([[0.25, 0.75, 0.0], [0.5, 0.5, 0.0]])
    # a zero-probability child is never accepted; the bonus avoids the rejected token
    path, bonus = sampling_walk([9, 2], [-1, 0], probs, torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.99]))
    assert path == [0] and bonus == 0
    # a child with all the mass is always accepted
    path, bonus = sampling_walk([9, 1], [-1, 0], torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]),
                                torch.tensor([0.0, 0.999]), torch.tensor([0.5, 0.5]))
    assert path == [0, 1] and bonus == 2
    # rows that do not sum to 1 and leave no residual: the row's argmax
    path, bonus = sampling_walk([9, 1], [-1, 0], torch.tensor([[0.0, 0.3, 0.0], [1.0, 0.0, 0.0]]),
                                torch.tensor([0.0, 0.9]), torch.tensor([0.5, 0.5]))
    assert path == [0] and bonus == 1
    tok, par, off = pack_trees([([9, 1], [-1, 0])])
    paths, lengths, b = sampling_verify_batch_torch(tok, par, torch.tensor([[0.0, 0.3, 0.0], [1.0, 0.0, 0.0]]),
                                                    torch.tensor([0.0, 0.9]), torch.tensor([0.5, 0.5]), off)
    assert lengths.tolist() == [1] and b.tolist() == [1]


def test_batched_sampling_validates_inputs():
    tok, par, off = pack_trees([([1, 2], [-1, 0])])
    u = torch.zeros(2)
    with pytest.raises(ValueError, match=r"probs must be \[N, V\] with N = 2"):
        sampling_verify_batch_torch(tok, par, torch.zeros(3, 4), u, u, off)
    with pytest.raises(ValueError, match=r"u_bonus must be \[N\]"):
        sampling_verify_batch_torch(tok, par, torch.zeros(2, 4), u, torch.zeros(3), off)
    with pytest.raises(ValueError, match=r"parents\[1\] = 1"):
        sampling_verify_batch_torch(tok, torch.tensor([-1, 1]), torch.zeros(2, 4), u, u, off)
    with pytest.raises(ValueError, match="offsets must start at 0"):
        sampling_verify_batch_torch(tok, par, torch.zeros(2, 4), u, u, torch.tensor([0, 3]))
