"""Exactness through the server under load: 8 greedy requests at once (chat completions,
completions and fast apply, speculation on) to a real `agentspec serve` process, each answer
equal to its prompt's plain decoding computed here with the same model."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers.serve import CODE, MODEL, Server, rewrite_messages

pytestmark = [pytest.mark.slow, pytest.mark.extended]   # extended tier: exactness under load

MAX_TOKENS = 48

CHATS = [
    rewrite_messages(),
    [{"role": "user", "content": "List three prime numbers greater than 50 and say why each is prime."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Explain in two sentences why the sky is blue."}],
]
COMPLETIONS = [
    CODE + "\n\ndef fibonacci_list(n):\n",
    "The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7,",
]
APPLIES = [
    {"code": CODE, "update": "def factorial(n):\n    # iterative\n    ..."},
    {"code": CODE, "instruction": "Rename fibonacci to fib."},
]


@pytest.fixture(scope="module")
def load_server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("load"), config=None, name="load")
    yield s
    s.stop()


def _expected(engine, plain_greedy):
    """(kind, request, what the answer must be) for the 8 requests, from plain greedy decoding
    of exactly the prompt ids the server builds."""
    from agentspec.apply import build_apply

    out = []
    for msgs in CHATS:  # the chat template
        g = plain_greedy(engine.encode(msgs), MAX_TOKENS)
        out.append(("chat", msgs, (g.text, len(g.token_ids), g.finish_reason)))
    for prompt in COMPLETIONS:  # raw text: no template
        g = plain_greedy(engine.tokenizer.encode(prompt), MAX_TOKENS)
        out.append(("completion", prompt, (g.text, len(g.token_ids), g.finish_reason)))
    for body in APPLIES:  # the apply prompt; the answer post-processed as the server does
        plan = build_apply(body["code"], body.get("update"), body.get("instruction"), tokenizer=engine.tokenizer)
        g = plain_greedy(engine.encode(plan.messages), MAX_TOKENS)
        out.append(("apply", body, (plan.finish(g.text), len(g.token_ids), g.finish_reason)))
    return out


def test_concurrent_mixed_greedy_requests_equal_plain_decoding(load_server, engine, plain_greedy):
    expected = _expected(engine, plain_greedy)
    assert len(expected) == 8
    c = load_server.client()
    start = threading.Barrier(len(expected))

    def send(kind, req):
        start.wait(60)  # all 8 leave together
        if kind == "chat":
            r = c.chat.completions.create(model=MODEL, messages=req, temperature=0, max_tokens=MAX_TOKENS,
                                          extra_body={"spec_stats": True})
            return r.id, (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason), \
                r.model_extra["spec"]
        if kind == "completion":
            r = c.completions.create(model=MODEL, prompt=req, temperature=0, max_tokens=MAX_TOKENS,
                                     extra_body={"spec_stats": True})
            return r.id, (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason), \
                r.model_extra["spec"]
        r = httpx.post(load_server.base + "/v1/apply", timeout=300,
                       json={**req, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        b = r.json()
        return b["id"], (b["merged_code"], b["usage"]["completion_tokens"], b["finish_reason"]), b["spec"]

    with ThreadPoolExecutor(len(expected)) as pool:
        futures = [pool.submit(send, kind, req) for kind, req, _ in expected]
        results = [f.result(timeout=600) for f in futures]

    bad = [(kind, req, got, want) for (kind, req, want), (_, got, _) in zip(expected, results) if got != want]
    assert not bad, "outputs under load differ from plain decoding:\n" + "\n".join(
        f"  {kind} {str(req)[:60]!r}:\n    got  {got!r}\n    want {want!r}" for kind, req, got, want in bad)
    specs = [s for _, _, s in results]
    assert all(s["enabled"] for s in specs), specs
    assert sum(s["accepted_tokens"] for s in specs) > 0, "speculation never accepted a token"

    # the 8 requests really ran together: one moment when every one of them was in the server
    from agentspec.telemetry import ReadReport, read_records

    ids = {rid for rid, _, _ in results}
    for _ in range(300):  # a hang guard: records may land just after the responses
        records = [r for r in read_records(load_server.cwd / "logs", report=ReadReport()) if r.request_id in ids]
        if len(records) == len(ids):
            break
        time.sleep(0.1)
    assert len(records) == len(ids), records
    arrived = max(r.ts - r.e2e_ms / 1e3 for r in records)
    first_done = min(r.ts for r in records)
    assert arrived < first_done, "a request finished before the last one arrived: they did not overlap"
