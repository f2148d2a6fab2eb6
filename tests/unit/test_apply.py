"""agentspec.apply: fast apply as a library (prompt, chat detection, code-only answers, workspace paths).

No model: a tiny fake tokenizer stands in where one is needed (the tokenizer is not the point).
"""

from __future__ import annotations

import os
import random
import re

import pytest

from agentspec.apply import (
    APPLY_SYSTEM,
    ApplyPathError,
    apply_prompt,
    build_apply,
    chat_fast_apply,
    find_apply_code,
    language_for,
    merged_code,
    prediction_usage,
    resolve_workspace_path,
)
from agentspec.errors import InvalidRequestError
from agentspec.workspace import DEFAULT_IGNORE


class WordTokenizer:
    """Splits on spaces (each space its own token): enough to count and compare tokens."""

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for i, word in enumerate(text.split(" ")):
            if i:
                out.append(0)
            if word:
                out.append(hash(word) % 10_000 + 1)
        return out

    def encode_batch(self, texts) -> list[list[int]]:   # what a Workspace tokenizes its chunks with
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        raise NotImplementedError


CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
NEW = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    # subtract\n    return a - b\n"

MARKDOWN = """# Notes

Install it:

```bash
pip install thing
```

Then run:

```python
import thing
thing.run()
```

That is all.
"""


# ---- code only -------------------------------------------------------------------------------------

def test_chatter_around_the_fence_is_dropped():
    answer = ("Here is the updated file:\n```python\n" + NEW + "```\n"
              "This will compile and run the file, and `sub` now has a comment.\n")
    assert merged_code(answer, CODE) == NEW
    assert merged_code(answer) == NEW  # without the original: the preamble ends with ":"


def test_fence_with_language_tag_and_bare_fence():
    assert merged_code("```python\n" + NEW + "```", CODE) == NEW
    assert merged_code("```py\n" + NEW + "```\n", CODE) == NEW
    assert merged_code("```\n" + NEW + "```\n\n", CODE) == NEW
    assert merged_code("\n\n```python\n" + NEW + "```\n") == NEW  # leading blank lines
    assert merged_code("~~~python\n" + NEW + "~~~\n", CODE) == NEW
    assert merged_code("````\n" + NEW + "````\n", CODE) == NEW


def test_no_fence_is_the_file():
    assert merged_code(NEW) == NEW  # unchanged without the original
    assert merged_code(NEW + "\n\n", CODE) == NEW  # exactly one final newline, as the original
    assert merged_code(NEW.rstrip("\n"), CODE) == NEW
    assert merged_code(NEW, CODE.rstrip("\n")) == NEW.rstrip("\n")  # the original has no final newline
    assert merged_code("x = 1", "") == "x = 1\n"  # an empty original: one final newline
    assert merged_code("", CODE) == "" and merged_code("\n\n", CODE) == ""


def test_a_prose_only_preamble_without_a_fence_is_kept():
    # nothing marks where chatter ends: the answer is the file as it is
    answer = "Here is the updated file:\n" + NEW
    assert merged_code(answer) == answer
    assert merged_code(answer, CODE) == answer


def test_preamble_limits():
    long_preamble = "One.\nTwo.\nThree.\nFour:\n```python\n" + NEW + "```\n"
    assert merged_code(long_preamble, CODE) == long_preamble  # more than 3 lines: not chatter
    # without the original, a preamble must end with ":" to count as chatter
    assert merged_code("Sure.\n```python\n" + NEW + "```\n") == "Sure.\n```python\n" + NEW + "```\n"
    assert merged_code("Sure.\n```python\n" + NEW + "```\n", CODE) == NEW  # not a line of the original


def test_a_cut_off_answer_loses_only_its_opening_fence():
    assert merged_code("```python\ndef add(a, b):\n    ret", CODE) == "def add(a, b):\n    ret\n"
    assert merged_code("Updated:\n```python\ndef add(a, b):\n", CODE) == "def add(a, b):\n"


def test_a_second_code_block_in_the_chatter_is_dropped():
    answer = ("```python\n" + NEW + "```\n\nUsage:\n\n```python\nprint(sub(3, 1))\n```\n")
    assert merged_code(answer, CODE) == NEW


def test_markdown_file_keeps_its_own_fences():
    edited = MARKDOWN.replace("That is all.", "That is all, really.")
    # unwrapped: the file as it is, its fences included
    assert merged_code(edited, MARKDOWN) == edited
    assert merged_code(MARKDOWN, MARKDOWN) == MARKDOWN
    # wrapped: only the outermost pair goes
    assert merged_code("```markdown\n" + edited + "```\n", MARKDOWN) == edited
    assert merged_code("```markdown\n" + edited + "```\n") == edited  # outermost pair without the original too
    assert merged_code("Here it is:\n```markdown\n" + edited + "```\nI changed the last line.\n", MARKDOWN) == edited
    # an edit that adds a code block to a Markdown file without fences is not a wrapper
    plain = "# Title\n\nSome text.\n"
    added = "# Title\n\n```sh\nmake\n```\n\nSome text.\n"
    assert merged_code(added, plain) == added
    top = "```sh\nmake\n```\n# Title\n\nSome text.\n"  # a new block at the very top
    assert merged_code(top, plain) == top


def test_markdown_file_that_starts_with_a_fence():
    md = "```python\nprint(1)\n```\n\nText.\n"
    edited = "```python\nprint(2)\n```\n\nText.\n"
    assert merged_code(edited, md) == edited
    assert merged_code("```markdown\n" + edited + "```\n", md) == edited


def test_windows_newlines_follow_the_original():
    crlf = CODE.replace("\n", "\r\n")
    new_crlf = NEW.replace("\n", "\r\n")
    assert merged_code("```python\n" + NEW + "```\n", crlf) == new_crlf          # LF answer, CRLF file
    assert merged_code("```python\r\n" + new_crlf + "```\r\n", crlf) == new_crlf  # CRLF answer
    assert merged_code("Here:\r\n```python\r\n" + new_crlf + "```\r\nDone.\r\n", CODE) == NEW  # CRLF answer, LF file
    assert merged_code(new_crlf, CODE) == NEW
    assert merged_code("```\r\n" + new_crlf + "```\r\n") == new_crlf  # no original: the answer's endings


# ---- prompt, plan and chat detection --------------------------------------------------------------

def test_apply_prompt_and_language():
    p = apply_prompt("x = 1\n", "x = 2", "bump x", "a.py")
    assert "```python\nx = 1\n```" in p and "bump x" in p and "x = 2" in p and "`a.py`" in p
    q = apply_prompt("x", None, None)
    assert "the file" in q and "Merge the edit below" in q and "The edit" not in q
    assert language_for("src/Main.RS") == "rust" and language_for("Makefile") == ""


def test_build_apply_plans_the_merge():
    tok = WordTokenizer()
    crlf = CODE.replace("\n", "\r\n")
    plan = build_apply(crlf, "def sub(a, b):\r\n    # subtract", None, "m.py", tokenizer=tok)
    [msg] = plan.messages
    assert msg["role"] == "user" and "\r" not in msg["content"] and "```python\n" + CODE.rstrip() in msg["content"]
    assert plan.prediction_ids == tok.encode(CODE)  # the LF text: what the model will write
    n = len(tok.encode(CODE))
    assert plan.max_tokens_estimate == n + len(tok.encode("def sub(a, b):\n    # subtract")) + n // 4 + 64
    assert plan.max_tokens(10**6) == plan.max_tokens_estimate and plan.max_tokens(5) == 5 and plan.max_tokens(0) == 1
    assert plan.code == crlf
    assert plan.finish("Here:\n```python\n" + NEW + "```\nDone.") == NEW.replace("\n", "\r\n")
    only_instruction = build_apply(CODE, None, "add a comment", tokenizer=tok)
    assert only_instruction.max_tokens_estimate == n + n // 4 + 64
    with pytest.raises(InvalidRequestError, match="update") as e:
        build_apply(CODE, None, "", tokenizer=tok)
    assert e.value.param == "update"
    with pytest.raises(InvalidRequestError, match="code must be a string"):
        build_apply(None, "x", None, tokenizer=tok)


def test_chat_fast_apply_detection():
    msg = "<instruction>Add a comment</instruction>\n<code>\nx = 1\n</code>\n<update>x = 1  # one</update>"
    assert find_apply_code(msg) == "x = 1"
    assert find_apply_code("<code>x</code> only") is None
    assert find_apply_code("<code>x</code><update>y</update>") == "x"
    messages = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": msg}]
    out, code = chat_fast_apply(messages)
    assert code == "x = 1" and out[0] == {"role": "system", "content": APPLY_SYSTEM} and out[1:] == messages
    assert len(messages) == 3  # the caller's list is left alone
    own = [{"role": "system", "content": "be brief"}, {"role": "user", "content": msg}]
    assert chat_fast_apply(own) == (own, "x = 1")
    plain = [{"role": "user", "content": "hello <code>x</code>"}]
    assert chat_fast_apply(plain) == (plain, None)
    assert chat_fast_apply([{"role": "system", "content": "s"}]) == ([{"role": "system", "content": "s"}], None)


def test_fast_apply_tags_read_like_the_lazy_pattern_they_replace():
    # One newline after the opening tag and one before the closing tag are left out; the first
    # complete pair counts, however the text around it looks.
    pattern = re.compile(r"<code>\n?(.*?)\n?</code>", re.DOTALL)
    rng = random.Random(7)
    pieces = ["<code>", "</code>", "\n", "a", "<", ">", "/"]
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        found = pattern.search(text)
        expected = found.group(1) if found else None
        assert find_apply_code(text + "<update>u</update>") == expected, text


@pytest.mark.timeout(30)
def test_fast_apply_detection_is_linear_in_the_message():
    # A message of opening tags with no closing one: the lazy pattern retried at every tag
    # (quadratic, about an hour at this size, holding the interpreter for every tenant).
    assert find_apply_code("<code>" * 200_000 + "<update>u</update>") is None
    assert find_apply_code("<code>x</code>" + "<update>" * 200_000) is None


def test_prediction_usage():
    assert prediction_usage([1, 2, 3, 4], [1, 2, 9, 4]) == (3, 1)
    assert prediction_usage([], [1]) == (0, 0)
    assert prediction_usage([1, 2], []) == (0, 2)


# ---- workspace paths -------------------------------------------------------------------------------

@pytest.fixture()
def workspace(tmp_path):
    root = tmp_path / "ws"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text(CODE)
    (root / "win.py").write_bytes(CODE.replace("\n", "\r\n").encode())
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (root / "big.txt").write_text("x" * 101)
    outside = tmp_path / "secret.py"
    outside.write_text("SECRET = 1\n")
    os.symlink(outside, root / "escape.py")
    os.symlink(root / "pkg" / "mod.py", root / "alias.py")
    os.symlink(tmp_path, root / "up")
    return root


def _err(root, path, **kw) -> ApplyPathError:
    with pytest.raises(ApplyPathError) as e:
        resolve_workspace_path(root, path, max_bytes=kw.pop("max_bytes", 100), **kw)
    assert e.value.param == "path" and isinstance(e.value, InvalidRequestError)
    return e.value


def test_paths_inside_the_workspace(workspace):
    full, text = resolve_workspace_path(workspace, "pkg/mod.py", max_bytes=100)
    assert full == workspace / "pkg" / "mod.py" and text == CODE
    assert resolve_workspace_path(workspace, str(workspace / "pkg" / "mod.py"), max_bytes=100)[1] == CODE
    assert resolve_workspace_path(workspace, "pkg/../pkg/mod.py", max_bytes=100)[1] == CODE
    full, text = resolve_workspace_path(workspace, "alias.py", max_bytes=100)  # a symlink within: fine
    assert full == workspace / "pkg" / "mod.py" and text == CODE
    assert resolve_workspace_path(workspace, "win.py", max_bytes=100)[1] == CODE.replace("\n", "\r\n")  # as stored
    assert resolve_workspace_path(str(workspace), "pkg/mod.py", max_bytes=len(CODE))[1] == CODE  # at the limit


def test_paths_outside_the_workspace(workspace):
    for path in ("../secret.py", "pkg/../../secret.py", str(workspace.parent / "secret.py"), "/etc/passwd",
                 "escape.py", "up/secret.py"):
        e = _err(workspace, path, tenant="acme")
        assert (e.status, e.type, e.code) == (403, "permission_error", "path_outside_workspace"), path
        assert str(e) == f"path {path!r} is outside the workspace of tenant 'acme'"
    assert str(_err(workspace, "../secret.py")) == "path '../secret.py' is outside the workspace"


def test_bad_paths(workspace):
    e = _err(workspace, "pkg/\x00mod.py")
    assert (e.status, e.code, str(e)) == (400, "invalid_value", "path must not contain NUL bytes")
    e = _err(workspace, "nope.py")
    assert (e.status, e.type, e.code, str(e)) == (404, "not_found_error", "file_not_found",
                                                  "no such file in the workspace: 'nope.py'")
    assert _err(workspace, "pkg").status == 404  # a directory
    e = _err(workspace, "big.txt")
    assert (e.status, e.code, str(e)) == (413, "file_too_large", "file 'big.txt' is larger than 100 bytes")
    e = _err(workspace, "latin1.txt")
    assert (e.status, e.code, str(e)) == (400, "invalid_value", "file 'latin1.txt' is not UTF-8 text")
    e = _err(None, "pkg/mod.py", tenant="beta")
    assert (e.status, e.code, str(e)) == (400, "no_workspace",
                                          "tenant 'beta' has no workspace: send `code` instead of `path`")
    os.symlink("loop_b", workspace / "loop_a")
    os.symlink("loop_a", workspace / "loop_b")
    assert _err(workspace, "loop_a").status in (400, 404)  # a symlink loop: an error, never a crash


def test_paths_the_workspace_ignores_are_refused(workspace):
    """Fast apply reads what the workspace indexes, nothing more: .git/, DEFAULT_IGNORE folders,
    gitignored files and folders (also through a symlink, or not existing) get 403."""
    from agentspec.workspace import Workspace, is_ignored

    (workspace / ".git").mkdir()
    (workspace / ".git" / "config").write_text("[remote]\n")
    (workspace / ".venv").mkdir()
    (workspace / ".venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (workspace / ".gitignore").write_text(".env\nbuild/\n")
    (workspace / ".env").write_text("TOKEN=secret\n")
    (workspace / "pkg" / ".gitignore").write_text("local_*.py\n")
    (workspace / "pkg" / "local_settings.py").write_text("X = 1\n")
    (workspace / "build").mkdir()
    (workspace / "build" / "gen.py").write_text("X = 1\n")
    os.symlink(workspace / ".env", workspace / "env_link.py")   # a visible name for an ignored file
    os.symlink(workspace / ".git", workspace / "gitdir")
    ignored = [".git/config", ".venv/pyvenv.cfg", ".env", "build/gen.py", "pkg/local_settings.py", "env_link.py",
               "gitdir/config", "pkg/../.env", str(workspace / ".git" / "config"), ".git/HEAD_missing", "build/nope.py"]
    for path in ignored:
        e = _err(workspace, path, tenant="acme")
        assert (e.status, e.type, e.code) == (403, "permission_error", "path_ignored"), path
        assert str(e).startswith(f"path {path!r} is ignored by the workspace of tenant 'acme'"), str(e)
    # what the workspace indexes is still readable; so is .gitignore itself (the workspace indexes it)
    assert resolve_workspace_path(workspace, "pkg/mod.py", max_bytes=100)[1] == CODE
    assert resolve_workspace_path(workspace, ".gitignore", max_bytes=100)[1] == ".env\nbuild/\n"
    # outside stays outside (checked first)
    assert _err(workspace, "escape.py").code == "path_outside_workspace"
    # the rules are the workspace's: Workspace.ignored, with its own ignore list
    with Workspace(workspace, watch=False, tokenizer=WordTokenizer(), ignore=[*DEFAULT_IGNORE, "*.txt"]) as ws:
        assert not set(ws.files()) & {".env", ".git/config", "build/gen.py", "pkg/local_settings.py"}
        for path in (".git/config", ".env", "build/gen.py", "pkg/local_settings.py", "big.txt"):
            assert ws.ignored(path) and ws.ignored(workspace / path), path
        assert not ws.ignored("pkg/mod.py") and not ws.ignored(".gitignore")
        with pytest.raises(ValueError):
            ws.ignored("../secret.py")
        e = _err(workspace, "big.txt", ignored=ws.ignored)
        assert e.code == "path_ignored"
        assert not is_ignored(workspace, "big.txt")   # the default list does not name *.txt


# ---- the file read is the file checked -------------------------------------------------------------


def _swap_pkg_during_the_checks(workspace, target):
    """An ``ignored`` rule that, when first asked (the path resolved, the checks under way), swaps
    the folder ``pkg`` for a symlink to ``target``: the window a rename-exchange racing the request
    would hit, made deterministic."""
    from agentspec.workspace import ignore_checker

    rules, swapped = ignore_checker(workspace), []

    def ignored(rel: str) -> bool:
        if not swapped:
            swapped.append(rel)
            os.rename(workspace / "pkg", workspace / "pkg.old")
            os.symlink(target, workspace / "pkg")
        return rules(rel)

    return ignored


def test_a_folder_swapped_for_a_symlink_after_the_checks_is_refused(workspace, tmp_path):
    """What is read is what was opened, checked again as opened: pkg/ turned into a link between
    the checks and the open leads nowhere the checks refuse (outside, the server's files, ignored)."""
    from agentspec.workspace import OwnedPath

    srv = tmp_path / "srv"   # outside the workspace
    srv.mkdir()
    (srv / "mod.py").write_text("API_KEYS = ['outside-canary-1']\n")
    (workspace / "deploy").mkdir()   # inside, holding the server's config
    (workspace / "deploy" / "mod.py").write_text("API_KEYS = ['config-canary-2']\n")
    (workspace / ".gitignore").write_text("private/\n")
    (workspace / "private").mkdir()
    (workspace / "private" / "mod.py").write_text("TOKEN = 'ignored-canary-3'\n")
    owned = [OwnedPath.of("config file", workspace / "deploy" / "mod.py")]
    for target, code in ((srv, "path_outside_workspace"), (workspace / "deploy", "path_server_owned"),
                         (workspace / "private", "path_ignored")):
        ignored = _swap_pkg_during_the_checks(workspace, target)
        e = _err(workspace, "pkg/mod.py", ignored=ignored, owned=owned)
        assert (e.status, e.type, e.code) == (403, "permission_error", code), target
        assert "pkg/mod.py" in str(e) and "canary" not in str(e)
        if code == "path_server_owned":
            assert "(config file)" in str(e)
        os.unlink(workspace / "pkg")
        os.rename(workspace / "pkg.old", workspace / "pkg")
    assert resolve_workspace_path(workspace, "pkg/mod.py", max_bytes=100, owned=owned)[1] == CODE   # unswapped


def test_a_hard_link_to_the_servers_file_is_refused(workspace):
    """The server's files are matched by identity too: a hard link has a path of its own."""
    from agentspec.workspace import OwnedPath

    config = workspace.parent / "agentspec.toml"
    config.write_text("api_keys = ['hard-link-canary']\n")
    os.link(config, workspace / "cfg.py")
    e = _err(workspace, "cfg.py", owned=[OwnedPath.of("config file", config)])
    assert (e.status, e.code) == (403, "path_server_owned") and "(config file)" in str(e)


def test_a_fifo_is_no_file_and_never_blocks(workspace):
    os.mkfifo(workspace / "pipe.py")
    assert _err(workspace, "pipe.py").code == "file_not_found"


def test_the_language_server_reads_the_file_it_checked(workspace, tmp_path):
    """``agentspec lsp``: ``path_of`` checks a URI, ``document`` reads it; pkg/ swapped for a link
    in between (to a folder outside the workspace) is refused, not read."""
    pytest.importorskip("pygls")
    from pygls.exceptions import JsonRpcInvalidParams
    from pygls.uris import from_fs_path
    from pygls.workspace import Workspace as EditorWorkspace

    from agentspec.lsp.server import AgentSpecLanguageServer

    srv = tmp_path / "srv"
    srv.mkdir()
    (srv / "mod.py").write_text("API_KEYS = ['lsp-canary']\n")
    ls = AgentSpecLanguageServer()
    ls.root = workspace.resolve()
    ls.protocol._workspace = EditorWorkspace(from_fs_path(str(ls.root)))   # what initialize sets: no open buffers
    uri = from_fs_path(str(workspace / "pkg" / "mod.py"))
    try:
        assert ls.document(uri, ls.path_of(uri)) == (CODE, None)
        path = ls.path_of(uri)
        os.rename(workspace / "pkg", workspace / "pkg.old")
        os.symlink(srv, workspace / "pkg")
        with pytest.raises(JsonRpcInvalidParams, match="outside the workspace") as e:
            ls.document(uri, path)
        assert "canary" not in str(e.value)
    finally:
        ls.overlays.close()
