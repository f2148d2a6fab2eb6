"""The model's output as events: text, a call started, its arguments in fragments, a call ended.

``OutputParser`` reads the text of a turn as it is decoded (``push``) and says what it holds
(``finish``), for one family's format (``agentspec.chat.formats``). Every wire adapter streams
from its events, and a whole (non-streamed) answer is one ``push`` and a ``finish``:

- ``Text(text)``: answer text, safe to send (never the start of a call marker: a partial
  ``<tool_`` is held until it is known to be text);
- ``CallStart(index, id, name)``, ``CallArgs(index, delta)`` (the arguments' JSON text in
  fragments, as OpenAI and Anthropic stream them), ``CallEnd(index)``;
- ``Reasoning(text)``: the model's thoughts, for a family that thinks in a block ahead of its
  answer (``ReasoningFormat``: ``<think>`` ... ``</think>``; opened by the prompt or by the model),
  without the block's tags and the newlines around its text; what follows the block is parsed as
  the answer.

Small coder models often write a call as a bare JSON object or in a ``json`` fence instead of
inside the family's tags (measured on the real Qwen2.5-Coder 0.5B and 1.5B). An answer that
*starts* like that is held back until it is known: a call when its ``name`` is a declared tool
and it parses, else text. Inside a tagged call the parser tracks the JSON (in a string or not,
nesting, the key being written): ``state`` is there for the decode step and drafters.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from .conversation import ToolCall
from .formats import ReasoningFormat, ToolFormat

__all__ = ["CallArgs", "CallEnd", "CallStart", "Event", "JsonState", "OutputParser", "Reasoning", "Text", "new_call_id"]


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    delta: str


@dataclass(frozen=True)
class CallEnd:
    index: int


@dataclass(frozen=True)
class Reasoning:
    text: str


Event = Text | CallStart | CallArgs | CallEnd | Reasoning


def new_call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


@dataclass
class JsonState:
    """Where a JSON text stands, character by character: nesting depth, inside a string, an
    escape pending, and the object key last written (the argument being filled)."""

    depth: int = 0
    in_string: bool = False
    escape: bool = False
    key: str | None = None
    _string: list[str] = field(default_factory=list)
    _expect_key: bool = False
    _string_is_key: bool = False

    @property
    def in_key(self) -> bool:
        """Inside an object key's string."""
        return self.in_string and self._string_is_key

    def feed(self, ch: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self._string_is_key:
                    self.key = "".join(self._string)
                self._string = []
                return
            if self._string_is_key:
                self._string.append(ch)
            return
        if ch == '"':
            self.in_string = True
            self._string_is_key = self._expect_key
            self._expect_key = False
        elif ch in "{[":
            self.depth += 1
            self._expect_key = ch == "{"
        elif ch in "}]":
            self.depth -= 1
        elif ch == ",":
            self._expect_key = True   # (in a list this is a value's place; harmless: it names no key)


_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*')
_FENCE = re.compile(r"^\s*```[a-zA-Z]*\s*\n?")


class OutputParser:
    """Turns a turn's text into ``Event``s for one tool-call format. ``tools``: the declared tool
    names (a bare or fenced JSON answer is a call only if it names one); ``fmt`` None (or no
    tools): everything is text. ``id_prefix``: how call ids start (``call_``, ``toolu_``, ``fc_``).
    ``reasoning``: the family's thought block (None: it has none); ``opened``: the prompt opened it
    (True), closed it (False: no thoughts follow) or left it to the model (None)."""

    def __init__(self, fmt: ToolFormat | None, tools: Iterable[str] = (), *, id_prefix: str = "call_",
                 forced: bool = False, reasoning: ReasoningFormat | None = None,
                 opened: bool | None = None) -> None:
        self.tools = frozenset(tools)
        self.fmt = fmt if self.tools else None
        self.id_prefix = id_prefix
        self.forced = forced             # the grammar forces calls: no text to hold back for
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self.incomplete = False          # the turn ended inside a call (cut off): no call returned for it
        self.json = JsonState()
        self._mode = "start" if self.fmt is not None else "text"
        self._buf = ""                   # text not yet decided (held back)
        self._call_text = ""             # the current call's text after its marker
        self._args_from = 0              # where its arguments start in _call_text (streaming)
        self._args_sent = 0
        self._open: CallStart | None = None
        self._bare = False               # the open call is bare JSON (no marker, no end tag)
        self._bare_fence = False         # ... inside a json fence
        self.reasoning: list[str] = []   # the thoughts, as sent
        self._think = reasoning
        # "head": the thoughts may open here; "in": inside them; "after": the whitespace after them
        self._r_mode = "none" if reasoning is None or opened is False else ("in" if opened else "head")
        self._r_buf = ""
        self._r_started = False          # a thought's text was sent (the newlines after ``start`` dropped)

    # ---- state for the decode step and drafters ---------------------------------------------

    @property
    def in_reasoning(self) -> bool:
        return self._r_mode == "in"

    @property
    def in_call(self) -> bool:
        return self._mode in ("call", "args", "call_tail", "call_raw", "held_json")

    @property
    def in_string(self) -> bool:
        """Inside a string value of a call's arguments (not a key)."""
        return self._mode == "args" and self.json.in_string and not self.json.in_key

    @property
    def open_arguments(self) -> tuple[str, str] | None:
        """Inside a call's arguments: the tool's name and the arguments' text written so far
        (None elsewhere)."""
        if self._mode != "args" or self._open is None:
            return None
        return self._open.name, self._call_text[self._args_from:]

    @property
    def call_head(self) -> tuple[str, str] | None:
        """Before a call's arguments: how the call opened ("tag": after the format's start
        marker; "json": an answer held as what may be a bare or fenced call) and its text so far
        (after the marker; the held text, leading whitespace aside). None elsewhere."""
        if self._mode == "call":
            return "tag", self._call_text
        if self._mode == "held_json" or (self._mode == "start" and self._buf.lstrip()[:1] in ("`", "{")):
            return "json", self._buf.lstrip()
        return None

    @property
    def call_closing(self) -> bool:
        """After a call's arguments, before the call's end."""
        return self._mode == "call_tail"

    @property
    def argument(self) -> str | None:
        """The argument (top-level key of the arguments object) being written, inside a call."""
        return self.json.key if self._mode == "args" else None

    # ---- feeding ----------------------------------------------------------------------------

    def push(self, text: str) -> list[Event]:
        out: list[Event] = []
        if not text:
            return out
        if self._r_mode != "none":
            text = self._reason(out, text, final=False)
            if not text:
                return out
        self._buf += text
        self._run(out, final=False)
        return out

    def finish(self) -> list[Event]:
        """The rest: held text released, a held JSON answer decided, a call the turn ended in
        completed if it parses (the model may stop before the closing tag) or else dropped
        (``incomplete``)."""
        out: list[Event] = []
        if self._r_mode != "none":
            rest = self._reason(out, "", final=True)
            self._buf += rest
        self._run(out, final=True)
        mode = self._mode
        if mode == "held_json":
            calls = self._parse_loose(self._buf)
            if calls is not None:
                for name, args in calls:
                    self._emit_whole(out, name, args)
            else:
                self._text(out, self._buf)
            self._buf = ""
        elif mode in ("call", "call_raw", "args", "call_tail"):
            body = self._call_text + self._buf
            if self.fmt is not None and self.fmt.end and body.rstrip().endswith(self.fmt.end):
                body = body.rstrip()[:-len(self.fmt.end)]
            if self._bare and body.rstrip().endswith("```"):
                body = body.rstrip()[:-3]
            many = self._parse_loose(body) if self._open is None and self.fmt.list_form else None
            parsed = self._parse_call_body(body)
            if many:
                for name, args in many:
                    self._emit_whole(out, name, args)
            elif parsed is not None and (self._open is None or parsed[0] == self._open.name):
                self._complete(out, *parsed)
            else:
                self.incomplete = True
            self._buf = ""
        elif mode == "after_bare":
            self._buf = ""   # whitespace (or a fence's end) after the last call
        elif self._buf:
            self._text(out, self._buf)
            self._buf = ""
        self._mode = "done"
        return out

    # ---- the thoughts ahead of the answer -----------------------------------------------------

    def _reason(self, out: list[Event], text: str, *, final: bool) -> str:
        """Takes what belongs to the thought block off ``text``; returns the rest (the answer's)."""
        r = self._think
        buf = self._r_buf + text
        self._r_buf = ""
        while True:
            if self._r_mode == "head":
                s = buf.lstrip()
                if s.startswith(r.start):
                    buf, self._r_mode = s[len(r.start):], "in"
                    continue
                if not final and (not s or r.start.startswith(s)):
                    self._r_buf = buf   # could still open the block
                    return ""
                self._r_mode = "none"
                return buf
            if self._r_mode == "in":
                if not self._r_started:
                    buf = buf.lstrip("\n")
                i = buf.find(r.end)
                if i >= 0:
                    self._thought(out, buf[:i].rstrip("\n"))
                    buf, self._r_mode = buf[i + len(r.end):], "after"
                    continue
                if final:   # cut off inside the thoughts
                    self._thought(out, buf)
                    self._r_mode = "none"
                    return ""
                keep = _partial_suffix(buf, r.end)
                send = buf[:len(buf) - keep]
                held = len(send) - len(send.rstrip("\n"))   # newlines: sent only if more thought follows
                self._thought(out, send[:len(send) - held])
                self._r_buf = buf[len(send) - held:]
                return ""
            if self._r_mode == "after":
                s = buf.lstrip()
                if not s and not final:
                    return ""
                self._r_mode = "none"
                return s
            return buf

    def _thought(self, out: list[Event], text: str) -> None:
        if text:
            self._r_started = True
            self.reasoning.append(text)
            out.append(Reasoning(text))

    # ---- the machine ------------------------------------------------------------------------

    def _run(self, out: list[Event], *, final: bool) -> None:
        fmt = self.fmt
        while self._buf:
            mode = self._mode
            if mode == "text":
                if fmt is None or not fmt.start:
                    self._text(out, self._buf)
                    self._buf = ""
                    return
                i = self._buf.find(fmt.start)
                if i >= 0:
                    self._text(out, self._buf[:i])
                    self._buf = self._buf[i + len(fmt.start):]
                    self._begin_call()
                    continue
                keep = 0 if final else _partial_suffix(self._buf, fmt.start)
                self._text(out, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            if mode == "start":
                s = self._buf.lstrip()
                if not s:
                    return
                if fmt.start and s.startswith(fmt.start):
                    self._buf = s[len(fmt.start):]
                    self._begin_call()
                    continue
                if fmt.start and fmt.start.startswith(s) and not final:
                    return   # could still be the marker
                if s.startswith("<|python_tag|>"):
                    self._buf = s[len("<|python_tag|>"):]
                    self._mode = "held_json"
                    continue
                if "<|python_tag|>".startswith(s) and not final:
                    return
                if s[0] in "{[`" and self._could_be_call(s):
                    self._mode = "held_json"
                    continue
                self._mode = "text"
                continue
            if mode == "held_json":
                held = self._buf.lstrip()
                if not self._could_be_call(held):
                    self._mode = "text"
                    continue
                fence = _FENCE.match(held) if held.startswith("`") else None
                body = held[fence.end():] if fence is not None else held
                m = _HEADER.match(body)
                if m is not None and _unescape(m.group(1)) in self.tools:
                    # a bare (or fenced) call to an offered tool: its arguments stream from here on
                    self._bare, self._bare_fence = True, fence is not None
                    self._open = CallStart(len(self.calls), new_call_id(self.id_prefix), _unescape(m.group(1)))
                    out.append(self._open)
                    self._call_text = body[:m.end()]
                    self._args_from = self._args_sent = m.end()
                    self.json = JsonState()
                    self._buf = body[m.end():]
                    self._mode = "args"
                    continue
                return   # decided when it grows, or at finish (a list of calls)
            if mode == "call_tail" and self._bare:
                rest = self._buf.lstrip()
                if not rest:
                    return
                if rest[0] != "}":   # not the object's end: the whole text decides at finish
                    self._call_text += self._buf
                    self._buf = ""
                    return
                self._call_text += self._buf[:len(self._buf) - len(rest) + 1]
                self._buf = rest[1:]
                parsed = self._parse_call_body(self._call_text)
                if parsed is None or parsed[0] != self._open.name:
                    return
                out.append(CallEnd(self._open.index))
                self._record(self._open, parsed[1])
                self._open, self._call_text, self._bare = None, "", False
                self._mode = "after_bare"
                continue
            if mode == "after_bare":
                rest = self._buf.lstrip()
                if self._bare_fence:
                    if not rest or (len(rest) < 3 and "```".startswith(rest)):
                        return
                    if rest.startswith("```"):
                        self._buf, self._bare_fence = rest[3:], False
                        continue
                if not rest:
                    return
                if rest[0] in "{`":   # another call
                    self._buf = rest
                    self._mode = "held_json"
                    continue
                self._mode = "text"
                continue
            if mode == "call":
                if fmt.list_form:
                    self._mode = "call_raw"
                    continue
                self._call_text += self._buf
                self._buf = ""
                m = _HEADER.match(self._call_text)
                if m is not None:
                    name = _unescape(m.group(1))
                    self._open = CallStart(len(self.calls), new_call_id(self.id_prefix), name)
                    out.append(self._open)
                    self._args_from = self._args_sent = m.end()
                    self.json = JsonState()
                    self._mode = "args"
                    rest, self._call_text = self._call_text[m.end():], self._call_text[:m.end()]
                    self._buf = rest
                    continue
                if not _header_prefix(self._call_text):
                    self._mode = "call_raw"   # another key order, or not JSON: decided at the end tag
                return
            if mode == "args":
                consumed = 0
                closed = False
                for ch in self._buf:
                    if self.json.depth == 0 and consumed == 0 and self._args_sent == self._args_from and ch.isspace():
                        consumed += 1
                        self._args_from += 1
                        self._args_sent += 1
                        continue
                    self.json.feed(ch)
                    consumed += 1
                    if self.json.depth == 0 and not self.json.in_string:
                        closed = True
                        break
                piece = self._buf[:consumed]
                self._buf = self._buf[consumed:]
                self._call_text += piece
                delta = self._call_text[self._args_sent:]
                if delta:
                    out.append(CallArgs(self._open.index, delta))
                    self._args_sent = len(self._call_text)
                if closed:
                    self._mode = "call_tail"
                    continue
                return
            if mode in ("call_tail", "call_raw"):
                end = fmt.end
                if not end:    # closed by the end of the turn (Mistral's list, Llama's object)
                    self._call_text += self._buf
                    self._buf = ""
                    return
                i = self._buf.find(end)
                if i < 0:
                    keep = _partial_suffix(self._buf, end)
                    self._call_text += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._call_text += self._buf[:i]
                self._buf = self._buf[i + len(end):]
                parsed = self._parse_call_body(self._call_text)
                if mode == "call_tail" and parsed is not None and parsed[0] == self._open.name:
                    out.append(CallEnd(self._open.index))
                    self._record(self._open, parsed[1])
                elif parsed is not None and self._open is None:
                    self._emit_whole(out, *parsed)
                else:   # a marker around something that is not a call: the model's text, as written
                    self._open = None
                    self._text(out, fmt.start + self._call_text + end)
                self._open = None
                self._call_text = ""
                self._mode = "between"
                continue
            if mode == "between":
                s = self._buf.lstrip()
                if not s:
                    if final:
                        self._buf = ""
                    return
                if fmt.start.startswith(s[:len(fmt.start)]) and len(s) < len(fmt.start) and not final:
                    return
                if s.startswith(fmt.start):
                    self._buf = s[len(fmt.start):]
                    self._begin_call()
                    continue
                self._mode = "text"
                continue
            return

    def _begin_call(self) -> None:
        self._mode = "call"
        self._call_text = ""
        self._open = None

    def _text(self, out: list[Event], text: str) -> None:
        if text:
            self.content.append(text)
            out.append(Text(text))

    def _record(self, start: CallStart, args: str) -> None:
        self.calls.append(ToolCall(id=start.id, name=start.name, arguments=args))

    def _complete(self, out: list[Event], name: str, args: str) -> None:
        """The open call (or a new one) finished from its whole text at the end of the turn."""
        if self._open is None:
            self._emit_whole(out, name, args)
            return
        sent = self._call_text[self._args_from:self._args_sent] if self._mode in ("args", "call_tail") else ""
        if args.startswith(sent) and len(args) > len(sent):
            out.append(CallArgs(self._open.index, args[len(sent):]))
        out.append(CallEnd(self._open.index))
        self._record(self._open, args)
        self._open = None

    def _emit_whole(self, out: list[Event], name: str, args: str) -> None:
        start = CallStart(len(self.calls), new_call_id(self.id_prefix), name)
        out += [start, CallArgs(start.index, args), CallEnd(start.index)]
        self._record(start, args)

    # ---- JSON ------------------------------------------------------------------------------

    def _call_object(self, obj) -> tuple[str, str] | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):   # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return obj["name"], json.dumps(args, ensure_ascii=False)

    def _parse_call_body(self, body: str) -> tuple[str, str] | None:
        """One call's JSON (the text between its markers), as (name, arguments JSON text). The
        arguments keep the model's own text where it streamed them (what the client was sent)."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        parsed = self._call_object(obj)
        if parsed is None:
            return None
        m = _HEADER.match(body)
        if m is not None:   # the arguments as written (streamed fragments add up to them)
            try:
                raw, end = json.JSONDecoder().raw_decode(body, m.end())
                if isinstance(raw, dict):
                    return parsed[0], body[m.end():end]
            except ValueError:
                pass
        return parsed

    def _parse_loose(self, text: str) -> list[tuple[str, str]] | None:
        """A held answer as calls: bare JSON, a fenced block, a list of calls, or several objects
        one after another; every call naming a declared tool. None: it is text."""
        s = text.strip()
        fence = _FENCE.match(s)
        if fence is not None:
            s = s[fence.end():]
            if not s.rstrip().endswith("```"):
                return None
            s = s.rstrip()[:-3]
        s = s.strip()
        if self.fmt is not None and self.fmt.list_form and s.startswith(self.fmt.start):
            s = s[len(self.fmt.start):].strip()
        objs = []
        dec = json.JSONDecoder()
        i = 0
        while i < len(s):
            try:
                obj, i = dec.raw_decode(s, i)
            except ValueError:
                return None
            objs.extend(obj if isinstance(obj, list) else [obj])
            while i < len(s) and (s[i].isspace() or s[i] in ",;"):
                i += 1
        calls = []
        for obj in objs:
            c = self._call_object(obj)
            if c is None or c[0] not in self.tools:
                return None
            calls.append(c)
        if not calls or (len(calls) > 1 and not (self.fmt and self.fmt.multiple)):
            return calls[:1] or None
        return calls

    def _could_be_call(self, s: str) -> bool:
        """Whether a held answer's start may still turn out to be a call to a declared tool."""
        fence = _FENCE.match(s)
        if s.startswith("`"):
            if fence is None:
                return "```".startswith(s[:3]) and "\n" not in s
            s = s[fence.end():]
        s = s.lstrip()
        if s.startswith("["):
            s = s[1:].lstrip()
        if not s:
            return True
        if s[0] != "{":
            return False
        ok, name, complete = _header_progress(s)
        if not ok:
            return False
        if name is None:
            return True
        return name in self.tools if complete else any(t.startswith(name) for t in self.tools)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _header_progress(text: str) -> tuple[bool, str | None, bool]:
    """How far ``text`` gets into a call header ``{"name": "...", "arguments": `` (any whitespace):
    (whether it may still be one, the name so far or None, whether the name is complete)."""
    i, n = 0, len(text)

    def ws() -> None:
        nonlocal i
        while i < n and text[i].isspace():
            i += 1

    def lit(s: str) -> bool | None:   # True matched, None ran out (a prefix), False mismatch
        nonlocal i
        for ch in s:
            if i >= n:
                return None
            if text[i] != ch:
                return False
            i += 1
        return True

    for part in ("{", '"name"', ":", '"'):
        ws()
        r = lit(part)
        if r is not True:
            return r is None, None, False
    chars = []
    while i < n and text[i] != '"':
        if text[i] == "\\":
            if i + 1 >= n:
                return True, _unescape("".join(chars)), False
            chars.append(text[i:i + 2])
            i += 2
            continue
        chars.append(text[i])
        i += 1
    name = _unescape("".join(chars))
    if i >= n:
        return True, name, False
    i += 1
    ws()
    r = lit(",")
    if r is not True:
        return r is None, name, True
    ws()
    rest = text[i:]
    ok = any(k.startswith(rest[:len(k)]) or rest.startswith(k) for k in ('"arguments"', '"parameters"'))
    return ok, name, True


def _header_prefix(text: str) -> bool:
    """Whether ``text`` may still grow into a call header ``{"name": "...", "arguments": ``."""
    return _HEADER.match(text) is not None or _header_progress(text)[0]


def _unescape(s: str) -> str:
    try:
        return json.loads(f'"{s}"')
    except ValueError:
        return s
