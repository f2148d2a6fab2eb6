"""The server as users reach it: a real `agentspec serve` process on loopback, the real `openai`
client and raw HTTP for what the client would refuse to send."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from helpers.serve import CODE, MODEL, Server, rewrite_messages

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ACME_KEY = "sk-acme-0123456789"
BETA_KEY = "sk-beta-0123456789"



@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    a, b = root / "repo_a", root / "repo_b"
    a.mkdir()
    b.mkdir()
    (a / "mathutil.py").write_text(CODE)
    (b / "other.py").write_text("print('beta')\n")
    # what the workspace ignores, and /v1/apply must not read: .git/, .venv/, gitignored files
    (a / ".git").mkdir()
    (a / ".git" / "config").write_text('[remote "origin"]\n\turl = https://token@example.com/x.git\n')
    (a / ".venv").mkdir()
    (a / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (a / ".gitignore").write_text(".env\nsecrets/\n")
    (a / ".env").write_text("API_TOKEN=secret\n")
    (a / "secrets").mkdir()
    (a / "secrets" / "keys.py").write_text("KEY = 'secret'\n")
    return root, a, b


@pytest.fixture(scope="module")
def server(workspaces):
    root, a, b = workspaces
    config = f"""
[server]
log_dir = "logs"
log_max_bytes = 1048576
[[tenants]]
name = "acme"
api_keys = ["{ACME_KEY}"]
workspace = "{a}"
[[tenants]]
name = "beta"
api_keys = ["{BETA_KEY}"]
workspace = "{b}"
[[routes]]
name = "creative"
when = {{ min_temperature = 0.7 }}
speculation = false
[[routes]]
name = "beta-huge"
when = {{ tenant = "beta", endpoint = "completions" }}
budget = 1000
drafters = ["suffix", "prompt_lookup"]
[[routes]]
name = "beta-small"
when = {{ tenant = "beta" }}
budget = 8
"""
    s = Server(root, config=config)
    yield s
    s.stop()


def _logs(server: Server, tenant: str) -> list[dict]:
    path = server.cwd / "logs" / f"{tenant}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait_for_record(server: Server, tenant: str, request_id: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in _logs(server, tenant):
            if r["request_id"] == request_id:
                return r
        time.sleep(0.1)
    raise AssertionError(f"no log record for {request_id} in {tenant}.jsonl")


# ---- OpenAI API --------------------------------------------------------------------------------------

def test_chat_stream_equals_non_stream_and_speculation_is_exact(server):
    c = server.client(ACME_KEY)
    msgs = rewrite_messages()
    spec = c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=120,
                                     extra_body={"spec_stats": True})
    plain = c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=120,
                                      extra_body={"spec_stats": True, "speculation": False})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens > 0
    s, p = spec.model_extra["spec"], plain.model_extra["spec"]
    assert s["enabled"] and s["accepted_tokens"] > 0 and s["steps"] < p["steps"]
    assert not p["enabled"] and p["reason"] == "request: speculation = false"

    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=120, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == spec.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == spec.usage.completion_tokens
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [spec.choices[0].finish_reason]


def test_completions_raw_prompt_stop_and_stream(server):
    c = server.client(ACME_KEY)
    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
    full = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 40
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stream=True))
    assert streamed == full.choices[0].text
    text = full.choices[0].text
    stop = text.strip()[:6]
    cut = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.find(stop)]
    cut_streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stop=[stop], stream=True))
    assert cut_streamed == cut.choices[0].text
    # token ids are used as given
    ids = c.completions.create(model=MODEL, prompt=[1, 2, 3, 4], temperature=0, max_tokens=3)
    assert ids.usage.prompt_tokens == 4


def test_prediction_is_a_draft_source_and_reported_in_usage(server, engine):
    from agentspec.apply import prediction_usage

    c = server.client(ACME_KEY)
    msgs = [{"role": "user", "content": "Repeat this code exactly, nothing else:\n\n" + CODE.replace("n!", "n factorial")}]
    plain = engine.generate(msgs, max_tokens=100, temperature=0, spec=None)  # what the server must answer
    kw = dict(model=MODEL, messages=msgs, temperature=0, max_tokens=100, extra_body={"spec_stats": True})
    without = c.chat.completions.create(**kw)
    with_pred = c.chat.completions.create(**kw, prediction={"type": "content", "content": CODE})
    assert with_pred.choices[0].message.content == without.choices[0].message.content == plain.text
    assert with_pred.usage.completion_tokens == len(plain.token_ids)
    assert without.usage.completion_tokens_details is None or \
        without.usage.completion_tokens_details.accepted_prediction_tokens is None
    # usage counts the prediction's tokens found in order in the output (a diff's matching blocks)
    pred = engine.tokenizer.encode(CODE)
    acc, rej = prediction_usage(pred, plain.token_ids)
    d = with_pred.usage.completion_tokens_details
    assert (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (acc, rej)
    assert acc + rej == len(pred) and acc > 0
    assert with_pred.model_extra["spec"]["mean_acceptance_length"] > 1.0
    # a prediction that is the answer itself: all of it accepted, and long accepted drafts
    exact = c.chat.completions.create(**kw, prediction={"type": "content", "content": plain.text})
    assert exact.choices[0].message.content == plain.text
    assert engine.tokenizer.encode(plain.text) == plain.token_ids
    d = exact.usage.completion_tokens_details
    assert (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (len(plain.token_ids), 0)
    s = exact.model_extra["spec"]
    assert s["accepted_tokens"] >= len(plain.token_ids) // 2, s
    assert s["steps"] <= without.model_extra["spec"]["steps"], (s, without.model_extra["spec"])


def test_apply_code_path_and_morph_style_messages(server, workspaces, engine):
    from agentspec.apply import build_apply, chat_fast_apply, prediction_usage

    _, a, b = workspaces
    h = {"Authorization": f"Bearer {ACME_KEY}"}
    update = "def factorial(n):\n    # iterative\n    ..."
    # the answer the server must give: plain greedy decoding of the prompt /v1/apply builds
    plan = build_apply(CODE, update, None, tokenizer=engine.tokenizer)
    plain = engine.generate(plan.messages, max_tokens=60, temperature=0, spec=None)
    code_ids = plan.prediction_ids
    acc, rej = prediction_usage(code_ids, plain.token_ids)
    r = httpx.post(server.base + "/v1/apply", headers=h, timeout=120,
                   json={"code": CODE, "update": update, "max_tokens": 60})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["merged_code"] == plan.finish(plain.text) and body["merged_code"]
    assert body["spec"]["enabled"] and body["usage"]["completion_tokens"] == len(plain.token_ids) == 60
    assert body["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": acc,
                                                          "rejected_prediction_tokens": rej}
    assert acc + rej == len(code_ids) and acc > 0
    by_path = httpx.post(server.base + "/v1/apply", headers=h, timeout=120,
                         json={"path": "mathutil.py", "update": "def factorial(n):\n    # iterative\n    ...",
                               "max_tokens": 60}).json()
    assert by_path["path"] == "mathutil.py" and by_path["merged_code"]
    assert by_path["usage"]["prompt_tokens"] > body["usage"]["prompt_tokens"] - 20  # the file's text is in it
    # streamed apply ends with the same merged code
    with httpx.stream("POST", server.base + "/v1/apply", headers=h, timeout=120,
                      json={"code": CODE, "update": update, "max_tokens": 60, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    # the deltas are the model's raw text (fences and all), exactly; merged_code comes at the end
    assert "".join(e["delta"] for e in events) == plain.text
    assert events[-1]["merged_code"] == body["merged_code"]
    # the same usage, but for the prompt tokens the prefix cache served the second time
    cached = events[-1]["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert cached >= body["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert events[-1]["usage"] == body["usage"] and events[-1]["finish_reason"] == body["finish_reason"]
    assert all("merged_code" not in e for e in events[:-1])
    # outside the workspace: 403; another tenant's workspace is outside too
    for path in ("../repo_b/other.py", str(b / "other.py"), "/etc/passwd"):
        bad = httpx.post(server.base + "/v1/apply", headers=h, json={"path": path, "update": "x"})
        assert bad.status_code == 403, (path, bad.text)
        assert bad.json()["error"]["type"] == "permission_error"
    missing = httpx.post(server.base + "/v1/apply", headers=h, json={"path": "nope.py", "update": "x"})
    assert missing.status_code == 404
    # Morph/Relace-style message through the OpenAI client
    c = server.client(ACME_KEY)
    msg = f"<instruction>Add a comment</instruction>\n<code>{CODE}</code>\n<update># comment\ndef fibonacci(n):</update>"
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}], temperature=0,
                                    max_tokens=40, extra_body={"spec_stats": True})
    # the server adds its merge instructions as the system message and drafts from the <code> block
    messages, original = chat_fast_apply([{"role": "user", "content": msg}])
    assert messages[0]["role"] == "system" and original is not None and original.strip() == CODE.strip()
    morph = engine.generate(messages, max_tokens=40, temperature=0, spec=None)
    assert out.choices[0].message.content == morph.text
    pred = engine.tokenizer.encode(original)
    acc, rej = prediction_usage(pred, morph.token_ids)
    d = out.usage.completion_tokens_details
    assert (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (acc, rej)
    assert acc + rej == len(pred) and acc > 0


def test_apply_refuses_what_the_workspace_ignores(server, workspaces):
    _, a, _ = workspaces
    h = {"Authorization": f"Bearer {ACME_KEY}"}
    for path in (".git/config", ".venv/pyvenv.cfg", ".env", "secrets/keys.py", "secrets/../.env",
                 str(a / ".git" / "config"), ".git/no_such_file"):
        r = httpx.post(server.base + "/v1/apply", headers=h, json={"path": path, "update": "x", "max_tokens": 1},
                       timeout=120)
        assert r.status_code == 403, (path, r.text)
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("permission_error", "path_ignored", "path"), err
        assert "ignored by the workspace of tenant 'acme'" in err["message"]
        assert not any(leak in r.text for leak in ("token@", "API_TOKEN", "KEY =", "home ="))
    r = httpx.post(server.base + "/v1/apply", headers=h, json={"path": "mathutil.py", "update": "# x", "max_tokens": 1},
                   timeout=120)
    assert r.status_code == 200, r.text


def test_startup_hint_commands_work_when_pasted(server):
    """The "try:" commands the server prints with tenants, run through bash as printed (with
    max_tokens added, for time) and $AGENTSPEC_API_KEY set: 200, not the 401 a single-quoted
    header got."""
    import os
    import shutil

    deadline = time.monotonic() + 30
    while "[agentspec] try:" not in (err := (server.cwd / "server.stderr").read_text()):
        assert time.monotonic() < deadline, err[-2000:]
        time.sleep(0.1)
    hint = err.split("[agentspec] try:\n", 1)[1].splitlines()
    curl = "\n".join(hint[:2]).strip()
    python = hint[2].strip()
    assert curl.startswith("curl -s ") and '-H "Authorization: Bearer $AGENTSPEC_API_KEY"' in curl, curl
    assert python.startswith('python -c "') and "AGENTSPEC_API_KEY" in python, python
    env = {**os.environ, "AGENTSPEC_API_KEY": ACME_KEY}
    if shutil.which("curl"):
        cmd = (curl.replace('"temperature": 0,', '"temperature": 0, "max_tokens": 4,', 1)
               + " -o /dev/null -w '%{http_code}'")
        out = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout == "200", (cmd, out.stdout, out.stderr)
    cmd = python.replace("python -c", f"{sys.executable} -c", 1)
    cmd = cmd.replace("temperature=0,", "temperature=0, max_tokens=4,", 1)
    out = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip(), (cmd, out.stderr[-2000:])


def test_auth_and_tenants(server):
    with pytest.raises(openai.AuthenticationError):
        server.client("sk-wrong-key-000").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.base + "/health").status_code == 200
    assert server.client(BETA_KEY).models.list().data[0].id == MODEL
    out = server.client(BETA_KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=8,
        extra_body={"spec_stats": True}, extra_headers={})
    assert out.model_extra["spec"]["route"] == "beta-small"
    rec = _wait_for_record(server, "beta", out.id)
    assert rec["tenant"] == "beta" and rec["route"] == "beta-small"
    assert all(r["tenant"] == "acme" for r in _logs(server, "acme"))
    assert out.id not in {r["request_id"] for r in _logs(server, "acme")}


def test_sessions_belong_to_their_tenant(server):
    acme, beta = ({"Authorization": f"Bearer {k}"} for k in (ACME_KEY, BETA_KEY))
    hi = [{"role": "user", "content": "Say hi."}]
    out = server.client(ACME_KEY).chat.completions.create(model=MODEL, messages=hi, temperature=0, max_tokens=2,
                                                          prompt_cache_key="loop-acme-1")
    assert _wait_for_record(server, "acme", out.id)["session"] == "loop-acme-1"
    # beta cannot see acme's session (404, as an id never made) nor take it: the same id is beta's own
    r = httpx.post(server.base + "/v1/chat/completions", headers=beta,
                   json={"messages": hi, "max_tokens": 2, "session": "loop-acme-1"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text
    assert httpx.get(server.base + "/v1/sessions/loop-acme-1", headers=beta).status_code == 404
    for url, body in (("/v1/chat/completions", {"messages": hi}),
                      ("/v1/apply", {"code": "x = 1\n", "update": "x = 2\n"})):
        r = httpx.post(server.base + url, headers=beta, json={**body, "max_tokens": 2, "prompt_cache_key": "loop-acme-1"})
        assert r.status_code == 200, (url, r.text)
        assert _wait_for_record(server, "beta", r.json()["id"])["session"] == "loop-acme-1"
    assert httpx.get(server.base + "/v1/sessions/loop-acme-1", headers=beta).json()["id"] == "loop-acme-1"
    assert {r["tenant"] for r in _logs(server, "acme")} == {"acme"}
    # `user` is OpenAI's end-user id, not a binding: beta's own "loop-acme-1" user is beta's business
    r = httpx.post(server.base + "/v1/completions", headers=beta, json={"prompt": "a", "max_tokens": 2,
                                                                       "user": "loop-acme-1"})
    assert r.status_code == 200, r.text
    assert _wait_for_record(server, "beta", r.json()["id"])["session"] == "loop-acme-1"
    # explicit sessions: created by POST /v1/sessions (or an earlier prompt_cache_key), else 404
    r = httpx.post(server.base + "/v1/sessions", headers=beta)
    assert r.status_code == 200, r.text
    sess = r.json()
    assert sess["object"] == "session" and sess["id"] and sess["created"] > 0
    assert httpx.get(server.base + f"/v1/sessions/{sess['id']}", headers=beta).json() == sess
    assert httpx.get(server.base + f"/v1/sessions/{sess['id']}", headers=acme).status_code == 404
    named = httpx.post(server.base + "/v1/sessions", headers=beta, json={"id": "beta-named"}).json()
    assert named["id"] == "beta-named"
    r = httpx.post(server.base + "/v1/completions", headers=beta,
                   json={"prompt": "a", "max_tokens": 2, "session": sess["id"]})
    assert r.status_code == 200, r.text
    assert _wait_for_record(server, "beta", r.json()["id"])["session"] == sess["id"]
    assert httpx.get(server.base + "/v1/sessions/loop-acme-1", headers=acme).json()["id"] == "loop-acme-1"
    for url, kw in (("/v1/sessions/never-made", {}), ("/v1/chat/completions", {"json": {"messages": hi, "session": "never-made"}})):
        r = (httpx.get(server.base + url, headers=acme) if not kw
             else httpx.post(server.base + url, headers=acme, **kw))
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["type"] == "not_found_error" and err["code"] == "session_not_found"
    assert err["param"] == "session"


def test_route_budget_past_one_forward_is_clamped_and_exact(server, engine, plain_greedy):
    """A route's budget of 1000 (the config allows up to 1024) is more than one forward verifies
    (128 rows): the request is clamped, says so in its log record, and stays exact, also next to
    other requests in the same batch."""
    c = server.client(BETA_KEY)
    prompt = CODE + "\n# The same code again:\n" + CODE[:200]
    want = plain_greedy(engine.tokenizer.encode(prompt), 64)
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda _: c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=64,
                                                            extra_body={"spec_stats": True}), range(3)))
    for out in outs:
        assert out.choices[0].text == want.text
        spec = out.model_extra["spec"]
        assert spec["enabled"] and spec["route"] == "beta-huge" and "clamped to 127" in spec["reason"]
        rec = _wait_for_record(server, "beta", out.id)
        assert "clamped to 127" in rec["spec_reason"] and rec["accepted_tokens"] > 0


def test_high_temperature_turns_speculation_off_by_route(server):
    c = server.client(ACME_KEY)
    out = c.chat.completions.create(model=MODEL, messages=rewrite_messages(), temperature=0.9, seed=7,
                                    max_tokens=16, extra_body={"spec_stats": True}, prompt_cache_key="sess-42")
    spec = out.model_extra["spec"]
    assert spec["enabled"] is False and spec["route"] == "creative"
    assert spec["reason"] == "route 'creative': speculation = false" and spec["draft_tokens"] == 0
    rec = _wait_for_record(server, "acme", out.id)
    assert rec["spec_enabled"] is False and rec["spec_reason"] == spec["reason"] and rec["route"] == "creative"
    assert rec["session"] == "sess-42" and rec["endpoint"] == "chat.completions"
    again = c.chat.completions.create(model=MODEL, messages=rewrite_messages(), temperature=0.9, seed=7, max_tokens=16)
    assert again.choices[0].message.content == out.choices[0].message.content  # seeded sampling repeats


def test_log_records_and_metrics(server):
    c = server.client(ACME_KEY)
    out = c.chat.completions.create(model=MODEL, messages=rewrite_messages(), temperature=0, max_tokens=60)
    rec = _wait_for_record(server, "acme", out.id)
    for key in ("ts", "request_id", "tenant", "route", "endpoint", "session", "prompt_tokens", "completion_tokens",
                "ttft_ms", "e2e_ms", "spec_enabled", "spec_reason", "steps", "draft_tokens", "accepted_tokens", "mat",
                "acceptance_per_pos", "draft_sources", "finish_reason"):
        assert key in rec, key
    # (where the answer ends depends on the CPU's kernels: the record says what the response said)
    assert rec["spec_enabled"] and rec["completion_tokens"] == out.usage.completion_tokens
    assert rec["finish_reason"] == out.choices[0].finish_reason
    assert 0 < rec["ttft_ms"] <= rec["e2e_ms"]
    assert sum(rec["accepted_per_pos"]) == rec["accepted_tokens"]
    # with tenants configured /metrics (it names them) needs a key, any tenant's
    for headers in ({}, {"Authorization": "Bearer sk-wrong-key-000"}):
        denied = httpx.get(server.base + "/metrics", headers=headers, timeout=60)
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        assert "acme" not in denied.text
    beta = httpx.get(server.base + "/metrics", headers={"Authorization": f"Bearer {BETA_KEY}"}, timeout=60)
    assert beta.status_code == 200
    r = httpx.get(server.base + "/metrics", headers={"Authorization": f"Bearer {ACME_KEY}"}, timeout=60)
    assert r.status_code == 200
    text = r.text
    for name in ("agentspec:spec_decode_num_drafts_total", "agentspec:spec_decode_num_draft_tokens_total",
                 "agentspec:spec_decode_num_accepted_tokens_total",
                 "agentspec:spec_decode_num_accepted_tokens_per_pos_total", "agentspec:e2e_request_latency_seconds"):
        assert name in text, name
    assert 'tenant="acme"' in text
    assert "_created" not in text   # no timestamp twin per series
    line = next(x for x in text.splitlines() if x.startswith('agentspec:spec_decode_num_accepted_tokens_total{tenant="acme"}'))
    assert float(line.split()[-1]) > 0


def test_stats_cli_table_json_and_plot(server, tmp_path):
    png = tmp_path / "acc.png"
    stats = [sys.executable, "-m", "agentspec", "stats", "--log-dir", str(server.cwd / "logs")]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # both at once
             for args in ([*stats, "--plot", str(png)], [*stats, "--tenant", "beta", "--json"])]
    try:
        (r_out, r_err), (j_out, _) = (p.communicate(timeout=60) for p in procs)
    finally:
        for p in procs:
            if p.returncode is None:  # not waited for (a timeout above): end it, close its pipes
                p.kill()
                p.communicate()
    assert procs[0].returncode == 0, r_err
    assert "acme" in r_out and "creative" in r_out and "default" in r_out
    assert png.stat().st_size > 1000
    data = json.loads(j_out)
    assert data["records"] >= 1 and {t["tenant"] for t in data["tenants"]} == {"beta"}


BAD_BODIES = [
    (b"{", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"messages": []}', 400, "messages"),
    (b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": -1}', 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": "3"}', 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "a"}], "max_token": 3}', 400, "max_token"),
    # the bundled model's chat template renders no tools: refused by name
    (b'{"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {"name": "f"}}]}',
     400, "tools"),
    (b'{"messages": [{"role": "user", "content": "a"}], "functions": []}', 400, "functions"),
    (b'{"messages": [{"role": "user", "content": "a"}], "temperature": 9}', 400, "temperature"),
    (b'{"messages": [{"role": "user", "content": "a"}], "n": 2}', 400, "n"),
    (b'{"messages": [{"role": "wizard", "content": "a"}]}', 400, "messages"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    (b'{"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"}', 400, "tool_choice"),
    (b"", 400, None),
]


@pytest.mark.parametrize("body,status,param", BAD_BODIES)
def test_bad_requests_get_openai_errors(server, body, status, param):
    r = httpx.post(server.base + "/v1/chat/completions", content=body,
                   headers={"Authorization": f"Bearer {ACME_KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param


def test_oversize_body_unknown_route_and_bad_completions(server):
    h = {"Authorization": f"Bearer {ACME_KEY}"}
    big = httpx.post(server.base + "/v1/completions", headers=h, content=b'{"prompt": "' + b"a" * (9 << 20) + b'"}')
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server.base + "/v1/nothing").status_code == 404
    assert httpx.get(server.base + "/v1/chat/completions").status_code == 405
    for body, param in (({"prompt": ""}, "prompt"), ({"prompt": [10**9]}, "prompt"), ({"prompt": "a", "echo": True}, "echo"),
                        ({"prompt": ["a", "b"]}, "prompt"), ({}, None)):
        r = httpx.post(server.base + "/v1/completions", headers=h, json=body)
        assert r.status_code == 400, (body, r.text)
        assert param is None or r.json()["error"]["param"] == param


def test_fuzzed_bodies_never_500(server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False, width=32),
                        st.text(max_size=5))
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                          max_leaves=6)
    keys = st.sampled_from(["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "stop", "stream",
                            "prediction", "n", "seed", "code", "path", "update", "instruction", "stream_options",
                            "speculation", "spec_stats", "zzz"])
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                     "content": st.one_of(st.text(max_size=8), values)})
    bodies = st.dictionaries(keys, st.one_of(values, st.lists(message, max_size=2)), max_size=6)
    h = {"Authorization": f"Bearer {ACME_KEY}"}

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=bodies, endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/apply"]))
    def check(body, endpoint):
        if isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = min(body["max_tokens"], 2)
        body.setdefault("max_tokens", 2)
        body["stream"] = False
        r = httpx.post(server.base + endpoint, headers=h, json=body, timeout=60)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    check()


def test_concurrent_clients_and_disconnect_cancels(server):
    c = server.client(ACME_KEY)
    prompts = [f"Count from {i} to {i + 5}." for i in range(4)]
    want = [c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], temperature=0,
                                      max_tokens=20).choices[0].message.content for p in prompts]
    got: dict[int, str] = {}

    def run(i):
        got[i] = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[i]}],
                                           temperature=0, max_tokens=20).choices[0].message.content

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(4)] == want

    # a streaming client that goes away: its generation stops and is logged as cancelled
    h = {"Authorization": f"Bearer {ACME_KEY}"}
    with httpx.stream("POST", server.base + "/v1/chat/completions", headers=h, timeout=60,
                      json={"messages": rewrite_messages(), "temperature": 0, "max_tokens": 2000,
                            "stream": True, "speculation": False}) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
    rid = json.loads(first[6:])["id"]
    rec = _wait_for_record(server, "acme", rid, timeout=60)
    assert rec["finish_reason"] == "cancelled" and rec["completion_tokens"] < 2000
    quick = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
                                      max_tokens=2)
    assert quick.usage.completion_tokens >= 1


def test_a_non_streamed_client_that_leaves_cancels_its_generation(server):
    """A non-streamed request whose client closes the connection mid-generation stops at the
    next decode step: tokens arriving faster than any idle check must not hide the disconnect."""
    import re
    import socket

    h = {"Authorization": f"Bearer {ACME_KEY}"}
    before = {r["request_id"] for r in _logs(server, "acme")}
    body = json.dumps({"messages": rewrite_messages(), "temperature": 0, "max_tokens": 2000,
                       "speculation": False}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Authorization: Bearer {ACME_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    running = re.compile(r'agentspec:num_requests_running\{tenant="acme"\} 1\.0')
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 60
        while not running.search(httpx.get(server.base + "/metrics", headers=h, timeout=60).text):
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    deadline = time.monotonic() + 120
    while not (new := [r for r in _logs(server, "acme") if r["request_id"] not in before]):
        assert time.monotonic() < deadline, "no record for the abandoned request"
        time.sleep(0.1)
    assert new[0]["finish_reason"] == "cancelled" and new[0]["completion_tokens"] < 2000, new[0]


@pytest.mark.extended
def test_default_server_without_config_and_sigkill(tmp_path):
    """No config: tenant "default", no key on loopback, workspace = --repo. A SIGKILL mid-stream
    leaves logs that still parse."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "mathutil.py").write_text(CODE)
    s = Server(tmp_path, config=None, repo=repo, name="default")
    try:
        c = s.client()
        out = c.chat.completions.create(model=MODEL, messages=rewrite_messages(), temperature=0, max_tokens=30,
                                        extra_body={"spec_stats": True})
        assert out.model_extra["spec"]["enabled"] and out.usage.completion_tokens == 30
        r = httpx.post(s.base + "/v1/apply", json={"path": "mathutil.py", "update": "# x", "max_tokens": 4},
                       timeout=120)
        assert r.status_code == 200, r.text
        m = httpx.get(s.base + "/metrics", timeout=60)   # no keys configured: no key needed here either
        assert m.status_code == 200 and 'tenant="default"' in m.text and "_created" not in m.text
        with httpx.stream("POST", s.base + "/v1/chat/completions", timeout=60,
                          json={"messages": rewrite_messages(), "temperature": 0, "max_tokens": 200,
                                "stream": True}) as st:
            for line in st.iter_lines():
                if line.startswith("data: {"):
                    s.proc.kill()  # SIGKILL mid-stream
                    break
        s.proc.wait(10)
    finally:
        s.stop()
    from agentspec.telemetry import ReadReport, read_records

    report = ReadReport()
    records = list(read_records(tmp_path / "logs", report=report))
    assert {r.tenant for r in records} == {"default"}
    assert [r.finish_reason for r in records][:2] == ["length", "length"]
    assert report.skipped == 0


@pytest.fixture(scope="module")
def timeout_server(tmp_path_factory):
    """A server whose request timeout no request can meet (1 ms: less than one forward of the
    model, let alone the 200 tokens each request below asks for): it always fires."""
    root = tmp_path_factory.mktemp("timeout")
    s = Server(root, config='[server]\nrequest_timeout_s = 0.001\n', name="timeout")
    yield s
    s.stop()


TIMEOUT_CHAT = {"messages": rewrite_messages(), "temperature": 0, "max_tokens": 200, "speculation": False}


@pytest.mark.extended
def test_request_timeout_is_a_504_and_logged(timeout_server):
    s = timeout_server
    slow = httpx.post(s.base + "/v1/chat/completions", timeout=120, json=TIMEOUT_CHAT)
    assert slow.status_code == 504, slow.text
    assert slow.json()["error"]["code"] == "timeout"
    slow = httpx.post(s.base + "/v1/completions", timeout=120,
                      json={"prompt": "1, 2, 3, 4, 5,", "temperature": 0, "max_tokens": 200})
    assert slow.status_code == 504 and slow.json()["error"]["code"] == "timeout", slow.text
    from agentspec.telemetry import ReadReport, read_records

    report = ReadReport()
    for _ in range(300):  # a hang guard: the records may be written just after the responses
        records = list(read_records(s.cwd / "logs", report=ReadReport()))
        if len(records) >= 2:
            break
        time.sleep(0.1)
    records = list(read_records(s.cwd / "logs", report=report))
    assert [(r.endpoint, r.finish_reason) for r in records] == [("chat.completions", "timeout"),
                                                                ("completions", "timeout")]
    assert report.skipped == 0


def test_streamed_request_timeout_ends_with_a_timeout_error(timeout_server):
    s = timeout_server
    with httpx.stream("POST", s.base + "/v1/chat/completions", timeout=120,
                      json={**TIMEOUT_CHAT, "stream": True}) as st:
        events = [json.loads(line[6:]) for line in st.iter_lines() if line.startswith("data: {")]
    assert events[-1].get("error", {}).get("code") == "timeout", events[-1]
    assert all(ch["finish_reason"] is None for e in events[:-1] for ch in e.get("choices", []))


# ---- refused request fields (nothing accepted and ignored) --------------------------------------------

def test_unimplemented_fields_are_refused_by_name(server):
    h = {"Authorization": f"Bearer {ACME_KEY}"}
    msgs = [{"role": "user", "content": "a"}]
    cases = [
        ("/v1/chat/completions", {"messages": msgs, "stream": True,
                                  "stream_options": {"continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats", "unsupported_parameter"),
        ("/v1/chat/completions", {"messages": msgs, "stream_options": {"include_usage": True}},
         "stream_options", "invalid_value"),
        ("/v1/completions", {"prompt": "a", "stream": False, "stream_options": {"include_usage": True}},
         "stream_options", "invalid_value"),
        ("/v1/chat/completions", {"messages": msgs, "top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
        ("/v1/completions", {"prompt": "a", "logprobs": 0}, "logprobs", "unsupported_parameter"),
    ]
    for path, body, param, code in cases:
        r = httpx.post(server.base + path, headers=h, json={**body, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), r.text
    # what they may be instead is taken
    ok = httpx.post(server.base + "/v1/chat/completions", headers=h, timeout=60,
                    json={"messages": [*msgs, {"role": "assistant", "content": "b", "name": "bot"}], "max_tokens": 2,
                          "temperature": 0, "top_logprobs": 0, "logprobs": False, "stream_options": None})
    assert ok.status_code == 200, ok.text


def test_a_prediction_past_the_context_window_is_a_400(server):
    """Refused before its tokens reach the backend (the index, per-token checks, the usage diff):
    by its length in characters past 32 per token, else by its token count."""
    h = {"Authorization": f"Bearer {ACME_KEY}"}
    ctx = httpx.get(server.base + "/v1/models", headers=h, timeout=60).json()["data"][0]["max_model_len"]
    import re

    for content, size in (("x" * (32 * ctx + 1), f"prediction of {32 * ctx + 1} characters"),
                          (" 7" * (ctx + 50), r"prediction of \d+ tokens")):
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
                           ("/v1/completions", {"prompt": "a"})):
            r = httpx.post(server.base + path, headers=h, timeout=60,
                           json={**body, "max_tokens": 2, "prediction": {"type": "content", "content": content}})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["param"], err["code"]) == ("prediction", "context_length_exceeded"), err
            assert re.match(size, err["message"]) and f"window of {ctx} tokens" in err["message"], err


def test_a_temperature_near_zero_is_greedy(server):
    """1e-320 would divide the logits to inf (NaN probabilities): below 1e-5 it is greedy."""
    c = server.client(ACME_KEY)
    msgs = [{"role": "user", "content": "Count from 1 to 5."}]
    greedy = c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=12)
    tiny = c.chat.completions.create(model=MODEL, messages=msgs, temperature=1e-320, max_tokens=12,
                                     extra_body={"spec_stats": True})
    assert tiny.choices[0].message.content == greedy.choices[0].message.content
    assert tiny.usage.completion_tokens == greedy.usage.completion_tokens


# ---- queued requests end while they wait ----------------------------------------------------------------

@pytest.fixture(scope="module")
def one_slot_server(tmp_path_factory):
    """One request decodes at a time (max_batch = 1) and one may wait (max_queue = 1)."""
    root = tmp_path_factory.mktemp("one_slot")
    s = Server(root, config="[server]\nmax_batch = 1\nmax_queue = 1\n", name="one_slot")
    yield s
    s.stop()


# a completion that goes on counting: it holds the one batch slot until it is cancelled
LONG_COUNT = {"prompt": "1, 2, 3, 4, 5, 6,", "temperature": 0, "max_tokens": 1500, "speculation": False}


def _until(cond, what: str, timeout: float = 120) -> None:
    """Poll ``cond`` (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_queued_request_whose_client_leaves_ends_while_the_batch_is_full(one_slot_server):
    """A queued request's disconnect ends it at the next decode step, not when a batch slot
    frees: its queue place is free again while the running request still decodes."""
    import socket

    s = one_slot_server

    def health() -> dict:
        return httpx.get(s.base + "/health", timeout=60).json()

    with httpx.stream("POST", s.base + "/v1/completions", json={**LONG_COUNT, "stream": True}, timeout=120) as long:
        lines = long.iter_lines()   # kept: a closed line iterator closes the response (a disconnect)
        first = next(line for line in lines if line.startswith("data: {"))
        long_id = json.loads(first[6:])["id"]
        body = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{s.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", s.port), timeout=60) as sock:
            sock.sendall(head + body)
            _until(lambda: health()["waiting"] == 1, "the second request never queued")
        _until(lambda: health()["waiting"] == 0, "the abandoned request kept its queue place")
        _until(lambda: any(r["request_id"] != long_id for r in _logs(s, "default")), "no record for it")
        queued = [r for r in _logs(s, "default") if r["request_id"] != long_id]
        assert [(r["finish_reason"], r["completion_tokens"]) for r in queued] == [("cancelled", 0)], queued
        assert health()["running"] == 1 and not any(r["request_id"] == long_id for r in _logs(s, "default"))
    _until(lambda: any(r["request_id"] == long_id for r in _logs(s, "default")), "no record for the long one")
    rec = next(r for r in _logs(s, "default") if r["request_id"] == long_id)
    assert rec["finish_reason"] == "cancelled" and rec["completion_tokens"] < LONG_COUNT["max_tokens"], rec


def test_a_queued_request_gets_its_504_at_its_deadline_while_the_batch_is_full(engine, tmp_path):
    """The server's handling on the real engine, one batch slot: a queued request whose deadline
    passes gets its 504 then, while the request in the slot still decodes (not after it ends).
    (Over HTTP every request has the same ``request_timeout_s``, so a queued one never expires
    before the one ahead of it; ``handling.submit``'s deadline is the per-request one.)"""
    import queue

    import msgspec

    from agentspec.api import handling
    from agentspec.api.protocol import APIError
    from agentspec.api.state import build_state
    from agentspec.config import ServerConfig

    config = msgspec.convert({"server": {"log_dir": str(tmp_path / "logs")}}, ServerConfig)
    state = build_state(config, engine=engine, max_batch=1, quiet=True, watch=False)
    try:
        tenant = state.tenants["default"]
        long = handling.prepare(state, "/v1/completions", tenant, json.dumps({**LONG_COUNT, "stream": True}).encode())
        long_events: queue.Queue = queue.Queue()
        long_job = handling.submit(state, long.call, lambda kind, value: long_events.put((kind, value)))
        assert long_events.get(timeout=120)[0] == "tokens"   # decoding: it holds the one slot
        short = handling.prepare(state, "/v1/completions", tenant,
                                 json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode())
        events: queue.Queue = queue.Queue()
        job = handling.submit(state, short.call, lambda kind, value: events.put((kind, value)),
                              deadline=time.monotonic() + 0.2)
        kind, value = events.get(timeout=120)
        with pytest.raises(APIError) as info:
            handling.outcome(job, kind, value)
        assert (info.value.status, info.value.code) == (504, "timeout")
        seen = []
        while not long_events.empty():
            seen.append(long_events.get()[0])
        assert "done" not in seen and state.backend.health()["running"] == 1   # the long one still decodes
        long_job.cancel()
        while (end := long_events.get(timeout=120))[0] == "tokens":
            pass
        assert end[0] == "done" and end[1].finish_reason == "cancelled", end
    finally:
        state.close()
    from agentspec.telemetry import read_records

    records = {r.request_id: r for r in read_records(tmp_path / "logs")}
    assert records[short.call.request_id].finish_reason == "timeout"
    assert records[long.call.request_id].finish_reason == "cancelled"
