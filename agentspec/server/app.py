"""The ASGI app: OpenAI-compatible completions, fast apply, tenants, routes, logs and metrics.

Endpoints (DESIGN.md section 8):
  GET  /health, /metrics, /v1/models, /v1/models/{id}, /v1/sessions/{id}
  POST /v1/chat/completions, /v1/completions, /v1/apply, /v1/sessions

Sessions (``prompt_cache_key``, ``user`` or the explicit ``session``) belong to the tenant that
first used them; the rules (403 for another tenant's, 404 for an unknown explicit one) are in
``agentspec/server/sessions.py``.

Every error is an OpenAI envelope ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status for bad input; a request that got as far as the engine leaves one record in its tenant's
acceptance log (``<log_dir>/<tenant>.jsonl``), whatever its end (done, cancelled, timed out).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HTTPRoute

from ..apply import ApplyPathError, build_apply, chat_fast_apply, prediction_usage, resolve_workspace_path
from ..backend import Backend, GenerationRequest
from ..config import ServerConfig
from ..errors import BackendClosedError, ContextLengthError, InvalidRequestError, QueueFullError
from ..routing import Route, Router
from ..text import TextStream
from .protocol import (
    APIError,
    ApplyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    SessionCreateRequest,
    decode_body,
)
from .openapi import openapi_endpoint
from .limits import LimitExceeded, TenantLimits
from .sessions import SessionForbiddenError, SessionNotFoundError, SessionRegistry
from .worker import Job

if TYPE_CHECKING:
    from ..engine.base import GenerationStats

__all__ = ["ServerState", "Tenant", "create_app"]

_json = msgspec.json.Encoder()


@dataclass
class Tenant:
    name: str
    workspace: Any = None          # agentspec.Workspace or None
    root: Path | None = None


@dataclass
class ServerState:
    """Everything the handlers share. Built by ``agentspec.server.build_state``."""

    backend: Backend               # the engine, behind agentspec.backend.Backend (nothing else is used)
    config: ServerConfig
    tenants: dict[str, Tenant]
    router: Router
    sink: Any                      # telemetry.TenantLogSink
    metrics: Any                   # telemetry.Metrics
    model_id: str
    require_key: bool
    keys: dict[str, str] = field(default_factory=dict)   # api key -> tenant
    sessions: SessionRegistry = field(default_factory=SessionRegistry)   # session id -> owning tenant
    started: float = field(default_factory=time.time)
    limits: TenantLimits | None = None   # per-tenant max_concurrent / requests_per_minute (from config)
    draining: bool = False         # shutting down: new generation requests get 503 (``serve``'s SIGTERM)
    jobs: set = field(default_factory=set, repr=False)   # jobs submitted and not finished
    jobs_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def cancel_jobs(self) -> int:
        """Cancel every unfinished job because the server is shutting down (each stops at its
        next decode step; its client gets a 503 ``shutting_down`` error); how many."""
        with self.jobs_lock:
            jobs = list(self.jobs)
        for job in jobs:
            job.shutdown = True
            job.cancel()
        return len(jobs)

    def __post_init__(self) -> None:
        if self.limits is None:
            self.limits = TenantLimits({t.name: (t.max_concurrent, t.requests_per_minute)
                                        for t in (self.config.tenants or [])})


# ---- helpers ------------------------------------------------------------------------------------

def _error(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    headers.update(e.headers or {})
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


def _authenticate(state: ServerState, request: Request) -> Tenant:
    if not state.require_key:
        return state.tenants["default"]
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    if not auth:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", type="authentication_error",
                       code="invalid_api_key")
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
    return body  # parsed as JSON whatever the Content-Type says (curl -d sends form-urlencoded)


def _check_model(state: ServerState, model: str | None) -> str:
    if model is None or model == state.model_id:
        return state.model_id
    raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_id!r}",
                   type="not_found_error", param="model", code="model_not_found")


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


# ---- the request pipeline ------------------------------------------------------------------------

@dataclass
class Call:
    """One generation request after parsing, shared by the three endpoints."""

    endpoint: str
    tenant: Tenant
    ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    route: Route
    spec_reason: str                    # set when the request or its route turned speculation off
    prediction: list[int] | None
    session: str | None
    stream: bool
    include_usage: bool
    want_stats: bool
    request_id: str
    t0: float                           # monotonic time the request arrived
    created: int = field(default_factory=lambda: int(time.time()))


def _resolve(state: ServerState, *, endpoint: str, tenant: Tenant, model: str, ids: list[int], temperature: float,
             top_p: float | None, top_k: int | None, seed: int | None, stop, max_tokens: int | None,
             speculation: bool | None, prediction: str | list[int] | None, session: str | None, stream: bool,
             include_usage: bool, want_stats: bool, t0: float, prefix: str) -> Call:
    backend = state.backend
    route = state.router.resolve(endpoint=endpoint, tenant=tenant.name, model=model, temperature=temperature)
    reason = route.reason
    if speculation is False and route.spec is not None:
        route = Route(name=route.name, spec=None, reason="request: speculation = false", drafters=route.drafters)
        reason = route.reason
    room = backend.max_context - len(ids)
    if room < 1:
        raise APIError(400, f"prompt of {len(ids)} tokens does not fit the context window of "
                            f"{backend.max_context} tokens", param="messages" if endpoint == "chat.completions"
                       else "prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(state.config.server.default_max_tokens, room)
    pred_ids = backend.encode_text(prediction) if isinstance(prediction, str) and prediction else (
        prediction or None)
    if isinstance(stop, str):
        stop = [stop]
    return Call(endpoint=endpoint, tenant=tenant, ids=ids, max_tokens=max_tokens, temperature=temperature,
                top_p=1.0 if top_p is None else top_p, top_k=max(top_k or 0, 0), seed=seed, stop=list(stop or []),
                route=route, spec_reason=reason, prediction=pred_ids, session=session, stream=stream,
                include_usage=include_usage, want_stats=want_stats,
                request_id=f"{prefix}-{secrets.token_hex(12)}", t0=t0)


_PARAMS = {"prediction_ids": "prediction"}   # GenerationRequest fields -> the API's names


def _submit(state: ServerState, call: Call) -> Job:
    """Queue the call on the backend; bad values raise 400s now, a full queue a 503."""
    tenant = call.tenant.name
    request = GenerationRequest(
        prompt_ids=call.ids, max_tokens=call.max_tokens, temperature=call.temperature, top_p=call.top_p,
        top_k=call.top_k, seed=call.seed, stop=call.stop, spec=call.route.spec, drafters=call.route.drafters,
        tenant=tenant, route=call.route.name, session=call.session, request_id=call.request_id,
        prediction_ids=call.prediction)
    if state.draining:
        raise _shutting_down()

    try:
        limited = state.limits.acquire(tenant)
    except LimitExceeded as e:
        raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(e.retry_after)}) from None

    def on_finish(job: Job, kind: str, value: Any):
        with state.jobs_lock:
            state.jobs.discard(job)
        if limited:
            state.limits.release(tenant)
        _record(state, call, job, kind, value)

    job = Job(request, deadline=call.t0 + state.config.server.request_timeout_s, loop=asyncio.get_running_loop(),
              on_finish=on_finish)
    state.metrics.request_started(tenant)
    job.started_at = time.monotonic()
    with state.jobs_lock:
        state.jobs.add(job)
    try:
        state.backend.submit(request, on_tokens=job._tokens, on_done=job._done, should_stop=job.should_stop)
    except BaseException as e:
        with state.jobs_lock:
            state.jobs.discard(job)
        job.started_at = None
        if limited:
            state.limits.release(tenant)
        state.metrics.request_finished(tenant)
        if isinstance(e, ContextLengthError):
            raise APIError(400, str(e), param=_PARAMS.get(e.param, e.param), code="context_length_exceeded") from None
        if isinstance(e, InvalidRequestError):
            raise APIError(400, str(e), param=_PARAMS.get(e.param, e.param), code="invalid_value") from None
        if isinstance(e, QueueFullError):
            raise APIError(503, f"server overloaded: {e}", type="server_error", code="overloaded") from None
        if isinstance(e, BackendClosedError):
            raise APIError(503, "server shutting down; retry on another instance", type="server_error",
                           code="shutting_down") from None
        raise
    return job


def _record(state: ServerState, call: Call, job: Job, kind: str, value: Any) -> None:
    """One acceptance-log record and the metrics for a finished (or failed) request."""
    from ..engine.base import GenerationStats
    from ..telemetry import record_from_stats

    now = time.monotonic()
    if kind == "done":
        gen = value
        stats = gen.stats
        finish = gen.finish_reason
        if finish == "cancelled" and job.timed_out:
            finish = "timeout"
    else:
        stats = GenerationStats(prompt_tokens=len(call.ids))
        finish = {"cancelled": "timeout" if job.timed_out else "cancelled"}.get(kind, "error")
    if call.spec_reason:
        stats.spec_reason = call.spec_reason
    e2e = (now - call.t0) * 1e3
    ttft = (job.first_token_at - call.t0) * 1e3 if job.first_token_at is not None else e2e
    extra: dict[str, Any] = {}
    if kind == "error":
        extra = {"status_code": 500 if not isinstance(value, InvalidRequestError) else 400,
                 "error": f"{type(value).__name__}: {value}"}
    elif finish in ("cancelled", "timeout"):
        extra = {"status_code": 504 if finish == "timeout" else 499}
    if job.shutdown and finish in ("cancelled", "error"):   # cut off by the shutdown grace period
        finish, extra = "cancelled", {"status_code": 503, "error": "server shutting down"}
    rec = record_from_stats(
        stats, request_id=call.request_id, tenant=call.tenant.name, route=call.route.name, endpoint=call.endpoint,
        session=call.session, model=state.model_id, ttft_ms=round(ttft, 3), e2e_ms=round(e2e, 3),
        finish_reason=finish, **extra)
    try:
        state.sink.write(rec)
    finally:
        state.metrics.observe(rec)
        if job.started_at is not None:
            state.metrics.request_finished(call.tenant.name)


def spec_info(call: Call, stats) -> dict:
    steps = stats.steps
    return {
        "enabled": stats.spec_enabled,
        "reason": call.spec_reason or stats.spec_reason,
        "route": call.route.name,
        "steps": steps,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        "acceptance_rate": round(stats.accepted_tokens / stats.draft_tokens, 4) if stats.draft_tokens else 0.0,
        "draft_sources": dict(stats.draft_sources),
        "prefill_ms": round(stats.prefill_seconds * 1e3, 2),
        "decode_ms": round(stats.decode_seconds * 1e3, 2),
        "tokens_per_second": round(stats.tokens_per_second, 2),
    }


def usage(call: Call, completion_ids: Sequence[int], stats: GenerationStats | None = None) -> dict:
    u: dict[str, Any] = {"prompt_tokens": len(call.ids), "completion_tokens": len(completion_ids),
                         "total_tokens": len(call.ids) + len(completion_ids),
                         # prompt tokens whose KV the prefix cache served (OpenAI's field)
                         "prompt_tokens_details": {"cached_tokens": getattr(stats, "cached_tokens", 0)}}
    if call.prediction is not None:
        acc, rej = prediction_usage(call.prediction, completion_ids)
        u["completion_tokens_details"] = {"accepted_prediction_tokens": acc, "rejected_prediction_tokens": rej}
    return u


def _finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "length"


async def _collect(request: Request, job: Job):
    """Wait for a non-streamed job; cancel it if the client goes away."""
    while True:
        try:
            kind, value = await asyncio.wait_for(job.events.get(), timeout=0.5)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel()
            continue
        if kind == "tokens":
            continue
        if job.shutdown and (kind != "done" or value.finish_reason == "cancelled"):
            raise _shutting_down()
        if kind == "done":
            if value.finish_reason == "cancelled" and job.timed_out:
                raise APIError(504, "request timed out", type="server_error", code="timeout")
            return value
        if kind == "cancelled":
            if job.timed_out:
                raise APIError(504, "request timed out while queued", type="server_error", code="timeout")
            raise APIError(499, "request cancelled", type="server_error", code="cancelled")
        raise _engine_error(value)


def _shutting_down() -> APIError:
    return APIError(503, "server shutting down; retry on another instance", type="server_error",
                    code="shutting_down")


def _engine_error(e: Any) -> APIError:
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), param=e.param, code="invalid_value")
    print(f"[agentspec] generation failed: {e!r}", file=sys.stderr, flush=True)
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error", code="internal_error")


def _final_chunks(call: Call, gen, head: dict, choice: dict):
    """The last chunk(s) of a streamed completion: ``choice`` with the finish reason (and the
    spec stats when asked), then, with ``stream_options.include_usage``, the usage chunk."""
    last = {**head, "choices": [choice]}
    if call.want_stats:
        last["spec"] = spec_info(call, gen.stats)
    if not call.include_usage:
        return [last]
    last["usage"] = None
    return [last, {**head, "choices": [], "usage": usage(call, gen.token_ids, gen.stats)}]


def _sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


async def _stream_events(job: Job, call: Call, tokenizer, chunk, final,
                         progress: dict | None = None) -> AsyncIterator[bytes]:
    """SSE bytes for a job: ``chunk(text)`` per text delta, ``final(gen, tail)`` at the end.
    ``progress``: a dict kept at the committed ``completion_tokens`` and decode ``steps`` so far."""
    text = TextStream(tokenizer, call.stop)
    try:
        while True:
            kind, value = await job.events.get()
            if kind == "tokens":
                if progress is not None:
                    progress["completion_tokens"] += len(value)
                    progress["steps"] += 1
                delta = text.push(value)
                if delta:
                    yield _sse(chunk(delta))
                continue
            if kind == "done" and not (value.finish_reason == "cancelled" and (job.timed_out or job.shutdown)):
                for obj in final(value, text.finish(value.text)):
                    yield _sse(obj)
            else:  # an error, a cancellation, or a timeout after the stream started
                err = (_shutting_down() if job.shutdown
                       else APIError(504, "request timed out", type="server_error", code="timeout") if job.timed_out
                       else APIError(499, "request cancelled", type="server_error", code="cancelled")
                       if kind == "cancelled" else _engine_error(value))
                yield _sse(err.body())
            yield b"data: [DONE]\n\n"
            return
    finally:
        job.cancel()  # client gone (task cancelled) or done: either way the engine may stop


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---- endpoints ---------------------------------------------------------------------------------------

async def _parse(request: Request, body_type):
    """What every generation endpoint starts with: (state, arrival time, tenant, body, model id,
    session id or None). A session of another tenant is a 403 here, before anything runs."""
    state: ServerState = request.app.state.agentspec
    t0 = time.monotonic()
    tenant = _authenticate(state, request)
    req = decode_body(await _read_body(request, state.config.server.max_body_bytes), body_type)
    req.check_unsupported()
    model = _check_model(state, req.model)
    return state, t0, tenant, req, model, _session(state, tenant, req)


def _session_error(e: Exception, param: str) -> APIError:
    if isinstance(e, SessionNotFoundError):
        return APIError(404, str(e), type="not_found_error", param=param, code="session_not_found")
    if isinstance(e, SessionForbiddenError):
        return APIError(403, str(e), type="permission_error", param=param, code="session_forbidden")
    return APIError(400, str(e), param=param, code="invalid_value")


def _session(state: ServerState, tenant: Tenant, req) -> str | None:
    """The request's session id, checked against (or bound to) ``tenant``: an explicit ``session``
    must exist; ``prompt_cache_key`` is bound at first use. ``user`` (OpenAI's end-user id: two
    tenants may well both have a "user-1") names the session only when neither is given, and is
    never bound: it groups the tenant's own records and cannot be refused for another tenant's."""
    for param in ("session", "prompt_cache_key"):
        sid = getattr(req, param, None)
        if not sid:
            continue
        try:
            if param == "session":
                return state.sessions.get(tenant.name, sid).id
            return state.sessions.bind(tenant.name, sid).id
        except (SessionNotFoundError, SessionForbiddenError, ValueError) as e:
            raise _session_error(e, param) from None
    user = getattr(req, "user", None)
    return user or None


async def chat_completions(request: Request) -> Response:
    state, t0, tenant, req, model, session = await _parse(request, ChatCompletionRequest)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
                for m in req.messages]
    prediction = _text(req.prediction.content) if req.prediction is not None else None
    endpoint = "chat.completions"
    # Morph/Relace-style fast apply in a chat message: the original code is the draft source
    messages, apply_code = chat_fast_apply(messages)
    if apply_code is not None and prediction is None:
        prediction = apply_code
    try:
        ids = state.backend.encode_chat(messages)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    temperature = 1.0 if req.temperature is None else req.temperature
    call = _resolve(state, endpoint=endpoint, tenant=tenant, model=model, ids=ids, temperature=temperature,
                    top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=req.stop,
                    max_tokens=req.max_completion_tokens or req.max_tokens, speculation=req.speculation,
                    prediction=prediction, session=session, stream=req.stream,
                    include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    want_stats=req.spec_stats, t0=t0, prefix="chatcmpl")
    job = _submit(state, call)
    base = {"id": call.request_id, "created": call.created, "model": model}
    if not call.stream:
        gen = await _collect(request, job)
        body = {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                             "logprobs": None, "finish_reason": _finish_reason(gen.finish_reason)}],
                "usage": usage(call, gen.token_ids, gen.stats)}
        if call.want_stats:
            body["spec"] = spec_info(call, gen.stats)
        return Response(_json.encode(body), media_type="application/json")

    def chunk(delta: str, *, role: bool = False) -> dict:
        c = {**base, "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": ({"role": "assistant", "content": delta} if role
                                                 else {"content": delta}), "logprobs": None, "finish_reason": None}]}
        if call.include_usage:
            c["usage"] = None
        return c

    def final(gen, tail: str):
        return _final_chunks(call, gen, {**base, "object": "chat.completion.chunk"},
                             {"index": 0, "delta": {"content": tail} if tail else {}, "logprobs": None,
                              "finish_reason": _finish_reason(gen.finish_reason)})

    async def body():
        yield _sse(chunk("", role=True))
        async for b in _stream_events(job, call, state.backend.tokenizer, chunk, final):
            yield b

    return StreamingResponse(body(), media_type="text/event-stream", headers=_SSE_HEADERS)


async def completions(request: Request) -> Response:
    state, t0, tenant, req, model, session = await _parse(request, CompletionRequest)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request is supported, got a batch of {len(prompt)}", param="prompt",
                           code="unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        ids = state.backend.encode_text(prompt)  # a completion prompt is raw text: no chat template
    elif not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise APIError(400, "prompt must be a string, a list of token ids, or a batch of one of either",
                       param="prompt", code="invalid_value")
    else:
        ids = list(prompt)  # token ids: the backend checks them at submit (param "prompt")
    temperature = 1.0 if req.temperature is None else req.temperature
    call = _resolve(state, endpoint="completions", tenant=tenant, model=model, ids=ids, temperature=temperature,
                    top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=req.stop, max_tokens=req.max_tokens,
                    speculation=req.speculation,
                    prediction=_text(req.prediction.content) if req.prediction is not None else None,
                    session=session, stream=req.stream,
                    include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    want_stats=req.spec_stats, t0=t0, prefix="cmpl")
    job = _submit(state, call)
    base = {"id": call.request_id, "object": "text_completion", "created": call.created, "model": model}
    if not call.stream:
        gen = await _collect(request, job)
        body = {**base, "choices": [{"index": 0, "text": gen.text, "logprobs": None,
                                     "finish_reason": _finish_reason(gen.finish_reason)}],
                "usage": usage(call, gen.token_ids, gen.stats)}
        if call.want_stats:
            body["spec"] = spec_info(call, gen.stats)
        return Response(_json.encode(body), media_type="application/json")

    def chunk(delta: str) -> dict:
        c = {**base, "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": None}]}
        if call.include_usage:
            c["usage"] = None
        return c

    def final(gen, tail: str):
        return _final_chunks(call, gen, base, {"index": 0, "text": tail, "logprobs": None,
                                               "finish_reason": _finish_reason(gen.finish_reason)})

    return StreamingResponse(_stream_events(job, call, state.backend.tokenizer, chunk, final),
                             media_type="text/event-stream", headers=_SSE_HEADERS)


def _read_workspace_file(tenant: Tenant, path: str, limit: int) -> str:
    try:
        # what the workspace ignores (.gitignore, its ignore list, .git/) is refused like outside it
        ignored = tenant.workspace.ignored if tenant.workspace is not None else None
        return resolve_workspace_path(tenant.root, path, max_bytes=limit, tenant=tenant.name, ignored=ignored)[1]
    except ApplyPathError as e:
        raise APIError(e.status, str(e), type=e.type, param=e.param, code=e.code) from None


async def apply(request: Request) -> Response:
    state, t0, tenant, req, model, session = await _parse(request, ApplyRequest)
    if (req.code is None) == (req.path is None):
        raise APIError(400, "give exactly one of `code` or `path`", param="code", code="invalid_value")
    if not req.update and not req.instruction:
        raise APIError(400, "give `update` (an edit snippet) and/or `instruction`", param="update",
                       code="invalid_value")
    code = req.code if req.code is not None else _read_workspace_file(tenant, req.path,
                                                                        state.config.server.max_body_bytes)
    name = Path(req.path).name if req.path is not None else "the file"
    try:
        plan = build_apply(code, req.update, req.instruction, name, tokenizer=state.backend.tokenizer)
        ids = state.backend.encode_chat(plan.messages)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param if e.param != "messages" else "code",
                       code="invalid_value") from None
    code_ids = plan.prediction_ids   # the draft source, and the output's expected size
    max_tokens = req.max_tokens
    if max_tokens is None:  # room for the whole file and the update, within the context window
        max_tokens = plan.max_tokens(state.backend.max_context - len(ids))
    call = _resolve(state, endpoint="apply", tenant=tenant, model=model, ids=ids, temperature=req.temperature,
                    top_p=None, top_k=None, seed=req.seed, stop=None, max_tokens=max_tokens,
                    speculation=req.speculation, prediction=code_ids, session=session, stream=req.stream,
                    include_usage=True, want_stats=True, t0=t0, prefix="apply")
    job = _submit(state, call)
    base = {"id": call.request_id, "object": "apply", "created": call.created, "model": model}
    if req.path is not None:
        base["path"] = req.path
    if not call.stream:
        gen = await _collect(request, job)
        return Response(_json.encode({**base, "merged_code": plan.finish(gen.text),
                                      "finish_reason": _finish_reason(gen.finish_reason),
                                      "usage": usage(call, gen.token_ids, gen.stats), "spec": spec_info(call, gen.stats)}),
                        media_type="application/json")

    progress = {"completion_tokens": 0, "steps": 0}   # on every chunk: an editor's progress bar and MAT so far

    def chunk(delta: str) -> dict:
        return {**base, "object": "apply.chunk", "delta": delta, **progress}

    def final(gen, tail: str):
        yield {**base, "object": "apply.chunk", "delta": tail, "merged_code": plan.finish(gen.text),
               "finish_reason": _finish_reason(gen.finish_reason), "usage": usage(call, gen.token_ids, gen.stats),
               "spec": spec_info(call, gen.stats)}

    return StreamingResponse(_stream_events(job, call, state.backend.tokenizer, chunk, final, progress),
                             media_type="text/event-stream", headers=_SSE_HEADERS)


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.agentspec
    _authenticate(state, request)
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def model_detail(request: Request) -> Response:
    state: ServerState = request.app.state.agentspec
    _authenticate(state, request)
    _check_model(state, request.path_params["model"])
    return JSONResponse(_model_card(state))


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
    req = decode_body(raw, SessionCreateRequest) if raw.strip() else SessionCreateRequest()
    try:
        return JSONResponse(state.sessions.create(tenant.name, req.id).body())
    except (SessionForbiddenError, ValueError) as e:
        raise _session_error(e, "id") from None


async def session_detail(request: Request) -> Response:
    """``GET /v1/sessions/{id}``: the caller's own session; 404 unknown, 403 another tenant's."""
    state: ServerState = request.app.state.agentspec
    tenant = _authenticate(state, request)
    try:
        return JSONResponse(state.sessions.get(tenant.name, request.path_params["session"]).body())
    except (SessionNotFoundError, SessionForbiddenError) as e:
        raise _session_error(e, "id") from None


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": int(state.started), "owned_by": "agentspec",
            "max_model_len": state.backend.max_context}


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.agentspec
    h = state.backend.health()
    sizes = {}   # memory that grows with use (for operators and the soak test): no prompts, no names
    index = getattr(state.backend, "index", None)
    if index is not None:
        sizes["index_bytes"] = index.nbytes
    pc = getattr(getattr(state.backend, "engine", None), "prefix_cache", None)
    if pc is not None:
        sizes["prefix_cache_bytes"] = pc.bytes
    # the acceptance logs: "failing" while a tenant's last write failed (disk full, permissions);
    # requests are still served, so the status stays "ok"
    logs = {"logs": getattr(state.sink, "status", "ok"), "log_write_errors": getattr(state.sink, "failed", 0)}
    return JSONResponse({**h, "status": h.get("status", "ok"), "model": state.model_id,
                         "uptime_s": round(time.time() - state.started, 1), **sizes, **logs})


async def metrics(request: Request) -> Response:
    """Prometheus text. With tenants configured it names them: any tenant's key may read it (401
    without one); a server without keys serves it to anyone, like every other endpoint."""
    state: ServerState = request.app.state.agentspec
    _authenticate(state, request)
    body, ctype = state.metrics.render()
    return Response(body, media_type=ctype)


# ---- the app -----------------------------------------------------------------------------------------

def create_app(state: ServerState) -> Starlette:
    """The Starlette app over a built ``ServerState``; closes its backend on shutdown. The backend's
    scheduler runs on the thread that calls ``backend.run()`` (``serve``) or, without one, on a
    thread of its own from the first request (``EmbeddedBackend(background=True)``)."""

    def wrap(handler):
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                return _error(e)
        return endpoint

    async def not_found(request: Request, exc) -> Response:
        return _error(APIError(404, f"no route {request.method} {request.url.path}", type="not_found_error",
                               code="not_found"))

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
        HTTPRoute("/v1/chat/completions", wrap(chat_completions), methods=["POST"]),
        HTTPRoute("/v1/completions", wrap(completions), methods=["POST"]),
        HTTPRoute("/v1/apply", wrap(apply), methods=["POST"]),
        HTTPRoute("/v1/sessions", wrap(create_session), methods=["POST"]),
        HTTPRoute("/v1/sessions/{session:path}", wrap(session_detail), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: method_not_allowed, 500: server_error,
                                        Exception: server_error})
    app.state.agentspec = state
    if hasattr(state.metrics, "watch_log_sink"):
        state.metrics.watch_log_sink(state.sink)   # agentspec:log_write_errors_total
    return app
