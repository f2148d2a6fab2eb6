#!/usr/bin/env python
"""Decoding speed while another process holds a core: plain and speculative, quiet and busy.

A laptop running the server next to an editor, a build and an agent has cores taken away at any
moment. This runs our engine on recorded rewrite prompts in a child process, once on a quiet
machine and once while a busy-loop process spins (one core's worth of work), per thread policy:
- ``governor``: the engine's default (agentspec/backends/embedded/threads.py: libgomp's spin-waiting, the
  team sized to the cores other work leaves free, re-sampled every 0.25 s);
- ``fixed``: a team as wide as the machine, libgomp's default waiting (the engine before issue 13);
- ``passive``: a fixed team with ``OMP_WAIT_POLICY=PASSIVE`` (threads sleep while they wait).
Times are decode-only (prefill excluded) and prefill-included. Greedy outputs are checked
identical across all runs. Prints one JSON object (last line of stdout).

    python -m benchmarks.bench_contention [--prompts 3] [--max-tokens 128] [--busy 1]
        [--policies passive,default] [--out FILE] [--plot PNG]

Set ``AGENTSPEC_CPU_ISA=avx2`` to measure the AVX2 path on a machine with AVX-512.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    FIXTURE,
    ROOT,
    emit_report,
    first_record,
    logger,
    machine_record,
    pyplot,
    save_figure,
)

log = logger("bench_contention")


CHILD = r'''
import json, statistics, sys, time
spec = json.loads(sys.argv[1])
import agentspec
from agentspec import SpecConfig
from agentspec.traces import load_records, prompt_messages
engine = agentspec.Engine.embedded(quiet=True)
fixture = {json.loads(l)["id"] for l in open(spec["fixture"]) if l.strip()}
prompts = []
for k, rec in enumerate(load_records(spec["data"])):
    if k >= spec["start"] and rec["id"] not in fixture:
        ids = engine.encode(prompt_messages(rec["prompt"]))
        if len(ids) <= spec["max_prompt"]:
            prompts.append(ids)
    if len(prompts) == spec["prompts"]:
        break
engine.generate(prompts[0][:64], max_tokens=8, spec=None)
print("READY", file=sys.stderr, flush=True)
sys.stdin.readline()  # the parent starts its busy loop, then tells us to go
out = {"machine": engine.kernel_info()}
for mode, cfg in (("plain", None), ("spec", SpecConfig())):
    toks = secs = dec_secs = 0.0
    outputs = []
    for i, ids in enumerate(prompts):
        g = engine.generate(ids, max_tokens=spec["max_tokens"], spec=cfg, tenant=f"{mode}{i}")
        toks += g.stats.completion_tokens
        secs += g.stats.seconds
        dec_secs += g.stats.seconds - g.stats.prefill_seconds
        outputs.append(g.token_ids)
    out[mode] = {"tokens": int(toks), "tokens_per_s": round(toks / secs, 2),
                 "decode_tokens_per_s": round(toks / dec_secs, 2), "outputs": outputs}
print(json.dumps(out))
'''


def run_child(env: dict, spec: dict, busy: int) -> dict:
    p = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, cwd=ROOT, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = ""
    while "READY" not in line:
        line = p.stderr.readline()
        if not line and p.poll() is not None:
            raise RuntimeError(f"child failed: {p.stderr.read()[-2000:]}")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(0.5)
        out, err = p.communicate("go\n", timeout=3600)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    if p.returncode != 0:
        raise RuntimeError(f"child failed (rc {p.returncode}): {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    rows = report["runs"]
    labels = [f"{r['policy']}\n{'busy' if r['busy'] else 'quiet'}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(rows))
    w = 0.38
    for k, (mode, color) in enumerate((("plain", "tab:gray"), ("spec", "tab:blue"))):
        vals = [r[mode]["decode_tokens_per_s"] for r in rows]
        bars = ax.bar([i + (k - 0.5) * w for i in x], vals, w, label=mode, color=color)
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in vals], fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("decode tokens/s")
    m = report["machine"]
    ax.set_title(f"Decoding with a busy-loop process on one of {m.get('cpus_usable')} cores "
                 f"({m.get('decode_kernels')})", fontsize=9)
    ax.legend()
    save_figure(fig, path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--start", type=int, default=None,
                    help="first record index (default: 200 in the recorded sets; 0 in the shipped sample)")
    ap.add_argument("--max-prompt", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--busy", type=int, default=1, help="busy-loop processes during the busy runs")
    ap.add_argument("--policies", default="governor,fixed,passive", help="thread policies (see above)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    spec = {"data": str(args.data / "file_rewrites.jsonl"), "fixture": str(FIXTURE), "prompts": args.prompts,
            "start": first_record(args.data, 200, args.start), "max_prompt": args.max_prompt,
            "max_tokens": args.max_tokens}
    runs = []
    machine = None
    for policy in args.policies.split(","):
        env = dict(os.environ)
        env.pop("OMP_WAIT_POLICY", None)
        if policy != "governor":
            env["AGENTSPEC_THREAD_GOVERNOR"] = "0"
        if policy == "passive":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        for busy in (0, args.busy):
            log(f"policy {policy}, {'busy' if busy else 'quiet'}")
            r = run_child(env, spec, busy)
            machine = machine or r.pop("machine")
            r.pop("machine", None)
            runs.append({"policy": policy, "busy": busy, **r})
            log(f"  plain {r['plain']['decode_tokens_per_s']} spec {r['spec']['decode_tokens_per_s']} decode tok/s")
    ref = runs[0]["plain"]["outputs"]
    identical = all(r[m]["outputs"] == ref for r in runs for m in ("plain", "spec"))
    for r in runs:
        for m in ("plain", "spec"):
            r[m].pop("outputs")
    summary = {}
    for policy in args.policies.split(","):
        q = next(r for r in runs if r["policy"] == policy and not r["busy"])
        b = next(r for r in runs if r["policy"] == policy and r["busy"])
        summary[policy] = {f"{m}_busy_vs_quiet": round(b[m]["decode_tokens_per_s"] / q[m]["decode_tokens_per_s"], 3)
                           for m in ("plain", "spec")}
    report = {"benchmark": "bench_contention", "machine": machine_record(kernels=machine),
              "config": {**{k: v for k, v in spec.items() if k not in ("data", "fixture")}, "busy": args.busy,
                         "agentspec_cpu_isa": os.environ.get("AGENTSPEC_CPU_ISA")},
              "identical_outputs": identical, "summary": summary, "runs": runs}
    emit_report(report, args.out)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
