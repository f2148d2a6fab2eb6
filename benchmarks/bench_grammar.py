"""What a grammar costs a decode step: llguidance's masks against the model's step time.

For a JSON schema (a tool's arguments: an edit with a path, an enum, strings that hold code) and
a tool-call grammar (free text, then ``<tool_call>`` and one of three tools' JSON: a lazy text
trigger, or the special token where the tokenizer has one), on ``--model`` (default the bundled SmolLM2-135M; a GGUF
such as Qwen2.5-Coder-1.5B with ``--model PATH``):

- compile: ``LLMatcher`` construction per request (the grammar parsed and checked), the median
  of ``--repeat``; and the llguidance tokenizer, built once per engine;
- along a sample output that follows the grammar (its tokens in the model's tokenizer), at every
  position: the full mask (``compute_bitmask``, unpacked, the masked argmax of a row of logits:
  what a greedy row pays when the shortcut misses, and every sampled row, ``masked``) and the
  greedy shortcut (``Constraint.allows`` of the token the output has there: one
  ``validate_tokens`` where the grammar forces no bytes);
- per step: a one-row decode step (one mask, or one shortcut) and a 32-row verification step
  (32 masks, or 32 shortcuts, along 32 consecutive tokens, with the matcher consuming them as
  the verification walk does), against the engine's own decode steps without a grammar: a plain
  step, and a step verifying a 32-token draft (``--steps`` steps a run, the fastest run of
  ``--step-repeat``): the fractions are grammar time / step time;
- pruning: ``Constraint.legal`` of a 32-node draft tree (the sample's next tokens, a decoy
  beside each);
- end to end: one real request per grammar (greedy, ``--max-tokens``), without the grammar,
  with it, and with it and speculation (checked to give the plain constrained tokens): decode
  time per token and the grammar's share of it (``GenerationStats.grammar_seconds``).

Each timing is the fastest of 3 runs from the same state (a shared machine disturbs the others).

    .venv/bin/python -m benchmarks.bench_grammar
    .venv/bin/python -m benchmarks.bench_grammar --model Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf --out FILE
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import emit_report, logger, machine_record  # noqa: E402

log = logger("bench_grammar")

EDIT_SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "mode": {"enum": ["replace", "insert", "delete"]},
        "old_string": {"type": "string"},
        "new_string": {"type": "string"},
        "line": {"type": "integer", "minimum": 1},
        "replace_all": {"type": "boolean"},
    },
    "required": ["path", "mode", "old_string", "new_string"],
    "additionalProperties": False,
}
EDIT_SAMPLE = {
    "path": "agentspec/decode/step.py", "mode": "replace",
    "old_string": "def accept(self, seq, new):\n    \"\"\"Append new tokens.\"\"\"\n    out = seq.out\n",
    "new_string": "def accept(self, seq, new):\n    \"\"\"Append new tokens; stop at EOS.\"\"\"\n    out = seq.out\n"
                  "    eos = self.eos\n",
    "line": 214, "replace_all": False,
}
TOOLS = [
    {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                         "required": ["path"], "additionalProperties": False}},
    {"name": "list_dir", "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                                         "depth": {"type": "integer"}},
                                        "required": ["path"], "additionalProperties": False}},
    {"name": "edit_file", "parameters": EDIT_SCHEMA},
]
TOOL_SAMPLE = ("I will look at the decode step first, then change how it accepts tokens.\n<tool_call>\n"
               + json.dumps({"name": "edit_file", "arguments": EDIT_SAMPLE}) + "\n</tool_call>")


EDIT_PROMPT = [{"role": "user", "content": "Give the JSON arguments of an edit_file call that renames the function "
                                           "load_config to read_config in src/config.py (mode replace). JSON only."}]
TOOL_PROMPT = [
    {"role": "system", "content": "You call tools by writing <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>. "
                                  "Tools: read_file(path), list_dir(path, depth), edit_file(path, mode, old_string, "
                                  "new_string)."},
    {"role": "user", "content": "Read main.py"},
    {"role": "assistant", "content": '<tool_call>{"name": "read_file", "arguments": {"path": "main.py"}}</tool_call>'},
    {"role": "user", "content": "In main.py, replace 'debug = True' with 'debug = False'."},
]


def end_to_end(engine, name: str, grammar: str, prompt, *, max_tokens: int) -> dict:
    """A real request with the grammar: plain and speculative (the same tokens), and without it;
    the grammar's share of the decode time (``GenerationStats.grammar_seconds``)."""
    from agentspec import SpecConfig
    from agentspec.decode.constraint import Constraint

    ids = engine.encode(prompt)
    engine.generate(ids, max_tokens=4, spec=None, grammar=grammar)   # warm
    out = {}
    counts = {"allows": 0, "refused": 0}
    allows = Constraint.allows

    def counted(self, token):   # the greedy shortcut: how often the row's argmax is allowed
        ok = allows(self, token)
        counts["allows"] += 1
        counts["refused"] += not ok
        return ok

    for mode, spec, g in (("free", None, None), ("plain", None, grammar), ("speculative", SpecConfig(), grammar)):
        counts.update(allows=0, refused=0)
        Constraint.allows = counted
        try:
            r = engine.generate(ids, max_tokens=max_tokens, spec=spec, grammar=g)
        finally:
            Constraint.allows = allows
        st = r.stats
        out[mode] = {"tokens": st.completion_tokens, "steps": st.steps, "finish": r.finish_reason,
                     "decode_ms_per_token": round(st.decode_seconds / max(st.completion_tokens - 1, 1) * 1e3, 3),
                     "grammar_ms": round(st.grammar_seconds * 1e3, 2),
                     "grammar_share_of_decode": round(st.grammar_seconds / st.decode_seconds, 4) if g and st.decode_seconds
                     else None, "rows_checked": counts["allows"], "rows_needing_the_full_mask": counts["refused"],
                     "token_ids": r.token_ids}
    out["speculative_equals_plain"] = out["speculative"]["token_ids"] == out["plain"]["token_ids"]
    text = engine.decode(out["plain"]["token_ids"])
    for v in out.values():
        if isinstance(v, dict):
            v.pop("token_ids")
    return {"grammar": name, "text": text, **out}


class _Rejected:
    """A drafter whose every draft is a chain of ``n`` tokens the model will not pick (the step
    verifies n + 1 rows and commits one token): a verification step's time, by the engine's own
    path."""

    def __init__(self, n: int, token: int) -> None:
        self.n, self.token = n, token

    def start(self, req_id, prompt, *, tenant="default"):
        pass

    def extend(self, req_id, tokens):
        pass

    def stop(self, req_id):
        pass

    def propose(self, req_id, budget):
        from agentspec import Draft

        return Draft.chain([self.token] * min(self.n, budget), 0.9, source="rejected")


def step_times(engine, ids: list[int], *, steps: int, repeat: int) -> dict[int, float]:
    """Seconds per decode step of the engine without a grammar: {1: a plain step, 33: a step
    verifying a 32-token draft}, each the fastest of ``repeat`` runs of ``steps`` steps (the
    mean step of a run: ``decode_seconds / steps``)."""
    from agentspec import SpecConfig

    out = {}
    for rows, spec, drafter in ((1, None, None), (33, SpecConfig(budget=32, row_cost=0.0), _Rejected(32, engine.vocab_size // 2 + 17))):
        best = float("inf")
        for _ in range(repeat + 1):   # (the first untimed)
            g = engine.generate(ids, max_tokens=steps + 1, spec=spec, drafter=drafter)
            if g.stats.steps:
                best = min(best, g.stats.decode_seconds / g.stats.steps)
        out[rows] = best
    return out


def tool_call_grammar(tokenizer) -> str:
    """Free text, then tool calls: ``<tool_call>`` starts one of the tools' JSON (``{"name": ...,
    "arguments": ...}``) up to ``</tool_call>``, then free text again. Where the tokenizer has
    ``<tool_call>`` as a token of its own (Qwen2.5's added tokens), the grammar names those
    special tokens (text never spells them); elsewhere (SmolLM2) the text is the trigger, a lazy
    lexeme: any text until ``<tool_call>`` is written."""
    one_of = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                         "required": ["name", "arguments"], "additionalProperties": False} for t in TOOLS]}
    body = f"\"\\n\"? %json {json.dumps(one_of)} \"\\n\"?"
    if len(tokenizer.encode("<tool_call>")) == 1 and len(tokenizer.encode("</tool_call>")) == 1:
        return ("start: TEXT? ( call TEXT? )*\n"
                "TEXT: /(.|\\n)+/\n"
                f"call: <tool_call> {body} </tool_call>\n")
    return ("start: ( f_call )* f_end\n"
            "f_end: TEXT\n"
            "TEXT: /(.|\\n)*/\n"
            "f_call_hd[lazy]: TEXT \"<tool_call>\"\n"
            f"f_call: f_call_hd {body} \"</tool_call>\"\n")


def _median_us(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _fastest_us(fn, repeat: int = 3) -> float:
    """The fastest of ``repeat`` runs of ``fn()`` (each from the same state): the least disturbed
    by other work on a shared machine."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def measure_grammar(engine, name: str, grammar: str, sample: str, *, repeat: int, rng: random.Random) -> dict:
    import torch

    from agentspec import Draft

    factory = engine.constraints
    compile_us = _median_us(lambda: factory.compile(grammar), repeat)
    ids = engine.tokenizer.encode(sample)
    V = engine.vocab_size
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0)).to(engine.dtype)   # [V]: one row

    # at every position of the sample: a full mask (fresh: no cached state), and the shortcut
    mask_us, sampled_us, short_us, forced, wide = [], [], [], 0, 0
    c = factory.compile(grammar)

    def fresh() -> None:   # the state's mask not computed yet
        c._bits = c._ids = None

    for t in ids:
        mask_us.append(_fastest_us(lambda: (fresh(), c.masked_argmax(logits))))
        sampled_us.append(_fastest_us(lambda: (fresh(), c.masked(logits))))
        wide += c.mask().sum().item() > V // 2
        fresh()
        forced += bool(c.matcher.compute_ff_bytes())
        short_us.append(_fastest_us(lambda: (fresh(), c.allows(t))))
        assert c.allows(t), f"{name}: the sample's token {t} is refused at its place"
        c.consume([t])

    # 32-row verification steps: 32 consecutive positions, the matcher consuming as the walk does
    def walk(start: int, full: bool) -> float:
        best = float("inf")
        for _ in range(3):
            w = factory.compile(grammar)
            w.consume(ids[:start])
            t0 = time.perf_counter()
            for t in ids[start:start + 32]:
                if full:
                    w.masked_argmax(logits)
                else:
                    w.allows(t)
                w.consume([t])
            best = min(best, time.perf_counter() - t0)
        return best * 1e6

    starts = [s for s in range(0, max(len(ids) - 32, 1), 8)]
    walk_mask_us = statistics.median(walk(s, True) for s in starts)
    walk_short_us = statistics.median(walk(s, False) for s in starts)

    # pruning a 32-node tree: the sample's next 16 tokens with a decoy beside each
    prune_us = []
    for s in starts:
        p = factory.compile(grammar)
        p.consume(ids[:s])
        tokens, parents, parent = [], [], -1
        for t in ids[s:s + 16]:
            pair = [t, rng.randrange(V)] if rng.random() < 0.5 else [rng.randrange(V), t]
            for tok in pair:
                tokens.append(tok)
                parents.append(parent)
            parent = len(tokens) - (2 if pair[0] == t else 1)
        d = Draft(tokens, parents, [0.5] * len(tokens))
        prune_us.append(_fastest_us(lambda: p.legal(d)))
    return {
        "grammar": name, "grammar_chars": len(grammar), "sample_tokens": len(ids),
        "positions_with_forced_bytes": forced, "positions_with_most_tokens_allowed": wide,
        "compile_us_median": round(compile_us, 1),
        "full_mask_us": {"median": round(statistics.median(mask_us), 1), "mean": round(statistics.mean(mask_us), 1),
                         "max": round(max(mask_us), 1)},
        "sampled_mask_us": {"median": round(statistics.median(sampled_us), 1),
                            "mean": round(statistics.mean(sampled_us), 1)},
        "shortcut_us": {"median": round(statistics.median(short_us), 2), "mean": round(statistics.mean(short_us), 2),
                        "max": round(max(short_us), 1)},
        "verify_32_rows_full_masks_us": round(walk_mask_us, 1),
        "verify_32_rows_shortcuts_us": round(walk_short_us, 1),
        "prune_32_node_tree_us_median": round(statistics.median(prune_us), 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: the bundled model)")
    ap.add_argument("--repeat", type=int, default=20, help="compiles timed per grammar (the median is reported)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed run (a step's time: their mean)")
    ap.add_argument("--step-repeat", type=int, default=5, help="timed runs per step kind (the fastest is used)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per end-to-end request")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)

    import agentspec
    import llguidance

    engine = agentspec.Engine.embedded(model=args.model, quiet=True)
    log(f"model {engine.model_path}: vocab {engine.vocab_size}")
    t0 = time.perf_counter()
    engine.constraints.ll_tokenizer   # built once per engine
    tokenizer_s = time.perf_counter() - t0
    step_s = step_times(engine, engine.encode(EDIT_PROMPT), steps=args.steps, repeat=args.step_repeat)
    log(f"decode step: 1 row {step_s[1] * 1e3:.2f} ms, 33 rows {step_s[33] * 1e3:.2f} ms")
    rng = random.Random(0)
    rows, e2e = [], []
    for name, grammar, sample, prompt in (
            ("json_schema", llguidance.LLMatcher.grammar_from_json_schema(EDIT_SCHEMA), json.dumps(EDIT_SAMPLE),
             EDIT_PROMPT),
            ("tool_call", tool_call_grammar(engine.tokenizer), TOOL_SAMPLE, TOOL_PROMPT)):
        r = measure_grammar(engine, name, grammar, sample, repeat=args.repeat, rng=rng)
        f1, f33 = step_s[1] * 1e6, step_s[33] * 1e6
        r["fraction_of_1row_step"] = {"full_mask": round(r["full_mask_us"]["mean"] / f1, 4),
                                      "sampled_mask": round(r["sampled_mask_us"]["mean"] / f1, 4),
                                      "shortcut": round(r["shortcut_us"]["mean"] / f1, 5)}
        r["fraction_of_33row_step"] = {"32_full_masks": round(r["verify_32_rows_full_masks_us"] / f33, 4),
                                       "32_shortcuts": round(r["verify_32_rows_shortcuts_us"] / f33, 5),
                                       "prune_32_nodes": round(r["prune_32_node_tree_us_median"] / f33, 5)}
        log(json.dumps(r))
        rows.append(r)
        e2e.append(end_to_end(engine, name, grammar, prompt, max_tokens=args.max_tokens))
        log(json.dumps(e2e[-1]))
    emit_report({
        "benchmark": "grammar", "model": str(engine.model_path), "vocab": engine.vocab_size,
        "llguidance": llguidance.__version__ if hasattr(llguidance, "__version__") else _version("llguidance"),
        "machine": machine_record(engine),
        "step_1row_ms": round(step_s[1] * 1e3, 3), "step_33row_ms": round(step_s[33] * 1e3, 3),
        "ll_tokenizer_build_s": round(tokenizer_s, 3), "grammars": rows, "end_to_end": e2e,
    }, args.out, indent=1)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
