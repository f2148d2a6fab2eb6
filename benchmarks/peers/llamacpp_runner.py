#!/usr/bin/env python
"""Benchmark peer: llama.cpp (via llama-cpp-python), plain greedy decoding on
the GGUF file itself -- the quantized (Q4_1) model, no conversion.

Run with the python of the dedicated llama.cpp venv:

    /work/venvs/llamacpp/bin/python llamacpp_runner.py spec.json

spec.json uses the same keys as vllm_runner.py; here:

    {
      "model": "/path/to/model.gguf",   # a .gguf file (not an HF folder)
      "prompts": [[1, 2, 3], ...],       # prompts as token ids (no template added)
      "max_tokens": 192,                 # new tokens per prompt (stops early at EOS)
      "methods": ["plain"],              # only "plain" is supported
      "batched": false,                  # true is rejected: no batched API here
      "n_threads": 2,                    # * default: all CPUs
      "n_ctx": 4096                      # * default: fits longest prompt + max_tokens
    }

The LAST line on stdout is one JSON object, shaped like vllm_runner.py's:
{"config": {...}, "results": {"plain": {"total_tokens", "wall_s",
"tokens_per_s", "per_prompt_s", "outputs"}}}.

Timing: one warmup request on an unrelated prompt first (not timed); then
each prompt in turn, the KV cache reset before each so that the timed section
includes the full prefill (llama-cpp-python would otherwise reuse a shared
prefix with the previous request).
"""

import json
import os
import sys
import time

WARMUP_TEXT = ("Write a short haiku about autumn leaves falling in a quiet "
               "park, then explain its imagery in one sentence.")
WARMUP_TOKENS = 32


def greedy(llm, prompt_ids, max_tokens):
    """Greedy-decode up to max_tokens after prompt_ids; stop at EOS.

    We drive llama.cpp with eval() + argmax over the last logits instead of
    Llama.generate(): generate()'s sampler chain re-feeds the whole token
    history on every step, which makes it ~0.5 s/token with a 600-token
    prompt here (vs ~10 ms for the model itself).
    """
    import numpy as np

    llm.reset()  # drop the KV cache: no prefix reuse across requests
    eos = llm.token_eos()
    n_vocab = llm.n_vocab()
    out = []
    llm.eval(prompt_ids)  # prefill, in n_batch chunks
    while len(out) < max_tokens:
        # Logits of the last evaluated position, [n_vocab].
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        tok = int(np.argmax(logits))
        if tok == eos:
            break
        out.append(tok)
        if len(out) < max_tokens:
            llm.eval([tok])
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} SPEC.json")
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    bad = [m for m in spec["methods"] if m != "plain"]
    if bad:
        sys.exit(f"llamacpp_runner supports only method 'plain', got {bad}")
    if spec.get("batched", False):
        sys.exit("llamacpp_runner: batched=true is not supported "
                 "(llama-cpp-python decodes one sequence at a time)")

    from llama_cpp import Llama  # lazy: only present in the llama.cpp venv

    max_tokens = int(spec["max_tokens"])
    prompts = [list(map(int, p)) for p in spec["prompts"]]
    n_ctx = int(spec.get("n_ctx") or 0)
    if n_ctx <= 0:
        need = max(len(p) for p in prompts) + max_tokens + 1
        n_ctx = max(4096, -(-need // 512) * 512)
    n_threads = int(spec.get("n_threads") or os.cpu_count() or 1)

    llm = Llama(model_path=spec["model"], n_ctx=n_ctx, n_batch=512,
                n_threads=n_threads, n_threads_batch=n_threads,
                seed=0, verbose=False)

    # Warmup on an unrelated prompt; not timed.
    greedy(llm, llm.tokenize(WARMUP_TEXT.encode(), add_bos=False),
           WARMUP_TOKENS)

    outputs, per_prompt_s = [], []
    for p in prompts:
        t0 = time.perf_counter()
        outputs.append(greedy(llm, p, max_tokens))
        per_prompt_s.append(time.perf_counter() - t0)
    wall = sum(per_prompt_s)
    total = sum(len(o) for o in outputs)

    import llama_cpp
    config = {k: v for k, v in spec.items() if k != "prompts"}
    config.update({"num_prompts": len(prompts), "n_ctx": n_ctx,
                   "n_threads": n_threads,
                   "llama_cpp_python_version": llama_cpp.__version__})
    results = {"plain": {"total_tokens": total, "wall_s": wall,
                         "tokens_per_s": total / wall if wall > 0 else 0.0,
                         "per_prompt_s": per_prompt_s, "outputs": outputs}}
    print(f"[llamacpp_runner] plain: {total} tokens in {wall:.2f}s = "
          f"{results['plain']['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    print(json.dumps({"config": config, "results": results}), flush=True)


if __name__ == "__main__":
    main()
