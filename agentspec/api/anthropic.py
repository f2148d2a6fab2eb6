"""Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``): the adapter in and out.

In: a Messages body becomes the conversation inside (``agentspec.chat.Conversation``): ``system``
(text or text blocks), content blocks (``text``; ``tool_use`` with its ``toolu_`` id as an
assistant turn's call; ``tool_result`` as text or text blocks, ``is_error`` said in the text, as a
tool message; ``thinking`` blocks as the turn's thoughts, shown to the model where its chat
template shows them, ``redacted_thinking`` dropped), system turns among the messages (rendered
where they stand), ``tools`` with
``input_schema`` (a ``defer_loading`` tool left out: it is not in the model's context until a tool
search loads it), ``tool_choice``, ``stop_sequences``.
Images and documents are refused by name, and so are server tools (``web_search``, ``bash``, ...)
and options that would change the output if ignored (``context_management`` edits other than
clearing thinking). ``thinking`` ``disabled`` turns a thinking model's thoughts off (Qwen3's
``enable_thinking``), ``enabled`` / ``adaptive`` on; a hint for a model that does not think
(``budget_tokens`` is not enforced). Hints (``cache_control``, ``metadata``, ``service_tier:
auto``, ``clear_thinking`` edits: the template already drops thoughts of turns before the last
user message) are accepted and ignored.

Out: the message (``content`` blocks, ``stop_reason`` ``end_turn`` / ``max_tokens`` /
``stop_sequence`` / ``tool_use``, ``usage`` with ``cache_read_input_tokens`` from the prefix cache)
or its stream as named events (``message_start``, ``ping``, ``content_block_start`` / ``_delta``
/ ``_stop`` with ``thinking_delta``, ``text_delta`` and ``input_json_delta``, ``message_delta``,
``message_stop``; a thinking model's thoughts are a ``thinking`` block ahead of the answer, its
``signature`` empty: nothing checks it on the way back in;
``error``), Anthropic's error envelope (``agentspec.api.errors``).
"""

from __future__ import annotations

import json
import secrets
from types import SimpleNamespace
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from ..backends.protocol import MAX_TEMPERATURE
from ..chat import CallArgs, CallEnd, CallStart, Conversation, Message, Reasoning, Text, Tool, ToolCall
from ..text import stop_index
from .errors import anthropic_error_type
from .protocol import APIError, decode_body, sampling_temperature
from .turns import render_turn

if TYPE_CHECKING:
    from .handling import Prepared
    from .state import ServerState, Tenant

__all__ = ["MessagesRequest", "count_tokens", "prepare_messages"]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class _Block(_Strict, tag_field="type", kw_only=True):
    cache_control: Any = None          # a hint: the prefix cache is automatic


class TextBlock(_Block, tag="text"):
    text: str
    citations: Any = None


class ImageBlock(_Block, tag="image"):
    source: Any = None


class DocumentBlock(_Block, tag="document"):
    source: Any = None
    title: str | None = None
    context: str | None = None
    citations: Any = None


class ToolUseBlock(_Block, tag="tool_use"):
    id: str
    name: str
    input: Any = None
    caller: Any = None
    toolset_name: str | None = None


class ToolResultBlock(_Block, tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool | None = None
    toolset_name: str | None = None


class ThinkingBlock(_Block, tag="thinking"):
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(_Block, tag="redacted_thinking"):
    data: str = ""


Block = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class MessageParam(_Strict):
    # "system": a system turn in the middle of the conversation (Claude Code sends its environment
    # that way); text only, rendered where it stands (Qwen's template has a branch for it)
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolDef(_Strict):
    name: Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_.\-]{1,128}$")]
    input_schema: dict | None = None
    description: str | None = None
    type: str | None = None            # "custom" (or absent); a server tool's type is refused by name
    cache_control: Any = None          # hints, as on blocks
    strict: bool | None = None
    eager_input_streaming: bool | None = None   # arguments stream as they are written anyway
    defer_loading: bool | None = None   # true: not in the model's context (the API's tool search loads it)
    input_examples: list[dict] | None = None
    allowed_callers: Any = None


class ToolChoiceParam(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(_Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: str | None = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema: dict


class OutputConfig(_Strict):
    effort: str | None = None          # a hint: the models served have one effort
    format: JsonOutputFormat | None = None


class MetadataParam(_Strict):
    user_id: str | None = None


class MessagesRequest(_Strict, kw_only=True):
    model: str | None = None
    messages: Annotated[list[MessageParam], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    # sampling: the Messages API of earlier versions (clients still send them)
    temperature: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceParam | None = None
    metadata: MetadataParam | None = None
    thinking: ThinkingParam | None = None   # disabled / enabled: a thinking model's thoughts off / on
    output_config: OutputConfig | None = None
    # hints with nothing to do here: the prefix cache is automatic, one region, one speed
    cache_control: Any = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    # agentspec extensions (as on the OpenAI endpoints)
    seed: int | None = None
    speculation: bool | None = None
    route: str | None = None
    spec_stats: bool = False

    def check_unsupported(self) -> None:
        for name in ("container", "mcp_servers"):
            if getattr(self, name) is not None:
                raise APIError(400, f"`{name}` is not supported by this server (it runs no server-side tools)",
                               param=name, code="unsupported_parameter")
        _check_context_management(self.context_management)
        for i, t in enumerate(self.tools or ()):
            if t.type not in (None, "custom"):
                raise APIError(400, f"tools[{i}] is a server tool ({t.type!r}): this server runs none; offer it as "
                                    "a custom tool with an input_schema", param=f"tools[{i}].type",
                               code="unsupported_parameter")
        for i, m in enumerate(self.messages):
            for j, b in enumerate(m.content if isinstance(m.content, list) else ()):
                _check_block(b, f"messages[{i}].content[{j}]", m.role)
                if isinstance(b, ToolResultBlock) and isinstance(b.content, list):
                    for k, inner in enumerate(b.content):
                        _check_block(inner, f"messages[{i}].content[{j}].content[{k}]", m.role)


def _check_context_management(cm: Any) -> None:
    """``context_management``: only edits that clear thinking blocks (Claude Code sends
    ``clear_thinking_20251015`` on every request) are taken, as no-ops: a thinking model's template
    already drops the thoughts of turns before the last user message, and a model that does not
    think has none. Any other edit (clearing tool results) would change the prompt: refused."""
    if cm is None:
        return
    edits = cm.get("edits") if isinstance(cm, dict) else None
    if not isinstance(cm, dict) or set(cm) - {"edits"} or not isinstance(edits, list):
        raise APIError(400, "`context_management` takes `edits` (a list) only", param="context_management",
                       code="invalid_value")
    for i, e in enumerate(edits):
        kind = e.get("type") if isinstance(e, dict) else None
        if not isinstance(kind, str) or not kind.startswith("clear_thinking_"):
            raise APIError(400, f"context_management.edits[{i}] ({kind!r}) is not supported: this server does not "
                                "edit the context (clear_thinking edits are taken: the chat template drops earlier "
                                "thoughts itself); leave it out", param=f"context_management.edits[{i}].type",
                           code="unsupported_parameter")


def _check_block(b: Any, where: str, role: str) -> None:
    if isinstance(b, (ImageBlock, DocumentBlock)):
        kind = "an image" if isinstance(b, ImageBlock) else "a document"
        raise APIError(400, f"{where} is {kind}: this server's model reads text only; send text blocks",
                       param=f"{where}.type", code="unsupported_content")
    if isinstance(b, ToolUseBlock) and role != "assistant":
        raise APIError(400, f"{where}: tool_use blocks belong in assistant turns", param=where, code="invalid_value")
    if isinstance(b, (ToolUseBlock, ToolResultBlock)) and role == "system":
        raise APIError(400, f"{where}: a system turn holds text only", param=where, code="invalid_value")
    if isinstance(b, ToolResultBlock) and role != "user":
        raise APIError(400, f"{where}: tool_result blocks belong in user turns", param=where, code="invalid_value")


def _block_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(b.text for b in content if isinstance(b, TextBlock))


def conversation(req: MessagesRequest) -> Conversation:
    """A Messages body as the conversation inside."""
    messages: list[Message] = []
    if req.system:
        messages.append(Message(role="system", content=_block_text(req.system)))
    for m in req.messages:
        if isinstance(m.content, str):
            messages.append(Message(role=m.role, content=m.content))
            continue
        if m.role == "system":
            messages.append(Message(role="system", content=_block_text(m.content)))
            continue
        if m.role == "assistant":
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            calls = [ToolCall(id=b.id, name=b.name, arguments=json.dumps(b.input if b.input is not None else {},
                                                                         ensure_ascii=False))
                     for b in m.content if isinstance(b, ToolUseBlock)]
            thought = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
            messages.append(Message(role="assistant", content=text, tool_calls=calls, reasoning=thought))
            continue
        # a user turn: its tool results (each a tool message, in order), then its text
        text: list[str] = []
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                out = _block_text(b.content)
                messages.append(Message(role="tool", content=f"Error: {out}" if b.is_error else out,
                                        tool_call_id=b.tool_use_id))
            elif isinstance(b, TextBlock):
                text.append(b.text)
        if text or not any(isinstance(b, ToolResultBlock) for b in m.content):
            messages.append(Message(role="user", content="".join(text)))
    # a deferred tool is not in the model's context until a tool search loads it: not rendered, not callable
    tools = [Tool(name=t.name, description=t.description, parameters=t.input_schema or {}, strict=bool(t.strict))
             for t in req.tools or () if not t.defer_loading]
    choice, forced, parallel = "auto", None, True
    tc = req.tool_choice
    if tc is not None:
        choice = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[tc.type]
        if tc.type == "tool":
            if not tc.name:
                raise APIError(400, "tool_choice of type tool needs `name`", param="tool_choice.name",
                               code="invalid_value")
            forced = tc.name
        parallel = not tc.disable_parallel_tool_use
    fmt = req.output_config.format if req.output_config is not None else None
    thinking = None
    if req.thinking is not None:
        thinking = {"disabled": False, "enabled": True, "adaptive": True}.get(req.thinking.type)
    return Conversation(messages=messages, tools=tools, tool_choice=choice, forced_tool=forced,
                        parallel_tool_calls=parallel, response_schema=fmt.schema if fmt is not None else None,
                        response_strict=fmt is not None, thinking=thinking)


def count_tokens(state: ServerState, body: bytes) -> dict:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": n}`` of the rendered prompt."""
    req = decode_body(body, _CountRequest)
    full = MessagesRequest(model=req.model, messages=req.messages, max_tokens=1, system=req.system, tools=req.tools,
                           tool_choice=req.tool_choice, thinking=req.thinking, output_config=req.output_config)
    full.check_unsupported()
    turn = render_turn(state, conversation(full))
    return {"input_tokens": len(turn.ids)}


class _CountRequest(_Strict, kw_only=True):
    model: str | None = None
    messages: Annotated[list[MessageParam], msgspec.Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    cache_control: Any = None


def _stop_reason(gen, parser, stops: list[str], tokenizer) -> tuple[str, str | None]:
    if parser.calls and not parser.incomplete:
        return "tool_use", None
    if gen.finish_reason == "length" or parser.incomplete:
        return "max_tokens", None
    if stops:
        full = tokenizer.decode(gen.token_ids)
        i = stop_index(full, stops)
        if i >= 0:
            return "stop_sequence", min((s for s in stops if full.find(s) == i), key=len)
    return "end_turn", None


def prepare_messages(state: ServerState, tenant: Tenant, req: MessagesRequest, model: str, session: str | None,
                     t0: float) -> Prepared:
    from .handling import Prepared, _resolve, spec_info

    conv = conversation(req)
    turn = render_turn(state, conv, format_param="output_config.format")
    temperature = req.temperature
    opts = SimpleNamespace(temperature=1.0 if temperature is None else min(temperature, MAX_TEMPERATURE),
                           top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=list(req.stop_sequences or []),
                           stream=req.stream, route=req.route, speculation=req.speculation)
    opts.temperature = sampling_temperature(opts.temperature)
    call = _resolve(state, opts, endpoint="messages", tenant=tenant, model=model, ids=turn.ids,
                    max_tokens=req.max_tokens, prediction=None, session=session, t0=t0, prefix="msg",
                    include_usage=True, want_stats=req.spec_stats, grammar=turn.grammar,
                    grammar_param=turn.grammar_param, output=turn.output)
    msg_id = "msg_" + call.request_id.split("-", 1)[1]
    tokenizer = state.backend.tokenizer
    stops = list(req.stop_sequences or [])

    def usage(gen) -> dict:
        cached = getattr(gen.stats, "cached_tokens", 0)
        return {"input_tokens": len(call.ids) - cached, "output_tokens": len(gen.token_ids),
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    def respond(gen) -> dict:
        p = turn.parser("toolu_")
        p.push(gen.text)
        p.finish()
        content: list[dict] = []
        if p.reasoning:
            content.append({"type": "thinking", "thinking": "".join(p.reasoning), "signature": ""})
        text = "".join(p.content)
        if p.calls:
            text = text.strip()
        if text:
            content.append({"type": "text", "text": text})
        for c in p.calls:
            content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)})
        reason, seq = _stop_reason(gen, p, stops, tokenizer)
        body = {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": reason, "stop_sequence": seq, "usage": usage(gen)}
        if call.want_stats:
            body["spec"] = spec_info(call, gen.stats)
        return body

    parser = turn.parser("toolu_")
    blocks = {"open": None, "next": 0}   # the open content block's index and kind

    def close(out: list[dict]) -> None:
        if blocks["open"] is not None:
            out.append({"type": "content_block_stop", "index": blocks["open"][0]})
            blocks["open"] = None

    def keep_open(out: list[dict], block: dict) -> None:
        """The open block if it is of ``block``'s type, else that one started (the last closed)."""
        if blocks["open"] is None or blocks["open"][1] != block["type"]:
            close(out)
            blocks["open"] = (blocks["next"], block["type"])
            blocks["next"] += 1
            out.append({"type": "content_block_start", "index": blocks["open"][0], "content_block": block})

    def shape(events) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            if isinstance(ev, Reasoning):
                keep_open(out, {"type": "thinking", "thinking": "", "signature": ""})
                out.append({"type": "content_block_delta", "index": blocks["open"][0],
                            "delta": {"type": "thinking_delta", "thinking": ev.text}})
            elif isinstance(ev, Text):
                keep_open(out, {"type": "text", "text": ""})
                out.append({"type": "content_block_delta", "index": blocks["open"][0],
                            "delta": {"type": "text_delta", "text": ev.text}})
            elif isinstance(ev, CallStart):
                close(out)
                blocks["open"] = (blocks["next"], "tool_use")
                blocks["next"] += 1
                out.append({"type": "content_block_start", "index": blocks["open"][0],
                            "content_block": {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}}})
            elif isinstance(ev, CallArgs):
                out.append({"type": "content_block_delta", "index": blocks["open"][0],
                            "delta": {"type": "input_json_delta", "partial_json": ev.delta}})
            elif isinstance(ev, CallEnd):
                close(out)
        return out

    def chunk(delta: str) -> list[dict]:
        return shape(parser.push(delta))

    def final(gen, tail: str) -> list[dict]:
        out = shape(parser.push(tail) + parser.finish())
        close(out)
        reason, seq = _stop_reason(gen, parser, stops, tokenizer)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                 "usage": usage(gen)}
        if call.want_stats:
            delta["spec"] = spec_info(call, gen.stats)
        return out + [delta, {"type": "message_stop"}]

    def error_chunks(e: APIError) -> list[dict]:
        return [{"type": "error", "error": {"type": anthropic_error_type(e.status), "message": e.message}}]

    start = {"type": "message_start",
             "message": {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
                         "stop_reason": None, "stop_sequence": None,
                         # the split between new and cached input is known after prefill: message_delta has it
                         "usage": {"input_tokens": len(call.ids), "output_tokens": 0,
                                   "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}}
    return Prepared(call, respond, chunk, final, opening=[start, {"type": "ping"}], wire="anthropic",
                    error_chunks=error_chunks, heartbeat=lambda: [{"type": "ping"}])


def new_tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)
