"""Teacher-forced acceptance of the EAGLE-3 head vs the suffix index, per draft depth.

Development prompts the head never saw (agent turns: the first --records records; training
skipped the first 240 and their conversations; rewrites: records from 200, training used
>= 400). Each prompt's response is the target's own greedy output (generated once with the
engine and cached), so a draft token is accepted exactly when real decoding would accept it.
The prompt + response run through the target once, teacher-forced, for the feature layers'
states; then decoding is replayed step by step through each drafter's real interface (start,
observe_hidden, extend, propose), verification walking the draft tree against the response:

  suffix          the suffix index (request context + the tenant's earlier outputs)
  eagle3          the head alone (no gate)
  suffix+eagle3   the route ["suffix", "eagle3"]: the head backs the suffix drafts when their
                  expected accepted length is < 3 (FallbackDrafter, merge)

Reports tau (mean accepted length, bonus token included), P(accepted >= d) per depth d, the
accepted tokens by source in the combined drafter (where the head wins).

    python -m benchmarks.bench_eagle3_acceptance --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    emit_report,
    first_record,
    logger,
    machine_record,
    select_prompts,
)

DEPTHS = 8

log = logger("bench_eagle3_acceptance")


def dev_records(engine, data: Path, n_agent: int, n_rewrites: int, max_prompt: int, max_tokens: int,
                cache: Path) -> dict[str, list[dict]]:
    from agentspec.training.distill import (
        PromptItem,
        distill,
        load_prompt_items,
        read_distilled,
    )

    out = {}
    agent = load_prompt_items([data / "agent_turns.jsonl"], engine.tokenizer, max_prompt=max_prompt, limit=n_agent)
    rewrites = select_prompts(engine, data, n_rewrites, max_prompt, first_record(data, 200))
    rew = [PromptItem(rid, ids) for rid, ids in rewrites]
    for name, items in (("agent", agent), ("rewrites", rew)):
        f = cache / f"dev_{name}.jsonl"
        distill(engine, items, f, max_tokens=max_tokens, samples=0, concurrency=4, progress=False)
        want = {it.id for it in items}
        out[name] = [r for r in read_distilled(f) if r["id"] in want and r["temperature"] == 0.0]
    return out


@torch.inference_mode()
def features(engine, ids: list[int], layers) -> dict[int, torch.Tensor]:
    cache = engine.new_cache(len(ids) + 1)
    _, hidden = engine.model(torch.tensor(ids), torch.arange(len(ids)), cache, logits_rows=slice(0, 1),
                             hidden_layers=tuple(layers))
    return {k: v.clone() for k, v in hidden.items()}


def replay(drafter, recs, feats_of, budget: int, layers, tag: str) -> dict:
    from agentspec.kernels.tree import tree_depths, with_root

    from agentspec.drafting.protocols import wants_hidden_states
    from agentspec.decode.verify import greedy_verify

    wants = bool(wants_hidden_states(drafter))
    acc_hist = [0] * (DEPTHS + 2)
    steps = tokens = 0
    by_src: dict[str, int] = {}
    t0 = time.perf_counter()
    for k, r in enumerate(recs):
        P, resp = r["prompt_ids"], r["response_ids"]
        if len(resp) < 2:
            continue
        x = list(P) + list(resp)
        feats = feats_of(k)
        rid = f"{tag}-{k}"
        drafter.start(rid, P, tenant="bench")
        if wants:
            drafter.observe_hidden(rid, P, {i: feats[i][:len(P)] for i in layers})
        drafter.extend(rid, [x[len(P)]])
        pos = len(P)
        while pos < len(x) - 1:
            d = drafter.propose(rid, min(budget, len(x) - 1 - pos))
            parents = with_root(d.parents)
            depths = tree_depths(parents)
            toks = [x[pos], *d.token_ids]
            path, _ = greedy_verify(toks, parents, [x[min(pos + dep + 1, len(x) - 1)] for dep in depths])
            n = len(path) - 1
            n = min(n, len(x) - 1 - pos)
            acc_hist[min(n, DEPTHS + 1)] += 1
            steps += 1
            tokens += n + 1
            nsrc = getattr(d, "node_sources", None)
            for i in path[1:]:
                src = nsrc[i - 1] if nsrc else (d.source or "none")
                by_src[src] = by_src.get(src, 0) + 1
            if wants:
                drafter.observe_hidden(rid, x[pos:pos + n + 1], {i: feats[i][pos:pos + n + 1] for i in layers})
            drafter.extend(rid, x[pos + 1:pos + n + 2])
            pos += n + 1
        drafter.stop(rid)
    ge = [sum(acc_hist[d:]) / max(steps, 1) for d in range(1, DEPTHS + 1)]
    return {"steps": steps, "tokens": tokens, "tau": round(tokens / max(steps, 1), 3),
            "p_accepted_ge_depth": [round(v, 3) for v in ge], "accepted_by_source": by_src,
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--eagle3", help="head directory (default: the shipped head)")
    ap.add_argument("--agent", type=int, default=40, help="development agent-turn records")
    ap.add_argument("--rewrites", type=int, default=6)
    ap.add_argument("--max-prompt", type=int, default=1536)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "agentspec" / "eagle3_dev")
    ap.add_argument("--workloads", default="agent,rewrites")
    ap.add_argument("--head-options", default="{}", help="JSON options for the head's drafter (depth, topk, ...)")
    ap.add_argument("--min-expected", type=float, help="FallbackDrafter.min_expected (default: the registry's)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from agentspec.drafting import SuffixDrafter
    from agentspec.drafting.combine import FallbackDrafter
    from agentspec.drafting.eagle3_drafter import for_engine
    from agentspec.drafting.registry import FALLBACK_MIN_EXPECTED
    from agentspec.backends.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(eagle3=args.eagle3, quiet=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    sets = dev_records(engine, args.data, args.agent, args.rewrites, args.max_prompt, args.max_tokens, args.cache)
    hopts = json.loads(args.head_options)
    min_expected = FALLBACK_MIN_EXPECTED if args.min_expected is None else args.min_expected
    head_drafter = for_engine(engine, gate=False, **hopts)
    layers = head_drafter.hidden_layers
    report = {"benchmark": "bench_eagle3_acceptance", "machine": machine_record(engine), "budget": args.budget, "head": args.eagle3 or "shipped",
              "min_expected": min_expected, "head_options": hopts, "results": {}}
    for wl, recs in sets.items():
        if wl not in args.workloads.split(","):
            continue
        log(f"{wl}: {len(recs)} records, {sum(len(r['response_ids']) for r in recs)} response tokens")
        cache = {}

        def feats_of(k, recs=recs, cache=cache):
            if k not in cache:
                cache.clear()
                cache[k] = features(engine, list(recs[k]["prompt_ids"]) + list(recs[k]["response_ids"]), layers)
            return cache[k]

        res = {}
        for name, make in (("suffix", lambda: SuffixDrafter(vocab_size=engine.vocab_size)),
                           ("eagle3", lambda: for_engine(engine, gate=False, **hopts)),
                           ("suffix+eagle3", lambda: FallbackDrafter(SuffixDrafter(vocab_size=engine.vocab_size),
                                                                     for_engine(engine, gate=False, **hopts),
                                                                     mode="merge", min_expected=min_expected))):
            res[name] = replay(make(), recs, feats_of, args.budget, layers, f"{wl}-{name}")
            log(f"{wl} {name}: tau {res[name]['tau']}, P(acc>=d) {res[name]['p_accepted_ge_depth'][:4]}")
        res["tau_ratio_combined_vs_suffix"] = round(res["suffix+eagle3"]["tau"] / res["suffix"]["tau"], 3)
        report["results"][wl] = res
    emit_report(report, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
