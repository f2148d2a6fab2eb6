#!/usr/bin/env python
"""Benchmark peer: vLLM on CPU, plain decoding and its `ngram` / `suffix`
speculative decoding, on the same model and prompts as our engine.

Run with the python of the dedicated vLLM venv (see setup notes in the
report / setup script), never the project venv:

    /work/venvs/vllm/bin/python vllm_runner.py spec.json

spec.json (keys marked * are optional):

    {
      "model": "/work/models/smollm2-hf",     # Hugging Face folder (python -m agentspec.integrations.sglang.convert)
      "prompts": [[1, 2, 3], ...],            # prompts as token ids (no template added)
      "max_tokens": 192,                      # new tokens per prompt (stops early at EOS)
      "methods": ["plain", "ngram", "suffix"],
      "num_speculative_tokens": 8,            # K: max draft length for ngram/suffix
      "batched": false,                       # false: one request at a time;
                                              # true: all prompts in one generate()
      "max_num_seqs": 8,                      # * with batched: at most this many in flight
      "prompt_lookup_max": 3,                 # * ngram: longest n-gram to match
      "prompt_lookup_min": 1,                 # * ngram: shortest n-gram to match
      "dtype": "bfloat16",                    # * model dtype on CPU
      "max_model_len": 4096,                  # * default: fits longest prompt + max_tokens
      "enable_prefix_caching": false          # * vLLM's automatic prefix caching (multi-turn replays)
    }

Output: vLLM logs go to stderr; the LAST line on stdout is one JSON object:

    {"config": {...},
     "results": {"<method>": {
         "total_tokens": int,            # generated tokens, all prompts
         "wall_s": float,                # timed section, prefill included
         "tokens_per_s": float,          # total_tokens / wall_s
         "per_prompt_s": [float, ...],   # only when batched=false
         "outputs": [[ids...], ...],     # generated ids, prompt order
         "spec": {"num_drafts": int, "num_draft_tokens": int,
                  "num_accepted_tokens": int, "accepted_per_pos": [int, ...],
                  "acceptance_rate": float, "mean_acceptance_length": float}
                                         # spec methods only; null if unavailable
     }}}

Method notes:
  * Each method gets a fresh `LLM` instance (so e.g. suffix decoding's global
    tree of past responses starts empty), and one warmup request on an
    unrelated prompt is run and excluded from timing and from the stats.
  * Greedy decoding (temperature 0), EOS honoured (ignore_eos=False).
  * The acceptance stats are vLLM's own Prometheus counters, read with
    LLM.get_metrics() before and after the timed section.
  * Suffix decoding (needs `arctic-inference` in the venv) keeps vLLM's
    defaults: its global tree caches the responses of earlier requests of the
    same LLM instance, so in one-at-a-time mode later prompts can draft from
    earlier answers -- the behaviour a vLLM user gets.
"""

import json
import os
import sys
import time

# vLLM logs to stdout by default; keep stdout for the result line only.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
# CPU KV cache size in GiB. A 135M model needs well under 1 GiB here; vLLM's
# own default would take a large share of the host memory.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

# Prompt used only to warm the engine up (first-call overheads, kernel
# selection). Text, not ids, so it never coincides with a benchmark prompt.
WARMUP_TEXT = ("Write a short haiku about autumn leaves falling in a quiet "
               "park, then explain its imagery in one sentence.")
WARMUP_TOKENS = 32


def spec_config(method, spec):
    """The speculative_config passed to LLM() for one method (None = plain)."""
    k = int(spec["num_speculative_tokens"])
    if method == "plain":
        return None
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": int(spec.get("prompt_lookup_max", 3)),
            "prompt_lookup_min": int(spec.get("prompt_lookup_min", 1)),
        }
    if method == "suffix":
        # For suffix decoding K is an upper bound; the tree decides the
        # actual draft length per step (other suffix_* settings: defaults).
        return {"method": "suffix", "num_speculative_tokens": k}
    raise ValueError(f"unknown method {method!r}")


def spec_counters(llm):
    """Cumulative speculative-decoding counters from vLLM's metrics."""
    from vllm.v1.metrics.reader import Counter, Vector

    stats = {"num_drafts": 0, "num_draft_tokens": 0,
             "num_accepted_tokens": 0, "accepted_per_pos": []}
    names = {
        "vllm:spec_decode_num_drafts": "num_drafts",
        "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    }
    for metric in llm.get_metrics():
        if metric.name in names and isinstance(metric, Counter):
            stats[names[metric.name]] += metric.value
        elif (metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos"
              and isinstance(metric, Vector)):
            per_pos = stats["accepted_per_pos"]
            per_pos.extend([0] * (len(metric.values) - len(per_pos)))
            for i, v in enumerate(metric.values):
                per_pos[i] += v
    return stats


def spec_delta(before, after):
    """Counters accumulated between two snapshots, plus derived rates."""
    d = {key: after[key] - before[key]
         for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    pos_before = before["accepted_per_pos"] + [0] * len(after["accepted_per_pos"])
    d["accepted_per_pos"] = [a - pos_before[i]
                             for i, a in enumerate(after["accepted_per_pos"])]
    d["acceptance_rate"] = (d["num_accepted_tokens"] / d["num_draft_tokens"]
                            if d["num_draft_tokens"] else 0.0)
    # Tokens produced per verification step that had a draft (1 = no gain).
    d["mean_acceptance_length"] = (1 + d["num_accepted_tokens"] / d["num_drafts"]
                                   if d["num_drafts"] else 1.0)
    return d


def run_method(method, spec, max_model_len):
    """Build an LLM for `method`, warm it up, time the prompts."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        max_model_len=max_model_len,
        speculative_config=spec_config(method, spec),
        disable_log_stats=False,    # needed for get_metrics()
        # default off: no reuse between timed requests; on for multi-turn replays (bench_agent_loop)
        enable_prefix_caching=bool(spec.get("enable_prefix_caching", False)),
        seed=0,
        **({"max_num_seqs": int(spec["max_num_seqs"])} if spec.get("max_num_seqs") else {}),
    )
    params = SamplingParams(temperature=0.0, max_tokens=int(spec["max_tokens"]),
                            ignore_eos=False)
    prompts = [{"prompt_token_ids": list(map(int, p))} for p in spec["prompts"]]

    # Warmup: one short request on an unrelated prompt, not timed or counted.
    warm_ids = llm.get_tokenizer().encode(WARMUP_TEXT)
    llm.generate([{"prompt_token_ids": warm_ids}],
                 SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS),
                 use_tqdm=False)

    is_spec = method != "plain"
    before = spec_counters(llm) if is_spec else None
    per_prompt_s = None
    if spec.get("batched", False):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    else:
        outs, per_prompt_s = [], []
        for p in prompts:
            t0 = time.perf_counter()
            outs.extend(llm.generate([p], params, use_tqdm=False))
            per_prompt_s.append(time.perf_counter() - t0)
        wall = sum(per_prompt_s)
    stats = None
    if is_spec:
        try:
            stats = spec_delta(before, spec_counters(llm))
        except Exception as e:  # metrics are best effort
            print(f"could not read spec metrics: {e!r}", file=sys.stderr)

    # generate() returns results in prompt order.
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    total = sum(len(o) for o in outputs)
    result = {
        "total_tokens": total,
        "wall_s": wall,
        "tokens_per_s": total / wall if wall > 0 else 0.0,
        "per_prompt_s": per_prompt_s,
        "outputs": outputs,
    }
    if is_spec:
        result["spec"] = stats

    # Stop the engine-core process before the next method builds its own.
    llm.llm_engine.engine_core.shutdown()
    del llm
    return result


def main():
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} SPEC.json")
    with open(sys.argv[1]) as f:
        spec = json.load(f)

    longest = max(len(p) for p in spec["prompts"])
    max_model_len = int(spec.get("max_model_len") or 0)
    if max_model_len <= 0:
        # Room for the longest prompt plus the new tokens, in 512 steps, and
        # at least 4096 (covers ~2.5k-token prompts + 256 new tokens).
        need = longest + int(spec["max_tokens"]) + 1
        max_model_len = max(4096, -(-need // 512) * 512)

    results = {}
    for method in spec["methods"]:
        print(f"[vllm_runner] method={method} batched={spec.get('batched', False)}",
              file=sys.stderr, flush=True)
        results[method] = run_method(method, spec, max_model_len)
        r = results[method]
        print(f"[vllm_runner] {method}: {r['total_tokens']} tokens in "
              f"{r['wall_s']:.2f}s = {r['tokens_per_s']:.1f} tok/s",
              file=sys.stderr, flush=True)

    import vllm
    config = {k: v for k, v in spec.items() if k != "prompts"}
    config.update({"num_prompts": len(spec["prompts"]),
                   "dtype": spec.get("dtype", "bfloat16"),
                   "max_model_len": max_model_len,
                   "vllm_version": vllm.__version__})
    sys.stdout.flush()
    print(json.dumps({"config": config, "results": results}), flush=True)


# vLLM starts its engine core in a separate (spawned) process, which re-imports
# this module: everything must stay under the main guard.
if __name__ == "__main__":
    main()
