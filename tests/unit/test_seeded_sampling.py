"""Seeded sampling (Gumbel-max keyed by (seed, position)): the token follows the target
distribution over seeds, is a function of (seed, position, logits) alone, and as a verifier
accepts a node's children with probability p(c1) + p(c2) + ...; and ``process_logits``, the
distribution it samples from."""

from __future__ import annotations

import torch

from agentspec.decode.verify import greedy_verify, gumbel_noise, process_logits, seeded_target

N = 3000
ALPHA = 1e-3  # a correct sampler fails one run in a thousand


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


def _logits(v: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(v, generator=g) * 2.0


def test_seeded_target_follows_the_processed_distribution():
    logits = _logits()
    for temperature, top_p, top_k in ((1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.8, 0.8, 6)):
        p = process_logits(logits, temperature=temperature, top_p=top_p, top_k=top_k)
        counts = torch.zeros_like(p)
        for s in range(N):
            counts[seeded_target(logits, seed=s, position=7, temperature=temperature, top_p=top_p,
                                 top_k=top_k)] += 1
        assert _chi2_pvalue(counts, p) > ALPHA, (temperature, top_p, top_k)


def test_positions_get_independent_noise():
    """Over seeds, the tokens at two positions of the same logits are independent: their joint
    distribution is the product of the marginals."""
    logits = _logits(6, seed=3)
    p = process_logits(logits, temperature=1.0)
    joint = torch.zeros(6, 6)
    for s in range(N):
        a = seeded_target(logits, seed=s, position=10, temperature=1.0)
        b = seeded_target(logits, seed=s, position=11, temperature=1.0)
        joint[a, b] += 1
    assert _chi2_pvalue(joint, torch.outer(p, p)) > ALPHA


def test_a_function_of_seed_and_position_alone():
    logits = _logits(50_000, seed=1)
    a = [seeded_target(logits, seed=99, position=i, temperature=1.0) for i in range(20)]
    b = [seeded_target(logits, seed=99, position=i, temperature=1.0) for i in range(20)]
    c = [seeded_target(logits, seed=100, position=i, temperature=1.0) for i in range(20)]
    assert a == b and a != c
    # the full 64-bit seed keys the noise (a torch CPU generator would keep only its low 32 bits)
    assert not torch.equal(gumbel_noise(5, 0, 64), gumbel_noise(5 + 2**32, 0, 64))
    assert torch.equal(gumbel_noise(-1, 3, 64), gumbel_noise(2**64 - 1, 3, 64))  # negative seeds wrap
    assert not torch.equal(gumbel_noise(5, 0, 64), gumbel_noise(5, 1, 64))


def test_verifier_accepts_siblings_with_their_summed_probability():
    """Root with children c1, c2 (point masses): a child is accepted iff it is the target's
    token, i.e. with probability p(c1) + p(c2); when none is, the bonus follows p restricted to
    the other tokens (renormalised)."""
    logits = _logits(8, seed=5)
    p = process_logits(logits, temperature=1.0)
    c1, c2 = int(p.argsort()[-2]), int(p.argsort()[-4])
    tokens, parents = [100, c1, c2], [-1, 0, 0]
    accepted = torch.zeros(3)
    bonus = torch.zeros(8)
    for s in range(N):
        path, b = greedy_verify(tokens, parents, [seeded_target(logits, seed=s, position=3, temperature=1.0), 0, 0])
        accepted[path[-1]] += 1
        if len(path) == 1:
            bonus[b] += 1
    want = torch.tensor([1 - p[c1] - p[c2], p[c1], p[c2]])
    assert _chi2_pvalue(accepted, want) > ALPHA
    rest = p.clone()
    rest[[c1, c2]] = 0
    assert _chi2_pvalue(bonus, rest / rest.sum()) > ALPHA


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
