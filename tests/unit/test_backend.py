"""The backend seam: ``agentspec.backends.protocol`` (torch-free types and protocol) and ``EmbeddedBackend``."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from agentspec.backends.protocol import GenerationRequest
from agentspec.config import SpecConfig
from agentspec.errors import ConfigError



def test_backend_module_does_not_load_torch():
    code = ("import sys, agentspec.backends.protocol, agentspec.backends.embedded.backend, agentspec.server.app; "
            "print(sorted(m for m in ('torch', 'agentspec.backends.embedded.engine', 'agentspec.backends.embedded.batch') "
            "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_request_defaults_and_json_roundtrip():
    import msgspec

    r = GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=8)
    assert r.spec == SpecConfig() and r.drafters is None and r.stop == [] and r.prediction_ids is None
    assert r.tenant == "default" and r.request_id == "" and r.greedy
    back = msgspec.json.decode(msgspec.json.encode(r), type=GenerationRequest)
    assert back == r
    plain = msgspec.json.decode(b'{"prompt_ids": [5], "max_tokens": 2, "spec": null}', type=GenerationRequest)
    assert plain.spec is None


def test_deterministic_engine_is_refused():
    from agentspec.backends.embedded.backend import EmbeddedBackend

    with pytest.raises(ConfigError, match="deterministic"):
        EmbeddedBackend(types.SimpleNamespace(deterministic=True, vocab_size=100))
