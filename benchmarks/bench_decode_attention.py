"""Decode / verify attention: the QKVAttention kernels (AGENTSPEC_DECODE_ATTENTION) in the same
process, alternating.

One request's decode / verify forward of the bundled model's shape (30 layers, 9 query heads,
3 kv heads, head_dim 64): ``T`` rows (a draft chain after the committed prefix) over a
``--context``-token packed KV cache, every layer's ``QKVAttention`` call (rotary, cache writes,
attention). Per kernel and T, the median over ``--rounds`` rounds of the best of ``--repeat``
forwards, at ``--threads`` threads:

- ``rows``: one task per (row, kv head), each streaming the kv head's keys and values;
- ``amx`` (CPUs with AMX): all of a request's rows at once on AMX tiles, its own bits.

(A third kernel, the same phases with VDPBF16PS and ``rows``' bits, measured 0.64-0.99x of
``rows`` in ``benchmarks/results/decode_attention.json`` and was removed.)

With ``--plain-prompt N`` (N > 0) it also times plain decoding end to end with the bundled model
(``--plain-tokens`` greedy tokens after an N-token prompt, no speculation), the kernels alternating
over the same rounds: milliseconds per token, medians.

    .venv/bin/python -m benchmarks.bench_decode_attention --plain-prompt 3000 --out benchmarks/results/decode_attention.json

Prints JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import emit_report, machine_info  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rows", default="1,4,8,16,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plain-prompt", type=int, default=0)
    ap.add_argument("--plain-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r]
    if args.context < 16 or not rows or min(rows) < 1:
        raise SystemExit(f"--context must be >= 16 and --rows positive: {args.context}, {args.rows!r}")

    import torch

    from agentspec.backends.embedded.model import KVCache, ModelArgs
    from agentspec.kernels import cpu_attention
    from agentspec.kernels.tree import tree_mask

    if not cpu_attention.available():
        raise SystemExit("agentspec.kernels._cpu is not built")
    H, HKV, D, NL = 9, 3, 64, 30
    margs = ModelArgs(dim=576, n_layers=NL, n_heads=H, n_kv_heads=HKV, hidden_dim=256, vocab_size=300,
                      max_seq_len=args.context + max(rows) + 16)
    P = args.context
    g = torch.Generator().manual_seed(0)
    cache = KVCache(margs, P + max(rows) + 16, dtype=torch.float32, device=torch.device("cpu"), packed=True)
    cache.k[:, :, :P] = torch.randn(NL, HKV, P, D, generator=g).bfloat16().float()
    cache.v[:, :, :P] = torch.randn(NL, HKV, P, D, generator=g).bfloat16().float()
    cpu_attention.sync_packed(cache, range(P))
    modes = ["rows"] + (["amx"] if cpu_attention._cpu.decode_amx_runs() else [])
    times: dict[str, dict[int, list[float]]] = {m: {T: [] for T in rows} for m in modes}
    for _ in range(args.rounds):
        for T in rows:
            L = P + T
            mask = torch.zeros(T, L, dtype=torch.bool)
            mask[:, :P] = True
            mask[:, P:] = tree_mask([-1] + list(range(T - 1)))
            qkv = torch.randn(T, (H + 2 * HKV) * D, generator=g).bfloat16()
            ang = torch.rand(T, D // 2, generator=g)
            cos = torch.cat([ang.cos(), ang.cos()], 1).bfloat16()
            sin = torch.cat([ang.sin(), ang.sin()], 1).bfloat16()
            for mode in modes:
                att = cpu_attention.QKVAttention([(cache, P, L, mask, T)], cos, sin, n_heads=H, n_kv_heads=HKV,
                                                 head_dim=D, threads=args.threads, mode=mode)
                for layer in range(NL):
                    att(qkv, layer)
                best = float("inf")
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    for layer in range(NL):
                        att(qkv, layer)
                    best = min(best, time.perf_counter() - t0)
                times[mode][T].append(best)
    ms = {m: {T: round(statistics.median(v) * 1e3, 2) for T, v in tt.items()} for m, tt in times.items()}
    plain = None
    if args.plain_prompt > 0:
        import random

        from agentspec import Engine

        eng = Engine.embedded(prefix_cache_bytes=0)
        rng = random.Random(1)
        ids = [rng.randrange(100, eng.tokenizer.vocab_size - 1) for _ in range(args.plain_prompt)]
        per_tok: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                eng.model.set_kernel_settings(eng.model.kernel_settings.with_(decode_attention=mode))
                st = eng.generate(ids, max_tokens=args.plain_tokens, spec=None).stats
                per_tok[mode].append(st.decode_seconds / max(1, st.completion_tokens - 1))
        plain = {"prompt_tokens": args.plain_prompt, "tokens": args.plain_tokens, "engine": eng.kernel_info(),
                 "ms_per_token": {m: round(statistics.median(v) * 1e3, 2) for m, v in per_tok.items()},
                 "ms_per_token_rounds": {m: [round(x * 1e3, 2) for x in v] for m, v in per_tok.items()}}
    report = {"machine": machine_info(), "context": P, "threads": args.threads, "layers": NL,
              **({"plain_decoding": plain} if plain else {}),
              "forward_ms": ms,
              "speedup_vs_rows": {m: {T: round(ms["rows"][T] / ms[m][T], 2) for T in rows} for m in modes if m != "rows"}}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
