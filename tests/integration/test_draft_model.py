"""A draft model as a drafter (``agentspec.drafting.draft_model``): a smaller model of the target's
family and tokenizer proposing what it would write. It only proposes: speculation with it equals
plain decoding, greedy, on every prompt; a draft model with another tokenizer is refused at
start-up; an agent's next turn reuses the draft model's cache of the last one.

Models: random-weight K-quant Qwen2 GGUF files (``helpers.families``: no download) sharing one
tokenizer, the way the real Qwen2.5-Coder 0.5B and 1.5B do; the draft model is the target itself in
the exactness test (its drafts are then all accepted: the verifier's whole path runs)."""

from __future__ import annotations

import pytest

import agentspec
from agentspec.config import SpecConfig
from agentspec.errors import ConfigError


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from helpers.families import write_family, write_quantized_pair

    root = tmp_path_factory.mktemp("draft-model")
    out = {}
    for name, kw in (("target", dict(dim=256, heads=2, kv_heads=1, hidden=512, layers=2)),
                     ("small", dict(dim=256, heads=2, kv_heads=1, hidden=256, layers=1, seed=1))):   # (small: extended)
        folder = write_family(root / name, "qwen2", **kw)
        out[name] = write_quantized_pair(folder, root / f"{name}.gguf", {})
    return out


def _prompts(eng):
    return [eng.encode([{"role": "user", "content": f"Write a function number {i} that adds two numbers."}])
            for i in range(3)]


def test_speculation_with_a_draft_model_equals_plain_decoding(files):
    eng = agentspec.Engine.embedded(model=str(files["target"]), draft_model=str(files["target"]), quiet=True,
                                    prefix_cache_bytes=0)
    assert eng.default_drafters[-1] == "draft_model"
    drafter = eng.drafter_for(["draft_model"])
    # a random model is never sure of its next token: draft whatever it says, ungated
    drafter.gate, drafter.min_survival = None, 0.0
    for ids in _prompts(eng):
        plain = eng.generate(ids, max_tokens=40, spec=None)
        spec = eng.generate(ids, max_tokens=40, spec=SpecConfig(drafters=["draft_model"]))
        assert spec.token_ids == plain.token_ids
        # the same model drafting: everything it proposes is accepted
        assert spec.stats.source_drafted.get("draft_model", 0) > 0
        assert spec.stats.source_accepted["draft_model"] == spec.stats.source_drafted["draft_model"]
        both = eng.generate(ids, max_tokens=40)   # the default: suffix, json_copy, the draft model behind them
        assert both.token_ids == plain.token_ids


@pytest.mark.extended
def test_a_smaller_draft_model_behind_the_suffix_drafts_and_its_cache_carries_to_the_next_turn(files):
    eng = agentspec.Engine.embedded(model=str(files["target"]), draft_model=str(files["small"]), quiet=True)
    drafter = eng.drafter_for(["draft_model"])
    drafter.gate, drafter.min_survival = None, 0.0   # (a random pair would not pass the break-even)
    try:
        turn1 = _prompts(eng)[0]
        first = eng.generate(turn1, max_tokens=24, spec=SpecConfig(drafters=["draft_model"]), tenant="t")
        assert first.token_ids == eng.generate(turn1, max_tokens=24, spec=None, tenant="u").token_ids
        turn2 = turn1 + first.token_ids + eng.encode([{"role": "user", "content": "Now subtract."}])[1:]
        seen = []
        orig = drafter.start

        def start(req_id, prompt, *, tenant="default"):
            orig(req_id, prompt, tenant=tenant)
            r = drafter._reqs[req_id]
            seen.append(r.cache.length if r.cache is not None else 0)
        drafter.start = start
        second = eng.generate(turn2, max_tokens=24, spec=SpecConfig(drafters=["draft_model"]), tenant="t")
        assert second.token_ids == eng.generate(turn2, max_tokens=24, spec=None, tenant="u").token_ids
        assert seen and seen[0] >= len(turn1) - 1   # the last turn's rows, not a new prefill
    finally:
        drafter.__dict__.pop("start", None)


@pytest.mark.extended
def test_a_draft_model_with_another_tokenizer_is_refused(files, tmp_path):
    from helpers.families import write_family, write_quantized_pair

    other = write_quantized_pair(write_family(tmp_path / "llama", "llama", dim=256, heads=4, kv_heads=2, hidden=512),
                                 tmp_path / "llama.gguf", {})
    with pytest.raises(ConfigError, match="another tokenizer"):
        agentspec.Engine.embedded(model=str(files["target"]), draft_model=str(other), quiet=True)
    with pytest.raises(ConfigError, match="does not exist"):
        agentspec.Engine.embedded(model=str(files["target"]), draft_model="/nonexistent.gguf", quiet=True)
    eng = agentspec.Engine.embedded(model=str(files["target"]), quiet=True, prefix_cache_bytes=0)
    with pytest.raises(Exception, match="--draft-model"):
        eng.generate(_prompts(eng)[0], max_tokens=4, spec=SpecConfig(drafters=["draft_model"]))
