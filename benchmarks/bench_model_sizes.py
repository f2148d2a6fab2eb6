"""Per-token cost of the embedded engine at real model sizes (random weights, no download).

Builds a model with the shapes of a published checkpoint (default: Qwen2.5-Coder-1.5B) with
random bfloat16 weights, as ``Engine.embedded`` runs it (native row-invariant linears where the
CPU has them; the attention path the shape takes), and measures after a ``context``-token
prefill: a plain decoding step (1 row) and a verification step of R rows (a chain draft), for
R in --rows, at each --context. transformers runs the same shapes (plain greedy decoding,
``generate``) in the same run unless --no-transformers.

From those step costs and the replay MAT (``benchmarks/replay.py``, held-out traffic, budget 32)
it prints the speed-up speculation would give: ``min(MAT, R) * t(1) / t(R)``, best R. That is a
model (measured step cost x replayed acceptance), not a measurement of a served request.

    .venv/bin/python benchmarks/bench_model_sizes.py --shape qwen2.5-coder-1.5b \
        --out benchmarks/results/model_sizes_qwen2.5-coder-1.5b.json
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import agentspec  # noqa: F401  (first: OpenMP / ISA environment before torch loads)

SHAPES = {
    # hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied, family
    "qwen2.5-coder-1.5b": dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128, hidden_dim=8960,
                               vocab_size=151936, tie_embeddings=True, family="qwen2", qkv_bias=True,
                               rope_base=1e6, max_seq_len=32768),
    "qwen2.5-coder-7b": dict(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128, hidden_dim=18944,
                             vocab_size=152064, tie_embeddings=False, family="qwen2", qkv_bias=True,
                             rope_base=1e6, max_seq_len=32768),
}
# held-out replay MAT at budget 32 (benchmarks/replay.py; docs/benchmarks.md)
REPLAY_MAT = {"rewrites": 25.24, "agent_turns": 3.26}


def log(msg: str) -> None:
    print(f"[bench_model_sizes] {msg}", file=sys.stderr, flush=True)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build(shape: dict):
    import torch

    from agentspec.engine.model import ModelArgs, Transformer
    from agentspec.kernels import cpu_linear

    args = ModelArgs(**shape)
    model = Transformer(args, init_weights=False).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02))
    model.rope_cos = model.rope_cos.float()
    model.rope_sin = model.rope_sin.float()
    native = model.pack_linears() if cpu_linear.linear_supported(torch.bfloat16, torch.device("cpu")) else False
    return args, model, native


def step_costs(args, model, contexts: list[int], rows: list[int], repeat: int) -> dict:
    import torch

    from agentspec.engine.model import KVCache
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
        per = {}
        for n in [1, *[r for r in rows if r > 1]]:
            tok = torch.full((n,), 100)
            pos = torch.arange(ctx, ctx + n)
            mask = torch.zeros(n, ctx + n, dtype=torch.bool)
            mask[:, :ctx] = True
            mask[:, ctx:] = tree_mask(list(range(-1, n - 1)))
            ts = []
            with torch.inference_mode():
                for _ in range(repeat + 1):
                    t = time.perf_counter()
                    model(tok, pos, cache, mask, logits_rows=slice(0, n))
                    ts.append(time.perf_counter() - t)
            per[n] = statistics.median(ts[1:]) * 1000
            log(f"context {ctx}: {n} rows {per[n]:.1f} ms")
        out[ctx] = per
        del cache
        gc.collect()
    return out


def transformers_decode(shape: dict, context: int, tokens: int) -> dict:
    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        hidden_size=shape["dim"], num_hidden_layers=shape["n_layers"], num_attention_heads=shape["n_heads"],
        num_key_value_heads=shape["n_kv_heads"], intermediate_size=shape["hidden_dim"], vocab_size=shape["vocab_size"],
        tie_word_embeddings=shape["tie_embeddings"], rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = (torch.arange(1000, 1000 + context) % shape["vocab_size"]).unsqueeze(0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens + 1, do_sample=False, pad_token_id=0, min_new_tokens=tokens + 1)
        total = time.perf_counter() - t0
    per_token = (total - prefill) / tokens
    return {"context": context, "tokens": tokens, "prefill_s": prefill, "ms_per_token": per_token * 1000,
            "tok_s": 1 / per_token, "dtype": "bfloat16", "attention": model.config._attn_implementation}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-coder-1.5b")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--rows", default="1,4,8,16,32")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import torch

    from agentspec.kernels import cpu_isa

    shape = SHAPES[a.shape]
    n_params = (shape["vocab_size"] * shape["dim"] * (1 if shape["tie_embeddings"] else 2)
                + shape["n_layers"] * (shape["dim"] * shape["head_dim"] * (2 * shape["n_heads"] + 2 * shape["n_kv_heads"])
                                       + 3 * shape["dim"] * shape["hidden_dim"]))
    need = n_params * 2 * 2   # bf16 weights + the native linears' packed copy
    from os import sysconf
    ram = sysconf("SC_PAGE_SIZE") * sysconf("SC_PHYS_PAGES")
    report = {"shape": a.shape, "params": n_params, "machine": cpu_isa.machine_info(), "threads": torch.get_num_threads(),
              "dtype": "bfloat16", "kv_dtype": "float32", "replay_mat": REPLAY_MAT}
    if need > 0.9 * ram:
        report["skipped"] = (f"bf16 weights and the native linears' packed copy need {need / 2**30:.1f} GiB; "
                             f"this machine has {ram / 2**30:.1f} GiB")
        log(report["skipped"])
        print(json.dumps(report, indent=2))
        if a.out:
            a.out.write_text(json.dumps(report, indent=2) + "\n")
        return 0
    contexts = [int(x) for x in a.contexts.split(",")]
    rows = [int(x) for x in a.rows.split(",")]
    t0 = time.perf_counter()
    args, model, native = build(shape)
    report["load_s"] = time.perf_counter() - t0
    report["peak_rss_gib_after_load"] = peak_rss_gib()
    report["linears"] = "native row-invariant (packed)" if native else "torch"
    from agentspec.kernels import cpu_attention
    report["decode_attention"] = ("native" if cpu_attention.packed_supported(torch.float32, torch.device("cpu"),
                                                                              args.head_dim) else
                                  f"torch (small_attention; native kernels take head_dim 64, this is {args.head_dim})")
    log(f"{a.shape}: {n_params / 1e9:.2f}B parameters, loaded in {report['load_s']:.1f}s, "
        f"peak RSS {report['peak_rss_gib_after_load']:.1f} GiB; linears {report['linears']}")
    costs = step_costs(args, model, contexts, rows, a.repeat)
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
    del model
    gc.collect()
    if not a.no_transformers:
        log("transformers: plain greedy decoding, same shapes, bf16")
        report["transformers"] = [transformers_decode(shape, c, 16) for c in contexts[:1]]
    report["peak_rss_gib"] = peak_rss_gib()
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
