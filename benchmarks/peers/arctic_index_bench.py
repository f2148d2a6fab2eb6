"""Benchmark peer: index cost of arctic-inference's suffix decoding on our token streams.

Measures, on the cached token streams written by ``benchmarks/replay_data.py``:

(a) insert throughput (tokens/s)
    * ``insert_response_tok_s``: responses cached the way vLLM does it, through
      ``SuffixDecodingCache``: ``start_request(rid, [])``, ``add_active_response(rid, response)``
      (one call per record, int32 ndarray: the zero-copy overload), ``stop_request(rid)``.
      NB ``add_active_response`` extends *both* the request's local tree and the global tree, so
      this is two tree inserts per token (what vLLM pays);
    * ``insert_response_stepwise_tok_s``: the same, but one ``add_active_response`` call per token
      with a Python list (vLLM's call pattern for steps that commit a single token; same tokens
      unless ``--stepwise-tokens`` is given);
    * ``insert_global_only_tok_s``: the raw native ``SuffixTree.extend_ndarray`` into one tree (the
      global-tree part alone);
    * ``insert_prompt_tok_s``: ``start_request(rid, prompt)``, which builds the per-request prompt
      tree (kept only while the request is active).
    Records are taken in file order, streams in the order given, until ``--tokens`` tokens are
    indexed.  If the streams hold fewer response tokens than ``--tokens`` (agent_turns has ~112k),
    the global tree is topped up with prompts fed the same way, and the JSON says how many.
    Each insert figure is the fastest of ``--repeat`` builds (fresh structure each; all runs are
    listed in ``*_runs``), since the machine may be shared.
(b) bytes per indexed token, two ways: arctic's own accounting, ``SuffixTree.estimate_memory()``
    (what arctic's simulator prints; it sums node structs, child hash maps, sequences), and
    process RSS growth (``/proc/self/statm``) around the first build, each measurement in a
    fresh child process (``sys.executable`` re-running this file) with the data loaded
    beforehand.  The global-tree figures cover responses only: the per-request prompt trees are
    freed at ``stop_request``; the prompt-tree figures keep all those requests active.
(c) ``speculate`` latency p50/p99 (µs) with the global tree holding >= ``--tokens`` tokens:
    records *not* used for indexing (per stream, in file order; the last ``--holdout`` records
    of every stream are never indexed, so each stream has some) are replayed teacher-forced
    (``start_request(prompt)``, then per step: context = last ``max_tree_depth`` tokens of
    prompt + response so far, ``speculate`` timed, commit accepted + 1 with
    ``add_active_response``, untimed) until ``--queries`` calls; at each step both the tree draft
    (``use_tree_spec=True``, the replay's default) and the path draft (vLLM's default) are timed on
    the same state (the query responses join the global tree as they are committed, as in vLLM).

Parameters follow vLLM's defaults (max_tree_depth=24, max_cached_requests=10000,
max_spec_factor=1.0, max_spec_offset=0.0, min_token_prob=0.1) with max_spec_tokens=--budget.
Timings are single-threaded wall clock (perf_counter_ns); other load on the machine shows up.

Run (needs only numpy + arctic_inference, e.g. the vllm venv)::

  /work/venvs/vllm/bin/python benchmarks/peers/arctic_index_bench.py \\
      --streams ~/.cache/agentspec/replay/file_rewrites-<key>.npz \\
      --streams ~/.cache/agentspec/replay/agent_turns-<key>.npz --out /tmp/arctic_index.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def load_streams(paths):
    """[(name, tokens int32, offsets (n,3))] in the order given."""
    out = []
    for p in paths:
        z = np.load(p)
        out.append((os.path.basename(p), np.ascontiguousarray(z["tokens"], np.int32),
                    z["offsets"].astype(np.int64)))
    return out


def reserved(streams, holdout: int):
    """The last ``holdout`` records of each stream: never indexed, always available as queries."""
    return {(s, i) for s, (_, _, offs) in enumerate(streams)
            for i in range(max(0, len(offs) - holdout), len(offs))}


def pick(streams, tokens: int, kind: str, exclude=frozenset()):
    """Records (stream index, record index) in order until >= tokens of ``kind`` are reached."""
    col = (1, 2) if kind == "response" else (0, 1)
    got, total = [], 0
    for s, (_, _, offs) in enumerate(streams):
        for i in range(len(offs)):
            if total >= tokens:
                return got, total
            if (s, i) in exclude:
                continue
            n = int(offs[i, col[1]] - offs[i, col[0]])
            if n:
                got.append((s, i))
                total += n
    return got, total


def seg(streams, s, i, kind):
    _, toks, offs = streams[s]
    a, b, c = (int(x) for x in offs[i])
    return toks[b:c] if kind == "response" else toks[a:b]


def percentiles(ns):
    a = np.asarray(ns, np.int64)
    if not len(a):
        return {"n": 0}
    return {"n": int(len(a)), "p50_us": float(np.percentile(a, 50)) / 1e3,
            "p99_us": float(np.percentile(a, 99)) / 1e3, "mean_us": float(a.mean()) / 1e3}


# ---------------------------------------------------------------------------- children


def global_seqs(streams, tokens, exclude):
    """Sequences for the global tree: responses in order, topped up with prompts if short."""
    recs, n_resp = pick(streams, tokens, "response", exclude)
    chunks = [seg(streams, s, i, "response") for s, i in recs]
    from_prompts = []
    if n_resp < tokens:  # not enough response text: top up with prompts, fed the same way
        more, _ = pick(streams, tokens - n_resp, "prompt", exclude)
        from_prompts = [seg(streams, s, i, "prompt") for s, i in more]
    comp = {"records_responses": len(chunks), "tokens_responses": int(sum(map(len, chunks))),
            "records_prompts": len(from_prompts),
            "tokens_prompts": int(sum(map(len, from_prompts)))}
    return chunks + from_prompts, set(recs), comp


def repeated(build, repeat: int):
    """Run ``build()`` (returns (seconds, structure)) ``repeat`` times, each on a fresh structure.

    RSS growth is taken from the first build only (fresh process, nothing freed yet).
    Returns (list of seconds, rss growth of the first build, the last structure)."""
    times, drss, obj = [], None, None
    for r in range(max(1, repeat)):
        obj = None
        gc.collect()
        rss0 = rss_bytes()
        dt, obj = build()
        gc.collect()
        if r == 0:
            drss = rss_bytes() - rss0
        times.append(dt)
    return times, drss, obj


def rate(total, times, key):
    return {key: total / min(times), f"{key}_runs": [round(total / t) for t in times]}


def child_response(a) -> dict:
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    streams = load_streams(a.streams)
    seqs, used, comp = global_seqs(streams, a.tokens, reserved(streams, a.holdout))
    total = int(sum(map(len, seqs)))

    def build():
        cache = SuffixDecodingCache(max_tree_depth=a.max_tree_depth,
                                    max_cached_requests=a.max_cached_requests)
        t = time.perf_counter_ns()
        for k, arr in enumerate(seqs):
            rid = ("idx", k)
            cache.start_request(rid, [])
            cache.add_active_response(rid, arr)
            cache.stop_request(rid)
        return (time.perf_counter_ns() - t) / 1e9, cache

    times, drss, cache = repeated(build, a.repeat)
    est = cache._global_tree.estimate_memory()
    res = {**rate(total, times, "insert_response_tok_s"),
           "global_tokens": total, **comp,
           "global_estimate_memory_bytes": est, "global_bytes_per_token_estimate": est / total,
           "global_rss_growth_bytes": drss, "global_bytes_per_token_rss": drss / total,
           "cached_requests": len(cache.cached_requests)}
    if len(cache.cached_requests) < comp["records_responses"] + comp["records_prompts"]:
        res["note_eviction"] = "max_cached_requests evicted part of the index"
    res["speculate"] = speculate_latency(cache, streams, used, a)
    return res


def speculate_latency(cache, streams, used, a) -> dict:
    depth = a.max_tree_depth
    per_stream = max(1, a.queries // len(streams))
    perf = time.perf_counter_ns
    tree_ns, path_ns, by_stream = [], [], {}
    kw = dict(max_spec_tokens=a.budget, max_spec_factor=1.0, max_spec_offset=0.0,
              min_token_prob=a.min_token_prob)
    for s, (name, toks, offs) in enumerate(streams):
        held = [i for i in range(len(offs)) if (s, i) not in used]
        source = "records whose responses were not indexed, in file order"
        t_ns, p_ns, d_tree, d_path, calls = [], [], [], [], 0
        for i in held:
            if calls >= per_stream:
                break
            ps, rs, end = (int(x) for x in offs[i])
            seq, resp = toks[ps:end], toks[rs:end]
            plen, n = rs - ps, end - rs
            rid = ("q", s, i)
            cache.start_request(rid, toks[ps:rs])
            pos = 0
            while pos < n and calls < per_stream:
                cur = plen + pos
                ctx = seq[max(0, cur - depth):cur]
                t = perf()
                dp = cache.speculate(rid, ctx, use_tree_spec=False, **kw)
                p_ns.append(perf() - t)
                t = perf()
                dt_ = cache.speculate(rid, ctx, use_tree_spec=True, **kw)
                t_ns.append(perf() - t)
                d_tree.append(len(dt_.token_ids))
                d_path.append(len(dp.token_ids))
                acc = accepted_len(dt_.token_ids, dt_.parents, resp, pos)
                c = min(acc + 1, n - pos)
                cache.add_active_response(rid, resp[pos:pos + c])
                pos += c
                calls += 1
            cache.stop_request(rid)
        by_stream[name] = {"source": source, "tree": percentiles(t_ns), "path": percentiles(p_ns),
                           "mean_drafted_tree": float(np.mean(d_tree)) if d_tree else 0.0,
                           "mean_drafted_path": float(np.mean(d_path)) if d_path else 0.0}
        tree_ns += t_ns
        path_ns += p_ns
    return {"tree": percentiles(tree_ns), "path": percentiles(path_ns), "by_stream": by_stream}


def accepted_len(token_ids, parents, target, pos) -> int:
    m, limit = len(token_ids), len(target) - pos
    depth, best = [0] * m, 0
    for i in range(m):
        p = parents[i]
        d = 1 if p < 0 else (depth[p] + 1 if depth[p] else 0)
        if d and d <= limit and token_ids[i] == target[pos + d - 1]:
            depth[i] = d
            best = max(best, d)
    return best


def child_stepwise(a) -> dict:
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    streams = load_streams(a.streams)
    seqs, _, _ = global_seqs(streams, a.stepwise_tokens or a.tokens, reserved(streams, a.holdout))
    lists = [[[t] for t in arr.tolist()] for arr in seqs]
    total = sum(map(len, lists))

    def build():
        cache = SuffixDecodingCache(max_tree_depth=a.max_tree_depth,
                                    max_cached_requests=a.max_cached_requests)
        t = time.perf_counter_ns()
        for k, toks in enumerate(lists):
            rid = ("step", k)
            cache.start_request(rid, [])
            for one in toks:
                cache.add_active_response(rid, one)
            cache.stop_request(rid)
        return (time.perf_counter_ns() - t) / 1e9, cache

    times, _, _ = repeated(build, a.repeat)
    return {**rate(total, times, "insert_response_stepwise_tok_s"), "stepwise_tokens": total}


def child_global_only(a) -> dict:
    from arctic_inference.suffix_decoding._C import SuffixTree

    streams = load_streams(a.streams)
    seqs, _, _ = global_seqs(streams, a.tokens, reserved(streams, a.holdout))
    total = int(sum(map(len, seqs)))

    def build():
        tree = SuffixTree(a.max_tree_depth)
        t = time.perf_counter_ns()
        for k, arr in enumerate(seqs):
            tree.extend_ndarray(k, arr)
        return (time.perf_counter_ns() - t) / 1e9, tree

    times, drss, tree = repeated(build, a.repeat)
    est = tree.estimate_memory()
    return {**rate(total, times, "insert_global_only_tok_s"), "global_only_tokens": total,
            "global_only_bytes_per_token_estimate": est / total,
            "global_only_bytes_per_token_rss": drss / total}


def child_prompt(a) -> dict:
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    streams = load_streams(a.streams)
    recs, _ = pick(streams, a.tokens, "prompt")
    prompts = [seg(streams, s, i, "prompt") for s, i in recs]
    total = int(sum(map(len, prompts)))

    def build():
        cache = SuffixDecodingCache(max_tree_depth=a.max_tree_depth,
                                    max_cached_requests=a.max_cached_requests)
        t = time.perf_counter_ns()
        for k, p in enumerate(prompts):  # all kept active, so their trees stay alive
            cache.start_request(("p", k), p)
        return (time.perf_counter_ns() - t) / 1e9, cache

    times, drss, cache = repeated(build, a.repeat)
    est = sum(tr.estimate_memory() for tr in cache._local_trees.values())
    return {**rate(total, times, "insert_prompt_tok_s"), "prompt_tokens": total,
            "prompt_records": len(prompts),
            "prompt_estimate_memory_bytes": est, "prompt_bytes_per_token_estimate": est / total,
            "prompt_rss_growth_bytes": drss, "prompt_bytes_per_token_rss": drss / total}


CHILDREN = {"response": child_response, "stepwise": child_stepwise,
            "global_only": child_global_only, "prompt": child_prompt}


# ---------------------------------------------------------------------------- parent


def run_child(kind: str, argv) -> dict:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", kind, *argv],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"child {kind} failed with {p.returncode}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res[f"{kind}_child_wall_s"] = round(time.perf_counter() - t, 2)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", action="append", required=True,
                    help="token stream .npz (repeatable)")
    ap.add_argument("--out", default=None, help="output JSON path (also printed to stdout)")
    ap.add_argument("--tokens", type=int, default=1_000_000,
                    help="tokens to index per measurement")
    ap.add_argument("--queries", type=int, default=20_000,
                    help="speculate calls (split over streams)")
    ap.add_argument("--stepwise-tokens", type=int, default=0,
                    help="tokens for the one-call-per-token insert (default: --tokens)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="builds per insert measurement; the fastest is reported (all in *_runs)")
    ap.add_argument("--holdout", type=int, default=50,
                    help="last N records of each stream are never indexed (query records)")
    ap.add_argument("--budget", type=int, default=32, help="max_spec_tokens for speculate")
    ap.add_argument("--max-tree-depth", type=int, default=24)
    ap.add_argument("--max-cached-requests", type=int, default=10000)
    ap.add_argument("--min-token-prob", type=float, default=0.1)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._child:
        print(json.dumps(CHILDREN[args._child](args)))
        return 0

    fwd = []
    for s in args.streams:
        fwd += ["--streams", s]
    fwd += ["--tokens", str(args.tokens), "--queries", str(args.queries),
            "--stepwise-tokens", str(args.stepwise_tokens), "--budget", str(args.budget),
            "--holdout", str(args.holdout), "--repeat", str(args.repeat),
            "--max-tree-depth", str(args.max_tree_depth),
            "--max-cached-requests", str(args.max_cached_requests),
            "--min-token-prob", str(args.min_token_prob)]
    t0 = time.perf_counter()
    result = {"method": "arctic"}
    try:
        import importlib.metadata as md
        version = md.version("arctic_inference")
    except Exception:  # pragma: no cover
        version = None
    result["params"] = {
        "streams": [os.path.abspath(s) for s in args.streams], "tokens": args.tokens,
        "queries": args.queries, "holdout": args.holdout, "repeat": args.repeat,
        "budget": args.budget, "max_tree_depth": args.max_tree_depth,
        "max_cached_requests": args.max_cached_requests, "min_token_prob": args.min_token_prob,
        "max_spec_factor": 1.0, "max_spec_offset": 0.0, "arctic_inference": version,
    }
    result["memory_method"] = (
        "bytes_per_token_estimate: arctic's SuffixTree.estimate_memory() (its own accounting); "
        "bytes_per_token_rss: /proc/self/statm resident growth around the build in a fresh child "
        "process, data loaded beforehand")
    for kind in ("response", "global_only", "prompt", "stepwise"):
        print(f"[arctic_index_bench] {kind} ...", file=sys.stderr, flush=True)
        result.update(run_child(kind, fwd))
    sp = result.pop("speculate")
    result["propose_p50_us"] = sp["tree"].get("p50_us")
    result["propose_p99_us"] = sp["tree"].get("p99_us")
    result["propose_path_p50_us"] = sp["path"].get("p50_us")
    result["propose_path_p99_us"] = sp["path"].get("p99_us")
    result["speculate"] = sp
    result["elapsed_s"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(result, indent=1)
    if args.out:
        d = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(d, exist_ok=True)
        tmp = f"{args.out}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
