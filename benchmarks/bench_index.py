#!/usr/bin/env python
"""Index cost of our suffix index against arctic-inference's suffix tree, same tokens, one run.

Measures on the recorded streams (benchmarks/replay_data.py), mirroring
benchmarks/peers/arctic_index_bench.py (run in the same invocation in its own venv):

- insert throughput, tokens/s, best of ``--repeat`` fresh builds:
  ``insert_history_tok_s``: outputs fed as arctic caches responses (start with an empty prompt,
  extend by the whole response, stop: the output joins the tenant's history, i.e. two inserts
  per token, like arctic's local + global tree); ``insert_document_tok_s``: the same tokens as
  documents (``add_document``); ``insert_prompt_tok_s``: ``start(req, prompt)``, requests kept
  active;
- bytes per indexed token: ``nbytes`` (the index's own accounting) and process RSS growth, in a
  fresh child process each, for the history arena and for active prompts;
- propose latency (p50/p99 µs) with >= ``--tokens`` tokens of history indexed, on records never
  indexed, teacher-forced (propose timed; propose + extend timed separately).

Prints one JSON object with both sides and the ratios.

    python -m benchmarks.bench_index [--data DIR] [--tokens 1000000]
        [--vllm-python /work/venvs/vllm/bin/python]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import replay_data  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    PEERS,
    ROOT,
    emit_report,
    is_sample,
    logger,
    machine_record,
    rss_bytes,
)
from benchmarks.replay import accepted_length  # noqa: E402

log = logger("bench_index")


def streams(data: Path) -> list[list[tuple[str, np.ndarray, np.ndarray]]]:
    return [replay_data.load(replay_data.tokenize(data, n)) for n in replay_data.DATASETS]


def pick(all_recs, tokens: int, kind: str, holdout: int):
    """Segments (response or prompt) in file order, stream after stream, until >= tokens;
    the last ``holdout`` records of each stream are never used (they are the queries)."""
    out, total = [], 0
    for recs in all_recs:
        for _, p, r in recs[:len(recs) - holdout]:
            if total >= tokens:
                return out, total
            seg = r if kind == "response" else p
            if len(seg):
                out.append(seg)
                total += len(seg)
    return out, total


def history_segments(all_recs, tokens, holdout):
    segs, n = pick(all_recs, tokens, "response", holdout)
    if n < tokens:  # not enough response text: top up with prompts, like the arctic peer
        more, _ = pick(all_recs, tokens - n, "prompt", holdout)
        segs += more
    return segs


def build(kind: str, segs):
    from suffix_index import SuffixIndex

    ix = SuffixIndex(history_tokens=1 << 40)
    t0 = time.perf_counter()
    if kind == "history":
        for k, s in enumerate(segs):
            ix.start(f"h{k}", s[:0])
            ix.extend(f"h{k}", s)
            ix.stop(f"h{k}")
    elif kind == "document":
        for k, s in enumerate(segs):
            ix.add_document(f"d{k}", s)
    else:
        for k, s in enumerate(segs):
            ix.start(f"p{k}", s)
    return time.perf_counter() - t0, ix


def child(kind: str, args) -> dict:
    all_recs = streams(args.data)
    segs = history_segments(all_recs, args.tokens, args.holdout) if kind != "prompt" else \
        pick(all_recs, args.tokens, "prompt", args.holdout)[0]
    n = int(sum(len(s) for s in segs))
    gc.collect()
    before = rss_bytes()
    secs, ix = build(kind, segs)
    grown = rss_bytes() - before
    out = {f"{kind}_tokens": n, f"{kind}_bytes_per_token": ix.nbytes / n, f"{kind}_bytes_per_token_rss": grown / n}
    runs = [secs]
    for _ in range(args.repeat - 1):
        del ix
        gc.collect()
        secs, ix = build(kind, segs)
        runs.append(secs)
    out[f"insert_{kind}_tok_s"] = n / min(runs)
    out[f"insert_{kind}_runs_s"] = [round(r, 4) for r in runs]
    if kind == "history":
        out.update(latency(ix, all_recs, args))
    return out


def latency(ix, all_recs, args) -> dict:
    from agentspec.drafting.draft import Draft  # noqa: F401  (warm the import outside the timing)

    perf = time.perf_counter_ns
    prop, step = [], []
    per_stream = args.queries // len(all_recs)
    for s, recs in enumerate(all_recs):
        calls = 0
        for k, (_, p, r) in enumerate(recs[len(recs) - args.holdout:]):
            if calls >= per_stream:
                break
            rid = f"q{s}-{k}"
            ix.start(rid, p)
            pos, n = 0, len(r)
            rl = r.tolist()
            while pos < n and calls < per_stream:
                t0 = perf()
                d = ix.propose(rid, args.budget)
                t1 = perf()
                a = accepted_length(d.token_ids, d.parents, rl[pos:pos + len(d.token_ids)])
                c = min(a + 1, n - pos)
                t2 = perf()
                ix.extend(rid, r[pos:pos + c])
                t3 = perf()
                prop.append(t1 - t0)
                step.append((t1 - t0) + (t3 - t2))
                pos += c
                calls += 1
            ix.stop(rid)
    return {"propose_p50_us": float(np.percentile(prop, 50)) / 1e3, "propose_p99_us": float(np.percentile(prop, 99)) / 1e3,
            "step_p50_us": float(np.percentile(step, 50)) / 1e3, "step_p99_us": float(np.percentile(step, 99)) / 1e3,
            "queries": len(prop)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=20_000)
    ap.add_argument("--holdout", type=int, default=None,
                    help="last records of each stream kept out of the index, as the queries "
                         "(default: 50; 4 in the shipped sample)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.holdout is None:
        args.holdout = 4 if is_sample(args.data) else 50
    if args._child:
        print(json.dumps(child(args._child, args)))
        return
    fwd = ["--data", str(args.data), "--tokens", str(args.tokens), "--queries", str(args.queries),
           "--holdout", str(args.holdout), "--repeat", str(args.repeat), "--budget", str(args.budget)]
    ours: dict = {}
    for kind in ("history", "document", "prompt"):
        log(f"ours: {kind} ...")
        res = subprocess.run([sys.executable, __file__, "--_child", kind, *fwd], capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(res.stderr)
        ours.update(json.loads(res.stdout.strip().splitlines()[-1]))
    builds: dict = {}
    result = {"benchmark": "bench_index", "tokens": args.tokens, "ours": ours}
    if Path(args.vllm_python).exists():
        log("arctic ...")
        paths = [str(replay_data.tokenize(args.data, n)) for n in replay_data.DATASETS]
        out = ROOT / "bench_out" / "arctic_index.json"
        out.parent.mkdir(exist_ok=True)
        cmd = [args.vllm_python, str(PEERS / "arctic_index_bench.py"),
               "--streams", paths[0], "--streams", paths[1], "--out", str(out), "--tokens", str(args.tokens),
               "--queries", str(args.queries), "--holdout", str(args.holdout), "--repeat", str(args.repeat),
               "--budget", str(args.budget)]
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode == 0:
            arctic = json.loads(out.read_text())
            result["arctic"] = {k: v for k, v in arctic.items() if not isinstance(v, (dict, list))}
            a = result["arctic"]
            result["ratios"] = {
                "insert_history_vs_arctic_response": ours["insert_history_tok_s"] / a["insert_response_tok_s"],
                "insert_document_vs_arctic_global_only": ours["insert_document_tok_s"] / a["insert_global_only_tok_s"],
                "insert_prompt_vs_arctic_prompt": ours["insert_prompt_tok_s"] / a["insert_prompt_tok_s"],
                "propose_p50_arctic_over_ours": a["propose_p50_us"] / ours["propose_p50_us"],
            }
            builds["arctic_inference"] = (arctic.get("params") or {}).get("arctic_inference")
    result["machine"] = machine_record(peers=builds)   # the index alone: no model forward, no kernel plan
    emit_report(result, args.out, indent=1, one_line=True)


if __name__ == "__main__":
    main()
