"""SGLang's own EAGLE-3 worker on this CPU, with this repo's EAGLE-3 draft head
(agentspec/heads/smollm2-135m-instruct-eagle3, SpecForge's LlamaForCausalLMEagle3 layout).

One SGLang engine without speculation gives the reference greedy outputs for 4 real prompts (the
prompts of test_agentspec_engine.py) and shuts down; then one EAGLE3 engine (topk 1: a chain of 4
drafts) must reproduce them token for token, with the head's drafts accepted at least sometimes
(meta_info spec_accept_length > 1). The draft tree metadata comes from the stand-in's
build_tree_kernel_efficient_cpu, the multi-step draft decode's per-branch KV rows from
build_draft_decode_metadata_cpu (tests/sglang/standin; checked op by op in test_standin.py).

float32, as in test_agentspec_engine.py: SGLang's bf16 verify forward is not row-invariant on this
CPU (near-ties flip, even NGRAM diverges from plain in bf16).
"""

from __future__ import annotations

import time
import warnings

import pytest

from helpers.sglang import require_sglang

require_sglang()   # before anything that imports SGLang

from helpers.sglang import MODEL, ROOT, engine_kwargs, real_prompts

# two engine start-ups plus 8 generations: ~6-10 min on this shared 2-core machine under pytest
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

HEAD = ROOT / "agentspec" / "heads" / "smollm2-135m-instruct-eagle3"
MAX_TOKENS = 40
EAGLE3 = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(HEAD),
              speculative_num_steps=4, speculative_eagle_topk=1, speculative_num_draft_tokens=5)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    if not (MODEL / "config.json").is_file():
        pytest.fail(f"no converted model at {MODEL}: run scripts/setup_sglang.sh")
    if not (HEAD / "config.json").is_file():
        pytest.fail(f"no EAGLE-3 head at {HEAD}")
    groups = real_prompts()
    if "agent" in groups:
        return groups["rewrites"][:2] + groups["agent"][:2]
    return groups["rewrites"][:4]


def run_engine(prompts, **spec) -> dict:
    """Start an engine, generate every prompt greedily one at a time, shut it down (always)."""
    import sglang as sgl

    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = sgl.Engine(**engine_kwargs(**spec))
    result = {"startup_s": time.monotonic() - t0, "outs": []}
    try:
        for ids in prompts:
            r = engine.generate(input_ids=list(ids),
                                sampling_params={"temperature": 0.0, "max_new_tokens": MAX_TOKENS})
            result["outs"].append((list(r["output_ids"]), r["meta_info"]))
    finally:
        engine.shutdown()
    result["total_s"] = time.monotonic() - t0
    return result


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    return [ids for ids, _ in run_engine(prompts)["outs"]]


def test_eagle3_matches_plain_greedy(prompts, reference):
    run = run_engine(prompts, **EAGLE3)
    accept = []
    for i, ((ids, meta), want) in enumerate(zip(run["outs"], reference)):
        assert ids == want, f"prompt {i}: EAGLE3 output differs from SGLang without speculation"
        accept.append(meta["spec_accept_length"])
    print(f"EAGLE3 topk=1 start-up {run['startup_s']:.1f}s, total {run['total_s']:.1f}s, spec_accept_length per prompt: "
          + ", ".join(f"{a:.2f}" for a in accept))
    assert sum(accept) / len(accept) > 1.0, f"the head's drafts were never accepted: {accept}"
