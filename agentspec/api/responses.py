"""OpenAI Responses (``POST /v1/responses``), stateless: the adapter in and out.

In: ``input`` (text, or items: messages with ``input_text`` / ``output_text`` parts,
``function_call`` and ``function_call_output`` items; ``reasoning`` items: their
``reasoning_text`` content as the next assistant turn's thoughts, shown to the model where its
chat template shows them, summaries and encrypted content dropped), ``instructions``, function
``tools`` (``call_id`` distinct from the item ``id``) and ``namespace`` tools (their functions
offered as ``namespace.name``; a call to one comes back with ``namespace`` and its bare ``name``),
``tool_choice``, ``parallel_tool_calls``,
``text.format`` (``json_schema`` / ``json_object``), ``max_output_tokens``. Nothing is stored
(``store`` is accepted; there is no stored state to return): ``previous_response_id`` and
``conversation`` are refused by name, and so are freeform ``custom`` tools (Codex's
``apply_patch`` in its freeform form: Codex falls back to its JSON function form), hosted tools
other than web search, images and files. The hosted ``web_search`` tool (Codex offers it by default)
is accepted and not offered to the model: an offered tool is a permission, and the answer is one
a model that chose not to search gives. ``reasoning.effort`` ``none`` turns a thinking model's
thoughts off (Qwen3's ``enable_thinking``). Hints (other efforts, ``include``, ``metadata``,
``client_metadata``, ``user``, ``truncation``, ``prompt_cache_key`` -- a session, as on Chat
Completions) are accepted.

Out: the response object (``output`` items: a thinking model's ``reasoning`` item with its
``reasoning_text``, a ``message`` with ``output_text``, ``function_call`` items) or its stream,
every event with its ``sequence_number``: ``response.created``,
``response.in_progress``, ``response.output_item.added`` / ``.done``,
``response.content_part.added`` / ``.done``, ``response.reasoning_text.delta`` / ``.done``,
``response.output_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done``, and always a last
``response.completed`` (status ``completed``, or ``incomplete`` with its reason) or
``response.failed`` (with its error code, e.g. ``context_length_exceeded``).
"""

from __future__ import annotations

import json
import secrets
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from ..backends.protocol import MAX_TEMPERATURE
from ..chat import CallArgs, CallEnd, CallStart, Conversation, Message, Reasoning, Text, Tool, ToolCall
from .protocol import APIError, sampling_temperature
from .turns import render_turn

if TYPE_CHECKING:
    from .handling import Prepared
    from .state import ServerState, Tenant

__all__ = ["ResponsesRequest", "prepare_responses"]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class FunctionTool(_Strict):
    type: str                      # "function"; anything else is refused by name (check_unsupported)
    name: str | None = None
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    format: Any = None             # a custom tool's grammar (refused with the tool)
    tools: list[FunctionTool] | None = None   # a ``namespace`` tool's function tools
    # a hosted web search's options (the tool itself is accepted and not offered: ``_WEB_SEARCH``)
    external_web_access: bool | None = None
    search_context_size: str | None = None
    user_location: Any = None
    filters: Any = None


class NamedChoice(_Strict):
    type: Literal["function", "custom", "allowed_tools"]
    name: str | None = None
    mode: str | None = None
    tools: Any = None


class TextFormat(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema: dict | None = None
    description: str | None = None
    strict: bool | None = None


class TextParam(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None    # a hint


class ReasoningParam(_Strict):
    effort: str | None = None       # "none": a thinking model's thoughts off; otherwise a hint
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Strict, kw_only=True):
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_tool_calls: int | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    text: TextParam | None = None
    reasoning: ReasoningParam | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    stream_options: Any = None
    client_metadata: dict | None = None   # a hint: the client's own ids (Codex's turn metadata)
    # agentspec extensions (as on the other endpoints)
    seed: int | None = None
    speculation: bool | None = None
    route: str | None = None
    spec_stats: bool = False

    def check_unsupported(self) -> None:
        if self.previous_response_id is not None:
            raise APIError(400, "previous_response_id is not supported: this server stores no responses (it is "
                                "stateless); send the whole conversation as `input` items, with store: false",
                           param="previous_response_id", code="unsupported_parameter")
        for name, what in (("conversation", "conversations"), ("prompt", "stored prompts")):
            if getattr(self, name) is not None:
                raise APIError(400, f"`{name}` is not supported: this server keeps no {what}", param=name,
                               code="unsupported_parameter")
        if self.background:
            raise APIError(400, "background responses are not supported (nothing is stored to poll)",
                           param="background", code="unsupported_parameter")
        if self.top_logprobs:
            raise APIError(400, "top_logprobs is not supported (logprobs are not computed)", param="top_logprobs",
                           code="unsupported_parameter")
        if self.max_tool_calls is not None:
            raise APIError(400, "max_tool_calls is not supported; leave it out", param="max_tool_calls",
                           code="unsupported_parameter")
        for i, t in enumerate(self.tools or ()):
            _check_tool(t, f"tools[{i}]", top=True)
        tc = self.tool_choice
        if tc is not None and not isinstance(tc, str) and tc.type != "function":
            raise APIError(400, f"tool_choice of type {tc.type!r} is not supported (auto, none, required or a "
                                "function by name)", param="tool_choice", code="unsupported_parameter")


# the hosted web search (Codex offers it by default): accepted and not offered to the model, which
# answers as a model that chose not to search does; an offered tool is a permission, not an order
_WEB_SEARCH = frozenset({"web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11"})
_WEB_FIELDS = ("external_web_access", "search_context_size", "user_location", "filters")


def _check_tool(t: FunctionTool, where: str, *, top: bool) -> None:
    if top and t.type in _WEB_SEARCH:
        return
    if top and t.type == "namespace":
        if not t.name:
            raise APIError(400, f"{where} needs `name`", param=f"{where}.name", code="invalid_value")
        if not t.tools:
            raise APIError(400, f"{where}: a namespace needs `tools`", param=f"{where}.tools", code="invalid_value")
        for j, member in enumerate(t.tools):
            _check_tool(member, f"{where}.tools[{j}]", top=False)
        return
    if t.type == "custom":
        raise APIError(400, f"{where} is a freeform custom tool ({t.name!r}): custom tools are not "
                            "supported; offer it as a function tool with a JSON schema",
                       param=f"{where}.type", code="unsupported_parameter")
    if t.type != "function":
        raise APIError(400, f"{where} is a hosted tool ({t.type!r}): this server runs none; offer a "
                            "function tool", param=f"{where}.type", code="unsupported_parameter")
    if not t.name:
        raise APIError(400, f"{where} needs `name`", param=f"{where}.name", code="invalid_value")
    for name in ("tools", *_WEB_FIELDS):
        if getattr(t, name) is not None:
            raise APIError(400, f"unknown field `{name}` in `{where}` (a function tool)", param=f"{where}.{name}",
                           code="unknown_field")


def function_tools(req: ResponsesRequest) -> dict[str, tuple[str | None, FunctionTool]]:
    """The function tools offered, by the name the model sees: a namespace's tools as
    ``namespace.name`` (their calls go back with ``namespace`` and the bare ``name``), each with
    its namespace (None at the top level); hosted web search left out."""
    out: dict[str, tuple[str | None, FunctionTool]] = {}
    for t in req.tools or ():
        if t.type == "namespace":
            for member in t.tools or ():
                out[f"{t.name}.{member.name}"] = (t.name, member)
        elif t.type not in _WEB_SEARCH:
            out[t.name or ""] = (None, t)
    return out


_MESSAGE_ROLES = {"user", "assistant", "system", "developer"}


def _parts_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where, code="invalid_value")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise APIError(400, f"{where}[{j}] needs a string `text`", param=f"{where}[{j}].text",
                               code="invalid_value")
            out.append(text)
        elif kind == "refusal":
            out.append(str(part.get("refusal", "")))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{where}[{j}] is an {kind} part: this server's model reads text only; send text",
                           param=f"{where}[{j}].type", code="unsupported_content")
        else:
            raise APIError(400, f"{where}[{j}] has an unknown part type {kind!r} (input_text, output_text)",
                           param=f"{where}[{j}].type", code="invalid_value")
    return "".join(out)


def _string(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise APIError(400, f"{where} needs a string `{key}`", param=f"{where}.{key}", code="invalid_value")
    return v


def conversation(req: ResponsesRequest) -> Conversation:
    """A Responses body as the conversation inside."""
    messages: list[Message] = []
    if req.instructions:
        messages.append(Message(role="system", content=req.instructions))
    offered = function_tools(req)
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise APIError(400, "input must not be empty", param="input", code="invalid_value")
    thought = ""   # a reasoning item's text, for the assistant turn it precedes

    def think(m: Message) -> Message:
        nonlocal thought
        if thought and m.role == "assistant" and not m.reasoning:
            m.reasoning, thought = thought, ""
        return m

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise APIError(400, f"{where}.role must be one of user, assistant, system, developer; got {role!r}",
                               param=f"{where}.role", code="invalid_value")
            text = _parts_text(item.get("content"), f"{where}.content")
            role = "system" if role == "developer" else role
            last = messages[-1] if messages else None
            if role == "assistant" and last is not None and last.role == "assistant" and not last.content \
                    and last.tool_calls:
                last.content = text   # text and calls of one turn, in whichever order they came
                think(last)
                continue
            messages.append(think(Message(role=role, content=text)))
        elif kind == "function_call":
            name, ns = _string(item, "name", where), item.get("namespace")
            if isinstance(ns, str) and f"{ns}.{name}" in offered:   # a namespace's tool, by the name the model saw
                name = f"{ns}.{name}"
            call = ToolCall(id=_string(item, "call_id", where), name=name,
                            arguments=item.get("arguments") if isinstance(item.get("arguments"), str) else "{}")
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*last.tool_calls, call]   # several calls of one turn
                think(last)
            else:
                messages.append(think(Message(role="assistant", content="", tool_calls=[call])))
        elif kind == "function_call_output":
            out = item.get("output")
            text = out if isinstance(out, str) else _parts_text(out, f"{where}.output")
            messages.append(Message(role="tool", content=text, tool_call_id=_string(item, "call_id", where)))
        elif kind == "reasoning":
            # the model's own thoughts (reasoning_text) go back to it; a summary is not what it wrote
            parts = item.get("content") if isinstance(item.get("content"), list) else []
            thought += "".join(p["text"] for p in parts if isinstance(p, dict) and p.get("type") == "reasoning_text"
                               and isinstance(p.get("text"), str))
        elif kind in ("custom_tool_call", "custom_tool_call_output"):
            raise APIError(400, f"{where} is a {kind} item: custom tools are not supported", param=f"{where}.type",
                           code="unsupported_parameter")
        elif kind == "item_reference":
            raise APIError(400, f"{where} is an item_reference: this server stores no items; send the item itself",
                           param=f"{where}.type", code="unsupported_parameter")
        else:
            raise APIError(400, f"{where} has an unknown or unsupported type {kind!r} (message, function_call, "
                                "function_call_output, reasoning)", param=f"{where}.type", code="invalid_value")
    tools = [Tool(name=name, description=t.description, parameters=t.parameters or {}, strict=bool(t.strict))
             for name, (_, t) in offered.items()]
    choice, forced = "auto", None
    tc = req.tool_choice
    if isinstance(tc, str):
        choice = tc
    elif tc is not None:
        choice, forced = "function", tc.name
    schema, strict = None, False
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        schema = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema, strict = fmt.schema if fmt.schema is not None else {}, bool(fmt.strict)
    effort = req.reasoning.effort if req.reasoning is not None else None
    return Conversation(messages=messages, tools=tools, tool_choice=choice, forced_tool=forced,
                        parallel_tool_calls=req.parallel_tool_calls is not False, response_schema=schema,
                        response_strict=strict, thinking=False if effort == "none" else None)


def prepare_responses(state: ServerState, tenant: Tenant, req: ResponsesRequest, model: str, session: str | None,
                      t0: float) -> Prepared:
    from .handling import Prepared, _resolve, spec_info

    conv = conversation(req)
    turn = render_turn(state, conv, format_param="text.format", messages_param="input")
    opts = SimpleNamespace(temperature=req.temperature, top_p=req.top_p, top_k=None, seed=req.seed, stop=None,
                           stream=req.stream, route=req.route, speculation=req.speculation)
    opts.temperature = None if req.temperature is None else sampling_temperature(req.temperature)
    call = _resolve(state, opts, endpoint="responses", tenant=tenant, model=model, ids=turn.ids,
                    max_tokens=req.max_output_tokens, prediction=None, session=session, t0=t0, prefix="resp",
                    include_usage=True, want_stats=req.spec_stats, grammar=turn.grammar,
                    grammar_param=turn.grammar_param, output=turn.output)
    resp_id = "resp_" + call.request_id.split("-", 1)[1]
    created = int(time.time())
    echo = {
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": conv.parallel_tool_calls,
        "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
        else {"type": "function", "name": req.tool_choice.name},
        "tools": [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                   "strict": t.strict} for t in conv.tools],
        "temperature": req.temperature, "top_p": req.top_p, "store": False, "previous_response_id": None,
        "metadata": req.metadata or {}, "text": {"format": {"type": "text"}} if req.text is None or
        req.text.format is None else {"format": msgspec.to_builtins(req.text.format)},
        "reasoning": {"effort": req.reasoning.effort if req.reasoning is not None else None, "summary": None},
        "truncation": req.truncation or "disabled",
        "user": req.user, "usage": None, "error": None, "incomplete_details": None,
    }
    if echo["tool_choice"] is None:
        echo["tool_choice"] = "auto"

    tokenizer = state.backend.tokenizer

    def response(status: str, output: list[dict], gen=None, error: dict | None = None) -> dict:
        body = {"id": resp_id, "object": "response", "created_at": created, "status": status, "model": model,
                "output": output, **echo}
        if gen is not None:
            cached = getattr(gen.stats, "cached_tokens", 0)
            body["usage"] = {"input_tokens": len(call.ids), "input_tokens_details": {"cached_tokens": cached},
                             "output_tokens": len(gen.token_ids),
                             "output_tokens_details": {"reasoning_tokens": reasoning_tokens(output)},
                             "total_tokens": len(call.ids) + len(gen.token_ids)}
            if status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            if call.want_stats:
                body["spec"] = spec_info(call, gen.stats)
        if error is not None:
            body["error"] = error
        return body

    def status_of(gen, p) -> str:
        return "incomplete" if gen.finish_reason == "length" or p.incomplete else "completed"

    def reasoning_tokens(output: list[dict]) -> int:   # the thoughts' tokens (their text re-encoded)
        return sum(len(tokenizer.encode(c["text"])) for o in output if o["type"] == "reasoning"
                   for c in o["content"])

    def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
        return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}

    def message_item(item_id: str, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    namespaced = {name: ns for name, (ns, _) in function_tools(req).items() if ns is not None}

    def call_item(item_id: str, c_id: str, name: str, args: str, status: str = "completed") -> dict:
        item = {"type": "function_call", "id": item_id, "call_id": c_id, "name": name, "arguments": args,
                "status": status}
        if name in namespaced:   # a namespace's tool: its bare name and the namespace
            item["name"], item["namespace"] = name[len(namespaced[name]) + 1:], namespaced[name]
        return item

    def respond(gen) -> dict:
        p = turn.parser("call_")
        p.push(gen.text)
        p.finish()
        output = []
        if p.reasoning:
            output.append(reasoning_item(_item_id("rs_"), "".join(p.reasoning)))
        text = "".join(p.content)
        if p.calls:
            text = text.strip()
        if text or not (p.calls or p.reasoning):   # (a turn of thoughts alone has no message)
            output.append(message_item(_item_id("msg_"), text))
        for c in p.calls:
            output.append(call_item(_item_id("fc_"), c.id, c.name, c.arguments))
        return response(status_of(gen, p), output, gen)

    parser = turn.parser("call_")
    seq = {"n": 0}
    st: dict[str, Any] = {"open": None, "output": []}   # the open item: (index, kind, id, text parts, call)

    def ev(kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": seq["n"], **fields}
        seq["n"] += 1
        return e

    def close(out: list[dict]) -> None:
        o = st["open"]
        if o is None:
            return
        idx, kind, item_id, parts, c = o
        if kind == "message":
            text = "".join(parts)
            out.append(ev("response.output_text.done", item_id=item_id, output_index=idx, content_index=0,
                          text=text, logprobs=[]))
            out.append(ev("response.content_part.done", item_id=item_id, output_index=idx, content_index=0,
                          part={"type": "output_text", "text": text, "annotations": [], "logprobs": []}))
            item = message_item(item_id, text)
        elif kind == "reasoning":
            text = "".join(parts)
            out.append(ev("response.reasoning_text.done", item_id=item_id, output_index=idx, content_index=0,
                          text=text))
            out.append(ev("response.content_part.done", item_id=item_id, output_index=idx, content_index=0,
                          part={"type": "reasoning_text", "text": text}))
            item = reasoning_item(item_id, text)
        else:
            args = "".join(parts)
            out.append(ev("response.function_call_arguments.done", item_id=item_id, output_index=idx,
                          arguments=args, name=c.name))
            item = call_item(item_id, c.id, c.name, args)
        out.append(ev("response.output_item.done", output_index=idx, item=item))
        st["output"].append(item)
        st["open"] = None

    def shape(events) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, Reasoning):
                o = st["open"]
                if o is None or o[1] != "reasoning":
                    close(out)
                    idx, item_id = len(st["output"]), _item_id("rs_")
                    st["open"] = o = (idx, "reasoning", item_id, [], None)
                    out.append(ev("response.output_item.added", output_index=idx,
                                  item=reasoning_item(item_id, "", status="in_progress")))
                    out.append(ev("response.content_part.added", item_id=item_id, output_index=idx, content_index=0,
                                  part={"type": "reasoning_text", "text": ""}))
                o[3].append(e.text)
                out.append(ev("response.reasoning_text.delta", item_id=o[2], output_index=o[0], content_index=0,
                              delta=e.text))
            elif isinstance(e, Text):
                o = st["open"]
                if o is None or o[1] != "message":
                    if not e.text.strip() and o is None and st["output"]:
                        continue   # whitespace between calls
                    close(out)
                    idx, item_id = len(st["output"]), _item_id("msg_")
                    st["open"] = o = (idx, "message", item_id, [], None)
                    out.append(ev("response.output_item.added", output_index=idx,
                                  item={"type": "message", "id": item_id, "status": "in_progress",
                                        "role": "assistant", "content": []}))
                    out.append(ev("response.content_part.added", item_id=item_id, output_index=idx, content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
                o[3].append(e.text)
                out.append(ev("response.output_text.delta", item_id=o[2], output_index=o[0], content_index=0,
                              delta=e.text, logprobs=[]))
            elif isinstance(e, CallStart):
                close(out)
                idx, item_id = len(st["output"]), _item_id("fc_")
                st["open"] = (idx, "call", item_id, [], e)
                out.append(ev("response.output_item.added", output_index=idx,
                              item=call_item(item_id, e.id, e.name, "", status="in_progress")))
            elif isinstance(e, CallArgs):
                o = st["open"]
                o[3].append(e.delta)
                out.append(ev("response.function_call_arguments.delta", item_id=o[2], output_index=o[0],
                              delta=e.delta))
            elif isinstance(e, CallEnd):
                close(out)
        return out

    def chunk(delta: str) -> list[dict]:
        return shape(parser.push(delta))

    def final(gen, tail: str) -> list[dict]:
        out = shape(parser.push(tail) + parser.finish())
        o = st["open"]
        if o is not None and o[1] == "call":   # cut off inside a call: never handed on as a complete call
            st["open"] = None
        close(out)
        output = list(st["output"])
        out.append(ev("response.completed", response=response(status_of(gen, parser), output, gen)))
        return out

    def error_chunks(e: APIError) -> list[dict]:
        err = {"code": e.code or "server_error", "message": e.message}
        return [ev("response.failed", response=response("failed", list(st["output"]), None, err))]

    opening = [ev("response.created", response=response("in_progress", [])),
               ev("response.in_progress", response=response("in_progress", []))]
    def heartbeat() -> list[dict]:   # Codex's idle timeout counts events: an SSE comment is not one
        return [ev("response.in_progress", response=response("in_progress", list(st["output"])))]

    return Prepared(call, respond, chunk, final, opening=opening, wire="responses", error_chunks=error_chunks,
                    heartbeat=heartbeat)


def _item_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)
