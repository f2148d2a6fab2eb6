"""Drafters named per request and per route: ``SpecConfig(drafters=...)`` is validated where it is
written, routes accept ``"eagle3"``, and a route whose draft head is missing or does not fit the
model is refused when the backend is built (a server's start-up), not at its first request. No
model is loaded here: the engine is a stand-in with a tiny target's shapes."""

from __future__ import annotations

import types
from pathlib import Path

import msgspec
import pytest
import torch

from agentspec.backends.protocol import GenerationRequest
from agentspec.config import SpecConfig, check_drafters, load_server_config
from agentspec.drafting.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    build_vocab_map,
    save_eagle3,
)
from agentspec.backends.embedded.model import ModelArgs
from agentspec.errors import ConfigError
from agentspec.api.routing import Router

TINY = ModelArgs(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, hidden_dim=48, vocab_size=100,
                 norm_eps=1e-5, rope_base=100000.0, max_seq_len=256)


# ---- SpecConfig.drafters ---------------------------------------------------------------------------


def test_spec_drafters_default_none_and_lists_become_tuples():
    assert SpecConfig().drafters is None
    s = SpecConfig(drafters=["suffix", "eagle3"])
    assert s.drafters == ("suffix", "eagle3")
    assert hash(s) == hash(SpecConfig(drafters=("suffix", "eagle3")))   # still a usable dict key
    assert SpecConfig(drafters="eagle3").drafters == ("eagle3",)
    assert SpecConfig(drafters=["suffix>lookahead"]).drafters == ("suffix>lookahead",)
    back = msgspec.json.decode(msgspec.json.encode(s), type=SpecConfig)
    assert back == s


def test_spec_unknown_drafter_is_a_config_error_naming_it():
    with pytest.raises(ConfigError) as exc:
        SpecConfig(drafters=["suffix", "nope"])
    msg = str(exc.value)
    assert "'nope'" in msg and "SpecConfig.drafters" in msg
    for known in ("suffix", "lookahead", "prompt_lookup", "eagle3"):   # the known names are listed
        assert known in msg


@pytest.mark.parametrize(("bad", "needle"), [
    ([], "must not be empty"),
    (5, "got 5"),
    (["suffix", "suffix"], "more than once"),
    (["suffix", 3], "got 3"),
    (["suffix>"], "empty name"),
])
def test_spec_bad_drafter_lists(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        SpecConfig(drafters=bad)


def test_spec_drafters_decoded_from_json_are_validated():
    with pytest.raises(msgspec.ValidationError, match="nope"):
        msgspec.json.decode(b'{"drafters": ["nope"]}', type=SpecConfig)
    r = msgspec.json.decode(b'{"prompt_ids": [1], "max_tokens": 2, "spec": {"drafters": ["suffix", "eagle3"]}}',
                            type=GenerationRequest)
    assert r.spec.drafters == ("suffix", "eagle3")


def test_check_drafters_names_what_it_checks():
    assert check_drafters(["eagle3"]) == ("eagle3",)
    with pytest.raises(ConfigError, match=r"^route drafters: unknown drafter 'x'"):
        check_drafters(["x"], "route drafters")


# ---- routes ------------------------------------------------------------------------------------------


def test_route_names_eagle3_and_configured_lists_every_rule(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("""
[[routes]]
name = "chat"
when = { endpoint = "chat.completions" }
drafters = ["suffix", "eagle3"]
[[routes]]
name = "off"
when = { min_temperature = 0.7 }
speculation = false
drafters = ["eagle3"]
[[routes]]
name = "rest"
""")
    routes = Router(load_server_config(p).routes).configured()
    assert [(r.name, r.drafters, r.spec is not None) for r in routes] == [
        ("chat", ("suffix", "eagle3"), True), ("off", ("eagle3",), False), ("rest", None, True)]   # None: the backend's default


def test_route_unknown_drafter_names_it(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[[routes]]\nname = "r"\ndrafters = ["suffix", "eagel3"]\n')
    with pytest.raises(ConfigError) as exc:
        load_server_config(p)
    assert "route 'r'" in str(exc.value) and "'eagel3'" in str(exc.value) and "eagle3" in str(exc.value)


# ---- start-up refuses a head that is missing or does not fit -------------------------------------------


def _stand_in_engine(head_dir: Path | None) -> types.SimpleNamespace:
    """What ``EmbeddedBackend`` and the eagle3 factory read of an engine before any forward."""
    import threading

    from agentspec.backends.embedded.engine import EmbeddedEngine

    ns = types.SimpleNamespace(deterministic=False, vocab_size=TINY.vocab_size, args=TINY, dtype=torch.float32,
                               device=torch.device("cpu"), model_path="/nowhere/tiny.gguf",
                               eagle3=None if head_dir is None else str(head_dir), drafter=None,
                               runs_bundled_model=False, draft_heads={},
                               _named_drafters={}, _named_lock=threading.Lock())
    ns.drafter_for = lambda names, index=None: EmbeddedEngine.drafter_for(ns, names, index=index)   # the real one
    return ns


def _write_head(path: Path, **config_overrides) -> Path:
    cfg = Eagle3Config.for_target(TINY, draft_vocab_size=40)
    torch.manual_seed(0)
    head = Eagle3Head(cfg)
    counts = torch.randint(0, 50, (TINY.vocab_size,))
    head.set_vocab_map(*build_vocab_map(counts, 40))
    for k, v in config_overrides.items():
        setattr(cfg, k, v)
    return save_eagle3(head, cfg, path)


@pytest.mark.parametrize(("overrides", "needles"), [
    ({"hidden_size": 64}, ["hidden_size 64 != target hidden size 32"]),
    ({"vocab_size": 1000}, ["vocab_size 1000 != target vocab size 100"]),
])
def test_backend_refuses_a_mismatched_head_at_construction(tmp_path, overrides, needles):
    from agentspec.backends.embedded.backend import EmbeddedBackend

    head = _write_head(tmp_path / "head", **overrides)
    with pytest.raises(ConfigError) as exc:
        EmbeddedBackend(_stand_in_engine(head), drafters={"route 'chat'": ["suffix", "eagle3"]})
    msg = str(exc.value)
    assert msg.startswith("route 'chat': drafters ['suffix', 'eagle3']: "), msg
    assert str(head) in msg
    for n in needles:
        assert n in msg


def test_backend_refuses_a_missing_head_at_construction(tmp_path):
    from agentspec.backends.embedded.backend import EmbeddedBackend

    missing = tmp_path / "no-such-head"
    with pytest.raises(ConfigError) as exc:
        EmbeddedBackend(_stand_in_engine(missing), drafters={"route 'chat'": ["eagle3"]})
    assert "route 'chat'" in str(exc.value) and str(missing) in str(exc.value)
    assert "does not exist" in str(exc.value)
