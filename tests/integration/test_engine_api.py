"""Public API, bad input, stopping rules, sampling, model loading."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import agentspec
from agentspec import ConfigError, ContextLengthError, InvalidRequestError, ModelLoadError, SpecConfig

pytestmark = pytest.mark.slow


def test_public_defaults():
    eng = agentspec.Engine.embedded()  # every default: bundled model, cpu, default dtype, default drafter
    g = eng.generate("Say hello.")     # default max_tokens, temperature, spec
    assert isinstance(g, agentspec.Generation)
    assert g.text and g.token_ids and g.finish_reason in ("stop", "length")
    assert g.stats.spec_enabled and g.stats.spec_reason == "greedy"
    assert g.stats.completion_tokens == len(g.token_ids) <= 256
    assert g.stats.seconds > 0 and g.stats.prefill_seconds > 0
    assert 0.0 <= eng.row_cost <= 1.0   # profiled at start-up


def test_bad_row_cost():  # was a second test_bad_engine_options, shadowed by the one below: never ran
    for bad in (-0.5, "cheap", 11):
        with pytest.raises(ConfigError, match="row_cost must be a number in"):
            agentspec.Engine.embedded(row_cost=bad)


def test_text_messages_and_ids_agree(engine):
    text = engine.generate("What is 2 + 2?", max_tokens=12, spec=None)
    msgs = engine.generate([{"role": "user", "content": "What is 2 + 2?"}], max_tokens=12, spec=None)
    ids = engine.generate(engine.encode("What is 2 + 2?"), max_tokens=12, spec=None)
    assert text.token_ids == msgs.token_ids == ids.token_ids


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(prompt=""), "prompt must not be empty"),
        (dict(prompt=[]), "prompt must not be empty"),
        (dict(prompt=[1, "a"]), "token id at index 1 of prompt must be an integer, got 'a'"),
        (dict(prompt=[1, 2.5]), "token id at index 1 of prompt must be an integer, got 2.5"),
        (dict(prompt=[1, True]), "token id at index 1 of prompt must be an integer, got True"),
        (dict(prompt=[-1]), r"token id -1 at index 0 of prompt is out of the vocabulary \[0, 49152\)"),
        (dict(prompt=[49152]), "token id 49152 at index 0 of prompt is out of the vocabulary"),
        (dict(prompt=b"abc"), "got bytes"),
        (dict(prompt=42), "got int"),
        (dict(prompt=[{"role": "user"}]), "needs string 'role' and 'content'"),
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(max_tokens=-5), "max_tokens must be >= 1, got -5"),
        (dict(max_tokens=1.5), "max_tokens must be an integer, got 1.5"),
        (dict(temperature=-1), "temperature must be in"),
        (dict(temperature=math.nan), "temperature must be in"),
        (dict(top_p=0), "top_p must be in"),
        (dict(top_k=-1), "top_k must be >= 0"),
        (dict(stop=""), "stop strings must not be empty"),
        (dict(stop=[1]), "stop must be a string or a list of strings"),
        (dict(spec="yes"), "spec must be a SpecConfig or None"),
    ],
)
def test_bad_input_names_the_value(engine, kwargs, match):
    kwargs = {"prompt": "hi", "max_tokens": 4, **kwargs}
    prompt = kwargs.pop("prompt")
    with pytest.raises(InvalidRequestError, match=match):
        engine.generate(prompt, **kwargs)


def test_context_window(engine):
    too_long = [1] * (engine.max_context + 1)
    with pytest.raises(ContextLengthError, match=rf"prompt of {engine.max_context + 1} tokens"):
        engine.generate(too_long, max_tokens=1)
    with pytest.raises(ContextLengthError, match="plus max_tokens=100"):
        engine.generate([1] * (engine.max_context - 50), max_tokens=100)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="model path does not exist: '/nonexistent/model.gguf'"):
        agentspec.Engine.embedded(model="/nonexistent/model.gguf")
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="must be a .gguf file or a Hugging Face folder"):
        agentspec.Engine.embedded(model=str(bad))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        agentspec.Engine.embedded(model=str(fake))
    with pytest.raises(ModelLoadError, match="no config.json"):
        agentspec.Engine.embedded(model=str(tmp_path))


def test_stop_strings_eos_and_length(engine):
    ids = engine.encode("Write a Python function that adds two numbers, with a docstring.")
    full = engine.generate(ids, max_tokens=48, spec=None)
    assert full.finish_reason == "length" and len(full.token_ids) == 48
    assert "\n" in full.text
    for spec in (None, SpecConfig()):
        g = engine.generate(ids, max_tokens=48, stop="\n", spec=spec)
        assert g.finish_reason == "stop" and "\n" not in g.text
        assert full.text.startswith(g.text)
        assert engine.decode(g.token_ids).find("\n") >= 0  # the stop string's token is the last one
    # EOS ends a generation and is not among its tokens: a grammar that takes only "yes" leaves EOS
    # the one token after it (where the answer would end on its own depends on the CPU's kernels)
    short = engine.generate("Reply with just the word yes.", max_tokens=64, grammar='start: "yes"')
    assert short.finish_reason == "stop" and short.text == "yes" and len(short.token_ids) < 64
    assert not set(short.token_ids) & engine.tokenizer.eos_token_ids


def test_sampling_speculates_and_seeds_repeat(engine):
    # with speculation a seed reproduces the output given the same drafts; the default drafter
    # remembers earlier outputs (tenant history), so each run gets a fresh one here
    from agentspec import SuffixDrafter

    kw = dict(max_tokens=24, temperature=0.8, top_p=0.95, seed=11)
    a = engine.generate("Tell me a story about a cat.", drafter=SuffixDrafter(), **kw)
    b = engine.generate("Tell me a story about a cat.", drafter=SuffixDrafter(), **kw)
    c = engine.generate("Tell me a story about a cat.", drafter=SuffixDrafter(), **{**kw, "seed": 12})
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    assert a.stats.spec_enabled and "exact tree speculative sampling" in a.stats.spec_reason
    p1 = engine.generate("Tell me a story about a cat.", spec=None, **kw)
    p2 = engine.generate("Tell me a story about a cat.", spec=None, **kw)
    assert p1.token_ids == p2.token_ids and not p1.stats.spec_enabled
    plain = engine.generate("x", max_tokens=2, spec=SpecConfig(budget=0))
    assert not plain.stats.spec_enabled and plain.stats.spec_reason == "budget 0"


def test_stream_yields_what_generate_returns(engine, rewrite_prompts):
    ids = rewrite_prompts[1]
    it = engine.generate_stream(ids, max_tokens=40)
    chunks = []
    while True:
        try:
            chunks.append(next(it))
        except StopIteration as done:
            final = done.value
            break
    assert [t for c in chunks for t in c] == final.token_ids
    assert len(chunks) == final.stats.steps + 1  # prefill's token, then one chunk per step


def test_weight_cache_makes_starts_fast(monkeypatch):
    """A start after the first reads the converted cache: the GGUF is not dequantized again."""
    from agentspec.backends.embedded import weights

    first = weights.load_checkpoint(quiet=True)  # converted by now (the session engine did it)

    def no_conversion(*args, **kw):
        raise AssertionError("the cached conversion was not used: the GGUF was converted again")

    monkeypatch.setattr(weights, "_convert_gguf", no_conversion)
    ckpt = weights.load_checkpoint(quiet=True)
    assert ckpt.args.n_layers == 30 and ckpt.args.vocab_size == 49152
    a, b = ckpt.state_dict(), first.state_dict()
    assert a.keys() == b.keys()
    assert torch.equal(a["embed.weight"], b["embed.weight"])
    assert torch.equal(a["layers.29.w_down.weight"], b["layers.29.w_down.weight"])


def _run_all(runs: dict[str, tuple[list[str], str | None]], timeout: float) -> dict[str, subprocess.CompletedProcess]:
    """``subprocess.run`` for several commands at once (each start imports torch: seconds);
    every process is waited for (killed on a timeout) before this returns."""
    procs = {k: subprocess.Popen(args, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, (args, stdin) in runs.items()}
    out = {}
    try:
        for k, p in procs.items():
            stdout, stderr = p.communicate(runs[k][1], timeout=timeout)
            out[k] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    finally:
        for k, p in procs.items():
            if k not in out:  # a timeout or an error above: end it and close its pipes
                p.kill()
                p.communicate()
    return out


def test_cli_generate_json_and_errors(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Name three colors.")
    gen = [sys.executable, "-m", "agentspec", "generate"]
    # the error cases alongside one model run; the two model runs one after the other (two
    # OpenMP teams on two cores would slow each other down more than they save)
    res = _run_all({
        "json": ([*gen, str(prompt), "--max-tokens", "16", "--json"], None),
        "bad": ([*gen, "--max-tokens", "0", str(prompt)], None),
        "missing": ([*gen, str(tmp_path / "nope.txt")], None),
        "badmodel": ([*gen, str(prompt), "--model", "/no/such.gguf"], None),
    }, timeout=300)
    res |= _run_all({"stdin": ([*gen, "--max-tokens", "16", "--json", "--no-spec"], "Name three colors.")},
                    timeout=300)
    r = res["json"]
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["text"] and len(out["token_ids"]) <= 16 and out["stats"]["spec_enabled"] is True
    r2 = res["stdin"]
    assert r2.returncode == 0, r2.stderr
    out2 = json.loads(r2.stdout.strip().splitlines()[-1])
    assert out2["token_ids"] == out["token_ids"] and out2["stats"]["spec_enabled"] is False
    bad = res["bad"]
    assert bad.returncode == 2 and "--max-tokens must be > 0, got 0" in bad.stderr
    missing = res["missing"]
    assert missing.returncode != 0 and "prompt file not found" in missing.stderr
    badmodel = res["badmodel"]
    assert badmodel.returncode == 2 and "model path does not exist: '/no/such.gguf'" in badmodel.stderr


def test_bad_engine_options():
    with pytest.raises(ConfigError, match="dtype must be float32, bfloat16 or float16, got 'fp8'"):
        agentspec.Engine.embedded(dtype="fp8", quiet=True)
    with pytest.raises(ConfigError, match="kv_dtype must be float32, bfloat16 or float16, got 'int8'"):
        agentspec.Engine.embedded(kv_dtype="int8", quiet=True)
    with pytest.raises(ConfigError, match="deterministic_width must be >= 2, got 1"):
        agentspec.Engine.embedded(deterministic_width=1, quiet=True)


def test_text_stream_never_sends_what_the_final_text_lacks():
    from agentspec.text import TextStream
    from agentspec.backends.embedded.weights import load_checkpoint

    tok = load_checkpoint(quiet=True).tokenizer
    text = "naïve café — ünïcödé 你好 and the END marker here"
    ids = tok.encode(text)
    for stops in ([], ["END"], ["你好"], ["é —"]):
        s = TextStream(tok, stops)
        sent = "".join(s.push([t]) for t in ids)
        cut = min((i for i in (text.find(x) for x in stops) if i >= 0), default=len(text))
        final = text[:cut]
        assert final.startswith(sent) and "\ufffd" not in sent
        assert sent + s.finish(final) == final
