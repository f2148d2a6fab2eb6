"""Throughput under load: continuous batching with and without speculation, vs vLLM-CPU.

For each workload (file-rewrite prompts; agent-turn prompts, where acceptance is low) and each
concurrency c in --concurrency, N = max(--waves * c, --requests) distinct requests are run with at most c in flight
(closed loop: a finished request's slot goes to the next), greedy, --max-tokens new tokens each:

  ours_plain       BatchEngine(budget="off")          plain batched decoding
  ours_fixed       BatchEngine(budget="fixed")        each request cuts its own draft (single-request rule)
  ours_load_aware  BatchEngine(budget="load_aware")   global top-B slots under the profiled step cost
  vllm_plain / vllm_suffix   vLLM-CPU, max_num_seqs=c, one generate() over the N prompts
                             (benchmarks/peers/vllm_runner.py in /work/venvs/vllm; skipped if absent)

  server_plain / server_spec  with --server: the same requests through `agentspec serve` (a fresh
                             server per run, warmed up by c requests of another tenant; the openai
                             client's completions, c threads), with `"speculation": false` and with
                             the default route (load-aware)

plus `ours_sequential`: the same N requests one at a time, plain (the baseline that batching must
beat 2x). Every run of ours gets a fresh suffix index (no memory of earlier runs); vLLM builds a
fresh LLM per method and concurrency. Tokens/s = generated tokens / wall time, prefill included.
Prints JSON; --plot draws tokens/s against concurrency.

    python -m benchmarks.bench_throughput --out benchmarks/results/throughput_2026-11-30_native-linear.json \\
        --plot docs/bench_throughput.png
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    agent_prompts,
    cold,
    distinct,  # with rewrite_prompts, still importable from here (tests/sglang imports them so)
    emit_report,
    logger,
    machine_record,
    pyplot,
    rewrite_prompts,
    run_peer,
    save_figure,
    start_server,
    workload_prompts,
)

log = logger("bench_throughput")


def run_ours(engine, prompts, c: int, policy: str, max_tokens: int, step_costs) -> dict:
    from agentspec.drafting import SuffixDrafter
    from agentspec.backends.embedded.batch import BatchEngine

    drafter = SuffixDrafter(vocab_size=engine.vocab_size)  # fresh: no memory of earlier runs
    cold(engine)                                              # nor their prefills
    with BatchEngine(engine, max_batch=c, budget=policy, step_costs=step_costs, background=False) as be:
        t0 = time.perf_counter()
        gens = be.generate_many(prompts, max_tokens=max_tokens, drafter=drafter)
        wall = time.perf_counter() - t0
    tokens = sum(len(g.token_ids) for g in gens)
    steps = sum(g.stats.steps for g in gens)
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "mat": round(sum(sum(g.stats.acceptance_lengths) for g in gens) / max(steps, 1), 3),
            "draft_tokens": sum(g.stats.draft_tokens for g in gens),
            "accepted_tokens": sum(g.stats.accepted_tokens for g in gens),
            "outputs": [g.token_ids for g in gens]}


def run_sequential(engine, prompts, max_tokens: int) -> dict:
    cold(engine)
    t0 = time.perf_counter()
    gens = [engine.generate(p, max_tokens=max_tokens, spec=None) for p in prompts]
    wall = time.perf_counter() - t0
    tokens = sum(len(g.token_ids) for g in gens)
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "outputs": [g.token_ids for g in gens]}


def median_runs(runs: dict, repeat: int) -> dict:
    """Each of ``runs`` (name: ``run()``) ``repeat`` times, interleaved (a, b, c, a, b, c, ...: a
    shared machine's drift touches every method alike): per name the run with the median tokens/s,
    with every run's tokens/s in ``tokens_per_s_runs``."""
    done: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(max(repeat, 1)):
        for name, run in runs.items():
            done[name].append(run())
    out = {}
    for name, rs in done.items():
        rs.sort(key=lambda r: r["tokens_per_s"])
        out[name] = rs[(len(rs) - 1) // 2]
        if len(rs) > 1:
            out[name]["tokens_per_s_runs"] = [r["tokens_per_s"] for r in rs]
    return out


def run_server(prompts, c: int, spec: bool, max_tokens: int) -> dict:
    """The N prompts (token ids) through a fresh ``agentspec serve`` (embedded engine, an empty
    workspace: nothing of earlier runs) with the official ``openai`` client's
    ``completions.create``, streamed, at most ``c`` in flight; ``spec`` False sends
    ``"speculation": false`` (plain batching in the same server)."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    with tempfile.TemporaryDirectory() as ws:
        config = Path(ws) / "agentspec.toml"
        config.write_text("".join(f'[[tenants]]\nname = "{t}"\napi_keys = ["sk-{t}-0123456789"]\n'
                                  for t in ("bench", "warmup")))
        server = start_server(["--config", str(config)], log_path=Path(ws) / "server.log", cwd=Path(ws))
        try:
            client = OpenAI(base_url=server.base + "/v1", api_key="sk-bench-0123456789", max_retries=0, timeout=600)
            model = client.models.list().data[0].id
            extra = {} if spec else {"speculation": False}
            # warm-up, not timed: c requests at once as another tenant (its own prefix cache,
            # suffix index and outputs: nothing of it reaches the timed tenant's drafts), so the
            # timed run meets a server whose first-call costs and first touches of KV memory are paid
            warm = OpenAI(base_url=server.base + "/v1", api_key="sk-warmup-0123456789", max_retries=0, timeout=600)
            with ThreadPoolExecutor(c) as pool:
                list(pool.map(lambda ids: warm.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0,
                                                                  extra_body=extra), prompts[:c]))

            def one(ids: list[int]) -> tuple[str, int]:
                text, n = [], 0
                for ch in client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_body=extra):
                    if ch.choices:
                        text.append(ch.choices[0].text or "")
                    if ch.usage is not None:
                        n = ch.usage.completion_tokens
                return "".join(text), n

            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                runs = list(pool.map(one, prompts))
            wall = time.perf_counter() - t0
        finally:
            server.stop()
    tokens = sum(n for _, n in runs)
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "outputs": [t for t, _ in runs]}


def run_vllm(python: str, model: str, prompts, c: int, max_tokens: int, timeout: int) -> dict | None:
    spec = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "methods": ["plain", "suffix"],
            "num_speculative_tokens": 8, "batched": True, "max_num_seqs": c}
    res = run_peer(python, "vllm_runner.py", spec, timeout)
    if res is None:
        return None
    return {m: {"tokens": r["total_tokens"], "wall_s": round(r["wall_s"], 3), "tokens_per_s": round(r["tokens_per_s"], 2),
                "mat": (r.get("spec") or {}).get("mean_acceptance_length")} for m, r in res.items()}


def plot(report: dict, path: Path) -> None:
    workloads = list(report["results"])
    fig, axes = pyplot().subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        rows = report["results"][wl]
        cs = sorted(int(c) for c in rows)
        for key, style in (("ours_load_aware", "o-"), ("ours_fixed", "s--"), ("ours_plain", "^-"),
                           ("server_spec", "D-"), ("server_plain", "d:"),
                           ("vllm_suffix", "x-"), ("vllm_plain", "v:")):
            ys = [rows[str(c)].get(key, {}).get("tokens_per_s") for c in cs]
            if any(y is not None for y in ys):
                ax.plot(cs, [y if y is not None else float("nan") for y in ys], style, label=key)
        ax.set(title=f"{wl}: tokens/s vs concurrency", xlabel="concurrent requests", ylabel="tokens/s", xscale="log")
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def merge_reports(paths: list[Path]) -> dict:
    """Saved reports' results merged cell by cell (a later file's cell replaces an earlier one's)."""
    import json

    results: dict = {}
    for path in paths:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--replot {path}: not a saved bench_throughput report ({e})") from None
        if report.get("benchmark") != "bench_throughput":
            raise SystemExit(f"--replot {path}: not a bench_throughput report")
        for wl, rows in report["results"].items():
            results.setdefault(wl, {}).update(rows)
    return {"results": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=8, help="requests per run (at least the concurrency)")
    ap.add_argument("--waves", type=int, default=1,
                    help="at least this many requests per slot: N = max(waves * c, --requests) distinct prompts "
                         "(one wave of c ends on its slowest request; more keep the batch full, as a stream of "
                         "agents would)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=1500)
    ap.add_argument("--workloads", default="rewrites,agent_turns")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--vllm-model", default="/work/models/smollm2-hf")
    ap.add_argument("--peer-timeout", type=int, default=1800)
    ap.add_argument("--no-sequential", action="store_true")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each of ours per cell, interleaved with the other methods' runs, the median "
                         "reported (vLLM runs once: a fresh engine each)")
    ap.add_argument("--server", action="store_true",
                    help="also through `agentspec serve` (a fresh server per run, the openai client, c threads): "
                         "speculation on vs `\"speculation\": false`")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--replot", type=Path, nargs="+", metavar="JSON",
                    help="only draw --plot from saved --out files (their cells merged: e.g. one run at c = 1,4 "
                         "and one at c = 8,16)")
    args = ap.parse_args()
    if args.replot:
        if not args.plot:
            raise SystemExit("--replot needs --plot PNG (where to draw)")
        plot(merge_reports(args.replot), args.plot)
        return 0

    from agentspec import Engine
    from agentspec.backends.embedded.batch import BatchEngine

    cs = [int(x) for x in args.concurrency.split(",")]
    engine = Engine.embedded(quiet=True)
    with BatchEngine(engine, background=False) as be:
        step_costs = be.step_costs
    log(f"step costs (ms): { {k: round(v * 1e3, 1) for k, v in step_costs.items()} }")
    n_max = max(max(cs) * args.waves, args.requests)
    sets = workload_prompts(engine, args.data, args.workloads, n_max, args.max_prompt)
    have_vllm = Path(args.vllm_python).exists() and Path(args.vllm_model).exists()
    results: dict = {}
    for wl, prompts in sets.items():
        results[wl] = {}
        for c in cs:
            ps = distinct(prompts, max(c * args.waves, args.requests), log)
            n = len(ps)
            row: dict = {}
            row.update(median_runs({{"off": "ours_plain"}.get(p, f"ours_{p}"):
                                    (lambda p=p: run_ours(engine, ps, c, p, args.max_tokens, step_costs))
                                    for p in ("off", "fixed", "load_aware")}, args.repeat))
            base = row["ours_plain"]["outputs"]
            for k in ("ours_fixed", "ours_load_aware"):
                row[k]["identical_to_plain"] = f"{sum(a == b for a, b in zip(row[k]['outputs'], base))}/{n}"
            if c == 1 and not args.no_sequential:
                row["ours_sequential"] = run_sequential(engine, ps, args.max_tokens)
                row["ours_sequential"]["identical_to_batched_plain"] = \
                    f"{sum(a == b for a, b in zip(row['ours_sequential']['outputs'], base))}/{n}"
            if args.server:
                row.update(median_runs({"server_plain": lambda: run_server(ps, c, False, args.max_tokens),
                                        "server_spec": lambda: run_server(ps, c, True, args.max_tokens)}, args.repeat))
                row["server_spec"]["identical_to_plain"] = \
                    f"{sum(a == b for a, b in zip(row['server_spec']['outputs'], row['server_plain']['outputs']))}/{n}"
            if have_vllm:
                v = run_vllm(args.vllm_python, args.vllm_model, ps, c, args.max_tokens, args.peer_timeout)
                if v:
                    row.update({f"vllm_{m}": r for m, r in v.items()})
            for r in row.values():
                r.pop("outputs", None)
            p = row["ours_plain"]["tokens_per_s"]
            row["ratios"] = {"load_aware_vs_plain": round(row["ours_load_aware"]["tokens_per_s"] / p, 3),
                             "fixed_vs_plain": round(row["ours_fixed"]["tokens_per_s"] / p, 3)}
            if "server_spec" in row:
                row["ratios"]["server_spec_vs_plain"] = round(
                    row["server_spec"]["tokens_per_s"] / row["server_plain"]["tokens_per_s"], 3)
            if "vllm_suffix" in row:
                for k in ("ours_load_aware", "server_spec"):
                    if k in row:
                        row["ratios"][f"{k.removeprefix('ours_')}_vs_vllm_suffix"] = round(
                            row[k]["tokens_per_s"] / row["vllm_suffix"]["tokens_per_s"], 3)
            results[wl][str(c)] = row
            log(f"{wl} c={c}: " + ", ".join(f"{k} {v['tokens_per_s']}" for k, v in row.items() if k != "ratios")
                + f" | {row['ratios']}")
    seq = {wl: results[wl].get("1", {}).get("ours_sequential", {}).get("tokens_per_s") for wl in results}
    summary = {wl: {c: rows[c]["ratios"] for c in rows} for wl, rows in results.items()}
    for wl, rows in results.items():
        if seq.get(wl):
            for c in rows:
                summary[wl][c]["plain_batched_vs_sequential"] = round(rows[c]["ours_plain"]["tokens_per_s"] / seq[wl], 3)
    report = {"benchmark": "bench_throughput", "machine": machine_record(engine.kernel_info()),
              "config": {"concurrency": cs, "requests": args.requests, "waves": args.waves, "repeat": args.repeat, "max_tokens": args.max_tokens,
                         "max_prompt": args.max_prompt, "greedy": True, "vllm": have_vllm, "server": args.server,
                         "step_costs_ms": {k: round(v * 1e3, 2) for k, v in step_costs.items()}},
              "summary": summary, "results": results}
    emit_report(report, args.out)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
