"""SGLang 0.5.23 on this CPU, end to end: greedy output with NGRAM speculation (8 draft tokens,
the intel_amx attention backend verifying the draft tree through the sgl_kernel stand-in) is
token-for-token the output without speculation.

Each engine start-up takes ~25-90 s on a 2-core machine (mostly Python imports in the spawned
scheduler), so each engine starts once per module and is shut down before the next one starts.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import pytest

from helpers.sglang import require_sglang

require_sglang()   # before anything that imports SGLang

pytestmark = pytest.mark.slow

MODEL = Path(os.environ.get(
    "AGENTSPEC_SGLANG_MODEL",
    Path(sys.prefix) / "models" / "SmolLM2-135M-Instruct"))   # made by scripts/setup_sglang.sh

PROMPTS = [
    "Rewrite this Python function to use a list comprehension. Keep the name and the docstring.\n"
    "```python\n"
    "def squares(n):\n"
    '    """The squares of 0..n-1."""\n'
    "    out = []\n"
    "    for i in range(n):\n"
    "        out.append(i * i)\n"
    "    return out\n"
    "```",
    "What is the capital of France? Answer in one sentence.",
]
MAX_NEW_TOKENS = 48
ENGINE_ARGS = dict(device="cpu", dtype="bfloat16", attention_backend="intel_amx",
                   max_total_tokens=4096, max_running_requests=4, mem_fraction_static=0.3)
SPEC_FIELDS = ("spec_accept_rate", "spec_accept_length", "spec_num_correct_drafts",
               "spec_num_proposed_drafts", "spec_verify_ct", "spec_correct_drafts_histogram")


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    if not (MODEL / "config.json").is_file():
        pytest.fail(f"no converted model at {MODEL}: run scripts/setup_sglang.sh")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    out = []
    for p in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def run_engine(prompt_ids, passes: int, **spec) -> dict:
    """Start an engine, run every prompt `passes` times (one request at a time, greedy), shut it
    down (always). Returns start-up seconds and, per pass, per prompt (output ids, meta_info)."""
    import sglang as sgl

    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = sgl.Engine(model_path=str(MODEL), **ENGINE_ARGS, **spec)
    result = {"startup_s": time.monotonic() - t0, "passes": [],
              "attention_backend": engine.server_args.attention_backend}
    try:
        for _ in range(passes):
            outs = []
            for ids in prompt_ids:
                t = time.monotonic()
                out = engine.generate(input_ids=ids, sampling_params={
                    "temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS})
                outs.append((list(out["output_ids"]), out["meta_info"], time.monotonic() - t, out["text"]))
            result["passes"].append(outs)
    finally:
        engine.shutdown()
    return result


@pytest.fixture(scope="module")
def plain(prompt_ids):
    return run_engine(prompt_ids, passes=1)


@pytest.fixture(scope="module")
def ngram(prompt_ids, plain):   # after `plain`: one engine at a time on this 2-core machine
    return run_engine(prompt_ids, passes=2, speculative_algorithm="NGRAM",
                      speculative_num_draft_tokens=8)


def test_ngram_greedy_output_is_identical(plain, ngram, capsys):
    with capsys.disabled():
        print(f"\n[sglang] start-up: plain {plain['startup_s']:.1f} s, NGRAM {ngram['startup_s']:.1f} s; "
              f"attention backend {ngram['attention_backend']}")
        for name, res in (("plain", plain), ("NGRAM", ngram)):
            for k, outs in enumerate(res["passes"]):
                for i, (ids, meta, secs, text) in enumerate(outs):
                    spec = {f: meta.get(f) for f in SPEC_FIELDS if f in meta}
                    print(f"[sglang] {name} pass {k} prompt {i}: {len(ids)} tokens in {secs:.2f} s "
                          f"({len(ids) / secs:.1f} tok/s) {spec} {text[:60]!r}")
    assert plain["attention_backend"] == ngram["attention_backend"] == "intel_amx"
    expected = [ids for ids, *_ in plain["passes"][0]]
    assert all(len(ids) > 0 for ids in expected)
    for outs in ngram["passes"]:
        assert [ids for ids, *_ in outs] == expected


def test_ngram_speculates(ngram):
    for outs in ngram["passes"]:
        for _, meta, *_ in outs:
            assert set(SPEC_FIELDS) <= set(meta), sorted(meta)
            assert meta["spec_verify_ct"] > 0
    # the second pass finds each output in the n-gram corpus the first pass filled
    assert sum(meta["spec_num_correct_drafts"] for _, meta, *_ in ngram["passes"][1]) > 0
