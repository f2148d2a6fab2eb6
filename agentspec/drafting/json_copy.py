"""Escape-aware drafting: text the server has, copied into the JSON string the model is writing.

An agent's editing turn is mostly tool-call arguments (``Write(content=...)``, ``Edit(old_string,
new_string)``, a heredoc in a ``bash`` command) that copy text the server already holds: the file a
``Read`` returned, the ``old_string`` the model just wrote. Inside a JSON string that text arrives
escaped (a newline as ``\\n``, a quote as ``\\"``, a backslash doubled), so a token-level index over
the raw text matches only the stretches between escapes. This drafter works on text instead:

1. the request's output is read by the tool-call format's ``OutputParser`` (the request's
   ``OutputFormat``, told through ``OutputDrafter.output_format``), which says, token by token,
   whether the output is inside a JSON string of a call's arguments and which argument;
2. inside one, the string written so far is unescaped, and its tail (up to ``MAX_MATCH``
   characters, at least ``MIN_MATCH``) is looked up in the *unescaped* sources: the string
   values the output already holds (the ``old_string`` before a ``new_string``), the prompt's
   text, and the prompt with line-number gutters stripped (``cat -n`` / ``Read`` results);
3. what followed the match there is escaped as the model writes JSON (``json.dumps``, raw UTF-8
   unless the output used ``\\u`` escapes) and tokenized with the target's tokenizer from the last
   committed token's boundary: a chain draft, verified like any other (exactness never depends on
   a draft).

Edits: at the start of ``new_string`` (nothing written to match yet) the draft is the call's
``old_string`` from its start (an edit changes a few lines of what it replaces); a ``Write``'s
``content`` starts as the file the prompt shows whole; any other argument as an earlier call had
it (the path a ``Read`` took), else, from its first characters, as the line of a file shown whole
that they start (an ``old_string`` quoting the file). Where a copied string ends in the source
(the end of ``old_string``, of the path read), the draft closes the JSON string too.

Between arguments: after a string value, the separator, the next key the tool's schema requires
(the schemas as the prompt shows them) and its value's opening quote, laid out as the model lays
out its arguments (``,`` and the whitespace it puts before a key, its ``: ``); a draft that
closes a string goes on with them. Around the arguments, the call's envelope: a fence's ``json``
and ``{``, the ``"name": "`` key, the tool's name once what is typed names one tool, the
``"arguments": {`` after it and the first key one level deeper, and after the last required
argument the closing braces and the fence's or the format's end, all laid out as the model laid
out the call's opening (compact, or indented).

Changed lines: where the tail matches nowhere (the model changed the line, or re-indented it),
the last finished line the source has, whitespace aside, anchors the next one (``_by_lines``):
the line as many lines further down is drafted, indented as the model indents. A numbered
listing (the model copying a ``Read``'s line numbers into the file, as small models do, with a
separator of its own) is drafted line by line with the next number (``_numbered``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .draft import EMPTY_DRAFT, Draft

__all__ = ["JsonCopyDrafter", "escape_json", "unescape_json"]

MIN_MATCH = 8      # characters of the string's tail a copy must match
MAX_MATCH = 64     # the longest tail looked up
_LINE_BACK = 8     # lines back a line-anchored copy looks for a line the source has
_LINE_KEY = 4      # characters (whitespace aside) a line needs to anchor one
_LINE_CONF = 0.9   # a line-anchored draft's per-token confidence (a whole line matched, as a 32-character tail)
# a line number leading a line of a numbered listing: its indentation, its digits, the separator
_NUMBERED = re.compile(r"^( *)(\d+)(\t|→|\| ?|\.|:)?(?=\S| |$)")
# arguments that write a whole file: at their start, the file the prompt shows
_FILE_KEYS = frozenset({"content", "file_text"})
# a draft's per-token confidence by the length of the tail it matched
_CONF = ((64, 0.95), (32, 0.9), (16, 0.8), (0, 0.6))
# what may follow a value up to the next key's name (part of it), and an object's "{" up to its first key's
_SEPARATOR = re.compile(r'\s*(?:,\s*(?:"[^"\\]*)?)?')
_FIRST = re.compile(r'\s*(?:"[^"\\]*)?')
# a call's JSON opening up to its arguments: the indentation of its line, the whitespace before "name"
_CALL_OPEN = re.compile(r'(?:^|(?<=\n))([ \t]*)\{(\s*)"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"(?:arguments|parameters)"\s*:\s*',
                        re.M)
_HEAD_WS = re.compile(r'\{\s*')                                 # a call's "{" and the whitespace after it
_HEAD_NAME = re.compile(r'\{(\s*)"name"\s*:\s*"([^"\\]*)(?:"(.*))?', re.S)   # its name typed (and what follows)
_FENCE = re.compile(r"```[a-zA-Z]*[ \t]*\n")
_END = "\x00"      # between string values in the output's source: a copy stops there, closing the string

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", '"': '"', "\\": "\\", "/": "/"}
_ESC = re.compile(r"\\(u[0-9a-fA-F]{4}|.)", re.S)
_SURROGATE = re.compile("[\ud800-\udfff]")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"', re.S)
# line-number gutters of a file shown to the model: `cat -n` ("     1\t"), Claude Code's Read
# ("     1→"), opencode's ("00001| ")
_GUTTER = re.compile(r"^ *\d+(?:\t|→|\| ?)", re.M)
# a run of such lines: a file shown whole (its end is where a copy of it closes the string)
_GUTTER_RUN = re.compile(r"(?:^ *\d+(?:\t|→|\| ?).*(?:\n|$))+", re.M)


def unescape_json(s: str) -> str:
    """The text a JSON string body (no quotes) stands for; an escape it cannot read stays as written."""
    if "\\" not in s:
        return s

    def one(m: re.Match) -> str:
        e = m.group(1)
        if e[0] == "u" and len(e) == 5:
            return chr(int(e[1:], 16))
        return _ESCAPES.get(e, m.group(0))
    out = _ESC.sub(one, s)
    if _SURROGATE.search(out):   # a pair written as two \u escapes: one character
        out = out.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return out


def escape_json(s: str, *, ascii_only: bool = False) -> str:
    """``s`` as a JSON string body, escaped as ``json.dumps`` writes it."""
    return json.dumps(s, ensure_ascii=ascii_only)[1:-1]


_SHORT = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f", "/": "\\/"}


def _key(ch: str) -> str | None:
    """The class of a character the model may write raw or escaped (None: one way only)."""
    o = ord(ch)
    if o < 0x20 or ch == "/":
        return ch
    return "U" if o > 0x7F else None


def learn_escapes(raw: str, forms: dict, prev: str | None) -> tuple[int, str | None]:
    """Read how the model wrote a stretch of a JSON string body (``raw``, as written): for each
    character it may write raw or escaped (control characters, ``/``, non-ASCII) the form it took,
    after which character, into ``forms`` ({(previous char or None, class): "raw" | "esc"}).
    Returns how far it read (an escape cut off at the end is left for later) and the last
    character read."""
    i, n = 0, len(raw)
    while i < n:
        ch = raw[i]
        if ch == "\\":
            if i + 1 >= n:
                break
            e = raw[i + 1]
            if e == "u":
                if i + 6 > n:
                    break
                try:
                    ch = chr(int(raw[i + 2:i + 6], 16))
                except ValueError:
                    ch = "u"
                i += 6
            else:
                ch = _ESCAPES.get(e, e)
                i += 2
            form = "esc"
        else:
            i += 1
            form = "raw"
        k = _key(ch)
        if k is not None:
            forms[(prev, k)] = forms[(None, k)] = form
        prev = ch
    return i, prev


def escape_like(s: str, forms: dict, prev: str | None = None) -> str:
    """``s`` as a JSON string body, each character that may go either way written the way the
    model last wrote it after the same character (``forms``, ``learn_escapes``), else after any,
    else as ``json.dumps`` writes it (control characters escaped, ``/`` and non-ASCII raw)."""
    out: list[str] = []
    for ch in s:
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        else:
            k = _key(ch)
            if k is None:
                out.append(ch)
            else:
                form = forms.get((prev, k)) or forms.get((None, k)) or ("esc" if ord(ch) < 0x20 else "raw")
                if form == "raw":
                    out.append(ch)
                elif ch in _SHORT:
                    out.append(_SHORT[ch])
                else:
                    out.append(json.dumps(ch, ensure_ascii=True)[1:-1])
        prev = ch
    return "".join(out)


def _spaces(text: str, i: int) -> int:
    n = i
    while n < len(text) and text[n] == " ":
        n += 1
    return n - i


def _indent_delta(cur: str, start: int, cut: bool, src: str, at: int) -> int:
    """How much deeper the model indents than the source: where the match (``cur[start:]`` found
    at ``src[at:]``) starts inside a line, that line's indentation in the output less the source
    line's (0 where the match holds the line's start, so the indentation already matched, or where
    the output's line starts before the text at hand: ``cut``)."""
    ls = cur.rfind("\n", 0, start) + 1
    if ls == start or (ls == 0 and cut):
        return 0
    src_ls = src.rfind("\n", 0, at) + 1
    return _spaces(cur, ls) - _spaces(src, src_ls)


def _reindent(text: str, delta: int, *, full_first: bool = False) -> str:
    """``text``'s lines (after its first line break; from its start with ``full_first``) with
    ``delta`` more leading spaces (fewer, where negative, as far as a line has them)."""
    if delta == 0:
        return text
    lines = text.split("\n")
    for i in range(0 if full_first else 1, len(lines)):
        line = lines[i]
        if not line or line.startswith("\t"):
            continue
        lines[i] = " " * delta + line if delta > 0 else line[min(-delta, _spaces(line, 0)):]
    return "\n".join(lines)


def _line_kind(line: str) -> str:
    return "empty" if not line.strip() else ("indented" if line[0] in " \t" else "flush")


def _lead(lead: str, first: int, num: int) -> str:
    """The spaces before ``num`` in a listing whose line ``first`` had ``lead`` before it: as
    many, or fewer by the digits gained where the listing keeps a width (cat -n's 6)."""
    if len(lead) + len(str(first)) == 6:
        return " " * max(0, 6 - len(str(num)))
    return lead


def _tail_lines(raw: str, chars: int) -> tuple[list[str], str] | None:
    """The last ``chars`` of a JSON string body (``raw``, escaped), unescaped and split into its
    finished lines (the first dropped where the cut fell inside it) and the line being written;
    None without a line break."""
    lo = max(0, len(raw) - chars)
    while lo > 0 and _backslashes_before(raw, lo) % 2 == 1:
        lo += 1
    done = unescape_json(raw[lo:]).split("\n")
    if len(done) < 2:
        return None
    partial = done.pop()
    return (done[1:] if lo > 0 else done), partial


def _layout(args: str) -> tuple[list[str], str, str, str] | None:
    """How an arguments object is laid out so far, where its text ends after a top-level string
    value and maybe part of what follows it up to the next key (``,``, whitespace, the key's
    first characters), or after its ``{`` and maybe part of its first key: (the keys written at
    its top level, the whitespace the model puts before a key after a ``,``, what it puts between
    a key and its value (``: ``), the text after that value or ``{``); None elsewhere (inside a
    value, a nested value). Before a second key the layout is guessed from the first: the
    whitespace after ``{`` (a space where there was none, as ``json.dumps`` writes), ``: ``."""
    depth, in_str, esc, is_key = 0, False, False, False
    expect_key = False
    keys: list[str] = []
    buf: list[str] = []
    ws: list[str] | None = None      # whitespace after the top level's "{" or "," so far
    before_key, kv, after_comma = "", None, False
    kv_buf: list[str] | None = None  # after a top-level key, up to its value
    value_end = -1
    for i, ch in enumerate(args):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if is_key:
                    keys.append("".join(buf))
                    kv_buf = []
                elif depth == 1:
                    value_end = i
            elif is_key:
                buf.append(ch)
            continue
        if kv_buf is not None:
            if ch.isspace() or ch == ":":
                kv_buf.append(ch)
                continue
            kv, kv_buf = "".join(kv_buf), None
        if ws is not None:
            if ch.isspace():
                ws.append(ch)
                continue
            if ch == '"':
                before_key, after_comma = "".join(ws), depth == 1 and args[:i].rstrip().endswith(",")
            ws = None
        if ch == '"':
            in_str, is_key, buf = True, expect_key and depth == 1, []
            expect_key = False
        elif ch in "{[":
            depth += 1
            expect_key = ch == "{"
            if depth == 1:
                ws, value_end = [], i
        elif ch in "}]":
            depth -= 1
        elif ch == ",":
            expect_key = True
            if depth == 1:
                ws = []
    tail = args[value_end + 1:]
    if (in_str and not is_key) or depth != 1 or value_end < 0 or not (_SEPARATOR if keys else _FIRST).fullmatch(tail):
        return None
    if not after_comma:
        before_key = before_key or " "
    return keys, before_key, ": " if kv is None else kv, tail


def _backslashes_before(text: str, i: int) -> int:
    n = 0
    while i - n - 1 >= 0 and text[i - n - 1] == "\\":
        n += 1
    return n


def _last_open_quote(text: str, lo: int) -> int:
    """The last unescaped ``"`` in ``text`` at or after ``lo`` (-1: none)."""
    i = len(text)
    while True:
        i = text.rfind('"', lo, i)
        if i < 0 or _backslashes_before(text, i) % 2 == 0:
            return i


@dataclass
class _Req:
    prompt_ids: list[int]
    tenant: str
    ids: list[int] = field(default_factory=list)
    parser: Any = None                 # the output's OutputParser (None: no output format told)
    json_state: Any = None             # a whole-JSON answer's JsonState (response schema)
    text: str = ""                     # the output's text, as far as fed
    open_at: int = -1                  # where the JSON string being written opens in ``text``
    sources: list[str] | None = None   # the prompt's unescaped sources (built on first use)
    prompt_text: str = ""              # the prompt as text (with the sources)
    files: list[str] = field(default_factory=list)   # files the prompt shows whole (a Read's), gutters stripped
    lines: dict = field(default_factory=dict)        # id(source) -> (its lines, stripped line -> indices)
    out_source: str = ""               # the output's finished string values, unescaped, _END-separated
    out_source_to: int = -1            # ... for the output up to this string's opening
    forms: dict = field(default_factory=dict)   # how the model writes what may go either way (learn_escapes)
    scanned: int = 0                   # the output's text read into ``forms`` up to here
    scan_prev: str | None = None       # the last character read there (in the current string)
    key_values: dict = field(default_factory=dict)   # argument -> its values in the prompt's calls, last first
    schemas: dict | None = None        # tool name -> (its argument keys in order, the required ones, key -> type)
    stats: dict = field(default_factory=lambda: {"proposals": 0, "edit": 0, "output": 0, "prompt": 0, "index": 0,
                                                 "keys": 0, "envelope": 0})


class JsonCopyDrafter:
    """A ``Drafter`` (and ``OutputDrafter``) that copies unescaped text into the JSON string
    being written, escaped. ``tokenizer``: the target's (``encode`` / ``decode``, and a
    ``backend`` with ``encode(text, add_special_tokens=False)`` when it adds a BOS)."""

    def __init__(self, tokenizer: Any, *, index: Any = None, min_match: int = MIN_MATCH,
                 max_match: int = MAX_MATCH) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.tokenizer = tokenizer
        self.index = index   # a SuffixIndex: the tenant's workspace and earlier outputs, where the prompt has no match
        self.min_match, self.max_match = int(min_match), int(max_match)
        self._reqs: dict[str, _Req] = {}
        self._piece: dict[int, str] = {}

    # ---- Drafter ------------------------------------------------------------------------------

    def start(self, req_id: str, prompt: Sequence[int], *, tenant: str = "default") -> None:
        self._reqs[req_id] = _Req(list(prompt), tenant)

    def output_format(self, req_id: str, output: Any) -> None:
        from ..chat.formats import FORMATS
        from ..chat.parse import JsonState, OutputParser

        r = self._reqs.get(req_id)
        if r is None:
            return
        fmt = FORMATS.get(output.tool_format) if output.tool_format else None
        if fmt is not None and output.tools:
            r.parser = OutputParser(fmt, output.tools, forced=bool(output.forced))
        elif output.json:
            r.json_state = JsonState()

    def extend(self, req_id: str, tokens: Sequence[int]) -> None:
        r = self._reqs.get(req_id)
        if r is not None and (r.parser is not None or r.json_state is not None):
            r.ids.extend(int(t) for t in tokens)

    def stop(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def stats(self, req_id: str) -> dict | None:
        """Drafts proposed for a request, by where they were copied from (for tests and benchmarks)."""
        r = self._reqs.get(req_id)
        return None if r is None else dict(r.stats)

    def propose(self, req_id: str, budget: int) -> Draft:
        r = self._reqs.get(req_id)
        if r is None or budget <= 0 or not r.ids or (r.parser is None and r.json_state is None):
            return EMPTY_DRAFT
        if not self._sync(r):
            return self._next_key(r, budget)
        raw = r.text[r.open_at + 1:]
        # an escape half written: the next characters finish it
        pending = _backslashes_before(raw, len(raw)) % 2 == 1
        if pending:
            raw = raw[:-1]
        elif re.search(r"(?<!\\)(?:\\\\)*\\u[0-9a-fA-F]{0,3}$", raw):
            return EMPTY_DRAFT   # inside a \uXXXX escape
        found = self._find(r, raw)
        if found is None:
            return EMPTY_DRAFT
        cont, conf, where = found
        closes = cont.endswith(_END)
        body = cont[:-1] if closes else cont
        # the string's escapes as the model writes them: learn from what it wrote (raw tabs, a raw
        # newline after a tab, \/, \u escapes of non-ASCII ...), then write the copy the same way
        lo = max(r.scanned, r.open_at + 1)
        if lo == r.open_at + 1:
            r.scan_prev = None
        read, r.scan_prev = learn_escapes(r.text[lo:len(r.text) - (1 if pending else 0)], r.forms, r.scan_prev)
        r.scanned = lo + read
        esc = escape_like(body, r.forms, r.scan_prev)
        if pending:
            if not esc.startswith("\\"):
                return EMPTY_DRAFT
            esc = esc[1:]
        if closes:
            esc += '"'
            args = r.parser.open_arguments if r.parser is not None else None
            if args is not None:   # and the next argument's key, as the model lays them out
                after = self._key_text(r, args[0], args[1] + esc, len(r.text) - len(args[1]))
                esc += after[0] if after is not None else ""
        ids = self._tokens(r.ids[-1], esc)
        if not closes and len(ids) > 1:
            ids = ids[:-1]   # the last token may be a word cut short
        ids = ids[:budget]
        if not ids:
            return EMPTY_DRAFT
        r.stats["proposals"] += 1
        r.stats[where] += 1
        return Draft.chain(ids, conf, source="json_copy")

    # ---- the output's state ----------------------------------------------------------------------

    def _sync(self, r: _Req) -> bool:
        """Feed the output's new text to its parser; whether it is inside a JSON string now (and
        ``r.open_at`` is where that string opens)."""
        text = self.tokenizer.decode(r.ids).rstrip("\ufffd")
        if not text.startswith(r.text):   # (a character completed differently: start over)
            r.text, r.open_at = "", -1
            r.out_source_to = -1
            r.scanned, r.scan_prev = 0, None
            if r.parser is not None:
                r.parser = type(r.parser)(r.parser.fmt, r.parser.tools, forced=r.parser.forced)
            else:
                r.json_state = type(r.json_state)()
        new = text[len(r.text):]
        before = len(r.text)
        r.text = text
        if r.parser is not None:
            r.parser.push(new)
            inside = r.parser.in_string and r.parser.argument is not None
        else:
            for ch in new:
                r.json_state.feed(ch)
            inside = r.json_state.in_string
        if not inside:
            r.open_at = -1
            return False
        if r.open_at < 0 or _last_open_quote(text, max(before - 1, r.open_at + 1)) >= 0:
            r.open_at = _last_open_quote(text, 0)
        return r.open_at >= 0

    def _argument(self, r: _Req) -> str | None:
        return r.parser.argument if r.parser is not None else None

    # ---- where the continuation comes from -------------------------------------------------------

    def _prompt_sources(self, r: _Req) -> list[str]:
        if r.sources is None:
            prompt = r.prompt_text = self.tokenizer.decode(r.prompt_ids)
            # a Read's file without its gutters first (the model writes the file, not the gutters),
            # then the prompt unescaped (an earlier call's arguments), then as it is
            plain = _GUTTER_RUN.sub(lambda m: _GUTTER.sub("", m.group(0)) + _END, prompt)
            r.files = [_GUTTER.sub("", m.group(0)) for m in _GUTTER_RUN.finditer(prompt)]
            views = [plain, unescape_json(plain), prompt]
            r.sources = [v for i, v in enumerate(views) if v not in views[:i]]
        return r.sources

    def _output_source(self, r: _Req) -> str:
        """The string values the output wrote before the current string, unescaped."""
        if r.out_source_to != r.open_at:
            values = [unescape_json(m.group(1)) for m in _STRING.finditer(r.text, 0, r.open_at)]
            r.out_source = _END.join(values) + _END if values else ""
            r.out_source_to = r.open_at
        return r.out_source

    def _find(self, r: _Req, raw: str) -> tuple[str, float, str] | None:
        """(continuation, confidence, source kind) for the string written so far (``raw``, escaped)."""
        # the tail, unescaped, from an escape boundary
        lo = max(0, len(raw) - 6 * self.max_match)
        while lo > 0 and _backslashes_before(raw, lo) % 2 == 1:
            lo += 1
        cur = unescape_json(raw[lo:])
        n = 8 * 64   # characters copied at most (tokens are fewer)
        if len(cur) < self.min_match and lo == 0:
            return self._at_start(r, cur, n)
        if lo == 0 and self._argument(r) not in _FILE_KEYS and self._argument(r) != "new_string":
            found = self._same_key(r, cur)   # a path, a name, a command as an earlier call wrote it
            if found is not None:
                return found
        out = self._output_source(r)
        sources = [(out, "output")] + [(s, "prompt") for s in self._prompt_sources(r)]
        # in a line's indentation: match up to the line break, then the next line's indentation
        # (re-indented as the model indents) less what it typed already
        typed, base = "", cur
        nl = cur.rfind("\n")
        if nl >= 0 and nl < len(cur) - 1 and not cur[nl + 1:].strip(" "):
            typed, base = cur[nl + 1:], cur[:nl + 1]
        top = min(self.max_match, len(base))
        numbered_tried = lines_tried = False
        for L in sorted({top, *(x for x in (32, 16, self.min_match) if self.min_match <= x < top)}, reverse=True):
            if L < 32 and not numbered_tried:   # a numbered listing's next line, where the tail is no copy
                numbered_tried = True
                found = self._numbered(r, raw, sources, n)
                if found is not None:
                    return found
            if L < 16 and not lines_tried:   # before a short tail's guess: the lines around a changed one
                lines_tried = True
                found = self._by_lines(r, raw, sources, n)
                if found is not None:
                    return found
            needle = base[-L:]
            for src, kind in sources:
                at = src.rfind(needle)
                if at < 0:
                    continue
                cont = src[at + L:at + L + n]
                end = cont.find(_END)
                if end >= 0:   # the copied value (a string the output wrote, a file shown whole) ends: so does the string
                    cont = cont[:end + 1]
                cont = _reindent(cont, _indent_delta(base, len(base) - L, lo > 0, src, at), full_first=bool(typed))
                if typed:
                    if not cont.startswith(typed):
                        continue
                    cont = cont[len(typed):]
                if cont:
                    return cont, next(c for m, c in _CONF if L >= m), kind
        if not numbered_tried:
            found = self._numbered(r, raw, sources, n)
            if found is not None:
                return found
        if not lines_tried:
            found = self._by_lines(r, raw, sources, n)
            if found is not None:
                return found
        return self._from_index(r, cur, n)

    def _at_start(self, r: _Req, cur: str, n: int) -> tuple[str, float, str] | None:
        """A string with fewer than ``min_match`` characters written: an edit's ``new_string``
        starts as its ``old_string`` did; a file's content (``content``, ``file_text``) as the file
        the prompt shows whole (a ``Read`` of it); any other argument as the same argument of the
        prompt's last call that has it (the path a ``Read`` took)."""
        key = self._argument(r)
        if key == "new_string":   # an edit: new_string starts as old_string did
            old = self._call_value(r, "old_string")
            if old is not None and old.startswith(cur) and len(old) > len(cur):
                return old[len(cur):len(cur) + n] + (_END if len(old) - len(cur) <= n else ""), 0.8, "edit"
            return self._quoted(r, cur, n)
        if key is None:
            return None
        self._prompt_sources(r)
        if key in _FILE_KEYS:
            for f in reversed(r.files):
                if f.startswith(cur) and len(f) > len(cur):
                    return f[len(cur):len(cur) + n] + (_END if len(f) - len(cur) <= n else ""), 0.6, "prompt"
            return None
        return self._same_key(r, cur) or self._quoted(r, cur, n)

    def _same_key(self, r: _Req, cur: str) -> tuple[str, float, str] | None:
        """The string being written as the same argument of an earlier call has it, where that
        value starts with all of it: the output's own calls last first, then the prompt's (the
        path a ``Read`` took); the draft closes the string where that value ends."""
        key = self._argument(r)
        if key is None:
            return None
        self._prompt_sources(r)
        values = r.key_values.get(key)
        if values is None:   # (the prompt's calls' arguments as the model wrote them: JSON)
            values = r.key_values[key] = [unescape_json(m.group(1)) for m in reversed(list(re.finditer(
                r'"' + re.escape(key) + r'"\s*:\s*"((?:[^"\\]|\\.)*)"', r.prompt_text)))]
        own = self._call_value(r, key)
        for v, kind in ([(own, "output")] if own is not None else []) + [(v, "prompt") for v in values]:
            if v.startswith(cur):
                return v[len(cur):] + _END, 0.8, kind
        return None

    def _quoted(self, r: _Req, cur: str, n: int) -> tuple[str, float, str] | None:
        """A string that starts quoting a file the prompt shows whole (an ``old_string``, a search
        pattern): what follows every place the file has the characters typed, as far as those
        places agree. Places at a line's start (indentation aside, unless typed) first; where
        there is none, places where a word starts (three characters typed at least)."""
        lead = cur.lstrip(" \t")
        if len(lead) < 2 or "\n" in cur:
            return None
        self._prompt_sources(r)
        if not r.files:
            return None
        conts: list[str] = []
        at_line = re.compile((r"^[ \t]*" + re.escape(cur)) if lead == cur else ("^" + re.escape(cur)), re.M)
        for f in r.files:
            conts += [f[m.end():m.end() + n] for m in at_line.finditer(f)]
        if not conts and len(lead) >= 3 and lead == cur:
            in_line = re.compile(r"(?<!\w)" + re.escape(cur) if cur[0].isalnum() or cur[0] == "_" else re.escape(cur))
            for f in r.files:
                conts += [f[m.end():m.end() + n] for m in in_line.finditer(f)]
        if not conts:
            return None
        common = os.path.commonprefix(conts)
        return (common, 0.8 if len(set(conts)) == 1 else 0.7, "prompt") if common else None

    # ---- between arguments --------------------------------------------------------------------

    def _schemas(self, r: _Req) -> dict:
        """The offered tools' argument keys, from their schemas as the prompt shows them (every
        chat template writes a tool's ``parameters`` as JSON): name -> (keys in order, required
        keys, key -> JSON type)."""
        if r.schemas is None:
            r.schemas = {}
            self._prompt_sources(r)
            prompt, tools = r.prompt_text, (r.parser.tools if r.parser is not None else frozenset())
            names = list(re.finditer(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', prompt))
            dec = json.JSONDecoder()
            for m in re.finditer(r'"(?:parameters|input_schema)"\s*:\s*(?=\{)', prompt):
                try:
                    schema, _ = dec.raw_decode(prompt, m.end())
                except ValueError:
                    continue
                props = schema.get("properties") if isinstance(schema, dict) else None
                if not isinstance(props, dict):
                    continue
                # the tool's name: the nearest "name" before its schema that names an offered tool
                name = next((x.group(1) for x in reversed(names) if x.start() < m.start() and x.group(1) in tools),
                            None)
                if name is None or name in r.schemas:
                    continue
                req = schema.get("required")
                r.schemas[name] = (list(props), set(req) if isinstance(req, list) else set(),
                                   {k: v.get("type") if isinstance(v, dict) else None for k, v in props.items()})
        return r.schemas

    def _key_text(self, r: _Req, name: str, args: str, at: int) -> tuple[str, str] | None:
        """What follows ``args`` (a call's arguments, ending after a string value and maybe part
        of the separator after it): the rest of the separator, the next required key of the
        tool's schema and its value's opening quote, laid out as the model laid out the keys
        before (``,`` and the whitespace it put before a key, its ``: ``); where the schema requires
        no more, what closes the call. ``at``: where ``args`` starts in the output. (The text,
        "keys" or "envelope"); None: nothing."""
        layout = _layout(args)
        schema = self._schemas(r).get(name) if layout is not None else None
        if schema is None:
            return None
        keys, before_key, kv, tail = layout
        order, required, types = schema
        nxt = next((k for k in order if k not in keys and k in required), None)
        if nxt is None:   # the call closes (or the model adds an optional argument)
            env = self._envelope(r, at) if keys and "," not in tail else None
            if env is None:
                return None
            text, kind = env[2], "envelope"
        else:
            kind = "keys"
            key = json.dumps(nxt) + kv + ('"' if types.get(nxt) == "string" else "")
            if keys:
                text = "," + before_key + key
            elif '"' in tail:   # the first key, once its quote is typed
                text = tail[:tail.index('"')] + key
            elif (env := self._envelope(r, at)) is not None and (env[1] or not tail):
                text = env[1] + key   # the first key, one level deeper than the call's keys
            else:
                return None
        return (text[len(tail):], kind) if text.startswith(tail) and len(text) > len(tail) else None

    def _envelope(self, r: _Req, at: int | None) -> tuple[str, str, str] | None:
        """The call whose arguments start at ``at`` in the output (None: the last call opened),
        as the model laid it out: (the whitespace before its ``"name"``, the whitespace its
        arguments' first key takes (one level deeper; none where the call is compact), the text
        that closes the arguments and the call: the closing braces laid out the same way, then
        the fence's or the format's end)."""
        head = r.text if at is None else r.text[:at]
        m = None
        for m in _CALL_OPEN.finditer(head):
            pass
        if m is None or (at is not None and m.end() != len(head)):
            return None
        ws, indent = m.group(2), m.group(1)
        fmt = r.parser.fmt
        before = head[:m.start()].rstrip(" \t")
        if before.endswith("```json\n") or before.endswith("```\n"):
            end = "\n```"
        elif fmt is not None and fmt.start and before.endswith(fmt.start + fmt.head):
            end = fmt.tail + fmt.end
        else:
            end = ""
        if "\n" in ws:
            spaces = ws[ws.rindex("\n") + 1:]   # the call's keys' indentation: one level past its brace's
            return ws, ws + spaces[len(indent):], "\n" + spaces + "}\n" + indent + "}" + end
        return ws, "", "}}" + end

    def _head_text(self, r: _Req) -> str | None:
        """Before a call's arguments: the rest of its opening as the format and the tools allow
        (a fence's ``json``, ``{"name": "``, a tool's name once what is typed names one tool, and
        ``", "arguments": {`` laid out as the model laid out ``"name"``)."""
        got = r.parser.call_head if r.parser is not None else None
        if got is None:
            return None
        kind, text = got
        fmt = r.parser.fmt
        if kind == "json" and text.startswith("`"):
            if "```json\n{".startswith(text):
                return "```json\n{"[len(text):]
            f = _FENCE.match(text)
            if f is None:
                return None
            text = text[f.end():]
        elif kind == "tag":
            opening = fmt.head + "{"
            if opening.startswith(text):
                return opening[len(text):]
            text = text.lstrip()
        m = _HEAD_WS.match(text)
        if m is not None:   # the name's key, once its quote is typed (the whitespace before it may be any)
            opening = m.group(0) + '"name": "'
            if opening.startswith(text) and len(text) > len(m.group(0)):
                return opening[len(text):]
        m = _HEAD_NAME.fullmatch(text)
        if m is None:
            return None
        ws, typed, rest = m.group(1), m.group(2), m.group(3)
        names = sorted(t for t in r.parser.tools if t.startswith(typed))
        if not names:
            return None
        after = "," + (ws if "\n" in ws else " ") + json.dumps(fmt.args_key) + ": {"
        if rest is None:
            if len(names) > 1:
                common = os.path.commonprefix(names)[len(typed):]
                return common or None
            return names[0][len(typed):] + '"' + after
        if typed not in r.parser.tools or not after.startswith(rest) or after == rest:
            return None
        return after[len(rest):]

    def _closing_text(self, r: _Req) -> str | None:
        """After a call's arguments closed: the rest of what closes the call (``_envelope``)."""
        env = self._envelope(r, None)
        q = r.text.rfind('"')
        written = r.text[q + 1:]
        if env is None or q < 0 or "}" not in written or not env[2].startswith(written) or env[2] == written:
            return None
        return env[2][len(written):]

    def _next_key(self, r: _Req, budget: int) -> Draft:
        """Outside the arguments' strings: between arguments and after the last (``_key_text``),
        before them (``_head_text``), after them (``_closing_text``)."""
        if r.parser is None:
            return EMPTY_DRAFT
        args = r.parser.open_arguments
        conf, kind = 0.9, "envelope"
        if args is not None:
            got = self._key_text(r, *args, len(r.text) - len(args[1]))
            text, kind = got if got is not None else (None, kind)
        elif r.parser.call_closing:
            text = self._closing_text(r)
        else:
            text = self._head_text(r)
            conf = 0.6 if text == "json\n{" else 0.9   # (a fence may open code, not a call)
        if not text:
            return EMPTY_DRAFT
        ids = self._tokens(r.ids[-1], text)[:budget]
        if not ids:
            return EMPTY_DRAFT
        r.stats["proposals"] += 1
        r.stats[kind] += 1
        return Draft.chain(ids, conf, source="json_copy")

    def _line_index(self, r: _Req, src: str, cache: bool) -> tuple[list[str], dict[str, list[int]]]:
        got = r.lines.get(id(src)) if cache else None
        if got is None or got[0] is not src:
            lines = src.split("\n")
            index: dict[str, list[int]] = {}
            for i, line in enumerate(lines):
                key = line.strip()
                if len(key) >= _LINE_KEY:
                    index.setdefault(key, []).append(i)
            got = (src, lines, index)
            if cache:
                r.lines[id(src)] = got
        return got[1], got[2]

    def _by_lines(self, r: _Req, raw: str, sources: list, n: int) -> tuple[str, float, str] | None:
        """The line being written, from the lines around it: the last finished line of the string
        (within ``_LINE_BACK``) found in a source, whitespace aside, anchors it; the line as many
        lines further down that source is the one being written (the lines between were changed
        one for one), or a line near it that starts as this one does. Copied from there with the
        indentation the model gives it: what it typed, or, still at the line's start, the depth it
        gave the anchor line relative to the source (re-indented code stays re-indented)."""
        tail = _tail_lines(raw, 3000)
        if tail is None:
            return None
        done, partial = tail
        ws = partial[:len(partial) - len(partial.lstrip(" \t"))]
        typed = partial[len(ws):]
        piece = self._piece_of(r.ids[-1])
        last_ws = piece != "" and not piece.strip(" ")
        for back in range(1, min(_LINE_BACK, len(done)) + 1):
            key = done[-back].strip()
            if len(key) < _LINE_KEY:
                continue
            best = None
            for si, (src, kind) in enumerate(sources):
                lines, index = self._line_index(r, src, cache=si > 0)
                for j in reversed(index.get(key, ())):
                    # how many lines before the anchor agree too (the likelier place where a line repeats)
                    score = 0
                    while (score < 3 and j - score - 1 >= 0 and back + score + 1 <= len(done)
                           and lines[j - score - 1].strip() == done[-back - score - 1].strip()):
                        score += 1
                    if best is None or score > best[0]:
                        best = (score, lines, j, kind)
            if best is None:
                continue
            _, lines, j, kind = best
            order = [j + back] + ([p for p in range(j + 1, j + back + 3) if p != j + back] if typed else [])
            for p in order:
                if p >= len(lines):
                    continue
                line = lines[p]
                s_ws = line[:len(line) - len(line.lstrip(" \t"))]
                body = line[len(s_ws):]
                if typed:
                    if not body.startswith(typed):
                        continue
                    first = body[len(typed):]
                    tabs = "\t" in ws or "\t" in s_ws
                    if tabs and ws != s_ws:
                        continue
                    delta = 0 if tabs else len(ws) - len(s_ws)
                else:
                    anchor = done[-back]
                    a_ws = len(anchor) - len(anchor.lstrip(" "))
                    delta = a_ws - _spaces(lines[j], 0)
                    if "\t" in s_ws or "\t" in ws:
                        if not s_ws.startswith(ws):
                            return None
                        delta, first = 0, s_ws[len(ws):] + body
                    else:
                        want = len(s_ws) + delta
                        if ws and last_ws and want <= len(ws):
                            want = len(ws) + 1   # (a run of spaces is a token short of the last one, which leads the word)
                            delta = want - len(s_ws)
                        if want < len(ws):
                            return None
                        first = " " * (want - len(ws)) + body
                cont = first + "\n" + _reindent("\n".join(lines[p + 1:])[:n], delta, full_first=True)
                end = cont.find(_END)
                if end >= 0:
                    cont = cont[:end + 1]
                if cont and cont != "\n":
                    return cont[:n], _LINE_CONF, kind
            return None
        return None

    def _numbered(self, r: _Req, raw: str, sources: list, n: int) -> tuple[str, float, str] | None:
        """A numbered listing: the string's last lines each start with a line number, one more each
        line (the model copying a file with the gutters its ``Read`` showed, as small models do,
        with a separator of its own or none). The last numbered line found in a source, its
        gutter aside, anchors the next: drafted with its number, the separator the model last
        wrote before a line of the same kind (flush, indented, empty), then the source's line."""
        tail = _tail_lines(raw, 1500)
        if tail is None:
            return None
        done, partial = tail
        gutters = [_NUMBERED.match(x) for x in done[-3:]]
        if len(gutters) < 2 or not all(gutters):
            return None
        nums = [int(m.group(2)) for m in gutters]
        if any(b != a + 1 for a, b in zip(nums, nums[1:])):
            return None
        seps: dict[str, str] = {}
        for line in done[-_LINE_BACK:]:   # the separator by the kind of line it goes before
            m = _NUMBERED.match(line)
            if m is not None:
                seps[_line_kind(line[m.end():])] = m.group(3) or ""
        last = gutters[-1]
        for back in range(1, len(gutters) + 1):
            m = gutters[-back]
            rest = done[-back][m.end():]
            key = rest.strip()
            if len(key) < _LINE_KEY:
                continue
            for si, (src, kind) in enumerate(sources):
                lines, index = self._line_index(r, src, cache=si > 0)
                js = index.get(key)
                if not js:
                    continue
                j = js[-1]
                delta = _spaces(rest, 0) - _spaces(lines[j], 0)
                nxt = nums[-1] + 1
                out: list[str] = []
                size = 0
                for k, p in enumerate(range(j + back, len(lines))):
                    line = lines[p]
                    if _END in line:
                        break
                    line = _reindent("\n" + line, delta)[1:]
                    kind_k = _line_kind(line)
                    text = f"{_lead(last.group(1), nums[-1], nxt + k)}{nxt + k}{seps.get(kind_k, last.group(3) or '')}{line}"
                    if k == 0:
                        if not text.startswith(partial):
                            return None
                        text = text[len(partial):]
                    out.append(text)
                    size += len(text) + 1
                    if size >= n:
                        break
                cont = "\n".join(out)
                return (cont, _LINE_CONF, kind) if cont else None
            return None
        # no line to anchor on: a listing whose last lines say the same after their numbers (empty
        # ones, as a model caught in a loop writes them) goes on the same way
        rests = {done[-k][m.end():] for k, m in zip(range(len(gutters), 0, -1), gutters)}
        if len(rests) == 1:
            rest = rests.pop()
            sep, nxt = last.group(3) or "", nums[-1] + 1
            lines = [f"{_lead(last.group(1), nums[-1], nxt + k)}{nxt + k}{sep}{rest}" for k in range(max(1, n // 16))]
            if lines[0].startswith(partial):
                return "\n".join(lines)[len(partial):n], 0.8, "output"
        return None

    def _from_index(self, r: _Req, cur: str, n: int) -> tuple[str, float, str] | None:
        """The tail looked up in the suffix index (the tenant's workspace files and earlier outputs,
        raw text as tokens): a request of the index's own whose context is the tail's tokens,
        opened and closed here (it proposes; it has no output, so its tenant's history is unchanged)."""
        if self.index is None or len(cur) < self.min_match:
            return None
        ids = self._encode(cur[-self.max_match:])[1:]   # (the first token may be a word cut short)
        if len(ids) < 2:
            return None
        rid = f"json_copy\x1f{id(r)}"
        self.index.start(rid, ids, tenant=r.tenant)
        try:
            toks, parents, probs, _ = self.index.propose(rid, max(1, n // 4))
        finally:
            self.index.stop(rid)
        chain: list[int] = []
        last = -1
        for i, (t, p) in enumerate(zip(toks, parents)):   # the first root-to-leaf path (likeliest first)
            if p == last:
                chain.append(int(t))
                last = i
        if len(chain) < 2:
            return None
        cont = self.tokenizer.decode(chain).rstrip("\ufffd")
        return (cont, 0.7, "index") if cont else None
        return None

    def _call_value(self, r: _Req, key: str) -> str | None:
        """The last complete ``key`` string value the output wrote, unescaped."""
        m = None
        for m in re.finditer(r'"' + re.escape(key) + r'"\s*:\s*"((?:[^"\\]|\\.)*)"', r.text[:r.open_at]):
            pass
        return None if m is None else unescape_json(m.group(1))

    # ---- text to token ids -----------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        backend = getattr(self.tokenizer, "backend", None)
        if backend is not None:
            return list(backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text))

    def _piece_of(self, token: int) -> str:
        piece = self._piece.get(token)
        if piece is None:
            piece = self._piece[token] = self.tokenizer.decode([token])
        return piece

    def _tokens(self, last: int, text: str) -> list[int]:
        """``text``'s tokens as they follow the committed token ``last``: tokenized together with
        that token's text where it stays one token there (the boundary the model sees), else alone."""
        piece = self._piece_of(last)
        if piece and "\ufffd" not in piece:
            ids = self._encode(piece + text)
            if ids and ids[0] == last:
                return ids[1:]
        return self._encode(text)
