#!/usr/bin/env python
"""The embedded engine's cost of one verification forward over n tokens, against 1.

What a drafted token costs decides how long a draft pays: this measures the model forward the
engine runs per decode step (the engine's own path: a chain of ``n`` rows with the tree mask,
at least 2 rows) after a prefill of ``--context`` tokens, median over ``--repeat`` runs.
benchmarks/replay.py turns these into an estimated speedup (``--costs``).

    python -m benchmarks.step_costs [--context 2048] [--rows 1,2,4,8,16,24,33,48,65]
        [--out benchmarks/results/step_costs.json] [--breakdown]

``--breakdown``: also the time per forward inside the native kernels (bfloat16 models on CPU):
attention (``QKVAttention``) and the row-invariant linears (``PackedLinear``); the rest is torch
(norms, rotary tables, the output projection) and Python.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import ROOT, emit_report  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,33,48,65")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "step_costs.json")
    ap.add_argument("--breakdown", action="store_true", help="time inside the native attention and linears")
    args = ap.parse_args()

    import collections

    import torch

    spent: collections.Counter = collections.Counter()
    if args.breakdown:
        from agentspec.kernels import cpu_attention, cpu_linear

        def timed(cls, name):
            call = cls.__call__

            def wrapper(self, *a, **k):
                t0 = time.perf_counter()
                try:
                    return call(self, *a, **k)
                finally:
                    spent[name] += time.perf_counter() - t0
            cls.__call__ = wrapper

        timed(cpu_attention.QKVAttention, "attention")
        timed(cpu_linear.PackedLinear, "linears")

    from agentspec import Engine
    from agentspec.kernels.tree import tree_mask

    engine = Engine.embedded(quiet=True)
    rows_list = [int(x) for x in args.rows.split(",")]
    cache = engine._ensure_cache(args.context + max(rows_list) + 2)
    cache.reset()
    ids = torch.randint(100, 10000, (args.context,))
    with torch.inference_mode():
        engine.model(ids, torch.arange(args.context), cache, logits_rows=slice(-1, None))
        cache.commit(list(range(args.context)))
        out, parts = {}, {}
        for n in rows_list:
            # a plain step's rows (see EmbeddedEngine._step): 1 where the forward is row-invariant
            rows = n if engine.model.row_invariant(cache) else max(n, 2)
            parents = list(range(-1, rows - 1))
            tok = torch.randint(100, 10000, (rows,))
            pos = torch.arange(args.context, args.context + rows)
            mask = torch.zeros(rows, args.context + rows, dtype=torch.bool)
            mask[:, :args.context] = True
            mask[:, args.context:] = tree_mask(parents)
            times = []
            for i in range(args.repeat + 2):
                if i == 2:
                    spent.clear()
                t0 = time.perf_counter()
                engine.model(tok, pos, cache, mask)
                times.append(time.perf_counter() - t0)
            out[n] = statistics.median(times[2:])
            if args.breakdown:
                parts[n] = {k: v / args.repeat for k, v in spent.items()}
            extra = "".join(f", {k} {v * 1e3:.1f} ms" for k, v in parts.get(n, {}).items())
            print(f"[step_costs] {n:3d} rows: {out[n] * 1e3:7.2f} ms ({out[n] / out[rows_list[0]]:.2f}x){extra}",
                  file=sys.stderr, flush=True)
    result = {"context": args.context, "threads": torch.get_num_threads(), "dtype": str(engine.dtype),
              "step_seconds": {str(k): v for k, v in out.items()},
              "relative": {str(k): v / out[rows_list[0]] for k, v in out.items()},
              "machine": engine.kernel_info()}
    if args.breakdown:
        result["native_seconds_per_forward"] = {str(k): v for k, v in parts.items()}
    emit_report(result, args.out, indent=1, one_line=True)


if __name__ == "__main__":
    main()
