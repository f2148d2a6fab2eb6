"""The one chat core every wire adapter shares: a ``Conversation`` rendered with the model's own
chat template (tools included), the grammar its output is held to, and the parser that reads
the output back as text and tool calls.

The adapters (OpenAI Chat Completions in ``handling``, Anthropic Messages in ``anthropic``,
OpenAI Responses in ``responses``) translate their bodies into a ``Conversation`` and their
events out of a ``Turn``; the decode path never learns which API a request came through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..chat import Conversation, OutputParser, ReasoningFormat, ToolFormat, detect_format, detect_reasoning
from ..chat.conversation import template_messages, template_tools
from ..backends.protocol import OutputFormat
from ..errors import InvalidRequestError
from .protocol import APIError

if TYPE_CHECKING:
    from .state import ServerState

__all__ = ["Turn", "render_turn", "tool_format"]


def tool_format(state: ServerState) -> ToolFormat | None:
    """The served model's tool-call row, from its chat template (None: it has none)."""
    tok = state.backend.tokenizer
    return detect_format(getattr(tok, "chat_template", None))


def _token_id(tokenizer: Any):
    backend = getattr(tokenizer, "backend", None)

    def token_id(text: str) -> int | None:
        if backend is None:
            return None
        tid = backend.token_to_id(text)
        return tid if isinstance(tid, int) else None
    return token_id


@dataclass
class Turn:
    """A rendered conversation: the prompt's ids, the grammar (None: free output) and how its
    output is read."""

    conv: Conversation
    ids: list[int]
    grammar: str | None
    fmt: ToolFormat | None
    grammar_param: str | None     # the request field the grammar came from (its errors name it)
    reasoning: ReasoningFormat | None = None   # the model's thought block (None: it has none, or it is off)
    opened: bool | None = None    # the prompt opened the thoughts (True), closed them (False), or neither

    @property
    def tool_names(self) -> list[str]:
        if self.conv.tool_choice == "none":
            return []
        if self.conv.tool_choice == "function":
            return [self.conv.forced_tool] if self.conv.forced_tool else []
        return [t.name for t in self.conv.tools]

    @property
    def output(self) -> OutputFormat | None:
        """How the output reads, for the drafters (None: free text)."""
        tools = self.tool_names
        if (self.fmt is None or not tools) and self.conv.response_schema is None:
            return None
        return OutputFormat(tool_format=self.fmt.name if self.fmt is not None and tools else None,
                            tools=tuple(tools), forced=self.conv.tool_choice in ("required", "function"),
                            json=self.conv.response_schema is not None and not tools)

    def parser(self, id_prefix: str = "call_") -> OutputParser:
        return OutputParser(self.fmt, self.tool_names, id_prefix=id_prefix,
                            forced=self.conv.tool_choice in ("required", "function"),
                            reasoning=self.reasoning, opened=self.opened)


def render_turn(state: ServerState, conv: Conversation, *, tools_param: str = "tools",
                choice_param: str = "tool_choice", format_param: str = "response_format",
                messages_param: str = "messages") -> Turn:
    """``conv`` checked against what the served model can do, rendered and tokenized. Raises the
    APIError (400) its adapter sends: tools for a model without a tool-call format, a named tool
    that is not offered, a grammar the backend cannot run."""
    backend = state.backend
    tok = backend.tokenizer
    fmt = None
    if conv.tools:
        fmt = tool_format(state)
        if fmt is None:
            raise APIError(400, f"`{tools_param}`: the served model {state.model_id!r} has no tool-call format "
                                "(its chat template renders no tools, or none this server knows: Qwen2.5/Qwen3 "
                                "Hermes tags, Llama 3.x JSON, Mistral [TOOL_CALLS]); send the request without "
                                "tools", param=tools_param, code="unsupported_parameter")
        names = [t.name for t in conv.tools]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise APIError(400, f"`{tools_param}`: two tools are named {dup!r}; tool names must be unique",
                           param=tools_param, code="invalid_value")
    if conv.tool_choice in ("required", "function") and not conv.tools:
        raise APIError(400, f"`{choice_param}` is {conv.tool_choice!r} but no tools are offered: send `{tools_param}`",
                       param=choice_param, code="invalid_value")
    if conv.tool_choice == "function" and conv.tool(conv.forced_tool or "") is None:
        raise APIError(400, f"`{choice_param}` names {conv.forced_tool!r}, which is not among the tools offered "
                            f"({', '.join(t.name for t in conv.tools)})", param=choice_param, code="invalid_value")
    grammar = None
    grammar_param = None
    if fmt is not None or conv.response_schema is not None:
        row = fmt if fmt is not None else _NO_TOOLS
        try:
            grammar = row.grammar(conv, _token_id(tok))
        except (TypeError, ValueError) as e:
            raise APIError(400, f"cannot build the output grammar: {e}", param=format_param,
                           code="invalid_value") from None
        grammar_param = format_param if conv.response_schema is not None and conv.tool_choice in ("auto", "none") \
            else tools_param
    if grammar is not None and not getattr(backend, "supports_grammar", False):
        if conv.response_schema is not None or conv.tool_choice in ("required", "function"):
            raise APIError(400, f"this backend ({type(backend).__name__}) does not run output grammars: "
                                f"`{format_param}` and a forced `{choice_param}` need the embedded engine",
                           param=format_param if conv.response_schema is not None else choice_param,
                           code="unsupported_parameter")
        grammar = None   # auto: calls are parsed, not held to their schemas
    think = detect_reasoning(getattr(tok, "chat_template", None))
    kwargs = {"enable_thinking": conv.thinking} if think is not None and conv.thinking is not None else None
    try:
        messages = template_messages(conv.messages)
        ids = backend.encode_chat(messages, tools=template_tools(conv.tools) if fmt is not None else None,
                                  template_kwargs=kwargs)
    except InvalidRequestError as e:
        param = e.param if e.param and e.param.startswith("messages[") else messages_param
        raise APIError(400, str(e), param=param, code="invalid_value") from None
    opened = None
    if think is not None:
        opened = think.opened(tok.decode(ids[-16:]))
        if opened is False:
            think = None   # the template closed the thoughts: the output is the answer
        elif grammar is not None:   # the thoughts come first, free; the grammar holds what follows them
            grammar = think.with_reasoning(grammar, opened=bool(opened), token_id=_token_id(tok))
    return Turn(conv=conv, ids=ids, grammar=grammar, fmt=fmt, grammar_param=grammar_param, reasoning=think,
                opened=opened)


# a response schema without tools: the grammar is the schema alone
_NO_TOOLS = ToolFormat("none", start="", end="", args_key="arguments", multiple=False)
