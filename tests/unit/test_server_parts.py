"""Server parts that need no server: config loading, route rules, streaming detokenisation."""

from __future__ import annotations

import pytest

from agentspec.apply import apply_prompt, merged_code, prediction_usage
from agentspec.config import ServerConfig, SpecConfig, load_server_config
from agentspec.errors import ConfigError
from agentspec.api.routing import Router

README_CONFIG = """
[server]
log_dir = "logs"
[[tenants]]
name = "acme"
api_keys = ["sk-acme-12345678"]
[[routes]]
name = "creative"
when = { min_temperature = 0.7 }
speculation = false
"""


def _load(tmp_path, text: str) -> ServerConfig:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return load_server_config(p)


def test_defaults_and_readme_example(tmp_path):
    d = load_server_config(None)
    assert d.tenants == [] and d.routes == [] and d.server.log_dir == "logs"
    c = _load(tmp_path, README_CONFIG)
    assert c.tenants[0].name == "acme" and c.routes[0].when.min_temperature == 0.7


@pytest.mark.parametrize("text,match", [
    ('[server]\nlog_dri = "x"\n', "log_dri"),
    ('[[tenants]]\nname = "a b"\n', "tenants"),
    ('[[tenants]]\nname = "a"\napi_keys = ["short"]\n', "api_keys"),
    ('[[tenants]]\nname = "a"\napi_keys = ["sk-123456789"]\n[[tenants]]\nname = "b"\napi_keys = ["sk-123456789"]\n',
     "more than one tenant"),
    ('[[tenants]]\nname = "a"\n[[tenants]]\nname = "a"\n', "unique"),
    ('[[routes]]\nname = "r"\nwhen = { endpoint = "embeddings" }\n', "embeddings"),
    ('[[routes]]\nname = "r"\ndrafters = ["eagle9"]\n', "eagle9"),
    ('[[routes]]\nname = "r"\nbudget = -1\n', "budget"),
    ('[[tenants]]\nname = "a"\n[[routes]]\nname = "r"\nwhen = { tenant = "zed" }\n', "zed"),
    ("[server\n", "not valid TOML"),
])
def test_bad_config_names_the_problem(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        _load(tmp_path, text)


def test_short_api_key_message_names_the_field_and_the_rule(tmp_path):
    """The README's placeholder ``"sk-..."`` is refused; the message says which key and why."""
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, '[[tenants]]\nname = "acme"\napi_keys = ["sk-acme-12345678", "sk-..."]\n')
    msg = str(e.value)
    assert "tenant 'acme': api_keys[1] is 6 characters long; an API key needs at least 8" in msg, msg
    assert "sk-..." not in msg and "sk-acme" not in msg   # keys are never echoed
    assert _load(tmp_path, '[[tenants]]\nname = "acme"\napi_keys = ["12345678"]\n').tenants[0].api_keys == ["12345678"]


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_server_config(tmp_path / "nope.toml")


def test_routes_first_match_wins(tmp_path):
    c = _load(tmp_path, """
[[tenants]]
name = "acme"
[[tenants]]
name = "beta"
[[routes]]
name = "hot"
when = { min_temperature = 0.7 }
speculation = false
[[routes]]
name = "apply-wide"
when = { endpoint = "apply", tenant = ["acme", "beta"] }
budget = 64
drafters = ["suffix", "lookahead"]
[[routes]]
name = "beta-off"
when = { tenant = "beta", max_temperature = 0.5 }
budget = 0
[[routes]]
name = "everything"
""")
    r = Router(c.routes)
    hot = r.resolve(endpoint="apply", tenant="acme", model="m", temperature=0.8)
    assert hot.name == "hot" and hot.spec is None and "speculation = false" in hot.reason
    wide = r.resolve(endpoint="apply", tenant="beta", model="m", temperature=0.0)
    assert wide.name == "apply-wide" and wide.spec == SpecConfig(budget=64) and wide.drafters == ("suffix", "lookahead")
    off = r.resolve(endpoint="chat.completions", tenant="beta", model="m", temperature=0.2)
    assert off.name == "beta-off" and off.spec is None and "budget = 0" in off.reason
    rest = r.resolve(endpoint="completions", tenant="acme", model="m", temperature=0.0)
    assert rest.name == "everything" and rest.spec == SpecConfig()
    assert Router().resolve(endpoint="apply", tenant="x", model="m", temperature=1.0).name == "default"


def test_merged_code_prediction_usage_and_apply_prompt():
    # the server's helpers live in agentspec.apply now (more cases in test_apply.py)
    assert merged_code("```python\nx = 1\n```\n") == "x = 1\n"
    assert merged_code("x = 1\n") == "x = 1\n"
    assert merged_code("```\n```") == ""
    assert prediction_usage([1, 2, 3, 4], [1, 2, 9, 4]) == (3, 1)
    assert prediction_usage([], [1]) == (0, 0)
    p = apply_prompt("x = 1\n", "x = 2", "bump x", "a.py")
    assert "```python\nx = 1\n```" in p and "bump x" in p and "x = 2" in p


@pytest.mark.parametrize("wire,heartbeat,beat", [
    ("openai", None, b": keep-alive\n\n"),
    ("anthropic", lambda: [{"type": "ping"}], b'event: ping\ndata: {"type":"ping"}\n\n'),
])
def test_a_quiet_stream_sends_heartbeats(monkeypatch, wire, heartbeat, beat):
    """While a stream has nothing to send (a long prefill on a CPU, a held-back bare-JSON call),
    a heartbeat goes out every HEARTBEAT_S: agent CLIs drop a stream idle for 300 s and retry it."""
    import asyncio
    from types import SimpleNamespace

    from agentspec.server import app

    class Shaper:
        def __init__(self, prepared, tokenizer):
            pass

        def events(self, job, kind, value):
            return ([{"type": "text", "text": value}] if kind == "tokens" else []), None, kind == "done"

    monkeypatch.setattr(app, "StreamShaper", Shaper)
    monkeypatch.setattr(app, "HEARTBEAT_S", 0.05)
    prepared = SimpleNamespace(opening=[], wire=wire, heartbeat=heartbeat, error_chunks=None)
    job = SimpleNamespace(cancel=lambda: None)
    state = SimpleNamespace(backend=SimpleNamespace(tokenizer=None))

    async def run() -> list[bytes]:
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.call_later(0.18, events.put_nowait, ("tokens", "hi"))
        loop.call_later(0.2, events.put_nowait, ("done", None))
        return [b async for b in app._stream(state, prepared, job, events)]

    out = asyncio.run(run())
    beats = [b for b in out if b == beat]
    assert len(beats) >= 2 and out.index(beat) == 0, out
    assert b"hi" in b"".join(out)   # no event lost to a heartbeat's timeout
