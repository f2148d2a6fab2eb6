"""Fast apply as a library: merge an edit (an update snippet and/or an instruction) into a file.

No HTTP and no torch: the server's ``POST /v1/apply`` and its chat fast-apply detection call
this module, and so can an SDK or a language server::

    plan = build_apply(code, update, instruction, name="util.py", tokenizer=backend.tokenizer)
    ids = backend.encode_chat(plan.messages)
    request = GenerationRequest(prompt_ids=ids, max_tokens=plan.max_tokens(backend.max_context - len(ids)),
                                prediction_ids=plan.prediction_ids)   # the original drafts the answer
    gen = collect(backend.stream(request))   # agentspec.backends.protocol: GenerationRequest, collect
    merged = plan.finish(gen.text)           # the file only: no code fence, no chatter

The original code is the draft source (``prediction_ids``): most of the answer is the file
again, so speculation accepts long runs of it.

**Code only.** Models wrap the file in a Markdown fence and sometimes add chatter around it
("Here is the updated file:" ... "This will compile and run ..."). ``merged_code`` keeps the
file only: the outermost fence pair is a wrapper when the opening fence is the first line or
follows a short preamble (at most ``MAX_PREAMBLE_LINES`` non-blank lines), and everything after
the closing fence is dropped. A file that itself contains fences (Markdown) keeps them: given the
original, a wrapper must add fences the original does not have, a preamble or epilogue made of
the original's own lines is content, and the closing fence is the one that leaves as many fences
inside as the original has. Line endings and the final newline follow the original: CRLF when it
uses CRLF, exactly one trailing newline when it ends with one (or is empty), none when it does not.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .errors import InvalidRequestError

if TYPE_CHECKING:
    from .workspace.ignore import OwnedPath

__all__ = [
    "APPLY_SYSTEM",
    "LANGUAGES",
    "MAX_PREAMBLE_LINES",
    "ApplyPathError",
    "ApplyPlan",
    "Tokenizer",
    "apply_prompt",
    "build_apply",
    "chat_fast_apply",
    "find_apply_code",
    "language_for",
    "merged_code",
    "prediction_usage",
    "resolve_workspace_path",
]

APPLY_SYSTEM = ("You merge code edits. Apply the update to the original code and reply with the complete "
                "merged code only: no explanations, no code fences.")

LANGUAGES = {".py": "python", ".js": "javascript", ".ts": "typescript", ".tsx": "tsx", ".go": "go", ".rs": "rust",
             ".java": "java", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp", ".md": "markdown",
             ".sh": "bash", ".rb": "ruby", ".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}

MAX_PREAMBLE_LINES = 3  # non-blank lines of chatter allowed before the opening fence

_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})([^`]*)")  # a fence line: marker and info string (CommonMark)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# ---- the prompt ------------------------------------------------------------------------------------

def language_for(name: str) -> str:
    """The Markdown fence language of a file name ("a.py" -> "python"); "" when unknown."""
    return LANGUAGES.get(Path(name).suffix.lower(), "")


def apply_prompt(code: str, update: str | None, instruction: str | None, name: str = "the file") -> str:
    """The fast-apply request as the user message: the shape coding assistants (Aider) send a
    whole-file rewrite in, which instruction-tuned models follow best: the change, the current
    file in a fence, and "reply with the complete updated file"."""
    label = f"`{name}`" if name != "the file" else name
    lang = language_for(name)
    parts = [f"Apply this change to {label}:\n\n{instruction or 'Merge the edit below into the file.'}"]
    if update:
        parts.append(f"The edit (unchanged code may be elided with comments like `... existing code ...`):\n"
                     f"```\n{update.strip(chr(10))}\n```")
    parts.append(f"Current contents of {label}:\n```{lang}\n{code.rstrip(chr(10))}\n```")
    parts.append("Reply with the complete updated file and nothing else.")
    return "\n\n".join(parts)


def _tagged(text: str, tag: str) -> str | None:
    """What the first ``<tag>...</tag>`` in ``text`` holds, one newline after the opening tag and one
    before the closing tag left out; None when there is none. Two ``str.find`` calls: linear in the
    text, where a lazy regex retries at every opening tag that has no closing one (quadratic: a
    message of repeated ``<code>`` would hold the interpreter for minutes)."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    start = text.find(opening)
    if start < 0:
        return None
    start += len(opening)
    end = text.find(closing, start)
    if end < 0:
        return None
    if text.startswith("\n", start) and start < end:
        start += 1
    if end > start and text[end - 1] == "\n":
        end -= 1
    return text[start:end]


def find_apply_code(text: str) -> str | None:
    """The original code of a Morph/Relace-style fast-apply message (``<code>...</code>`` with an
    ``<update>`` and/or an ``<instruction>``); None when ``text`` is not one."""
    code = _tagged(text, "code")
    if code is not None and (_tagged(text, "update") is not None or _tagged(text, "instruction") is not None):
        return code
    return None


def chat_fast_apply(messages: list[dict]) -> tuple[list[dict], str | None]:
    """``(messages, code)`` for a chat whose last user message is a fast-apply request
    (``find_apply_code``): ``code`` is its original code (the draft source), and ``messages``
    starts with ``APPLY_SYSTEM`` unless it has a system message already. Other chats:
    ``(messages, None)``, unchanged. Messages are dicts with "role" and (text) "content"."""
    last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    code = find_apply_code(last_user or "")
    if code is None:
        return messages, None
    if not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": APPLY_SYSTEM}, *messages]
    return messages, code


# ---- planning a merge --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ApplyPlan:
    """What to generate for one fast apply, and how to read the answer."""

    code: str                          # the original file, as given (line endings included)
    messages: list[dict[str, str]]     # the chat to encode and generate from (one user message)
    prediction_ids: list[int]          # the original's tokens (LF line endings): the draft source
    max_tokens_estimate: int           # room for the whole file, the update and a quarter more

    def max_tokens(self, room: int) -> int:
        """``max_tokens_estimate`` capped to ``room`` (context window minus the prompt), at least 1."""
        return max(1, min(self.max_tokens_estimate, room))

    def finish(self, text: str) -> str:
        """The merged file from the model's answer: ``merged_code(text, self.code)``."""
        return merged_code(text, self.code)


def build_apply(code: str, update: str | None, instruction: str | None, name: str = "the file", *,
                tokenizer: Tokenizer) -> ApplyPlan:
    """The plan for merging ``update`` (an edit snippet) and/or ``instruction`` into ``code``.
    ``name``: the file's name (its suffix picks the fence language), or "the file". CRLF line
    endings are shown to the model as LF (``finish`` puts them back). InvalidRequestError when
    ``code`` is not a string or neither ``update`` nor ``instruction`` is given."""
    if not isinstance(code, str):
        raise InvalidRequestError(f"code must be a string, got {type(code).__name__}", param="code")
    if not update and not instruction:
        raise InvalidRequestError("give `update` (an edit snippet) and/or `instruction`", param="update")
    src = _lf(code)
    upd = _lf(update) if update else update
    messages = [{"role": "user", "content": apply_prompt(src, upd, instruction, name)}]
    code_ids = list(tokenizer.encode(src))
    # the file, the snippet's new lines, and a quarter more for what an instruction adds
    # (docstrings, a new function) and a fence around the answer
    estimate = len(code_ids) + len(tokenizer.encode(upd or "")) + len(code_ids) // 4 + 64
    return ApplyPlan(code=code, messages=messages, prediction_ids=code_ids, max_tokens_estimate=estimate)


def prediction_usage(pred: Sequence[int], out: Sequence[int]) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens: those of the prediction that appear in the
    completion in order (matching blocks of a diff), and the rest."""
    if not pred:
        return 0, 0
    sm = difflib.SequenceMatcher(None, list(pred), list(out), autojunk=False)
    accepted = sum(b.size for b in sm.get_matching_blocks())
    return accepted, len(pred) - accepted


# ---- the answer: code only ----------------------------------------------------------------------------

def _lf(text: str) -> str:
    return text.replace("\r\n", "\n")


def _uses_crlf(text: str) -> bool:
    crlf = text.count("\r\n")
    return crlf > 0 and crlf * 2 >= text.count("\n")


def _fence(line: str) -> tuple[str, int, str] | None:
    """(marker character, marker length, info string) of a fence line, else None."""
    m = _FENCE.fullmatch(line.rstrip())
    return (m[1][0], len(m[1]), m[2].strip()) if m else None


def _unwrap(s: str, orig: str | None) -> str | None:
    """The text inside the wrapper fence of ``s`` (LF line endings), or None when the answer
    is not wrapped. ``orig``: the original file (LF), to tell its own fences from a wrapper."""
    lines = s.split("\n")
    fences = [(i, f) for i, line in enumerate(lines) if (f := _fence(line)) is not None]
    if not fences:
        return None
    orig_fences, orig_lines = 0, set()
    if orig is not None:
        olines = orig.split("\n")
        orig_fences = sum(1 for line in olines if _fence(line) is not None)
        if len(fences) <= orig_fences:  # the model added no fence: nothing wraps the file
            return None
        orig_lines = {line.strip() for line in olines if line.strip()}
    open_i, (char, width, _) = fences[0]
    preamble = [line.strip() for line in lines[:open_i] if line.strip()]
    if preamble:
        if len(preamble) > MAX_PREAMBLE_LINES:
            return None
        if orig is None:
            if not preamble[-1].endswith(":"):  # "Here is the updated file:"
                return None
        elif any(line in orig_lines for line in preamble):  # the file's own first lines
            return None
    closers = [i for i, (c, w, info) in fences if i > open_i and c == char and w >= width and not info]
    close_i: int | None = closers[-1] if closers else None  # none: cut off (max_tokens); runs to the end
    if closers and orig is not None:  # the closer that leaves the original's own fences inside
        for i in closers:
            if sum(1 for j, _ in fences if open_i < j < i) == orig_fences:
                close_i = i
                break
        epilogue = [line.strip() for line in lines[close_i + 1:] if line.strip()]
        if epilogue and 2 * sum(line in orig_lines for line in epilogue) > len(epilogue):
            return None  # what follows is mostly the file's own lines: that fence was the file's
    return "\n".join(lines[open_i + 1:close_i])


def merged_code(text: str, original: str | None = None) -> str:
    """The file only, from a model's fast-apply answer: without the wrapper fence, a chatty
    preamble before it and anything after it (see the module docstring). An answer without a
    wrapper is the file as it is. With ``original``, line endings follow it (CRLF or LF) and the
    answer ends with exactly one newline when the original ends with one (or is empty), none
    when it does not; without, a wrapped answer ends with one newline and an unwrapped one is
    returned unchanged."""
    s = _lf(text)
    orig = _lf(original) if original is not None else None
    body = _unwrap(s, orig)
    if body is None:
        if orig is None:
            return text
        body = s
    core = body.rstrip("\n")
    if not core.strip():
        return ""
    end = "\n" if orig is None or not orig or orig.endswith("\n") else ""
    out = core + end
    crlf = _uses_crlf(original) if original is not None else _uses_crlf(text)
    return out.replace("\n", "\r\n") if crlf else out


# ---- workspace files ----------------------------------------------------------------------------------

MAX_PATH_CHARS = 4096   # Linux's PATH_MAX: no longer path can be opened
MAX_PATH_PARTS = 64     # components after normalizing: deeper than any source file a client would apply to


class ApplyPathError(InvalidRequestError):
    """A workspace path fast apply cannot read. ``status``: the HTTP status a server answers with
    (400 no workspace / bad path / unreadable / not UTF-8, 403 outside the workspace or ignored by
    it, 404 no such file, 413 too large); ``code`` and ``type``: the OpenAI error code and type."""

    def __init__(self, message: str, *, status: int, code: str, type: str = "invalid_request_error",
                 param: str | None = "path") -> None:
        super().__init__(message, param=param)
        self.status = status
        self.code = code
        self.type = type


def _ignored_path(base: Path, asked: Path, full: Path, ignored: Callable[[str], bool]) -> bool:
    """Whether the workspace at ``base`` ignores ``asked`` (as given: normalized, symlinks not
    followed) or ``full`` (the file it resolves to, inside ``base``)."""
    lexical = Path(os.path.normpath(asked if asked.is_absolute() else base / asked))
    rels = {full.relative_to(base).as_posix()}
    if lexical.is_relative_to(base):
        rels.add(lexical.relative_to(base).as_posix())
    for rel in rels - {"", "."}:
        try:
            if ignored(rel):
                return True
        except ValueError:   # not under the workspace's own root: no file it indexes
            return True
    return False


def resolve_workspace_path(root: str | os.PathLike | None, path: str, *, max_bytes: int,
                           tenant: str | None = None,
                           ignored: Callable[[str], bool] | None = None,
                           owned: Sequence[OwnedPath] = ()) -> tuple[Path, str]:
    """``(full path, text)`` of the file at ``path`` (relative to ``root``, or absolute) inside the
    workspace ``root``. Symlinks are resolved first, so one pointing out of the workspace is
    outside it. A file the workspace ignores is refused too (403, code ``path_ignored``), whether
    it exists or not: ``ignored`` (a path relative to ``root`` -> bool, e.g. ``Workspace.ignored``;
    default ``agentspec.workspace.ignore_checker`` with ``DEFAULT_IGNORE`` and the ``.gitignore``
    files) is asked about the path as given and the file it resolves to, so ``.git/config``,
    ``.env`` when gitignored, ``.venv/...`` and a symlink to any of them are not read. The text
    is decoded as UTF-8 as stored (CRLF kept). ``tenant`` names the workspace's owner in
    messages. ``owned``: the server's own files and folders (config file, log folder, caches),
    refused whatever the path says (403, code ``path_server_owned``, naming the rule; a hard link
    to one too). The file is opened once and the checks are asked again of what was opened, so
    a folder swapped for a symlink between the checks and the read is caught. Raises
    ApplyPathError (see its ``status``)."""
    owner = f" of tenant {tenant!r}" if tenant is not None else ""
    if root is None:
        who = f"tenant {tenant!r} has" if tenant is not None else "there is"
        raise ApplyPathError(f"{who} no workspace: send `code` instead of `path`", status=400, code="no_workspace")
    if "\x00" in path:
        raise ApplyPathError("path must not contain NUL bytes", status=400, code="invalid_value")
    if len(path) > MAX_PATH_CHARS or len(Path(os.path.normpath(path)).parts) > MAX_PATH_PARTS:
        # before any file system or ignore-rule work: the ignore walk costs ~depth^3 (7 s at 200 parts)
        raise ApplyPathError(f"path is too long or too deep (at most {MAX_PATH_CHARS} characters and "
                             f"{MAX_PATH_PARTS} components)", status=400, code="invalid_value")
    from .workspace.ignore import owned_identity, owned_rule
    from .workspace.scan import read_opened

    base = Path(root).resolve()
    if ignored is None:   # one rule set for every question (each .gitignore read once)
        from .workspace import ignore_checker

        ignored = ignore_checker(base)
    p = Path(path)
    lexical = Path(os.path.normpath(p if p.is_absolute() else base / p))

    def refuse(full: Path, st: os.stat_result | None = None) -> None:
        """Raise the 403 for ``full`` (resolved; ``st``: its stat once opened), if it has one."""
        if not full.is_relative_to(base):
            raise ApplyPathError(f"path {path!r} is outside the workspace{owner}", status=403,
                                 type="permission_error", code="path_outside_workspace")
        rule = owned_rule(owned, lexical, full)
        if rule is None and st is not None:   # a hard link to one
            rule = owned_identity(owned, st, full, base)
        if rule:
            raise ApplyPathError(f"path {path!r} is one of the server's own files ({rule}): no tenant reads "
                                 "them", status=403, type="permission_error", code="path_server_owned")
        if _ignored_path(base, p, full, ignored):
            raise ApplyPathError(f"path {path!r} is ignored by the workspace{owner} (.gitignore or the ignore "
                                 "list): fast apply reads only files the workspace indexes", status=403,
                                 type="permission_error", code="path_ignored")

    try:
        full = (p if p.is_absolute() else base / p).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise ApplyPathError(f"cannot read {path!r}: {getattr(e, 'strerror', None) or e}", status=400,
                             code="unreadable") from None
    refuse(full)
    not_found = ApplyPathError(f"no such file in the workspace: {path!r}", status=404, type="not_found_error",
                               code="file_not_found")
    try:
        st = full.stat()   # before opening: a FIFO or device is never opened
    except OSError as e:  # ENAMETOOLONG (a name over 255 bytes) and the like: a 400, not a 500
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise not_found from None
        raise ApplyPathError(f"cannot read {path!r}: {e.strerror}", status=400, code="unreadable") from None
    if not stat.S_ISREG(st.st_mode):
        raise not_found
    too_large = ApplyPathError(f"file {path!r} is larger than {max_bytes} bytes", status=413, code="file_too_large")
    if st.st_size > max_bytes:
        raise too_large
    try:
        opened, st, data = read_opened(full, max_bytes + 1)
    except FileNotFoundError:
        raise not_found from None
    except OSError as e:
        raise ApplyPathError(f"cannot read {path!r}: {e.strerror}", status=400, code="unreadable") from None
    refuse(opened, st)   # checked again as opened and read (a folder on the way may be a symlink by now)
    if data is None:
        raise not_found
    if len(data) > max_bytes:  # grew since the stat
        raise too_large
    try:
        return full, data.decode("utf-8")
    except UnicodeDecodeError:
        raise ApplyPathError(f"file {path!r} is not UTF-8 text", status=400, code="invalid_value") from None
