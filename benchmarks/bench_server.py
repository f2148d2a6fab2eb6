"""Server benchmark: file rewrites through `/v1/apply` and `/v1/chat/completions`, speculation on vs off.

Starts `agentspec serve` (embedded engine, bundled model) on loopback with a workspace holding
the files being rewritten, then sends each rewrite prompt from ``--data``'s file_rewrites.jsonl
(default: the sample in benchmarks/data; prompt <= --max-prompt tokens) as
  - `/v1/apply` with `path` (the file in the workspace) and `instruction` (the commit message),
  - `/v1/chat/completions` with the recorded prompt, through the official `openai` client,
each once with speculation on (the default route) and once with `"speculation": false`, streamed,
greedy, one request at a time. Reports tokens/s (completion tokens / request wall time, prefill
included), time to first token (first streamed text), and whether both modes produced the same text.
Then a concurrent phase: distinct rewrite prompts and agent turns through chat completions, at most
``--concurrency`` in flight, spec then plain.

Every timed series starts in a fresh server (the same workspace files): each of the four
(endpoint x mode) series of a round, and each (workload x mode) of the concurrent phase. Nothing is
cached from another series: the prefix cache and the suffix index are per tenant and every request
uses the default one, so in a shared server the second mode would take its prefill from the cache
and have the first mode's answers (or apply's, for chat) drafted verbatim. For the same reason no
prompt is sent twice in a series (the concurrent phase runs fewer requests when fewer distinct
prompts exist), and the warm-up request is none of the timed prompts.

    python -m benchmarks.bench_server --prompts 6 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    agent_items,
    distinct,
    emit_report,
    first_record,
    logger,
    machine_record,
    server_kernels,
    sse_events,
    start_server,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    import openai

_INSTR = re.compile(r"Apply this change to `([^`]+)`:\n\n(.*?)\n\nCurrent contents of `[^`]+`:\n```[^\n]*\n(.*)\n```\n\n"
                    r"Reply with the complete updated file and nothing else\.", re.S)


log = logger("bench_server")

def _messages(item: dict) -> str:
    return json.dumps(item["messages"], sort_keys=True)


def _said(what: str):
    return lambda msg: log(f"{what}: {msg}")


SERIES = ("apply_spec", "apply_plain", "chat_spec", "chat_plain")
WARM_UP = [{"role": "user", "content": "Say hello."}]   # none of the timed prompts: nothing of theirs cached


def select(data: Path, n: int, max_prompt: int, start: int, tokenizer) -> list[dict]:
    from agentspec.traces import load_records, prompt_messages

    out = []
    for i, r in enumerate(load_records(data / "file_rewrites.jsonl")):
        if i < start:
            continue
        msgs = prompt_messages(r["prompt"])
        m = _INSTR.search(msgs[-1]["content"])
        if not m:
            continue
        if len(tokenizer.encode(msgs[-1]["content"])) > max_prompt:
            continue
        out.append({"id": r["id"], "path": m.group(1), "instruction": m.group(2), "code": m.group(3) + "\n",
                    "messages": msgs})
        if len(out) == n:
            break
    return out


def workspace(repo: Path, items: list[dict]) -> Path:
    """``repo`` holding each rewrite item's file at its ``path``."""
    for it in items:
        f = repo / it["path"]
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(it["code"])
    return repo


@contextmanager
def fresh_server(repo: Path, tmp: Path, name: str, spec: bool) -> Iterator[tuple[str, openai.OpenAI, str]]:
    """``(base, client, model)`` of a new ``agentspec serve`` over ``repo``, warmed up (``spec``'s
    mode, on ``WARM_UP``), stopped on leaving: a series timed in it finds nothing of another's."""
    import openai

    t0 = time.monotonic()
    server = start_server(["--repo", str(repo)], log_path=tmp / f"server_{name}.log", cwd=tmp)
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        stream_chat(client, model, {"messages": WARM_UP}, spec, 8)  # first-call costs, not timed
        log(f"{name}: fresh server up in {time.monotonic() - t0:.1f}s")
        yield server.base, client, model
    finally:
        server.stop()


def stream_apply(base: str, item: dict, spec: bool, max_tokens: int) -> dict:
    body = {"path": item["path"], "instruction": item["instruction"], "max_tokens": max_tokens, "stream": True,
            "temperature": 0}
    if not spec:
        body["speculation"] = False
    t0 = time.perf_counter()
    ttft = None
    text, final = [], None
    for ev in sse_events(base + "/v1/apply", body, timeout=600):
        if ev.get("delta") and ttft is None:
            ttft = time.perf_counter() - t0
        text.append(ev.get("delta", ""))
        if "usage" in ev:
            final = ev
    wall = time.perf_counter() - t0
    n = final["usage"]["completion_tokens"]
    return {"tokens": n, "wall_s": wall, "ttft_s": ttft or wall, "text": "".join(text),
            "mat": final["spec"]["mean_acceptance_length"]}


def stream_chat(client, model: str, item: dict, spec: bool, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft = None
    text, usage, stats = [], None, None
    extra = {"spec_stats": True} | ({} if spec else {"speculation": False})
    for ch in client.chat.completions.create(model=model, messages=item["messages"], temperature=0,
                                             max_tokens=max_tokens, stream=True,
                                             stream_options={"include_usage": True}, extra_body=extra):
        if ch.choices:
            d = ch.choices[0].delta.content or ""
            if d and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(d)
            if ch.model_extra.get("spec"):
                stats = ch.model_extra["spec"]
        if ch.usage is not None:
            usage = ch.usage
    wall = time.perf_counter() - t0
    return {"tokens": usage.completion_tokens, "wall_s": wall, "ttft_s": ttft or wall, "text": "".join(text),
            "mat": stats["mean_acceptance_length"] if stats else None}


def concurrent_chat(client, model: str, items: list[dict], spec: bool, max_tokens: int, concurrency: int) -> dict:
    """All ``items`` through chat completions, at most ``concurrency`` in flight."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda it: stream_chat(client, model, it, spec, max_tokens), items))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in runs)
    return {"requests": len(runs), "completion_tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2), "ttft_ms_p50": round(statistics.median(r["ttft_s"] for r in runs) * 1e3, 1),
            "texts": [r["text"] for r in runs]}


def summarize(runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    return {"requests": len(runs), "completion_tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
            "ttft_ms_p50": round(statistics.median(r["ttft_s"] for r in runs) * 1e3, 1),
            "mat_mean": round(statistics.mean(r["mat"] for r in runs if r["mat"] is not None), 3)
            if any(r["mat"] is not None for r in runs) else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--start", type=int, default=None,
                    help="first record index (default: 200 in the recorded sets, whose earlier records the tests use; "
                         "0 in the shipped sample)")
    ap.add_argument("--max-prompt", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="rounds over all prompts (medians of per-round figures)")
    ap.add_argument("--concurrency", type=int, default=8, help="concurrent phase: requests in flight (0: skip)")
    ap.add_argument("--concurrent-requests", type=int, default=16, help="concurrent phase: requests per workload")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from agentspec.backends.embedded.weights import load_checkpoint

    tok = load_checkpoint(quiet=True).tokenizer
    rewrites = select(args.data, max(args.prompts, args.concurrent_requests if args.concurrency else 0),
                      args.max_prompt, first_record(args.data, 200, args.start), tok)
    items = distinct(rewrites, args.prompts, _said("sequential rounds"), key=_messages)
    if not items:
        raise SystemExit(f"no rewrite prompts found in {args.data}")
    for k, it in enumerate(rewrites):  # one folder per record: two records may share a path
        it["path"] = f"r{k}/{it['path']}"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        repo = workspace(tmp / "repo", items)   # just files: each fresh server indexes the same workspace
        log(f"{len(items)} prompts x 2 endpoints x 2 modes, a fresh server per series")
        rounds = []
        kernels = None
        for rep in range(args.repeats):
            res: dict[str, list[dict]] = {}
            for key in SERIES:
                ep, spec = key.split("_")[0], key.endswith("_spec")
                with fresh_server(repo, tmp, f"round{rep}_{key}", spec) as (base, client, model):
                    res[key] = [stream_apply(base, it, spec, args.max_tokens) if ep == "apply"
                                else stream_chat(client, model, it, spec, args.max_tokens) for it in items]
                kernels = kernels or server_kernels(tmp / f"server_round{rep}_{key}.log")
            same = {ep: sum(a["text"] == b["text"] for a, b in zip(res[f"{ep}_spec"], res[f"{ep}_plain"]))
                    for ep in ("apply", "chat")}
            for k, it in enumerate(items):
                a_on, a_off, c_on, c_off = (res[key][k] for key in SERIES)
                log(f"{it['id']}: apply {a_on['tokens'] / a_on['wall_s']:.1f} vs {a_off['tokens'] / a_off['wall_s']:.1f} "
                    f"tok/s, chat {c_on['tokens'] / c_on['wall_s']:.1f} vs {c_off['tokens'] / c_off['wall_s']:.1f}")
            rounds.append(({k: summarize(v) for k, v in res.items()}, same))
        concurrent = {}
        if args.concurrency:
            n = args.concurrent_requests
            workloads = {"rewrites": distinct(rewrites, n, _said("concurrent rewrites"), key=_messages),
                         "agent_turns": distinct(agent_items(args.data, n, args.max_prompt, first_record(args.data, 150),
                                                             tok), n, _said("concurrent agent_turns"), key=_messages)}
            repo = workspace(tmp / "repo_concurrent", workloads["rewrites"])
            for wl, its in workloads.items():
                runs = {}
                for mode, spec in (("spec", True), ("plain", False)):
                    with fresh_server(repo, tmp, f"concurrent_{wl}_{mode}", spec) as (_, client, model):
                        runs[mode] = concurrent_chat(client, model, its, spec, args.max_tokens, args.concurrency)
                on, off = runs["spec"], runs["plain"]
                same_n = sum(a == b for a, b in zip(on.pop("texts"), off.pop("texts")))
                concurrent[wl] = {"spec": on, "plain": off, "identical": f"{same_n}/{len(its)}",
                                  "speedup": round(on["tokens_per_s"] / off["tokens_per_s"], 3)}
                log(f"concurrency {args.concurrency}, {wl}: spec {on['tokens_per_s']} vs plain {off['tokens_per_s']} "
                    f"tok/s, identical {same_n}/{len(its)}")

    def med(key: str, field: str):
        return statistics.median(r[0][key][field] for r in rounds)

    summary = {}
    for k in SERIES:
        summary[k] = {f: (med(k, f) if rounds[0][0][k][f] is not None else None)
                      for f in ("tokens_per_s", "ttft_ms_p50", "mat_mean")} | {
            "completion_tokens": rounds[0][0][k]["completion_tokens"]}
    for ep in ("apply", "chat"):
        summary[f"{ep}_speedup"] = round(summary[f"{ep}_spec"]["tokens_per_s"] / summary[f"{ep}_plain"]["tokens_per_s"], 3)
        summary[f"{ep}_identical"] = f"{min(r[1][ep] for r in rounds)}/{len(items)}"
    report = {"benchmark": "bench_server", "machine": machine_record(kernels=kernels),
              "config": {"prompts": [it["id"] for it in items], "max_tokens": args.max_tokens, "repeats": args.repeats,
                         "streamed": True, "greedy": True, "one_request_at_a_time": True,
                         "fresh_server_per_run": True, "distinct_prompts": True},
              "summary": summary, "concurrent": {"concurrency": args.concurrency, **concurrent},
              "rounds": [r[0] for r in rounds]}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
