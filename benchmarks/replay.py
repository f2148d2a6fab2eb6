#!/usr/bin/env python
"""Teacher-forced acceptance replay of recorded traffic: our drafters against their peers, one run.

Each record's response is replayed token by token as if the target produced it: at every step a
drafter proposes a tree (budget tokens) for the context (prompt + response so far), the accepted
length is the longest root path that matches the recorded continuation, and the accepted tokens
plus the bonus token are committed. Records are replayed in file order as one tenant (a request's
output joins the tenant's history when it stops), like arctic-inference's simulator.

Methods, same tokens (bundled model's tokenizer, prompt rendered with its chat template):
- ``agentspec``: our default drafter (``agentspec.drafting.default_drafter()``);
- ``prompt_lookup``: the request's own context only, n <= 3 (chain);
- ``oracle``: drafts the recorded answer itself (an upper bound for the budget);
- ``arctic``: arctic-inference's ``SuffixDecodingCache`` (its own venv; benchmarks/peers/arctic_replay.py);
- ``sglang_ngram``: SGLang 0.5.23's NGRAM corpus, as its worker feeds it and with the prompt as
  an external corpus (its own venv; benchmarks/peers/sglang_ngram_replay.py).

Reported per dataset and split (``dev``: the records the drafter was tuned on; ``held_out``: the
rest): MAT (mean committed tokens per step, bonus included), drafted tokens per step, drafter time
per step (propose + extend, p50/p99 µs), and, with ``--costs FILE`` (a step-cost profile:
``python -m benchmarks.bench_step_profile --costs --out FILE``), the speedup estimated from the
engine's measured cost of verifying n tokens vs 1.

    python -m benchmarks.replay [--data DIR] [--budget 32] [--limit N]
        [--methods agentspec,prompt_lookup,oracle,arctic,sglang_ngram] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
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
    emit_report,
    first_record,
    logger,
    machine_record,
    method_bars,
    pyplot,
    save_figure,
)

# Records tuned on: the first DEV_RECORDS[name] records of each recorded file; the rest are held out
# (the shipped sample has none: first_record).
DEV_RECORDS = {"file_rewrites": 100, "agent_turns": 150}

log = logger("replay")


def accepted_length(draft_tokens, parents, target) -> int:
    """Longest root path of the tree whose tokens equal ``target[0], target[1], ...``."""
    n = len(draft_tokens)
    if n == 0 or len(target) == 0:
        return 0
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    node, depth = -1, 0
    while depth < len(target):
        nxt = None
        for c in children.get(node, ()):
            if draft_tokens[c] == target[depth]:
                nxt = c
                break
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def replay_drafter(drafter, records, budget: int, stop_at: int, tenant: str = "replay",
                   row_cost: float = 0.0) -> list[dict]:
    from agentspec.config import SpecConfig
    from agentspec.drafting.draft import EMPTY_DRAFT, AcceptanceTracker
    from agentspec.decode.policy import MAX_STEP_ROWS, DraftPolicy

    # the engine's own policy for a request with this budget (clamp, min_prob, cost cut, trust)
    policy = DraftPolicy.for_request(SpecConfig(budget=budget, row_cost=row_cost), row_cost=row_cost,
                                     max_rows=MAX_STEP_ROWS)
    out = []
    clock = time.perf_counter_ns
    for k, (rid, prompt, resp) in enumerate(records[:stop_at]):
        req = f"r{k}"
        drafter.start(req, prompt, tenant=tenant)
        n, pos = len(resp), 0
        acc, drafted, ns, score = [], [], [], []
        tracker = AcceptanceTracker()   # per-request calibration, as the engine keeps it
        resp_list = resp.tolist()
        while pos < n:
            t0 = clock()
            # the engine caps a step's drafts by the request's max_tokens left (budget_for); a
            # recorded turn ended by itself, with no max_tokens to reach, so its drafts get the whole
            # budget, as in the SGLang worker for a request without one (the tokens left in the
            # recorded answer would cap each tree by the answer's own length, which the engine
            # never knows, and narrow its last steps' trees)
            b = policy.budget
            d = drafter.propose(req, b) if b > 0 else EMPTY_DRAFT
            t1 = clock()
            d.validate(b)
            d = policy.shape(d, trust=tracker.trust)
            a = accepted_length(d.token_ids, d.parents, resp_list[pos:pos + len(d.token_ids)])
            c = min(a + 1, n - pos)
            t2 = clock()
            drafter.extend(req, resp_list[pos:pos + c])
            t3 = clock()
            acc.append(a)
            if d.token_ids:
                tracker.update(d.score, a)
            drafted.append(len(d.token_ids))
            score.append(d.score)
            ns.append((t1 - t0) + (t3 - t2))
            pos += c
        drafter.stop(req)
        out.append({"id": rid, "n": n, "accepted": acc, "drafted": drafted, "ns": ns, "score": score})
    return out


class OracleDrafter:
    """Knows the recorded answer: drafts its next ``budget`` tokens."""

    def __init__(self, records):
        self._answers = {f"r{k}": r.tolist() for k, (_, _, r) in enumerate(records)}
        self._pos: dict[str, int] = {}

    def start(self, req_id, prompt, *, tenant="default"):
        self._pos[req_id] = 0

    def extend(self, req_id, tokens):
        self._pos[req_id] += len(tokens)

    def propose(self, req_id, budget):
        from agentspec.drafting import Draft

        p = self._pos[req_id]
        return Draft.chain(self._answers[req_id][p:p + budget], source="oracle")

    def stop(self, req_id):
        self._pos.pop(req_id, None)


class PromptLookupChain:
    """Classic prompt lookup (as in transformers / vLLM ``ngram``): the most recent earlier
    occurrence of the last n tokens (n = 3, 2, 1) in the request's own context, copied as a chain."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._reqs: dict[str, tuple[list[int], dict, dict]] = {}

    def start(self, req_id, prompt, *, tenant="default"):
        self._reqs[req_id] = ([], {}, {})
        self.extend(req_id, prompt)

    def extend(self, req_id, tokens):
        toks, last, prev = self._reqs[req_id]
        for t in np.asarray(tokens).tolist():
            toks.append(t)
            end = len(toks)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                key = tuple(toks[end - n:end])
                if key in last:
                    prev[key] = last[key]
                last[key] = end  # position just after this occurrence

    def propose(self, req_id, budget):
        from agentspec.drafting import Draft

        toks, last, prev = self._reqs[req_id]
        end = len(toks)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            pos = prev.get(tuple(toks[end - n:]))  # last[...] is the current suffix itself
            if pos is not None:
                return Draft.chain(toks[pos:pos + budget], source="prompt_lookup")
        return Draft.chain([], source="prompt_lookup")

    def stop(self, req_id):
        self._reqs.pop(req_id, None)


def summarize(records: list[dict], costs: dict[int, float] | None = None) -> dict:
    steps = sum(len(r["accepted"]) for r in records)
    if steps == 0:
        return {"records": len(records), "steps": 0}
    # committed per step is accepted + 1, except at the end of a response: the response length
    committed = sum(r["n"] if "n" in r else sum(r["accepted"]) + len(r["accepted"]) for r in records)
    ns = np.asarray([x for r in records for x in r["ns"]], dtype=np.float64)
    drafted = np.asarray([x for r in records for x in r["drafted"]], dtype=np.float64)
    out = {
        "records": len(records),
        "steps": steps,
        "tokens": committed,
        "mat": round(committed / steps, 3),
        "mat_per_record_median": round(statistics.median(
            (sum(r["accepted"]) + len(r["accepted"])) / len(r["accepted"]) for r in records if r["accepted"]), 3),
        "drafted_per_step": round(float(drafted.mean()), 2),
        "drafter_us_p50": round(float(np.percentile(ns, 50)) / 1e3, 2),
        "drafter_us_p99": round(float(np.percentile(ns, 99)) / 1e3, 2),
    }
    scores = [x for r in records for x in r.get("score", ())]
    if scores:   # calibration: the drafter's expected accepted tokens vs the accepted ones
        out["mean_score"] = round(float(np.mean(scores)), 3)
        out["mean_accepted"] = round(float(np.mean([a for r in records for a in r["accepted"]])), 3)
    if costs:
        # time of a step verifying d draft tokens = cost(max(d + 1, 2)) (the engine never runs a
        # single row); plain decoding pays cost(2) per token
        keys = sorted(costs)
        xs, ys = np.asarray(keys, float), np.asarray([costs[k] for k in keys])

        def cost(rows: int) -> float:
            if rows > keys[-1]:  # extrapolate with the last segment's slope
                slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
                return float(ys[-1] + slope * (rows - xs[-1]))
            return float(np.interp(rows, xs, ys))

        spec_t = sum(cost(max(d + 1, 2)) for r in records for d in r["drafted"])
        out["est_speedup"] = round(committed * cost(2) / spec_t, 3)
    return out


def run_peer(script: str, python: str, streams: Path, budget: int, stop: int, extra: list[str],
             builds: dict | None = None) -> list[dict] | None:
    """A peer's replay (its own venv's ``python``): its per-record results; its build's version
    goes into ``builds``."""
    if not Path(python).exists():
        log(f"{script}: {python} not found, skipped")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [python, str(PEERS / script), "--streams", str(streams), "--out", str(out),
               "--budget", str(budget), "--records", f"0:{stop}", *extra]
        log(" ".join(cmd))
        res = subprocess.run(cmd, stderr=sys.stderr, stdout=subprocess.DEVNULL)
        if res.returncode != 0 or not out.exists():
            log(f"{script} failed with exit code {res.returncode}")
            return None
        data = json.loads(out.read_text())
        if builds is not None:
            params = data.get("params") or {}
            builds.update({k.removesuffix("_version"): v for k, v in params.items()
                           if (k.endswith("_version") or k == "arctic_inference") and isinstance(v, str)})
        return data["records"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--datasets", default=",".join(replay_data.DATASETS))
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N records of each file")
    ap.add_argument("--methods", default="agentspec,prompt_lookup,oracle,arctic,sglang_ngram,sglang_ngram_prompt")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--sglang-python", default="/work/venvs/sglang/bin/python")
    ap.add_argument("--costs", type=Path, default=None,
                    help="a step-cost profile (bench_step_profile --costs --out FILE), for est_speedup")
    ap.add_argument("--row-cost", type=float, default=0.0,
                    help="cut our drafts to the prefix worth verifying at this cost per extra row "
                         "(agentspec.drafting.cut_for_cost); 0 = use the whole budget")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="draw held-out MAT per method into this PNG")
    ap.add_argument("--replot", type=Path, default=None, help="only draw --plot from a saved --out JSON")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot or args.replot.with_suffix(".png"))
        return

    from agentspec.drafting import default_drafter

    costs = None
    if args.costs:
        try:
            costs = {int(k): float(v) for k, v in json.loads(args.costs.read_text())["step_seconds"].items()}
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"--costs {args.costs}: not a step-cost profile with step_seconds ({e})") from None
    methods = args.methods.split(",")
    dev_records = {name: first_record(args.data, n) for name, n in DEV_RECORDS.items()}
    builds: dict = {}
    result = {"benchmark": "replay", "machine": {}, "budget": args.budget, "dev_records": dev_records,
              "costs": str(args.costs) if args.costs else None, "datasets": {}}
    for name in args.datasets.split(","):
        streams = replay_data.tokenize(args.data, name)
        records = replay_data.load(streams)
        stop = len(records) if args.limit is None else min(args.limit, len(records))
        cut = dev_records[name]
        per_method = {}
        for m in methods:
            t0 = time.perf_counter()
            if m == "agentspec":
                recs = replay_drafter(default_drafter(), records, args.budget, stop, row_cost=args.row_cost)
            elif m == "prompt_lookup":
                recs = replay_drafter(PromptLookupChain(), records, args.budget, stop)
            elif m == "oracle":
                recs = replay_drafter(OracleDrafter(records), records, args.budget, stop)
            elif m == "arctic":
                recs = run_peer("arctic_replay.py", args.vllm_python, streams, args.budget, stop, [], builds)
            elif m == "sglang_ngram":
                recs = run_peer("sglang_ngram_replay.py", args.sglang_python, streams, args.budget, stop,
                                ["--mode", "worker"], builds)
            elif m == "sglang_ngram_prompt":
                recs = run_peer("sglang_ngram_replay.py", args.sglang_python, streams, args.budget, stop,
                                ["--mode", "prompt-corpus"], builds)
            else:
                raise SystemExit(f"unknown method {m!r}")
            if recs is None:
                continue
            for k, r in enumerate(recs):   # peers report steps; the response length is ours
                r["n"] = len(records[k][2])
            per_method[m] = {"dev": summarize(recs[:cut], costs), "held_out": summarize(recs[cut:], costs)}
            log(f"{name} {m}: {json.dumps(per_method[m])} ({time.perf_counter() - t0:.0f} s)")
        result["datasets"][name] = per_method
    result["machine"] = machine_record(peers=builds)   # drafters only: no model forward, no kernel plan
    emit_report(result, args.out, indent=1, one_line=True)
    if args.plot:
        plot(result, args.plot)


LABELS = {"agentspec": "agentspec (suffix index)", "prompt_lookup": "prompt lookup (n<=3)",
          "oracle": "oracle (knows the answer)", "arctic": "arctic-inference suffix",
          "sglang_ngram": "SGLang NGRAM (worker)", "sglang_ngram_prompt": "SGLang NGRAM + prompt corpus"}


def plot(result: dict, path: Path) -> None:
    """Held-out MAT per method, one panel per dataset."""
    names = list(result["datasets"])
    fig, axes = pyplot().subplots(1, len(names), figsize=(6 * len(names), 3.6))
    for ax, name in zip(np.atleast_1d(axes), names):
        methods = [m for m in result["datasets"][name] if m != "oracle"]
        mats = [result["datasets"][name][m]["held_out"]["mat"] for m in methods]
        method_bars(ax, methods, mats, labels=LABELS, ours=lambda m: m == "agentspec", fmt="{:.2f}")
        oracle = result["datasets"][name].get("oracle", {}).get("held_out", {}).get("mat")
        ax.set_xlabel("mean accepted tokens per step (bonus included)")
        ax.set_title(f"{name}, held-out records, budget {result['budget']}"
                     + (f" (oracle {oracle:.1f})" if oracle else ""), fontsize=9)
        ax.set_xlim(0, max(mats) * 1.2)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
