"""Escape-aware drafting (``agentspec.drafting.json_copy``) and grammar-forced drafts
(``agentspec.decode.step.with_forced``), on a real tokenizer (the bundled model's BPE) and real
files of this repository: the drafter is fed an agent's tool call token by token, as the engine
feeds it, and each draft is checked against what the call says comes next."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec import Draft
from agentspec.backends.protocol import OutputFormat
from agentspec.decode.step import with_forced
from agentspec.drafting.json_copy import JsonCopyDrafter, escape_json, unescape_json

ROOT = Path(__file__).resolve().parents[2]
HERMES = OutputFormat(tool_format="hermes", tools=("Read", "Write", "Edit"))


@pytest.fixture(scope="module")
def tok():
    from agentspec.backends.embedded.weights import load_checkpoint

    return load_checkpoint(quiet=True).tokenizer


def _gutter(text: str) -> str:   # a Read result as Claude Code shows it: "     1→line"
    return "".join(f"{i + 1:6d}→{line}\n" for i, line in enumerate(text.splitlines()))


def _replay(tok, prompt: str, output: str, fmt: OutputFormat | None = HERMES, budget: int = 32):
    """Feed ``output``'s tokens as greedy verification would commit them (the accepted draft
    prefix plus one token a step); (steps, accepted, drafted, the drafter's stats)."""
    out = tok.encode(output)
    d = JsonCopyDrafter(tok)
    d.start("r", tok.encode(prompt))
    if fmt is not None:
        d.output_format("r", fmt)
    i, steps, accepted, drafted = 1, 0, 0, 0
    d.extend("r", out[:1])
    while i < len(out):
        draft = d.propose("r", budget)
        draft.validate(budget)
        assert draft.parents == list(range(-1, len(draft) - 1))   # a chain
        k = 0
        while k < len(draft) and i + k < len(out) and draft.token_ids[k] == out[i + k]:
            k += 1
        new = out[i:i + k + 1]
        d.extend("r", new)
        i += len(new)
        steps, accepted, drafted = steps + 1, accepted + k, drafted + len(draft)
    stats = d.stats("r")
    d.stop("r")
    assert d.stats("r") is None
    return steps, accepted, drafted, stats


def _call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_escape_and_unescape_are_json_strings(s):
    assert json.loads('"' + escape_json(s) + '"') == s
    assert unescape_json(escape_json(s)) == s
    if not any("\ud800" <= c <= "\udfff" for c in s):   # (a lone surrogate has no UTF-16 pair to rejoin)
        assert unescape_json(json.dumps(s, ensure_ascii=True)[1:-1]) == s


@pytest.mark.parametrize("path", ["agentspec/drafting/suffix.py", "agentspec/text.py"])
def test_a_write_of_a_file_the_prompt_holds_is_drafted_through_its_escapes(tok, path):
    """The file read with line-number gutters, rewritten with one line changed in a Write: the
    content (quotes, newlines, backslashes escaped) is nearly all drafted."""
    src = (ROOT / path).read_text()
    assert "\n" in src and '"' in src
    new = src.replace("from __future__ import annotations", "from __future__ import annotations  # (edited)", 1)
    prompt = f"<|im_start|>user\nRead({path}):\n{_gutter(src)}\nMark the future import.<|im_end|>\n<|im_start|>assistant\n"
    output = _call("Write", file_path=path, content=new)
    n = len(tok.encode(output))
    steps, accepted, drafted, stats = _replay(tok, prompt, output)
    assert accepted >= 0.8 * n, (accepted, n)
    assert steps <= n / 5
    assert stats["prompt"] > 0 and accepted >= 0.7 * drafted


def test_an_edit_drafts_new_string_from_old_string(tok):
    src = (ROOT / "agentspec/drafting/suffix.py").read_text()
    old = src[src.index("    def propose"):src.index("    def stop")]
    new = old.replace('"suffix")', '"suffix")  # the index\'s own')
    prompt = f"<|im_start|>user\n{_gutter(src)}\nComment the source name.<|im_end|>\n<|im_start|>assistant\n"
    output = _call("Edit", file_path="suffix.py", old_string=old, new_string=new)
    steps, accepted, drafted, stats = _replay(tok, prompt, output)
    assert stats["edit"] >= 1   # new_string's start: old_string from its start
    new_tokens = len(tok.encode(json.dumps(new)))
    assert accepted >= len(tok.encode(json.dumps(old))) * 0.6 + new_tokens * 0.6


def test_old_string_copied_to_its_end_closes_the_string(tok):
    old = 'x = "a\\\\b"\ny = 2\n'
    d = JsonCopyDrafter(tok)
    prefix = '<tool_call>\n{"name": "Edit", "arguments": {"old_string": ' + json.dumps(old) + ', "new_string": "x = '
    d.start("r", tok.encode("prompt"))
    d.output_format("r", HERMES)
    d.extend("r", tok.encode(prefix))
    draft = d.propose("r", 64)
    assert tok.decode(draft.token_ids) == json.dumps(old)[5:]   # the rest of it, escaped, and the closing quote


def test_nothing_is_drafted_outside_strings_or_without_a_format(tok):
    src = (ROOT / "agentspec/text.py").read_text()
    prompt = f"user: {src}\nassistant:"
    # free text copying the file: no output format, no drafts (the suffix index drafts raw text)
    _, accepted, drafted, stats = _replay(tok, prompt, src, fmt=None)
    assert drafted == 0 and stats["proposals"] == 0
    # a call whose strings hold nothing the prompt has: only the call's envelope is drafted (its
    # braces, name key and tags, from the format), nothing inside its strings
    _, _, drafted, stats = _replay(tok, prompt, _call("Read", file_path="zz_no_such_path_qq.txt"))
    assert stats["proposals"] == stats["envelope"] and stats["prompt"] == stats["output"] == stats["edit"] == 0
    # prose before a call: nothing drafted for it either
    _, _, drafted, stats = _replay(tok, prompt, "I will read it.\n" + _call("Read", file_path="x"))
    assert stats["proposals"] == stats["envelope"]


def test_a_pending_escape_and_ascii_escapes_are_continued_as_written(tok):
    text = 'caf\u00e9 "x"\n\ttab line two of the text\n'
    d = JsonCopyDrafter(tok)
    d.start("r", tok.encode("The text: " + text))
    d.output_format("r", OutputFormat(json=True))
    written = json.dumps({"content": text}, ensure_ascii=True)
    cut = written.index("\\n") + 1   # the output ends between the backslash and the n
    d.extend("r", tok.encode(written[:cut]))
    draft = tok.decode(d.propose("r", 64).token_ids)
    assert written[cut:].startswith(draft) and draft.startswith("n\\ttab")
    assert "\\u00e9" in written[:cut]   # the output escaped é: copies would too (nothing after it has one here)


def test_unknown_requests_and_zero_budgets_draft_nothing(tok):
    d = JsonCopyDrafter(tok)
    assert not d.propose("nope", 8).token_ids
    d.start("r", tok.encode("abc"))
    d.output_format("r", HERMES)
    d.extend("r", tok.encode('<tool_call>\n{"name": "Write", "arguments": {"content": "abc'))
    assert not d.propose("r", 0).token_ids
    d.output_format("other", HERMES)   # not started: ignored
    with pytest.raises(ValueError, match="min_match"):
        JsonCopyDrafter(tok, min_match=0)


def test_forced_tokens_lead_the_draft_and_the_drafter_continues_after_them():
    d = Draft([5, 6, 7, 9, 8], [-1, 0, 1, -1, 3], [0.9, 0.9, 0.8, 0.5, 0.5], source="suffix")
    out = with_forced([5, 6], d, 16)
    assert out.token_ids == [5, 6, 7] and out.parents == [-1, 0, 1]
    assert out.node_sources == ["grammar", "grammar", "suffix"] and out.probs[:2] == [1.0, 1.0]
    assert out.source == "grammar+suffix"
    # a draft that does not start with the forced tokens adds nothing
    out = with_forced([4], d, 16)
    assert out.token_ids == [4] and out.source == "grammar"
    # the budget holds
    assert with_forced([1, 2, 3], d, 2).token_ids == [1, 2]
    out.validate(16)


def test_the_tenants_workspace_serves_where_the_prompt_has_no_copy(tok):
    """A Write of a file the prompt does not hold (not read this turn) but the tenant's workspace
    does (a document in the suffix index): copied from the index, escaped; another tenant's
    documents never reach the request."""
    from suffix_index import SuffixIndex

    src = (ROOT / "agentspec/text.py").read_text()
    output = _call("Write", file_path="agentspec/text.py", content=src)
    n = len(tok.encode(output))
    for tenant, want in (("acme", True), ("other", False)):
        index = SuffixIndex(vocab_size=len(tok.backend.get_vocab()) + 64)
        index.add_document("agentspec/text.py", tok.encode(src), tenant="acme")
        d = JsonCopyDrafter(tok, index=index)
        out = tok.encode(output)
        d.start("r", tok.encode("Rewrite agentspec/text.py as it is."), tenant=tenant)
        d.output_format("r", HERMES)
        i, accepted = 1, 0
        d.extend("r", out[:1])
        while i < len(out):
            draft = d.propose("r", 32)
            k = 0
            while k < len(draft) and i + k < len(out) and draft.token_ids[k] == out[i + k]:
                k += 1
            d.extend("r", out[i:i + k + 1])
            i, accepted = i + k + 1, accepted + k
        stats = d.stats("r")
        if want:
            assert stats["index"] > 0 and accepted > 0.6 * n, (stats, accepted, n)
        else:   # (the tail's own repeats aside, nothing to copy)
            assert accepted < 0.1 * n, (stats, accepted, n)
        assert index.num_requests == 0   # the lookups' own requests are closed


def test_copies_are_escaped_the_way_the_model_escapes(tok):
    """A model that writes tabs raw and a newline after a tab raw (the real 1.5B copying a
    `cat -n` Read result does), other newlines escaped: once it has, the drafts do too."""
    from agentspec.drafting.json_copy import escape_like, learn_escapes

    forms: dict = {}
    read, prev = learn_escapes('a\\n     1\timport x\\n     2\t\n     3\tb\\/c caf\\u00e9', forms, None)
    assert prev == "é" and read == len('a\\n     1\timport x\\n     2\t\n     3\tb\\/c caf\\u00e9')
    assert escape_like("x\n\ty\t\nz/é", forms, None) == "x\\n\ty\t\nz\\/\\u00e9"
    assert escape_like('q"\\', {}, None) == 'q\\"\\\\' and escape_like("\n/é", {}) == "\\n/é"
    assert learn_escapes("ab\\u00", {}, None)[0] == 2   # an escape cut off: read later

    src = "".join(f"line {i} of the file\n\n" for i in range(40))
    gutter = "".join(f"{i + 1:6d}\t{line}\n" for i, line in enumerate(src.splitlines()))
    prompt = "<|im_start|>user\n<tool_response>\n" + gutter + "<|im_end|>\n<|im_start|>assistant\n"
    # the call as that model writes it: the gutters copied, tabs raw, a newline after a tab raw
    body = gutter.replace("\t\n", "\t\x00").replace("\n", "\\n").replace("\x00", "\n")
    output = '<tool_call>\n{"name": "Write", "arguments": {"file_path": "f.txt", "content": "' + body + '"}}'
    n = len(tok.encode(output))
    _, accepted, drafted, _ = _replay(tok, prompt, output)
    assert accepted > 0.8 * n and accepted > 0.8 * drafted, (accepted, drafted, n)


def test_a_copy_the_model_reindents_is_drafted_reindented(tok):
    """The real 1.5B rewriting an HTML file with a script in it indented every copied line 8
    spaces deeper than the file: once a line shows it, the drafts carry the same indentation."""
    src = "".join(f"{' ' * (4 * (i % 3))}item_{i} = compute({i}, 'x')\n" for i in range(60))
    prompt = "<|im_start|>user\n" + src + "<|im_end|>\n<|im_start|>assistant\n"
    moved = "".join("        " + line + "\n" for line in src.splitlines())
    output = _call("Write", file_path="f.py", content=moved)
    n = len(tok.encode(output))
    _, accepted, drafted, _ = _replay(tok, prompt, output)
    assert accepted > 0.7 * n, (accepted, drafted, n)


def _draft_after(tok, prompt: str, written: str, fmt: OutputFormat = HERMES, budget: int = 64) -> str:
    """The text of the drafter's proposal once the output is ``written``."""
    d = JsonCopyDrafter(tok)
    d.start("r", tok.encode(prompt))
    d.output_format("r", fmt)
    d.extend("r", tok.encode(written))
    return tok.decode(d.propose("r", budget).token_ids)


def test_after_a_changed_line_the_next_one_is_drafted_from_the_source(tok):
    """A Write that changes one line of the file: right after the changed line's break, before a
    character of the next line is written, the draft is the source's next line (the line the
    change replaced anchors nothing; the one before it does)."""
    lines = [f"    value_{i} = table[{i}] * {i + 7}" for i in range(40)]
    prompt = "<|im_start|>user\n" + _gutter("\n".join(lines)) + "<|im_end|>\n<|im_start|>assistant\n"
    changed = lines[:20] + ["    something entirely new()"]
    written = _call("Write", file_path="t.py", content="\n".join(changed) + "\n")
    written = written[:written.rindex("\\n") + 2]   # up to the changed line's break
    assert _draft_after(tok, prompt, written).startswith(json.dumps("\n".join(lines[21:24]))[1:-1])
    # the same where the model writes the line's indentation deeper than the file has it
    deeper = [" " * 4 + line for line in lines[:21]]
    written = _call("Write", file_path="t.py", content="\n".join(deeper[:20] + ["        other()"]) + "\n")
    written = written[:written.rindex("\\n") + 2]
    assert _draft_after(tok, prompt, written).startswith(json.dumps("\n".join(deeper[21:21] + [" " * 4 + lines[21]]))[1:-1])


def test_a_write_starts_as_the_file_read_and_a_path_as_the_one_read(tok):
    src = (ROOT / "agentspec/text.py").read_text()
    read = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "agentspec/text.py"}}\n</tool_call>'
    prompt = (f"<|im_start|>user\nFix it.<|im_end|>\n<|im_start|>assistant\n{read}<|im_end|>\n"
              f"<|im_start|>user\n<tool_response>\n{_gutter(src)}</tool_response><|im_end|>\n<|im_start|>assistant\n")
    head = '<tool_call>\n{"name": "Write", "arguments": {"file_path": "'
    assert _draft_after(tok, prompt, head) == 'agentspec/text.py"'
    written = head + 'agentspec/text.py", "content": "'
    assert json.dumps(src)[1:].startswith(_draft_after(tok, prompt, written)[:200])
    assert len(_draft_after(tok, prompt, written)) >= 100


def test_a_numbered_listing_is_drafted_with_its_numbers(tok):
    """The real 1.5B, made to Write a file it had Read, copied the Read's line numbers into it with
    a separator of its own ("     7.class X:", "     8    def f():", "     9."): once two lines show
    the listing, each next line is drafted with its number, that separator and the file's line."""
    src = (ROOT / "agentspec/text.py").read_text()
    prompt = "<|im_start|>user\n" + _gutter(src) + "<|im_end|>\n<|im_start|>assistant\n"
    listing = "".join(f"{i:6d}{'' if line[:1] == ' ' else '.'}{line}\n" for i, line in enumerate(src.splitlines(), 1))
    output = _call("Write", file_path="agentspec/text.py", content=listing)
    n = len(tok.encode(output))
    steps, accepted, drafted, _ = _replay(tok, prompt, output)
    assert accepted > 0.8 * n and steps < n / 6, (steps, accepted, drafted, n)


def test_a_listing_caught_in_a_loop_goes_on_with_its_numbers(tok):
    """The real 1.5B, once, wrote a Write's content as lines of numbers alone ("  9.\\n 10.\\n
    11.\\n ..."): nothing in the file anchors such lines; the listing goes on as it has been."""
    src = (ROOT / "agentspec/text.py").read_text()
    prompt = "<|im_start|>user\n" + _gutter(src) + "<|im_end|>\n<|im_start|>assistant\n"
    listing = "".join(f"{i:3d}.\n" for i in range(1, 120))
    output = _call("Write", file_path="agentspec/text.py", content=listing)
    n = len(tok.encode(output))
    steps, accepted, drafted, _ = _replay(tok, prompt, output)
    assert accepted > 0.8 * n and steps < n / 6, (steps, accepted, drafted, n)


EDIT = {"type": "object", "properties": {"file_path": {"type": "string"}, "old_string": {"type": "string"},
                                          "new_string": {"type": "string"}, "replace_all": {"type": "boolean"}},
        "required": ["file_path", "old_string", "new_string"]}
# the tools as Qwen2.5's chat template lists them in the system prompt (one JSON object a line)
TOOLS = ("<|im_start|>system\nYou may call one or more functions.\n<tools>\n"
         + json.dumps({"type": "function", "function": {"name": "Read", "description": "Read a file.", "parameters": {
             "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}}) + "\n"
         + json.dumps({"type": "function", "function": {"name": "Edit", "description": 'Replace "old_string".',
                                                        "parameters": EDIT}})
         + "\n</tools><|im_end|>\n")


@pytest.mark.parametrize("indent", [None, 4])
def test_the_next_argument_is_drafted_as_the_model_lays_out_its_arguments(tok, indent):
    """After an argument's string value: the separator, the next key the tool's schema requires
    and its value's quote, with the whitespace the model put before its keys (a space after a
    comma where it wrote `{"` compact, as json.dumps does); the same from any point of the
    separator and from inside the key. After the last required argument, what closes the call."""
    prompt = TOOLS + "<|im_start|>user\nFix x.py<|im_end|>\n<|im_start|>assistant\n"
    args = {"file_path": "x.py", "old_string": "a = 1", "new_string": "a = 2"}
    call = "<tool_call>\n" + json.dumps({"name": "Edit", "arguments": args}, indent=indent) + "\n</tool_call>"
    sep = ",\n" + " " * (2 * indent) if indent else ", "
    after_path = call.index('"x.py"') + len('"x.py"')
    assert _draft_after(tok, prompt, call[:after_path]) == sep + '"old_string": "'
    for cut in range(after_path + 1, call.index('"old_string"') + len('"old_')):
        assert sep + '"old_string": "' == call[after_path:cut] + _draft_after(tok, prompt, call[:cut]), cut
    after_old = call.index('"a = 1"') + len('"a = 1"')
    assert _draft_after(tok, prompt, call[:after_old]) == sep + '"new_string": "'
    after_new = call.index('"a = 2"') + len('"a = 2"')
    # the last required argument: the call closes, laid out as it opened (replace_all is optional)
    assert _draft_after(tok, prompt, call[:after_new]) == call[after_new:]
    # a whole call: separators and keys are drafted (the values are the model's)
    _, accepted, _, stats = _replay(tok, prompt, call)
    assert stats["keys"] >= 2 and accepted >= len(tok.encode(sep + '"new_string": "')) * 2 - 2
    # no schema in the prompt: no keys
    _, _, _, stats = _replay(tok, "<|im_start|>user\nFix x.py<|im_end|>\n<|im_start|>assistant\n", call)
    assert stats["keys"] == 0


def test_an_argument_written_whole_as_an_earlier_call_had_it_closes_and_the_next_key_follows(tok):
    read = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "agentspec/text.py"}}\n</tool_call>'
    prompt = (TOOLS + f"<|im_start|>user\nFix it.<|im_end|>\n<|im_start|>assistant\n{read}<|im_end|>\n"
              "<|im_start|>user\n<tool_response>\n     1→x = 1\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    head = '<tool_call>\n{"name": "Edit", "arguments": {"file_path": "agentspec/text'
    assert _draft_after(tok, prompt, head) == '.py", "old_string": "'
    assert _draft_after(tok, prompt, head + '.py') == '", "old_string": "'


def test_old_string_starts_as_the_line_of_the_file_it_quotes(tok):
    """An Edit's old_string quotes the file read: from its first characters on, before a copy's
    eight characters are written, the draft is the rest of the line those characters start (the
    continuation all such lines agree on), indented or not."""
    src = (ROOT / "agentspec/drafting/suffix.py").read_text()
    prompt = f"<|im_start|>user\n{_gutter(src)}\nFix it.<|im_end|>\n<|im_start|>assistant\n"
    lines = src.splitlines()
    starts = [line.strip()[:3] for line in lines]
    line = next(x for x in lines if len(x.strip()) > 30 and x.startswith("    ") and starts.count(x.strip()[:3]) == 1)
    head = '<tool_call>\n{"name": "Edit", "arguments": {"file_path": "suffix.py", "old_string": "'
    for typed in (line.strip()[:3], line[:len(line) - len(line.lstrip()) + 3]):
        rest = src[src.index(line) + len(line) - len(line.lstrip()) + 3:]
        got = _draft_after(tok, prompt, head + json.dumps(typed)[1:-1])
        assert len(got) > 20 and json.dumps(rest)[1:].startswith(got), (typed, got)
    # characters no line starts with: nothing
    assert _draft_after(tok, prompt, head + "qzx") == ""


@pytest.mark.parametrize("form", ["fence-4", "fence-2", "tags", "tags-4"])
def test_a_calls_envelope_is_drafted_as_the_model_lays_it_out(tok, form):
    """Around the arguments: a fence's `json` and `{`, the `"name": "` key once its quote is
    typed, the tool's name once what is typed names one tool and `"arguments": {` laid out as
    `"name"` was, the first argument's key one level deeper, and after the last required argument
    the closing braces and the fence's or the tags' end. The real 1.5B, after a Read, wrote its
    Edit call as an indented fenced block."""
    prompt = TOOLS + "<|im_start|>user\nFix x.py<|im_end|>\n<|im_start|>assistant\n"
    indent = int(form[-1]) if form[-1].isdigit() else None
    call = json.dumps({"name": "Edit", "arguments": {"file_path": "x.py", "old_string": "a = 1", "new_string": "a = 2"}},
                      indent=indent)
    text = ("```json\n" + call + "\n```") if form.startswith("fence") else ("<tool_call>\n" + call + "\n</tool_call>")
    pad = "\n" + " " * indent if indent else ""
    points = {text.index('"name"') + 1: 'name": "',                           # the key, once its quote is typed
              text.index('"Edit"') + 3: 'it",' + (pad or " ") + '"arguments": {',   # "Ed" names one tool
              text.index('"arguments": {') + len('"arguments": {'): (pad + " " * (indent or 0) if indent else "") + '"file_path": "',
              text.index('"a = 2"') + len('"a = 2"'): text[text.index('"a = 2"') + len('"a = 2"'):]}
    if form.startswith("fence"):
        points[3] = "json\n{"
    else:
        points[len("<tool_call>")] = "\n{"
    if indent:
        closed = text.index("}", text.index('"a = 2"')) + 1   # after the arguments' brace
        points[closed] = text[closed:]
    for at, want in sorted(points.items()):
        assert _draft_after(tok, prompt, text[:at]) == want, (at, text[:at][-30:])
    n = len(tok.encode(text))
    steps, accepted, _, stats = _replay(tok, prompt, text)
    assert accepted > 0.6 * n and stats["keys"] >= 2 and stats["envelope"] >= 3, (steps, accepted, n, stats)


def test_a_name_two_tools_share_is_drafted_as_far_as_they_agree(tok):
    fmt = OutputFormat(tool_format="hermes", tools=("Read", "ReadMany", "Edit"))
    assert _draft_after(tok, "<|im_start|>user\nhi<|im_end|>\n", '<tool_call>\n{"name": "Re', fmt) == "ad"
    assert _draft_after(tok, "<|im_start|>user\nhi<|im_end|>\n", '<tool_call>\n{"name": "E', fmt) == 'dit", "arguments": {'


_VALUES = st.lists(st.sampled_from(list('ab "\\\n\t{}[],:é/\u2603') + ["x = 1", "def f():"]), max_size=20).map("".join)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["Edit", "Read", "Write", "Other"]), indent=st.sampled_from([None, 2, 4]),
       wrap=st.sampled_from(["tags", "fence", "bare", "prose"]), values=st.lists(_VALUES, min_size=1, max_size=3),
       cut=st.floats(0.05, 1.0))
def test_drafting_around_any_call_never_fails(tok, name, indent, wrap, values, cut):
    """Arbitrary calls (any name, layout, wrapping, escapes; cut anywhere): every draft is a chain
    of at most the budget, and whatever it proposes never raises."""
    args = dict(zip(["file_path", "old_string", "new_string"], values))
    call = json.dumps({"name": name, "arguments": args}, indent=indent)
    text = {"tags": f"<tool_call>\n{call}\n</tool_call>", "fence": f"```json\n{call}\n```", "bare": call,
            "prose": f"Let me see.\n{call}"}[wrap]
    text = text[:max(1, int(len(text) * cut))]
    prompt = TOOLS + '<|im_start|>user\n     1→x = 1\n     2→def f():\n<|im_end|>\n<|im_start|>assistant\n'
    _replay(tok, prompt, text, budget=16)
