"""One conversation model for every wire protocol.

OpenAI Chat Completions, OpenAI Responses and Anthropic Messages bodies are translated into a
``Conversation`` at the edge (``agentspec.api``); inside, the request is rendered with the model's
own chat template (``render``), constrained by a grammar where it asks for one
(``agentspec.chat.grammar``) and its output parsed back into text and tool calls
(``agentspec.chat.parse``). Nothing here knows which API a request came through.

Standard library and msgspec only (no torch).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from ..errors import InvalidRequestError

__all__ = ["Conversation", "Message", "Tool", "ToolCall", "arguments_object", "template_messages", "template_tools"]

Role = Literal["system", "user", "assistant", "tool"]


class ToolCall(msgspec.Struct, frozen=True):
    """A call the model made (or made in an earlier turn): ``arguments`` is the JSON text of an
    object, as the model wrote it or the client sent it back."""

    id: str
    name: str
    arguments: str


class Message(msgspec.Struct):
    """One turn: text, the calls an assistant turn made, or a tool's result (``role`` "tool",
    ``tool_call_id`` naming the call it answers)."""

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None
    name: str | None = None       # a participant's name (OpenAI), or the tool a result is from
    reasoning: str = ""           # an assistant turn's thoughts, sent back (rendered where the template does)


class Tool(msgspec.Struct, frozen=True):
    """A function the model may call: its JSON-schema ``parameters``; ``strict``: the arguments must
    follow the schema exactly (unsupported schema features are an error, not ignored)."""

    name: str
    description: str | None = None
    parameters: dict = {}
    strict: bool = False


class Conversation(msgspec.Struct):
    """Messages, the tools offered, how a call may be made and an optional output constraint.

    ``tool_choice``: "auto" (the model decides), "none" (no call), "required" (at least one call),
    or "function" with ``forced_tool`` naming the one tool it must call. ``parallel_tool_calls``:
    several calls in one turn. ``response_schema``: the answer is JSON following this schema
    (``{"type": "object"}`` for any object); ``response_strict``: unsupported schema features are an
    error rather than ignored. ``thinking``: for a model that thinks before it answers, True or
    False asks its template to let it or not (``enable_thinking``); None leaves it to the template."""

    messages: list[Message]
    tools: list[Tool] = []
    tool_choice: Literal["auto", "none", "required", "function"] = "auto"
    forced_tool: str | None = None
    parallel_tool_calls: bool = True
    response_schema: dict | None = None
    response_strict: bool = False
    thinking: bool | None = None

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


def arguments_object(text: str, *, param: str) -> Any:
    """A call's ``arguments`` JSON text as the object the chat template renders (Qwen's applies
    ``tojson`` to it: a string would be encoded twice). Not JSON: InvalidRequestError naming ``param``."""
    if not text.strip():
        return {}
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"{param} must be a JSON object encoded as a string, got {text[:80]!r} ({e})",
                                  param=param) from None


def template_tools(tools: Sequence[Tool]) -> list[dict] | None:
    """``tools`` as chat templates take them (OpenAI's function-tool shape, as transformers passes them)."""
    if not tools:
        return None
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.name}
        if t.description is not None:
            fn["description"] = t.description
        fn["parameters"] = t.parameters or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def template_messages(messages: Sequence[Message]) -> list[dict]:
    """Messages as chat templates take them (transformers' ``apply_chat_template`` shape): an
    assistant turn's calls as ``tool_calls`` with their arguments parsed to objects, a tool result
    as ``role: tool`` with its ``tool_call_id``; content always a string."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name,
                              "arguments": arguments_object(c.arguments,
                                                            param=f"messages[{i}].tool_calls[{j}].arguments")}}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning and m.role == "assistant":
            d["reasoning_content"] = m.reasoning
        out.append(d)
    return out
