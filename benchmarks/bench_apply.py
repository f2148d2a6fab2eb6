#!/usr/bin/env python
"""Fast apply with a real model: is the merged file the recorded new file, and how fast, against
llama.cpp's ``llama-server`` on the same GGUF file given the same prompts, in one run.

Cases: held-out recorded file rewrites (``file_rewrites.jsonl``: Aider commits; the old file is in
the prompt, the recorded new file is the answer), each turned into an edit snippet the way
fast-apply clients write them (Morph style): the changed hunks with two lines of context on each
side, ``... existing code ...`` comment lines (in the file's comment syntax) where unchanged lines
are left out, and the commit message as the instruction. Files whose rewrite changes nothing are
skipped.

Prompt variants (``--variants``), each sent as chat messages through the official ``openai``
client, greedy:

  aider    what ``POST /v1/apply`` sends (``agentspec.apply.apply_prompt``: the change, the edit in a
           fence, the current file in a fence, "reply with the complete updated file")
  morph    ``agentspec.apply.APPLY_SYSTEM`` as the system message, the user message
           ``<instruction>..</instruction><code>..</code><update>..</update>`` (what Morph/Relace
           clients send; agentspec's chat endpoint detects it and drafts from the code)
  plain    one user message: "Merge the edit into the code and output the whole updated file",
           the edit, the code (no fences, no system message)

Methods: ``agentspec`` (``agentspec serve --model FILE``; the original code as the prediction, as
``/v1/apply`` passes it; speculation on) and ``llama.cpp`` (``llama-server -m FILE --jinja``,
plain decoding, and ``--llama-spec`` modes for the time comparison). Every method runs on a fresh
server. The answer goes through ``agentspec.apply.merged_code`` (code only: the wrapper fence and
chatter dropped, the original's line endings) for every method alike.

Reported per method and variant: exact matches with the recorded new file, matches up to
trailing whitespace, seconds per merge (prefill included), completion tokens/s, and per case the
first differing line of a miss.

    python -m benchmarks.bench_apply --model "$(python scripts/fetch_model.py qwen2.5-coder-1.5b)" \\
        --data DIR --files 6 --out FILE
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gguf import Process, agentspec_cmd, llama_cmd, llama_server, llama_version, peak_rss  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    DATA, DATA_HELP, emit_report, fixture_ids, free_port, logger, machine_record, server_kernels)

log = logger("bench_apply")

COMMENT = {".py": "#", ".scm": ";", ".el": ";", ".sh": "#", ".rb": "#", ".toml": "#", ".yaml": "#", ".yml": "#", ".md": "<!--",
           ".html": "<!--", ".css": "/*"}
VARIANTS = ("aider", "morph", "plain")
_CURRENT = re.compile(r"Current contents of `(?P<name>[^`]+)`:\n```[^\n]*\n(?P<code>.*)\n```", re.DOTALL)
_CHANGE = re.compile(r"Apply this change to `[^`]+`:\n\n(?P<instruction>.*?)\n\nCurrent contents of", re.DOTALL)


def marker(name: str) -> str:
    """The ``... existing code ...`` line in the file's comment syntax."""
    c = COMMENT.get(Path(name).suffix.lower(), "//")
    return {"<!--": "<!-- ... existing code ... -->", "/*": "/* ... existing code ... */"}.get(c, f"{c} ... existing code ...")


def morph_snippet(old: str, new: str, name: str, context: int = 2) -> str | None:
    """The edit from ``old`` to ``new`` as a fast-apply snippet: each changed hunk of the new file
    with ``context`` lines around it, a marker line wherever unchanged lines are left out. None
    when nothing changed."""
    a, b = old.split("\n"), new.split("\n")
    groups = list(difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context))
    if not groups or all(tag == "equal" for g in groups for tag, *_ in g):
        return None
    mark, out, end = marker(name), [], 0
    for g in groups:
        j1, j2 = g[0][3], g[-1][4]
        if j1 > end or (not out and j1 > 0):
            out.append(mark)
        out.extend(b[j1:j2])
        end = j2
    if end < len(b) and any(line.strip() for line in b[end:]):
        out.append(mark)
    return "\n".join(out)


def cases(data: Path, n: int, max_chars: int) -> list[dict]:
    """The first ``n`` held-out recorded rewrites (not in the tests' fixture) of at most
    ``max_chars`` of old file that change something."""
    from agentspec.traces import load_records

    held = fixture_ids()
    out = []
    for rec in load_records(data / "file_rewrites.jsonl"):
        m, ch = _CURRENT.search(rec["prompt"]), _CHANGE.search(rec["prompt"])
        if rec["id"] in held or not m or not ch or len(m["code"]) > max_chars:
            continue
        old, new = m["code"] + "\n", rec["response"]
        snippet = morph_snippet(old, new, m["name"])
        if snippet is None:
            continue
        out.append({"id": rec["id"], "name": m["name"], "instruction": ch["instruction"].strip(), "old": old,
                    "new": new, "update": snippet})
        if len(out) == n:
            break
    return out


def messages(case: dict, variant: str) -> list[dict]:
    from agentspec.apply import APPLY_SYSTEM, apply_prompt

    code, update, instruction = case["old"], case["update"], case["instruction"]
    if variant == "aider":
        return [{"role": "user", "content": apply_prompt(code, update, instruction, case["name"])}]
    if variant == "morph":
        return [{"role": "system", "content": APPLY_SYSTEM},
                {"role": "user", "content": f"<instruction>{instruction}</instruction>\n<code>{code}</code>\n"
                                            f"<update>{update}</update>"}]
    if variant == "plain":
        return [{"role": "user", "content": "Merge the edit into the code and output the whole updated file.\n\n"
                                            f"Edit:\n{update}\n\nCode:\n{code}"}]
    raise ValueError(f"unknown prompt variant {variant!r}: use {', '.join(VARIANTS)}")


def first_difference(got: str, want: str) -> dict | None:
    if got == want:
        return None
    g, w = got.split("\n"), want.split("\n")
    i = next((k for k, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w)))
    return {"line": i + 1, "got": g[i] if i < len(g) else None, "want": w[i] if i < len(w) else None,
            "got_lines": len(g), "want_lines": len(w)}


def run_cases(base: str, model: str, cs: list[dict], variant: str, extra_for) -> dict:
    import openai

    from agentspec.apply import merged_code

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=3600, max_retries=0)
    rows = []
    for c in cs:
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=model, messages=messages(c, variant), temperature=0,
                                           max_tokens=len(c["new"]) // 2 + 256, extra_body=extra_for(c))
        dt = time.perf_counter() - t0
        merged = merged_code(r.choices[0].message.content or "", c["old"])
        diff = first_difference(merged, c["new"])
        loose = merged.rstrip() == c["new"].rstrip() and [x.rstrip() for x in merged.split("\n")] == \
            [x.rstrip() for x in c["new"].split("\n")]
        rows.append({"id": c["id"], "s": round(dt, 3), "completion_tokens": r.usage.completion_tokens,
                     "prompt_tokens": r.usage.prompt_tokens, "exact": diff is None, "whitespace_only": loose,
                     "first_difference": diff, "merged": merged})
        log(f"  {variant} {c['id']}: {'exact' if diff is None else 'differs at line %d' % diff['line']}, "
            f"{r.usage.completion_tokens} tokens in {dt:.2f} s")
    tokens, wall = sum(r["completion_tokens"] for r in rows), sum(r["s"] for r in rows)
    return {"exact": sum(r["exact"] for r in rows), "whitespace_only": sum(r["whitespace_only"] for r in rows),
            "cases": len(rows), "s_per_merge": round(wall / len(rows), 3), "tokens_per_s": round(tokens / wall, 2),
            "rows": rows}


def serve(cmd: list[str], port: int, log_path: Path, args, env=None) -> Process:
    return Process(cmd, port, log_path, "/health", args.start_timeout, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the .gguf file")
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--files", type=int, default=6, help="recorded rewrites to merge")
    ap.add_argument("--max-chars", type=int, default=3000, help="skip old files longer than this")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"prompt variants ({', '.join(VARIANTS)})")
    ap.add_argument("--methods", default="agentspec,llama.cpp", help="agentspec, llama.cpp (plain)")
    ap.add_argument("--llama-spec", default="", help="llama-server --spec-type values also timed (first variant)")
    ap.add_argument("--llama-draft-max", type=int, default=64)
    ap.add_argument("--llama-server", type=Path, help="default: benchmarks/peers/setup_llamacpp.sh's build")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        ap.error(f"--variants takes {', '.join(VARIANTS)}, got {args.variants!r}")
    methods = [m for m in args.methods.split(",") if m]
    if any(m not in ("agentspec", "llama.cpp") for m in methods):
        ap.error(f"--methods takes agentspec, llama.cpp, got {args.methods!r}")
    if not args.model.is_file():
        ap.error(f"--model {args.model}: no such file")
    cs = cases(args.data, args.files, args.max_chars)
    if not cs:
        raise SystemExit(f"no recorded rewrites under {args.max_chars} characters in {args.data}")
    server = llama_server(args.llama_server) if "llama.cpp" in methods else args.llama_server
    results: dict = {}
    kernels = None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for variant in variants:
            for m in methods:
                port = free_port()
                if m == "agentspec":
                    cmd = agentspec_cmd(args.model, port, args.threads)
                    p = serve(cmd, port, tmp / f"agentspec-{variant}.log", args, env=dict(os.environ))
                    name = args.model.name.removesuffix(".gguf")
                    def extra(c):
                        return {"prediction": {"type": "content", "content": c["old"]}, "spec_stats": True}
                else:
                    cmd = llama_cmd(server, args.model, port, args.threads, args.context)
                    p = serve(cmd, port, tmp / f"llama-{variant}.log", args)
                    name = args.model.name
                    def extra(c):
                        return {"cache_prompt": False}
                log(f"{m} {variant}: {len(cs)} merges")
                try:
                    out = run_cases(p.base, name, cs, variant, extra)
                    out.update(start_s=round(p.start_s, 2), peak_rss_bytes=peak_rss(p.proc.pid))
                finally:
                    p.stop()
                if m == "agentspec" and kernels is None:
                    kernels = server_kernels(p.log_path)
                results.setdefault(m, {})[variant] = out
                log(f"  {m} {variant}: exact {out['exact']}/{out['cases']}, {out['s_per_merge']} s per merge")
        for spec in [s for s in args.llama_spec.split(",") if s] if "llama.cpp" in methods else []:
            port = free_port()
            cmd = llama_cmd(server, args.model, port, args.threads, args.context, spec_type=spec,
                            draft_max=args.llama_draft_max)
            p = serve(cmd, port, tmp / f"llama-{spec}.log", args)
            log(f"llama.cpp:{spec} {variants[0]}: {len(cs)} merges")
            try:
                out = run_cases(p.base, args.model.name, cs, variants[0], lambda c: {"cache_prompt": False})
                out.update(start_s=round(p.start_s, 2), peak_rss_bytes=peak_rss(p.proc.pid))
            finally:
                p.stop()
            results.setdefault(f"llama.cpp:{spec}", {})[variants[0]] = out
    summary = {m: {v: {k: r[k] for k in ("exact", "whitespace_only", "cases", "s_per_merge", "tokens_per_s")}
                   for v, r in per.items()} for m, per in results.items()}
    for v in variants:
        a, b = results.get("agentspec", {}).get(v), results.get("llama.cpp", {}).get(v)
        if a and b:
            summary["agentspec"][v]["same_merge_as_llama_plain"] = sum(
                x["merged"] == y["merged"] for x, y in zip(a["rows"], b["rows"]))
            summary["agentspec"][v]["speed_vs_llama_plain"] = round(b["s_per_merge"] / a["s_per_merge"], 3)
    for m, per in summary.items():
        log(f"{m}: {json.dumps(per)}")
    report = {"benchmark": "bench_apply",
              "machine": machine_record(kernels=kernels, peers={"llama.cpp": llama_version(server)} if server else None),
              "config": {"model": str(args.model), "model_bytes": args.model.stat().st_size, "files": len(cs),
                         "max_chars": args.max_chars, "variants": variants, "threads": args.threads, "greedy": True,
                         "llama_spec": args.llama_spec, "llama_server": str(server) if server else None},
              "cases": [{k: c[k] for k in ("id", "name", "instruction", "update")} for c in cs],
              "summary": summary, "results": results}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
