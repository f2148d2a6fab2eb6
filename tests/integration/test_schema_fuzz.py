"""Schemathesis against a real `agentspec serve`: the schema comes from the live `/openapi.json`,
every operation gets bounded, derandomized examples (valid bodies and invalid ones), and the
server must never answer 5xx nor take longer than a request timeout to answer.

The server has a tenant with an API key, so auth runs on every request: most examples carry the
key, some none or a wrong one (401s, never 5xx). Generation stays cheap: `max_tokens` and
`max_completion_tokens` are capped in every generated body, and `default_max_tokens` is small."""

from __future__ import annotations

import os

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import max_response_time, not_a_server_error
from helpers.serve import Server

from agentspec.server.openapi import build_openapi

pytestmark = [pytest.mark.slow, pytest.mark.extended]   # extended tier: schema fuzzing of every endpoint

TENANT = "fuzz-tenant"
KEY = "sk-fuzz-0123456789"
MAX_TOKENS = 4                 # cap on generated max_tokens / max_completion_tokens
RESPONSE_LIMIT_S = 30.0        # max_response_time: a slower answer fails the check
REQUEST_TIMEOUT_S = 60.0       # requests' timeout: a hang fails the test instead of stalling it
EXAMPLES = int(os.environ.get("AGENTSPEC_FUZZ_EXAMPLES", 25))   # per operation and mode (more: a deeper run)

AUTH = {"key": {"Authorization": f"Bearer {KEY}"}, "wrong": {"Authorization": "Bearer sk-wrong"}, "none": {}}

CONFIG = f"""
[server]
log_dir = "logs"
default_max_tokens = {MAX_TOKENS}
request_timeout_s = {int(RESPONSE_LIMIT_S)}
max_body_bytes = 262144
[[tenants]]
name = "{TENANT}"
api_keys = ["{KEY}"]
"""


def _takes_input(op: dict) -> bool:
    return bool(op.get("parameters") or op.get("requestBody") or {} not in op.get("security", [None]))


OPERATIONS = [(method.upper(), path) for path, item in build_openapi()["paths"].items() for method in item]
# invalid examples need something to break: parameters, a body, or a key (/health takes none)
CASES = [(m, p, mode) for m, p in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode is GenerationMode.POSITIVE or _takes_input(build_openapi()["paths"][p][m.lower()])]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    repo = root / "repo"
    repo.mkdir()
    (repo / "util.py").write_text("def add(a, b):\n    return a + b\n")
    s = Server(root, config=CONFIG, repo=repo)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(
        server.base + "/openapi.json", timeout=10,
        config=schemathesis.Config.from_dict({"checks": {"max_response_time": RESPONSE_LIMIT_S}}))


@pytest.fixture
def session():
    with requests.Session() as s:
        yield s


def test_openapi_is_public_and_names_no_tenant(server):
    with httpx.Client(base_url=server.base, timeout=10) as http:
        r = http.get("/openapi.json")   # no key, though every /v1 route needs one
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
        assert r.json() == build_openapi()
        assert TENANT not in r.text and KEY not in r.text and str(server.cwd) not in r.text
        assert http.get("/v1/models").status_code == 401


@pytest.mark.parametrize("path,status", [
    ("x" * 300, 400),           # a name over 255 bytes: is_file() raised ENAMETOOLONG, a 500
    ("a/" * 5000 + "b", 400),   # a deep path: the ignore-rule walk is ~depth^3 (minutes), on the event loop
    ("a/" * 20 + "b", 404),
])
def test_apply_paths_found_by_probing(server, path, status):
    with httpx.Client(base_url=server.base, timeout=10, headers=AUTH["key"]) as http:
        r = http.post("/v1/apply", json={"path": path, "update": "x = 1\n"})
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def _adjust(case, path: str, reach_engine: bool) -> None:
    """Keep generation short: cap the token budget of a generated body (a dict; invalid bodies
    may be anything). ``reach_engine``: also fix what the schema cannot say, so that the example
    gets past the checks before the engine: the served model (a random one is a 404), a text
    prompt for /v1/completions (random token ids are mostly out of the vocabulary), and for
    /v1/apply exactly one of code/path (the workspace's file) and an update."""
    body = case.body
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if path in ("/v1/completions", "/v1/apply") and "max_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS   # their defaults (16; the whole file) ignore default_max_tokens
    if path in ("/v1/messages", "/v1/responses") and not isinstance(body.get("max_output_tokens" if path ==
                                                                          "/v1/responses" else "max_tokens"), int):
        body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = MAX_TOKENS
    if not reach_engine:
        return
    body.pop("model", None)
    # the bundled model's chat template renders no tools; grammars and tool choices need them
    for name in ("tools", "tool_choice", "response_format", "text", "output_config", "previous_response_id",
                 "conversation", "prompt", "background", "max_tool_calls", "top_logprobs", "container",
                 "mcp_servers", "context_management"):
        body.pop(name, None)
    if path == "/v1/responses":
        body["input"] = "def add(a, b):"
    if path == "/v1/chat/completions":   # (random roles, tool calls and parts are mostly refused)
        body["messages"] = [{"role": "user", "content": "def add(a, b):"}]
    if path in ("/v1/messages", "/v1/messages/count_tokens"):
        body["messages"] = [{"role": "user", "content": "def add(a, b):"}]
    if path == "/v1/completions" and not (isinstance(body.get("prompt"), str) and body["prompt"]):
        body["prompt"] = "def add(a, b):"
    if path == "/v1/apply":
        if body.get("path") is not None:
            body["path"] = "util.py"
            body.pop("code", None)
        elif not isinstance(body.get("code"), str):
            body["code"] = "def add(a, b):\n    return a + b\n"
        if not body.get("update") and not body.get("instruction"):
            body["update"] = "def add(a, b):\n    return b + a\n"


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES])
def test_no_server_errors(server, schema, session, method, path, mode):
    operation = schema[path][method]
    strategy = st.tuples(operation.as_strategy(generation_mode=mode), st.booleans(),
                         st.sampled_from(["key", "key", "key", "wrong", "none"]))

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate],   # no shrinking: bounded time; the failing case is shown
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(strategy)
    def run(example):
        case, reach_engine, auth = example
        _adjust(case, path, reach_engine)
        r = case.call_and_validate(base_url=server.base, session=session, headers=AUTH[auth],
                                   checks=[not_a_server_error, max_response_time], timeout=REQUEST_TIMEOUT_S)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

    statuses: dict[int, int] = {}
    run()
    print(method, path, mode.value, sorted(statuses.items()))   # with -s: what the examples got
    if mode is GenerationMode.POSITIVE and "{" not in path:   # valid examples got through, not only 4xx
        assert 200 in statuses, statuses
