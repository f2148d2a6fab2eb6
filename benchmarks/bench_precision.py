#!/usr/bin/env python
"""How far the bf16 engine's greedy text agrees with the float32 model's, per attention path.

The bundled model runs in bfloat16 by default; its decode attention runs either the fused bf16
kernel (AVX512-BF16 dot products, p rounded to bf16: ``QKVAttention``) or the float32 kernel
(``AGENTSPEC_CPU_FUSED=0``). Both are exact with respect to their own plain decoding; this
measures what each costs in fidelity to the float32 model (weights dequantized exactly): the
number of leading greedy tokens equal to the float32 model's, per prompt. Prints JSON.

    python -m benchmarks.bench_precision [--prompts 14] [--max-tokens 64] [--start 100]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import DATA, DATA_HELP, emit_report, first_record, machine_record  # noqa: E402


def agree(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--prompts", type=int, default=14)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--start", type=int, default=None,
                    help="first record to consider (default: 100 in the recorded sets; 0 in the shipped sample)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    start = first_record(args.data, 100, args.start)

    from agentspec import Engine
    from agentspec.traces import load_records, prompt_messages

    e32 = Engine.embedded(quiet=True, dtype="float32", row_cost=0.04)
    e16 = Engine.embedded(quiet=True, row_cost=0.04)
    rows = []
    for k, rec in enumerate(load_records(args.data / "file_rewrites.jsonl")):
        if k < start:
            continue
        ids = e16.encode(prompt_messages(rec["prompt"]))
        if not 300 < len(ids) < 1500:
            continue
        ref = e32.generate(ids, max_tokens=args.max_tokens, spec=None).token_ids
        row = {"id": rec["id"], "prompt_tokens": len(ids)}
        settings = e16.model.kernel_settings
        for name, fused in (("bf16_fused", True), ("float32_kernel", False)):
            e16.model.set_kernel_settings(settings.with_(fused=fused))
            try:
                row[name] = agree(e16.generate(ids, max_tokens=args.max_tokens, spec=None).token_ids, ref)
            finally:
                e16.model.set_kernel_settings(settings)
        rows.append(row)
        print(f"[bench_precision] {row}", file=sys.stderr, flush=True)
        if len(rows) == args.prompts:
            break
    out = {
        "benchmark": "precision",
        "machine": machine_record(e16),
        "reference": {"dtype": "float32", "kernel_plan": e32.kernel_info()["kernel_plan"]},
        "max_tokens": args.max_tokens,
        "agreeing_tokens": {n: sum(r[n] for r in rows) for n in ("bf16_fused", "float32_kernel")},
        "of": sum(args.max_tokens for _ in rows),
        "rows": rows,
    }
    emit_report(out, args.out, one_line=True)


if __name__ == "__main__":
    main()
