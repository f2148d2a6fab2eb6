"""Sampled generation with speculation follows the target's distribution, through the real engine
(single-request and batched paths) with the real model: a chi-square goodness-of-fit test of the
first two generated tokens against probabilities computed from the model itself."""

from __future__ import annotations

import pytest
import torch

from agentspec import Draft, SpecConfig
from agentspec.drafting import EMPTY_DRAFT
from agentspec.backends.embedded.batch import BatchEngine
from agentspec.decode.verify import process_logits

pytestmark = [pytest.mark.slow, pytest.mark.extended]   # extended tier: chi-square tests of speculative sampling (minutes); the seeded-sampling exactness tests stay in make test

TEMPERATURE, TOP_K = 1.0, 3
N = 160  # samples per test: enough for the chi-square (small cells pooled) to catch a biased sampler
MAX_TOKENS = 2 + TOP_K  # the engine drafts at most max_tokens - generated - 1 tokens


def _next_probs(engine, ids: list[int], then: int | None = None) -> torch.Tensor:
    """The target distribution after ``ids`` (+ ``then``), computed as the engine computes it:
    the prompt by prefill, ``then`` by a decode step (its own row plus a padding row)."""
    cache = engine.new_cache(len(ids) + 256)
    logits = engine.model(torch.tensor(ids), torch.arange(len(ids)), cache, logits_rows=slice(-1, None))[0]
    if then is not None:
        n = len(ids)
        cache.commit(list(range(n)))
        mask = torch.zeros(2, n + 2, dtype=torch.bool)
        mask[:, :n] = True
        mask[0, n] = mask[1, n + 1] = True
        logits = engine.model(torch.tensor([then, then]), torch.tensor([n, n]), cache, mask)[0]
    return process_logits(logits, temperature=TEMPERATURE, top_k=TOP_K)


class TopKTreeDrafter:
    """After the first generated token, drafts that context's top-k tokens as sibling children
    of the root, worst first (so rejection and renormalisation are exercised)."""

    def __init__(self, table: dict[int, list[int]]) -> None:
        self.table = table
        self.ctx: dict[str, list[int]] = {}

    def start(self, req_id, prompt, *, tenant="default"):
        self.ctx[req_id] = []

    def extend(self, req_id, tokens):
        self.ctx[req_id].extend(tokens)

    def propose(self, req_id, budget):
        out = self.ctx[req_id]
        if len(out) != 1 or out[0] not in self.table or budget < 1:
            return EMPTY_DRAFT
        kids = self.table[out[0]][::-1][:budget]
        return Draft(kids, [-1] * len(kids), [0.5] * len(kids), 1.0, "test")

    def stop(self, req_id):
        self.ctx.pop(req_id, None)


def _chi2_pvalue(observed: dict, expected: dict, n: int) -> float:
    """Pearson chi-square p-value; cells with expected count < 5 are pooled."""
    cells, pooled_o, pooled_e = [], 0, 0.0
    for key, p in expected.items():
        e = p * n
        if e < 5:
            pooled_o += observed.get(key, 0)
            pooled_e += e
        else:
            cells.append((observed.get(key, 0), e))
    if pooled_e > 0:
        cells.append((pooled_o, pooled_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def target(engine):
    prompt = engine.encode("Name one color. Answer with one word.")
    p1 = _next_probs(engine, prompt)
    firsts = torch.nonzero(p1).flatten().tolist()
    joint, table = {}, {}
    for t1 in firsts:
        p2 = _next_probs(engine, prompt, then=t1)
        seconds = torch.nonzero(p2).flatten().tolist()
        table[t1] = seconds
        for t2 in seconds:
            key = (t1, -1 if t2 in engine.tokenizer.eos_token_ids else t2)  # EOS ends the output
            joint[key] = joint.get(key, 0.0) + float(p1[t1] * p2[t2])
    eos = engine.tokenizer.eos_token_ids
    assert not any(t in eos for t in firsts), "pick a prompt whose first tokens are not EOS"
    return prompt, joint, table


def _pair(g) -> tuple[int, int]:
    return (g.token_ids[0], g.token_ids[1] if len(g.token_ids) >= 2 else -1)


def _check(samples: list[tuple[int, int]], joint: dict) -> None:
    observed: dict = {}
    for s in samples:
        observed[s] = observed.get(s, 0) + 1
    assert set(observed) <= set(joint), "sampled a pair outside the target's support"
    p = _chi2_pvalue(observed, joint, len(samples))
    assert p > 1e-3, f"chi-square p = {p:.2e}: speculative sampling does not follow the target"


def test_single_request_speculative_sampling_matches_target(engine, target):
    prompt, joint, table = target
    drafter = TopKTreeDrafter(table)
    samples, drafted = [], 0
    for seed in range(N):
        g = engine.generate(prompt, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_k=TOP_K, seed=seed,
                            spec=SpecConfig(budget=8, row_cost=0), drafter=drafter)
        assert g.stats.spec_enabled
        drafted += g.stats.draft_tokens > 0
        samples.append(_pair(g))
    assert drafted == N  # every request verified a tree at its second token
    _check(samples, joint)


@pytest.mark.parametrize("verify", ["reference", "batched"])
def test_batched_speculative_sampling_matches_target(engine, target, verify):
    """Batched; ``verify="batched"`` is the engine's CUDA path (agentspec.kernels), here through
    the kernels' torch reference."""
    prompt, joint, table = target
    drafter = TopKTreeDrafter(table)
    results = []
    # flat costs, kept (live_costs=False: the timed steps would make rows dear), so every request drafts
    with BatchEngine(engine, max_batch=8, step_costs={2: 1.0, 264: 1.0}, background=False, verify=verify,
                     live_costs=False) as be:
        for seed in range(N):
            be.submit(prompt, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_k=TOP_K, seed=10_000 + seed,
                      spec=SpecConfig(budget=8), drafter=drafter, on_done=lambda g, e: results.append(e or g))
        be.run_until_idle()  # the queued requests, batched, in this thread
    assert len(results) == N and not any(isinstance(r, BaseException) for r in results)
    assert all(r.stats.draft_tokens > 0 and r.stats.spec_enabled for r in results)
    _check([_pair(r) for r in results], joint)


def test_speculative_sampling_with_eagle3_head_matches_target(engine, target):
    """Sampled requests drafted by an EAGLE-3 head (a chain with top-k leaves: trees), through the
    single-request path, follow the target distribution."""
    from agentspec.drafting.eagle3 import Eagle3Config, Eagle3Head, build_vocab_map
    from agentspec.drafting.eagle3_drafter import Eagle3Drafter

    prompt, joint, _ = target
    cfg = Eagle3Config.for_target(engine.args, draft_vocab_size=1024)
    torch.manual_seed(0)
    head = Eagle3Head(cfg)
    counts = torch.zeros(engine.args.vocab_size)
    for t1, t2 in joint:   # the draft vocabulary holds the tokens the target can say here
        counts[t1] += 1
        counts[max(t2, 0)] += 1
    head.set_vocab_map(*build_vocab_map(counts, 1024))
    drafter = Eagle3Drafter(head.to(torch.bfloat16).eval(), engine.model.embed.weight, topk=3, depth=3,
                            min_survival=0.0, min_prob=0.0)
    samples, drafted = [], 0
    for seed in range(N):
        g = engine.generate(prompt, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_k=TOP_K, seed=50_000 + seed,
                            spec=SpecConfig(budget=8, row_cost=0), drafter=drafter)
        drafted += g.stats.draft_tokens > 0
        samples.append(_pair(g))
    assert drafted == N
    _check(samples, joint)
