#!/usr/bin/env python
"""Benchmark peer: SGLang 0.5.23's NGRAM speculative drafter (its C++ n-gram
corpus: trie + optional suffix automaton) in a teacher-forced acceptance replay.

Runs under the python of a dedicated venv, never the project venv (no agentspec
import; only numpy + the SGLang wheel's own ngram code and JIT loader).

Setup (once; CPU only, ~2.2 GB, first run JIT-compiles the C++ corpus in ~25 s
with g++ into ~/.cache/sglang/jit/, later runs reuse it):

    python3 -m venv /work/venvs/sglang
    /work/venvs/sglang/bin/pip install torch==2.13.0        # CPU wheel; never unpinned
    /work/venvs/sglang/bin/pip install apache-tvm-ffi==0.1.11 numpy ninja \\
        orjson psutil pybase64 requests triton packaging pillow starlette \\
        msgspec pydantic_core pyzmq
    /work/venvs/sglang/bin/pip install --no-deps sglang==0.5.23

(`pip` warns that sglang wants torch==2.14.1 and more packages: expected; only
the ngram corpus is used. g++ and ninja must be on PATH.)

Run:

    /work/venvs/sglang/bin/python benchmarks/peers/sglang_ngram_replay.py \\
        --streams ~/.cache/agentspec/replay/file_rewrites-<key>.npz \\
        --out bench_out/sglang_ngram_file_rewrites_worker.json \\
        --budget 32 --records 0:100 --mode worker        # or --mode prompt-corpus

How it is loaded: the real classes `sglang.srt.speculative.cpp_ngram.ngram_corpus.
NgramCorpus` (the worker's wrapper) and, beneath it, `sglang.kernels.ops.
speculative.ngram_corpus` (the wheel's `load_jit` build of csrc/ngram_corpus/*.cpp
via apache-tvm-ffi) are imported with the package `__init__`s of `sglang`,
`sglang.kernels`, `sglang.kernels.ops`, `sglang.kernels.ops.speculative` bypassed
(they pull in the whole server / Triton kernel registry); no SGLang code is copied
except the worker's 5-line `_efficient_concat_last_n` (NGRAMWorker needs a GPU
server to construct).

Replay semantics (one corpus for the whole run; records replayed in file order
from 0, only those in --records START:STOP reported; records after STOP skipped):

  per record (prompt P, response R of n tokens), pos = 0; each step:
    window = last max_trie_depth (18) tokens of P + R[:pos]   (as NGRAMWorker.
             _prepare_draft_tokens builds it), total_len = len(P) + pos;
    draft  = NgramCorpus.batch_get([rid], [window], [total_len]) — stateful
             per-request match (anchors advanced incrementally, as the worker);
    insert = NgramCorpus.batch_put([window]) — the worker inserts exactly the
             same window after every verify (_update_ngram_corpus); the prompt
             is never inserted beyond its last 17 tokens, the last accepted
             tokens of a request are never inserted, nothing is inserted when a
             request finishes (only its match state is erased);
    a      = longest root path of the draft tree matching R[pos], R[pos+1], ...
    c      = min(a + 1, n - pos); pos += c.
  ns per step = synchronize + batch_get (incl. the wrapper's tensor marshalling)
  + batch_put + synchronize (waits for the async insert thread, so the insert
  cost lands in the step that caused it).

  Difference from a live server, kept deliberately: the replay drafts the first
  response token too (pos = 0); SGLang produces it by prefill without a draft.

Modes:
  worker         SGLang defaults: max_trie_depth 18, min/max BFS breadth 1/10,
                 match_type BFS (recency), capacity 10M nodes, no external corpus;
                 speculative_num_draft_tokens = budget + 1 (SGLang counts the root,
                 i.e. the last committed token, as one of the draft tokens; there
                 is no NGRAM-specific maximum, its default is 12 = 11 drafted).
  prompt-corpus  as worker, plus each request's prompt loaded as a named external
                 corpus (suffix automaton; NgramWorker.add_external_corpus /
                 commit_corpus_load, i.e. what POST /add_external_corpus does) before
                 its first step and removed after its last, with
                 external_sam_budget = 16 draft nodes (--sam-budget). SGLang's
                 external corpora are server-wide, so per-request loading is our
                 use of the feature, not a server default. SAM build time per
                 record is reported as `load_ns` (not in the step times).

Output JSON (atomic): {"method": "sglang_ngram", "mode", "params",
  "records": [{"id", "accepted": [a...], "drafted": [non-padding nodes...],
  "ns": [...], "load_ns"?}]} and one stderr summary line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types

import numpy as np

SGLANG_VERSION = "0.5.23"


def load_ngram_corpus_cls():
    """Import SGLang's NgramCorpus without executing the heavy package __init__s."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sglang is not installed in this interpreter (see the docstring)")
    root = list(spec.submodule_search_locations)[0]
    for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.speculative"):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [os.path.join(root, *name.split(".")[1:])]
            sys.modules[name] = mod
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    try:
        from importlib.metadata import version

        ver = version("sglang")
    except Exception:  # pragma: no cover
        ver = "?"
    return NgramCorpus, ver


def efficient_concat_last_n(seq1, seq2, n):
    """Verbatim NGRAMWorker._efficient_concat_last_n (sglang 0.5.23)."""
    seq2_len = len(seq2)
    if seq2_len >= n:
        return seq2[-n:]
    need_from_seq1 = n - seq2_len
    return seq1[-need_from_seq1:] + seq2


def tree_parents(mask: np.ndarray, d: int) -> np.ndarray:
    """Parent of node i = largest j < i with mask[i, j] (as the worker's _derive_tree_links)."""
    m = mask.reshape(d, d).astype(bool)
    lower = np.tril(m, -1)
    has = lower.any(1)
    last = d - 1 - np.argmax(lower[:, ::-1], axis=1)
    return np.where(has, last, -1)


def accept_len(tokens, parents, resp, pos: int, n: int) -> tuple[int, int]:
    """(accepted, non-padding drafted nodes) for one draft tree; node 0 is the root."""
    d = len(tokens)
    children: dict[int, list[int]] = {}
    for i in range(1, d):
        children.setdefault(int(parents[i]), []).append(i)
    a, cur = 0, 0
    while pos + a < n:
        want = resp[pos + a]
        nxt = -1
        for j in children.get(cur, ()):
            if tokens[j] == want:
                nxt = j
                break
        if nxt < 0:
            break
        cur, a = nxt, a + 1
    # fillResult pads with (token 0, parent root) after the BFS-ordered real nodes.
    pad = 0
    i = d - 1
    while i >= 1 and tokens[i] == 0 and parents[i] == 0:
        pad += 1
        i -= 1
    return a, d - 1 - pad


def parse_range(s: str | None, total: int) -> tuple[int, int]:
    if not s:
        return 0, total
    lo, _, hi = s.partition(":")
    lo_i = int(lo) if lo else 0
    hi_i = int(hi) if hi else total
    return max(0, lo_i), min(total, hi_i)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", required=True, help="replay .npz (tokens, offsets, ids)")
    ap.add_argument("--out", required=True, help="output JSON path")
    ap.add_argument("--budget", type=int, default=32, help="max drafted tree nodes per step (root excluded)")
    ap.add_argument("--records", default=None, help="START:STOP of records to report")
    ap.add_argument("--mode", choices=("worker", "prompt-corpus"), default="worker")
    ap.add_argument(
        "--draft-token-num",
        type=int,
        default=None,
        help="override SGLang's speculative_num_draft_tokens (root included; default budget+1)",
    )
    ap.add_argument("--sam-budget", type=int, default=16, help="external_sam_budget for --mode prompt-corpus")
    ap.add_argument("--match-type", choices=("BFS", "PROB"), default="BFS")
    ap.add_argument("--max-trie-depth", type=int, default=18)
    ap.add_argument("--min-bfs-breadth", type=int, default=1)
    ap.add_argument("--max-bfs-breadth", type=int, default=10)
    ap.add_argument("--capacity", type=int, default=10 * 1000 * 1000)
    ap.add_argument("--verbose", action="store_true", help="progress lines on stderr")
    args = ap.parse_args(argv)

    NgramCorpus, ver = load_ngram_corpus_cls()

    z = np.load(args.streams)
    tokens = z["tokens"]
    offsets = z["offsets"]
    ids = [str(x) for x in z["ids"]]
    start, stop = parse_range(args.records, len(offsets))

    draft_token_num = args.draft_token_num if args.draft_token_num is not None else args.budget + 1
    sam_budget = args.sam_budget if args.mode == "prompt-corpus" else 0
    if sam_budget > draft_token_num - 1:
        raise SystemExit(f"--sam-budget must be <= draft_token_num - 1 ({draft_token_num - 1}), as SGLang checks")
    depth = args.max_trie_depth

    t_build = time.perf_counter()
    corpus = NgramCorpus(
        max_trie_depth=depth,
        min_bfs_breadth=args.min_bfs_breadth,
        max_bfs_breadth=args.max_bfs_breadth,
        draft_token_num=draft_token_num,
        match_type=args.match_type,
        capacity=args.capacity,
        external_sam_budget=sam_budget,
    )
    init_s = time.perf_counter() - t_build

    params = {
        "sglang_version": ver,
        "budget": args.budget,
        "speculative_num_draft_tokens": draft_token_num,
        "max_drafted_nodes": draft_token_num - 1,
        "max_trie_depth": depth,
        "min_bfs_breadth": args.min_bfs_breadth,
        "max_bfs_breadth": args.max_bfs_breadth,
        "match_type": args.match_type,
        "capacity": args.capacity,
        "external_sam_budget": sam_budget,
        "external_corpus": "each request's prompt (suffix automaton), loaded before and removed after it"
        if args.mode == "prompt-corpus"
        else None,
        "records": [start, stop],
        "streams": os.path.basename(args.streams),
        "insert": "worker window (last max_trie_depth tokens of prompt+output) after every step",
        "first_token_drafted": True,
        "step_ns": "synchronize + batch_get + batch_put + synchronize",
    }

    perf = time.perf_counter_ns
    out_records = []
    t0 = time.perf_counter()
    for k in range(stop):
        p0, r0, end = (int(x) for x in offsets[k])
        prompt = tokens[p0:r0].tolist()
        resp = tokens[r0:end].tolist()
        n = len(resp)
        rid = f"req-{k}"
        report = k >= start
        input_tail = prompt[-depth:]

        load_ns = None
        corpus_id = None
        if args.mode == "prompt-corpus" and prompt:
            corpus_id = f"prompt-{k}"
            tl = perf()
            loaded = corpus.load_external_corpus_named(corpus_id, [prompt])
            corpus.commit_external_corpus_load(corpus_id, loaded)
            load_ns = perf() - tl

        acc_l, dr_l, ns_l = [], [], []
        pos = 0
        while pos < n:
            window = efficient_concat_last_n(input_tail, resp[max(0, pos - depth) : pos], depth)
            total_len = len(prompt) + pos
            ts = perf()
            corpus.synchronize()
            drafts, mask = corpus.batch_get([rid], [window], [total_len])
            corpus.batch_put([window])
            corpus.synchronize()
            dt = perf() - ts
            parents = tree_parents(mask, draft_token_num)
            a, drafted = accept_len(drafts.tolist(), parents.tolist(), resp, pos, n)
            c = min(a + 1, n - pos)
            pos += c
            if report:
                acc_l.append(a)
                dr_l.append(drafted)
                ns_l.append(dt)
        corpus.erase_match_state([rid])
        if corpus_id is not None:
            corpus.remove_external_corpus(corpus_id)
        if report:
            rec = {"id": ids[k], "accepted": acc_l, "drafted": dr_l, "ns": ns_l}
            if load_ns is not None:
                rec["load_ns"] = load_ns
            out_records.append(rec)
        if args.verbose and (k + 1) % 25 == 0:
            print(f"[sglang_ngram] {k + 1}/{stop} records, {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0

    doc = {"method": "sglang_ngram", "mode": args.mode, "params": params, "records": out_records}
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, args.out)

    steps = committed = drafted_sum = 0
    all_ns = []
    for rec, k in zip(out_records, range(start, stop)):
        n = int(offsets[k][2] - offsets[k][1])
        pos = 0
        for a in rec["accepted"]:
            c = min(a + 1, n - pos)
            pos += c
            committed += c
        steps += len(rec["accepted"])
        drafted_sum += sum(rec["drafted"])
        all_ns.extend(rec["ns"])
    ns_arr = np.asarray(all_ns, dtype=np.float64) if all_ns else np.zeros(1)
    mat = committed / steps if steps else float("nan")
    print(
        f"sglang_ngram mode={args.mode} {os.path.basename(args.streams)} records={start}:{stop} "
        f"steps={steps} MAT={mat:.3f} mean_drafted={drafted_sum / max(steps, 1):.2f} "
        f"p50={np.percentile(ns_arr, 50) / 1e3:.1f}us p99={np.percentile(ns_arr, 99) / 1e3:.1f}us "
        f"wall={wall:.1f}s init={init_s:.1f}s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
