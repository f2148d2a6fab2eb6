"""The step-cost model behind the load-aware budget: a start-up profile, refreshed by live steps.

``select_slots`` (continuous batching) weighs the tokens a step's draft slots are expected to add
against what the step costs with them: ``cost(rows)``, seconds of one decode step verifying
``rows`` rows. The start-up profile measures that once (one forward per row count, at one
context, on an idle machine). The steps the engine then runs say more: their contexts, the
kernels' real cost at those row counts, what drafting and committing add per step, how busy the
machine is. ``StepCostModel`` keeps the profile as a prior and learns a correction from the
steps it is told about (``observe``):

- corrections are kept per (row count, context) cell: rows on the profile's grid, contexts in
  power-of-two buckets; a cell's correction is a log factor on the prior at its grid point;
- each observation moves the two cells around its row count by a least-mean-squares step
  (rate ``alpha``, each cell by its share of the interpolated prediction) on the error
  ``log(observed / predicted)``, clipped to ``log(clip)`` first: one step that a page fault or
  another process stretched 10x moves the estimate as one ``clip``-fold step would, and a
  lasting change still wins after a few steps;
- a context bucket also keeps the mean correction of all its steps (the same clipped rule); a
  cell never observed takes it, and a cell observed for the first time starts from it. A
  bucket's mean leans on the prior (no correction) until it has a few observations: weight
  ``n / (n + warm)``;
- ``cost(rows, context)`` is the prior's curve times the corrections, lowered onto its lower
  convex hull (``lower_convex_hull``), interpolated linearly between grid points and past them.

It also keeps ``offset``: what the latest steps took beyond the prior at their row counts, in
seconds (an exponentially weighted mean, each observation clipped as above). At high batch that
is mostly the requests' KV read, once per request per step however many rows each verifies, so
it adds to a step whatever its rows: ``extra_cost(rows)`` = the prior + the offset is what the
load-aware budget weighs draft rows with. (The per-cell factors cannot say it: at a batch whose
steps always carry drafts the draft-free row count is never observed, and the hull pulls its
cell down towards the small row counts the batch never runs.)

A verified row also attends over its request's whole context, so a row costs more at 4k tokens
than the profile's 1k says (measured on the 1.5B: ~12 against ~7 ms a row). ``row_context_cost``
(seconds per row per token of context, measured at start-up: ``step_profile``) prices that:
``extra_cost(rows, context)`` adds ``row_context_cost * rows * (context - prior_context)``, and
the offset learns what is left beyond it.

Torch-free and clock-free: the caller times its steps and passes seconds in, so tests feed it
synthetic timings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["StepCostModel", "interpolate", "lower_convex_hull"]


def lower_convex_hull(costs: Mapping[int, float]) -> dict[int, float]:
    """A step-cost profile with each point lowered onto the profile's lower convex hull.

    Timing noise on a shared machine only ever adds time, and a forward's cost is convex in its
    row count (fixed weight streaming, then compute-bound rows), so a point above the hull of
    its neighbours is noise. Left in, such a point makes the rows just past it look cheap and
    the load-aware budget over-drafts (seen: 16 rows profiled at 39.5 ms between 8 rows at 18.2
    and 33 rows at 51.3; the hull puts it at 27.8, and a same-process measurement gave 29.5)."""
    pts = sorted(costs.items())
    hull: list[tuple[int, float]] = []
    for x, y in pts:
        # pop while the last hull point lies on or above the segment from its predecessor to (x, y)
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0]) >= (y - hull[-2][1]) * (
                hull[-1][0] - hull[-2][0]):
            hull.pop()
        hull.append((x, y))
    out = {}
    for x, y in pts:
        for (x0, y0), (x1, y1) in zip(hull, hull[1:]):
            if x0 <= x <= x1:
                out[x] = min(y, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
                break
        else:
            out[x] = y
    return out


def interpolate(grid: list[int], costs: Mapping[int, float], rows: float) -> float:
    """``costs`` (on the ascending ``grid``) at ``rows``: linear between grid points, the first
    point below the grid, linear extrapolation of the last two points above it."""
    if rows <= grid[0] or len(grid) == 1:
        return costs[grid[0]]
    for a, b in zip(grid, grid[1:]):
        if rows <= b:
            return costs[a] + (costs[b] - costs[a]) * (rows - a) / (b - a)
    a, b = grid[-2], grid[-1]
    return costs[b] + (costs[b] - costs[a]) * (rows - b) / (b - a)


class _Mean:
    """An exponentially weighted mean of log ratios, with its observation count."""

    __slots__ = ("mean", "n")

    def __init__(self, mean: float = 0.0) -> None:
        self.mean = mean
        self.n = 0.0


class StepCostModel:
    """Seconds of a decode step by rows verified and context, from a prior profile and live steps.

    prior: {rows: seconds} (the start-up profile, or a stand-in in other units; ``set_prior``
      replaces it and forgets what was observed, which was relative to the old one).
    alpha: learning rate: the weight of the newest observation (0.2: a lasting change is mostly
      learnt within ~10 steps around those rows).
    clip: the most one observation can say, as a factor (2: a 10x outlier counts as 2x).
    warm: observations before a context bucket's mean counts as much as the prior.
    """

    CONTEXT_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

    def __init__(self, prior: Mapping[int, float], *, alpha: float = 0.2, clip: float = 2.0,
                 warm: float = 4.0) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if not clip > 1.0:
            raise ValueError(f"clip must be > 1, got {clip!r}")
        if not warm >= 0.0:
            raise ValueError(f"warm must be >= 0, got {warm!r}")
        self.alpha, self.log_clip, self.warm = float(alpha), math.log(clip), float(warm)
        self._cells: dict[tuple[int, int], _Mean] = {}     # (context bucket, grid rows) -> mean
        self._buckets: dict[int, _Mean] = {}                # context bucket -> mean
        self._curves: dict[int, dict[int, float]] = {}      # context bucket -> corrected, hulled curve
        self.observed = 0                                   # observations since the prior was set
        self.offset = 0.0                                   # seconds beyond the prior, recent steps
        self.row_context_cost = 0.0                         # seconds per row per token of context
        self.prior_context = 0.0                            # the context the prior was measured at
        self.set_prior(prior)

    def set_prior(self, prior: Mapping[int, float]) -> None:
        if not prior or any(not (isinstance(r, int) and r > 0) for r in prior) or \
                any(not (c > 0 and math.isfinite(c)) for c in prior.values()):
            raise ValueError(f"prior must map row counts > 0 to finite seconds > 0, got {dict(prior)!r}")
        self.grid = sorted(prior)
        self.prior = {r: float(prior[r]) for r in self.grid}
        self._cells.clear()
        self._buckets.clear()
        self._curves.clear()
        self.observed = 0
        self.offset = 0.0

    @classmethod
    def bucket(cls, context: float) -> int:
        """The context bucket of a step whose requests hold ``context`` tokens each (on average)."""
        for b in cls.CONTEXT_BUCKETS:
            if context <= b:
                return b
        return cls.CONTEXT_BUCKETS[-1]

    def observe(self, rows: int, context: float, seconds: float) -> None:
        """A step verified ``rows`` rows (every request's root and draft tokens) over requests of
        ``context`` cached tokens (their mean) and took ``seconds``."""
        if rows <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return   # nothing to learn (a clock that did not move, a bad reading)
        b = self.bucket(context)
        x = math.log(seconds)
        clip = self.log_clip
        # the bucket: its mean log ratio to the prior
        bucket = self._buckets.setdefault(b, _Mean())
        e = x - math.log(interpolate(self.grid, self.prior, rows)) - bucket.mean
        bucket.mean += self.alpha * max(-clip, min(clip, e))
        bucket.n += 1
        # the cells: a least-mean-squares step on the log of what ``cost`` predicts here (the
        # correction interpolated between the two grid points around ``rows``), each cell by its
        # share of the prediction; a cell seen for the first time starts from its bucket's mean
        near = self._neighbours(rows)
        base = self._bucket_log(b)
        cells = [self._cells.get((b, g)) or self._cells.setdefault((b, g), _Mean(base)) for g, _ in near]
        pred = math.log(sum(w * self.prior[g] * math.exp(c.mean) for (g, w), c in zip(near, cells)))
        e = max(-clip, min(clip, x - pred))
        for (g, w), c in zip(near, cells):
            c.mean += self.alpha * w * e
            c.n += w
        self._curves.pop(b, None)
        # the additive offset: the same rate, an error clipped to what ``clip`` allows at these rows
        p = self._base(rows, context)
        lim = p * (math.exp(clip) - 1.0)
        self.offset = max(self.offset + self.alpha * max(-lim, min(lim, seconds - p - self.offset)), -p)
        self.observed += 1

    def cost(self, rows: float, context: float | None = None) -> float:
        """Seconds of a step of ``rows`` rows; ``context`` None: the prior alone."""
        if context is None:
            return interpolate(self.grid, self.prior, rows)
        return interpolate(self.grid, self.curve(context), rows)

    def curve(self, context: float) -> dict[int, float]:
        """{grid rows: seconds} at ``context``: the prior times the learnt corrections, hulled."""
        b = self.bucket(context)
        c = self._curves.get(b)
        if c is None:
            base = self._bucket_log(b)
            raw = {}
            for g in self.grid:
                cell = self._cells.get((b, g))
                raw[g] = self.prior[g] * math.exp(base if cell is None else cell.mean)
            c = self._curves[b] = lower_convex_hull(raw)
        return c

    def set_row_context_cost(self, seconds_per_row_token: float, prior_context: float) -> None:
        """What a verified row's attention adds per token of its request's context
        (``seconds_per_row_token``), and the context the prior was measured at. The offset learnt
        so far was relative to the old pricing: forgotten."""
        if not (seconds_per_row_token >= 0.0 and math.isfinite(seconds_per_row_token)) or not prior_context >= 0:
            raise ValueError(f"row context cost must be finite and >= 0, got {seconds_per_row_token!r} at "
                             f"context {prior_context!r}")
        self.row_context_cost, self.prior_context = float(seconds_per_row_token), float(prior_context)
        self.offset = 0.0

    def extra_cost(self, rows: float, context: float | None = None) -> float:
        """Seconds of a step of ``rows`` rows as the latest steps say: the prior at ``rows``, the
        rows' attention beyond the prior's context at ``context`` (requests' mean), plus
        ``offset`` (what those steps took beyond that at theirs)."""
        return max(self._base(rows, context) + self.offset, 1e-9)

    def _base(self, rows: float, context: float | None) -> float:
        """The prior at ``rows``, its rows' attention moved to ``context`` (at least a tenth of the
        prior: a context far below the prior's prices no row below zero)."""
        p = interpolate(self.grid, self.prior, rows)
        if context is None or not self.row_context_cost:
            return p
        return max(p + self.row_context_cost * rows * (context - self.prior_context), 0.1 * p)

    def correction(self, rows: int, context: float) -> float:
        """The learnt factor at (``rows``, ``context``): ``cost`` over the prior's (1.0: none)."""
        return self.cost(rows, context) / self.cost(rows)

    # ---- helpers ------------------------------------------------------------------------------

    def _bucket_log(self, b: int) -> float:
        m = self._buckets.get(b)
        if m is None or m.n == 0:
            return 0.0
        w = m.n / (m.n + self.warm) if self.warm else 1.0
        return w * m.mean

    def _neighbours(self, rows: int) -> list[tuple[int, float]]:
        """The grid points an observation at ``rows`` informs, with weights summing to 1."""
        g = self.grid
        if rows <= g[0]:
            return [(g[0], 1.0)]
        if rows >= g[-1]:
            return [(g[-1], 1.0)]
        for a, b in zip(g, g[1:]):
            if rows <= b:
                t = (rows - a) / (b - a)
                return [(a, 1.0 - t), (b, t)] if 0.0 < t < 1.0 else [(b if t >= 1.0 else a, 1.0)]
        return [(g[-1], 1.0)]
