"""Unit tests run without the model and without a server: a unit test that loads the bundled
model or starts a server fails here, naming where it belongs (tiny checkpoints a test writes
itself may load)."""

from __future__ import annotations

from pathlib import Path

import pytest

WHERE = "a unit test may not {what}: it belongs in tests/integration"


@pytest.fixture(scope="session")
def engine():
    pytest.fail(WHERE.format(what="use the real engine (the `engine` fixture)"))


@pytest.fixture(autouse=True)
def _no_model_no_server(monkeypatch):
    from agentspec.backends.embedded import engine as engine_mod
    from agentspec.backends.embedded import weights

    import helpers.serve

    def refuse(what):
        def fail(*args, **kwargs):
            pytest.fail(WHERE.format(what=what))
        return fail

    load = weights.load_checkpoint
    bundled = weights.bundled_model_path().resolve()

    def guarded(model=None, *args, **kwargs):
        if model is None or Path(model).resolve() == bundled:
            pytest.fail(WHERE.format(what="load the bundled model"))
        return load(model, *args, **kwargs)

    monkeypatch.setattr(weights, "load_checkpoint", guarded)
    monkeypatch.setattr(engine_mod, "load_checkpoint", guarded)
    monkeypatch.setattr(helpers.serve.Server, "__init__", refuse("start a server"))
    monkeypatch.setattr("agentspec.server.serve", refuse("start a server"))
