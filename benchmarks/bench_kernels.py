"""The CPU kernels against each other, in the same process, alternating: one subcommand per kernel.

``decode-attention``: decode / verify attention, the ``QKVAttention`` modes (the plan's
``rows_attention``; ``AGENTSPEC_DECODE_ATTENTION``). One request's decode / verify forward of the
bundled model's shape (30 layers, 9 query heads, 3 kv heads, head_dim 64): ``T`` rows (a draft
chain after the committed prefix) over a ``--context``-token packed KV cache, every layer's
``QKVAttention`` call (rotary, cache writes, attention). Per mode and T, the median over
``--rounds`` rounds of the best of ``--repeat`` forwards, at ``--threads`` threads:

- ``rows``: one task per (row, kv head), each streaming the kv head's keys and values;
- ``amx`` (CPUs with AMX): all of a request's rows at once on AMX tiles, its own bits.

With ``--plain-prompt N`` (N > 0) it also times plain decoding end to end with the bundled model
(``--plain-tokens`` greedy tokens after an N-token prompt, no speculation), the modes alternating
over the same rounds (``Settings.decode_attention``): milliseconds per token, medians.

``verify-groups``: the float32-query attention (the layered rows path: ``head_dim`` 128, here
Qwen2.5-Coder-1.5B's shape, 28 layers, 12 query heads, 2 kv heads) of a batched verification
step, ``S`` requests of ``T`` rows (a draft chain) over ``--contexts``-token caches each, one
``segment_attention`` call per layer: a request's rows in groups that share each read of its
cache (the kernel's choice) against one row at a time (``group=1``), alternating within each
round; milliseconds per layer (best of ``--repeat``, median over ``--rounds``) and the speed-up.
Both give the same bits (checked).

``dot-attention`` (AVX512-BF16): decode / verify attention of the layered rows path at
Qwen2.5-Coder-1.5B's shape (12 query heads, 2 kv heads, head_dim 128), one request's ``--rows``
(a draft chain) after ``--contexts`` keys, one layer a call: the float32 kernel
(``decode_attention``) over a float32 and over a bfloat16 cache, and its bfloat16-product mode
(``dot=True``, the plan's ``dot``) over each, alternating within each round; milliseconds a layer
(best of ``--repeat``, median over ``--rounds``) and the speed-ups against the float32 kernel over a
float32 cache (the plan before the mode existed).

``verify-step --model FILE``: what a decode / verification forward of a real model costs by its row
count: after a ``--context``-token prompt (prefilled in the engine's chunks), a forward of R rows (a
draft chain; ``--rows``) with the engine's kernel plan, milliseconds (median of ``--repeat`` after
two untimed), and the part of it in the rows' attention calls (``decode_attention``, timed around
each call; the layered rows path's, the GGUF models': the fused path's attention is inside its
``QKVAttention`` call and reads 0): where a draft row's price comes from.

``prefill``: prompt attention and projections, AMX against torch (CPUs with AMX-BF16 only):

1. One layer of the bundled model's shape, a 256-token prompt chunk after ``--contexts`` keys:
   the AMX kernel over a packed cache against SDPA in bf16 with the chunk's causal offset as an
   additive mask (as the model calls it). Median of ``--repeat`` calls each.
2. The model's four projections for a 256-row chunk, every layer's own weights in turn (as a
   prefill streams them): AMX tiles (``PackedLinear.prefill``) against torch's GEMM.
3. The bundled model prefilling a ``--prompt``-token prompt in the engine's 256-token chunks with
   the plan's prefill kernels (``Settings.prefill_attention``: ``amx``, the whole layer on AMX
   where it runs; ``sdpa``, torch's flash attention and GEMMs), alternating ``--rounds`` times:
   per-chunk and total seconds, medians.

``prefill-native``: prompt attention on AVX512-BF16 CPUs without AMX, the plan's ``native`` kernel
(``cpu_attention.prefill_bf16``, VDPBF16PS) against the SDPA path it replaces
(``model.prefill_attention_sdpa``, torch's flash kernel in 32-query blocks):

1. One layer, a ``--chunk``-token prompt chunk after ``--contexts`` keys, at the shapes of
   Qwen2.5-Coder-1.5B (12 query heads, 2 kv heads, head_dim 128) and -0.5B (14, 2, 64), a float32
   cache: milliseconds (median of ``--repeat``) and GFLOP/s (4 T L D H, L the mean keys a row sees).
2. With ``--model FILE.gguf``: that model prefilling ``--new`` tokens after ``--history`` cached
   ones, in the engine's 256-token chunks (``prefill=True``), the two kernels alternating over
   ``--rounds`` rounds: seconds (median) and tokens per second.

``quant-linears``: a GGUF model's quantized linears (every layer's fused q/k/v, output, fused
gate/up and down projections, the weights as the engine packs them; not the vocabulary head, which
a prefill runs for its last row only) at each ISA level this CPU has (``--isas``), for ``--rows``
rows of bfloat16 activations at ``--threads`` threads: the best of ``--repeat`` passes over all
layers (the levels in turn within each pass, alternating which goes first), milliseconds per projection and in all, and the int8
products per second. The ``amx-int8`` body (``avx512bf16`` on a CPU with AMX) is the VNNI one
except for prompt chunks of Q6_K weights. Beside them, the
rate a tight loop of each body's own instruction sequence reaches on this CPU with the same threads
(``benchmarks/native/int8_peak.cpp``, compiled with ``$CXX`` or ``c++``: the AVX2 body's two
``VPMADDUBSW`` summed in int16, eight per ``VPMADDWD``; the VNNI body's broadcast ``VPDPBUSD``),
weights in registers: ``of_peak`` is how close the body comes to its instructions' ceiling.

    python -m benchmarks.bench_kernels decode-attention --plain-prompt 3000 --out FILE
    python -m benchmarks.bench_kernels verify-groups --out FILE
    python -m benchmarks.bench_kernels prefill --out FILE
    python -m benchmarks.bench_kernels prefill-native --model FILE.gguf --out FILE
    python -m benchmarks.bench_kernels quant-linears --model FILE.gguf --out FILE

Prints JSON; every report carries the machine record (``harness.machine_record``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import emit_report, logger, machine_record  # noqa: E402

log = logger("bench_kernels")

H, HKV, D, NL = 9, 3, 64, 30   # the bundled model's attention shape


def _median_ms(fn, repeat: int) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e3, 3)


# --- decode attention -----------------------------------------------------------------------------

def decode_attention(args) -> dict:
    rows = [int(r) for r in args.rows.split(",") if r]
    if args.context < 16 or not rows or min(rows) < 1:
        raise SystemExit(f"--context must be >= 16 and --rows positive: {args.context}, {args.rows!r}")

    import torch

    from agentspec.backends.embedded.model import KVCache, ModelArgs
    from agentspec.backends.embedded.plan import DECODE_ATTENTION_MODES
    from agentspec.kernels import cpu_attention
    from agentspec.kernels.tree import tree_mask

    if not cpu_attention.available():
        raise SystemExit("agentspec.kernels._cpu is not built")
    margs = ModelArgs(dim=576, n_layers=NL, n_heads=H, n_kv_heads=HKV, hidden_dim=256, vocab_size=300,
                      max_seq_len=args.context + max(rows) + 16)
    P = args.context
    g = torch.Generator().manual_seed(0)
    cache = KVCache(margs, P + max(rows) + 16, dtype=torch.float32, device=torch.device("cpu"), packed=True)
    cache.k[:, :, :P] = torch.randn(NL, HKV, P, D, generator=g).bfloat16().float()
    cache.v[:, :, :P] = torch.randn(NL, HKV, P, D, generator=g).bfloat16().float()
    cpu_attention.sync_packed(cache, range(P))
    modes = [m for m in DECODE_ATTENTION_MODES if m != "amx" or cpu_attention._cpu.decode_amx_runs()]
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
    log("forward ms: " + "; ".join(f"{m} {ms[m]}" for m in modes))
    report: dict = {"benchmark": "bench_kernels", "kernel": "decode-attention", "context": P, "threads": args.threads,
                    "layers": NL, "forward_ms": ms,
                    "speedup_vs_rows": {m: {T: round(ms["rows"][T] / ms[m][T], 2) for T in rows}
                                        for m in modes if m != "rows"}}
    engine = None
    if args.plain_prompt > 0:
        import random

        from agentspec import Engine

        engine = Engine.embedded(prefix_cache_bytes=0, quiet=True)
        settings = engine.model.kernel_settings
        rng = random.Random(1)
        ids = [rng.randrange(100, engine.tokenizer.vocab_size - 1) for _ in range(args.plain_prompt)]
        per_tok: dict[str, list[float]] = {m: [] for m in modes}
        try:
            for _ in range(args.rounds):
                for mode in modes:
                    engine.model.set_kernel_settings(settings.with_(decode_attention=mode))
                    st = engine.generate(ids, max_tokens=args.plain_tokens, spec=None).stats
                    per_tok[mode].append(st.decode_seconds / max(1, st.completion_tokens - 1))
        finally:
            engine.model.set_kernel_settings(settings)
        report["plain_decoding"] = {
            "prompt_tokens": args.plain_prompt, "tokens": args.plain_tokens,
            "ms_per_token": {m: round(statistics.median(v) * 1e3, 2) for m, v in per_tok.items()},
            "ms_per_token_rounds": {m: [round(x * 1e3, 2) for x in v] for m, v in per_tok.items()}}
    report["machine"] = machine_record(engine)
    return report


# --- prefill --------------------------------------------------------------------------------------

def prefill(args) -> dict:
    try:
        contexts = [int(x) for x in args.contexts.split(",")]
    except ValueError:
        raise SystemExit(f"--contexts takes comma-separated integers, not {args.contexts!r}") from None
    if any(c < 0 or c % 16 for c in contexts) or args.repeat < 1 or args.rounds < 1 or args.prompt < 256:
        raise SystemExit("--contexts: multiples of 16 >= 0; --repeat, --rounds >= 1; --prompt >= 256")

    import torch
    import torch.nn.functional as F

    from agentspec import Engine
    from agentspec.kernels import cpu_attention

    if not (cpu_attention.available() and cpu_attention._cpu.prefill_amx_available()):
        raise SystemExit("this CPU (or OS) has no AMX-BF16: the AMX prefill kernels do not run here")
    T = 256

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
        log(f"one layer, 256 tokens after {ctx}: amx {amx:.2f} ms, sdpa {sdpa:.2f} ms")

    engine = Engine.embedded(quiet=True)
    projections = {}
    if engine.plan.prefill_linears == "amx":
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
            log(f"{name} {list(mods[0][1].shape)} x 256 rows, all layers: amx {a_ms:.1f} ms, torch {t_ms:.1f} ms")
    cache = engine.new_cache(args.prompt + 256)
    ids = torch.randint(100, 10000, (args.prompt,), generator=g)

    def run() -> list[float]:
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

    settings = engine.model.kernel_settings
    modes = ("amx", "sdpa")
    runs: dict[str, list[list[float]]] = {m: [] for m in modes}
    plans = {}
    try:
        run()  # warm-up
        for _ in range(args.rounds):
            for mode in modes:
                engine.model.set_kernel_settings(settings.with_(prefill_attention=mode))
                plans[mode] = {k: v for k, v in engine.model.plan().to_dict().items() if k.startswith("prefill")}
                runs[mode].append(run())
    finally:
        engine.model.set_kernel_settings(settings)
    model = {}
    for name, rs in runs.items():
        per_chunk = [round(statistics.median(r[i] for r in rs) * 1e3, 1) for i in range(len(rs[0]))]
        model[name] = {"plan": plans[name], "total_s": round(statistics.median(sum(r) for r in rs), 3),
                       "chunk_ms": per_chunk}
    model["speedup_vs_sdpa"] = round(model["sdpa"]["total_s"] / model["amx"]["total_s"], 3)
    log(f"{args.prompt}-token prefill: amx {model['amx']['total_s']} s, sdpa {model['sdpa']['total_s']} s")
    return {"benchmark": "bench_kernels", "kernel": "prefill", "machine": machine_record(engine),
            "threads": torch.get_num_threads(), "layer_256_token_chunk": layer,
            "projections_256_token_chunk": projections,
            "model_prefill": {"prompt_tokens": args.prompt, "rounds": args.rounds, **model}}


# --- quant-linears ---------------------------------------------------------------------------------

PEAK_SOURCE = Path(__file__).resolve().parent / "native" / "int8_peak.cpp"
PEAK_LOOP = {"avx2": "avx2", "avx512vnni": "vnni"}   # a body -> the loop of its instruction sequence


def build_int8_peak(folder: Path) -> Path:
    """``native/int8_peak.cpp`` compiled into ``folder`` (with ``$CXX``, ``c++`` or ``g++``)."""
    import os
    import shutil
    import subprocess

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise SystemExit("quant-linears needs a C++ compiler for its peak loop: set $CXX or install g++")
    exe = folder / "int8_peak"
    subprocess.run([cxx, "-O2", "-std=c++17", "-pthread", str(PEAK_SOURCE), "-o", str(exe)], check=True)
    return exe


def int8_peak(exe: Path, loop: str, threads: int, seconds: float = 2.0) -> dict:
    """The built peak program's ``loop`` at ``threads`` threads: its JSON line."""
    import subprocess

    out = subprocess.run([str(exe), loop, str(threads), str(seconds)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def quant_linears(args) -> dict:
    try:
        rows = [int(x) for x in args.rows.split(",")]
    except ValueError:
        raise SystemExit(f"--rows takes comma-separated integers, not {args.rows!r}") from None
    if any(r < 1 for r in rows) or args.repeat < 1 or args.threads < 1:
        raise SystemExit("--rows: integers >= 1; --repeat, --threads >= 1")
    if not args.model.is_file():
        raise SystemExit(f"--model {args.model}: no such GGUF file")

    import numpy as np
    import torch

    from agentspec.backends.embedded.gguf_file import GGUFFile
    from agentspec.kernels import cpu_isa
    from agentspec.kernels.cpu_quant import QuantLinear, body

    have = cpu_isa.supported()
    before = cpu_isa.active()
    if args.isas:
        isas = [x for x in args.isas.split(",") if x]
    else:   # avx2, avx512 and, where its body is another (amx-int8), avx512bf16
        isas, seen = [], set()
        for x in ("avx2", "avx512", "avx512bf16"):
            if x in have:
                cpu_isa.set_isa(x)
                if body() not in seen:
                    isas.append(x)
                    seen.add(body())
        cpu_isa.set_isa(before)
    bad = [x for x in isas if x not in have]
    if bad:
        raise SystemExit(f"--isas {','.join(bad)}: not an ISA level this CPU runs (it runs {', '.join(have)})")
    f = GGUFFile(str(args.model))
    T = {t.name: t for t in f.tensors}
    layers = sorted({int(n.split(".")[1]) for n in T if n.startswith("blk.")})
    kinds = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
             "down": ("ffn_down",)}
    lin: dict[tuple[str, int], QuantLinear] = {}
    macs_per_row = 0
    for layer in layers:
        for kind, names in kinds.items():
            ts = [T[f"blk.{layer}.{n}.weight"] for n in names]
            lin[kind, layer] = QuantLinear.from_raw([(t.tensor_type.name, np.asarray(t.data), int(t.shape[0])) for t in ts])
            macs_per_row += sum(int(t.shape[0]) * int(t.shape[1]) for t in ts)
    types = {kind: lin[kind, layers[0]].types() for kind in kinds}
    log(f"{args.model.name}: {len(layers)} layers, {macs_per_row / 1e9:.3f} G products a row; isas {isas}")
    results = []
    peaks: dict[str, dict] = {}
    build = tempfile.TemporaryDirectory(prefix="int8_peak-")
    exe = build_int8_peak(Path(build.name))
    bodies = {}
    for isa in isas:
        cpu_isa.set_isa(isa)
        bodies[isa] = b = body()
        if b in PEAK_LOOP and b not in peaks:
            peaks[b] = int8_peak(exe, PEAK_LOOP[b], args.threads)
            log(f"  peak loop {PEAK_LOOP[b]}: {peaks[b]['gmacs_per_s']} G products/s at {args.threads} threads")
    for m in rows:
        xs = {kl: torch.randn(m, q.K).to(torch.bfloat16) for kl, q in lin.items()}
        best = dict.fromkeys(isas, float("inf"))
        per = {isa: dict.fromkeys(kinds, float("inf")) for isa in isas}
        # the levels in turn within each pass, so that a shared machine's drift reaches them alike,
        # in reverse order every other pass (the level that runs second in a pass measured up to
        # a quarter faster on an AMX Xeon, whichever it was)
        for i in range(args.repeat + 1):   # the first pass warms the caches and the thread pool
            for isa in (isas if i % 2 else isas[::-1]):
                cpu_isa.set_isa(isa)
                t0 = time.perf_counter()
                spent = dict.fromkeys(kinds, 0.0)
                for (kind, layer), q in lin.items():
                    t1 = time.perf_counter()
                    q(xs[kind, layer], threads=args.threads)
                    spent[kind] += time.perf_counter() - t1
                total = time.perf_counter() - t0
                if total < best[isa]:
                    best[isa], per[isa] = total, spent
        for isa in isas:
            b = bodies[isa]
            rate = m * macs_per_row / best[isa] / 1e9
            cell = {"isa": isa, "body": b, "rows": m, "ms": round(best[isa] * 1e3, 2),
                    "ms_per_projection": {k: round(v * 1e3, 2) for k, v in per[isa].items()},
                    "gmacs_per_s": round(rate, 2),
                    "of_peak": round(rate / peaks[b]["gmacs_per_s"], 3) if b in peaks else None}
            log(f"  {isa} ({b}) {m} rows: {cell['ms']} ms, {cell['gmacs_per_s']} G products/s"
                + (f", {cell['of_peak']:.0%} of the peak loop" if cell["of_peak"] else ""))
            results.append(cell)
    cpu_isa.set_isa(before)
    build.cleanup()
    return {"benchmark": "bench_kernels quant-linears", "model": args.model.name, "layers": len(layers),
            "products_per_row": macs_per_row, "types": types, "threads": args.threads, "repeat": args.repeat,
            "peak_loops": peaks, "results": results, "machine": machine_record()}


# --- prompt attention on AVX512-BF16 ------------------------------------------------------------

def prefill_native(args) -> dict:
    import torch

    from agentspec import Engine
    from agentspec.backends.embedded.model import prefill_attention_sdpa
    from agentspec.kernels import cpu_attention

    if not cpu_attention.prefill_bf16_runs():
        raise SystemExit("the native prompt attention needs AVX512-BF16 (ISA level avx512bf16) and the built kernels")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    T = args.chunk
    layer = []
    for name, (h, hkv, d) in (("qwen2.5-coder-1.5b", (12, 2, 128)), ("qwen2.5-coder-0.5b", (14, 2, 64))):
        for ctx in (int(c) for c in args.contexts.split(",")):
            L = ctx + T
            k = torch.randn(hkv, L + 64, d, generator=g).bfloat16().float()
            v = torch.randn(hkv, L + 64, d, generator=g).bfloat16().float()
            q = (torch.randn(h, T, d, generator=g) * 2).bfloat16()
            nat = _median_ms(lambda: cpu_attention.prefill_bf16(q, k, v, ctx, threads=args.threads), args.repeat)
            sd = _median_ms(lambda: prefill_attention_sdpa(q, k[:, :L], v[:, :L], start=ctx), args.repeat)
            flop = 4 * T * (ctx + (T + 1) / 2) * d * h
            layer.append({"shape": name, "context": ctx, "chunk": T, "native_ms": nat, "sdpa_ms": sd,
                          "native_gflops": round(flop / nat / 1e6, 1), "sdpa_gflops": round(flop / sd / 1e6, 1),
                          "speedup": round(sd / nat, 2)})
            log(f"{name}, {T} tokens after {ctx}: native {nat:.2f} ms, sdpa {sd:.2f} ms ({sd / nat:.2f}x)")
    report = {"benchmark": "bench_kernels", "kernel": "prefill-native", "threads": args.threads,
              "repeat": args.repeat, "layer": layer}
    engine = None
    if args.model:
        engine = Engine.embedded(model=str(args.model), max_context=16384, quiet=True, threads=args.threads)
        model, settings = engine.model, engine.model.kernel_settings
        cache = engine.new_cache(16384)
        ids = torch.randint(100, 20000, (args.history + max(int(n) for n in args.new.split(",")),), generator=g)

        def prefill(a: int, b: int) -> float:
            t = time.perf_counter()
            with torch.inference_mode():
                s = a
                while s < b:
                    e = min((s // 256 + 1) * 256, b)
                    model(ids[s:e], torch.arange(s, e), cache, logits_rows=slice(-1, None), prefill=True)
                    cache.commit(list(range(e - s)))
                    s = e
            return time.perf_counter() - t

        rows = []
        try:
            prefill(0, args.history)   # the cached history (the same keys for both kernels)
            for n in (int(x) for x in args.new.split(",")):
                per = {"native": [], "sdpa": []}
                for _ in range(args.rounds):
                    for mode in per:
                        model.set_kernel_settings(settings.with_(prefill_attention=mode))
                        cache.length = args.history
                        per[mode].append(prefill(args.history, args.history + n))
                nat, sd = (statistics.median(per[m]) for m in ("native", "sdpa"))
                rows.append({"history": args.history, "new": n, "native_s": round(nat, 3), "sdpa_s": round(sd, 3),
                             "native_tok_s": round(n / nat, 1), "sdpa_tok_s": round(n / sd, 1),
                             "speedup": round(sd / nat, 3)})
                log(f"{n} tokens after {args.history}: native {nat:.3f} s, sdpa {sd:.3f} s ({sd / nat:.2f}x)")
        finally:
            model.set_kernel_settings(settings)
        report["model"] = {"file": str(args.model), "prefill": rows}
    report["machine"] = machine_record(engine)
    return report


# --- verification rows in groups ------------------------------------------------------------------

def verify_groups(args) -> dict:
    import torch

    from agentspec.kernels import cpu_attention
    from agentspec.kernels.tree import tree_mask

    if not cpu_attention.available():
        raise SystemExit("agentspec.kernels._cpu is not built: run scripts/setup.sh")
    torch.set_num_threads(args.threads)
    h, hkv, d, layers = 12, 2, 128, 28
    shapes = [tuple(int(x) for x in item.split("x")) for item in args.shapes.split(",")]
    results = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for n_req, rows in shapes:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(h, n_req * rows, d, generator=g)
            kv = torch.randn(2, hkv, n_req * rows, d, generator=g)
            segs = []
            for r in range(n_req):
                k = torch.randn(hkv, ctx + rows, d, generator=g)
                v = torch.randn(hkv, ctx + rows, d, generator=g)
                m = torch.zeros(rows, ctx + rows, dtype=torch.bool)
                m[:, :ctx] = True
                m[:, ctx:] = tree_mask(list(range(-1, rows - 1)))
                segs.append((k, v, ctx + rows, m, r * rows, rows))
            per: dict[int, list[float]] = {1: [], 0: []}
            outs = {}
            for _ in range(args.rounds):
                for group in (1, 0):
                    best = float("inf")
                    for _ in range(args.repeat + 1):
                        t = time.perf_counter()
                        outs[group] = cpu_attention.segment_attention(q, kv, segs, threads=args.threads, group=group)
                        best = min(best, time.perf_counter() - t)
                    per[group].append(best)
            same = bool(torch.equal(outs[0], outs[1]))
            one, grouped = (statistics.median(per[x]) * 1e3 for x in (1, 0))
            results.append({"context": ctx, "requests": n_req, "rows_each": rows, "one_row_ms": round(one, 3),
                            "grouped_ms": round(grouped, 3), "speedup": round(one / grouped, 2),
                            "step_ms_grouped": round(grouped * layers, 1), "same_bits": same})
            log(f"context {ctx}, {n_req} x {rows} rows: {one:.3f} -> {grouped:.3f} ms a layer ({one / grouped:.2f}x)")
    return {"benchmark": "bench_kernels verify-groups", "shape": {"heads": h, "kv_heads": hkv, "head_dim": d,
            "layers": layers}, "threads": args.threads, "repeat": args.repeat, "rounds": args.rounds,
            "results": results, "machine": machine_record()}


def dot_attention(args) -> dict:
    import torch

    from agentspec.kernels import cpu_attention
    from agentspec.kernels.tree import tree_mask

    if not cpu_attention.dot_runs():
        raise SystemExit("the bfloat16-product attention needs AVX512-BF16 and the built kernels (scripts/setup.sh)")
    torch.set_num_threads(args.threads)
    h, hkv, d = 12, 2, 128
    modes = {"float32 kernel, float32 cache": (torch.float32, False),
             "float32 kernel, bfloat16 cache": (torch.bfloat16, False),
             "bf16 products, float32 cache": (torch.float32, True),
             "bf16 products, bfloat16 cache": (torch.bfloat16, True)}
    results = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            g = torch.Generator().manual_seed(ctx + rows)
            k = torch.randn(hkv, ctx + rows, d, generator=g).to(torch.bfloat16)
            v = torch.randn(hkv, ctx + rows, d, generator=g).to(torch.bfloat16)
            q = torch.randn(h, rows, d, generator=g).to(torch.bfloat16).float()
            m = torch.zeros(rows, ctx + rows, dtype=torch.bool)
            m[:, :ctx] = True
            m[:, ctx:] = tree_mask(list(range(-1, rows - 1)))
            caches = {dt: (k.to(dt), v.to(dt)) for dt in (torch.float32, torch.bfloat16)}
            per: dict[str, list[float]] = {name: [] for name in modes}
            for _ in range(args.rounds):
                for name, (dt, dot) in modes.items():
                    kc, vc = caches[dt]
                    best = float("inf")
                    for _ in range(args.repeat + 1):
                        t = time.perf_counter()
                        cpu_attention.decode_attention(q, kc, vc, m, ctx + rows, dot=dot)
                        best = min(best, time.perf_counter() - t)
                    per[name].append(best)
            ms = {name: round(statistics.median(x) * 1e3, 3) for name, x in per.items()}
            base = ms["float32 kernel, float32 cache"]
            results.append({"context": ctx, "rows": rows, "ms_a_layer": ms,
                            "speedup_vs_float32_kernel_float32_cache": {n: round(base / x, 2) for n, x in ms.items()}})
            log(f"context {ctx}, {rows} rows: " + ", ".join(f"{n} {x:.3f}" for n, x in ms.items()) + " ms a layer")
    return {"benchmark": "bench_kernels dot-attention", "shape": {"heads": h, "kv_heads": hkv, "head_dim": d},
            "threads": args.threads, "repeat": args.repeat, "rounds": args.rounds, "results": results,
            "machine": machine_record()}


def verify_step(args) -> dict:
    import torch

    from agentspec.backends.embedded.engine import EmbeddedEngine
    from agentspec.kernels import cpu_attention
    from agentspec.kernels.tree import tree_mask

    torch.set_num_threads(args.threads)
    eng = EmbeddedEngine(model=str(args.model), max_context=args.context + 64, quiet=True)
    mdl, n, chunk = eng.model, args.context, eng.chunk_tokens
    g = torch.Generator().manual_seed(0)
    cache = eng.new_cache(n + 64)
    ids = torch.randint(100, 20000, (n,), generator=g)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        mdl(ids[a:b], torch.arange(a, b), cache, logits_rows=slice(-1, None), prefill=True)
        cache.commit(list(range(b - a)))
    orig, spent = cpu_attention.decode_attention, [0.0]

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    results = []
    cpu_attention.decode_attention = timed
    try:
        for rows in (int(r) for r in args.rows.split(",")):
            toks = torch.randint(100, 20000, (rows,), generator=g)
            pos = torch.arange(n, n + rows)
            m = torch.zeros(rows, n + rows, dtype=torch.bool)
            m[:, :n] = True
            m[:, n:] = tree_mask(list(range(-1, rows - 1)))
            steps, attn = [], []
            for i in range(args.repeat + 2):
                spent[0] = 0.0
                t = time.perf_counter()
                mdl(toks, pos, cache, m if rows > 1 else None)
                if i >= 2:
                    steps.append(time.perf_counter() - t)
                    attn.append(spent[0])
            step, at = statistics.median(steps) * 1e3, statistics.median(attn) * 1e3
            results.append({"rows": rows, "step_ms": round(step, 2), "attention_ms": round(at, 2),
                            "rest_ms": round(step - at, 2)})
            log(f"{rows} rows after {n} tokens: {step:.1f} ms ({at:.1f} ms attention)")
    finally:
        cpu_attention.decode_attention = orig
    return {"benchmark": "bench_kernels verify-step", "model": args.model.name, "context": n,
            "threads": args.threads, "repeat": args.repeat, "results": results, "machine": machine_record(eng)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kernel", required=True)
    d = sub.add_parser("decode-attention", help="decode / verify attention: the QKVAttention modes")
    d.add_argument("--context", type=int, default=4096)
    d.add_argument("--rows", default="1,4,8,16,32")
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--repeat", type=int, default=5)
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--plain-prompt", type=int, default=0, help="also plain decoding after an N-token prompt")
    d.add_argument("--plain-tokens", type=int, default=48)
    v = sub.add_parser("verify-groups", help="verification rows sharing each read of the cache, against one "
                       "row at a time")
    v.add_argument("--contexts", default="1024,4096,16384")
    v.add_argument("--shapes", default="1x1,1x8,1x16,4x1,4x4,4x8", help="REQUESTSxROWS, comma-separated")
    v.add_argument("--threads", type=int, default=2)
    v.add_argument("--repeat", type=int, default=3)
    v.add_argument("--rounds", type=int, default=3)
    da = sub.add_parser("dot-attention", help="decode / verify attention at the 1.5B's shape: the float32 kernel "
                        "against its bfloat16-product mode, float32 and bfloat16 caches (AVX512-BF16)")
    da.add_argument("--contexts", default="1024,4096,16384")
    da.add_argument("--rows", default="1,4,8")
    da.add_argument("--threads", type=int, default=2)
    da.add_argument("--repeat", type=int, default=5)
    da.add_argument("--rounds", type=int, default=3)
    vs = sub.add_parser("verify-step", help="a real model's decode / verification forward by its row count, "
                        "and its attention's part")
    vs.add_argument("--model", type=Path, required=True, help="a GGUF file or model folder")
    vs.add_argument("--context", type=int, default=4096)
    vs.add_argument("--rows", default="1,2,4,8,16")
    vs.add_argument("--threads", type=int, default=2)
    vs.add_argument("--repeat", type=int, default=9)
    p = sub.add_parser("prefill", help="prompt attention and projections: AMX against torch")
    p.add_argument("--contexts", default="0,1024,2048,3840", help="keys before the 256-token chunk (part 1)")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens (part 3)")
    p.add_argument("--rounds", type=int, default=3)
    pn = sub.add_parser("prefill-native", help="prompt attention on AVX512-BF16: the native kernel against SDPA")
    pn.add_argument("--contexts", default="0,1024,4992", help="keys before the chunk (part 1)")
    pn.add_argument("--chunk", type=int, default=256)
    pn.add_argument("--repeat", type=int, default=5)
    pn.add_argument("--model", type=Path, help="a GGUF file: prefill after a cached history (part 2)")
    pn.add_argument("--history", type=int, default=4992)
    pn.add_argument("--new", default="64,528", help="tokens prefilled after the history (comma-separated)")
    pn.add_argument("--rounds", type=int, default=3)
    pn.add_argument("--threads", type=int, default=2)
    q = sub.add_parser("quant-linears", help="a GGUF model's quantized linears at each ISA level, against "
                       "their instructions' peak")
    q.add_argument("--model", type=Path, required=True, help="a GGUF file (Q4_K_M, Q4_0, Q8_0, ...)")
    q.add_argument("--rows", default="1,16,512", help="activation rows per call (comma-separated)")
    q.add_argument("--isas", default="",
                   help="ISA levels (default: avx2, avx512 and, with AMX, avx512bf16, where the CPU has them)")
    q.add_argument("--threads", type=int, default=2)
    q.add_argument("--repeat", type=int, default=5)
    for s in (d, v, da, vs, p, pn, q):
        s.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from agentspec.kernels import cpu_isa

    cpu_isa.apply_env()   # AGENTSPEC_CPU_ISA caps the kernels timed, not only the machine record
    report = {"decode-attention": decode_attention, "verify-groups": verify_groups, "dot-attention": dot_attention,
              "verify-step": verify_step, "prefill": prefill,
              "prefill-native": prefill_native, "quant-linears": quant_linears}[args.kernel](args)
    emit_report(report, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
