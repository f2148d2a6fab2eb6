"""The one decode step (agentspec.decode.step) through every engine path, with the real model:
seeded sampling that repeats whatever drafts, budgets past one forward's rows, and the target's
hidden states for draft heads."""

from __future__ import annotations

import pytest

import torch

from agentspec import SpecConfig
from agentspec.drafting import LookaheadDrafter, PromptLookupDrafter, SuffixDrafter
from agentspec.drafting.protocols import HiddenStateDrafter
from agentspec.backends.embedded.batch import BatchEngine
from agentspec.decode.step import MAX_STEP_ROWS

REPEAT = ("Repeat this list exactly, twice: alpha, beta, gamma, delta, epsilon, zeta, eta, theta, iota, "
          "kappa, lambda, mu.")
COSTS = {2: 1.0, 8: 1.1, 33: 1.5, 264: 8.0}


def test_seeded_sampling_is_a_function_of_the_seed(engine):
    """Same seed: same tokens with speculation off, with different drafters, after the tenant's
    history changed (it feeds the suffix drafter), and batched next to other requests."""
    ids = engine.encode(REPEAT)
    opts = dict(max_tokens=48, temperature=0.8, top_p=0.95, seed=1234)
    plain = engine.generate(ids, spec=None, **opts)
    assert not plain.stats.spec_enabled and len(plain.token_ids) > 10
    suffix = SuffixDrafter()
    runs = {
        "suffix": engine.generate(ids, drafter=suffix, tenant="t1", **opts),
        # the tenant's history now holds the first run's output: different drafts, same tokens
        "suffix, history": engine.generate(ids, drafter=suffix, tenant="t1", **opts),
        "prompt lookup": engine.generate(ids, drafter=PromptLookupDrafter(), **opts),
        "lookahead": engine.generate(ids, drafter=LookaheadDrafter(), **opts),
        "budget 4": engine.generate(ids, spec=SpecConfig(budget=4, row_cost=0.0), **opts),
    }
    for name, g in runs.items():
        assert g.token_ids == plain.token_ids, name
    assert runs["suffix, history"].stats.accepted_tokens > runs["suffix"].stats.accepted_tokens
    other = engine.generate(ids, spec=None, **{**opts, "seed": 1235})
    assert other.token_ids != plain.token_ids  # the seed matters
    with BatchEngine(engine, background=False, step_costs=COSTS) as be:
        out = be.generate_many([ids, "Name three colours.", ids], **opts)
    assert out[0].token_ids == plain.token_ids and out[2].token_ids == plain.token_ids
    assert out[2].stats.accepted_tokens > 0  # the batch speculated for it


def test_budget_past_one_forward_is_clamped_not_a_crash(engine, plain_greedy):
    ids = engine.encode(REPEAT)
    want = plain_greedy(ids, 64)
    big = SpecConfig(budget=1000, row_cost=0.0)
    g = engine.generate(ids, max_tokens=64, spec=big)
    assert g.token_ids == want.token_ids
    assert f"clamped to {MAX_STEP_ROWS - 1}" in g.stats.spec_reason
    assert max(g.stats.draft_depths) <= MAX_STEP_ROWS - 1
    with BatchEngine(engine, background=False, budget_policy="fixed", step_costs=COSTS) as be:
        out = be.generate_many([ids, ids, "Say hello."], max_tokens=64, spec=big)
    assert out[0].token_ids == want.token_ids and out[1].token_ids == want.token_ids
    assert all("clamped" in o.stats.spec_reason for o in out)


class RecordingHeadDrafter:
    """A suffix drafter that asks for hidden states, as an EAGLE-3 head does, and records them."""

    def __init__(self, layers):
        self.inner = SuffixDrafter()
        self.hidden_layers = tuple(layers)
        self.seen: dict[str, list[tuple[list[int], dict]]] = {}
        self.extend, self.propose, self.stop = self.inner.extend, self.inner.propose, self.inner.stop

    def start(self, req_id, prompt, *, tenant="default"):
        self.inner.start(req_id, prompt, tenant=tenant)
        self.seen[req_id] = []

    def observe_hidden(self, req_id, tokens, hidden):
        self.seen[req_id].append((list(tokens), {k: v.detach().float().clone() for k, v in hidden.items()}))


def test_model_returns_hidden_states_only_when_asked(engine):
    m = engine.model
    ids = torch.tensor(engine.encode("Hello there."))
    n = m.args.n_layers
    cache = engine.new_cache(256)
    plain = m(ids, torch.arange(len(ids)), cache)
    assert isinstance(plain, torch.Tensor)
    cache.reset()
    logits, hidden = m(ids, torch.arange(len(ids)), cache, hidden_layers=(0, n - 1))
    assert sorted(hidden) == [0, n - 1] and hidden[n - 1].shape == (len(ids), m.args.dim)
    assert torch.equal(logits, plain)
    assert torch.equal(m._logits(hidden[n - 1]), plain)  # the last layer's output is what the head reads


def test_hidden_state_drafter_sees_every_committed_token(engine, plain_greedy):
    ids = engine.encode(REPEAT)
    want = plain_greedy(ids, 40)
    n = engine.args.n_layers
    layers = (1, n // 2, n - 2)
    d = RecordingHeadDrafter(layers)
    assert isinstance(d, HiddenStateDrafter)
    g = engine.generate(ids, max_tokens=40, drafter=d)
    assert g.token_ids == want.token_ids and g.stats.accepted_tokens > 0
    (calls,) = d.seen.values()
    toks = [t for tokens, _ in calls for t in tokens]
    # prefill: the prompt; each step: the root and the accepted draft tokens (the bonus token
    # is the next step's root): together every token of prompt + output but the last
    assert toks == ids + g.token_ids[:-1]
    for tokens, hidden in calls:
        assert sorted(hidden) == sorted(layers)
        assert all(h.shape == (len(tokens), engine.args.dim) for h in hidden.values())
    # the decode steps' hidden states match a prefill of the whole sequence (other kernels: close)
    full = torch.tensor(ids + g.token_ids[:-1])
    cache = engine.new_cache(len(full) + 256)
    _, ref = engine.model(full, torch.arange(len(full)), cache, hidden_layers=layers)
    got = torch.cat([h[layers[-1]] for _, h in calls])
    want_h = ref[layers[-1]].float()
    rel = (got - want_h).norm(dim=-1) / want_h.norm(dim=-1)   # bf16 activations: ~1% per row
    assert got.shape == want_h.shape and float(rel.max()) < 0.05, float(rel.max())
    # batched: the same calls per request
    d2 = RecordingHeadDrafter(layers)
    with BatchEngine(engine, background=False, step_costs=COSTS) as be:
        out = be.generate_many([ids, ids], max_tokens=40, drafter=d2)
    for o, calls in zip(out, d2.seen.values()):
        assert o.token_ids == want.token_ids
        assert [t for tokens, _ in calls for t in tokens] == ids + o.token_ids[:-1]


class BatchRecordingDrafter:
    """A prompt-lookup drafter that drafts batches at once (``BatchDrafter``) and asks for the
    final layer by a negative index."""

    hidden_layers = (-1,)

    def __init__(self):
        self.inner = PromptLookupDrafter()
        self.start, self.extend, self.stop = self.inner.start, self.inner.extend, self.inner.stop
        self.batches: list[int] = []
        self.layers_seen: set = set()

    def propose(self, req_id, budget):
        raise AssertionError("the batch path must call propose_batch")

    def propose_batch(self, req_ids, budgets):
        self.batches.append(len(req_ids))
        return [self.inner.propose(r, b) for r, b in zip(req_ids, budgets)]

    def observe_hidden(self, req_id, tokens, hidden):
        self.layers_seen |= set(hidden)


def test_batch_drafter_gets_one_call_per_step(engine, plain_greedy):
    ids = engine.encode(REPEAT)
    want = plain_greedy(ids, 40)
    d = BatchRecordingDrafter()
    with BatchEngine(engine, background=False, step_costs=COSTS) as be:
        out = be.generate_many([ids, ids, ids], max_tokens=40, drafter=d)
    assert all(o.token_ids == want.token_ids for o in out)
    assert max(d.batches) == 3 and len(d.batches) < sum(o.stats.steps for o in out)
    assert d.layers_seen == {-1}


def test_combined_drafters_pass_hidden_states_and_batches_through(engine, plain_greedy):
    """A draft head behind the suffix drafter (``"suffix>head"``) still gets its hidden states, and
    a batch drafter inside a merge still gets one call per step."""
    from agentspec.drafting import FallbackDrafter, MergedDrafter

    ids = engine.encode(REPEAT)
    want = plain_greedy(ids, 40)
    n = engine.args.n_layers
    head = RecordingHeadDrafter((2, n - 1))
    g = engine.generate(ids, max_tokens=40, drafter=FallbackDrafter(SuffixDrafter(), head))
    assert g.token_ids == want.token_ids
    (calls,) = head.seen.values()
    assert [t for tokens, _ in calls for t in tokens] == ids + g.token_ids[:-1]
    assert all(sorted(h) == [2, n - 1] for _, h in calls)
    batch = BatchRecordingDrafter()
    with BatchEngine(engine, background=False, step_costs=COSTS) as be:
        out = be.generate_many([ids, ids], max_tokens=40, drafter=MergedDrafter(PromptLookupDrafter(), batch))
    assert all(o.token_ids == want.token_ids for o in out) and max(batch.batches) == 2
    assert batch.layers_seen == {-1}


class FailingStartDrafter(PromptLookupDrafter):
    def start(self, req_id, prompt, *, tenant="default"):
        raise ValueError("index unavailable")


def test_a_failing_drafter_start_reports_its_own_error(engine):
    import pytest

    with pytest.raises(ValueError, match="index unavailable"):
        engine.generate("Hi", max_tokens=4, drafter=FailingStartDrafter())
    with BatchEngine(engine, background=False, step_costs=COSTS) as be:
        with pytest.raises(ValueError, match="index unavailable"):
            be.generate_many(["Hi"], max_tokens=4, drafter=FailingStartDrafter())


def test_one_requests_failure_is_its_own_and_reported_once(engine, plain_greedy):
    """A request whose ``should_stop`` raises mid-run fails alone, with one ``on_done``; the
    requests decoding next to it finish as plain decoding would."""
    from agentspec.errors import BackendClosedError

    ids = engine.encode(REPEAT)
    want = plain_greedy(ids, 32)
    calls = {"n": 0}

    def bad_stop():
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("client bookkeeping broke")
        return False

    done: dict[str, list] = {"bad": [], "good": []}
    be = BatchEngine(engine, background=False, step_costs=COSTS)
    be.submit(ids, max_tokens=32, should_stop=bad_stop, on_done=lambda g, e: done["bad"].append((g, e)))
    for _ in range(2):
        be.submit(ids, max_tokens=32, on_done=lambda g, e: done["good"].append((g, e)))
    be.run_until_idle()
    be.close()
    assert len(done["bad"]) == 1 and isinstance(done["bad"][0][1], RuntimeError)
    assert len(done["good"]) == 2 and all(e is None and g.token_ids == want.token_ids for g, e in done["good"])
    import pytest

    with pytest.raises(BackendClosedError):
        be.submit(ids, max_tokens=4)


def test_generate_names_an_unknown_option(engine):
    import pytest

    with pytest.raises(TypeError, match="generate\\(\\) got unexpected keyword argument.*'max_token'"):
        engine.generate("Hi", max_token=4)


def test_engine_counts_merged_drafts_by_source(engine, plain_greedy):
    """A real generation with a merged drafter: an oracle (the plain output's next tokens) and a
    drafter that is always wrong. Output unchanged; every accepted token is the oracle's."""
    from agentspec import Draft, SpecConfig
    from agentspec.drafting import MergedDrafter

    ids = engine.encode("List the numbers from one to twenty, separated by commas.")
    want = plain_greedy(ids, 40).token_ids

    class Oracle:
        def __init__(self, source: str, wrong: bool) -> None:
            self.source, self.wrong, self.done = source, wrong, 0

        def start(self, req_id, prompt, *, tenant="default"):
            self.done = 0

        def extend(self, req_id, tokens):   # committed output tokens (the prefill's first one too)
            self.done += len(tokens)

        def propose(self, req_id, budget):
            nxt = want[self.done:self.done + min(budget, 3)]
            if self.wrong:
                nxt = [t ^ 1 for t in nxt[:1]]
            return Draft.chain(nxt, 0.4 if self.wrong else 0.9, source=self.source)

        def stop(self, req_id):
            pass

    d = MergedDrafter(Oracle("oracle", False), Oracle("wrong", True))
    g = engine.generate(ids, max_tokens=40, drafter=d, spec=SpecConfig(row_cost=0.0))
    s = g.stats
    assert g.token_ids == want
    assert set(s.draft_sources) == {"merged"} and set(s.source_drafted) == {"oracle", "wrong"}
    assert s.source_accepted == {"oracle": s.accepted_tokens, "wrong": 0} and s.accepted_tokens > 20
    assert sum(s.source_drafted.values()) == s.draft_tokens
    # the wrong node is the least likely: cut when the budget is short (the last steps)
    assert s.source_steps["oracle"] == s.draft_sources["merged"] >= s.source_steps["wrong"] > 0


def test_the_bundled_model_reports_and_runs_it(engine, rewrite_prompts, monkeypatch):
    """The engine says which prefill attention ran (start-up line, benchmark JSON), and on a real
    rewrite prompt the AMX path's next token and logits agree with the SDPA path's."""
    import torch

    from agentspec.kernels import cpu_attention

    a = engine.args
    if not cpu_attention.prefill_amx_runs(torch.bfloat16, a.n_heads, a.n_kv_heads):
        pytest.skip("the bf16 kernels are capped below avx512bf16 (or the CPU has no AMX): prompts do not take the AMX path")
    assert engine.kernel_info()["kernel_plan"]["prefill_attention"] == "amx"
    ids = torch.tensor(max(rewrite_prompts, key=len)[:700])

    def last_logits():
        cache = engine.new_cache(768)
        with torch.inference_mode():
            for s in range(0, len(ids), 256):
                e = min(s + 256, len(ids))
                out = engine.model(ids[s:e], torch.arange(s, e), cache, logits_rows=slice(-1, None), prefill=True)
                cache.commit(list(range(e - s)))
        return out[0]

    amx = last_logits()
    settings = engine.model.kernel_settings
    engine.model.set_kernel_settings(settings.with_(prefill_attention="sdpa"))
    try:
        sdpa = last_logits()
    finally:
        engine.model.set_kernel_settings(settings)
    # bf16 rounding differs between the two kernels and compounds over 30 layers: a few percent
    # of the logits' range (a wrong kernel is off by the whole range)
    assert (amx - sdpa).abs().max().item() < 0.05 * sdpa.abs().max().item()
    assert amx.argmax() == sdpa.argmax()
