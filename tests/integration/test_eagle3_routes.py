"""The "eagle3" drafter named by a request (``SpecConfig(drafters=...)``) and by a server route
(``[[routes]] drafters = ["suffix", "eagle3"]``), on the real model, real head files and a real
``agentspec serve`` process on loopback with the ``openai`` client: greedy output is plain
decoding token for token, and a head that is missing or does not fit the model is refused at
start-up with a message naming the problem."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.serve import Server, free_port

from agentspec import SpecConfig
from agentspec.drafting import SuffixDrafter
from agentspec.drafting.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    build_vocab_map,
    save_eagle3,
)
from agentspec.backends.embedded.batch import BatchEngine
from agentspec.backends.embedded.engine import EmbeddedEngine
from agentspec.errors import ConfigError, ModelLoadError

pytestmark = [pytest.mark.slow, pytest.mark.extended]   # extended tier: the EAGLE-3 head through routes and the server

MODEL = "SmolLM2-135M-Instruct"
DRAFT_VOCAB = 1024
PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
]
ROUTE_CONFIG = """
[server]
log_dir = "logs"
[[routes]]
name = "chat-eagle"
when = { endpoint = "chat.completions" }
drafters = ["suffix", "eagle3"]
"""


def write_head(args, path: Path, *, seed: int = 0, **config_overrides) -> Path:
    """An EAGLE-3 head for the target ``args`` with random weights (what it drafts does not
    matter for exactness), written as the SGLang layout. Norms are 1 and the LM head large, so
    its draft-vocab distribution is peaked and it proposes confident chains (a flat one would
    stop below the drafter's survival floor and leave verification untested). The vocab map
    covers the ids a real tokenizer uses most (lower ids). ``config_overrides`` are written to
    config.json as they are, over a head shaped for the target: a deliberate mismatch."""
    cfg = Eagle3Config.for_target(args, draft_vocab_size=DRAFT_VOCAB)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(std=1.0 if name.startswith("lm_head") else 0.05)
    counts = torch.zeros(args.vocab_size)
    counts[: 4 * DRAFT_VOCAB] = torch.rand(4 * DRAFT_VOCAB)
    head.set_vocab_map(*build_vocab_map(counts, DRAFT_VOCAB))
    for k, v in config_overrides.items():
        setattr(cfg, k, v)
    return save_eagle3(head, cfg, path)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory) -> Path:
    from agentspec.backends.embedded.weights import load_checkpoint

    return write_head(load_checkpoint(quiet=True).args, tmp_path_factory.mktemp("eagle3") / "head")


@pytest.fixture(scope="module")
def eagle_engine(head_dir) -> EmbeddedEngine:
    """The engine with its head given as the ``eagle3=`` option (what ``--eagle3 DIR`` passes)."""
    # gate off: a random head never pays, and these tests need it to draft
    return EmbeddedEngine(quiet=True, eagle3=head_dir, eagle3_gate=False)


@pytest.fixture(scope="module")
def plain(eagle_engine):
    done: dict[tuple, object] = {}

    def generate(ids, max_tokens: int):
        key = (tuple(ids), max_tokens)
        if key not in done:
            done[key] = eagle_engine.generate(list(ids), max_tokens=max_tokens, spec=None)
        return done[key]

    return generate


def _eagle_steps(stats) -> int:
    return sum(n for source, n in stats.draft_sources.items() if "eagle3" in source)


# ---- the Python API --------------------------------------------------------------------------------


def test_spec_drafters_suffix_eagle3_greedy_equals_plain(eagle_engine, plain):
    spec = SpecConfig(drafters=["suffix", "eagle3"], row_cost=0)
    head_steps = 0
    for p in PROMPTS:
        ids = eagle_engine.encode(p)
        got = eagle_engine.generate(ids, max_tokens=48, spec=spec)
        assert got.token_ids == plain(ids, 48).token_ids
        assert got.stats.spec_enabled
        head_steps += _eagle_steps(got.stats)
    assert head_steps > 0, "the head never drafted: verification of its drafts was not tested"
    # built once per list, on the index of the engine's own drafter (tenant history shared)
    d = eagle_engine.drafter_for(("suffix", "eagle3"))
    assert eagle_engine.drafter_for(["suffix", "eagle3"]) is d
    assert d.primary.index is eagle_engine.drafter.index


def test_batch_submit_uses_spec_drafters(eagle_engine, plain):
    prompts = [eagle_engine.encode(p) for p in PROMPTS]
    with BatchEngine(eagle_engine, max_batch=4, budget_policy="fixed", step_costs={2: 1.0, 264: 1.0},
                     background=False) as be:
        gens = be.generate_many(prompts, max_tokens=40, spec=SpecConfig(drafters=["suffix", "eagle3"], row_cost=0))
    for ids, g in zip(prompts, gens):
        assert g.token_ids == plain(ids, 40).token_ids
    assert sum(_eagle_steps(g.stats) for g in gens) > 0


def test_explicit_drafter_wins_and_no_head_is_loaded_for_it(eagle_engine, tmp_path, monkeypatch):
    """An explicit ``drafter=`` is used as it is: the spec's list is not built (its head, here
    missing, is never looked for)."""
    monkeypatch.setattr(eagle_engine, "eagle3", str(tmp_path / "missing"))
    ids = eagle_engine.encode(PROMPTS[0])
    spec = SpecConfig(drafters=["eagle3"], budget=8)
    g = eagle_engine.generate(ids, max_tokens=8, spec=spec, drafter=SuffixDrafter())
    assert _eagle_steps(g.stats) == 0
    with BatchEngine(eagle_engine, budget_policy="fixed", step_costs={2: 1.0, 264: 1.0}, background=False) as be:
        (g2,) = be.generate_many([ids], max_tokens=8, spec=spec, drafter=SuffixDrafter())
    assert g2.token_ids == g.token_ids


def test_spec_unknown_drafter_raises_config_error():
    with pytest.raises(ConfigError, match="'nope'"):
        SpecConfig(drafters=["nope"])


# ---- heads that are missing or do not fit --------------------------------------------------------------


def _drop_tensor(head: Path, name: str) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(head / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(head / "model.safetensors"), metadata={"format": "pt"})
    return head


@pytest.mark.parametrize(("case", "needles"), [
    ("hidden", ["hidden_size 64 != target hidden size 576"]),
    ("vocab", ["vocab_size 1000 != target vocab size 49152", "draft_vocab_size 1024 not in 1..1000"]),
    ("tensor", ["missing tensors ['norm.weight']"]),
    ("missing", ["does not exist"]),
])
def test_for_engine_names_the_mismatch(eagle_engine, tmp_path, case, needles):
    from agentspec.drafting.eagle3_drafter import for_engine

    where = tmp_path / "head"
    if case == "hidden":
        write_head(eagle_engine.args, where, hidden_size=64)
    elif case == "vocab":
        write_head(eagle_engine.args, where, vocab_size=1000)
    elif case == "tensor":
        _drop_tensor(write_head(eagle_engine.args, where), "norm.weight")
    with pytest.raises(ModelLoadError) as exc:
        for_engine(eagle_engine, path=where)
    assert str(where) in str(exc.value)
    for n in needles:
        assert n in str(exc.value), str(exc.value)


def test_engine_request_with_a_bad_head_fails_at_the_call(eagle_engine, tmp_path, monkeypatch):
    """A spec naming a head that does not fit fails when the request is made, naming the problem
    (and the engine keeps serving other requests)."""
    bad = write_head(eagle_engine.args, tmp_path / "bad", hidden_size=64)
    monkeypatch.setattr(eagle_engine, "_named_drafters", {})   # the good head's drafter is cached per list
    monkeypatch.setattr(eagle_engine, "eagle3", str(bad))
    ids = eagle_engine.encode(PROMPTS[1])
    with pytest.raises(ModelLoadError, match="hidden_size 64 != target hidden size 576"):
        eagle_engine.generate(ids, max_tokens=4, spec=SpecConfig(drafters=["suffix", "eagle3"]))
    with (BatchEngine(eagle_engine, budget_policy="fixed", step_costs={2: 1.0, 264: 1.0}, background=False) as be,
          pytest.raises(ModelLoadError, match="hidden_size 64")):
        be.submit(ids, max_tokens=4, spec=SpecConfig(drafters=["suffix", "eagle3"]))
    assert eagle_engine.generate(ids, max_tokens=4, spec=None).token_ids


def test_build_state_refuses_a_route_whose_head_is_missing(eagle_engine, tmp_path, monkeypatch):
    from agentspec.config import load_server_config
    from agentspec.server import build_state

    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "no-head"
    monkeypatch.setattr(eagle_engine, "_named_drafters", {})   # the good head's drafter is cached per list
    monkeypatch.setattr(eagle_engine, "eagle3", str(missing))
    cfg = tmp_path / "c.toml"
    cfg.write_text(ROUTE_CONFIG)
    with pytest.raises(ConfigError) as exc:
        build_state(load_server_config(cfg), engine=eagle_engine, quiet=True)
    msg = str(exc.value)
    assert "route 'chat-eagle'" in msg and "['suffix', 'eagle3']" in msg and str(missing) in msg
    assert "does not exist" in msg


def test_build_state_loads_no_head_for_routes_without_eagle3(eagle_engine, tmp_path, monkeypatch):
    """Routes that do not name eagle3 start with no head anywhere (this one points at nothing),
    and so does a route that names it but does not speculate."""
    from agentspec.config import load_server_config
    from agentspec.server import build_state

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(eagle_engine, "eagle3", str(tmp_path / "no-head"))
    cfg = tmp_path / "c.toml"
    cfg.write_text("""
[[routes]]
name = "merged"
drafters = ["suffix", "lookahead"]
[[routes]]
name = "off"
when = { min_temperature = 0.7 }
speculation = false
drafters = ["suffix", "eagle3"]
""")
    state = build_state(load_server_config(cfg), engine=eagle_engine, quiet=True)
    try:
        assert state.router.configured()[0].drafters == ("suffix", "lookahead")
    finally:
        state.backend.close()
        state.sink.close()


# ---- the server: a real `agentspec serve` on loopback ------------------------------------------------


def _serve_cmd(port: int, config: Path, head: Path) -> list[str]:
    return [sys.executable, "-m", "agentspec", "serve", "--port", str(port), "--config", str(config),
            "--eagle3", str(head)]


def test_server_route_suffix_eagle3_equals_plain(head_dir, eagle_engine, plain, tmp_path):
    server = Server(tmp_path, config=ROUTE_CONFIG, args=["--eagle3", str(head_dir)],
                    env={"AGENTSPEC_EAGLE3_GATE": "0"}, timeout=180)
    try:
        head_steps = 0
        for p in PROMPTS:
            msgs = [{"role": "user", "content": p}]
            want = plain(eagle_engine.encode(msgs), 48)
            out = server.client().chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=48,
                                                        extra_body={"spec_stats": True})
            off = server.client().chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=48,
                                                        extra_body={"spec_stats": True, "speculation": False})
            spec = out.model_extra["spec"]
            assert spec["enabled"] and spec["route"] == "chat-eagle"
            assert out.choices[0].message.content == want.text == off.choices[0].message.content
            assert out.usage.completion_tokens == len(want.token_ids)
            head_steps += sum(n for s, n in spec["draft_sources"].items() if "eagle3" in s)
        assert head_steps > 0, "the route's head never drafted"
    finally:
        server.stop()


def test_serve_refuses_a_mismatched_head_at_start_up(eagle_engine, tmp_path):
    """Exit code 2 and the mismatch on stderr, before anything is served."""
    bad = write_head(eagle_engine.args, tmp_path / "bad-head", hidden_size=64)
    cfg = tmp_path / "server.toml"
    cfg.write_text(ROUTE_CONFIG)
    r = subprocess.run(_serve_cmd(free_port(), cfg, bad), cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr
    assert "agentspec serve: route 'chat-eagle': drafters ['suffix', 'eagle3']: " in err, err[-3000:]
    assert "hidden_size 64 != target hidden size 576" in err and str(bad) in err
    assert "Traceback" not in err and "[agentspec] serving" not in err
