"""End to end, greedy: plain vs suffix vs suffix + EAGLE-3 (gated), one request at a time and batched.

Workloads (prompts the EAGLE-3 head never saw: ``agentspec train-eagle3 --skip 240`` for agent
turns and records >= 400 for rewrites held them out):

  agent      agent-turn prompts (records from 150, the system message + latest messages within
             --max-prompt tokens): half the text is new, suffix drafts are short
  rewrites   file-rewrite prompts (records from 200): suffix drafts are long

Methods, each with a fresh drafter (no memory of earlier runs):

  plain          no speculation
  suffix         the default drafter (suffix index)
  suffix+eagle3  drafters ["suffix", "eagle3"]: the head backs the suffix drafts (gated)
  eagle3         the head alone, gate off (the head's own acceptance)

Concurrency 1: ``engine.generate`` per prompt; concurrency c > 1: ``BatchEngine(max_batch=c)``.
Reports tokens/s (generated tokens / wall, prefill included), MAT (mean tokens per step), the
accepted tokens by draft source, whether outputs equal plain decoding, and what ran (device,
kernels, dtype). Methods alternate per repeat; medians over repeats.

    python -m benchmarks.bench_eagle3 --out benchmarks/results/issue15/e2e_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    agent_prompts,
    emit_report,
    first_record,
    logger,
    rewrite_prompts,
    write_json,
)

METHODS = {"plain": None, "suffix": ["suffix"], "suffix+eagle3": ["suffix", "eagle3"], "eagle3": ["eagle3"]}

log = logger("bench_eagle3")


def make_drafter(engine, method: str):
    from agentspec.drafting.eagle3_drafter import for_engine
    from agentspec.drafting.registry import build_drafter

    names = METHODS[method]
    if names is None:
        return None
    if names == ["eagle3"]:
        return for_engine(engine, gate=False)
    return build_drafter(names, engine=engine)


def run(engine, prompts, method: str, c: int, max_tokens: int) -> dict:
    from agentspec.backends.embedded.batch import BatchEngine

    drafter = make_drafter(engine, method)
    spec = None if drafter is None else engine_default_spec()
    t0 = time.perf_counter()
    if c == 1:
        gens = [engine.generate(p, max_tokens=max_tokens, spec=spec, drafter=drafter) for p in prompts]
    else:
        with BatchEngine(engine, max_batch=c, budget="fixed" if spec else "off", background=False) as be:
            gens = be.generate_many(prompts, max_tokens=max_tokens, drafter=drafter, spec=spec)
    wall = time.perf_counter() - t0
    tokens = sum(len(g.token_ids) for g in gens)
    steps = sum(g.stats.steps for g in gens)
    by_src: dict[str, dict] = {}
    for g in gens:
        st = g.stats
        for k in st.source_steps:
            row = by_src.setdefault(k, {"steps": 0, "drafted": 0, "accepted": 0})
            row["steps"] += st.source_steps[k]
            row["drafted"] += st.source_drafted.get(k, 0)
            row["accepted"] += st.source_accepted.get(k, 0)
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "mat": round(sum(sum(g.stats.acceptance_lengths) for g in gens) / max(steps, 1), 3),
            "draft_tokens": sum(g.stats.draft_tokens for g in gens),
            "accepted_tokens": sum(g.stats.accepted_tokens for g in gens), "by_source": by_src,
            "draft_ms_per_step": round(1e3 * sum(g.stats.draft_seconds for g in gens) / max(steps, 1), 3),
            "decode_ms_per_step": round(1e3 * sum(g.stats.decode_seconds for g in gens) / max(steps, 1), 3),
            "outputs": [g.token_ids for g in gens]}


def engine_default_spec():
    from agentspec.config import SpecConfig

    return SpecConfig()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--model", help="target model (default: bundled)")
    ap.add_argument("--eagle3", help="head directory (default: the shipped head)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workloads", default="agent,rewrites")
    ap.add_argument("--methods", default="plain,suffix,suffix+eagle3,eagle3")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--agent", type=int, default=8, help="agent-turn prompts")
    ap.add_argument("--rewrites", type=int, default=4, help="rewrite prompts")
    ap.add_argument("--max-prompt", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts-file", type=Path, help="tokenized prompts (JSON {workload: [[ids]]}) instead of --data")
    ap.add_argument("--dump-prompts", type=Path, help="write the tokenized prompts there and exit")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from agentspec.backends.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(model=args.model, device=args.device, eagle3=args.eagle3)
    sets = {}
    for wl in args.workloads.split(","):
        if args.prompts_file:
            sets[wl] = json.loads(args.prompts_file.read_text())[wl]
        elif wl == "agent":
            sets[wl] = agent_prompts(engine, args.data, args.agent, args.max_prompt, first_record(args.data, 150))
        elif wl == "rewrites":
            sets[wl] = rewrite_prompts(engine, args.data, args.rewrites, args.max_prompt, first_record(args.data, 200))
        else:
            raise SystemExit(f"unknown workload {wl!r}")
    if args.dump_prompts:
        args.dump_prompts.write_text(json.dumps(sets))
        return 0
    # warm-up (first forwards pay one-time set-up: kernels, allocator, the head's first load)
    first = next(iter(sets.values()))[0]
    engine.generate(first, max_tokens=8, spec=None)
    if any(METHODS[m] and "eagle3" in METHODS[m] for m in args.methods.split(",")):
        engine.generate(first, max_tokens=8, drafter=make_drafter(engine, "eagle3"))
    methods = args.methods.split(",")
    conc = [int(c) for c in args.concurrency.split(",")]
    report = {"machine": engine.kernel_info(), "device": str(engine.device), "row_cost": engine.row_cost, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "head": str(args.eagle3 or "shipped"), "results": {}}
    raw: dict = {}
    for wl, prompts in sets.items():
        for c in conc:
            for rep in range(args.repeats):
                order = methods if rep % 2 == 0 else list(reversed(methods))
                for m in order:
                    try:
                        r = run(engine, prompts, m, c, args.max_tokens)
                    except Exception as e:  # noqa: BLE001 - one failing method must not lose the others
                        log(f"{wl} c={c} {m}: {type(e).__name__}: {e}")
                        raw.setdefault((wl, c, m), []).append({"error": f"{type(e).__name__}: {e}"})
                        continue
                    raw.setdefault((wl, c, m), []).append(r)
                    log(f"{wl} c={c} rep {rep} {m}: {r['tokens_per_s']} tok/s, MAT {r['mat']}")
            plain = next((x for x in raw.get((wl, c, "plain"), []) if "outputs" in x), None)
            for m in methods:
                runs = [x for x in raw.get((wl, c, m), []) if "outputs" in x]
                if not runs:
                    report["results"].setdefault(wl, {}).setdefault(str(c), {})[m] = raw.get((wl, c, m), [{}])[-1]
                    continue
                best = dict(runs[-1])
                outs = best.pop("outputs")
                best["tokens_per_s"] = round(statistics.median(x["tokens_per_s"] for x in runs), 2)
                best["tokens_per_s_runs"] = [x["tokens_per_s"] for x in runs]
                best["identical_to_plain"] = None if plain is None else outs == plain["outputs"]
                report["results"].setdefault(wl, {}).setdefault(str(c), {})[m] = best
            row = report["results"][wl][str(c)]
            base = row.get("suffix", {}).get("tokens_per_s")
            for m in methods:
                if base and row.get(m, {}).get("tokens_per_s"):
                    row[m]["speed_vs_suffix"] = round(row[m]["tokens_per_s"] / base, 3)
            if args.out:   # after every cell: a long run that fails keeps what it measured
                write_json(report, args.out, indent=1)
    emit_report(report, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
