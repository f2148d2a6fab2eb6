"""Where a batched decode step's time goes, at several concurrencies.

For each workload (held-out file rewrites; agent turns) and each concurrency c in --concurrency,
N = max(c, --requests) requests run through ``BatchEngine`` with at most c in flight (closed loop,
greedy, --max-tokens each), with speculation (budget "load_aware") and without ("off"). The
benchmark wraps the engine's parts in timers (nothing in the engine changes; nothing is wrapped
outside this script) and attributes each moment of the run to the innermost part running:

  forward      linears (the row-invariant projections), attention (rotary, KV writes and
               attention: one native call per layer), attention_setup (its per-forward segment
               table), norms, silu, lm_head (final norm and output projection), forward_other
               (embedding, rotary tables, residual adds: what the forward does besides)
  step         tree_mask, verify (greedy path), kv_compaction (``KVCache.commit``),
               step_other (rows, positions and masks of the step, tensors, stats)
  scheduler    drafting (drafters' extend / propose), policy (draft shaping, survival, the
               load-aware slot choice), commit (accept, stop strings, callbacks), detokenise,
               sched_other (the batch loop itself)
  admit        a joining request's prefill (reported apart: it is not a decode step's time)

Per cell: milliseconds per decode step for each part (the median over --repeat runs), their
share of the step, rows and committed tokens per step, tokens/s (instrumented), the wrappers' own
estimated cost. Prints JSON; --out writes it.

--variants compares engine settings in the same run, each cell's variants one after another
(so a busy machine disturbs them alike): ``name:linears,costs`` with linears ``amx`` or
``vector`` (AGENTSPEC_DECODE_LINEARS for decode rows) and costs ``live`` or ``static`` (the
step-cost model refreshed by observed steps, or the profile alone), e.g.
``--variants before:vector,static;after:amx,live``. Outputs are checked against the first
variant's plain run too.

``--costs`` measures the step-cost profile alone, as the engine does
(``agentspec.backends.embedded.step_profile.profile``): one forward of n decode/verify rows
(segments of up to 33 rows) over ``--context`` cached tokens for each n in ``--rows``, the fastest
of ``--repeat-forward`` runs, and each forward's time by part as above (attention, linears,
norms, ...). ``benchmarks/replay.py --costs FILE`` turns such a profile into estimated speedups.

    python -m benchmarks.bench_step_profile --data DIR --out FILE
    python -m benchmarks.bench_step_profile --costs --context 4096 --out FILE
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    cold,
    distinct,
    emit_report,
    logger,
    machine_record,
    workload_prompts,
)

log = logger("bench_step_profile")

FORWARD = ("linears", "attention", "attention_setup", "norms", "silu", "lm_head", "forward_other")
STEP = ("tree_mask", "verify", "kv_compaction", "step_other")
SCHED = ("drafting", "policy", "commit", "detokenise", "sched_other")
PARTS = FORWARD + STEP + SCHED


class Probe:
    """Exclusive time per part: a wrapped call's time goes to its part, less the time of wrapped
    calls inside it (their own parts). ``phase``: the outermost part on the stack ("step" or
    "admit"), so a prefill's linears are not a step's."""

    def __init__(self) -> None:
        self.stack: list[list] = []   # [part, start, children's time]
        self.totals: dict[tuple[str, str], float] = {}
        self.calls = 0
        self.undo: list = []
        self.missing: set[str] = set()

    def wrap(self, owner, attr: str, part: str, inherit: tuple[str, ...] = ()) -> None:
        """Time ``owner.attr`` as ``part``; called inside a part named in ``inherit``, as that part.
        An attribute the engine no longer has is listed in ``missing`` (its time goes to the part
        around it) rather than stopping the run."""
        fn = getattr(owner, attr, None)
        if fn is None:
            self.missing.add(f"{getattr(owner, '__name__', owner)}.{attr}")
            return
        probe = self
        clock = time.perf_counter

        def timed(*a, **k):
            probe.calls += 1
            own = probe.stack[-1][0] if inherit and probe.stack and probe.stack[-1][0] in inherit else part
            frame = [own, clock(), 0.0]
            probe.stack.append(frame)
            try:
                return fn(*a, **k)
            finally:
                probe.stack.pop()
                dt = clock() - frame[1]
                phase = probe.stack[0][0] if probe.stack else part
                key = (phase, own)
                probe.totals[key] = probe.totals.get(key, 0.0) + dt - frame[2]
                if probe.stack:
                    probe.stack[-1][2] += dt

        timed.__wrapped__ = fn
        setattr(owner, attr, timed)
        self.undo.append((owner, attr, fn))

    def restore(self) -> None:
        for owner, attr, fn in reversed(self.undo):
            setattr(owner, attr, fn)
        self.undo = []

    def reset(self) -> None:
        self.totals, self.calls = {}, 0


def instrument(engine, probe: Probe) -> None:
    """Wrap the engine's parts (classes and modules, for this process)."""
    import torch.nn.functional as F

    from agentspec.backends.embedded import batch, model
    from agentspec.decode import step
    from agentspec.decode.policy import DraftPolicy
    from agentspec.kernels import cpu_attention, cpu_linear

    w = probe.wrap
    # outermost: the phases (a decode step's own Python, and a joining request's prefill)
    w(batch.BatchEngine, "_step", "sched_other")
    w(batch.BatchEngine, "_admit", "admit")
    # scheduler
    w(step.Decoder, "propose_many", "drafting")
    w(DraftPolicy, "shape", "policy")
    w(batch, "select_slots", "policy")
    w(batch.BatchEngine, "_commit", "commit")
    w(engine.tokenizer, "decode", "detokenise")
    # step
    w(step.Decoder, "step", "step_other")
    w(step, "tree_mask", "tree_mask")
    w(step, "greedy_verify", "verify")
    w(step.Decoder, "_verify_greedy_batch", "verify")
    w(model.KVCache, "commit", "kv_compaction")
    # forward
    w(model.Transformer, "forward", "forward_other")
    w(model.Transformer, "forward_segments", "forward_other")
    w(model.Transformer, "_logits", "lm_head")
    w(cpu_linear.PackedLinear, "__call__", "linears", inherit=("lm_head",))   # the head's own: lm_head
    w(cpu_linear.PackedLinear, "prefill", "linears", inherit=("lm_head",))
    w(cpu_attention.QKVAttention, "__call__", "attention")
    w(cpu_attention.QKVAttention, "__init__", "attention_setup")
    w(cpu_attention, "rms_norm", "norms", inherit=("lm_head",))
    w(F, "rms_norm", "norms", inherit=("lm_head",))
    w(F, "silu", "silu")
    w(F, "linear", "linears", inherit=("lm_head",))   # torch's GEMM where the native linears do not run


def wrapper_cost(probe: Probe) -> float:
    """Seconds one wrapped call adds (a wrapped no-op, timed)."""

    class Box:
        @staticmethod
        def f():
            return None

    p = Probe()
    p.wrap(Box, "f", "x")
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        Box.f()
    t1 = time.perf_counter()
    for _ in range(n):
        Box.f.__wrapped__()
    t2 = time.perf_counter()
    return max((t1 - t0) - (t2 - t1), 0.0) / n


def parse_variants(text: str) -> list[tuple[str, str, bool]]:
    """``name:linears,costs;...`` -> [(name, linears, live)]; "" -> the defaults, as "default"."""
    if not text:
        return [("default", "", True)]
    out = []
    for part in text.split(";"):
        name, _, opts = part.partition(":")
        lin, _, costs = opts.partition(",")
        if lin not in ("amx", "vector") or costs not in ("live", "static") or not name:
            raise SystemExit(f"--variants: {part!r} is not name:amx|vector,live|static")
        out.append((name, lin, costs == "live"))
    return out


def run_cell(engine, probe: Probe, prompts, c: int, budget: str, max_tokens: int, step_costs,
             live: bool = True) -> dict:
    from agentspec.backends.embedded.batch import BatchEngine
    from agentspec.drafting import SuffixDrafter

    drafter = SuffixDrafter(vocab_size=engine.vocab_size)  # fresh: no memory of earlier runs
    rows: list[int] = []
    ctx: list[int] = []
    from agentspec.decode import step

    orig = step.Decoder.step

    def counting(self, seqs, drafts, **k):
        rows.append(sum(1 + len(d.token_ids) for d in drafts))
        ctx.append(sum(s.cache.length for s in seqs) // max(len(seqs), 1))
        return orig(self, seqs, drafts, **k)

    step.Decoder.step = counting
    try:
        with BatchEngine(engine, max_batch=c, budget_policy=budget, step_costs=step_costs, background=False,
                         live_costs=live) as be:
            probe.reset()
            cold(engine)   # every run pays its prefills
            t0 = time.perf_counter()
            gens = be.generate_many(prompts, max_tokens=max_tokens, drafter=drafter)
            wall = time.perf_counter() - t0
            steps = be.steps
    finally:
        step.Decoder.step = orig
    tot = probe.totals
    per = {p: tot.get(("sched_other", p), 0.0) / max(steps, 1) for p in PARTS}
    admit = sum(v for (ph, _), v in tot.items() if ph == "admit")
    stepped = sum(v for (ph, _), v in tot.items() if ph == "sched_other")
    per["sched_other"] += max(wall - admit - stepped, 0.0) / max(steps, 1)   # the loop outside _step
    tokens = sum(len(g.token_ids) for g in gens)
    admit_parts = {p: tot.get(("admit", p), 0.0) for p in PARTS + ("admit",)}
    return {"per_step_s": per, "steps": steps, "wall_s": wall, "admit_s": admit, "tokens": tokens,
            "admit_parts_s": admit_parts,
            "calls": probe.calls, "rows_per_step": sum(rows) / max(len(rows), 1),
            "context_per_step": sum(ctx) / max(len(ctx), 1), "tokens_per_step": tokens / max(steps, 1),
            "outputs": [g.token_ids for g in gens]}


def summarise(runs: list[dict], call_cost: float) -> dict:
    per = {p: statistics.median(r["per_step_s"][p] for r in runs) for p in PARTS}
    total = sum(per.values())
    groups = {"forward": sum(per[p] for p in FORWARD), "step": sum(per[p] for p in STEP),
              "scheduler": sum(per[p] for p in SCHED)}
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    steps = med("steps")
    return {
        "ms_per_step": {p: round(v * 1e3, 3) for p, v in per.items()},
        "percent": {p: round(100 * v / total, 1) for p, v in per.items()},
        "groups_ms": {g: round(v * 1e3, 3) for g, v in groups.items()},
        "groups_percent": {g: round(100 * v / total, 1) for g, v in groups.items()},
        "step_ms": round(total * 1e3, 3),
        "rows_per_step": round(med("rows_per_step"), 2),
        "tokens_per_step": round(med("tokens_per_step"), 3),
        "context_per_step": round(med("context_per_step")),
        "steps": steps,
        "admit_s": round(med("admit_s"), 3),
        "admit_parts_s": {p: round(statistics.median(r["admit_parts_s"][p] for r in runs), 3)
                          for p in PARTS + ("admit",) if any(r["admit_parts_s"][p] for r in runs)},
        "wall_s": round(med("wall_s"), 3),
        "tokens_per_s": round(statistics.median(r["tokens"] / r["wall_s"] for r in runs), 2),
        "wrapper_ms_per_step": round(statistics.median(r["calls"] for r in runs) / max(steps, 1) * call_cost * 1e3, 3),
        "repeats": len(runs),
    }


def profile_costs(engine, args) -> int:
    """``--costs``: the engine's step-cost profile (``step_profile.profile``), each forward's time
    split by part (the same probe; the untimed run of each point included in the split)."""
    import torch

    from agentspec.backends.embedded import model, step_profile

    grid = tuple(int(x) for x in args.rows.split(",")) if args.rows else step_profile.GRID
    context = args.context or step_profile.CONTEXT
    repeat = args.repeat_forward or step_profile.REPEAT
    probe = Probe()
    instrument(engine, probe)
    segments = model.Transformer.forward_segments    # the probe's wrapper: one call per point's forward
    split: dict[int, list[dict[str, float]]] = {}

    def by_rows(self, tokens, *a, **k):
        before = dict(probe.totals)
        try:
            return segments(self, tokens, *a, **k)
        finally:
            delta: dict[str, float] = {}
            for (_, part), v in probe.totals.items():
                delta[part] = delta.get(part, 0.0) + v - before.get((_, part), 0.0)
            split.setdefault(int(tokens.shape[0]), []).append(delta)

    model.Transformer.forward_segments = by_rows
    try:
        costs = step_profile.profile(engine, grid=grid, context=context, repeat=repeat)
    finally:
        model.Transformer.forward_segments = segments
        probe.restore()
    parts = {str(n): {p: round(statistics.median(d.get(p, 0.0) for d in split.get(n, [{}])) * 1e3, 3)
                      for p in FORWARD if any(d.get(p) for d in split.get(n, []))} for n in costs}
    for n, t in costs.items():
        log(f"{n:3d} rows: {t * 1e3:7.2f} ms ({t / costs[grid[0]]:.2f}x); "
            + ", ".join(f"{p} {v:.1f} ms" for p, v in parts[str(n)].items()))
    report = {"benchmark": "bench_step_profile", "mode": "costs", "machine": machine_record(engine),
              "config": {"context": context, "rows": list(grid), "repeat": repeat, "threads": torch.get_num_threads()},
              "step_seconds": {str(n): t for n, t in costs.items()},
              "relative": {str(n): round(t / costs[grid[0]], 4) for n, t in costs.items()},
              "row_cost": {str(b): step_profile.row_cost_of(costs, b) for b in (1, 2) if b in costs},
              "forward_ms_by_part": parts, "not_instrumented": sorted(probe.missing)}
    emit_report(report, args.out, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=8, help="requests per run (at least the concurrency)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-prompt", type=int, default=1500)
    ap.add_argument("--workloads", default="rewrites,agent_turns")
    ap.add_argument("--budgets", default="load_aware,off", help="BatchEngine budgets to profile")
    ap.add_argument("--repeat", type=int, default=2, help="runs per cell (medians reported)")
    ap.add_argument("--variants", default="", help="engine settings to compare in one run (see above)")
    ap.add_argument("--costs", action="store_true", help="only the step-cost profile, by part (see above)")
    ap.add_argument("--rows", default=None, help="--costs: rows per forward, comma-separated (default: the engine's grid)")
    ap.add_argument("--context", type=int, default=None, help="--costs: cached tokens (default: the engine's)")
    ap.add_argument("--repeat-forward", type=int, default=None, help="--costs: timed forwards per point")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from agentspec import Engine
    from agentspec.backends.embedded import step_profile
    from agentspec.decode.costs import lower_convex_hull

    engine = Engine.embedded(quiet=True)
    if args.costs:
        return profile_costs(engine, args)
    cs = [int(x) for x in args.concurrency.split(",")]
    step_costs = lower_convex_hull(step_profile.profile(engine))   # this run's, measured as the engine does
    cost_source = "measured by this run (step_profile.profile)"
    n_max = max(max(cs), args.requests)
    sets = workload_prompts(engine, args.data, args.workloads, n_max, args.max_prompt)
    variants = parse_variants(args.variants)
    probe = Probe()
    call_cost = wrapper_cost(probe)
    instrument(engine, probe)
    default_settings = engine.model.kernel_settings
    profiles: dict[str, dict[int, float]] = {} if len(variants) > 1 else {variants[0][0]: step_costs}
    results: dict = {}
    try:
        for wl, prompts in sets.items():
            results[wl] = {}
            for c in cs:
                ps = distinct(prompts, max(c, args.requests), log)
                n = len(ps)
                row: dict = {}
                for name, lin, live in variants:
                    engine.model.set_kernel_settings(default_settings.with_(decode_linears=lin)
                                                     if lin else default_settings)
                    if name not in profiles:  # the variant's own step-cost profile (its kernels)
                        probe.restore()
                        profiles[name] = lower_convex_hull(step_profile.profile(engine))
                        instrument(engine, probe)
                        log(f"{name}: step costs (ms) { {k: round(v * 1e3, 1) for k, v in profiles[name].items()} }")
                    cell, outs = {}, {}
                    for budget in args.budgets.split(","):
                        runs = [run_cell(engine, probe, ps, c, budget, args.max_tokens, profiles[name], live)
                                for _ in range(args.repeat)]
                        outs[budget] = runs[0]["outputs"]
                        cell[budget] = s = summarise(runs, call_cost)
                        log(f"{wl} c={c} {name} {budget}: {s['step_ms']} ms/step, {s['rows_per_step']} rows, "
                            f"{s['tokens_per_s']} tok/s | "
                            + ", ".join(f"{g} {v}%" for g, v in s["groups_percent"].items()))
                    if "off" in outs:
                        for b, o in outs.items():
                            if b != "off":
                                cell[b]["identical_to_plain"] = f"{sum(x == y for x, y in zip(o, outs['off']))}/{n}"
                        if "load_aware" in cell:
                            cell["speculation_vs_plain"] = round(
                                cell["load_aware"]["tokens_per_s"] / cell["off"]["tokens_per_s"], 3)
                    row[name] = cell
                results[wl][str(c)] = row if len(variants) > 1 else row[variants[0][0]]
    finally:
        engine.model.set_kernel_settings(default_settings)
        probe.restore()
    report = {"benchmark": "bench_step_profile", "machine": machine_record(engine),
              "config": {"concurrency": cs, "requests": args.requests, "max_tokens": args.max_tokens,
                         "max_prompt": args.max_prompt, "repeat": args.repeat, "greedy": True,
                         "step_costs_source": cost_source,
                         "step_costs_ms": {k: round(v * 1e3, 2) for k, v in step_costs.items()},
                         "wrapper_us_per_call": round(call_cost * 1e6, 3),
                         "variants": [{"name": n, "decode_linears": lin or default_settings.decode_linears, "live_costs": live,
                                       "step_costs_ms": {k: round(v * 1e3, 2) for k, v in profiles.get(n, {}).items()}}
                                      for n, lin, live in variants]},
              "parts": {"forward": FORWARD, "step": STEP, "scheduler": SCHED},
              "not_instrumented": sorted(probe.missing), "results": results}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
