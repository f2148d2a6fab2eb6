"""agentspec's drafters inside real SGLang vs SGLang's own NGRAM, EAGLE3 and no speculation, same prompts.

Each method is a fresh ``sglang.Engine`` in this process (started one after the other, so they
share the machine, never run together), fed the same prompts one at a time, greedy:

- ``none``: SGLang without speculation (the reference output);
- ``ngram``: SGLang's NGRAM (its C++ corpus, 18-token window), ``--speculative-num-draft-tokens D``;
- ``agentspec``: the AGENTSPEC algorithm (this repo's plugin: the suffix index over whole prompts
  and the tenant's history), same D;
- ``eagle3``: SGLang's EAGLE-3 worker with this repo's head, a chain of D - 1 drafts (topk 1);
- ``hybrid``: ``AGENTSPEC_EAGLE3`` (this repo's plugin): the same EAGLE-3 worker and head, each
  request's step verifying the suffix index's draft where it expects more than the head's.

Every method runs the prompts with the same verify width D. Each prompt is its own tenant, so the
suffix index drafts from the prompt (and what the request generates), not from earlier runs.

Reported per method and workload: SGLang's own ``spec_accept_length`` (mean over requests, and
the token-weighted figure: completion tokens / verify steps), tokens/s, start-up seconds,
whether each output is identical to ``none``'s and, for agentspec and hybrid, the accepted tokens
by source (``meta_info["agentspec_steps"]``). On a CPU, SGLang runs through a pure-torch
stand-in for its compiled kernels (tests/sglang/standin): absolute speeds mean little there,
acceptance lengths are what carry over.

    .venv-sglang/bin/python -m benchmarks.bench_sglang --out benchmarks/results/sglang_hybrid_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    ROOT,
    agent_prompts,
    emit_report,
    first_record,
    logger,
    rewrite_prompts,
)

DEFAULT_MODEL = ROOT / ".venv-sglang" / "models" / "SmolLM2-135M-Instruct"

log = logger("bench_sglang")


def engine_kwargs(method: str, model: str, draft_tokens: int, device: str, eagle3: str | None,
                  dtype: str = "bfloat16") -> dict:
    kw: dict = dict(model_path=model, device=device, dtype=dtype, max_running_requests=4,
                    mem_fraction_static=0.3, max_total_tokens=8192, log_level="error")
    if device == "cpu":
        kw["attention_backend"] = "intel_amx"
    if method == "ngram":
        kw.update(speculative_algorithm="NGRAM", speculative_num_draft_tokens=draft_tokens)
    elif method == "agentspec":
        kw.update(speculative_algorithm="AGENTSPEC", speculative_num_draft_tokens=draft_tokens)
    elif method in ("eagle3", "hybrid"):
        kw.update(speculative_algorithm="EAGLE3" if method == "eagle3" else "AGENTSPEC_EAGLE3",
                  speculative_draft_model_path=eagle3, speculative_num_steps=draft_tokens - 1,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=draft_tokens)
        if method == "hybrid":
            kw["disable_overlap_schedule"] = True
    elif method != "none":
        raise SystemExit(f"unknown method {method!r}")
    return kw


def run_method(method: str, sets: dict, args) -> dict:
    import sglang

    from agentspec.integrations.sglang.config import SOURCE_KEY, read_source_records, request_params

    t0 = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs(method, args.model, args.draft_tokens, args.device, args.eagle3, args.dtype))
    startup = time.perf_counter() - t0
    log(f"{method}: engine up in {startup:.1f}s")
    out: dict = {"startup_s": round(startup, 1), "workloads": {}}
    try:
        # warm-up: the first forward of each shape pays one-time costs
        engine.generate(input_ids=next(iter(sets.values()))[0][:64], sampling_params={"temperature": 0, "max_new_tokens": 4})
        for wl, prompts in sets.items():
            rows = []
            for i, ids in enumerate(prompts):
                sp = {"temperature": 0, "max_new_tokens": args.max_tokens}
                if method in ("agentspec", "hybrid"):
                    sp["custom_params"] = request_params(tenant=f"{wl}-{i}")
                t = time.perf_counter()
                r = engine.generate(input_ids=ids, sampling_params=sp)
                dt = time.perf_counter() - t
                meta = r["meta_info"]
                rows.append({"output_ids": list(r.get("output_ids") or []), "seconds": dt,
                             "completion_tokens": meta.get("completion_tokens"),
                             "spec": {k: v for k, v in meta.items() if k.startswith("spec_")},
                             "by_source": read_source_records(meta.get(SOURCE_KEY))})
                log(f"{method} {wl}[{i}]: {meta.get('completion_tokens')} tokens in {dt:.1f}s, "
                    f"accept length {meta.get('spec_accept_length')}")
            out["workloads"][wl] = rows
    finally:
        engine.shutdown()
    return out


def summarize(raw: dict) -> dict:
    ref = raw.get("none")
    res: dict = {}
    for method, r in raw.items():
        res[method] = {"startup_s": r["startup_s"]}
        for wl, rows in r["workloads"].items():
            toks = sum(x["completion_tokens"] or 0 for x in rows)
            secs = sum(x["seconds"] for x in rows)
            verify = sum(x["spec"].get("spec_verify_ct") or 0 for x in rows)
            accept = [x["spec"]["spec_accept_length"] for x in rows if x["spec"].get("spec_accept_length") is not None]
            entry = {"prompts": len(rows), "tokens": toks, "tokens_per_s": round(toks / secs, 2) if secs else None,
                     "accept_length_mean": round(statistics.fmean(accept), 3) if accept else None,
                     "accept_length_tokens_per_verify": round(toks / verify, 3) if verify else None}
            if ref is not None and method != "none":
                ref_rows = ref["workloads"].get(wl, [])
                same = [a["output_ids"] == b["output_ids"] for a, b in zip(rows, ref_rows)]
                entry["identical_to_none"] = f"{sum(same)}/{len(same)}"
            by: dict = {}
            for x in rows:
                for src, (steps, drafted, accepted) in (x.get("by_source") or {}).items():
                    t = by.setdefault(src, {"steps": 0, "drafted": 0, "accepted": 0})
                    t["steps"] += steps
                    t["drafted"] += drafted
                    t["accepted"] += accepted
            if by:
                entry["by_source"] = by
            res[method][wl] = entry
    ratios: dict = {}
    for wl in next(iter(raw.values()))["workloads"]:
        al = {m: res.get(m, {}).get(wl, {}).get("accept_length_tokens_per_verify") for m in res}
        for num, den in (("agentspec", "ngram"), ("hybrid", "eagle3"), ("hybrid", "agentspec")):
            if al.get(num) and al.get(den):
                ratios[f"{wl}_accept_length_{num}_over_{den}"] = round(al[num] / al[den], 3)
    if ratios:
        res["ratios"] = ratios
    return res


def bars(res: dict) -> dict:
    """The hybrid's targets: acceptance length >= 1.3x EAGLE3 and >= 1.15x AGENTSPEC on agent
    turns, >= AGENTSPEC on rewrites; every output identical to no speculation."""
    r = res.get("ratios", {})
    out = {}
    for key, want in (("agent_accept_length_hybrid_over_eagle3", 1.3), ("agent_accept_length_hybrid_over_agentspec", 1.15),
                      ("rewrites_accept_length_hybrid_over_agentspec", 1.0)):
        if key in r:
            out[key] = {"value": r[key], "bar": want, "met": r[key] >= want}
    identical = [v.get("identical_to_none") for m, wls in res.items() if m not in ("ratios", "none")
                 for wl, v in wls.items() if isinstance(v, dict) and "identical_to_none" in v]
    if identical:
        out["all_identical_to_none"] = all(a == b for a, b in (x.split("/") for x in identical))
    return out


def machine() -> dict:
    """The CPU as lscpu names it, its core count and its SIMD flags (avx*, amx*)."""
    import subprocess

    info: dict = {"cores": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                info["cpu"] = value.strip()
            elif key.strip() == "Flags":
                info["flags"] = sorted(f for f in value.split() if f.startswith(("avx", "amx", "fma")))
    except (OSError, subprocess.SubprocessError):
        info["cpu"] = platform.processor() or platform.machine()
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="Hugging Face model folder")
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU (SGLang's bf16 CPU verify is not "
                    "row-invariant: its own NGRAM diverges from plain there), bfloat16 on CUDA")
    ap.add_argument("--methods", default="none,ngram,agentspec,eagle3,hybrid")
    ap.add_argument("--eagle3", default=str(ROOT / "agentspec" / "heads" / "smollm2-135m-instruct-eagle3"))
    ap.add_argument("--draft-tokens", type=int, default=8, help="SGLang's verify width D")
    ap.add_argument("--agent", type=int, default=4)
    ap.add_argument("--rewrites", type=int, default=4)
    ap.add_argument("--max-prompt", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts-file", type=Path, help="tokenized prompts (JSON {workload: [[ids]]})")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.device == "cpu":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")   # SGLang reads it once, at import

    if args.prompts_file:
        sets = json.loads(args.prompts_file.read_text())
    else:
        from agentspec.backends.embedded.engine import EmbeddedEngine

        tok_engine = EmbeddedEngine(quiet=True)   # the same tokenizer and chat template as the HF folder
        sets = {"rewrites": rewrite_prompts(tok_engine, args.data, args.rewrites, args.max_prompt,
                                            first_record(args.data, 200)),
                "agent": agent_prompts(tok_engine, args.data, args.agent, args.max_prompt, first_record(args.data, 150))}
        del tok_engine
    raw = {}
    for m in args.methods.split(","):
        try:
            raw[m] = run_method(m, sets, args)
        except Exception as e:  # noqa: BLE001 - one failing method must not lose the others
            log(f"{m}: {type(e).__name__}: {e}")
            raw[m] = {"startup_s": None, "workloads": {}, "error": f"{type(e).__name__}: {e}"}
    ok = {m: r for m, r in raw.items() if "error" not in r}
    import sglang
    import torch

    results = summarize(ok) if ok else {}
    report = {"machine": machine(),
              "sglang": sglang.__version__, "torch": torch.__version__, "device": args.device, "dtype": args.dtype,
              "kernels": "pure-torch sgl_kernel stand-in (tests/sglang/standin), intel_amx attention backend"
              if args.device == "cpu" else "sgl_kernel",
              "draft_tokens": args.draft_tokens, "max_tokens": args.max_tokens,
              "prompts": {k: len(v) for k, v in sets.items()},
              "results": results, "bars": bars(results),
              "errors": {m: r["error"] for m, r in raw.items() if "error" in r}}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
