"""Prefix cache on multi-turn agent replays: time to first token with the cache and without.

Replays the first turns of agent trajectories (``agent_turns.jsonl`` in ``--data-dir``: by default
the synthetic sample in benchmarks/data, or recorded mini-swe-agent trajectories; each turn's
prompt is the message history up to that turn, so it extends the previous turn's prompt)
through the embedded engine, greedy. Every turn runs twice back to back, without the cache and
with it (the cache kept across the conversation's turns), so machine load drifts alike for both.
Prints JSON: per-turn TTFT, prefilled and cached tokens, whether the outputs are identical, and
the TTFT p50 from turn 3 on with its ratio.

    .venv/bin/python -m benchmarks.bench_prefix_cache --tasks 3 --turns 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import DATA, DATA_HELP, conversations, emit_report, machine_record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--tasks", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=4096, help="skip trajectories with longer prompts")
    ap.add_argument("--no-spec", action="store_true", help="plain decoding (TTFT does not depend on it)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()

    import agentspec
    from agentspec.backends.embedded.prefix_cache import PrefixCache

    engine = agentspec.Engine.embedded(quiet=True)
    convs = conversations(args.data_dir / "agent_turns.jsonl", engine, tasks=args.tasks, turns=args.turns,
                          max_prompt=args.max_prompt)
    spec = None if args.no_spec else agentspec.SpecConfig()
    engine.generate(convs[0][1][0][:300], max_tokens=4, spec=None)   # warm-up
    rows = []
    for task, prompts in convs:
        cache = PrefixCache(engine.prefix_cache.capacity_bytes)   # this conversation's own, empty
        for turn, ids in enumerate(prompts, start=1):
            res = {}
            for mode, pc in (("off", None), ("on", cache)):
                engine.prefix_cache = pc
                g = engine.generate(ids, max_tokens=args.max_tokens, spec=spec, tenant=task)
                res[mode] = g
            off, on = res["off"], res["on"]
            rows.append({"task": task, "turn": turn, "prompt_tokens": len(ids),
                         "ttft_off_ms": round(off.stats.prefill_seconds * 1e3, 1),
                         "ttft_on_ms": round(on.stats.prefill_seconds * 1e3, 1),
                         "cached_tokens": on.stats.cached_tokens,
                         "prefilled_tokens_on": len(ids) - on.stats.cached_tokens,
                         "identical": off.token_ids == on.token_ids, "completion_tokens": len(on.token_ids)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    late = [r for r in rows if r["turn"] >= 3]
    p50_off = statistics.median(r["ttft_off_ms"] for r in late) if late else None
    p50_on = statistics.median(r["ttft_on_ms"] for r in late) if late else None
    emit_report({
        "benchmark": "prefix_cache", "tasks": [t for t, _ in convs], "turns": args.turns,
        "max_tokens": args.max_tokens, "spec": not args.no_spec, "machine": machine_record(engine),
        "ttft_p50_turn3plus_off_ms": p50_off, "ttft_p50_turn3plus_on_ms": p50_on,
        "ttft_ratio_turn3plus": round(p50_off / p50_on, 2) if p50_on else None,
        "prefilled_tokens_off": sum(r["prompt_tokens"] for r in rows),
        "prefilled_tokens_on": sum(r["prefilled_tokens_on"] for r in rows),
        "identical": sum(r["identical"] for r in rows), "runs": len(rows), "per_turn": rows,
    }, args.out, indent=1)


if __name__ == "__main__":
    main()
