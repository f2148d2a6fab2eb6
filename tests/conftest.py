from __future__ import annotations

import gc
import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _repository_root_off_sys_path() -> None:
    """The repository root never on sys.path, in this process or any it starts: its kernels/ and
    integrations/ (installed as agentspec.kernels and agentspec.integrations) would shadow the
    installed packages of those names (Hugging Face's `kernels`, which transformers imports).
    ``make test`` runs ``python -P``; this covers ``python -m pytest`` too, and PYTHONSAFEPATH
    passes it on to every child Python. ``benchmarks`` is then imported from its folder."""
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
    os.environ["PYTHONSAFEPATH"] = "1"
    if "benchmarks" not in sys.modules:
        spec = importlib.util.spec_from_file_location("benchmarks", ROOT / "benchmarks" / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / "benchmarks")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks"] = module
        spec.loader.exec_module(module)


_repository_root_off_sys_path()

import pytest  # noqa: E402

import agentspec  # noqa: E402,F401  (first of ours: sets OpenMP / ISA variables before torch loads)

FIXTURES = Path(__file__).parent / "fixtures"

# tests/sglang (SGLang on CPU as test infrastructure) runs in .venv-sglang, via `make test-sglang`;
# anywhere SGLang is not installed its modules are skipped with the reason (helpers.sglang)

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50 and say why each is prime.",
]


@pytest.fixture(params=["inotify", "watchdog"] if sys.platform.startswith("linux") else ["watchdog"])
def watcher(request, monkeypatch):
    """Each file watcher this platform has (``AGENTSPEC_WATCHER``): on Linux the single-threaded
    inotify reader (the default) and watchdog's observer (the default elsewhere)."""
    monkeypatch.setenv("AGENTSPEC_WATCHER", request.param)
    return request.param


THREAD_JOIN_GRACE_S = 5.0


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Fail a test that leaves threads running (watchdog's fixture habit), daemon or not: every
    thread the project starts is a daemon (a scheduler, a watcher, a log writer), so a close()
    that forgets to join one is exactly what this must catch.

    Threads alive before the test are not its own: those of session- and module-scoped fixtures
    (set up before this function-scoped fixture) and of objects they own. A thread the test
    started is given a short grace to end (joined with a timeout: a thread told to stop by a
    close() may still be unwinding; this is a hang guard, not a time bound on anything); one
    still alive after that is a leak, named in the failure."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + THREAD_JOIN_GRACE_S
    leaked = []
    for t in threading.enumerate():
        if t in before or t is threading.current_thread():
            continue
        t.join(max(deadline - time.monotonic(), 0.0))
        if t.is_alive():
            leaked.append(t)
    assert not leaked, "test leaked threads: " + ", ".join(
        f"{t.name!r} ({'daemon' if t.daemon else 'non-daemon'}, target {getattr(t, '_target', None)!r})"
        for t in leaked)


@pytest.fixture(scope="module", autouse=True)
def _collect_frozen_garbage():
    """At the end of each module, collect what ``no_leaked_resources`` froze (see there)."""
    yield
    gc.unfreeze()
    gc.collect()


@pytest.fixture(autouse=True)
def no_leaked_resources():
    """Fail the test that leaks a socket, file or subprocess, not an innocent one.

    An unclosed socket, file or ``Popen`` warns (``ResourceWarning``, an error under
    ``filterwarnings = error``) when it is finalized. When it sits in a reference cycle (an
    ``openai.OpenAI`` or ``httpx.Client`` dropped without ``close()``: its pooled sockets) that is
    at some later garbage collection, in whichever test runs then (a hypothesis test of the
    suffix index, allocating a lot, was hit). So collect after every test: the warning is raised
    in this test's teardown and pytest reports it there (``PytestUnraisableExceptionWarning``
    naming the object). Survivors are then frozen, so that each collection only walks what the
    next test allocated (a full one walks ~300k objects with torch loaded, ~0.1-0.4 s); they are
    unfrozen and collected at the end of the module (``_collect_frozen_garbage``)."""
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture
def restore_isa():
    """``agentspec.kernels.cpu_isa``, its kernel ISA level put back after the test (a test that
    switches levels must not uncap a run started with ``AGENTSPEC_CPU_ISA``)."""
    from agentspec.kernels import cpu_isa

    before = cpu_isa.active()
    yield cpu_isa
    cpu_isa.set_isa(before)


@pytest.fixture(scope="session")
def rewrite_records() -> list[dict]:
    from agentspec.traces import load_records

    return list(load_records(FIXTURES / "file_rewrites_sample.jsonl"))


@pytest.fixture(scope="session")
def engine():
    return agentspec.Engine.embedded(quiet=True)


@pytest.fixture(scope="session")
def plain_greedy(engine):
    """``engine.generate(ids, max_tokens=n, spec=None)``, computed once per (ids, n) for the run:
    several modules compare against the same plain greedy references (greedy plain decoding is a
    function of the prompt alone). Callers must not modify what it returns."""
    done: dict[tuple, object] = {}

    def generate(ids, max_tokens: int):
        key = (tuple(ids), max_tokens)
        if key not in done:
            done[key] = engine.generate(list(ids), max_tokens=max_tokens, spec=None)
        return done[key]

    return generate


@pytest.fixture(scope="session")
def rewrite_prompts(engine, rewrite_records) -> list[list[int]]:
    from agentspec.traces import prompt_messages

    return [engine.encode(prompt_messages(r["prompt"])) for r in rewrite_records]


@pytest.fixture(scope="session")
def chat_prompts(engine) -> list[list[int]]:
    return [engine.encode(p) for p in CHAT_PROMPTS]
