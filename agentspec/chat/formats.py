"""Tool-call formats: one row per model family, like the kernel table.

A row says how a call starts and ends in the model's output, under which key its arguments go,
whether several calls fit in one turn, and how the grammar that makes a call well formed is
written. Rendering tools and past calls into the prompt is the model's own chat template's job
(``Tokenizer.apply_chat_template(tools=...)``, as transformers does); the row only has to agree
with it, so that a call the model wrote, parsed and sent back by the client, renders to the
text the model produced.

The row is chosen from the chat template and the vocabulary, as llama.cpp's ``common/chat.cpp``
does, never from the checkpoint's architecture (every ``llama`` architecture file -- Llama 3,
Mistral, SmolLM2 -- shares one):

| row | families | a call in the output | several a turn |
|---|---|---|---|
| ``hermes`` | Qwen2.5, Qwen2.5-Coder, Qwen3 | ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` | yes |
| ``llama3`` | Llama 3.1 / 3.2 / 3.3 | ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>`` first, optionally) | no |
| ``mistral`` | Mistral (v3 tokenizer and later) | ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` | yes |

A template none of these recognise has no row: a request with ``tools`` is refused by name.

Reasoning is a row of its own (``ReasoningFormat``): a template that renders ``<think>`` and
``</think>`` (Qwen3, QwQ, DeepSeek-R1 and its distills) serves a model that may think before it
answers. Its thoughts are not the answer: the parser sends them as reasoning events and the
grammar of a constrained turn admits them ahead of the constrained part (``with_reasoning``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .conversation import Conversation, Tool

__all__ = ["FORMATS", "ReasoningFormat", "ToolFormat", "detect_format", "detect_reasoning"]

# JSON as ``json.dumps`` (and so the templates' ``tojson``) writes it: a call made under the grammar
# re-renders, when the client sends it back, as the very text the model wrote
_DUMPS_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call format (see the module's table)."""

    name: str
    start: str                 # what opens a call (or the list of calls) in the output; "" : a bare JSON object
    end: str                   # what closes one call; "" : nothing
    args_key: str              # the arguments' key in the call object
    multiple: bool             # several calls in one turn
    list_form: bool = False    # the calls come as one JSON list after ``start`` (Mistral)
    separator: str = ""        # between two calls (Hermes: a newline)
    head: str = ""             # between ``start`` and the call's JSON (Hermes: a newline)
    tail: str = ""             # between the call's JSON and ``end``
    dumps_style: bool = True   # the template writes calls with json.dumps' separators
    bare_calls: bool = False   # the family's small models also write a call as bare or fenced JSON (Qwen coders)

    # ---- grammars (llguidance's Lark; ``agentspec.decode.constraint`` runs them) -------------

    def grammar(self, conv: Conversation, token_id: Callable[[str], int | None]) -> str | None:
        """The grammar for ``conv``'s output, or None where the output is free text: a call
        forced (``required``, a named tool), calls held to their tools' schemas once one starts
        (``auto``; lazily, from the start marker on), no call at all (``none``), the answer held
        to ``response_schema``. ``token_id(text)``: the id of a marker that is one token."""
        tools = conv.tools if conv.tool_choice != "none" else []
        if conv.tool_choice == "function":
            tools = [t for t in conv.tools if t.name == conv.forced_tool]
        answer = None
        if conv.response_schema is not None:
            answer = "%json " + json.dumps(_schema_with(conv.response_schema, lenient=not conv.response_strict))
        if not tools:
            if conv.tool_choice == "none" and conv.tools:
                # no call: the text may not hold the call marker (a special token is outside TEXT anyway)
                body = answer or "TEXT"
                return _lark(f"start: {body}", self._text_rule(token_id))
            return _lark(f"start: {answer}", "") if answer else None
        multiple = self.multiple and conv.parallel_tool_calls and conv.tool_choice != "function"
        calls, rules = self._calls_rule(tools, multiple, token_id)
        if conv.tool_choice in ("required", "function"):
            return _lark("start: calls", rules + f"calls: {calls}\n")
        # auto: free text (or the schema's answer), or calls once the marker starts them
        marker = self._marker(token_id)
        if marker is None:   # a bare-JSON format: no marker to trigger on; the parser still finds calls
            return _lark(f"start: {answer}", "") if answer else None
        if answer is not None:
            return _lark("start: answer | calls", rules + f"calls: {calls}\nanswer: {answer}\n")
        # free text with calls among it, each started by the marker: a special token (outside TEXT), or
        # text, taken as a lazy trigger (the text up to the marker is one lexeme, ended the moment the
        # marker appears: llguidance's lexer does not split a lexeme afterwards). Where the family's
        # small models write a call as bare or fenced JSON, an answer that starts like a call
        # ({"name": "...) is one too, held to the tools' schemas: free text may not start that way
        text_marker = token_id(self.start) is None
        rules += f"body: {self._call_body(token_id)}\n" + self._text_rule(token_id, bare=self.bare_calls)
        if text_marker:
            rules += f"tag_trig[lazy]: TEXT {json.dumps(self.start)}\ntag: tag_trig body\n"
        else:
            rules += f"tag: TEXT {marker} body\n"
        start = "start: tag* TEXT" if multiple else "start: TEXT | tag TEXT"
        if self.bare_calls:
            start += ' | bare_trig bare_rest bare_more | fence_trig bare_rest "\\n```"'
            rules += self._bare_rules(tools, multiple)
        return _lark(start, rules)

    def _marker(self, token_id: Callable[[str], int | None]) -> str | None:
        if not self.start:
            return None
        tid = token_id(self.start)
        return f"<[{tid}]>" if tid is not None else json.dumps(self.start)

    def _call_body(self, token_id: Callable[[str], int | None]) -> str:
        """What follows the marker in one call: its JSON and its end."""
        end = token_id(self.end) if self.end else None
        end_s = f"<[{end}]>" if end is not None else (json.dumps(self.end) if self.end else "")
        q = lambda s: json.dumps(s) if s else ""   # noqa: E731
        return f"{q(self.head)} call_json {q(self.tail)} {end_s}".strip()

    def _bare_rules(self, tools: Sequence[Tool], multiple: bool) -> str:
        """A call as bare (or fenced) JSON, ``{"name": "<tool>", "arguments": {...}}``: its start is a
        lazy trigger (the grammar takes over the moment an answer starts like a call), then the
        name of an offered tool and its arguments held to that tool's schema."""
        style = dict(_DUMPS_STYLE) if self.dumps_style else {}
        lenient = not all(t.strict for t in tools)
        out = ['bare_trig[lazy]: /[ \\n]*\\{"name": "/\n', 'fence_trig[lazy]: /[ \\n]*```json\\n\\{"name": "/\n']
        alts = []
        for i, t in enumerate(tools):
            params = {**(t.parameters or {"type": "object"}), "x-guidance": {**style, "lenient": lenient}}
            out.append(f"bare_args_{i}: %json {json.dumps(params)}\n")
            alts.append(f'{json.dumps(t.name + chr(34) + ", " + chr(34) + self.args_key + chr(34) + ": ")} '
                        f'bare_args_{i} "}}"')
        out.append("bare_rest: " + " | ".join(alts) + "\n")
        out.append('bare_more: ("\\n{\\"name\\": \\"" bare_rest)*\n' if multiple else 'bare_more: ""\n')
        return "".join(out)

    def _text_rule(self, token_id: Callable[[str], int | None], *, bare: bool = False) -> str:
        rule = "TEXT: /(.|\\n)*/"
        if self.start and token_id(self.start) is None:   # the marker is text: keep it out of TEXT
            rule += f" & ~/(.|\\n)*{_regex_literal(self.start)}(.|\\n)*/"
        if bare:   # free text does not start like a bare or fenced call
            rule += ' & ~/[ \\n]*(```json\\n)?\\{"name": "(.|\\n)*/'
        return rule + "\n"

    def _calls_rule(self, tools: Sequence[Tool], multiple: bool,
                    token_id: Callable[[str], int | None]) -> tuple[str, str]:
        """(the ``calls`` rule's body, the rules it needs)."""
        call_schema = self.call_schema(tools)
        rules = f"call_json: %json {json.dumps(call_schema)}\n"
        marker = self._marker(token_id)
        end = token_id(self.end) if self.end else None
        end_s = f"<[{end}]>" if end is not None else (json.dumps(self.end) if self.end else "")
        q = lambda s: json.dumps(s) if s else ""   # noqa: E731
        if self.list_form:
            item = "call_json"
            many = f'"[" {item} (", " {item})* "]"' if multiple else f'"[" {item} "]"'
            return f"{marker or ''} {many}", rules
        one = f"{marker or ''} {q(self.head)} call_json {q(self.tail)} {end_s}".strip()
        rules += f"call: {one}\n"
        return ("call (" + q(self.separator) + " call)*" if multiple else "call"), rules

    def call_schema(self, tools: Sequence[Tool]) -> dict:
        """The JSON schema of one call object: ``{"name": <a tool>, <args_key>: <its parameters>}``,
        in that key order (the order the templates render)."""
        options = []
        for t in tools:
            params = t.parameters or {"type": "object"}
            options.append({"type": "object", "properties": {"name": {"const": t.name}, self.args_key: params},
                            "required": ["name", self.args_key], "additionalProperties": False})
        schema: dict = options[0] if len(options) == 1 else {"anyOf": options}
        lenient = not all(t.strict for t in tools)
        style = dict(_DUMPS_STYLE) if self.dumps_style else {}
        return {**schema, "x-guidance": {**style, "lenient": lenient}}


def _schema_with(schema: dict, *, lenient: bool) -> dict:
    guidance = dict(schema.get("x-guidance") or {}) if isinstance(schema.get("x-guidance"), dict) else {}
    guidance.setdefault("lenient", lenient)
    for k, v in _DUMPS_STYLE.items():   # JSON as json.dumps writes it: no runs of whitespace between values
        guidance.setdefault(k, v)
    return {**schema, "x-guidance": guidance}


def _lark(start: str, rules: str) -> str:
    return "%llguidance {}\n" + start + "\n" + rules


def _regex_literal(text: str) -> str:
    out = []
    for ch in text:
        out.append("\\" + ch if ch in r"\.^$|?*+()[]{}/" else ch)
    return "".join(out)


FORMATS = {
    "hermes": ToolFormat("hermes", start="<tool_call>", end="</tool_call>", args_key="arguments", multiple=True,
                         separator="\n", head="\n", tail="\n", bare_calls=True),
    "llama3": ToolFormat("llama3", start="", end="", args_key="parameters", multiple=False),
    "mistral": ToolFormat("mistral", start="[TOOL_CALLS]", end="", args_key="arguments", multiple=True,
                          list_form=True, dumps_style=False),
}


def detect_format(template: str | None) -> ToolFormat | None:
    """The tool-call row for a chat template (None: the template renders no tools)."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return FORMATS["llama3"]
    return None


@dataclass(frozen=True)
class ReasoningFormat:
    """How a family's model thinks before it answers: ``start`` ... ``end`` ahead of the answer."""

    start: str = "<think>"
    end: str = "</think>"

    def opened(self, prompt: str) -> bool | None:
        """Where the rendered prompt leaves the model: True, inside its thoughts (the template opened
        them: Qwen3-2507 Thinking, DeepSeek-R1); False, with its thoughts closed (the template wrote
        an empty block: Qwen3 with ``enable_thinking`` false); None, free to open them or not."""
        tail = prompt.rstrip()
        if tail.endswith(self.start):
            return True
        if tail.endswith(self.end):
            return False
        return None

    def with_reasoning(self, grammar: str, *, opened: bool, token_id: Callable[[str], int | None]) -> str:
        """``grammar`` (``_lark`` output) with the model's thoughts admitted ahead of it: inside them
        when the prompt ``opened`` them, else an optional block. The thoughts are one lazy lexeme
        ended by the first ``end``, then the whitespace the model puts before its answer."""
        head, _, rest = grammar.partition("\nstart: ")
        body, _, rules = rest.partition("\n")
        end_id = token_id(self.end)
        if end_id is not None:
            think = (f"think: THINK <[{end_id}]> THINK_WS\n"
                     f"THINK: /(.|\\n)*/\n")
        else:
            think = f"think_text[lazy]: /(.|\\n)*/ {json.dumps(self.end)}\nthink: think_text THINK_WS\n"
        think += "THINK_WS: /[ \\t\\n]*/\n"
        if opened:
            start = "start: think main"
        else:
            start_id = token_id(self.start)
            opener = f"<[{start_id}]>" if start_id is not None else json.dumps(self.start)
            start = f"start: main | THINK_WS {opener} think main"
        return f"{head}\n{start}\nmain: {body}\n{rules}{think}"


def detect_reasoning(template: str | None) -> ReasoningFormat | None:
    """The reasoning row for a chat template (None: its model does not think in a block of its own)."""
    if template and "<think>" in template and "</think>" in template:
        return ReasoningFormat()
    return None
