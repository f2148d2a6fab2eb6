"""The OpenAPI 3.1 document (agentspec/server/openapi.py): valid, complete, and derived from the
msgspec request structs (what the document accepts is what the server decodes)."""

from __future__ import annotations

import jsonschema
import msgspec
import pytest
from openapi_spec_validator import OpenAPIV31SpecValidator

from agentspec.server.openapi import build_openapi, openapi_bytes
from agentspec.api.protocol import (
    APIError,
    ApplyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    SessionCreateRequest,
    decode_body,
)

PATHS = {
    "/v1/chat/completions": "post", "/v1/completions": "post", "/v1/apply": "post", "/v1/models": "get",
    "/v1/models/{model}": "get", "/v1/sessions": "post", "/v1/sessions/{id}": "get", "/health": "get",
    "/metrics": "get", "/v1/messages": "post", "/v1/messages/count_tokens": "post", "/v1/responses": "post",
}
ANTHROPIC = {"/v1/messages", "/v1/messages/count_tokens"}


def test_valid_openapi_31():
    doc = build_openapi()
    OpenAPIV31SpecValidator(doc).validate()   # raises with the first error
    assert doc["openapi"] == "3.1.0"


def test_built_once():
    assert build_openapi() is build_openapi()
    assert openapi_bytes() is openapi_bytes()
    assert msgspec.json.decode(openapi_bytes()) == build_openapi()


def test_paths_security_and_errors():
    doc = build_openapi()
    assert set(doc["paths"]) == set(PATHS)
    for path, method in PATHS.items():
        op = doc["paths"][path][method]
        for status, resp in op["responses"].items():
            if status[0] in "45":   # every 4xx/5xx is the OpenAI error envelope (Anthropic's on its paths)
                envelope = "AnthropicError" if path in ANTHROPIC else "ErrorResponse"
                assert resp["content"]["application/json"]["schema"] == {
                    "$ref": f"#/components/schemas/{envelope}"}, (path, status)
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http", "scheme": "bearer", "description": "A tenant's API key from the server's config"}
    assert doc["security"] == [{"bearerAuth": []}]
    assert doc["paths"]["/health"]["get"]["security"] == [{}]   # public
    env = doc["components"]["schemas"]["ErrorResponse"]
    assert env["required"] == ["error"]
    detail = doc["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path,struct", [
    ("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest),
    ("/v1/apply", ApplyRequest), ("/v1/sessions", SessionCreateRequest),
])
def test_request_bodies_are_the_msgspec_structs(path, struct):
    doc = build_openapi()
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = struct.__name__
    assert schema == {"$ref": f"#/components/schemas/{name}"}
    _, components = msgspec.json.schema_components([struct], ref_template="#/components/schemas/{name}")
    assert doc["components"]["schemas"][name] == components[name]
    assert components[name]["additionalProperties"] is False   # unknown fields are refused


# Bodies the schema and the server's strict decoder must judge alike
BODIES = [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, True),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "max_token": 4}, False),
    (ChatCompletionRequest, {"messages": []}, False),
    (ChatCompletionRequest, {"messages": [{"role": "critic", "content": "x"}]}, False),
    (ChatCompletionRequest, {"messages": [{"role": "tool", "content": "x", "tool_call_id": "call_1"}],
                             "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                             "tool_choice": {"type": "function", "function": {"name": "f"}}}, True),
    (ChatCompletionRequest, {"messages": [{"role": "user"}], "temperature": 2.5}, False),
    (CompletionRequest, {"prompt": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True}}, True),
    (CompletionRequest, {"prompt": "x", "max_tokens": 0}, False),
    (ApplyRequest, {"code": "a = 1\n", "update": "a = 2\n"}, True),
    (ApplyRequest, {"code": "a", "session": ""}, False),
    (SessionCreateRequest, {"id": "s-1"}, True),
    (SessionCreateRequest, {"id": "x" * 513}, False),
]


@pytest.mark.parametrize("struct,body,ok", BODIES)
def test_schema_agrees_with_the_decoder(struct, body, ok):
    doc = build_openapi()
    # the document's refs ("#/components/schemas/...") resolve against a root that carries them
    validator = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{struct.__name__}",
                                                 "components": doc["components"]})
    assert validator.is_valid(body) is ok
    raw = msgspec.json.encode(body)
    if ok:
        decode_body(raw, struct)
    else:
        with pytest.raises(APIError) as e:
            decode_body(raw, struct)
        assert e.value.status == 400
