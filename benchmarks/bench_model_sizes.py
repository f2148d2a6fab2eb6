"""Per-token cost of the embedded engine at real model sizes (random weights, no download).

Writes a checkpoint with the shapes of a published model (default: Qwen2.5-Coder-1.5B) and random
bfloat16 weights through transformers (a Hugging Face folder, cached in --workdir), loads it
with ``Engine.embedded`` as ``agentspec serve --model`` would (native row-invariant linears where
the CPU has them, one weight copy where two do not fit, the attention path the shape takes) and
measures after a ``context``-token prefill: a plain decoding step (1 row) and a verification step
of R rows (a chain draft), for R in --rows, at each --context.

Peers in the same run, on the same weights: transformers (plain greedy ``generate``, bfloat16)
and llama.cpp (llama-cpp-python from --llamacpp-python, F16 and Q8_0 GGUF files written from the
folder with the ``gguf`` package: a step of 1 and of R tokens after the same context). Peers that
do not fit in memory beside the checkpoint are skipped with the reason.

From the step costs and the replay MAT (``benchmarks/replay.py``, held-out traffic, budget 32)
it prints the speed-up speculation would give: ``min(MAT, R) * t(1) / t(R)``, best R. That is a
model (measured step cost x replayed acceptance), not a measurement of a served request.

    .venv/bin/python -m benchmarks.bench_model_sizes --shape qwen2.5-coder-1.5b \
        --out benchmarks/results/model_sizes_qwen2.5-coder-1.5b.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import agentspec  # noqa: F401  (first: OpenMP / ISA environment before torch loads)

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import ROOT, emit_report, logger, machine_record  # noqa: E402

SHAPES = {
    # hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied, family
    "qwen2.5-coder-1.5b": dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128, hidden_dim=8960,
                               vocab_size=151936, tie_embeddings=True, family="qwen2", max_seq_len=32768),
    # a quick check of this script (seconds), not a published shape
    "tiny": dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, hidden_dim=512, vocab_size=50000,
                 tie_embeddings=True, family="qwen2", max_seq_len=4096),
    "qwen2.5-coder-7b": dict(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128, hidden_dim=18944,
                             vocab_size=152064, tie_embeddings=False, family="qwen2", max_seq_len=32768),
}
# held-out replay MAT at budget 32 (benchmarks/replay.py; docs/benchmarks.md)
REPLAY_MAT = {"rewrites": 25.24, "agent_turns": 3.26}


log = logger("bench_model_sizes")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def family_checkpoints():
    """``tests/helpers/families.py``, the tests' checkpoint and GGUF writers (the one module this
    script imports from outside the package: ``tests/`` put on the path once, here)."""
    path = str(ROOT / "tests")
    if path not in sys.path:
        sys.path.insert(0, path)
    from helpers import families

    return families


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def checkpoint(shape: dict, folder: Path) -> Path:
    """The shape as a Hugging Face folder with random bfloat16 weights (written once)."""
    if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
        return folder
    import torch

    write_family = family_checkpoints().write_family
    log(f"writing a random-weight checkpoint to {folder} (transformers, bfloat16)")
    t0 = time.perf_counter()
    write_family(folder, shape["family"], dim=shape["dim"], layers=shape["n_layers"], heads=shape["n_heads"],
                 kv_heads=shape["n_kv_heads"], hidden=shape["hidden_dim"], vocab_size=shape["vocab_size"],
                 tie_word_embeddings=shape["tie_embeddings"], max_position_embeddings=shape["max_seq_len"],
                 init_std=0.02, dtype=torch.bfloat16, build_dtype=torch.bfloat16)
    log(f"checkpoint written in {time.perf_counter() - t0:.0f}s")
    return folder


def gguf_file(folder: Path, qtype: str) -> Path:
    path = folder / f"model-{qtype}.gguf"
    if not path.exists():
        log(f"writing {path.name} (gguf package)")
        tmp = path.with_suffix(".tmp")
        family_checkpoints().write_gguf(folder, tmp, qtype=qtype)
        tmp.replace(path)
    return path


LLAMACPP_STEPS = r"""
import json, statistics, sys, time
from llama_cpp import Llama
spec = json.loads(sys.argv[1])
ctx, rows, repeat = spec["context"], spec["rows"], spec["repeat"]
llm = Llama(model_path=spec["model"], n_ctx=ctx + max(rows) + 8, n_threads=spec["threads"],
            n_threads_batch=spec["threads"], n_batch=512, n_ubatch=512, logits_all=True, verbose=False)
# logits_all: a verification step needs every row's logits, as ours computes them
vocab = llm.n_vocab()
ids = [(1000 + i) % vocab for i in range(ctx)]
t = time.perf_counter(); llm.eval(ids); prefill = time.perf_counter() - t
out = {"prefill_s": prefill, "prefill_note": "with logits for every prompt row (logits_all)", "step_ms": {}}
ts = {n: [] for n in rows}
for rnd in range(repeat + 1):   # rounds over every row count (as ours); round 0 warms up
    for n in rows:
        llm.n_tokens = ctx          # eval() drops the cache past n_tokens: the same context each time
        t = time.perf_counter(); llm.eval([100] * n); dt = time.perf_counter() - t
        if rnd:
            ts[n].append(dt)
out["step_ms"] = {str(n): statistics.median(ts[n]) * 1000 for n in rows}
import llama_cpp
out["version"] = llama_cpp.__version__
out["system_info"] = llama_cpp.llama_print_system_info().decode()
print(json.dumps(out))
"""


def llamacpp_steps(python: str, model: Path, contexts: list[int], rows: list[int], repeat: int, threads: int) -> dict:
    """llama.cpp's cost of a step of 1 and of R tokens after each context (a fresh process per context)."""
    out = {}
    for ctx in contexts:
        spec = {"model": str(model), "context": ctx, "rows": [1, *[r for r in rows if r > 1]], "repeat": repeat,
                "threads": threads}
        p = subprocess.run([python, "-c", LLAMACPP_STEPS, json.dumps(spec)], capture_output=True, text=True,
                           timeout=3600)
        if p.returncode:
            raise RuntimeError(f"llama.cpp run failed: {p.stderr[-2000:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        log(f"llama.cpp {model.name} context {ctx}: prefill {r['prefill_s']:.1f}s, "
            + ", ".join(f"{k} rows {v:.1f} ms" for k, v in r["step_ms"].items()))
        out[str(ctx)] = r
    return out


def step_costs(args, model, contexts: list[int], rows: list[int], repeat: int) -> dict:
    import torch

    from agentspec.backends.embedded.model import KVCache
    from agentspec.kernels.tree import tree_mask

    out = {}
    for ctx in contexts:
        cache = KVCache(args, ctx + max(rows) + 8, dtype=torch.float32, device="cpu")
        ids = torch.arange(1000, 1000 + ctx) % args.vocab_size
        t0 = time.perf_counter()
        with torch.inference_mode():
            for s in range(0, ctx, 1024):   # prefill in 1k-token chunks
                e = min(s + 1024, ctx)
                model(ids[s:e], torch.arange(s, e), cache, logits_rows=slice(-1, None), prefill=s > 0)
                cache.commit(list(range(e - s)))
        log(f"context {ctx}: prefill {time.perf_counter() - t0:.1f}s")
        # every row count once per round, rounds repeated: a slow spell of the machine (a VM's
        # neighbours) lands on all of them alike instead of on one; medians over the rounds
        ns = [1, *[r for r in rows if r > 1]]
        inputs = {}
        for n in ns:
            mask = torch.zeros(n, ctx + n, dtype=torch.bool)
            mask[:, :ctx] = True
            mask[:, ctx:] = tree_mask(list(range(-1, n - 1)))
            inputs[n] = (torch.full((n,), 100), torch.arange(ctx, ctx + n), mask)
        ts: dict[int, list[float]] = {n: [] for n in ns}
        with torch.inference_mode():
            for rnd in range(repeat + 1):   # round 0 warms up
                for n in ns:
                    tok, pos, mask = inputs[n]
                    t = time.perf_counter()
                    model(tok, pos, cache, mask, logits_rows=slice(0, n))
                    if rnd:
                        ts[n].append(time.perf_counter() - t)
        per = {n: statistics.median(ts[n]) * 1000 for n in ns}
        log(f"context {ctx}: " + ", ".join(f"{n} rows {per[n]:.1f} ms" for n in ns))
        out[ctx] = per
        del cache
        gc.collect()
    return out


def transformers_decode(folder: Path, context: int, tokens: int) -> dict:
    """transformers' plain decoding step after ``context`` tokens: the median over ``tokens``
    one-token forwards with its KV cache (``DynamicCache``), after a warm-up."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size
    ids = (torch.arange(1000, 1000 + context) % vocab).unsqueeze(0)
    with torch.inference_mode():
        model(ids[:, :16], use_cache=True)   # warm-up: from_pretrained maps the weights; this pages them in
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - t0
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        ts = []
        for _ in range(tokens + 1):
            t = time.perf_counter()
            out = model(tok, past_key_values=past, use_cache=True)
            ts.append(time.perf_counter() - t)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    per_token = statistics.median(ts[1:])
    return {"context": context, "tokens": tokens, "prefill_s": prefill, "ms_per_token": per_token * 1000,
            "tok_s": 1 / per_token, "dtype": "bfloat16", "attention": model.config._attn_implementation,
            "version": transformers.__version__, "method": "median one-token forward with the KV cache"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-coder-1.5b")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--rows", default="1,4,8,16,32")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "agentspec" / "bench_model_sizes",
                    help="where the random-weight checkpoints and GGUF files are written (reused)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--llamacpp-python", default="/work/venvs/llamacpp/bin/python",
                    help="a python with llama-cpp-python installed; skipped when absent")
    ap.add_argument("--llamacpp-types", default="F16,Q8_0")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import torch

    import agentspec

    shape = SHAPES[a.shape]
    n_params = (shape["vocab_size"] * shape["dim"] * (1 if shape["tie_embeddings"] else 2)
                + shape["n_layers"] * (shape["dim"] * shape["head_dim"] * (2 * shape["n_heads"] + 2 * shape["n_kv_heads"])
                                       + 3 * shape["dim"] * shape["hidden_dim"]))
    ram = ram_bytes()
    contexts = [int(x) for x in a.contexts.split(",")]
    rows = [int(x) for x in a.rows.split(",")]
    report = {"benchmark": "bench_model_sizes", "shape": a.shape, "params": n_params, "machine": machine_record(),
              "threads": torch.get_num_threads(),
              "dtype": "bfloat16", "kv_dtype": "float32", "replay_mat": REPLAY_MAT, "ram_gib": ram / 2**30}
    if n_params * 2 > 0.85 * ram:
        report["skipped"] = f"bf16 weights need {n_params * 2 / 2**30:.1f} GiB; this machine has {ram / 2**30:.1f} GiB"
        log(report["skipped"])
    else:
        folder = checkpoint(shape, a.workdir / a.shape)
        t0 = time.perf_counter()
        engine = agentspec.Engine.embedded(model=str(folder), max_context=max(contexts) + max(rows) + 64,
                                           row_cost=0.5)
        report["load_s"] = time.perf_counter() - t0
        report["peak_rss_gib_after_load"] = peak_rss_gib()
        report["machine"] = machine_record(engine)
        log(f"{a.shape}: {n_params / 1e9:.2f}B parameters, loaded in {report['load_s']:.1f}s, peak RSS "
            f"{report['peak_rss_gib_after_load']:.1f} GiB, {engine.model.weight_copies} weight cop"
            f"{'y' if engine.model.weight_copies == 1 else 'ies'}")
        costs = step_costs(engine.args, engine.model, contexts, rows, a.repeat)
        report["step_ms"] = {str(c): {str(r): v for r, v in per.items()} for c, per in costs.items()}
        report["plain_tok_s"] = {str(c): 1000 / per[1] for c, per in costs.items()}
        model_speedups = {}
        for c, per in costs.items():
            for work, mat in REPLAY_MAT.items():
                best = max((min(mat, r) * per[1] / per[r], r) for r in per)
                model_speedups.setdefault(str(c), {})[work] = {"speedup": best[0], "rows": best[1]}
        report["modelled_speedup"] = model_speedups
        report["modelled_speedup_note"] = ("a model: min(replay MAT, R) x t(1 row) / t(R rows), best R; "
                                           "not a measurement of served requests")
        del engine
        gc.collect()
        if not Path(a.llamacpp_python).exists():
            report["llamacpp"] = {"skipped": f"no llama-cpp-python at {a.llamacpp_python}"}
        elif n_params * 6 > 0.85 * ram:
            report["llamacpp"] = {"skipped": f"writing the GGUF files needs ~{n_params * 6 / 2**30:.0f} GiB "
                                             f"(float32 state + F16 output); this machine has {ram / 2**30:.1f} GiB"}
        else:
            report["llamacpp"] = {}
            for qtype in a.llamacpp_types.split(","):
                path = gguf_file(folder, qtype)
                report["llamacpp"][qtype] = llamacpp_steps(a.llamacpp_python, path, contexts, rows, a.repeat,
                                                           torch.get_num_threads())
        if not a.no_transformers:
            log("transformers: plain greedy decoding, same weights, bf16")
            report["transformers"] = [transformers_decode(folder, c, 16) for c in contexts]
    report["peak_rss_gib"] = peak_rss_gib()
    emit_report(report, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
