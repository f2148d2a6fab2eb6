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


def _long_prompt(engine, prompts, chunks: int) -> list[int]:
    """A prompt of ``chunks`` prefill chunks and a few tokens more, from the recorded prompts."""
    from agentspec.decode.step import PREFILL_CHUNKS

    step = engine.chunk_tokens * (PREFILL_CHUNKS if engine.model.prefill_row_invariant(engine.new_cache(64)) else 1)
    ids: list[int] = []
    while len(ids) < chunks * step + 10:
        ids += [t for p in prompts for t in p]
    return ids[:chunks * step + 10]


def test_a_long_prompt_runs_a_chunk_at_a_time_between_the_running_requests_steps(engine, prompts, plain_greedy,
                                                                               step_costs):
    """A long prompt admitted beside running requests does not stop them for its whole prefill: a
    chunk, then their step, in turn; a short prompt admitted after it gets its first token after
    one of its chunks, not all of them. Every output is still plain decoding's."""
    long_ids = _long_prompt(engine, prompts, 4)          # 5 chunks: 4 yields between them
    events: list[tuple[str, int]] = []
    results: dict[str, object] = {}

    def on_done(name):
        def done(g, err):
            results[name] = err or g
        return done

    with BatchEngine(engine, budget_policy="off", step_costs=step_costs, background=False, max_batch=4) as be:
        be.submit(prompts[0], max_tokens=40, on_tokens=lambda t: events.append(("running", len(t))),
                  on_done=on_done("running"))
        # two one-chunk prompts and a long one between them: the short ones go first (fewest tokens left)
        be.submit(long_ids, max_tokens=6, on_tokens=lambda t: events.append(("long", len(t))), on_done=on_done("long"))
        be.submit(prompts[1], max_tokens=6, on_tokens=lambda t: events.append(("short", len(t))),
                  on_done=on_done("short"))
        be.run_until_idle()
    first_long = events.index(next(e for e in events if e[0] == "long"))
    first_short = events.index(next(e for e in events if e[0] == "short"))
    # the running request's steps went on while the long prompt ran (4 chunk boundaries)
    assert sum(1 for e in events[:first_long] if e[0] == "running") >= 4
    assert first_short < first_long
    for name, ids, n in (("running", prompts[0], 40), ("long", long_ids, 6), ("short", prompts[1], 6)):
        g, ref = results[name], plain_greedy(ids, n)
        assert not isinstance(g, BaseException), g
        assert g.token_ids == ref.token_ids, name
        assert g.stats.prompt_tokens == len(ids)


def test_a_request_cancelled_while_its_prompt_runs_ends_before_its_next_chunk(engine, prompts, plain_greedy,
                                                                            step_costs):
    """A client gone during a long prefill frees the server at the next chunk boundary, with no
    tokens; the next request is served as before."""
    long_ids = _long_prompt(engine, prompts, 6)
    calls = []

    def should_stop() -> bool:   # asked at admission, then before each chunk: stop after the first chunk
        calls.append(1)
        return len(calls) >= 3

    got = {}
    with BatchEngine(engine, budget_policy="load_aware", step_costs=step_costs, background=False) as be:
        be.submit(long_ids, max_tokens=8, should_stop=should_stop, on_done=lambda g, e: got.update(g=g, e=e))
        be.run_until_idle()
        assert got["e"] is None
        g = got["g"]
        assert g.finish_reason == "cancelled" and g.token_ids == [] and len(calls) == 3
        assert be.num_running == 0
        after = be.generate_many([prompts[2]], max_tokens=12)[0]
    assert after.token_ids == plain_greedy(prompts[2], 12).token_ids


def test_a_long_prompt_behind_short_ones_runs_after_a_bounded_wait(engine, prompts, step_costs, monkeypatch):
    """Shorter prompts go first, but a prompt passed over ``PREFILL_PASSES`` times runs its next
    chunk anyway: short prompts arriving all the time cannot hold a long one back for ever."""
    monkeypatch.setattr(BatchEngine, "PREFILL_PASSES", 2)
    long_ids = _long_prompt(engine, prompts, 3)          # 4 chunks
    firsts: list[str] = []
    with BatchEngine(engine, budget_policy="off", step_costs=step_costs, background=False, max_batch=16) as be:
        be.submit(long_ids, max_tokens=2, on_tokens=lambda t: firsts.append("long") if "long" not in firsts else None)
        for i in range(10):
            be.submit(prompts[i % len(prompts)], max_tokens=2,
                      on_tokens=lambda t, i=i: firsts.append(i) if i not in firsts else None)
        be.run_until_idle()
    # passed over twice, a chunk of its own, and so on: its 4 chunks end after at most 2 * 4 short prompts
    assert firsts.index("long") <= 2 * 4
    assert firsts[0] != "long" and len(firsts) == 11
