"""The live step-cost model behind the load-aware budget (agentspec.decode.costs), on synthetic timings."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.backends.embedded.batch import select_slots
from agentspec.decode.costs import StepCostModel, interpolate, lower_convex_hull

GRID = (2, 8, 16, 33, 66, 132, 264)
# a profile in which every row costs a tenth of a one-row step
PRIOR = {n: 1.0 + 0.1 * (n - 1) for n in GRID}


def feed(model: StepCostModel, truth, *, context: float, steps: int, rows=range(2, 100), seed: int = 0,
         noise: float = 0.0) -> None:
    """``steps`` observations at random row counts of ``rows``, each taking ``truth(rows)`` seconds
    (times a random factor in [1, 1 + noise]: timing noise only adds)."""
    rng = random.Random(seed)
    rows = list(rows)
    for _ in range(steps):
        n = rng.choice(rows)
        model.observe(n, context, truth(n) * (1.0 + noise * rng.random()))


def test_without_observations_the_prior_is_the_cost():
    m = StepCostModel(PRIOR)
    for n in (1, 2, 5, 8, 20, 264, 400):
        assert m.cost(n) == interpolate(sorted(PRIOR), PRIOR, n)
        assert m.cost(n, 1000) == pytest.approx(m.cost(n))
    assert m.cost(400) == pytest.approx(PRIOR[264] + (PRIOR[264] - PRIOR[132]) * (400 - 264) / 132)  # extrapolated
    assert m.correction(8, 1000) == pytest.approx(1.0)


def test_learns_cheaper_rows_and_the_budget_follows():
    """Rows got 5x cheaper than profiled (new kernels, say): the model learns the curve's shape,
    and the load-aware budget verifies more of the same drafts."""
    m = StepCostModel(PRIOR)
    surv = [[0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1]] * 8   # 8 requests' drafts

    def budget(context):
        return sum(select_slots(surv, 8, 8.0, lambda rows: m.cost(rows, context)))

    before = budget(1000)
    truth = lambda n: 0.5 * (1.0 + 0.02 * (n - 1))  # noqa: E731 - other units, other slope
    feed(m, truth, context=1000, steps=400)
    for n in (8, 16, 33, 66):
        # the shape is what select_slots reads: cost(n) / cost(8)
        assert m.cost(n, 1000) / m.cost(8, 1000) == pytest.approx(truth(n) / truth(8), rel=0.05)
    after = budget(1000)
    assert after > before
    assert budget(3000) == before          # another context bucket has seen nothing: still the prior


def test_dearer_rows_shrink_the_budget():
    """The machine got busier in a way that makes every row dearer (rows cost 3x what was
    profiled relative to the step's fixed part): the budget verifies fewer slots."""
    m = StepCostModel(PRIOR)
    surv = [[0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1]] * 8
    before = sum(select_slots(surv, 8, 8.0, lambda rows: m.cost(rows, 1000)))
    feed(m, lambda n: 1.0 + 0.3 * (n - 1), context=1000, steps=400)
    after = sum(select_slots(surv, 8, 8.0, lambda rows: m.cost(rows, 1000)))
    assert 0 < before and after < before


def test_one_outlier_moves_the_estimate_by_at_most_the_clip():
    m = StepCostModel(PRIOR, alpha=0.2, clip=2.0)
    truth = lambda n: 2.0 * PRIOR[n]  # noqa: E731
    for _ in range(100):
        m.observe(16, 1000, truth(16))
    settled = m.cost(16, 1000)
    assert settled == pytest.approx(truth(16), rel=0.05)
    m.observe(16, 1000, 20 * truth(16))          # a step stretched 20x (a page fault, another process)
    assert settled < m.cost(16, 1000) <= settled * 2.0 ** 0.2 * 1.0001
    for _ in range(30):                            # and it is forgotten
        m.observe(16, 1000, truth(16))
    assert m.cost(16, 1000) == pytest.approx(settled, rel=0.01)


def test_a_lasting_change_wins_despite_the_clip():
    m = StepCostModel(PRIOR)
    for _ in range(50):
        m.observe(16, 1000, PRIOR[16])
    for _ in range(60):
        m.observe(16, 1000, 10 * PRIOR[16])
    assert m.cost(16, 1000) == pytest.approx(10 * PRIOR[16], rel=0.1)


def test_cold_cells_lean_on_their_context_bucket():
    """Steps seen only around 16 rows: the other row counts of that context take the bucket's
    mean correction (a busier machine slows every step), not the bare prior."""
    m = StepCostModel(PRIOR, warm=4.0)
    for _ in range(100):
        m.observe(16, 1000, 3.0 * PRIOR[16])
    assert m.correction(132, 1000) == pytest.approx(3.0, rel=0.05)
    assert m.correction(132, 100) == pytest.approx(1.0)      # another bucket: none


def test_between_grid_points_both_neighbours_learn():
    m = StepCostModel(PRIOR)
    for _ in range(200):
        m.observe(24, 1000, 2.0 * interpolate(sorted(PRIOR), PRIOR, 24))
    assert m.correction(16, 1000) == pytest.approx(2.0, rel=0.05)
    assert m.correction(33, 1000) == pytest.approx(2.0, rel=0.05)
    assert m.cost(24, 1000) == pytest.approx(2.0 * interpolate(sorted(PRIOR), PRIOR, 24), rel=0.05)


def test_set_prior_forgets_what_was_relative_to_the_old_one():
    m = StepCostModel({n: float(n) for n in GRID})    # a stand-in, in its own units
    feed(m, lambda n: 0.01 * n, context=500, steps=50)
    assert m.observed == 50
    m.set_prior(PRIOR)
    assert m.observed == 0 and m.cost(16, 500) == pytest.approx(PRIOR[16])


def test_bad_readings_are_ignored_and_bad_settings_refused():
    m = StepCostModel(PRIOR)
    for seconds in (0.0, -1.0, math.nan, math.inf):
        m.observe(8, 1000, seconds)
    m.observe(0, 1000, 1.0)
    assert m.observed == 0 and m.cost(8, 1000) == pytest.approx(PRIOR[8])
    for kw in ({"alpha": 0.0}, {"alpha": 1.5}, {"clip": 1.0}, {"warm": -1.0}):
        with pytest.raises(ValueError):
            StepCostModel(PRIOR, **kw)
    for prior in ({}, {0: 1.0}, {2: 0.0}, {2: math.nan}):
        with pytest.raises(ValueError, match="prior"):
            StepCostModel(prior)


def test_context_buckets():
    b = StepCostModel.bucket
    assert b(0) == b(256) == 256 and b(257) == 512 and b(1000) == 1024 and b(5000) == 8192
    assert b(10 ** 9) == StepCostModel.CONTEXT_BUCKETS[-1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.sampled_from([100, 1000, 3000]), st.floats(1e-3, 50.0)),
                max_size=60))
def test_every_curve_is_convex_and_positive(observations):
    m = StepCostModel(PRIOR)
    for rows, ctx, sec in observations:
        m.observe(rows, ctx, sec)
    for ctx in (100, 1000, 3000):
        c = m.curve(ctx)
        assert c == pytest.approx(lower_convex_hull(c))
        assert all(v > 0 for v in c.values())
        xs = sorted(c)
        slopes = [(c[b] - c[a]) / (b - a) for a, b in zip(xs, xs[1:])]
        assert all(s2 >= s1 - 1e-9 * max(1.0, abs(s1)) for s1, s2 in zip(slopes, slopes[1:]))


def test_offset_adds_what_the_steps_take_beyond_the_prior_whatever_their_rows():
    m = StepCostModel(PRIOR)
    assert m.offset == 0.0 and m.extra_cost(16) == pytest.approx(PRIOR[16])
    feed(m, lambda n: interpolate(sorted(PRIOR), PRIOR, n) + 5.0, context=900, steps=100, rows=range(30, 60))
    assert m.offset == pytest.approx(5.0, rel=0.02)                     # learnt where the steps ran ...
    assert m.extra_cost(2) == pytest.approx(PRIOR[2] + 5.0, rel=0.02)   # ... and added at every row count
    assert m.extra_cost(66) - m.extra_cost(33) == pytest.approx(PRIOR[66] - PRIOR[33])
    before = m.offset
    m.observe(40, 900, 1000.0)          # one step stretched ~100x moves it by at most alpha * (clip - 1) * prior
    assert m.offset - before <= m.alpha * interpolate(sorted(PRIOR), PRIOR, 40) + 1e-9
    m.set_prior(PRIOR)
    assert m.offset == 0.0


def test_rows_over_a_longer_context_cost_their_attention_there():
    """Each verified row attends over its request's context: with the per-row-token cost set,
    a draft row at 4k tokens costs its profiled price plus 3k tokens of attention, the offset
    learns only what is left beyond that, and the budget takes fewer slots there than at 1k."""
    a = 0.1 / 1024                                   # a row's attention at 1k = the profile's whole row
    m = StepCostModel(PRIOR)
    m.set_row_context_cost(a, 1024)
    assert m.extra_cost(16, 1024) == pytest.approx(PRIOR[16])
    assert m.extra_cost(16) == pytest.approx(PRIOR[16])                  # no context given: the prior
    assert m.extra_cost(33, 4096) - m.extra_cost(16, 4096) == pytest.approx(
        PRIOR[33] - PRIOR[16] + a * 17 * 3072)
    assert m.extra_cost(16, 64) >= 0.1 * PRIOR[16]                        # never priced below a tenth
    # steps that take exactly that at 4k (plus a fixed 2 s of KV reads): the offset learns the 2 s
    truth = lambda n: interpolate(sorted(PRIOR), PRIOR, n) + a * n * 3072 + 2.0  # noqa: E731
    feed(m, truth, context=4096, steps=100, rows=range(4, 40))
    assert m.offset == pytest.approx(2.0, rel=0.02)
    assert m.extra_cost(10, 4096) == pytest.approx(truth(10), rel=0.01)
    surv = [[0.25] * 8 for _ in range(4)]
    at_1k = sum(select_slots(surv, 4, 4.0, lambda r: m.extra_cost(r, 1024)))
    at_4k = sum(select_slots(surv, 4, 4.0, lambda r: m.extra_cost(r, 4096)))
    assert at_4k < at_1k
    with pytest.raises(ValueError):
        m.set_row_context_cost(-1.0, 1024)
    m.set_row_context_cost(a, 1024)
    assert m.offset == 0.0                                               # relative to the old pricing: forgotten
