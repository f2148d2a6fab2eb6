"""Continuous batching: greedy outputs under batching equal single-request plain decoding, for
every budget policy, with requests joining and leaving mid-run."""

from __future__ import annotations

import threading
import time

import pytest

from agentspec.backends.embedded.batch import BatchEngine, lower_convex_hull, select_slots

pytestmark = pytest.mark.slow

MAX_TOKENS = 64


def _wait_until(cond, timeout: float) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


@pytest.fixture(scope="module")
def step_costs(engine):
    # profiled once for the module (each BatchEngine would otherwise profile at start-up); no
    # scheduler thread, so a cache miss measures it here rather than handing out the stand-in
    with BatchEngine(engine, background=False) as be:
        costs = be.step_costs
    assert set(costs) >= {2, 33, 264} and all(v > 0 for v in costs.values())
    return costs


@pytest.fixture(scope="module")
def prompts(rewrite_prompts, chat_prompts):
    return rewrite_prompts[:5] + chat_prompts[:3]


@pytest.fixture(scope="module")
def reference(plain_greedy, prompts):
    return [plain_greedy(p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("policy", ["off", "fixed", "load_aware"])
def test_batched_greedy_equals_single_request_plain(engine, prompts, reference, step_costs, policy):
    with BatchEngine(engine, budget_policy=policy, step_costs=step_costs, background=False) as be:
        out = be.generate_many(prompts, max_tokens=MAX_TOKENS)
    bad = [i for i, (a, r) in enumerate(zip(out, reference)) if a.token_ids != r.token_ids]
    assert not bad, f"batched ({policy}) output differs from plain decoding on prompts {bad}"
    assert [a.text for a in out] == [r.text for r in reference]
    assert [a.finish_reason for a in out] == [r.finish_reason for r in reference]
    for g in out:
        assert len(g.stats.draft_depths) == g.stats.steps == len(g.stats.acceptance_lengths)
    if policy == "off":
        assert all(g.stats.draft_tokens == 0 and not g.stats.spec_enabled for g in out)
        assert "off" in out[0].stats.spec_reason
    else:
        rewrites = out[:5]
        assert sum(g.stats.accepted_tokens for g in rewrites) > 0
        assert sum(g.stats.steps for g in rewrites) < sum(r.stats.steps for r in reference[:5])


def test_requests_join_and_leave_mid_run(engine, prompts, reference, step_costs):
    """Requests arrive while others run, with different lengths; each gets its own output."""
    lengths = [MAX_TOKENS, 9, MAX_TOKENS, 20, 3, MAX_TOKENS, 33, 17]
    results: dict[int, object] = {}
    streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    done = threading.Event()
    with BatchEngine(engine, budget_policy="load_aware", step_costs=step_costs, max_batch=4) as be:
        def submit(i):
            def on_done(g, err, i=i):
                results[i] = err or g
                if len(results) == len(prompts):
                    done.set()
            be.submit(prompts[i], max_tokens=lengths[i], on_tokens=streamed[i].extend, on_done=on_done)

        for i in range(3):
            submit(i)
        assert _wait_until(lambda: be.steps >= 3, 60)
        for i in range(3, len(prompts)):  # each joins at a later step than the one before
            at = be.steps
            submit(i)
            assert _wait_until(lambda: be.steps > at or done.is_set(), 60)
        assert done.wait(300)
    for i, ref in enumerate(reference):
        g = results[i]
        assert not isinstance(g, BaseException), g
        n = lengths[i]
        assert g.token_ids == ref.token_ids[:n], f"prompt {i}"
        assert streamed[i] == g.token_ids


def test_finished_requests_caches_serve_the_next_ones(engine, prompts, reference, step_costs, monkeypatch):
    """Two slots for eight requests: a request that joins takes a finished one's KV cache (stale
    keys and values past its own slots included) and still decodes exactly as alone."""
    made = []
    new_cache = engine.new_cache
    monkeypatch.setattr(engine, "new_cache", lambda cap: made.append(cap) or new_cache(cap))
    with BatchEngine(engine, budget_policy="load_aware", step_costs=step_costs, max_batch=2, background=False) as be:
        out = be.generate_many(prompts, max_tokens=MAX_TOKENS)
        assert be._free_caches == []       # idle at the end: nothing kept
    assert [g.token_ids for g in out] == [r.token_ids for r in reference]
    assert len(made) < len(prompts) - 2    # most requests ran on a cache another had used
    assert sum(g.stats.accepted_tokens for g in out) > 0


def test_cancel_and_bad_input(engine, prompts, step_costs):
    stop = threading.Event()
    finished = threading.Event()
    got = {}

    def on_done(g, e):
        got["g"] = g
        finished.set()

    with BatchEngine(engine, step_costs=step_costs) as be:
        be.submit(prompts[0], max_tokens=500, should_stop=stop.is_set,
                  on_tokens=lambda t: stop.set(), on_done=on_done)
        assert finished.wait(60)
        with pytest.raises(ValueError, match="max_tokens"):
            be.submit(prompts[0], max_tokens=0)
        with pytest.raises(ValueError, match="budget"):
            BatchEngine(engine, budget_policy="greedy", step_costs=step_costs)
    g = got["g"]
    assert g.finish_reason == "cancelled" and 0 < len(g.token_ids) < 500


def test_the_step_cost_model_learns_from_the_steps_it_runs(engine, prompts, reference, step_costs):
    """Every decode step the scheduler runs is told to the cost model (rows, context, seconds):
    the budget then weighs slots with the corrected curve at the step's context. With
    ``live_costs=False`` the profile alone decides, whatever ran."""
    with BatchEngine(engine, step_costs=step_costs, background=False) as be:
        out = be.generate_many(prompts[:4], max_tokens=24)
        assert be.steps > 0 and be.costs.observed == be.steps
        ctx = len(prompts[0])
        learnt = [be.step_cost(n, ctx) for n in (4, 16, 33)]
        assert learnt != [be.step_cost(n) for n in (4, 16, 33)]
        assert all(x > 0 for x in learnt)
    assert [g.token_ids for g in out] == [r.token_ids[:24] for r in reference[:4]]
    with BatchEngine(engine, step_costs=step_costs, background=False, live_costs=False) as be:
        be.generate_many(prompts[:2], max_tokens=8)
        assert [be.step_cost(n, len(prompts[0])) for n in (4, 16)] == [be.step_cost(n) for n in (4, 16)]


def test_select_slots_keeps_global_top_b():
    costs = {2: 1.0, 64: 1.0 + 62 * 0.01}

    def cost(rows, c=costs):
        return c[2] + (c[64] - c[2]) * (rows - 2) / 62

    # the best slots across requests, each request's slots taken as a prefix
    surv = [[0.9, 0.8, 0.1], [0.95, 0.05], [], [0.7, 0.6, 0.5, 0.02]]
    keep = select_slots(surv, 4, 4.0, cost)
    assert keep == [3, 1, 0, 3]  # 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.1: the 0.05 and 0.02 slots cost more than they yield
    # steep costs: plain decoding wins (B = 0)
    assert select_slots(surv, 4, 4.0, lambda rows: float(rows)) == [0, 0, 0, 0]
    # free rows: everything
    assert select_slots(surv, 4, 4.0, lambda rows: 1.0) == [3, 2, 0, 4]
    # a prefix even when a later slot is better than an earlier one
    assert select_slots([[0.1, 0.9]], 2, 1.0, lambda rows: 1.0 + 0.01 * rows) == [2]


def test_step_cost_profile_loses_its_noise_spikes():
    # the profile that made the load-aware budget over-draft at 16 requests (2026-11-30)
    seen = {2: 13.6, 8: 18.2, 16: 39.5, 33: 51.3, 66: 89.4, 132: 172.3, 264: 324.6}
    hull = lower_convex_hull(seen)
    # past 8 rows the hull is the 8-264 chord (~1.2 ms a row): every point between lies above it
    assert hull[16] == pytest.approx(18.2 + (324.6 - 18.2) * 8 / 256)
    assert all(hull[n] == seen[n] for n in (2, 8, 264))               # hull points stay
    assert all(hull[n] <= seen[n] for n in seen)
    xs = sorted(hull)
    slopes = [(hull[b] - hull[a]) / (b - a) for a, b in zip(xs, xs[1:])]
    assert all(b >= a - 1e-9 for a, b in zip(slopes, slopes[1:]))     # convex
    assert lower_convex_hull({2: 1.0}) == {2: 1.0}
    assert lower_convex_hull({2: 1.0, 8: 2.0}) == {2: 1.0, 8: 2.0}


def test_batched_kernel_verification_equals_reference(engine, prompts, reference, step_costs):
    """The engine's CUDA path (greedy verification of all requests at once with agentspec.kernels),
    here on CPU through the kernels' torch reference."""
    with BatchEngine(engine, step_costs=step_costs, background=False, verify="batched") as be:
        out = be.generate_many(prompts, max_tokens=MAX_TOKENS)
    assert [g.token_ids for g in out] == [r.token_ids for r in reference]
    assert sum(g.stats.accepted_tokens for g in out) > 0
    with pytest.raises(ValueError, match="verify"):
        BatchEngine(engine, step_costs=step_costs, verify="fast")
