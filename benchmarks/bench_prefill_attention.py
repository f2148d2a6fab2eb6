"""Prefill attention: the AMX kernel (kernels/csrc/prefill_amx.cpp) against torch's SDPA flash
kernel, the path it replaced, in the same process.

1. One layer of the bundled model's shape (9 query heads, 3 kv heads, head_dim 64), a 256-token
   prompt chunk after ``context`` keys: the AMX kernel over a packed cache, and SDPA in bf16 with
   the chunk's causal offset as an additive mask (as ``Transformer.forward`` calls it). Median of
   ``--repeat`` calls each.
2. The bundled model prefilling a ``--prompt``-token prompt in the engine's canonical 256-token
   chunks, three ways alternating ``--rounds`` times (per-chunk and total seconds, medians): the
   whole layer on AMX (``Block.forward_amx``, the default), AMX attention with torch's GEMMs and
   elementwise ops, and SDPA with torch's GEMMs.

    .venv/bin/python -m benchmarks.bench_prefill_attention --out benchmarks/results/prefill_attention.json

Needs a CPU with AMX-BF16 (exits with a message otherwise). Prints JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import emit_report  # noqa: E402


def _median_ms(fn, repeat: int) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e3, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="0,1024,2048,3840", help="keys before the 256-token chunk (part 1)")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens (part 2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    try:
        contexts = [int(x) for x in args.contexts.split(",")]
    except ValueError:
        raise SystemExit(f"--contexts takes comma-separated integers, not {args.contexts!r}")
    if any(c < 0 or c % 16 for c in contexts) or args.repeat < 1 or args.rounds < 1 or args.prompt < 256:
        raise SystemExit("--contexts: multiples of 16 >= 0; --repeat, --rounds >= 1; --prompt >= 256")

    import torch
    import torch.nn.functional as F

    from agentspec import Engine
    from agentspec.kernels import cpu_attention

    if not (cpu_attention.available() and cpu_attention._cpu.prefill_amx_available()):
        raise SystemExit("this CPU (or OS) has no AMX-BF16: the AMX prefill attention does not run here")

    H, HKV, D, T = 9, 3, 64, 256

    class _Packed:  # the packed half of one cache layer
        def __init__(self, cap: int):
            self.packed, self.capacity = True, cap
            self.kt2 = torch.zeros(1, HKV, D // 2, cap, 2, dtype=torch.bfloat16)
            self.vp = torch.zeros(1, HKV, cap // 2, D, 2, dtype=torch.bfloat16)

    g = torch.Generator().manual_seed(0)
    layer = {}
    for ctx in contexts:
        n = ctx + T
        q = (torch.randn(H, n, D, generator=g) * 2).bfloat16()
        k = (torch.randn(HKV, n, D, generator=g) * 2).bfloat16()
        v = torch.randn(HKV, n, D, generator=g).bfloat16()
        cache = _Packed((n + 255) // 256 * 256)
        for s in range(0, n, 256):  # earlier chunks fill the packed cache
            cpu_attention.prefill_attention(q[:, s:s + 256], k[:, s:s + 256], v[:, s:s + 256], cache, 0, s)
        qc, kc, vc = q[:, ctx:], k[:, ctx:], v[:, ctx:]
        amx = _median_ms(lambda: cpu_attention.prefill_attention(qc, kc, vc, cache, 0, ctx), args.repeat)
        mask = torch.zeros(T, n, dtype=torch.bfloat16).masked_fill_(
            ~torch.ones(T, n, dtype=torch.bool).tril(ctx), float("-inf"))
        kk, vv, qq = k.unsqueeze(0), v.unsqueeze(0), qc.unsqueeze(0)
        if ctx == 0:
            sdpa = _median_ms(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True),
                              args.repeat)
        else:
            sdpa = _median_ms(lambda: F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True),
                              args.repeat)
        layer[str(ctx)] = {"amx_ms": amx, "sdpa_ms": sdpa, "speedup": round(sdpa / amx, 2)}
        print(f"[prefill_attention] one layer, 256 tokens after {ctx}: amx {amx:.2f} ms, sdpa {sdpa:.2f} ms",
              file=sys.stderr, flush=True)

    engine = Engine.embedded(quiet=True)
    # the model's four projections for a 256-row chunk, every layer's own weights in turn (as a
    # prefill streams them): AMX tiles (PackedLinear.prefill) against torch's GEMM
    projections = {}
    if engine.model.layers[0].amx_linears:
        x = {576: torch.randn(T, 576, generator=g).bfloat16(), 1536: torch.randn(T, 1536, generator=g).bfloat16()}
        for i, name in enumerate(("wqkv", "wo", "w_gate_up", "w_down")):
            mods = [(blk.packed[i], getattr(blk, name).weight) for blk in engine.model.layers]
            xin = x[mods[0][1].shape[1]]

            def amx_all():
                for p, _ in mods:
                    p.prefill(xin)

            def torch_all():
                for _, w in mods:
                    F.linear(xin, w)

            a_ms, t_ms = _median_ms(amx_all, args.repeat), _median_ms(torch_all, args.repeat)
            projections[name] = {"shape": list(mods[0][1].shape), "amx_ms_all_layers": a_ms,
                                 "torch_ms_all_layers": t_ms, "speedup": round(t_ms / a_ms, 2)}
            print(f"[prefill_attention] {name} {list(mods[0][1].shape)} x 256 rows, all layers: amx {a_ms:.1f} ms, "
                  f"torch {t_ms:.1f} ms", file=sys.stderr, flush=True)
    cache = engine._ensure_cache(args.prompt + 64)
    ids = torch.randint(100, 10000, (args.prompt,), generator=g)

    def prefill() -> list[float]:
        cache.reset()
        ts = []
        with torch.inference_mode():
            for s in range(0, args.prompt, 256):
                e = min(s + 256, args.prompt)
                t = time.perf_counter()
                engine.model(ids[s:e], torch.arange(s, e), cache, logits_rows=slice(-1, None), prefill=True)
                ts.append(time.perf_counter() - t)
                cache.commit(list(range(e - s)))
        return ts

    # "amx": the whole layer on AMX (Block.forward_amx: AMX projections, native norms and
    # rotary, AMX attention); "amx_attention": AMX attention with torch's GEMMs and elementwise
    # ops (the previous default); "sdpa": torch's SDPA flash attention and GEMMs
    modes = {"amx": (True, True), "amx_attention": (True, False), "sdpa": (False, False)}
    full = engine.model.layers[0].amx_linears
    settings = engine.model.kernel_settings
    runs: dict[str, list[list[float]]] = {m: [] for m in modes}
    prefill()  # warm-up
    for _ in range(args.rounds):
        for name, (att, lin) in modes.items():
            engine.model.set_kernel_settings(settings.with_(prefill_attention="amx" if att else "sdpa"))
            for blk in engine.model.layers:
                blk.amx_linears = lin and full
            engine.model.set_kernel_settings(engine.model.kernel_settings)   # the plan sees amx_linears
            runs[name].append(prefill())
    engine.model.set_kernel_settings(settings)
    for blk in engine.model.layers:
        blk.amx_linears = full
    engine.model.set_kernel_settings(settings)
    model = {}
    for name, rs in runs.items():
        per_chunk = [round(statistics.median(r[i] for r in rs) * 1e3, 1) for i in range(len(rs[0]))]
        model[name] = {"total_s": round(statistics.median(sum(r) for r in rs), 3), "chunk_ms": per_chunk}
    model["speedup_vs_sdpa"] = round(model["sdpa"]["total_s"] / model["amx"]["total_s"], 3)
    model["speedup_vs_amx_attention"] = round(model["amx_attention"]["total_s"] / model["amx"]["total_s"], 3)
    print(f"[prefill_attention] {args.prompt}-token prefill: amx {model['amx']['total_s']} s, amx attention "
          f"only {model['amx_attention']['total_s']} s, sdpa {model['sdpa']['total_s']} s", file=sys.stderr)
    report = {"machine": engine.kernel_info(), "threads": torch.get_num_threads(),
              "layer_256_token_chunk": layer,
              "projections_256_token_chunk": projections, "model_prefill": {"prompt_tokens": args.prompt,
                                                                "rounds": args.rounds, **model}}
    emit_report(report, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
