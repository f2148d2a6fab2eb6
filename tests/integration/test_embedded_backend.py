"""``EmbeddedBackend`` on the real engine: the backend seam end to end (unit-level checks of the
types and the protocol are in tests/unit/test_backend.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from agentspec.backends.protocol import Backend, GenerationRequest, collect
from agentspec.config import SpecConfig
from agentspec.errors import ContextLengthError, InvalidRequestError, QueueFullError

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]


def test_serve_deterministic_is_refused_before_loading_anything(tmp_path):
    r = subprocess.run([sys.executable, "-m", "agentspec", "serve", "--deterministic"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "unrecognized arguments: --deterministic" in r.stderr
    assert "model ready" not in r.stderr


# ---- with the real engine -------------------------------------------------------------------------


@pytest.fixture
def backend(engine):
    from agentspec.backends.embedded.backend import EmbeddedBackend

    b = EmbeddedBackend(engine, max_queue=4, max_batch=4)
    yield b
    b.close()


def _run(backend, request) -> tuple[list[int], object, object]:
    """submit and wait: (streamed tokens, generation, error)."""
    streamed: list[int] = []
    out: dict = {}
    done = threading.Event()

    def on_done(gen, err):
        out["gen"], out["err"] = gen, err
        done.set()

    backend.submit(request, on_tokens=streamed.extend, on_done=on_done)
    assert done.wait(300), "the request did not finish"
    return streamed, out["gen"], out["err"]


def test_is_a_backend_with_tokenizer_and_chat_template(backend, engine):
    assert isinstance(backend, Backend)
    assert backend.max_context == engine.max_context and backend.model_name
    assert backend.encode_chat(PROMPT) == engine.encode(PROMPT)
    assert backend.encode_text("def f(x):") == engine.tokenizer.encode("def f(x):")
    assert backend.tokenizer.decode(backend.encode_text("hello world")) == "hello world"
    assert backend.tokenizer.eos_token_ids
    for bad in ([], "hi", [{"role": "user"}], [{"role": "user", "content": 3}], [42]):
        with pytest.raises(InvalidRequestError) as e:
            backend.encode_chat(bad)
        assert e.value.param == "messages"
    h = backend.health()
    assert h == {"status": "ok", "running": 0, "waiting": 0}
    s = backend.stats()
    assert s["backend"] == "embedded" and s["max_context"] == engine.max_context
    assert "kernels" in s and "hardware" in s and "step_costs_source" in s


def test_greedy_submit_equals_plain_decoding(backend, engine, plain_greedy):
    ids = engine.encode(PROMPT)
    ref = plain_greedy(ids, 24)
    for spec in (None, SpecConfig()):
        streamed, gen, err = _run(backend, GenerationRequest(prompt_ids=ids, max_tokens=24, spec=spec))
        assert err is None
        assert gen.token_ids == ref.token_ids, spec
        assert streamed == gen.token_ids and gen.text == ref.text
    assert backend.health()["running"] == 0


def test_stream_yields_the_generation_tokens(backend, engine, plain_greedy):
    ids = engine.encode(PROMPT)
    it = backend.stream(GenerationRequest(prompt_ids=ids, max_tokens=20))
    chunks = []
    while True:
        try:
            chunks.append(next(it))
        except StopIteration as stop:
            gen = stop.value
            break
    assert chunks and all(chunks)
    assert [t for c in chunks for t in c] == gen.token_ids == plain_greedy(ids, 20).token_ids
    assert collect(backend.stream(GenerationRequest(prompt_ids=ids, max_tokens=5))).token_ids == gen.token_ids[:5]


def test_stream_raises_bad_input_at_the_call(backend):
    with pytest.raises(InvalidRequestError):
        backend.stream(GenerationRequest(prompt_ids=[], max_tokens=5))


def test_cancel_stops_a_running_request(backend, engine):
    ids = engine.encode(PROMPT)
    rid = "cancel-me"
    assert backend.cancel(rid) is False  # not running
    cancelled = []

    def on_tokens(new):
        if not cancelled:
            cancelled.append(backend.cancel(rid))

    done = threading.Event()
    out = {}
    backend.submit(GenerationRequest(prompt_ids=ids, max_tokens=500, request_id=rid), on_tokens=on_tokens,
                   on_done=lambda g, e: (out.update(gen=g, err=e), done.set()))
    assert done.wait(300)
    assert cancelled == [True] and out["err"] is None
    assert out["gen"].finish_reason == "cancelled" and 0 < len(out["gen"].token_ids) < 500
    assert backend.cancel(rid) is False  # finished: forgotten
    # an early-closed stream cancels its request
    it = backend.stream(GenerationRequest(prompt_ids=ids, max_tokens=500, request_id="stream-closed"))
    next(it)
    it.close()  # cancels: the request ends at its next step
    deadline = time.monotonic() + 60
    while backend.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.health() == {"status": "ok", "running": 0, "waiting": 0}
    assert backend.cancel("stream-closed") is False


def test_queue_full(engine):
    from agentspec.backends.embedded.backend import EmbeddedBackend

    ids = engine.encode(PROMPT)
    errors = []
    b = EmbeddedBackend(engine, max_queue=2, background=False)  # nothing runs: requests stay queued
    try:
        for i in range(2):
            b.submit(GenerationRequest(prompt_ids=ids, max_tokens=4), on_tokens=lambda t: None,
                     on_done=lambda g, e: errors.append(e))
        assert b.health() == {"status": "ok", "running": 0, "waiting": 2}
        with pytest.raises(QueueFullError):
            b.submit(GenerationRequest(prompt_ids=ids, max_tokens=4), on_tokens=lambda t: None,
                     on_done=lambda g, e: errors.append(e))
    finally:
        b.close()
    assert len(errors) == 2 and all(isinstance(e, RuntimeError) for e in errors)  # failed at close
    assert b.health()["status"] == "closed"


def test_prediction_is_a_draft_source_for_one_request(engine):
    from agentspec.backends.embedded.backend import EmbeddedBackend, prediction_doc_id

    b = EmbeddedBackend(engine)
    added, removed = [], []
    real_add, real_remove = b.index.add_document, b.index.remove_document
    b.index.add_document = lambda doc, toks, *, tenant="default": (added.append((doc, list(toks), tenant)),
                                                                    real_add(doc, toks, tenant=tenant))[1]
    b.index.remove_document = lambda doc: (removed.append(doc), real_remove(doc))[1]
    ids = engine.encode(PROMPT)
    pred = engine.tokenizer.encode("def total(xs):\n    return sum(xs)\n")
    try:
        _, gen, err = _run(b, GenerationRequest(prompt_ids=ids, max_tokens=12, prediction_ids=pred, tenant="t1",
                                                request_id="with-pred"))
        assert err is None and gen.finish_reason in ("stop", "length")
        assert added == [(prediction_doc_id("with-pred"), pred, "t1")]
        assert removed == [prediction_doc_id("with-pred")]
        assert real_remove(prediction_doc_id("with-pred")) is False  # nothing left in the index
        # a rejected request leaves nothing behind either
        with pytest.raises(ContextLengthError):
            b.submit(GenerationRequest(prompt_ids=ids, max_tokens=engine.max_context, prediction_ids=pred,
                                       request_id="rejected"), on_tokens=lambda t: None, on_done=lambda g, e: None)
        assert real_remove(prediction_doc_id("rejected")) is False
        assert b.cancel("rejected") is False
    finally:
        b.close()


def test_bad_requests_raise_at_submit_naming_the_value(backend, engine):
    ids = engine.encode(PROMPT)
    cases = [
        (GenerationRequest(prompt_ids=[engine.vocab_size + 5], max_tokens=4), InvalidRequestError, "prompt"),
        (GenerationRequest(prompt_ids=[], max_tokens=4), InvalidRequestError, "prompt"),
        (GenerationRequest(prompt_ids=ids, max_tokens=engine.max_context), ContextLengthError, "max_tokens"),
        (GenerationRequest(prompt_ids=ids, max_tokens=0), InvalidRequestError, "max_tokens"),
        (GenerationRequest(prompt_ids=ids, max_tokens=4, top_p=2.0), InvalidRequestError, "top_p"),
        (GenerationRequest(prompt_ids=ids, max_tokens=4, drafters=("nope",)), InvalidRequestError, "drafters"),
        (GenerationRequest(prompt_ids=ids, max_tokens=4, prediction_ids=[-1]), InvalidRequestError,
         "prediction_ids"),
    ]
    for req, err, param in cases:
        with pytest.raises(err) as e:
            backend.submit(req, on_tokens=lambda t: None, on_done=lambda g, e: None)
        assert e.value.param == param, (req, e.value)
    with pytest.raises(InvalidRequestError):
        backend.submit({"prompt_ids": ids}, on_tokens=lambda t: None, on_done=lambda g, e: None)
    assert backend.health() == {"status": "ok", "running": 0, "waiting": 0}


def test_run_serves_on_the_calling_thread(engine, plain_greedy):
    from agentspec.backends.embedded.backend import EmbeddedBackend

    b = EmbeddedBackend(engine, background=False)
    ready = threading.Event()
    t = threading.Thread(target=b.run, kwargs={"on_ready": ready.set}, name="test-run", daemon=True)
    t.start()
    try:
        assert ready.wait(60)
        ids = engine.encode(PROMPT)
        assert collect(b.stream(GenerationRequest(prompt_ids=ids, max_tokens=8))).token_ids == plain_greedy(
            ids, 8).token_ids
        assert b.stats()["scheduler"] == "foreground"
    finally:
        b.close()
        t.join(60)
    assert not t.is_alive()
