"""Greedy speculation equals plain decoding, token for token, on real prompts with the real model."""

from __future__ import annotations

import random

import pytest
import torch

import agentspec
from agentspec import Draft, SpecConfig
from agentspec.drafting import PromptLookupDrafter

from helpers.trees import with_decoys

pytestmark = pytest.mark.slow

# 64: the plain references are then the session's shared ones (conftest.plain_greedy), which the
# batching, decode-step and tree-draft tests compare against too
MAX_TOKENS = 64


def test_greedy_identity_rewrites_and_chat(engine, plain_greedy, rewrite_prompts, chat_prompts):
    prompts = rewrite_prompts + chat_prompts
    assert len(prompts) >= 14
    pairs = [(plain_greedy(ids, MAX_TOKENS), engine.generate(ids, max_tokens=MAX_TOKENS)) for ids in prompts]
    mismatches = [i for i, (p, s) in enumerate(pairs) if p.token_ids != s.token_ids]
    assert not mismatches, f"speculative output differs from plain decoding on prompts {mismatches}"
    for plain, spec in pairs:
        assert plain.text == spec.text and plain.finish_reason == spec.finish_reason
        assert not plain.stats.spec_enabled and spec.stats.spec_enabled
        _check_step_accounting(plain)
        _check_step_accounting(spec)
        # plain decoding: one token per step, nothing drafted
        assert plain.stats.draft_tokens == plain.stats.accepted_tokens == 0 and not plain.stats.draft_sources
        assert set(plain.stats.acceptance_lengths) <= {1} and set(plain.stats.draft_depths) <= {0}
    # speculation must really have happened: rewrites copy from their prompt
    rw = [s.stats for _, s in pairs[: len(rewrite_prompts)]]
    assert sum(s.accepted_tokens for s in rw) > 0.3 * sum(s.completion_tokens for s in rw)
    assert sum(s.steps for s in rw) < sum(s.completion_tokens for s in rw)
    # the whole budget verified every step (no cost cut): same tokens, longer trees (four rewrites:
    # test_verification_logits_equal_plain_logits_bitwise checks every row of such steps too)
    for i, ids in enumerate(rewrite_prompts[:4]):
        full = engine.generate(ids, max_tokens=MAX_TOKENS, spec=SpecConfig(row_cost=0.0))
        assert full.token_ids == pairs[i][0].token_ids, f"full-budget speculation differs on rewrite {i}"
    # chat prompts are where drafts get rejected: the loop must survive that too
    chat = [s.stats for _, s in pairs[len(rewrite_prompts):]]
    assert sum(s.draft_tokens - s.accepted_tokens for s in chat) > 0, "no chat draft token was ever rejected"
    assert any(a - 1 < d for s in chat for a, d in zip(s.acceptance_lengths, s.draft_depths)), \
        "no chat step rejected part of its draft"


def _check_step_accounting(g) -> None:
    """What ``GenerationStats`` says about the steps agrees with itself and with the output."""
    s = g.stats
    assert s.completion_tokens == len(g.token_ids)
    assert len(s.acceptance_lengths) == len(s.draft_depths) == s.steps
    assert s.steps == 0 or s.mean_acceptance_length == pytest.approx(sum(s.acceptance_lengths) / s.steps)
    # each step commits its accepted draft tokens plus one bonus token, never more than the
    # draft tree is deep
    assert all(1 <= a <= d + 1 for a, d in zip(s.acceptance_lengths, s.draft_depths)), \
        list(zip(s.acceptance_lengths, s.draft_depths))
    assert s.accepted_tokens == sum(s.acceptance_lengths) - s.steps
    assert s.accepted_tokens <= s.draft_tokens and sum(s.draft_depths) <= s.draft_tokens
    assert sum(s.draft_sources.values()) == sum(1 for d in s.draft_depths if d > 0)
    # the prefill's token and every step's tokens are the output: all of them when max_tokens
    # ended it (drafts are capped to what is left), a cut last step at EOS / a stop string
    committed = 1 + sum(s.acceptance_lengths)
    if g.finish_reason == "length":
        assert s.completion_tokens == committed == MAX_TOKENS
    else:
        assert g.finish_reason == "stop"
        assert committed - s.acceptance_lengths[-1] <= s.completion_tokens <= committed if s.steps else \
            s.completion_tokens <= 1


class NoisyTreeDrafter:
    """Prompt lookup plus wrong and random branches: every draft is a real tree.

    The true continuation (when prompt lookup finds it) sits at a random child slot, so the
    verifier must pick non-first branches and the KV cache must be compacted.
    """

    def __init__(self, seed: int, vocab: int):
        self.inner = PromptLookupDrafter()
        self.rng = random.Random(seed)
        self.vocab = vocab

    def start(self, req_id, prompt, *, tenant="default"):
        self.inner.start(req_id, prompt, tenant=tenant)

    def extend(self, req_id, tokens):
        self.inner.extend(req_id, tokens)

    def stop(self, req_id):
        self.inner.stop(req_id)

    def propose(self, req_id, budget):
        chain = self.inner.propose(req_id, max(budget // 2, 1)).token_ids
        tokens, parents = with_decoys(chain, budget, self.rng, self.vocab)
        while len(tokens) < budget and len(tokens) < 12:  # random twigs anywhere
            parents.append(self.rng.randrange(-1, len(tokens)))
            tokens.append(self.rng.randrange(self.vocab))
        return Draft(tokens, parents, [0.5] * len(tokens), source="noisy-tree")


def test_greedy_identity_with_tree_drafts(engine, plain_greedy, rewrite_prompts, chat_prompts):
    drafter = NoisyTreeDrafter(seed=1234, vocab=engine.vocab_size)
    branch_accepts = 0
    for ids in rewrite_prompts[:5] + chat_prompts[:2]:
        plain = plain_greedy(ids, 64)
        tree = engine.generate(ids, max_tokens=64, spec=SpecConfig(budget=16, row_cost=0.0), drafter=drafter)
        assert tree.token_ids == plain.token_ids
        branch_accepts += tree.stats.accepted_tokens
    assert branch_accepts > 20  # the true branches were found among the decoys


def test_kv_compaction_equals_sequential_feeding(engine, rewrite_prompts):
    """The cache after a verified tree equals the cache from feeding the accepted tokens one by one."""
    from agentspec.backends.embedded.model import KVCache
    from agentspec.kernels import tree_depths, tree_mask, with_root
    from agentspec.decode.verify import greedy_verify

    ids = rewrite_prompts[0][:300]
    g = engine.generate(ids, max_tokens=4, spec=None).token_ids
    model, args, dt = engine.model, engine.args, engine.dtype
    # tree: root -> [decoy, g1]; g1 -> [g2]; g2 -> [decoy2]  (accepted path: root, g1, g2)
    root = g[0]
    draft_tokens = [(g[1] + 1) % args.vocab_size, g[1], g[2], (g[3] + 7) % args.vocab_size]
    parents = with_root([-1, -1, 1, 2])
    tokens = [root, *draft_tokens]

    # a bfloat16 cache through torch's attention, and the engine's own cache (float32 with the
    # packed copies the native attention reads, on CPU)
    for make in (lambda: KVCache(args, 512, dtype=dt, device=engine.device), lambda: engine.new_cache(512)):
        cache = make()
        model(torch.tensor(ids), torch.arange(len(ids)), cache)
        cache.commit(list(range(len(ids))))
        start = cache.length
        mask = torch.ones(len(tokens), start + len(tokens), dtype=torch.bool)
        mask[:, start:] = tree_mask(parents)
        pos = torch.tensor([start + d for d in tree_depths(parents)])
        logits = model(torch.tensor(tokens), pos, cache, mask)
        path, bonus = greedy_verify(tokens, parents, logits.argmax(-1).tolist())
        assert path == [0, 2, 3] and bonus == g[3]
        cache.commit(path)

        ref = make()
        model(torch.tensor(ids), torch.arange(len(ids)), ref)
        ref.commit(list(range(len(ids))))
        # as plain decoding runs: the token alone on a row-invariant forward (native linears
        # and attention), else the token and a padding row
        r = 1 if model.row_invariant(ref) else 2
        for t in (root, g[1], g[2]):
            s0 = ref.length
            m2 = torch.zeros(r, s0 + r, dtype=torch.bool)
            m2[:, :s0] = True
            m2[0, s0] = m2[r - 1, s0 + r - 1] = True
            model(torch.tensor([t] * r), torch.tensor([s0] * r), ref, m2)
            ref.commit([0])
        assert cache.length == ref.length == len(ids) + 3
        n = cache.length
        tol = dict(atol=1e-4, rtol=1e-4) if cache.k.dtype == torch.float32 and dt == torch.float32 \
            else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(cache.k[:, :, :n], ref.k[:, :, :n], **tol)
        torch.testing.assert_close(cache.v[:, :, :n], ref.v[:, :, :n], **tol)
        if cache.packed:  # the engine's path is exact: the same bits as plain decoding
            assert torch.equal(cache.k[:, :, :n], ref.k[:, :, :n]) and torch.equal(cache.v[:, :, :n], ref.v[:, :, :n])  # the packed copies moved with the accepted branch
            L, Hkv, _, D = cache.k.shape
            kt = cache.kt2[:, :, :, :n].permute(0, 1, 3, 2, 4).reshape(L, Hkv, n, D)
            assert torch.equal(kt.float(), cache.k[:, :, :n])
            vv = cache.vp.permute(0, 1, 2, 4, 3).reshape(L, Hkv, -1, D)[:, :, :n]
            assert torch.equal(vv.float(), cache.v[:, :, :n])


@pytest.mark.extended
def test_deterministic_mode_identity(rewrite_prompts, chat_prompts):
    det = agentspec.Engine.embedded(deterministic=True, quiet=True)
    for ids in rewrite_prompts[:1] + chat_prompts[:1]:  # (the engine paths are the ones tested above)
        plain = det.generate(ids, max_tokens=64, spec=None)
        spec = det.generate(ids, max_tokens=64)
        assert spec.token_ids == plain.token_ids
        assert "deterministic" in spec.stats.spec_reason


def _isa_levels():
    from agentspec.kernels import cpu_isa

    # scalar is checked bit for bit against the others on a small model (tests/unit/test_cpu_*);
    # on the real model it runs ~25x slower than AVX2
    return [isa for isa in cpu_isa.supported() if isa != "scalar"] or ["scalar"]


@pytest.fixture(params=_isa_levels())
def isa(request, restore_isa):
    """Each native-kernel ISA level this CPU runs (``AGENTSPEC_CPU_ISA`` caps them lower)."""
    cpu_isa = restore_isa
    if cpu_isa.ISA_LEVELS.index(request.param) > cpu_isa.ISA_LEVELS.index(cpu_isa.active()):
        pytest.skip(f"kernels capped at {cpu_isa.active()}")
    cpu_isa.set_isa(request.param)
    return request.param


def test_verification_logits_equal_plain_logits_bitwise(engine, rewrite_prompts, isa):
    """Stronger than token identity: every accepted-path row of every verification forward
    (suffix-drafter trees, whole budget, and noisy trees) has the very logits plain decoding
    computes for that position, on every kernel ISA level. Token identity alone would only
    catch near-ties. Two prompts at the CPU's best level, one below it (the levels compute the
    same bits: tests/unit/test_cpu_attention.py and test_cpu_linear.py compare them bit for bit)."""
    from agentspec.drafting import default_drafter
    from agentspec.kernels import cpu_isa

    best = max(_isa_levels(), key=cpu_isa.ISA_LEVELS.index)
    n_prompts = 2 if isa == best else 1

    recorded = []
    forward = engine.model.forward

    def spy(tok, pos, cache, mask=None, **kw):
        out = forward(tok, pos, cache, mask, **kw)
        recorded.append((tok.clone(), pos.clone(), None if mask is None else mask.clone(), out.detach().clone(),
                         cache.length))
        return out

    engine.model.forward = spy
    checked = mismatched = 0
    try:
        for ids in rewrite_prompts[:n_prompts]:
            P = len(ids)
            recorded.clear()
            plain = engine.generate(ids, max_tokens=64, spec=None)
            plain_logits = {P + j - 1: recorded[j][3][0] for j in range(1, len(recorded))}
            # a bfloat16 model on CPU decodes one row per step (native row-invariant linears)
            rows = {rec[0].shape[0] for rec in recorded[1:]}
            assert rows == ({1} if engine.model.row_invariant(engine.new_cache(16)) else {2})
            for drafter in (default_drafter(), NoisyTreeDrafter(seed=7, vocab=engine.vocab_size)):
                recorded.clear()
                g = engine.generate(ids, max_tokens=64, spec=SpecConfig(row_cost=0.0), drafter=drafter)
                assert g.token_ids == plain.token_ids
                out = g.token_ids
                for tok, pos, mask, logits, start in recorded[1:]:
                    T = tok.shape[0]
                    for r in range(T):
                        j = pos[r].item() - P
                        if not 0 <= j < len(out) or tok[r].item() != out[j] or pos[r].item() not in plain_logits:
                            continue
                        seen = mask[r, start:start + T].nonzero().flatten().tolist()
                        if all(tok[a].item() == out[pos[a].item() - P] for a in seen):   # on the output's path
                            checked += 1
                            mismatched += not torch.equal(logits[r], plain_logits[pos[r].item()])
    finally:
        del engine.model.forward   # back to the class's forward
    assert checked > 50 * n_prompts
    assert mismatched == 0, f"{mismatched} of {checked} verification rows differ from plain decoding"


def test_greedy_steps_logits_in_the_heads_dtype_are_the_float32_ones(engine, rewrite_prompts):
    """An all-greedy step asks for the head's own dtype (``float_logits=False``: no float32 copy
    of [rows, vocab]); those are the very float32 logits before conversion, so every argmax, and
    every token, is the same. Both forward paths: one request's rows and several requests' segments."""
    from agentspec.backends.embedded.model import Segment

    model = engine.model
    caches = []
    for ids in rewrite_prompts[:2]:
        cache = engine.new_cache(len(ids) + 16)
        model(torch.tensor(ids), torch.arange(len(ids)), cache, prefill=True)
        cache.commit(list(range(len(ids))))
        caches.append(cache)
    rows = torch.tensor(rewrite_prompts[0][-5:])
    P = caches[0].length
    mask = torch.ones(5, P + 5, dtype=torch.bool)
    mask[:, P:] = torch.ones(5, 5, dtype=torch.bool).tril()
    single = [model(rows, torch.arange(P, P + 5), caches[0], mask, float_logits=f) for f in (True, False)]
    segs = lambda: [Segment(cache=c, rows=3, mask=torch.cat([torch.ones(3, c.length, dtype=torch.bool),  # noqa: E731
                                                             torch.ones(3, 3, dtype=torch.bool).tril()], 1))
                    for c in caches]
    toks = torch.tensor(rewrite_prompts[0][-3:] + rewrite_prompts[1][-3:])
    pos = torch.tensor([caches[0].length + i for i in range(3)] + [caches[1].length + i for i in range(3)])
    multi = [model.forward_segments(toks, pos, segs(), float_logits=f) for f in (True, False)]
    for full, own in (single, multi):
        assert full.dtype == torch.float32 and own.dtype == model.embed.weight.dtype
        assert torch.equal(own.float(), full)
        assert torch.equal(own.argmax(dim=-1), full.argmax(dim=-1))


@pytest.mark.extended
def test_one_weight_copy_same_bits(engine, plain_greedy, rewrite_prompts, chat_prompts, monkeypatch):
    """AGENTSPEC_WEIGHT_COPIES=1 (what a model too large to hold twice gets): the torch weights
    are freed once packed and prompt chunks unpack them per forward. Prompt logits are the same
    bits as with both copies, and greedy output, plain and speculative, the same tokens."""
    from agentspec.backends.embedded.model import KVCache

    if engine.model.head_packed is None:
        pytest.skip("the native linears do not run here (nothing is packed)")
    monkeypatch.setenv("AGENTSPEC_WEIGHT_COPIES", "1")
    one = agentspec.Engine.embedded(quiet=True)
    assert one.model.weight_copies == 1 and engine.model.weight_copies == 2
    assert one.kernel_info()["kernel_plan"]["weight_copies"] == 1
    assert all(m.weight.numel() == 0 for layer in one.model.layers
               for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
    assert one.model.param_count() == engine.model.param_count()
    ids = rewrite_prompts[0]
    logits = []
    for e in (engine, one):
        cache = KVCache(e.args, len(ids) + 8, dtype=e.kv_dtype, device="cpu")
        logits.append(e.model(torch.tensor(ids), torch.arange(len(ids)), cache, logits_rows=slice(0, None)))
    assert torch.equal(logits[0], logits[1])
    assert one.generate(chat_prompts[0], max_tokens=MAX_TOKENS, spec=None).token_ids == \
        plain_greedy(chat_prompts[0], MAX_TOKENS).token_ids
    for ids in rewrite_prompts[:2] + chat_prompts[:1]:
        assert one.generate(ids, max_tokens=MAX_TOKENS).token_ids == plain_greedy(ids, MAX_TOKENS).token_ids


def test_weight_copies_setting_is_checked(monkeypatch):
    monkeypatch.setenv("AGENTSPEC_WEIGHT_COPIES", "3")
    with pytest.raises(agentspec.ConfigError, match="AGENTSPEC_WEIGHT_COPIES='3'"):
        agentspec.Engine.embedded(quiet=True)


@pytest.mark.extended
def test_bfloat16_kv_cache_greedy_identity(rewrite_prompts, chat_prompts):
    """A bfloat16 KV cache (``kv_dtype="bfloat16"``, the native attention on the layered rows path):
    speculation equals plain decoding with the real model on real prompts, one request at a time
    and batched (the segments kernel writes each request's new keys into its own cache)."""
    from agentspec.backends.embedded.batch import BatchEngine

    eng = agentspec.Engine.embedded(quiet=True, kv_dtype="bfloat16", prefix_cache_bytes=0)
    plan = eng.kernel_info()["kernel_plan"]
    if plan["rows_attention"] != "native":
        pytest.skip(f"the native attention does not run here ({plan['rows_attention']})")
    assert eng.new_cache(64).k.dtype == torch.bfloat16 and plan["rows_path"] == "layered"
    prompts = rewrite_prompts[:4] + chat_prompts[:2]
    plain = [eng.generate(ids, max_tokens=MAX_TOKENS, spec=None) for ids in prompts]
    spec = [eng.generate(ids, max_tokens=MAX_TOKENS) for ids in prompts]
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.accepted_tokens for s in spec[:4]) > 0.3 * sum(s.stats.completion_tokens for s in spec[:4])
    with BatchEngine(eng, budget_policy="load_aware", background=False) as be:
        out = be.generate_many(prompts, max_tokens=MAX_TOKENS)
    assert [g.token_ids for g in out] == [p.token_ids for p in plain]
