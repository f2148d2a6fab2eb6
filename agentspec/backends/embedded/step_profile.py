"""The step-cost profile: seconds for one forward of n decode/verify rows over a cached context,
measured on this machine and cached on disk per machine, build and model (``profile_cache``).

One curve, one cache entry (``"step_costs"``), two readers:

- the engine's **row cost** (``row_cost``): one more verified row relative to a plain decoding
  step, ``(t(33) - t(b)) / ((33 - b) * t(b))`` with ``b`` the rows of a plain step (1 where a
  row's bits do not depend on the forward's other rows, else 2). Single-request decoding cuts
  drafts with it from the first request, so on a miss the engine measures these two points at
  start-up (a few seconds, mostly the context's prefill) and stores them;
- the batch scheduler's **step costs** (``BatchEngine.step_costs``): the whole ``GRID``, for the
  load-aware budget, and what a verified row's attention adds per token of context
  (``row_context_cost``: a row and ``ROW_COST_ROWS`` timed at ``SHORT_CONTEXT`` and at
  ``LONG_CONTEXT`` one after the other, its own cache entry), so the budget prices rows over a
  4k-token history at what they cost there, not at the 1k profile's price. The points still missing are measured
  one forward at a time in the scheduler's idle time (``StepProfile.pending``) and the complete profile stored; a complete
  cached profile is checked against two of its points timed again (``CHECK``).

Each point is the fastest of ``REPEAT`` runs after one untimed run: the fastest is the least
disturbed by other work on a shared machine (a median swung 0.024-0.055 between two starts).
Not a second thread: it would time its forwards against requests on the same cores, and a
second thread running OpenMP teams throttles libgomp for the scheduler's.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import torch

from ...kernels.tree import tree_mask
from . import profile_cache
from .model import round_up

__all__ = ["CHECK", "CONTEXT", "GRID", "LONG_CONTEXT", "REPEAT", "ROW_COST_ROWS", "SHORT_CONTEXT", "StepProfile", "measure",
           "plausible", "profile", "row_context_cost_of", "row_cost_of", "stand_in"]

GRID = (1, 2, 8, 16, 33, 66, 132, 264)   # rows per forward (segments of up to 33 rows)
CONTEXT = 1024                            # tokens cached per segment
# the two contexts of ``row_context_cost`` (LONG_CONTEXT capped by the engine's): between 256 and
# 1,024 keys a row's attention grew less than the timing noise (measured 0 on the 1.5B, whose rows
# cost ~7.3 ms at 3k against ~6.0 at 1k)
SHORT_CONTEXT = 256
LONG_CONTEXT = 4096
REPEAT = 3                                # timed runs per point (after one untimed)
ROW_COST_ROWS = 33                        # the row cost's draft-sized step
CHECK = (2, 33)                           # a cached profile's points timed again
CHECK_TOLERANCE = 1.5
ATTEMPTS = 3                              # measurements before an implausible one is used (never stored)
PREFILLED = 64                            # context tokens a measurement prefills (the rest: written)

Measurement = Generator[None, None, Any]


def plausible(costs: Mapping[int, float], slack: float = 1.25) -> bool:
    """Whether a measured profile can be this machine's idle curve: a forward with more rows
    never runs much faster (each point at least 1/``slack`` of the one before). Other work on
    the cores makes some points several times too slow (seen: 317 ms at 2 rows, 230 at 8; 36,
    135, 248 then 59 ms at 33), a shape no idle machine gives; kept, it sets the draft rows'
    price for every later start."""
    pts = [costs[n] for n in sorted(costs)]
    return all(b >= a / slack for a, b in zip(pts, pts[1:]))


def row_cost_of(costs: Mapping[int, float], base: int, rows: int = ROW_COST_ROWS) -> float | None:
    """One more verified row relative to a ``base``-row step, from two points of a profile
    (None when either is missing), clamped to [0, 1]."""
    if base not in costs or rows not in costs or rows <= base or costs[base] <= 0:
        return None
    return float(min(max((costs[rows] - costs[base]) / ((rows - base) * costs[base]), 0.0), 1.0))


def row_context_cost_of(short: Mapping[int, float], long: Mapping[int, float], base: int, short_context: int,
                        long_context: int, rows: int = ROW_COST_ROWS) -> float:
    """Seconds a verified row's attention adds per token of context: the marginal row of a
    ``base``-row step (``rows - base`` more rows) at two contexts, its growth per token.
    Clamped to [0, the marginal row at ``long_context`` / ``long_context``]: noise never makes
    rows cheaper at longer contexts, nor more than all of a row's cost attention."""
    if long_context <= short_context or any(n not in m for n in (base, rows) for m in (short, long)) or rows <= base:
        return 0.0
    row_short = (short[rows] - short[base]) / (rows - base)
    row_long = (long[rows] - long[base]) / (rows - base)
    if not row_long > 0:
        return 0.0
    a = (row_long - row_short) / (long_context - short_context)
    return float(min(max(a, 0.0), row_long / long_context))


def stand_in(row_cost: float, grid: Sequence[int] = GRID) -> dict[int, float]:
    """A step-cost curve from a row cost, in units of a one-row step, until the profile is
    complete: ``1 + row_cost * (n - 1)`` up to 33 rows (the row cost is measured at 33 rows),
    then proportional to the rows (compute-bound: every row costs a 33-row step's average),
    which lies at or above the measured CPU curves past 33 rows, so the load-aware budget
    drafts less rather than more. ``select_slots`` only compares ratios."""
    rc = min(max(float(row_cost), 0.0), 1.0)
    c33 = 1.0 + 32.0 * rc
    return {n: (1.0 + rc * (n - 1)) if n <= 33 else c33 * n / 33.0 for n in grid}


def measure(engine, grid: Sequence[int], context: int, repeat: int) -> Measurement:
    """Time one forward of n rows for each n in ``grid`` (segments of up to 33 rows, each over
    ``context`` cached tokens), the fastest of ``repeat`` runs after an untimed one. A generator:
    it yields after each forward (and after filling the cache), so a scheduler can run requests
    in between, and returns ``{rows: seconds}``."""
    from .model import Segment

    dev = engine.device
    context = min(context, engine.max_context - 64)
    cache = engine.new_cache(round_up(context + 64, 256))
    # The first PREFILLED tokens go through a real prefill (it warms the prompt path up: start()
    # runs this as the first forwards of a process); the rest of the context's keys and values
    # are written straight into the cache: no attention kernel's time depends on the values
    # (no data-dependent path; random bfloat16-representable values, no subnormals), and a
    # prefill of the whole context would take longer than the measurement itself (seconds for
    # a 1.5B model on 2 cores, at every start that checks a cached profile).
    warm = min(context, PREFILLED)
    ids = torch.arange(100, 100 + warm, device=dev) % engine.args.vocab_size
    with torch.inference_mode():  # never across a yield: the scheduler runs in between
        engine.model(ids, torch.arange(warm, device=dev), cache, logits_rows=slice(-1, None))
        cache.commit(list(range(warm)))
    yield
    if context > warm:
        g = torch.Generator().manual_seed(0)
        n_layers, n_kv, _, head_dim = cache.k.shape
        with torch.inference_mode():
            k, v = ((torch.randn(n_layers, n_kv, context - warm, head_dim, generator=g) * 0.5)
                    .to(torch.bfloat16).to(device=dev, dtype=cache.k.dtype) for _ in range(2))
            cache.load(warm, k, v)
            cache.commit(list(range(context - warm)))
            del k, v
        yield
    costs: dict[int, float] = {}
    for n in grid:
        sizes = [33] * (n // 33) + ([n % 33] if n % 33 else [])
        with torch.inference_mode():
            segs = []
            for T in sizes:
                m = torch.zeros(T, context + T, dtype=torch.bool, device=dev)
                m[:, :context] = True
                m[:, context:] = tree_mask(list(range(-1, T - 1)), device=dev)
                segs.append(Segment(cache=cache, rows=T, mask=m))
            tok = torch.full((n,), 100, device=dev)
            pos = torch.cat([torch.arange(context, context + T, device=dev) for T in sizes])
        ts = []
        for _ in range(repeat + 1):
            with torch.inference_mode():
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.model.forward_segments(tok, pos, segs)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            yield
        costs[n] = min(ts[1:])
    return costs


def run(gen: Measurement) -> Any:
    """Run a measurement to its end; its result."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def profile(engine, grid: Sequence[int] = GRID, context: int = CONTEXT, repeat: int = REPEAT) -> dict[int, float]:
    """``measure`` run to its end (a benchmark's or a test's profile; ~3 s on 2 CPU cores for
    the 135M model). Past the grid a CPU step grows about linearly."""
    return run(measure(engine, grid, context, repeat))


class StepProfile:
    """One engine's step-cost profile: the points cached or measured so far (``points``), what
    remains to measure (``pending``), and the row cost (``row_cost``).

    ``source``: ``"cached"`` (read from disk), ``"measured"`` (by this process), or ``"none"``.
    ``base``: the rows of a plain decoding step (1 or 2)."""

    def __init__(self, engine, base: int = 2) -> None:
        self.engine = engine
        self.base = base
        self.context = min(CONTEXT, engine.max_context - 64)
        self.key = profile_cache.engine_key("step_costs", engine, grid=list(GRID), context=self.context,
                                            repeat=REPEAT)
        cached = profile_cache.load(self.key, profile_cache.valid_step_costs)
        usable = cached is not None and plausible(cached) and set(cached) <= set(GRID)
        self.points: dict[int, float] = dict(cached) if usable else {}
        self.source = "cached" if self.points else "none"
        self._checked = False
        self._attempts = 0
        self.long_context = min(LONG_CONTEXT, engine.max_context - 64)
        self.context_key = profile_cache.engine_key("row_context_cost", engine, rows=[base, ROW_COST_ROWS],
                                                    contexts=[SHORT_CONTEXT, self.long_context], repeat=REPEAT)
        # seconds per verified row per token of context (None: not measured yet)
        self.row_context_cost: float | None = profile_cache.load(self.context_key,
                                                                 profile_cache.valid_row_context_cost)

    @property
    def complete(self) -> bool:
        return all(n in self.points for n in GRID)

    def row_cost(self) -> float | None:
        return row_cost_of(self.points, self.base)

    def start(self) -> float:
        """The row cost at an engine's start: on a miss its two points are measured now and
        stored (a partial profile: the scheduler measures the rest); on a hit the same forwards
        run once over a short context, result dropped, as a warm-up (the first forwards of a
        process pay one-time set-up: OpenMP threads, GEMM primitives, first touch of the packed
        weights; measured 1-3 s on 2 loaded cores, which would otherwise land on the first
        request)."""
        grid = [self.base, ROW_COST_ROWS]
        cost = self.row_cost()
        if cost is not None:
            run(measure(self.engine, grid, 64, 1))
            return cost
        self.points.update(run(measure(self.engine, grid, self.context, REPEAT)))
        self.source = "measured"
        self._store()
        return self.row_cost()  # type: ignore[return-value]

    def pending(self) -> Measurement | None:
        """The measurement still to run (None: nothing): the grid's missing points, or, for a
        complete profile read from disk, ``CHECK`` timed again. It yields per forward and
        returns what ``finish`` takes."""
        if not self.complete:
            missing = [n for n in GRID if n not in self.points]
            return self._merged(measure(self.engine, missing, self.context, REPEAT))
        if self.source == "cached" and not self._checked:
            return self._check()
        if self.row_context_cost is None and self.long_context > SHORT_CONTEXT:
            return self._row_context_cost()
        return None

    def _row_context_cost(self) -> Measurement:
        """``row_context_cost``'s two contexts, one right after the other (a machine whose speed
        drifts over the day gives both the same speed); taken here, and stored when both
        measurements are plausible. Returns None: ``finish`` has nothing more to take."""
        rows = [self.base, ROW_COST_ROWS]
        short = yield from measure(self.engine, rows, SHORT_CONTEXT, REPEAT)
        long = yield from measure(self.engine, rows, self.long_context, REPEAT)
        self.row_context_cost = row_context_cost_of(short, long, self.base, SHORT_CONTEXT, self.long_context)
        if plausible(short) and plausible(long):
            profile_cache.store(self.context_key, self.row_context_cost)
        return None

    def _merged(self, gen: Measurement) -> Measurement:
        new = yield from gen
        return {**self.points, **new}

    def _check(self) -> Measurement:
        """A profile measured while other work shared the cores is too slow everywhere and in the
        wrong shape (seen: 2 rows at 482 ms where an idle machine takes 27), and its marginal
        row looks dear, so the load-aware budget drafts too little; the live corrections rescale
        a profile but learn its shape only where steps land. When a point is off by more than
        ``CHECK_TOLERANCE`` either way, the whole profile is measured again (and stored); else
        None: the cached one stands."""
        now = yield from measure(self.engine, list(CHECK), self.context, REPEAT)
        if all(1.0 / CHECK_TOLERANCE <= now[n] / self.points[n] <= CHECK_TOLERANCE for n in CHECK):
            return None
        return (yield from measure(self.engine, GRID, self.context, REPEAT))

    def finish(self, result: dict[int, float] | None) -> None:
        """Take a finished ``pending`` measurement: None (the check confirmed the cached profile)
        or the complete profile. An implausible one is measured again, whole (the points kept
        from before may be the disturbed ones), up to ``ATTEMPTS`` times, then used but never
        stored."""
        self._checked = True
        if result is None:
            return
        self._attempts += 1
        ok = plausible(result)
        if not ok and self._attempts < ATTEMPTS:
            self.points = {}
            return
        self.points = dict(result)
        self.source = "measured"
        if ok:
            self._store()

    def _store(self) -> None:
        profile_cache.store(self.key, [[n, c] for n, c in sorted(self.points.items())])
