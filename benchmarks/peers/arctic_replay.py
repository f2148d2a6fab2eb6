"""Benchmark peer: teacher-forced acceptance replay of arctic-inference's suffix decoding.

Replays cached token streams (``.npz`` written by ``benchmarks/replay_data.py``) through
``arctic_inference.suffix_decoding.SuffixDecodingCache`` the way vLLM's ``suffix`` method drives
it, with the recorded response standing in for the target model (like arctic-inference's own
``suffix_decoding/simulator.py``), and records per step how many drafted tokens would have been
accepted and how long the drafter took.

Semantics (one cache for the whole run, i.e. a single tenant; records in file order):

* for every record ``0 .. STOP-1`` (records before START only warm the cache and are not
  reported): ``start_request(i, prompt)`` builds the per-request prompt tree (and allocates the
  response slot in the global tree; FIFO eviction beyond ``--max-cached-requests``);
* ``pos = 0``; while ``pos < n`` (n = response length):
  - ``speculate(i, context, max_spec_tokens=budget, max_spec_factor=1.0, max_spec_offset=0.0,
    min_token_prob, use_tree_spec)`` where ``context`` is the last ``max_tree_depth`` tokens of
    prompt + response[:pos] (vLLM passes exactly this window);
  - accepted ``a`` = length of the longest root path of the draft tree (``parents[i] == -1`` is a
    root child) whose tokens equal ``response[pos], response[pos+1], ...``;
  - commit ``c = min(a + 1, n - pos)`` tokens (accepted + bonus) with ``add_active_response``
    (passed as a Python list, as vLLM passes ``sampled_ids``); ``pos += c``;
  - the step's time is ``perf_counter_ns`` around ``speculate`` plus around
    ``add_active_response``;
* ``stop_request(i)``: the prompt tree is dropped, the response stays in the global tree for
  later requests (as in vLLM).

vLLM's defaults (``SpeculativeConfig``): ``suffix_decoding_max_tree_depth=24``,
``suffix_decoding_max_cached_requests=10000``, ``suffix_decoding_max_spec_factor=1.0``,
``suffix_decoding_min_token_prob=0.1``; vLLM does *not* pass ``use_tree_spec`` (so it drafts a
single path, ``--no-tree`` here) and leaves ``max_spec_offset`` at 0.  Note that arctic caps a
draft path at ``max_spec_factor * match_len`` tokens with ``match_len < len(context) <=
max_tree_depth``, and suffixes are only indexed ``max_tree_depth`` deep (match + draft <= depth),
so with vLLM's depth of 24 at most 12 tokens can be accepted per step whatever ``--budget`` says
(arctic's own default depth is 64; on file_rewrites 0:100 that doubles MAT from 10.2 to 20.0).

Output JSON (written atomically)::

  {"method": "arctic", "params": {...}, "summary": {...},
   "records": [{"id", "response_len", "accepted": [a per step], "drafted": [draft size per step],
                "ns": [speculate + add_active_response ns per step],
                "start_ns": start_request(prompt) ns (prompt-tree build; not in "ns")}]}

A one-line summary goes to stderr: MAT = sum(committed) / steps over reported records, mean
drafted tokens per step, p50 / p99 step time in microseconds.

Run (needs only numpy + arctic_inference, e.g. the vllm venv)::

  /work/venvs/vllm/bin/python benchmarks/peers/arctic_replay.py \\
      --streams ~/.cache/agentspec/replay/file_rewrites-<key>.npz --out /tmp/arctic_fr.json \\
      --records 0:100
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def load_streams(path: str):
    z = np.load(path)
    toks = np.ascontiguousarray(z["tokens"], dtype=np.int32)
    offs = z["offsets"].astype(np.int64)
    ids = z["ids"]
    return toks, offs, [str(x) for x in ids]


def parse_range(spec: str | None, n: int) -> tuple[int, int]:
    if not spec:
        return 0, n
    a, _, b = spec.partition(":")
    start = int(a) if a else 0
    stop = int(b) if b else n
    start, stop = max(0, start), min(n, stop)
    if start > stop:
        raise SystemExit(f"bad --records {spec!r} for {n} records")
    return start, stop


def accepted_len(token_ids, parents, target: np.ndarray, pos: int) -> int:
    """Longest root path of the draft tree matching ``target[pos:]`` (parents precede children)."""
    m = len(token_ids)
    if m == 0:
        return 0
    limit = len(target) - pos
    depth = [0] * m  # >0: node i lies on a matching path at this depth; 0: no match
    best = 0
    for i in range(m):
        p = parents[i]
        if p < 0:
            d = 1
        else:
            dp = depth[p]
            if dp == 0:
                continue
            d = dp + 1
        if d <= limit and token_ids[i] == target[pos + d - 1]:
            depth[i] = d
            if d > best:
                best = d
    return best


def replay(args) -> dict:
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    toks, offs, ids = load_streams(args.streams)
    start, stop = parse_range(args.records, len(offs))
    depth = args.max_tree_depth
    use_tree = not args.no_tree
    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=args.max_cached_requests)
    perf = time.perf_counter_ns
    out_records = []
    t0 = time.perf_counter()
    for i in range(stop):
        ps, rs, end = (int(x) for x in offs[i])
        prompt = toks[ps:rs]          # contiguous int32 views (zero-copy ndarray overloads)
        resp = toks[rs:end]
        seq = toks[ps:end]            # prompt + response, for the context window
        plen, n = rs - ps, end - rs
        resp_list = resp.tolist()
        req = i                        # unique per record (record ids need not be)
        t = perf()
        cache.start_request(req, prompt)
        start_ns = perf() - t
        acc, drafted, ns = [], [], []
        pos = 0
        while pos < n:
            cur = plen + pos
            context = seq[max(0, cur - depth):cur]
            t = perf()
            draft = cache.speculate(req, context, max_spec_tokens=args.budget,
                                    max_spec_factor=args.max_spec_factor,
                                    max_spec_offset=args.max_spec_offset,
                                    min_token_prob=args.min_token_prob,
                                    use_tree_spec=use_tree)
            dt = perf() - t
            a = accepted_len(draft.token_ids, draft.parents, resp, pos)
            c = min(a + 1, n - pos)
            chunk = resp_list[pos:pos + c]
            t = perf()
            cache.add_active_response(req, chunk)
            dt += perf() - t
            acc.append(a)
            drafted.append(len(draft.token_ids))
            ns.append(dt)
            pos += c
        cache.stop_request(req)
        if i >= start:
            out_records.append({"id": ids[i], "response_len": n, "accepted": acc,
                                "drafted": drafted, "ns": ns, "start_ns": start_ns})
        if args.progress and (i + 1) % args.progress == 0:
            print(f"[arctic_replay] {i + 1}/{stop} records, {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - t0

    steps = sum(len(r["accepted"]) for r in out_records)
    committed = sum(r["response_len"] for r in out_records)
    all_ns = np.concatenate([np.asarray(r["ns"], np.int64) for r in out_records]) \
        if steps else np.zeros(0, np.int64)
    all_drafted = sum(sum(r["drafted"]) for r in out_records)
    all_acc = sum(sum(r["accepted"]) for r in out_records)
    summary = {
        "records": len(out_records),
        "steps": steps,
        "committed": committed,
        "mat": committed / steps if steps else 0.0,
        "mean_accepted": all_acc / steps if steps else 0.0,
        "mean_drafted": all_drafted / steps if steps else 0.0,
        "p50_us": float(np.percentile(all_ns, 50)) / 1e3 if steps else 0.0,
        "p99_us": float(np.percentile(all_ns, 99)) / 1e3 if steps else 0.0,
        "mean_us": float(all_ns.mean()) / 1e3 if steps else 0.0,
        "cached_requests_at_end": len(cache.cached_requests),
        "elapsed_s": round(elapsed, 3),
    }
    try:
        import importlib.metadata as md
        version = md.version("arctic_inference")
    except Exception:  # pragma: no cover
        version = None
    params = {
        "streams": os.path.abspath(args.streams),
        "records": [start, stop],
        "budget": args.budget,
        "max_tree_depth": depth,
        "max_cached_requests": args.max_cached_requests,
        "max_spec_factor": args.max_spec_factor,
        "max_spec_offset": args.max_spec_offset,
        "min_token_prob": args.min_token_prob,
        "use_tree_spec": use_tree,
        "use_cached_prompt": True,
        "context": "last max_tree_depth tokens of prompt + response[:pos]",
        "tenants": 1,
        "arctic_inference": version,
    }
    return {"method": "arctic", "params": params, "summary": summary, "records": out_records}


def write_json_atomic(path: str, obj) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", required=True,
                    help="token stream .npz (benchmarks/replay_data.py)")
    ap.add_argument("--out", required=True, help="output JSON path")
    ap.add_argument("--budget", type=int, default=32, help="max_spec_tokens per step")
    ap.add_argument("--records", default=None,
                    help="START:STOP; replays records [0, STOP), reports [START, STOP)")
    ap.add_argument("--max-tree-depth", type=int, default=24)
    ap.add_argument("--max-cached-requests", type=int, default=10000)
    ap.add_argument("--min-token-prob", type=float, default=0.1)
    ap.add_argument("--max-spec-factor", type=float, default=1.0)
    ap.add_argument("--max-spec-offset", type=float, default=0.0)
    ap.add_argument("--no-tree", action="store_true",
                    help="single-path drafts (what vLLM does; default here is tree speculation)")
    ap.add_argument("--progress", type=int, default=0, help="log every N records to stderr")
    args = ap.parse_args(argv)

    res = replay(args)
    write_json_atomic(args.out, res)
    s = res["summary"]
    print(f"[arctic_replay] {os.path.basename(args.streams)} records {res['params']['records']} "
          f"tree={res['params']['use_tree_spec']} budget={args.budget}: "
          f"MAT {s['mat']:.3f} ({s['committed']} tok / {s['steps']} steps), "
          f"mean drafted {s['mean_drafted']:.2f}, p50 {s['p50_us']:.1f}us p99 {s['p99_us']:.1f}us, "
          f"{s['elapsed_s']:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
