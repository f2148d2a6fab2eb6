#!/usr/bin/env python
"""Workspace indexing cost and edit-to-draftable latency on a large real source tree.

1. Indexes a copy of a real tree (default: this interpreter's standard library, >= 1M tokens)
   end to end: walk, .gitignore, read, tree-sitter chunking, tokenization, suffix index.
   Reports files, chunks, tokens, seconds, tokens/s, resident memory growth, index bytes and
   bytes per indexed token (index accounting and RSS).
2. With the watcher on, edits one line of a ~5k-line file ``--edits`` times and measures, for
   each save, the time until a request drafts the new line (polling the index every 1 ms):
   p50/p99 milliseconds.

Prints one JSON object.

    python -m benchmarks.bench_workspace [--tree DIR] [--edits 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import emit_report, logger, machine_record, rss_bytes  # noqa: E402
from benchmarks.replay import accepted_length  # noqa: E402

log = logger("bench_workspace")


def reproduce_files(ws, tok, tree: Path, n: int) -> dict:
    """A response that reproduces a file the prompt does not hold: teacher-forced MAT of the
    workspace drafter (budget 32) on ``n`` random indexed Python files of 50-400 lines."""
    from agentspec.drafting import SuffixDrafter

    rng = np.random.default_rng(1)
    pool = []
    for rel in ws.files():
        if rel.endswith(".py"):
            text = (tree / rel).read_text(encoding="utf-8", errors="replace")
            if 50 <= text.count("\n") <= 400:
                pool.append((rel, text))
    picks = [pool[i] for i in rng.choice(len(pool), size=min(n, len(pool)), replace=False)]
    drafter = SuffixDrafter(ws.index)
    total_tokens = total_steps = 0
    per_file = []
    for k, (rel, text) in enumerate(picks):
        resp = tok.encode(text)
        drafter.start(f"m{k}", tok.encode(f"Print the file {rel} exactly as it is on disk.\n"))
        pos = steps = 0
        while pos < len(resp):
            d = drafter.propose(f"m{k}", 32)
            depth = accepted_length(d.token_ids, d.parents, resp[pos:pos + len(d.token_ids)])
            c = min(depth + 1, len(resp) - pos)
            drafter.extend(f"m{k}", resp[pos:pos + c])
            pos += c
            steps += 1
        drafter.stop(f"m{k}")
        total_tokens += len(resp)
        total_steps += steps
        per_file.append(len(resp) / steps)
    return {"files": len(picks), "mat": round(total_tokens / total_steps, 2),
            "mat_per_file_median": round(float(np.median(per_file)), 2), "budget": 32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--edits", type=int, default=40)
    ap.add_argument("--files", type=int, default=20, help="files reproduced from the workspace (MAT)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from agentspec import Workspace
    from agentspec.backends.embedded.weights import load_checkpoint

    tok = load_checkpoint(quiet=True).tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / args.tree.name
        log(f"copying {args.tree} to {tree}")
        shutil.copytree(args.tree, tree, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "site-packages"))
        tok.encode_batch(["warm up"])
        before = rss_bytes()
        t0 = time.perf_counter()
        ws = Workspace(tree, tokenizer=tok, watch=False, progress=True)
        secs = time.perf_counter() - t0
        grown = rss_bytes() - before
        s = ws.summary()
        index_result = {"tree": str(args.tree), "files": s["files"], "chunks": s["chunks"], "tokens": s["tokens"],
                        "skipped": s["skipped"], "seconds": round(secs, 2), "tokens_per_s": round(s["tokens"] / secs),
                        "index_bytes": s["index_bytes"], "bytes_per_token_index": round(s["index_bytes"] / s["tokens"], 1),
                        "rss_growth_bytes": grown, "bytes_per_token_rss": round(grown / s["tokens"], 1)}
        log(json.dumps(index_result))
        mat_result = reproduce_files(ws, tok, tree, args.files)
        log(json.dumps(mat_result))
        ws.close()

        # edit latency, watcher on: a file of about 5k lines
        ws = Workspace(tree, tokenizer=tok, watch=True, progress=False)
        candidates = []
        for p in tree.rglob("*.py"):
            try:
                n = p.read_text(encoding="utf-8").count("\n")
            except (OSError, UnicodeDecodeError):
                continue
            candidates.append((abs(n - 5000), n, p))
        _, nlines, target = min(candidates)
        lines = target.read_text(encoding="utf-8").splitlines(keepends=True)
        log(f"editing {target.relative_to(tree)} ({nlines} lines) {args.edits} times")
        lat = []
        rng = np.random.default_rng(0)
        for i in range(args.edits):
            at = int(rng.integers(nlines // 4, 3 * nlines // 4))
            name = f"_edit_marker_{i}_{int(rng.integers(1 << 30))}"
            marker = f"{name} = {i} + 4096\n"
            new = lines[:at] + [marker] + lines[at:]
            # the request has just typed the new name (a prefix ending mid-line tokenizes stably)
            prefix = "".join(new[at - 3:at]) + f"{name} ="
            want = tok.encode(prefix + f" {i} + 4096")[len(tok.encode(prefix)):]
            ids = tok.encode(prefix)
            target.write_text("".join(new), encoding="utf-8")
            t_save = time.perf_counter()
            while True:
                rid = f"q{i}-{time.perf_counter_ns()}"
                ws.index.start(rid, ids)
                draft = ws.index.propose(rid, 32)
                ws.index.stop(rid)
                if accepted_length(draft.token_ids, draft.parents, want) == len(want):
                    lat.append(time.perf_counter() - t_save)
                    break
                if time.perf_counter() - t_save > 5:
                    lat.append(float("inf"))
                    break
                time.sleep(0.001)
            lines = new
            ws.wait_idle(5)
        ws.close()
        lat_ms = np.asarray(lat) * 1e3
        edit_result = {"file": str(target.relative_to(tree)), "lines": nlines, "edits": args.edits,
                       "save_to_draftable_ms_p50": round(float(np.percentile(lat_ms, 50)), 1),
                       "save_to_draftable_ms_p99": round(float(np.percentile(lat_ms, 99)), 1),
                       "save_to_draftable_ms_max": round(float(lat_ms.max()), 1)}
        log(json.dumps(edit_result))
    result = {"benchmark": "bench_workspace", "machine": machine_record(),   # indexing and drafting: no model forward
              "index": index_result, "reproduce": mat_result, "edit": edit_result, "cpus": os.cpu_count()}
    emit_report(result, args.out, indent=1, one_line=True)


if __name__ == "__main__":
    main()
