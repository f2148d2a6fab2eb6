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

    .venv-sglang/bin/python -m benchmarks.bench_sglang --out FILE.json

On a GPU (benchmarks/gpu/kit runs it so): ``--device cuda --attention-backend triton
--deterministic --disable-cuda-graph --concurrency 1,16 --reference-logprobs``. ``--concurrency``
runs the prompts once per level c: one at a time for c = 1 (per workload, as above), and for c > 1
every workload's prompts together in batches of c requests sent at once (tokens/s over the whole
batch, keys ``WORKLOAD@cC``). With ``--reference-logprobs`` the ``none`` run also returns its top-2
log-probabilities, and every output that differs from ``none``'s is reported at its first differing
token with ``none``'s margin there (top-1 minus top-2 logit): ``divergences`` in the report.
``--sampled N`` adds N sampled requests (temperature 0.7, seeded) per method, which must complete.
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

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`; last, so that
    # `agentspec` is the installed package (the source tree's has no `integrations`: it ships from the root)
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    ROOT,
    agent_prompts,
    emit_report,
    first_record,
    logger,
    machine_record,
    rewrite_prompts,
    write_json,
)

DEFAULT_MODEL = ROOT / ".venv-sglang" / "models" / "SmolLM2-135M-Instruct"

log = logger("bench_sglang")


def engine_kwargs(method: str, model: str, draft_tokens: int, device: str, eagle3: str | None,
                  dtype: str = "bfloat16", *, max_running: int = 4, attention_backend: str | None = None,
                  deterministic: bool = False, disable_cuda_graph: bool = False, fp32_lm_head: bool = False) -> dict:
    kw: dict = dict(model_path=model, device=device, dtype=dtype, max_running_requests=max(4, max_running),
                    mem_fraction_static=0.3, max_total_tokens=max(8192, 2048 * max_running), log_level="error")
    if device == "cpu":
        kw["attention_backend"] = "intel_amx"
    if attention_backend:
        kw["attention_backend"] = attention_backend
    if deterministic:
        kw["enable_deterministic_inference"] = True
    if disable_cuda_graph:
        kw["disable_cuda_graph"] = True
    if fp32_lm_head:
        kw["enable_fp32_lm_head"] = True
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

    levels = concurrency_levels(args.concurrency)
    t0 = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs(method, args.model, args.draft_tokens, args.device, args.eagle3, args.dtype,
                                           max_running=max(levels), attention_backend=args.attention_backend,
                                           deterministic=args.deterministic,
                                           disable_cuda_graph=args.disable_cuda_graph,
                                           fp32_lm_head=args.fp32_lm_head))
    startup = time.perf_counter() - t0
    log(f"{method}: engine up in {startup:.1f}s")
    out: dict = {"startup_s": round(startup, 1), "workloads": {}, "batches": {}}
    logprobs = args.reference_logprobs and method == "none"

    def params(wl: str, i: int) -> dict:
        sp: dict = {"temperature": 0, "max_new_tokens": args.max_tokens}
        if method in ("agentspec", "hybrid"):
            drafters = args.hybrid_drafters if method == "hybrid" else None
            sp["custom_params"] = request_params(tenant=f"{wl}-{i}", drafters=drafters)
        return sp

    def row(r: dict, dt: float) -> dict:
        meta = r["meta_info"]
        x = {"output_ids": list(r.get("output_ids") or []), "seconds": dt,
             "completion_tokens": meta.get("completion_tokens"),
             "spec": {k: v for k, v in meta.items() if k.startswith("spec_")},
             "by_source": read_source_records(meta.get(SOURCE_KEY))}
        if logprobs:
            x["top_logprobs"] = [[[lp, tok] for lp, tok, *_ in (pos or [])] for pos in meta.get("output_top_logprobs") or []]
        return x

    extra = dict(return_logprob=True, top_logprobs_num=2) if logprobs else {}
    try:
        # warm-up: the first forward of each shape pays one-time costs
        engine.generate(input_ids=next(iter(sets.values()))[0][:64], sampling_params={"temperature": 0, "max_new_tokens": 4})
        for c in levels:
            if c == 1:
                for wl, prompts in sets.items():
                    rows = []
                    for i, ids in enumerate(prompts[:args.c1_prompts or None]):
                        t = time.perf_counter()
                        r = engine.generate(input_ids=ids, sampling_params=params(wl, i), **extra)
                        rows.append(row(r, time.perf_counter() - t))
                        log(f"{method} {wl}[{i}]: {rows[-1]['completion_tokens']} tokens in {rows[-1]['seconds']:.1f}s, "
                            f"accept length {rows[-1]['spec'].get('spec_accept_length')}")
                    out["workloads"][wl] = rows
                continue
            # c > 1: every workload's prompts together, c at a time
            jobs = [(wl, i, ids) for wl, prompts in sets.items() for i, ids in enumerate(prompts)]
            keyed: dict = {f"{wl}@c{c}": [None] * len(prompts) for wl, prompts in sets.items()}
            tokens, seconds = 0, 0.0
            for k in range(0, len(jobs), c):
                chunk = jobs[k:k + c]
                t = time.perf_counter()
                rs = engine.generate(input_ids=[ids for _, _, ids in chunk],
                                     sampling_params=[params(wl, i) for wl, i, _ in chunk], **extra)
                dt = time.perf_counter() - t
                seconds += dt
                for (wl, i, _), r in zip(chunk, rs):
                    keyed[f"{wl}@c{c}"][i] = row(r, dt)
                    tokens += keyed[f"{wl}@c{c}"][i]["completion_tokens"] or 0
            out["workloads"].update(keyed)
            out["batches"][f"c{c}"] = {"requests": len(jobs), "tokens": tokens, "seconds": round(seconds, 3),
                                      "tokens_per_s": round(tokens / seconds, 2) if seconds else None}
            log(f"{method} c={c}: {tokens} tokens in {seconds:.1f}s")
        if args.sampled:
            ids = next(iter(sets.values()))[0]
            done = []
            for k in range(args.sampled):
                sp = {"temperature": 0.7, "top_p": 0.95, "max_new_tokens": args.max_tokens, "sampling_seed": 1234 + k}
                if method in ("agentspec", "hybrid"):
                    sp["custom_params"] = request_params(tenant=f"sampled-{k}")
                r = engine.generate(input_ids=ids, sampling_params=sp)
                done.append({"completion_tokens": r["meta_info"].get("completion_tokens"),
                             "spec_accept_length": r["meta_info"].get("spec_accept_length"),
                             "output_ids": list(r.get("output_ids") or [])})
            out["sampled"] = done
    finally:
        engine.shutdown()
    return out


def concurrency_levels(text: str) -> list[int]:
    levels = sorted({int(x) for x in str(text).split(",") if x.strip()})
    if not levels or levels[0] < 1:
        raise SystemExit(f"--concurrency must be positive integers, got {text!r}")
    return levels


def first_divergence(ref_ids: list[int], got_ids: list[int], ref_top: list | None = None) -> dict | None:
    """Where ``got_ids`` first leaves ``ref_ids`` (None when equal): the position, both tokens and,
    with the reference's top log-probabilities there (``[[logprob, token], ...]``), its top two
    and their margin (top-1 minus top-2 log-probability, which is the logit margin), and whether
    the diverging token was the reference's second choice (a near tie, not a wrong verify)."""
    if list(ref_ids) == list(got_ids):
        return None
    n = min(len(ref_ids), len(got_ids))
    j = next((i for i in range(n) if ref_ids[i] != got_ids[i]), n)
    entry: dict = {"position": j, "none_token": ref_ids[j] if j < len(ref_ids) else None,
                   "token": got_ids[j] if j < len(got_ids) else None}
    top = sorted(ref_top[j], key=lambda t: -t[0]) if ref_top and j < len(ref_top) and ref_top[j] else []
    if top:
        entry["none_top2"] = [[int(tok), round(float(lp), 6)] for lp, tok in top[:2]]
        if len(top) >= 2:
            entry["margin"] = round(float(top[0][0]) - float(top[1][0]), 6)
            entry["token_is_none_second_choice"] = int(top[1][1]) == entry["token"]
    return entry


def divergences(raw: dict) -> list[dict]:
    """Every output that differs from ``none``'s for the same prompt and concurrency, at its first
    differing token (later tokens follow from a different context, so only the first is news)."""
    ref = raw.get("none")
    out = []
    if ref is None:
        return out
    for method, r in raw.items():
        if method == "none":
            continue
        for key, rows in r["workloads"].items():
            for i, (a, b) in enumerate(zip(ref["workloads"].get(key, []), rows)):
                d = first_divergence(a["output_ids"], b["output_ids"], a.get("top_logprobs"))
                if d is not None:
                    out.append({"method": method, "workload": key, "prompt": i, **d})
    # plain decoding against itself: the same prompts one at a time and batched
    for key, rows in ref["workloads"].items():
        if "@c" in key:
            base = ref["workloads"].get(key.split("@")[0], [])
            for i, (a, b) in enumerate(zip(base, rows)):
                d = first_divergence(a["output_ids"], b["output_ids"], a.get("top_logprobs"))
                if d is not None:
                    out.append({"method": "none", "workload": key, "prompt": i, "against": "none@c1", **d})
    return out


def summarize(raw: dict) -> dict:
    ref = raw.get("none")
    res: dict = {}
    for method, r in raw.items():
        res[method] = {"startup_s": r["startup_s"]}
        if r.get("batches"):
            res[method]["batches"] = r["batches"]
        if r.get("sampled") is not None:
            res[method]["sampled"] = {"requests": len(r["sampled"]),
                                      "tokens": sum(x["completion_tokens"] or 0 for x in r["sampled"])}
        for wl, rows in r["workloads"].items():
            toks = sum(x["completion_tokens"] or 0 for x in rows)
            secs = sum(x["seconds"] for x in rows)
            verify = sum(x["spec"].get("spec_verify_ct") or 0 for x in rows)
            accept = [x["spec"]["spec_accept_length"] for x in rows if x["spec"].get("spec_accept_length") is not None]
            batched = "@c" in wl   # tokens/s of a batch is in "batches" (its rows share its time)
            entry = {"prompts": len(rows), "tokens": toks,
                     "tokens_per_s": round(toks / secs, 2) if secs and not batched else None,
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
    if ref is not None:   # plain decoding batched against one at a time
        for key, rows in ref["workloads"].items():
            if "@c" in key and key.split("@")[0] in ref["workloads"]:
                same = [a["output_ids"] == b["output_ids"] for a, b in zip(ref["workloads"][key.split("@")[0]], rows)]
                res["none"][key]["identical_to_c1"] = f"{sum(same)}/{len(same)}"
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


def machine(device: str = "cpu") -> dict:
    """The CPU as lscpu names it, its core count and its SIMD flags (avx*, amx*); on CUDA also the
    GPU, its driver and memory as nvidia-smi reports them, and the CUDA torch was built for."""
    import subprocess

    info: dict = {"cores": os.cpu_count()}
    if device.startswith("cuda"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
            info["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError) as e:
            info["gpus"] = f"nvidia-smi: {e}"
        import torch

        info["torch_cuda"] = torch.version.cuda
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


def kernels_note(device: str) -> str:
    try:
        import sgl_kernel
    except ImportError:
        return "no sgl_kernel"
    if getattr(sgl_kernel, "AGENTSPEC_CUDA_STANDIN", False):
        return ("torch/Triton sgl_kernel stand-in (tests/sglang/standin_cuda): tree ops and renorm in the wheel's "
                "Triton, sampled verification and RMSNorm in torch")
    if getattr(sgl_kernel, "AGENTSPEC_STANDIN", False):
        return "pure-torch sgl_kernel stand-in (tests/sglang/standin), intel_amx attention backend"
    return f"sgl_kernel {getattr(sgl_kernel, '__version__', '?')}"


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
    ap.add_argument("--concurrency", default="1", help="comma-separated levels, e.g. 1,16 (see above)")
    ap.add_argument("--c1-prompts", type=int, default=0, help="at c = 1 only the first N prompts of each workload "
                    "(default: all; c > 1 always runs all)")
    ap.add_argument("--attention-backend", help="SGLang's attention backend (default: intel_amx on CPU, SGLang's choice else)")
    ap.add_argument("--deterministic", action="store_true", help="SGLang's --enable-deterministic-inference "
                    "(batch-invariant kernels; on CUDA with the triton, fa3 or flashinfer attention backend)")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--fp32-lm-head", action="store_true", help="SGLang's enable_fp32_lm_head: float32 logits, so "
                    "that near ties are not rounded to bf16 steps (divergence margins read finer)")
    ap.add_argument("--reference-logprobs", action="store_true",
                    help="none returns its top-2 log-probabilities: divergences carry the margin at the first differing token")
    ap.add_argument("--sampled", type=int, default=0, help="sampled requests per method (temperature 0.7), after the greedy ones")
    ap.add_argument("--hybrid-drafters", type=lambda t: [x for x in t.split(",") if x], default=None,
                    help="the hybrid's drafter list per request, e.g. 'suffix>eagle3' (switch, the default) or "
                         "'suffix,eagle3' (both trees as siblings)")
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
    sets = {wl: prompts for wl, prompts in sets.items() if prompts}   # --rewrites 0: agent turns only
    if not sets:
        raise SystemExit("bench_sglang: no prompts (--agent and --rewrites are both 0)")
    import sglang
    import torch

    # the common machine record (harness), with lscpu's and nvidia-smi's view over it; the kernels
    # are SGLang's (kernels_note), the dtype the engine's
    record = {**machine_record(peers={"sglang": sglang.__version__}), **machine(args.device),
              "kernel_plan": kernels_note(args.device), "dtype": args.dtype}

    def report_of(raw: dict, done: bool) -> dict:
        ok = {m: r for m, r in raw.items() if "error" not in r}
        results = summarize(ok) if ok else {}
        return {"machine": record,
                "sglang": sglang.__version__, "torch": torch.__version__, "device": args.device, "dtype": args.dtype,
                "kernels": kernels_note(args.device),
                "engine": {k: v for k, v in engine_kwargs("none", args.model, args.draft_tokens, args.device, None,
                                                           args.dtype, max_running=max(concurrency_levels(args.concurrency)),
                                                           attention_backend=args.attention_backend,
                                                           deterministic=args.deterministic,
                                                           disable_cuda_graph=args.disable_cuda_graph,
                                                           fp32_lm_head=args.fp32_lm_head).items()
                           if k not in ("model_path", "log_level")},
                "draft_tokens": args.draft_tokens, "max_tokens": args.max_tokens,
                "concurrency": concurrency_levels(args.concurrency),
                "prompts": {k: len(v) for k, v in sets.items()},
                "methods_asked": args.methods.split(","), "complete": done,
                "results": results, "bars": bars(results),
                "divergences": divergences(ok),
                "reference_logprobs": bool(args.reference_logprobs),
                "errors": {m: r["error"] for m, r in raw.items() if "error" in r}}

    raw: dict = {}
    for m in args.methods.split(","):
        try:
            raw[m] = run_method(m, sets, args)
        except Exception as e:  # noqa: BLE001 - one failing method must not lose the others
            log(f"{m}: {type(e).__name__}: {e}")
            raw[m] = {"startup_s": None, "workloads": {}, "error": f"{type(e).__name__}: {e}"}
        if args.out:   # after every method: a run cut off by a time limit still leaves what finished
            write_json(report_of(raw, False), args.out, indent=2)
    report = report_of(raw, True)
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
