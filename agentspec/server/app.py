"""The ASGI app: HTTP over ``agentspec.api`` (OpenAI-compatible completions, fast apply,
sessions, tenants, logs and metrics).

Endpoints (DESIGN.md section 8):
  GET  /health, /metrics, /v1/models, /v1/models/{id}, /v1/sessions/{id}
  POST /v1/chat/completions, /v1/completions, /v1/apply, /v1/sessions

What is HTTP lives here: API-key authentication (a key names its tenant), body size limits and
types (JSON endpoints take ``application/json``: 415 otherwise), the ``Host`` check of a server
without keys (``ServerState.allowed_hosts``: loopback names only, against DNS rebinding), SSE
framing, client disconnects, the error envelope as a response. A generation request is admitted
against its tenant's limits before its body is read, and parsed and tokenized on a worker thread
(at most ``PREPARE_PER_TENANT`` at once per tenant), never on the event loop. Parsing, sessions, routes,
limits, submitting to the backend, response shapes and the acceptance records are
``agentspec.api.handling``'s, which the SDK's in-process mode runs too.

Every error is an OpenAI envelope ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status for bad input; a request that got as far as the engine leaves one record in its tenant's
acceptance log (``<log_dir>/<tenant>.jsonl``), whatever its end (done, cancelled, timed out).
"""

from __future__ import annotations

import asyncio
import hmac
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HTTPRoute

from ..api import anthropic, handling
from ..api.errors import error_envelope
from ..api.handling import Prepared, StreamShaper
from ..api.jobs import Job
from ..api.protocol import APIError
from ..api.state import ServerState, Tenant
from .openapi import openapi_endpoint

__all__ = ["create_app"]

_json = msgspec.json.Encoder()
PREPARE_PER_TENANT = 4   # a tenant's requests being parsed and tokenized at once (worker threads)


# ---- helpers ------------------------------------------------------------------------------------

def _error(e: APIError, wire: str = "openai") -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    headers.update(e.headers or {})
    return JSONResponse(error_envelope(e, wire), status_code=e.status, headers=headers or None)


def _authenticate(state: ServerState, request: Request) -> Tenant:
    """The tenant a request's key names: ``Authorization: Bearer <key>`` or Anthropic's
    ``x-api-key: <key>`` (the same keys, the same tenants)."""
    if not state.require_key:
        return state.default_tenant
    auth = request.headers.get("authorization", "")
    x_key = request.headers.get("x-api-key", "").strip()
    if not auth and x_key:
        auth = "Bearer " + x_key
    scheme, _, key = auth.partition(" ")
    if not auth:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                       type="authentication_error", code="invalid_api_key")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(401, "malformed Authorization header: expected 'Bearer <key>'", type="authentication_error",
                       code="invalid_api_key")
    key = key.strip()
    for known, tenant in state.keys.items():  # constant-time compare per key
        if hmac.compare_digest(known.encode(), key.encode()):
            return state.tenants[tenant]
    raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        try:
            n = int(length)
        except ValueError:
            raise APIError(400, f"invalid Content-Length header: {length!r}", code="invalid_header") from None
        if n > limit:
            raise APIError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes",
                           code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "client disconnected while sending the body", code="client_disconnect") from None
    body = b"".join(chunks)
    if not body:
        raise APIError(400, "request body is empty: expected a JSON object", code="invalid_json")
    _check_json_type(request)
    return body


def _check_json_type(request: Request) -> None:
    """415 unless the body says it is JSON (``application/json`` or ``application/*+json``): a web
    page can send ``text/plain`` or a form to a local server without asking, never JSON."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json")):
        return
    shown = f"{ctype!r}" if ctype else "none"
    raise APIError(415, f"Content-Type must be application/json, got {shown} (curl: -H 'Content-Type: "
                   "application/json')", code="unsupported_media_type")


def _check_host(state: ServerState, request: Request) -> None:
    """A server without API keys answers only the loopback names it was bound for: a page the
    developer visits can make a browser send requests to 127.0.0.1, but through a name of its own
    (DNS rebinding), which this refuses (403)."""
    allowed = state.allowed_hosts
    if allowed is None:
        return
    host = request.headers.get("host", "").strip().lower()
    if host.startswith("["):
        name = host[:host.find("]") + 1] if "]" in host else host
    else:
        name, sep, port = host.rpartition(":")
        if not sep or not port.isdigit():
            name = host
    if name not in allowed:
        raise APIError(403, f"Host {host!r} is not served: a server without API keys answers only "
                       f"{', '.join(sorted(allowed))} (configure tenants with api_keys to serve other names)",
                       type="permission_error", code="host_not_allowed")


# ---- generation ------------------------------------------------------------------------------------

def _sse(obj: Any, wire: str = "openai") -> bytes:
    """One server-sent event: OpenAI's ``data:`` line, or a named ``event:`` line first (Anthropic
    Messages, OpenAI Responses: the event's name is its ``type``)."""
    if wire == "openai":
        return b"data: " + _json.encode(obj) + b"\n\n"
    return b"event: " + str(obj.get("type", "message")).encode() + b"\ndata: " + _json.encode(obj) + b"\n\n"


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# a stream quiet this long gets a heartbeat: agent CLIs drop a stream idle for 240-300 s (Node's fetch
# body timeout: opencode, Claude Code; Qwen Code's and Codex's own guards, which count events, not
# bytes) and retry it from the start, while a CPU prefills an agent's 7k-19k-token prompt or a
# bare-JSON call is held back
HEARTBEAT_S = 15.0
_COMMENT = b": keep-alive\n\n"   # where an endpoint has no heartbeat event: an SSE comment, which SSE parsers skip


async def _next_or_heartbeat(events: asyncio.Queue, interval: float):
    """The next job event, or None after ``interval`` seconds without one (nothing is lost: an
    event that arrives meanwhile stays queued)."""
    try:
        return await asyncio.wait_for(events.get(), interval)
    except asyncio.TimeoutError:
        return None


def _submit(state: ServerState, prepared: Prepared) -> tuple[Job, asyncio.Queue]:
    """Submit on the backend; the job's events come back on this event loop's queue. (On the
    loop: the ids are checked and the drafter started in well under a millisecond, and a job
    submitted from a thread could outlive a client that left meanwhile.)"""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = handling.submit(state, prepared.call,
                          lambda kind, value: loop.call_soon_threadsafe(events.put_nowait, (kind, value)))
    return job, events


async def _collect(request: Request, job: Job, events: asyncio.Queue):
    """Wait for a non-streamed job; cancel it the moment the client goes away. The body is read
    already, so the connection's next message is its disconnect: a task waits for it beside the
    job's events (asking ``is_disconnected`` between events would never ask while tokens keep
    coming, and the job would hold its batch slot to ``max_tokens``)."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    watcher = asyncio.create_task(watch())
    try:
        while True:
            kind, value = await events.get()
            if kind != "tokens":
                return handling.outcome(job, kind, value)
    finally:
        watcher.cancel()


async def _stream(state: ServerState, prepared: Prepared, job: Job, events: asyncio.Queue) -> AsyncIterator[bytes]:
    """SSE bytes for a job: the opening chunks, a chunk per text delta, the final chunks (or
    the error) and ``[DONE]``."""
    shaper = StreamShaper(prepared, state.backend.tokenizer)
    wire = prepared.wire
    try:
        for c in prepared.opening:
            yield _sse(c, wire)
        while True:
            event = await _next_or_heartbeat(events, HEARTBEAT_S)
            if event is None:   # chat: an empty delta; Anthropic's wire: its ping; Responses: response.in_progress
                beat = prepared.heartbeat() if prepared.heartbeat is not None else None
                yield _COMMENT if beat is None else b"".join(_sse(c, wire) for c in beat)
                continue
            kind, value = event
            chunks, err, done = shaper.events(job, kind, value)
            for c in chunks:
                yield _sse(c, wire)
            if err is not None:
                for c in (prepared.error_chunks(err) if prepared.error_chunks is not None else [err.body()]):
                    yield _sse(c, wire)
            if done:
                if wire == "openai":
                    yield b"data: [DONE]\n\n"
                return
    finally:
        job.cancel()  # client gone (task cancelled) or done: either way the engine may stop


def _prepare_slot(app, tenant: str) -> asyncio.Semaphore:
    """The tenant's share of the worker threads that parse and tokenize requests: one tenant's
    burst waits for its own slots, not for the thread pool every tenant uses."""
    slots = app.state.prepare_slots
    sem = slots.get(tenant)
    if sem is None:
        sem = slots[tenant] = asyncio.Semaphore(PREPARE_PER_TENANT)
    return sem


def _generation(path: str):
    async def endpoint(request: Request) -> Response:
        state: ServerState = request.app.state.agentspec
        t0 = time.monotonic()
        tenant = _authenticate(state, request)
        handling.admit(state, tenant)   # a tenant at its limits: 429 before its body is even read
        body = await _read_body(request, state.config.server.max_body_bytes)
        async with _prepare_slot(request.app, tenant.name):
            prepared = await run_in_threadpool(handling.prepare, state, path, tenant, body, t0=t0)
        job, events = _submit(state, prepared)
        if not prepared.call.stream:
            gen = await _collect(request, job, events)
            return Response(_json.encode(prepared.respond(gen)), media_type="application/json")
        return StreamingResponse(_stream(state, prepared, job, events), media_type="text/event-stream",
                                 headers=_SSE_HEADERS)
    return endpoint


# ---- the other endpoints ------------------------------------------------------------------------------

async def models(request: Request) -> Response:
    state: ServerState = request.app.state.agentspec
    _authenticate(state, request)
    return JSONResponse({"object": "list", "data": [handling.model_card(state)]})


async def model_detail(request: Request) -> Response:
    state: ServerState = request.app.state.agentspec
    _authenticate(state, request)
    name = request.path_params["model"]
    if name != state.model_id:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_id!r} (a "
                            "generation request may name any model: the served one answers)",
                       type="not_found_error", param="model", code="model_not_found")
    return JSONResponse(handling.model_card(state))


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens`` (Anthropic): the prompt's tokens as the model sees them."""
    state: ServerState = request.app.state.agentspec
    tenant = _authenticate(state, request)
    body = await _read_body(request, state.config.server.max_body_bytes)
    async with _prepare_slot(request.app, tenant.name):
        out = await run_in_threadpool(anthropic.count_tokens, state, body)
    return JSONResponse(out)


async def create_session(request: Request) -> Response:
    """``POST /v1/sessions``: a session for the caller's tenant (body optional: ``{"id": ...}``)."""
    state: ServerState = request.app.state.agentspec
    tenant = _authenticate(state, request)
    raw = b""
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > 4096:
                raise APIError(413, "request body exceeds the limit of 4096 bytes", code="request_too_large")
    except ClientDisconnect:
        raise APIError(400, "client disconnected while sending the body", code="client_disconnect") from None
    if raw:
        _check_json_type(request)
    return JSONResponse(handling.create_session(state, tenant, raw))


async def session_detail(request: Request) -> Response:
    """``GET /v1/sessions/{id}``: the caller's own session; 404 unknown (another tenant's too)."""
    state: ServerState = request.app.state.agentspec
    tenant = _authenticate(state, request)
    return JSONResponse(handling.session_detail(state, tenant, request.path_params["session"]))


async def health(request: Request) -> Response:
    return JSONResponse(handling.health(request.app.state.agentspec))


async def metrics(request: Request) -> Response:
    """Prometheus text. With tenants configured a tenant's key reads only its own series, an
    operator key (``[server] metrics_api_keys``) every tenant's and the server's own (401 without
    a key); a server without keys serves everything to anyone, like every other endpoint."""
    state: ServerState = request.app.state.agentspec
    if state.require_key and _operator_key(state, request):
        body, ctype = state.metrics.render()
    elif state.require_key:
        body, ctype = state.metrics.render(tenant=_authenticate(state, request).name)
    else:
        body, ctype = state.metrics.render()
    return Response(body, media_type=ctype)


def _operator_key(state: ServerState, request: Request) -> bool:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    key = key.strip().encode()
    ok = False
    for known in state.config.server.metrics_api_keys:   # constant-time, every key compared
        ok |= scheme.lower() == "bearer" and hmac.compare_digest(known.encode(), key)
    return ok


# ---- the app -----------------------------------------------------------------------------------------

def create_app(state: ServerState) -> Starlette:
    """The Starlette app over a built ``ServerState``; closes its backend on shutdown. The backend's
    scheduler runs on the thread that calls ``backend.run()`` (``serve``) or, without one, on a
    thread of its own from the first request (``EmbeddedBackend(background=True)``)."""

    def wrap(handler, wire: str = "openai"):
        async def endpoint(request: Request) -> Response:
            try:
                _check_host(state, request)
                return await handler(request)
            except APIError as e:
                return _error(e, wire)
        return endpoint

    async def not_found(request: Request, exc) -> Response:
        return _error(APIError(404, f"no route {request.method} {request.url.path}", type="not_found_error",
                               code="not_found"), handling.wire_of(request.url.path))

    async def method_not_allowed(request: Request, exc) -> Response:
        return _error(APIError(405, f"method {request.method} not allowed on {request.url.path}",
                               code="method_not_allowed"))

    async def server_error(request: Request, exc) -> Response:
        print(f"[agentspec] unhandled error on {request.url.path}: {exc!r}", file=sys.stderr, flush=True)
        return _error(APIError(500, f"internal error: {type(exc).__name__}", type="server_error",
                               code="internal_error"))

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            state.backend.close()
            state.sink.close()

    routes = [
        HTTPRoute("/health", wrap(health), methods=["GET"]),
        HTTPRoute("/metrics", wrap(metrics), methods=["GET"]),
        HTTPRoute("/openapi.json", wrap(openapi_endpoint), methods=["GET"]),   # public, static
        HTTPRoute("/v1/models", wrap(models), methods=["GET"]),
        HTTPRoute("/v1/models/{model:path}", wrap(model_detail), methods=["GET"]),
        HTTPRoute("/v1/messages/count_tokens", wrap(count_tokens, "anthropic"), methods=["POST"]),
        *(HTTPRoute(path, wrap(_generation(path), handling.wire_of(path)), methods=["POST"])
          for path in handling.GENERATION_PATHS),
        HTTPRoute("/v1/sessions", wrap(create_session), methods=["POST"]),
        HTTPRoute("/v1/sessions/{session:path}", wrap(session_detail), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: method_not_allowed, 500: server_error,
                                        Exception: server_error})
    app.state.agentspec = state
    app.state.prepare_slots = {}
    if hasattr(state.metrics, "watch_log_sink"):
        state.metrics.watch_log_sink(state.sink)   # agentspec:log_write_errors_total
    return app
