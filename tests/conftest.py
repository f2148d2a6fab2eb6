from __future__ import annotations

import threading
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50 and say why each is prime.",
]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Fail a test that leaves threads running (watchdog's fixture habit)."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    assert not leaked, f"test leaked threads: {leaked}"


@pytest.fixture(scope="session")
def rewrite_records() -> list[dict]:
    from agentspec.traces import load_records

    return list(load_records(FIXTURES / "file_rewrites_sample.jsonl"))


@pytest.fixture(scope="session")
def engine():
    import agentspec

    return agentspec.Engine.embedded(quiet=True)


@pytest.fixture(scope="session")
def rewrite_prompts(engine, rewrite_records) -> list[list[int]]:
    from agentspec.traces import prompt_messages

    return [engine.encode(prompt_messages(r["prompt"])) for r in rewrite_records]


@pytest.fixture(scope="session")
def chat_prompts(engine) -> list[list[int]]:
    return [engine.encode(p) for p in CHAT_PROMPTS]
