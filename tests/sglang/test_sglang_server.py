"""``agentspec serve --backend sglang`` as users reach it, and ``SGLangBackend`` over a fake engine.

The fast tests drive ``SGLangBackend`` with a stand-in for ``sglang.Engine`` that streams the way
SGLang 0.5.23 does (cumulative ``output_ids``, a ``finish_reason`` dict at the end, EOS left at
the end of the output, aborts through the generator's cleanup). The slow ones start ONE real
server subprocess on loopback (an SGLang engine takes ~80-100 s to start on a 2-core CPU) and
check it with the real ``openai`` client and raw HTTP: what ``tests/integration/test_server.py``
checks of the embedded server that does not depend on the embedded engine.

Environment: ``AGENTSPEC_SGLANG_MODEL`` (default ``.venv-sglang/models/SmolLM2-135M-Instruct``),
``AGENTSPEC_TEST_SGLANG_SPECULATIVE`` (default ``agentspec`` when the plugin is importable, else
``ngram``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers.sglang import require_sglang

require_sglang()   # before anything that imports SGLang

ROOT = Path(__file__).resolve().parents[2]
from helpers.serve import CODE, Server, rewrite_messages  # noqa: E402

MODEL_DIR = Path(os.environ.get("AGENTSPEC_SGLANG_MODEL", ROOT / ".venv-sglang" / "models" / "SmolLM2-135M-Instruct"))
MODEL = MODEL_DIR.name
ACME_KEY = "sk-acme-0123456789"
BETA_KEY = "sk-beta-0123456789"


def _default_speculative() -> str:
    try:
        plugin = importlib.util.find_spec("agentspec.integrations.sglang.plugin") is not None
    except (ImportError, ValueError):
        plugin = False
    return "agentspec" if plugin else "ngram"


SPECULATIVE = os.environ.get("AGENTSPEC_TEST_SGLANG_SPECULATIVE") or _default_speculative()

needs_model = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(),
                                 reason=f"no converted model folder at {MODEL_DIR} (scripts/setup_sglang.sh)")



# ---- SGLangBackend over a stand-in engine (fast) -----------------------------------------------------

class _FakeTokenizerManager:
    context_len = 8192
    max_req_input_len = 4091

    def __init__(self) -> None:
        self.aborted: list[str] = []


class _FakeEngine:
    """Streams ``script``: a list of (new token ids, finish_reason, extra meta_info) per chunk,
    with cumulative ``output_ids`` (one list shared by the intermediate chunks, as SGLang does)."""

    def __init__(self, script, *, fail: Exception | None = None) -> None:
        self.script = script
        self.fail = fail
        self.tokenizer_manager = _FakeTokenizerManager()
        self.server_args = type("SA", (), {"incremental_streaming_output": False, "max_running_requests": 4})()
        self.calls: list[tuple] = []
        self.shut = False

    async def async_generate(self, *, input_ids, sampling_params, stream, rid, cache_salt=None):
        assert stream is True
        self.calls.append((input_ids, sampling_params, rid))
        script, fail, tm = self.script, self.fail, self.tokenizer_manager

        async def gen():
            acc: list[int] = []
            try:
                if fail is not None:
                    raise fail
                for new, finish, meta in script:
                    await asyncio.sleep(0.005)
                    acc.extend(new)
                    yield {"text": None, "output_ids": acc if finish is None else list(acc),
                           "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": len(input_ids), **meta}}
            except BaseException:
                tm.aborted.append(rid)   # SGLang's generator aborts the request on the way out
                raise

        return gen()

    def shutdown(self) -> None:
        self.shut = True


def _backend(script=(), **kw):
    from agentspec.integrations.sglang.backend import SGLangBackend

    fail = kw.pop("fail", None)
    kw.setdefault("speculative", "agentspec")
    return SGLangBackend(MODEL_DIR, engine=_FakeEngine(list(script), fail=fail), **kw)


def _run(backend, request, *, should_stop=None, cancel_after: float | None = None):
    chunks, result, done = [], {}, threading.Event()
    rid = backend.submit(request, on_tokens=chunks.append, should_stop=should_stop,
                         on_done=lambda g, e: (result.update(g=g, e=e), done.set()))
    if cancel_after is not None:
        time.sleep(cancel_after)
        assert backend.cancel(rid)
    assert done.wait(10)
    return rid, chunks, result["g"], result["e"]


@needs_model
def test_stream_tokens_eos_and_spec_stats():
    from agentspec.backends.protocol import GenerationRequest

    b = _backend()
    tok = b.tokenizer
    text = tok.encode("Hello world, this is a test")
    eos = min(tok.eos_token_ids)
    meta = {"completion_tokens": len(text) + 1, "spec_verify_ct": 3, "spec_num_correct_drafts": 4,
            "spec_num_proposed_drafts": 21, "spec_accept_length": 2.33, "spec_correct_drafts_histogram": [1, 1, 1]}
    b.engine.script = [(text[:2], None, {}), (text[2:5], None, {}),
                       (text[5:] + [eos], {"type": "stop", "matched": eos}, meta)]
    try:
        req = GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=20, tenant="acme")
        rid, chunks, gen, err = _run(b, req)
        assert err is None
        assert chunks == [text[:2], text[2:5], text[5:]]      # new tokens per chunk, no EOS
        assert gen.token_ids == text and gen.text == "Hello world, this is a test" and gen.finish_reason == "stop"
        s = gen.stats
        assert (s.prompt_tokens, s.completion_tokens, s.steps, s.accepted_tokens, s.draft_tokens) == (3, len(text), 3, 4, 21)
        assert s.spec_enabled and s.mean_acceptance_length == pytest.approx(2.33) and s.acceptance_lengths == [1, 2, 3]
        assert b.spec_meta(rid)["spec_verify_ct"] == 3
        _, sp, sent_rid = b.engine.calls[-1]
        assert sent_rid == rid
        assert sp["max_new_tokens"] == 20 and sp["top_k"] == -1 and sorted(sp["stop_token_ids"]) == sorted(tok.eos_token_ids)
        assert sp["custom_params"] == {"agentspec_tenant": "acme", "agentspec_spec": True, "agentspec_budget": 32,
                                       "agentspec_greedy": True}
    finally:
        b.close()
    assert b.engine.shut and b.health()["status"] == "closed"


@needs_model
def test_stop_string_length_spec_off_and_prediction():
    from agentspec.backends.protocol import GenerationRequest, collect

    b = _backend()
    text = b.tokenizer.encode("Hello world, this is")
    try:
        b.engine.script = [(text, {"type": "stop", "matched": " world"}, {})]
        g = collect(b.stream(GenerationRequest(prompt_ids=[1], max_tokens=9, stop=[" world"], spec=None,
                                               prediction_ids=[5, 6])))
        assert g.text == "Hello" and g.token_ids == text and g.finish_reason == "stop"   # as the embedded backend
        assert not g.stats.spec_enabled and g.stats.draft_tokens == 0
        sp = b.engine.calls[-1][1]
        assert sp["stop"] == [" world"] and sp["custom_params"]["agentspec_spec"] is False
        assert sp["custom_params"]["agentspec_prediction"] == [5, 6]
        b.engine.script = [(text[:2], None, {}), (text[2:], {"type": "length", "length": len(text)}, {})]
        g = collect(b.stream(GenerationRequest(prompt_ids=[1], max_tokens=len(text), temperature=0.5, top_k=7, seed=3)))
        assert g.finish_reason == "length" and g.token_ids == text and g.stats.seed == 3
        sp = b.engine.calls[-1][1]
        assert (sp["temperature"], sp["top_k"], sp["sampling_seed"]) == (0.5, 7, 3)
    finally:
        b.close()


@needs_model
def test_cancel_should_stop_errors_and_close():
    from agentspec.backends.protocol import GenerationRequest
    from agentspec.errors import BackendClosedError, InvalidRequestError

    slow = [([5], None, {})] * 400 + [([6], {"type": "length", "length": 401}, {})]
    b = _backend(slow, speculative=None)
    try:
        flag: list[int] = []
        done, res = threading.Event(), {}
        rid = b.submit(GenerationRequest(prompt_ids=[1], max_tokens=500), on_tokens=lambda t: None,
                       should_stop=lambda: bool(flag), on_done=lambda g, e: (res.update(g=g, e=e), done.set()))
        time.sleep(0.2)
        flag.append(1)
        assert done.wait(10) and res["e"] is None
        g = res["g"]
        assert g.finish_reason == "cancelled" and 0 < g.stats.completion_tokens < 401
        assert b.engine.tokenizer_manager.aborted == [rid]          # SGLang was told to abort
        rid, _, g, err = _run(b, GenerationRequest(prompt_ids=[1], max_tokens=500), cancel_after=0.1)
        assert g.finish_reason == "cancelled" and b.cancel(rid) is False
        # SGLang's own refusals and aborts
        b.engine.fail = ValueError("The input (5000 tokens) is longer than the model's context length")
        _, _, g, err = _run(b, GenerationRequest(prompt_ids=[1], max_tokens=5))
        assert g is None and isinstance(err, InvalidRequestError)
        b.engine.fail = None
        b.engine.script = [([5], {"type": "abort", "message": "out of memory", "status_code": 500}, {})]
        _, _, g, err = _run(b, GenerationRequest(prompt_ids=[1], max_tokens=5))
        assert g is None and "out of memory" in str(err)
        # close(): a running request ends, run() returns, later submits are refused
        b.engine.script = slow
        done.clear()
        res.clear()
        b.submit(GenerationRequest(prompt_ids=[1], max_tokens=500), on_tokens=lambda t: None,
                 on_done=lambda g, e: (res.update(g=g, e=e), done.set()))
        runner = threading.Thread(target=b.run)
        runner.start()
        time.sleep(0.2)
    finally:
        b.close()
    runner.join(10)
    assert not runner.is_alive() and done.is_set() and res["g"].finish_reason == "cancelled"
    with pytest.raises(BackendClosedError):
        b.submit(GenerationRequest(prompt_ids=[1], max_tokens=5), on_tokens=print, on_done=print)


@needs_model
@pytest.mark.parametrize("fields,param", [
    (dict(prompt_ids=[], max_tokens=3), "prompt"),
    (dict(prompt_ids=[10**7], max_tokens=3), "prompt"),
    (dict(prompt_ids=[True], max_tokens=3), "prompt"),
    (dict(prompt_ids=[1], max_tokens=0), "max_tokens"),
    (dict(prompt_ids=[1], max_tokens=5000), "max_tokens"),
    (dict(prompt_ids=[1] * 4095, max_tokens=1), "prompt"),
    (dict(prompt_ids=[1], max_tokens=3, temperature=-1.0), "temperature"),
    (dict(prompt_ids=[1], max_tokens=3, top_p=0.0), "top_p"),
    (dict(prompt_ids=[1], max_tokens=3, stop=[""]), "stop"),
    (dict(prompt_ids=[1], max_tokens=3, prediction_ids=[-1]), "prediction_ids"),
    (dict(prompt_ids=[1], max_tokens=3, drafters=("nope",)), "drafters"),
])
def test_bad_requests_raise_at_submit(fields, param):
    from agentspec.backends.protocol import GenerationRequest
    from agentspec.errors import InvalidRequestError

    b = _backend()
    try:
        with pytest.raises(InvalidRequestError) as e:
            b.submit(GenerationRequest(**fields), on_tokens=print, on_done=print)
        assert e.value.param == param
        assert b.engine.calls == []
    finally:
        b.close()


@needs_model
def test_encode_chat_context_and_stats():
    from agentspec.errors import InvalidRequestError

    b = _backend(speculative="ngram", tp_size=1)
    try:
        ids = b.encode_chat([{"role": "user", "content": "Hi"}])
        assert b.tokenizer.decode(ids).startswith("<|im_start|>") and ids == b.encode_chat(({"role": "user",
                                                                                           "content": "Hi"},))
        for bad in ([], "hi", [{"role": "user"}]):
            with pytest.raises(InvalidRequestError):
                b.encode_chat(bad)
        assert b.index is None and b.max_context == 4091 + 4 and b.model_name == MODEL
        s = b.stats()
        assert s["backend"] == "sglang" and s["speculative_algorithm"] == "NGRAM" and s["tp_size"] == 1
        assert b.health() == {"status": "ok", "running": 0, "waiting": 0}
    finally:
        b.close()


def test_route_drafters_against_the_algorithm(tmp_path):
    from agentspec.integrations.sglang.backend import check_route_drafters
    from agentspec.errors import ConfigError
    from agentspec.server import build_state

    check_route_drafters("agentspec", {"route 'a'": ["suffix"]})
    check_route_drafters("eagle3", {"route 'a'": ["eagle3"]})
    check_route_drafters("ngram", {"route 'a'": ["suffix", "prompt_lookup"]})   # baselines ignore them
    check_route_drafters(None, {"route 'a'": ["eagle3"]})
    with pytest.raises(ConfigError, match="route 'a'.*'eagle3'.*--speculative eagle3"):
        check_route_drafters("agentspec", {"route 'a'": ["suffix", "eagle3"]})
    with pytest.raises(ConfigError, match="'lookahead'"):
        check_route_drafters("eagle3", {"route 'a'": ["lookahead>eagle3"]})
    cfg = tmp_path / "s.toml"
    cfg.write_text('[[routes]]\nname = "heads"\ndrafters = ["suffix", "eagle3"]\n')
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="route 'heads'"):   # before any engine starts
        build_state(cfg, backend="sglang", sglang_options={"model": str(model)}, quiet=True)
    with pytest.raises(ConfigError, match="needs a model"):
        build_state(cfg, backend="sglang", quiet=True)


def test_cli_flags_for_the_backends(tmp_path):
    from agentspec.cli import _sglang_arg

    assert _sglang_arg("mem-fraction-static=0.3") == ("mem_fraction_static", 0.3)
    assert _sglang_arg("max_total_tokens=4096") == ("max_total_tokens", 4096)
    assert _sglang_arg("disable_radix_cache=true") == ("disable_radix_cache", True)
    assert _sglang_arg("attention_backend=intel_amx") == ("attention_backend", "intel_amx")
    assert _sglang_arg("json_model_override_args={\"a\": 1}") == ("json_model_override_args", {"a": 1})

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "agentspec", "serve", "--port", "1", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)

    for args, message in ((["--tp", "2"], "--tp needs --backend sglang"),
                          (["--speculative", "ngram"], "--speculative needs --backend sglang"),
                          (["--backend", "sglang"], "needs --model"),
                          (["--backend", "sglang", "--model", str(MODEL_DIR), "--threads", "2"], "--threads is an option"),
                          (["--backend", "sglang", "--model", str(MODEL_DIR), "--kv-dtype", "bfloat16"],
                           "--kv-dtype is an option"),
                          (["--backend", "sglang", "--model", str(MODEL_DIR), "--speculative", "eagle3"], "--eagle3 DIR"),
                          (["--backend", "sglang", "--sglang-arg", "tp_size=2"], "use --tp"),
                          (["--backend", "sglang", "--sglang-arg", "nonsense"], "KEY=VALUE"),
                          (["--backend", "sglang", "--model", str(MODEL_DIR), "--draft-tokens", "1"], ">= 2")):
        r = serve(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr, (args, r.stderr)


# ---- one real server (slow) -------------------------------------------------------------------------------

def _engine_args() -> list[str]:
    args = ["--backend", "sglang", "--model", str(MODEL_DIR), "--speculative", SPECULATIVE]
    if SPECULATIVE != "none":
        args += ["--draft-tokens", "8"]
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:   # SGLang on this CPU (see scripts/setup_sglang.sh)
        args += ["--device", "cpu"]   # float32: the backend's CPU default
        for kv in ("attention_backend=intel_amx", "max_total_tokens=4096", "max_running_requests=4",
                   "mem_fraction_static=0.3"):
            args += ["--sglang-arg", kv]
    return args


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_server")
    a, b = root / "repo_a", root / "repo_b"
    a.mkdir()
    b.mkdir()
    (a / "mathutil.py").write_text(CODE)
    (b / "other.py").write_text("print('beta')\n")
    return root, a, b


@pytest.fixture(scope="module")
def server(workspaces):
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"no converted model folder at {MODEL_DIR} (scripts/setup_sglang.sh)")
    root, a, b = workspaces
    config = f"""
[server]
log_dir = "logs"
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
name = "beta-small"
when = {{ tenant = "beta" }}
budget = 8
"""
    # the server's SGLang processes run compiled kernels, not Triton's interpreter (tests/sglang/conftest.py
    # sets TRITON_INTERPRET=1 for this test process only)
    s = Server(root, config=config, name="sglang", args=_engine_args(), env={"TRITON_INTERPRET": "0"}, timeout=900)
    yield s
    s.stop()


def _logs(server: Server, tenant: str) -> list[dict]:
    path = server.cwd / "logs" / f"{tenant}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait_for_record(server: Server, tenant: str, request_id: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in _logs(server, tenant):
            if r["request_id"] == request_id:
                return r
        time.sleep(0.1)
    raise AssertionError(f"no log record for {request_id} in {tenant}.jsonl")


@pytest.mark.slow
def test_models_health_and_start_up_line(server):
    assert server.client(ACME_KEY).models.list().data[0].id == MODEL
    card = httpx.get(server.base + f"/v1/models/{MODEL}", headers={"Authorization": f"Bearer {ACME_KEY}"}).json()
    assert card["id"] == MODEL and card["max_model_len"] > 1000
    h = httpx.get(server.base + "/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL
    server.stderr.seek(0)
    log = server.stderr.read()
    assert f"serving '{MODEL}'" in log and "ready in" in log, log[-2000:]


@pytest.mark.slow
def test_chat_stream_equals_non_stream(server):
    c = server.client(ACME_KEY)
    msgs = rewrite_messages()
    full = c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=48,
                                     extra_body={"spec_stats": True})
    assert full.choices[0].message.content and full.usage.completion_tokens > 0
    assert full.choices[0].finish_reason in ("stop", "length")
    s = full.model_extra["spec"]
    assert s["route"] == "default" and s["enabled"] == (SPECULATIVE != "none") and s["steps"] > 0
    if SPECULATIVE != "none":
        assert 0 < s["steps"] <= full.usage.completion_tokens and s["mean_acceptance_length"] >= 1.0
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=48, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    off = c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=8,
                                    extra_body={"spec_stats": True, "speculation": False})
    assert off.model_extra["spec"]["reason"] == "request: speculation = false"
    if SPECULATIVE in ("agentspec", "none"):   # NGRAM / EAGLE3 cannot be turned off per request
        assert off.model_extra["spec"]["enabled"] is False


@pytest.mark.slow
def test_completions_raw_prompt_stop_and_stream(server):
    c = server.client(ACME_KEY)
    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
    full = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24)
    text = full.choices[0].text
    assert full.choices[0].finish_reason in ("length", "stop") and full.usage.completion_tokens > 0
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=24, stream=True))
    assert streamed == text
    # speculation off gives the same text (float32 on this CPU: SGLang's bf16 verify forward is not
    # row-invariant, so there greedy output would depend on the drafts, NGRAM's as much as ours)
    off = {"speculation": False}
    plain = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24,
                                 extra_body=off).choices[0].text
    assert plain == text
    stop = text.strip()[:6]
    assert stop
    cut = c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24, stop=[stop],
                               extra_body={"spec_stats": True})
    assert cut.choices[0].finish_reason == "stop", (text, stop, cut.choices[0].text, cut.model_extra["spec"])
    assert cut.choices[0].text == text[:text.find(stop)]
    cut_streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=24, stop=[stop], stream=True))
    assert cut_streamed == cut.choices[0].text
    ids = c.completions.create(model=MODEL, prompt=[1, 2, 3, 4], temperature=0, max_tokens=3)
    assert ids.usage.prompt_tokens == 4


@pytest.mark.slow
def test_apply_code_path_and_tenant_isolation(server, workspaces):
    _, a, b = workspaces
    h = {"Authorization": f"Bearer {ACME_KEY}"}
    update = "def factorial(n):\n    # iterative\n    ..."
    r = httpx.post(server.base + "/v1/apply", headers=h, timeout=300,
                   json={"code": CODE, "update": update, "max_tokens": 40})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["merged_code"] and body["usage"]["completion_tokens"] > 0
    d = body["usage"]["completion_tokens_details"]
    assert set(d) == {"accepted_prediction_tokens", "rejected_prediction_tokens"}
    assert d["accepted_prediction_tokens"] > 0
    by_path = httpx.post(server.base + "/v1/apply", headers=h, timeout=300,
                         json={"path": "mathutil.py", "update": update, "max_tokens": 40})
    assert by_path.status_code == 200, by_path.text
    assert by_path.json()["path"] == "mathutil.py" and by_path.json()["merged_code"]
    with httpx.stream("POST", server.base + "/v1/apply", headers=h, timeout=300,
                      json={"code": CODE, "update": update, "max_tokens": 40, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["merged_code"] == body["merged_code"]
    assert events[-1]["usage"] == body["usage"] and events[-1]["finish_reason"] == body["finish_reason"]
    assert all("merged_code" not in e for e in events[:-1])
    # another tenant's workspace is outside this one's: 403; a missing file 404
    for path in ("../repo_b/other.py", str(b / "other.py"), "/etc/passwd"):
        bad = httpx.post(server.base + "/v1/apply", headers=h, json={"path": path, "update": "x"})
        assert bad.status_code == 403, (path, bad.text)
        assert bad.json()["error"]["type"] == "permission_error"
    beta = httpx.post(server.base + "/v1/apply", headers={"Authorization": f"Bearer {BETA_KEY}"},
                      json={"path": "mathutil.py", "update": "x"})
    assert beta.status_code == 404, beta.text   # not in beta's workspace
    assert httpx.post(server.base + "/v1/apply", headers=h, json={"path": "nope.py", "update": "x"}).status_code == 404


@pytest.mark.slow
def test_auth_tenants_and_routes(server):
    with pytest.raises(openai.AuthenticationError):
        server.client("sk-wrong-key-000").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    out = server.client(BETA_KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=8,
        extra_body={"spec_stats": True})
    assert out.model_extra["spec"]["route"] == "beta-small"
    rec = _wait_for_record(server, "beta", out.id)
    assert rec["tenant"] == "beta" and rec["route"] == "beta-small"
    assert out.id not in {r["request_id"] for r in _logs(server, "acme")}
    hot = server.client(ACME_KEY).chat.completions.create(
        model=MODEL, messages=rewrite_messages(), temperature=0.9, max_tokens=8, extra_body={"spec_stats": True},
        prompt_cache_key="sess-42")
    spec = hot.model_extra["spec"]
    assert spec["route"] == "creative" and spec["reason"] == "route 'creative': speculation = false"
    if SPECULATIVE in ("agentspec", "none"):
        assert spec["enabled"] is False and spec["draft_tokens"] == 0
    rec = _wait_for_record(server, "acme", hot.id)
    assert rec["route"] == "creative" and rec["session"] == "sess-42" and rec["spec_reason"] == spec["reason"]


@pytest.mark.slow
def test_log_records_and_metrics(server):
    c = server.client(ACME_KEY)
    out = c.chat.completions.create(model=MODEL, messages=rewrite_messages(), temperature=0, max_tokens=32)
    rec = _wait_for_record(server, "acme", out.id)
    for key in ("ts", "request_id", "tenant", "route", "endpoint", "session", "prompt_tokens", "completion_tokens",
                "ttft_ms", "e2e_ms", "spec_enabled", "spec_reason", "steps", "draft_tokens", "accepted_tokens", "mat",
                "draft_sources", "finish_reason"):
        assert key in rec, key
    assert rec["completion_tokens"] == out.usage.completion_tokens and rec["finish_reason"] == out.choices[0].finish_reason
    assert rec["prompt_tokens"] == out.usage.prompt_tokens and 0 < rec["ttft_ms"] <= rec["e2e_ms"]
    assert rec["spec_enabled"] == (SPECULATIVE != "none") and rec["model"] == MODEL
    if SPECULATIVE != "none":
        assert rec["steps"] > 0 and rec["mat"] >= 1.0 and rec["draft_sources"]
    assert httpx.get(server.base + "/metrics").status_code == 401   # tenants configured: a key is needed
    text = httpx.get(server.base + "/metrics", headers={"Authorization": f"Bearer {ACME_KEY}"}).text
    for name in ("agentspec:spec_decode_num_drafts_total", "agentspec:spec_decode_num_draft_tokens_total",
                 "agentspec:spec_decode_num_accepted_tokens_total", "agentspec:e2e_request_latency_seconds"):
        assert name in text, name
    assert 'tenant="acme"' in text


BAD_BODIES = [
    (b"{", 400, None),
    (b'{"messages": []}', 400, "messages"),
    (b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": -1}', 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "a"}], "max_token": 3}', 400, "max_token"),
    (b'{"messages": [{"role": "user", "content": "a"}], "temperature": 9}', 400, "temperature"),
    (b'{"messages": [{"role": "wizard", "content": "a"}]}', 400, "messages"),
    (b'{"messages": [{"role": "user", "content": "a"}], "model": "gpt-9"}', 404, "model"),
    (b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 100000}', 400, "max_tokens"),
]


@pytest.mark.slow
def test_bad_requests_get_openai_errors(server):
    h = {"Authorization": f"Bearer {ACME_KEY}", "Content-Type": "application/json"}
    for body, status, param in BAD_BODIES:
        r = httpx.post(server.base + "/v1/chat/completions", content=body, headers=h)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if param is not None:
            assert err["param"] == param, (body, err)
    for body, param in (({"prompt": ""}, "prompt"), ({"prompt": [10**9]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt")):
        r = httpx.post(server.base + "/v1/completions", headers=h, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


@pytest.mark.slow
def test_disconnect_cancels_and_server_keeps_serving(server):
    h = {"Authorization": f"Bearer {ACME_KEY}"}
    with httpx.stream("POST", server.base + "/v1/chat/completions", headers=h, timeout=120,
                      json={"messages": rewrite_messages(), "temperature": 0, "max_tokens": 2000,
                            "stream": True}) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        next(line for line in lines if line.startswith("data: {"))   # a token came: the request runs
    rid = json.loads(first[6:])["id"]
    rec = _wait_for_record(server, "acme", rid, timeout=120)
    assert rec["finish_reason"] == "cancelled" and rec["completion_tokens"] < 2000
    quick = server.client(ACME_KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=2)
    assert quick.usage.completion_tokens >= 1
    assert httpx.get(server.base + "/health").json()["running"] == 0
