"""OpenAI-shaped request handling with no HTTP: what the server and the in-process SDK share.

``prepare`` turns a JSON body for one of the generation endpoints into a ``Prepared`` call:
decoded with the request structs (``protocol``: the same validation, the same 400s), the model
checked, the session resolved for the tenant, the prompt encoded (chat template, fast apply),
resolved against the routes and the context window, with the response shapes (a whole body, the
stream's chunks) bound to it. ``submit`` queues it on the ``Backend`` as a ``Job`` (tenant limits,
draining, errors mapped to 4xx/5xx) and, when it finishes, writes its tenant's acceptance record
and the metrics. ``outcome`` and ``StreamShaper`` turn the job's events into the answer.

The HTTP server (``agentspec.server.app``) adds authentication, body limits, SSE framing and
disconnect checks; the SDK's in-process transport (``agentspec.sdk._local``) queues events on a
thread-safe queue instead of an event loop. Both run everything else here, so an in-process
agent loop leaves the same per-tenant records and uses sessions as a served one does.
"""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from ..apply import ApplyPathError, build_apply, chat_fast_apply, prediction_usage, resolve_workspace_path
from ..backends.protocol import GenerationRequest, OutputFormat
from ..errors import BackendClosedError, ContextLengthError, InvalidRequestError, QueueFullError
from .routing import Route, UnknownRouteError
from ..text import TextStream
from .jobs import Job
from .limits import LimitExceeded
from ..chat import CallArgs, CallStart, Conversation, Message, Reasoning, Text, Tool, ToolCall
from .turns import render_turn
from .protocol import (
    APIError,
    ApplyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    SessionCreateRequest,
    decode_body,
    sampling_temperature,
)
from .sessions import SessionNotFoundError

if TYPE_CHECKING:
    from ..decode.results import GenerationStats
    from .state import ServerState, Tenant

__all__ = ["GENERATION_PATHS", "Call", "Prepared", "StreamShaper", "create_session", "health", "model_card",
           "outcome", "prepare", "session_detail", "shutting_down", "submit", "wire_of"]


# ---- parsing and resolving -------------------------------------------------------------------------------

def check_model(state: ServerState, model: str | None) -> str:
    """The model a request runs on: the one served, whatever name the client gives (agents name
    models the server does not have: Claude Code's background calls name a small one). Responses
    carry the served model's id, so a client can see which answered."""
    return state.model_id


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content)


def _session_error(e: Exception, param: str) -> APIError:
    if isinstance(e, SessionNotFoundError):
        return APIError(404, str(e), type="not_found_error", param=param, code="session_not_found")
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
        except (SessionNotFoundError, ValueError) as e:
            raise _session_error(e, param) from None
    user = getattr(req, "user", None)
    return user or None


@dataclass
class Call:
    """One generation request after parsing, shared by the three endpoints: the request the
    backend runs (``request``: prompt, sampling, the route's spec and drafters, the prediction,
    the id) and what only the response and the log need."""

    endpoint: str
    tenant: Tenant
    request: GenerationRequest
    route: Route
    spec_reason: str                    # set when the request or its route turned speculation off
    session: str | None
    stream: bool
    include_usage: bool
    want_stats: bool
    model: str
    t0: float                           # monotonic time the request arrived
    created: int = field(default_factory=lambda: int(time.time()))
    grammar_param: str | None = None    # the request field its grammar came from (a grammar error names it)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def ids(self) -> list[int]:
        return self.request.prompt_ids


# characters per token a text can have at most before its length alone rules it out (a token of
# ordinary text is ~4 characters; runs of spaces or punctuation tokenize longer: a generous bound)
_CHARS_PER_TOKEN = 32


def _prediction_too_long(size: str, max_context: int) -> APIError:
    return APIError(400, f"prediction of {size} is longer than the context window of {max_context} tokens: no "
                         "completion can repeat it; send the part the completion is expected to reproduce",
                    param="prediction", code="context_length_exceeded")


def _prediction_text(req: Any, max_context: int) -> str | None:
    """The text of ``req.prediction`` (None: none), refused before it is tokenized when it cannot
    fit the context window however it tokenizes (``_CHARS_PER_TOKEN`` characters a token): a
    megabytes-long prediction would otherwise cost seconds of tokenizing, per-token checks and
    diffing before the token-count check (``_resolve``) refuses it."""
    if req.prediction is None:
        return None
    content = req.prediction.content
    size = len(content) if isinstance(content, str) else sum(len(part.text or "") for part in content)
    if size > _CHARS_PER_TOKEN * max_context:
        raise _prediction_too_long(f"{size} characters", max_context)
    return _text(content)


def _resolve(state: ServerState, body: Any, *, endpoint: str, tenant: Tenant, model: str, ids: list[int],
             max_tokens: int | None, prediction: str | list[int] | None, session: str | None, t0: float,
             prefix: str, include_usage: bool, want_stats: bool, grammar: str | None = None,
             grammar_param: str | None = None, output: OutputFormat | None = None) -> Call:
    """The ``Call`` of a decoded request ``body`` (its sampling fields, ``speculation``, ``stream``
    and ``route``; what an endpoint lacks takes its default): the route resolved, the default
    ``max_tokens`` filled in, the prediction tokenized."""
    backend = state.backend
    temperature = getattr(body, "temperature", None)
    # OpenAI's default when unset; below GREEDY_BELOW: greedy (0), as routed and as sampled
    temperature = 1.0 if temperature is None else sampling_temperature(temperature)
    try:
        route = state.router.resolve(endpoint=endpoint, tenant=tenant.name, model=model, temperature=temperature,
                                     name=getattr(body, "route", None))
    except UnknownRouteError as e:
        raise APIError(400, str(e), param="route", code="invalid_value") from None
    if getattr(body, "speculation", None) is False and route.spec is not None:
        route = Route(name=route.name, spec=None, reason="request: speculation = false", drafters=route.drafters)
    room = backend.max_context - len(ids)
    if room < 1:
        raise APIError(400, f"prompt of {len(ids)} tokens does not fit the context window of "
                            f"{backend.max_context} tokens",
                       param={"chat.completions": "messages", "messages": "messages", "responses": "input"}.get(
                           endpoint, "prompt"), code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(state.config.server.default_max_tokens, room)
    else:   # clients ask for more than the model holds (32000 from Claude Code, opencode): the room left
        max_tokens = min(max_tokens, room)
    pred_ids = backend.encode_text(prediction) if isinstance(prediction, str) and prediction else (
        prediction or None)
    if pred_ids is not None and len(pred_ids) > backend.max_context:
        raise _prediction_too_long(f"{len(pred_ids)} tokens", backend.max_context)
    stop = getattr(body, "stop", None)
    top_p, top_k = getattr(body, "top_p", None), getattr(body, "top_k", None)
    request = GenerationRequest(
        prompt_ids=ids, max_tokens=max_tokens, temperature=temperature, top_p=1.0 if top_p is None else top_p,
        top_k=max(top_k or 0, 0), seed=getattr(body, "seed", None), stop=[stop] if isinstance(stop, str) else list(stop or []),
        spec=route.spec, drafters=route.drafters, tenant=tenant.name, request_id=f"{prefix}-{secrets.token_hex(12)}",
        prediction_ids=pred_ids, grammar=grammar, output=output)
    return Call(endpoint=endpoint, tenant=tenant, request=request, route=route, spec_reason=route.reason,
                session=session, stream=getattr(body, "stream", False), include_usage=include_usage,
                want_stats=want_stats, model=model, t0=t0, grammar_param=grammar_param)


# ---- response shapes ----------------------------------------------------------------------------------

def spec_info(call: Call, stats) -> dict:
    return {
        "enabled": stats.spec_enabled,
        "reason": call.spec_reason or stats.spec_reason,
        "route": call.route.name,
        "steps": stats.steps,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        "acceptance_rate": round(stats.accepted_tokens / stats.draft_tokens, 4) if stats.draft_tokens else 0.0,
        "draft_sources": dict(stats.draft_sources),
        # by the drafter that proposed each draft token ("suffix", "json_copy", "grammar" for a
        # grammar's forced tokens): [steps, draft tokens, accepted tokens]
        "by_source": {src: [stats.source_steps.get(src, 0), n, stats.source_accepted.get(src, 0)]
                      for src, n in stats.source_drafted.items()},
        "prefill_ms": round(stats.prefill_seconds * 1e3, 2),
        "decode_ms": round(stats.decode_seconds * 1e3, 2),
        "draft_ms": round(stats.draft_seconds * 1e3, 2),   # inside decode_ms: the drafters' share
        "tokens_per_second": round(stats.tokens_per_second, 2),
    }


def usage(call: Call, completion_ids: Sequence[int], stats: GenerationStats | None = None) -> dict:
    u: dict[str, Any] = {"prompt_tokens": len(call.ids), "completion_tokens": len(completion_ids),
                         "total_tokens": len(call.ids) + len(completion_ids),
                         # prompt tokens whose KV the prefix cache served (OpenAI's field)
                         "prompt_tokens_details": {"cached_tokens": getattr(stats, "cached_tokens", 0)}}
    if call.request.prediction_ids is not None:
        acc, rej = prediction_usage(call.request.prediction_ids, completion_ids)
        u["completion_tokens_details"] = {"accepted_prediction_tokens": acc, "rejected_prediction_tokens": rej}
    return u


def _finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "length"


def _final_chunks(call: Call, gen, head: dict, choice: dict) -> list[dict]:
    """The last chunk(s) of a streamed completion: ``choice`` with the finish reason (and the
    spec stats when asked), then, with ``stream_options.include_usage``, the usage chunk."""
    last = {**head, "choices": [choice]}
    if call.want_stats:
        last["spec"] = spec_info(call, gen.stats)
    if not call.include_usage:
        return [last]
    last["usage"] = None
    return [last, {**head, "choices": [], "usage": usage(call, gen.token_ids, gen.stats)}]


@dataclass
class Prepared:
    """A resolved call and its response shapes: ``respond(gen)`` the whole body; for a stream,
    ``opening`` (chunks before any text), ``chunk(delta)`` the chunks (events) of a text delta,
    ``final(gen, tail)`` the closing chunks; ``progress`` (apply): committed tokens and steps so
    far, on every chunk. ``wire``: the protocol that frames them (``agentspec.server.app``:
    OpenAI's ``data:`` lines and ``[DONE]``, or named ``event:`` lines), ``error_chunks(e)`` what
    a stream sends when it fails after it started, ``heartbeat()`` what it sends after a quiet
    while (None: an SSE comment; chat: a chunk with an empty delta)."""

    call: Call
    respond: Callable[[Any], dict]
    chunk: Callable[[str], list[dict]]
    final: Callable[[Any, str], list[dict]]
    opening: list[dict] = field(default_factory=list)
    progress: dict | None = None
    wire: str = "openai"
    error_chunks: Callable[[APIError], list[dict]] | None = None
    heartbeat: Callable[[], list[dict]] | None = None


def openai_conversation(req: ChatCompletionRequest) -> Conversation:
    """An OpenAI Chat Completions body as the conversation inside (``agentspec.chat``)."""
    messages = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        calls = [ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in m.tool_calls or ()]
        if role == "tool" and not m.tool_call_id:
            raise APIError(400, f"messages[{i}] is a tool result without `tool_call_id`",
                           param=f"messages[{i}].tool_call_id", code="invalid_value")
        # a message's name goes to the chat template, as OpenAI-compatible servers pass it (clients such as
        # AutoGen send one on every message); the bundled and Qwen templates do not show it
        thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thought and role != "assistant":
            raise APIError(400, f"messages[{i}]: only an assistant message carries reasoning, this one is {m.role!r}",
                           param=f"messages[{i}].reasoning_content", code="invalid_value")
        messages.append(Message(role=role, content=_text(m.content), tool_calls=calls, tool_call_id=m.tool_call_id,
                                name=m.name, reasoning=thought or ""))
    tools = [Tool(name=t.function.name, description=t.function.description, parameters=t.function.parameters or {},
                  strict=bool(t.function.strict)) for t in req.tools or ()]
    choice, forced = "auto", None
    tc = req.tool_choice
    if isinstance(tc, str):
        choice = tc
    elif tc is not None:
        choice, forced = "function", tc.function.name
    if not tools and choice == "auto":
        choice = "auto"
    schema, strict = None, False
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        schema = {"type": "object"}
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs `json_schema` ({name, schema, strict})",
                           param="response_format.json_schema", code="invalid_value")
        schema = rf.json_schema.schema if rf.json_schema.schema is not None else {}
        strict = bool(rf.json_schema.strict)
    thinking = (req.chat_template_kwargs or {}).get("enable_thinking")
    if thinking is None and req.reasoning_effort == "none":
        thinking = False
    return Conversation(messages=messages, tools=tools, tool_choice=choice, forced_tool=forced,
                        parallel_tool_calls=req.parallel_tool_calls is not False, response_schema=schema,
                        response_strict=strict, thinking=thinking)


def _openai_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _chat(state: ServerState, tenant: Tenant, req: ChatCompletionRequest, model: str, session: str | None,
          t0: float) -> Prepared:
    conv = openai_conversation(req)
    prediction = _prediction_text(req, state.backend.max_context)
    if not conv.tools and conv.response_schema is None:
        # Morph/Relace-style fast apply in a chat message: the original code is the draft source
        plain = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name is not None else {})}
                 for m in conv.messages]
        if all(not m.tool_calls and m.role != "tool" for m in conv.messages):
            plain, apply_code = chat_fast_apply(plain)
            if apply_code is not None and prediction is None:
                prediction = apply_code
            if apply_code is not None:   # its merge instructions, as the system message
                conv.messages = [Message(role=p["role"], content=p["content"], name=p.get("name")) for p in plain]
    turn = render_turn(state, conv)
    call = _resolve(state, req, endpoint="chat.completions", tenant=tenant, model=model, ids=turn.ids,
                    max_tokens=req.max_completion_tokens or req.max_tokens, prediction=prediction, session=session,
                    t0=t0, prefix="chatcmpl", include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    want_stats=req.spec_stats, grammar=turn.grammar, grammar_param=turn.grammar_param,
                    output=turn.output)
    base = {"id": call.request_id, "created": call.created, "model": model}
    parser = turn.parser("call_")   # the stream's (a whole answer gets its own)

    def finish_reason(gen, p) -> str:
        if p.calls and not p.incomplete:
            return "tool_calls"
        return _finish_reason(gen.finish_reason)

    def respond(gen) -> dict:
        p = turn.parser("call_")
        p.push(gen.text)
        p.finish()
        text = "".join(p.content)
        message: dict[str, Any] = {"role": "assistant", "content": (text.strip() or None) if p.calls else text}
        if p.reasoning:
            message["reasoning_content"] = "".join(p.reasoning)
        if p.calls:
            message["tool_calls"] = [_openai_call(c.id, c.name, c.arguments) for c in p.calls]
        body = {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": finish_reason(gen, p)}],
                "usage": usage(call, gen.token_ids, gen.stats)}
        if call.want_stats:
            body["spec"] = spec_info(call, gen.stats)
        return body

    def delta_chunk(delta: dict) -> dict:
        c = {**base, "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
        if call.include_usage:
            c["usage"] = None
        return c

    def shape(events) -> list[dict]:
        out = []
        for ev in events:
            if isinstance(ev, Text):
                out.append(delta_chunk({"content": ev.text}))
            elif isinstance(ev, Reasoning):
                out.append(delta_chunk({"reasoning_content": ev.text}))
            elif isinstance(ev, CallStart):
                out.append(delta_chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                                        "function": {"name": ev.name, "arguments": ""}}]}))
            elif isinstance(ev, CallArgs):
                out.append(delta_chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.delta}}]}))
        return out

    def chunk(delta: str) -> list[dict]:
        return shape(parser.push(delta))

    def final(gen, tail: str) -> list[dict]:
        out = shape(parser.push(tail) + parser.finish())
        return out + _final_chunks(call, gen, {**base, "object": "chat.completion.chunk"},
                                   {"index": 0, "delta": {}, "logprobs": None,
                                    "finish_reason": finish_reason(gen, parser)})

    # a heartbeat is a chunk with an empty delta, not only an SSE comment: Qwen Code's idle guard counts chunks
    return Prepared(call, respond, chunk, final, opening=[delta_chunk({"role": "assistant", "content": ""})],
                    heartbeat=lambda: [delta_chunk({})])


def _completion(state: ServerState, tenant: Tenant, req: CompletionRequest, model: str, session: str | None,
                t0: float) -> Prepared:
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
    call = _resolve(state, req, endpoint="completions", tenant=tenant, model=model, ids=ids, max_tokens=req.max_tokens,
                    prediction=_prediction_text(req, state.backend.max_context),
                    session=session, t0=t0, prefix="cmpl",
                    include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    want_stats=req.spec_stats)
    base = {"id": call.request_id, "object": "text_completion", "created": call.created, "model": model}

    def respond(gen) -> dict:
        body = {**base, "choices": [{"index": 0, "text": gen.text, "logprobs": None,
                                     "finish_reason": _finish_reason(gen.finish_reason)}],
                "usage": usage(call, gen.token_ids, gen.stats)}
        if call.want_stats:
            body["spec"] = spec_info(call, gen.stats)
        return body

    def chunk(delta: str) -> list[dict]:
        c = {**base, "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": None}]}
        if call.include_usage:
            c["usage"] = None
        return [c]

    def final(gen, tail: str) -> list[dict]:
        return _final_chunks(call, gen, base, {"index": 0, "text": tail, "logprobs": None,
                                               "finish_reason": _finish_reason(gen.finish_reason)})

    return Prepared(call, respond, chunk, final)


def _read_workspace_file(state: ServerState, tenant: Tenant, path: str, limit: int) -> str:
    try:
        # what the workspace ignores (.gitignore, its ignore list, .git/) is refused like outside it,
        # and the server's own files (config, logs, caches) whatever the workspace says
        ignored = tenant.workspace.ignored if tenant.workspace is not None else None
        return resolve_workspace_path(tenant.root, path, max_bytes=limit, tenant=tenant.name, ignored=ignored,
                                      owned=state.owned)[1]
    except ApplyPathError as e:
        raise APIError(e.status, str(e), type=e.type, param=e.param, code=e.code) from None


def _apply(state: ServerState, tenant: Tenant, req: ApplyRequest, model: str, session: str | None,
           t0: float) -> Prepared:
    if (req.code is None) == (req.path is None):
        raise APIError(400, "give exactly one of `code` or `path`", param="code", code="invalid_value")
    if not req.update and not req.instruction:
        raise APIError(400, "give `update` (an edit snippet) and/or `instruction`", param="update",
                       code="invalid_value")
    code = req.code if req.code is not None else _read_workspace_file(state, tenant, req.path,
                                                                        state.config.server.max_body_bytes)
    name = Path(req.path).name if req.path is not None else "the file"
    try:
        plan = build_apply(code, req.update, req.instruction, name, tokenizer=state.backend.tokenizer)
        ids = state.backend.encode_chat(plan.messages)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param if e.param != "messages" else "code",
                       code="invalid_value") from None
    max_tokens = req.max_tokens
    if max_tokens is None:  # room for the whole file and the update, within the context window
        max_tokens = plan.max_tokens(state.backend.max_context - len(ids))
    call = _resolve(state, req, endpoint="apply", tenant=tenant, model=model, ids=ids, max_tokens=max_tokens,
                    prediction=plan.prediction_ids, session=session, t0=t0, prefix="apply", include_usage=True,
                    want_stats=True)
    base = {"id": call.request_id, "object": "apply", "created": call.created, "model": model}
    if req.path is not None:
        base["path"] = req.path

    def respond(gen) -> dict:
        return {**base, "merged_code": plan.finish(gen.text), "finish_reason": _finish_reason(gen.finish_reason),
                "usage": usage(call, gen.token_ids, gen.stats), "spec": spec_info(call, gen.stats)}

    progress = {"completion_tokens": 0, "steps": 0}   # on every chunk: an editor's progress bar and MAT so far

    def chunk(delta: str) -> list[dict]:
        return [{**base, "object": "apply.chunk", "delta": delta, **progress}]

    def final(gen, tail: str) -> list[dict]:
        return [{**respond(gen), "object": "apply.chunk", "delta": tail}]

    return Prepared(call, respond, chunk, final, progress=progress)


# path -> (request struct, preparer)
GENERATION_PATHS: dict[str, tuple[Any, Callable[..., Prepared]]] = {
    "/v1/chat/completions": (ChatCompletionRequest, _chat),
    "/v1/completions": (CompletionRequest, _completion),
    "/v1/apply": (ApplyRequest, _apply),
}


def wire_of(path: str) -> str:
    """The wire protocol a path speaks (its errors' envelope, its stream's framing)."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/responses"):
        return "responses"
    return "openai"


def _register_adapters() -> None:
    from . import anthropic, responses

    GENERATION_PATHS["/v1/messages"] = (anthropic.MessagesRequest, anthropic.prepare_messages)
    GENERATION_PATHS["/v1/responses"] = (responses.ResponsesRequest, responses.prepare_responses)


def prepare(state: ServerState, path: str, tenant: Tenant, body: bytes, *, t0: float | None = None,
            stream: bool | None = None) -> Prepared:
    """``body`` (JSON bytes) for the generation endpoint ``path``, decoded, checked and resolved
    for ``tenant``; ``t0``: when the request arrived (monotonic; default now). ``stream``: force
    the body's ``stream`` (the SDK's transports choose it). A session of another tenant is a 403
    here, before anything runs."""
    t0 = time.monotonic() if t0 is None else t0
    if path not in GENERATION_PATHS:
        raise APIError(404, f"no route POST {path}", type="not_found_error", code="not_found")
    admit(state, tenant)
    body_type, preparer = GENERATION_PATHS[path]
    req = decode_body(body, body_type)
    if stream is not None and req.stream != stream:
        req = msgspec.structs.replace(req, stream=stream)
    req.check_unsupported()   # after the forced ``stream``: stream_options go with a stream
    model = check_model(state, req.model)
    return preparer(state, tenant, req, model, _session(state, tenant, req), t0)


# ---- running a call -------------------------------------------------------------------------------

_PARAMS = {"prediction_ids": "prediction"}   # GenerationRequest fields -> the API's names


def shutting_down() -> APIError:
    return APIError(503, "server shutting down; retry on another instance", type="server_error",
                    code="shutting_down")


def engine_error(e: Any) -> APIError:
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), param=e.param, code="invalid_value")
    print(f"[agentspec] generation failed: {e!r}", file=sys.stderr, flush=True)
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error", code="internal_error")


def _rate_limited(e: LimitExceeded) -> APIError:
    return APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(e.retry_after)})


def admit(state: ServerState, tenant: Tenant) -> None:
    """Before a request is read or tokenized: 503 when the server is shutting down, 429 when its
    tenant is at its limits (``submit`` takes the slot; this only asks, so a tenant over its
    limits costs the others no parsing, tokenizing or file reads)."""
    if state.draining:
        raise shutting_down()
    try:
        state.limits.check(tenant.name)
    except LimitExceeded as e:
        raise _rate_limited(e) from None


def submit(state: ServerState, call: Call, emit: Callable[[str, Any], None], *,
           deadline: float | None = None) -> Job:
    """Queue ``call`` on the backend as a ``Job`` whose events go to ``emit(kind, value)`` (on
    the scheduler thread). Bad values raise 400s now, a full queue a 503, a tenant over its
    limits a 429. ``deadline`` (monotonic): default the arrival plus ``request_timeout_s``. When
    the job finishes, whatever its end, its tenant's acceptance log gets one record."""
    tenant = call.tenant.name
    request = call.request
    if state.draining:
        raise shutting_down()
    try:
        limited = state.limits.acquire(tenant)
    except LimitExceeded as e:
        raise _rate_limited(e) from None

    def on_finish(job: Job, kind: str, value: Any):
        with state.jobs_lock:
            state.jobs.discard(job)
        if limited:
            state.limits.release(tenant)
        _record(state, call, job, kind, value)

    if deadline is None:
        deadline = call.t0 + state.config.server.request_timeout_s
    job = Job(request, deadline=deadline, emit=emit, on_finish=on_finish)
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
        param = call.grammar_param if e.__class__ is InvalidRequestError and getattr(e, "param", None) == "grammar" \
            else _PARAMS.get(getattr(e, "param", None), getattr(e, "param", None))
        if isinstance(e, ContextLengthError):
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        if isinstance(e, InvalidRequestError):
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        if isinstance(e, QueueFullError):
            raise APIError(503, f"server overloaded: {e}", type="server_error", code="overloaded") from None
        if isinstance(e, BackendClosedError):
            raise shutting_down() from None
        raise
    return job


def _record(state: ServerState, call: Call, job: Job, kind: str, value: Any) -> None:
    """One acceptance-log record and the metrics for a finished (or failed) request."""
    from ..decode.results import GenerationStats
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


def outcome(job: Job, kind: str, value: Any):
    """The ``Generation`` of a job that ended with event ``(kind, value)``, or the APIError its
    client gets (504 timed out, 499 cancelled, 503 shutting down, 400/500 from the engine)."""
    if job.shutdown and (kind != "done" or value.finish_reason == "cancelled"):
        raise shutting_down()
    if kind == "done":
        if value.finish_reason == "cancelled" and job.timed_out:
            raise APIError(504, "request timed out", type="server_error", code="timeout")
        return value
    if kind == "cancelled":
        if job.timed_out:
            raise APIError(504, "request timed out while queued", type="server_error", code="timeout")
        raise APIError(499, "request cancelled", type="server_error", code="cancelled")
    raise engine_error(value)


class StreamShaper:
    """A streamed call's events as the chunks its client reads: ``events(kind, value)`` returns
    ``(chunks, error, done)`` for one job event; ``error`` is the APIError to send (as the
    stream's last data) when the job ended badly after the stream started."""

    def __init__(self, prepared: Prepared, tokenizer: Any) -> None:
        self.prepared = prepared
        self.text = TextStream(tokenizer, prepared.call.request.stop)

    def events(self, job: Job, kind: str, value: Any) -> tuple[list[dict], APIError | None, bool]:
        p = self.prepared
        if kind == "tokens":
            if p.progress is not None:
                p.progress["completion_tokens"] += len(value)
                p.progress["steps"] += 1
            delta = self.text.push(value)
            return (p.chunk(delta) if delta else []), None, False
        if kind == "done" and not (value.finish_reason == "cancelled" and (job.timed_out or job.shutdown)):
            return list(p.final(value, self.text.finish(value.text))), None, True
        # an error, a cancellation, or a timeout after the stream started
        err = (shutting_down() if job.shutdown
               else APIError(504, "request timed out", type="server_error", code="timeout") if job.timed_out
               else APIError(499, "request cancelled", type="server_error", code="cancelled")
               if kind in ("cancelled", "done") else engine_error(value))
        return [], err, True


# ---- the other endpoints ------------------------------------------------------------------------------

def model_card(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": int(state.started), "owned_by": "agentspec",
            "max_model_len": state.backend.max_context}


def create_session(state: ServerState, tenant: Tenant, body: bytes) -> dict:
    """``POST /v1/sessions``: a session for ``tenant`` (body optional: ``{"id": ...}``)."""
    req = decode_body(body, SessionCreateRequest) if body.strip() else SessionCreateRequest()
    try:
        return state.sessions.create(tenant.name, req.id).body()
    except ValueError as e:
        raise _session_error(e, "id") from None


def session_detail(state: ServerState, tenant: Tenant, session_id: str) -> dict:
    """``GET /v1/sessions/{id}``: the tenant's own session; 404 unknown (another tenant's too)."""
    try:
        return state.sessions.get(tenant.name, session_id).body()
    except SessionNotFoundError as e:
        raise _session_error(e, "id") from None


def health(state: ServerState) -> dict:
    """``GET /health``: the backend's health, memory that grows with use (for operators and the
    soak test: no prompts, no names) and whether the acceptance logs are being written."""
    h = state.backend.health()
    sizes = state.backend.memory()
    # the acceptance logs: "failing" while a tenant's last write failed (disk full, permissions);
    # requests are still served, so the status stays "ok"
    logs = {"logs": getattr(state.sink, "status", "ok"), "log_write_errors": getattr(state.sink, "failed", 0)}
    return {**h, "status": h.get("status", "ok"), "model": state.model_id,
            "uptime_s": round(time.time() - state.started, 1), **sizes, **logs}


_register_adapters()
