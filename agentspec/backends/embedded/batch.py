"""Continuous batching for the embedded engine, with a load-aware verification budget.

A scheduler thread runs steps. Between steps, requests join (their prompt is prefilled alone;
its last logits give the first token) and leave (EOS, max_tokens, a stop string, cancellation).
Each step verifies every running request's draft tree in one forward
(``Transformer.forward_segments``): the linear layers see all rows of all requests, attention
runs per request over its own KV cache. A token's logits do not depend on what else shares the
forward (see ``small_attention``), so greedy output equals single-request plain decoding.

Load-aware budget (DESIGN.md section 7): every draft slot has a survival estimate (the product
of the drafter's per-token confidences along its path, scaled by the request's observed
accepted/estimated ratio). Across running requests the scheduler keeps the global top-B slots,
B maximising expected tokens per second under a step-cost curve profiled at start-up
(``step_cost(rows)``: the time of one forward with that many rows) and corrected by the steps
the scheduler times (``decode.costs.StepCostModel``: per rows and context, robust to outliers).
B = 0 (plain batched decoding) is always a candidate, so in expectation speculation never costs
throughput.
"""

from __future__ import annotations

import collections
import heapq
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...config import DEFAULT_SPEC, SpecConfig
from ...drafting import Drafter
from ...errors import BackendClosedError, ConfigError
from ...decode.costs import StepCostModel, lower_convex_hull
from ...decode.results import Generation, GenerationStats
from ..protocol import GenerationRequest
from ...decode.step import SeqState
from . import step_profile
from .model import round_up

__all__ = ["BatchEngine", "BudgetPolicy", "lower_convex_hull", "select_slots"]

BudgetPolicy = str  # "load_aware" | "fixed" | "off"


def select_slots(survivals: Sequence[Sequence[float]], base_rows: int, base_tokens: float,
                 step_cost: Callable[[int], float]) -> list[int]:
    """How many draft slots (a prefix of each request's draft) to verify this step.

    ``survivals[r]``: expected acceptance of each of request r's draft tokens, in draft order
    (best first; parents before children, so any prefix is a tree). Slots are taken in global
    descending order (a k-way merge of the prefixes); B = the count maximising
    ``(base_tokens + sum of taken survivals) / step_cost(base_rows + B)``. Returns the prefix
    length per request.
    """
    heap = [(-s[0], r, 0) for r, s in enumerate(survivals) if len(s)]
    heapq.heapify(heap)
    taken = [0] * len(survivals)
    order: list[int] = []
    while heap:
        neg, r, i = heapq.heappop(heap)
        order.append(r)
        if i + 1 < len(survivals[r]):
            heapq.heappush(heap, (-float(survivals[r][i + 1]), r, i + 1))
    best_value = base_tokens / step_cost(base_rows)
    best_k, total = 0, base_tokens
    counts = [0] * len(survivals)
    for k, r in enumerate(order, start=1):
        total += float(survivals[r][counts[r]])
        counts[r] += 1
        value = total / step_cost(base_rows + k)
        if value > best_value:
            best_value, best_k = value, k
    for r in order[:best_k]:
        taken[r] += 1
    return taken


class FairQueue:
    """The waiting requests, one FIFO per tenant. ``pop`` serves the tenants in turn, the one
    with the fewest requests running first: a tenant that floods the server fills its own
    queue, and each other tenant's next request joins the batch at the next free slot, not
    behind the flood."""

    def __init__(self) -> None:
        self._queues: dict[str, collections.deque] = {}   # tenant -> its requests, oldest first (insertion: turn order)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def waiting(self, tenant: str) -> int:
        q = self._queues.get(tenant)
        return len(q) if q is not None else 0

    def tenants(self) -> int:
        return len(self._queues)

    def append(self, req: _Request) -> None:
        self._queues.setdefault(req.seq.tenant, collections.deque()).append(req)
        self._n += 1

    def pop(self, running: Mapping[str, int]) -> _Request:
        """The next request to admit: the first tenant in turn among those with the fewest running
        (``running``: tenant -> requests in the batch); that tenant then goes to the back."""
        tenant = min(self._queues, key=lambda t: running.get(t, 0))   # min keeps the first of ties: the turn
        q = self._queues.pop(tenant)
        req = q.popleft()
        if q:
            self._queues[tenant] = q   # re-inserted: last in turn
        self._n -= 1
        return req

    def take_if(self, pred: Callable[[_Request], bool]) -> list[_Request]:
        """Remove and return the waiting requests ``pred`` holds for (each tenant keeps its turn
        while it has requests left)."""
        out: list[_Request] = []
        for tenant, q in list(self._queues.items()):
            keep = collections.deque()
            for r in q:
                (out if pred(r) else keep).append(r)
            if len(keep) == len(q):
                continue
            if keep:
                self._queues[tenant] = keep   # an existing key: its place in the turn order stays
            else:
                del self._queues[tenant]
        self._n -= len(out)
        return out

    def drain(self) -> list[_Request]:
        out = [r for q in self._queues.values() for r in q]
        self._queues.clear()
        self._n = 0
        return out


@dataclass(eq=False)
class _Request:
    """A queued or running request: its decoding state and the caller's callbacks."""

    seq: SeqState
    on_tokens: Callable[[list[int]], None]
    on_done: Callable[[Any, Any], None]     # (Generation | None, error | None)
    should_stop: Callable[[], bool] | None
    finished: bool = False                  # on_done was called (it is called exactly once)
    prefill: Generator[None, None, list[int]] | None = None   # while its prompt runs (``Decoder.prefill_steps``)
    passed: int = 0                         # chunks of other prompts run while this one's waited

    def stopping(self) -> bool:
        """``should_stop()`` (False when there is none, or it fails: admission then fails the request)."""
        if self.should_stop is None:
            return False
        try:
            return bool(self.should_stop())
        except Exception:  # noqa: BLE001 - a consumer's failure must not stop the batch
            return False

    def done(self, generation: Any, error: Any) -> None:
        if self.finished:
            return
        self.finished = True
        try:
            self.on_done(generation, error)
        except Exception as e:  # noqa: BLE001 - a consumer's failure must not stop the batch
            import sys

            print(f"[agentspec] a request's completion callback failed: {e!r}", file=sys.stderr, flush=True)


class BatchEngine:
    """Runs many requests at once on an ``EmbeddedEngine``'s model (not its deterministic mode).

    Options:
      max_batch: running requests per step (more wait in arrival order).
      budget_policy: "load_aware" (global top-B slots, default), "fixed" (each request's own
        ``cut_for_cost`` as in single-request decoding) or "off" (plain batched decoding).
      step_costs: {rows: seconds} to use instead of the profile (see ``step_costs``).
      live_costs: refresh the step-cost model from the steps this engine times (default): the
        profile is the prior, each step's (rows, context, seconds) corrects it
        (``decode.costs.StepCostModel``), so the budget follows when rows get cheaper or dearer
        than profiled (other contexts, a busier machine, drafting's own cost). False: the
        profile alone.
      verify: "auto" (batched verification of the greedy requests with ``agentspec.kernels`` on
        CUDA; the per-request reference on CPU), "batched" or "reference".
      background: run the scheduler on its own thread (default). False: steps run in the
        caller's thread, in ``generate_many`` or ``serve_forever``. On CPU, prefer False with the
        process's main thread: libgomp throttles its spin-waiting once a second thread runs
        OpenMP teams, and a step then costs ~1.5x as much (measured on 2 cores: 39 vs 25 ms).
    """

    def __init__(self, engine, *, max_batch: int = 16, budget_policy: BudgetPolicy = "load_aware",
                 step_costs: dict[int, float] | None = None, background: bool = True,
                 verify: str = "auto", live_costs: bool = True) -> None:
        if engine.deterministic:
            raise ConfigError("continuous batching does not support the deterministic mode")
        if budget_policy not in ("load_aware", "fixed", "off"):
            raise ConfigError(f"budget_policy must be 'load_aware', 'fixed' or 'off', got {budget_policy!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if verify not in ("auto", "batched", "reference"):
            raise ConfigError(f"verify must be 'auto', 'batched' or 'reference', got {verify!r}")
        self._batched_verify = verify == "batched" or (verify == "auto" and engine.device.type == "cuda")
        self.engine = engine
        self.decoder = getattr(engine, "decoder", None)  # (None: a test fake that never steps)
        self.max_batch = max_batch
        self.budget_policy = budget_policy
        self._profile_lock = threading.Lock()
        self._profile: Any = None  # the profile's pending measurement, run one forward at a time
        self.live_costs = bool(live_costs)
        self.costs: StepCostModel | None = None   # set with the curve (_set_step_costs)
        self.profile: step_profile.StepProfile | None = None
        if step_costs:
            self._set_step_costs(dict(step_costs), "given")
        else:
            self.profile = getattr(engine, "step_profile", None) or step_profile.StepProfile(engine)
            self._take_profile()
        self._waiting = FairQueue()   # per tenant, served in turn (a flood waits behind itself)
        self._running: list[_Request] = []
        self._prefilling: list[_Request] = []   # admitted, their prompts running (``_prefill_chunk``)
        self._free_caches: list = []   # finished requests' KV caches, for the next ones (``_cache_for``)
        self._cv = threading.Condition()
        self._closed = False
        self.steps = 0
        self._serving = False
        self._threads = torch.get_num_threads()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="agentspec-batch", daemon=True)
            self._thread.start()

    # ---- public -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting_share(self, tenant: str) -> tuple[int, int]:
        """(requests of ``tenant`` waiting, tenants with requests waiting)."""
        with self._cv:
            return self._waiting.waiting(tenant), self._waiting.tenants()

    def submit(self, prompt, *, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               seed: int | None = None, stop=None, spec: SpecConfig | None = DEFAULT_SPEC,
               drafter: Drafter | None = None, tenant: str = "default",
               on_tokens: Callable[[list[int]], None] = lambda t: None,
               on_done: Callable[[Any, Any], None] = lambda g, e: None,
               should_stop: Callable[[], bool] | None = None, grammar: str | None = None) -> None:
        """Queue a request given as the engine's API takes one (``prompt``: text, messages or
        token ids), checked now (``check_request``: bad input raises here; ``grammar``, an
        llguidance grammar the output follows, is compiled here too). ``on_tokens(new)``
        is called from the scheduler thread after each step that committed tokens;
        ``on_done(generation, error)`` once at the end. The drafter: ``drafter`` when given,
        else what ``spec.drafters`` names (built once per list by the engine,
        ``EmbeddedEngine.drafter_for``), else the engine's own."""
        e = self.engine
        request = e.check(e.encode(prompt), max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          seed=seed, stop=stop, spec=spec, tenant=tenant, grammar=grammar)
        self.submit_request(request, drafter=e.request_drafter(drafter, spec), on_tokens=on_tokens,
                            on_done=on_done, should_stop=should_stop)

    def submit_request(self, request: GenerationRequest, *, drafter: Drafter | None,
                       on_tokens: Callable[[list[int]], None] = lambda t: None,
                       on_done: Callable[[Any, Any], None] = lambda g, e: None,
                       should_stop: Callable[[], bool] | None = None, constraint: Any = None) -> None:
        """Queue a request its backend checked (``check_request``), drafting with ``drafter``
        (None: nothing). Nothing is checked again here. ``constraint``: the request's grammar as
        the caller compiled it (``EmbeddedEngine.constraint_for``); None with a grammar compiles
        it now (InvalidRequestError, param "grammar", raised here)."""
        e = self.engine
        off = "batch budget policy 'off'" if self.budget_policy == "off" else getattr(e, "spec_off_reason", None)
        seq = self.decoder.sequence(request, drafter=drafter, off_reason=off, note=f", batched ({self.budget_policy})",
                                    constraint=constraint)
        req = _Request(seq=seq, on_tokens=on_tokens, on_done=on_done, should_stop=should_stop)
        with self._cv:
            if self._closed:
                raise BackendClosedError("BatchEngine is closed")
            self._waiting.append(req)
            self._cv.notify()

    def generate_many(self, prompts: Sequence, *, per_prompt: Sequence[Mapping[str, Any]] | None = None,
                      **options) -> list[Generation]:
        """Run ``prompts`` concurrently; their Generations in order (a convenience for tests,
        benchmarks and training-data distillation; errors are raised). ``per_prompt``: options
        for each prompt (e.g. its sampling ``seed``), over ``options``."""
        if per_prompt is not None and len(per_prompt) != len(prompts):
            raise ValueError(f"per_prompt has {len(per_prompt)} entries for {len(prompts)} prompts")
        done = threading.Semaphore(0)
        results: list[Any] = [None] * len(prompts)

        def finisher(i):
            def on_done(g, err):
                results[i] = err if err is not None else g
                done.release()
            return on_done

        for i, p in enumerate(prompts):
            self.submit(p, on_done=finisher(i), **{**options, **(per_prompt[i] if per_prompt else {})})
        if self._thread is None:
            self._loop(until_idle=True)
        for _ in prompts:
            done.acquire()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def run_until_idle(self) -> None:
        """Run steps in this thread until nothing waits or runs (``background=False`` only)."""
        if self._thread is not None:
            raise RuntimeError("this BatchEngine runs in the background already")
        self._loop(until_idle=True)

    def serve_forever(self) -> None:
        """Run the scheduler in this thread until ``close()`` (from another thread)."""
        if self._thread is not None:
            raise RuntimeError("this BatchEngine runs in the background already")
        self._loop()

    def close(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        elif not self._serving:  # nobody runs the loop: fail what is still queued
            for r in self._waiting.drain():
                self._fail(r, RuntimeError("engine shut down"))

    def __enter__(self) -> "BatchEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step_cost(self, rows: int, context: float | None = None) -> float:
        """Seconds for one step of ``rows`` rows: the profile, linearly interpolated (and
        extrapolated past its grid); with ``context`` (tokens cached per request) and
        ``live_costs``, as corrected by the steps observed so far (``StepCostModel.cost``)."""
        return self.costs.cost(rows, context if self.live_costs else None)

    def slot_costs(self, base_rows: int, context: float) -> Callable[[int], float]:
        """The cost ``select_slots`` weighs a step's draft rows with: the profile's curve plus what
        the latest steps took beyond it (``StepCostModel.extra_cost``).

        At high batch the steps take far more than the profile says (each running request's
        keys and values, read once per step however many rows it verifies: 16 requests at ~900
        tokens spend 36 of a 53 ms step there, where the profile, timing its rows over one
        cache, has 18 ms for the whole step). That excess is the same whatever the rows, so it
        is added, not multiplied: a verified row still costs only its compute, which the profile
        measures. (Scaling the curve by the excess made each row look ~3x dearer; the per-cell
        corrections, hulled, put the draft-free step of a batch that always drafts at half its
        cost. Either way the budget drafted too little.)

        The stand-in curve (a cache miss, until the profile is measured) is in units of a one-row
        step, not seconds: there the rows are the live step (``step_cost``) scaled by the
        stand-in's shape (conservative: the budget drafts less, never more)."""
        c = self.costs
        if self.step_costs_source == "stand-in" or not self.live_costs:
            base = self.step_cost(base_rows, context)
            prior_base = c.cost(base_rows)
            scale = base / prior_base if self.step_costs_source == "stand-in" and prior_base > 0 else 1.0
            return lambda rows: base + max(c.cost(rows) - prior_base, 0.0) * scale
        return lambda rows: c.extra_cost(rows, context)

    # ---- the step-cost profile ---------------------------------------------------------------

    PROFILE_AFTER_IDLE_S = 1.0  # a pending measurement runs once nothing ran for this long

    @property
    def step_costs(self) -> dict[int, float]:
        """The step-cost curve {rows: seconds}, lowered onto its convex hull: given, or the
        engine's step-cost profile (``step_profile.StepProfile``: cached on disk for this
        machine, build and model, or measured).

        Until the profile is complete (a cache miss) the curve is a stand-in from the engine's
        row cost (``step_profile.stand_in``) and the missing points are measured in idle time: a
        serving scheduler (``serve_forever``, ``background=True``) runs the measurement one
        forward at a time once nothing waited or ran for ``PROFILE_AFTER_IDLE_S``, so the server
        answers at once and a request waits at most one forward (~1.5 s at 264 rows on 2
        cores); ``run_until_idle``, ``generate_many(background=False)`` and a read of this
        property while no scheduler runs finish it first. A complete cached profile is checked
        the same way (two of its points timed again). ``step_costs_source`` says which it is."""
        if self._profile is not None and not self._serving and self._thread is None:
            self._finish_profile()
        return self._step_costs

    def _set_step_costs(self, costs: dict[int, float], source: str) -> None:
        hull = lower_convex_hull(costs) if source != "given" else costs
        self._step_costs = hull
        if self.costs is None:
            self.costs = StepCostModel(hull)
        else:
            self.costs.set_prior(hull)
        self.step_costs_source = source  # "given" | "cached" | "measured" | "stand-in"

    def _take_profile(self) -> None:
        """The curve from the profile as it stands, and its next measurement (if any)."""
        p = self.profile
        if p.complete:
            self._set_step_costs(p.points, p.source)
            if p.row_context_cost is not None:
                self.costs.set_row_context_cost(p.row_context_cost, p.context)
        else:
            self._set_step_costs(step_profile.stand_in(self.engine.row_cost), "stand-in")
        self._profile = p.pending()

    def _profile_piece(self) -> bool:
        """Run one forward of the pending measurement (False when another thread runs it or
        nothing is pending); at its end, hand it to the profile (which stores it) and take the
        curve."""
        if not self._profile_lock.acquire(blocking=False):
            return False
        try:
            gen = self._profile
            if gen is None:
                return False
            try:
                next(gen)
                return True
            except StopIteration as done:
                self.profile.finish(done.value)
                self._take_profile()
                return True
            except BaseException:
                self._profile = None  # keep the curve as it is; the next start measures again
                raise
        finally:
            self._profile_lock.release()

    def _finish_profile(self) -> None:
        while self._profile is not None:
            if not self._profile_piece():
                with self._profile_lock:  # another thread runs a piece: wait for it
                    pass

    # ---- the scheduler ------------------------------------------------------------------------

    def _loop(self, until_idle: bool = False) -> None:
        # OpenMP's thread count is per calling thread: keep the engine's (its governor's) setting
        gov = getattr(self.engine, "governor", None)
        if gov is not None:
            gov.apply()
        else:
            torch.set_num_threads(self._threads)
        self._serving = True
        try:
            if until_idle:  # run_until_idle / generate_many: a pending profile first, as at start-up
                self._finish_profile()
            self._run_loop(until_idle)
        finally:
            self._serving = False

    def _run_loop(self, until_idle: bool) -> None:
        pending: list[_Request] = []
        busy = time.monotonic()  # last time there was work (or the loop started)
        while True:
            with self._cv:
                if not self._waiting and not self._running and not self._prefilling:
                    self._free_caches.clear()   # idle: give the pooled caches' memory back
                    if until_idle:
                        return
                while not self._waiting and not self._running and not self._prefilling and not self._closed:
                    quiet = time.monotonic() - busy
                    if self._profile is not None and not until_idle and quiet >= self.PROFILE_AFTER_IDLE_S:
                        break  # idle a while: measure the step-cost profile, one forward (below)
                    # a timeout keeps the main thread responsive to signals
                    self._cv.wait(0.5 if self._profile is None else max(self.PROFILE_AFTER_IDLE_S - quiet, 0.01))
                if self._closed:
                    pending = self._waiting.drain() + self._prefilling + self._running
                    self._running, self._prefilling = [], []
                    break
                # waiting requests cancelled or past their deadline end now, not when a slot frees:
                # their clients get their answer (504, 499) at once and their queue places go to
                # others (bounded by max_queue: a cheap sweep once per step)
                stopped = self._waiting.take_if(_Request.stopping) if self._waiting else []
                joining = []
                admitted = len(self._running) + len(self._prefilling)
                if self._waiting and admitted < self.max_batch:
                    in_batch = collections.Counter(r.seq.tenant for r in self._running + self._prefilling)
                    while self._waiting and admitted + len(joining) < self.max_batch:
                        joining.append(self._waiting.pop(in_batch))
                        in_batch[joining[-1].seq.tenant] += 1
            for req in stopped:
                self._guard(req, self._end_waiting)
            for req in joining:
                self._guard(req, self._admit)
            self._running = [r for r in self._running if r.seq.cache is not None]
            if joining or self._running or self._prefilling:
                busy = time.monotonic()
            elif self._profile is not None:
                try:
                    self._profile_piece()
                except Exception as err:  # noqa: BLE001 - keep serving on the stand-in
                    import sys

                    print(f"[agentspec] step-cost profiling failed: {err!r}", file=sys.stderr, flush=True)
                continue
            if self._prefilling:
                self._prefill_chunk()
            if self._running:
                try:
                    self._step()
                except Exception as err:  # noqa: BLE001 - fail the running requests, keep serving
                    for r in self._running:
                        self._fail(r, err)
                    self._running = []
                busy = time.monotonic()
        for r in pending:
            self._fail(r, RuntimeError("engine shut down"))

    def _guard(self, req: _Request, fn) -> None:
        try:
            fn(req)
        except Exception as err:  # noqa: BLE001
            self._fail(req, err)

    def _fail(self, req: _Request, err: BaseException) -> None:
        if req.finished:
            return
        try:
            self._release(req.seq)
        except Exception:  # noqa: BLE001
            pass
        req.done(None, err)

    # a new request's KV cache: a finished one's where one is large enough (``KVCache.reset``, as
    # the single-request path reuses its cache: slots past a request's own are masked, weighted
    # exactly 0, and what a finished request left there is finite, so it reaches no result's
    # bits). A fresh one costs ~10-45 ms at ~1.2k tokens: ~90 MB of zeroed pages (keys, values
    # and their packed copies), page-faulted in again every time (glibc maps allocations that
    # large anew), with every other request waiting.
    CACHE_ROUND = 512

    def _cache_for(self, need: int):
        free = self._free_caches
        fits = [i for i, c in enumerate(free) if c.capacity >= need]
        if fits:
            cache = free.pop(min(fits, key=lambda i: free[i].capacity))
            cache.reset()
            return cache
        return self.engine.new_cache(round_up(need, self.CACHE_ROUND))

    def _release(self, seq) -> None:
        """``decoder.release``, keeping the cache for the next request (at most ``max_batch`` kept,
        the largest; all dropped when the scheduler goes idle)."""
        cache = seq.cache
        self.decoder.release(seq)
        if cache is not None and not self._closed:
            self._free_caches.append(cache)
            if len(self._free_caches) > self.max_batch:
                self._free_caches.remove(min(self._free_caches, key=lambda c: c.capacity))

    def _end_waiting(self, req: _Request) -> None:
        """End a request that was cancelled or expired while waiting: nothing ran (no drafter
        started, no cache), finish reason "cancelled" (the server tells a timeout apart)."""
        req.done(Generation(text="", token_ids=[], finish_reason="cancelled",
                            stats=GenerationStats(prompt_tokens=len(req.seq.ids))), None)

    def _admit(self, req: _Request) -> None:
        seq = req.seq
        if req.should_stop is not None and req.should_stop():  # cancelled or expired while waiting
            self._end_waiting(req)
            return
        seq.cache = self._cache_for(self.decoder.cache_need(seq))
        req.prefill = self.decoder.prefill_steps(seq)
        self._prefilling.append(req)

    PREFILL_PASSES = 16   # chunks a prompt lets shorter ones run before it goes next anyway

    def _prefill_chunk(self) -> None:
        """One prompt chunk between the running requests' steps (they wait one chunk, ~1-2 s at
        256 tokens of the 1.5B on 2 cores, not a 20 s prompt): of the admitted prompt with the
        fewest tokens left (a short prompt admitted behind a long one waits one chunk, not the
        whole prompt; prompts of one length run one after the other, not in rotation, so the
        first finishes first), or of the longest-waiting one once it let ``PREFILL_PASSES``
        chunks of others go before it. A chunk is the same computation whatever ran between two
        (``Decoder.prefill_steps``). The last chunk's request joins the running ones with its
        first token; one cancelled or past its deadline ends before its next chunk."""
        starved = [r for r in self._prefilling if r.passed >= self.PREFILL_PASSES]
        req = starved[0] if starved else min(self._prefilling, key=lambda r: len(r.seq.ids) - r.seq.cache.length)
        self._prefilling.remove(req)
        for r in self._prefilling:
            r.passed += 1
        req.passed = 0
        seq = req.seq
        if req.stopping():
            req.prefill.close()
            req.prefill = None
            seq.finish = "cancelled"
            self._release(seq)
            req.done(self.decoder.result(seq), None)
            return
        try:
            next(req.prefill)
        except StopIteration as done:
            req.prefill = None
            self._guard(req, lambda r: self._commit(r, done.value))
            if seq.cache is not None and not req.finished:
                self._running.append(req)
            return
        except Exception as err:  # noqa: BLE001 - this request's failure is its own
            req.prefill = None
            self._fail(req, err)
            return
        self._prefilling.insert(0, req)   # (first among equals: it goes on next)

    def _commit(self, req: _Request, new: list[int]) -> None:
        """Append newly verified tokens; emit them; finish the request if it is done."""
        seq = req.seq
        added, done = self.decoder.accept(seq, new)
        if added:
            try:
                req.on_tokens(added)
            except Exception:  # noqa: BLE001 - a consumer's failure must not stop the batch
                pass
        if not done and req.should_stop is not None and req.should_stop():
            seq.finish, done = "cancelled", True
        if done:
            self._release(seq)
            req.done(self.decoder.result(seq), None)

    def _step(self) -> None:
        t0 = time.perf_counter()
        reqs = self._running
        seqs = [r.seq for r in reqs]
        dec = self.decoder
        context = sum(s.cache.length for s in seqs) / len(seqs)   # tokens cached per request
        drafts = dec.propose_many(seqs, cost_cut=self.budget_policy == "fixed")
        if self.budget_policy == "load_aware" and any(d.token_ids for d in drafts):
            surv = [[x * s.tracker.trust for x in d.survival()] for s, d in zip(seqs, drafts)]
            # the rows a draft-free step runs: one per request (two for a lone request where a
            # single row would take another kernel path: the profile's base)
            base_rows = max(len(seqs), self.profile.base if self.profile is not None else 2)
            keep = select_slots(surv, base_rows, float(len(seqs)), self.slot_costs(base_rows, context))
            drafts = [d.prefix(k) for d, k in zip(drafts, keep)]
        news = dec.step(seqs, drafts, batched_verify=self._batched_verify)
        self.steps += 1
        for r, new in zip(reqs, news):
            self._guard(r, lambda r, new=new: self._commit(r, new))   # one request's failure is its own
        self._running = [r for r in self._running if r.seq.cache is not None]
        # the whole step (drafting, policy, forward, verification, commits): what a step's
        # tokens cost, so what the budget weighs them against
        self.costs.observe(sum(1 + len(d.token_ids) for d in drafts), context, time.perf_counter() - t0)
