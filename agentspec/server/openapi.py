"""The server's OpenAPI 3.1 document, served at ``GET /openapi.json`` (no auth).

Request bodies are the msgspec structs of ``protocol.py``, turned into JSON Schema (2020-12, the
dialect of OpenAPI 3.1) by ``msgspec.json.schema_components``, so the document cannot drift from
what the server decodes (strictly: ``additionalProperties: false``). Responses are described by the
documentation-only structs below: the fields the handlers in ``app.py`` always send (they may send
more, so those schemas stay open). Every 4xx/5xx is the OpenAI error envelope.

The document is static: built once per process (``openapi_bytes``), it names no tenant, key,
model, workspace or prompt of the running server.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ..api.anthropic import MessagesRequest, _CountRequest
from ..api.protocol import ApplyRequest, ChatCompletionRequest, CompletionRequest, SessionCreateRequest
from ..api.responses import ResponsesRequest

__all__ = ["build_openapi", "openapi_bytes", "openapi_endpoint"]

_REF = "#/components/schemas/{name}"


# ---- response shapes (documentation only: app.py builds these bodies as dicts) ------------------

class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """The OpenAI error envelope of every 4xx/5xx answer."""

    error: ErrorDetail


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(msgspec.Struct):
    """Non-streamed ``/v1/chat/completions``; ``spec`` (extension) with ``spec_stats: true``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]


class Completion(msgspec.Struct):
    """Non-streamed ``/v1/completions``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ApplyResponse(msgspec.Struct):
    """Non-streamed ``/v1/apply``: the merged file, usage and speculation stats."""

    id: str
    object: Literal["apply"]
    created: int
    model: str
    merged_code: str
    finish_reason: Literal["stop", "length"]
    usage: Usage
    spec: dict[str, Any]


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct):
    """Anthropic's error envelope: every 4xx/5xx of ``/v1/messages``."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicMessage(msgspec.Struct):
    """Non-streamed ``/v1/messages``: ``text`` and ``tool_use`` content blocks."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: dict[str, int]


class TokenCount(msgspec.Struct):
    input_tokens: int


class ResponseObject(msgspec.Struct):
    """Non-streamed ``/v1/responses``: ``message`` and ``function_call`` output items."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class Model(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[Model]


class Session(msgspec.Struct):
    id: str
    object: Literal["session"]
    created: int


class Health(msgspec.Struct):
    """Liveness and queue depth (and memory sizes that grow with use)."""

    status: str
    model: str
    uptime_s: float


_REQUESTS = (ChatCompletionRequest, CompletionRequest, ApplyRequest, SessionCreateRequest, MessagesRequest,
             ResponsesRequest, _CountRequest)
_RESPONSES = (ErrorResponse, ChatCompletion, Completion, ApplyResponse, ModelList, Model, Session, Health,
              AnthropicError, AnthropicMessage, TokenCount, ResponseObject)


# ---- the document ----------------------------------------------------------------------------------

def _ref(name: str) -> dict:
    return {"$ref": _REF.format(name=name)}


def _json(name: str) -> dict:
    return {"application/json": {"schema": _ref(name)}}


_SSE = {"text/event-stream": {"schema": {
    "type": "string",
    "description": "Server-sent events: `data: <JSON chunk>` lines, ending with `data: [DONE]`; an error after "
                   "the stream started is sent as one `data: {\"error\": ...}` event."}}}

_ERRORS = {
    "400": "Bad request: malformed JSON, a wrong type, an unknown field, an unsupported option (named in "
           "`param`), a prompt over the context window",
    "401": "Missing or invalid API key (only when tenants with API keys are configured)",
    "403": "A workspace path the caller's tenant may not read (outside the workspace, ignored by it, or one of the "
           "server's own files); a Host name a server without API keys does not answer",
    "404": "Unknown model, session or route",
    "413": "Request body over `max_body_bytes`",
    "415": "A body that is not `application/json`",
    "429": "The tenant's `max_concurrent` or `requests_per_minute` limit (`Retry-After` says when to retry)",
    "5XX": "Server error: 503 queue full or shutting down, 504 `request_timeout_s` passed",
}


def _errors(*codes: str, envelope: str = "ErrorResponse") -> dict:
    return {c: {"description": _ERRORS[c], "content": _json(envelope)} for c in codes}


_NAMED_SSE = {"text/event-stream": {"schema": {
    "type": "string",
    "description": "Server-sent events as `event: <type>` and `data: <JSON>` lines (no `[DONE]`)."}}}


def _generation(summary: str, description: str, request: str, ok: str, op_id: str, *,
                envelope: str = "ErrorResponse", sse: dict = _SSE) -> dict:
    return {"post": {
        "operationId": op_id,
        "summary": summary,
        "description": description,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {"description": f"{ok} (`stream: true`: server-sent events)",
                    "content": {**_json(ok), **sse}},
            **_errors("400", "401", "403", "404", "413", "415", "429", "5XX", envelope=envelope),
        },
    }}


@functools.cache
def build_openapi() -> dict:
    """The OpenAPI 3.1 document (a dict; cached: do not modify what it returns)."""
    (_refs, components) = msgspec.json.schema_components(_REQUESTS + _RESPONSES, ref_template=_REF)
    try:
        from importlib.metadata import version

        api_version = version("agentspec-serve")
    except Exception:   # a source tree without the distribution's metadata
        api_version = "0"
    public = [{}]   # no security requirement
    doc = {
        "openapi": "3.1.0",
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {
            "title": "agentspec",
            "version": api_version,
            "summary": "OpenAI-compatible server with exact, model-free speculative decoding for coding agents",
            "description": "Requests are decoded strictly: unknown fields and unsupported options are 400s that "
                           "name them. With tenants configured (`--config` with `[[tenants]] api_keys`) every "
                           "`/v1` request needs `Authorization: Bearer <key>`; without, none does.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "security": [{"bearerAuth": []}],
        "paths": {
            "/v1/chat/completions": _generation(
                "Chat completion", "OpenAI chat completions. Extensions: `spec_stats`, `speculation`, `session`, "
                "`route` (a configured route by name), `top_k`; `prediction` (Predicted Outputs) is the draft "
                "source.",
                "ChatCompletionRequest", "ChatCompletion", "createChatCompletion"),
            "/v1/messages": _generation(
                "Anthropic Messages", "Anthropic's Messages API: text, tool_use and tool_result blocks, tools, "
                "tool_choice; keys as `x-api-key` or bearer.", "MessagesRequest", "AnthropicMessage",
                "createMessage", envelope="AnthropicError", sse=_NAMED_SSE),
            "/v1/messages/count_tokens": {"post": {
                "operationId": "countMessageTokens", "summary": "Tokens of a Messages request as the model sees them",
                "requestBody": {"required": True, "content": _json("_CountRequest")},
                "responses": {"200": {"description": "The count", "content": _json("TokenCount")},
                              **_errors("400", "401", "413", "415", envelope="AnthropicError")}}},
            "/v1/responses": _generation(
                "Responses", "OpenAI's Responses API, stateless: input items, function tools, text.format; the "
                "stream's events carry sequence numbers and end with response.completed or response.failed.",
                "ResponsesRequest", "ResponseObject", "createResponse", sse=_NAMED_SSE),
            "/v1/completions": _generation(
                "Completion", "A raw prompt (no chat template) or token ids.",
                "CompletionRequest", "Completion", "createCompletion"),
            "/v1/apply": _generation(
                "Fast apply", "Merge `update` and/or `instruction` into `code` or the workspace file at `path` "
                "(exactly one of `code`, `path`); the original code is the draft source.",
                "ApplyRequest", "ApplyResponse", "createApply"),
            "/v1/models": {"get": {
                "operationId": "listModels", "summary": "The served model",
                "responses": {"200": {"description": "Model list", "content": _json("ModelList")},
                              **_errors("401")}}},
            "/v1/models/{model}": {"get": {
                "operationId": "retrieveModel", "summary": "One model",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "The model", "content": _json("Model")},
                              **_errors("401", "404")}}},
            "/v1/sessions": {"post": {
                "operationId": "createSession", "summary": "Create a session for the caller's tenant (extension)",
                "requestBody": {"required": False, "content": _json("SessionCreateRequest")},
                "responses": {"200": {"description": "The session", "content": _json("Session")},
                              **_errors("400", "401", "403", "413", "415")}}},
            "/v1/sessions/{id}": {"get": {
                "operationId": "retrieveSession", "summary": "One of the caller's sessions (extension)",
                "parameters": [{"name": "id", "in": "path", "required": True,
                                "schema": {"type": "string", "minLength": 1, "maxLength": 512}}],
                "responses": {"200": {"description": "The session", "content": _json("Session")},
                              **_errors("401", "403", "404")}}},
            "/health": {"get": {
                "operationId": "health", "summary": "Liveness and queue depth", "security": public,
                "responses": {"200": {"description": "Healthy", "content": _json("Health")}}}},
            "/metrics": {"get": {
                "operationId": "metrics", "summary": "Prometheus metrics (text exposition format)",
                "security": [{}, {"bearerAuth": []}],
                "responses": {"200": {"description": "Metrics",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}},
                              **_errors("401")}}},
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                               "description": "A tenant's API key from the server's config"}},
        },
    }
    return doc


@functools.cache
def openapi_bytes() -> bytes:
    return msgspec.json.encode(build_openapi())


async def openapi_endpoint(request: Request) -> Response:
    """``GET /openapi.json``: public, static, cached."""
    return Response(openapi_bytes(), media_type="application/json")
