"""The user-facing docs say only what is true of this repository.

Documents checked: README.md, CONTRIBUTING.md, docs/*.md, integrations/**/README.md,
benchmarks/**/*.md and examples/**/README.md (those that exist). Each check reads Markdown the
way GitHub renders it: fenced code blocks (```lang ... ```) apart from prose, inline code spans
apart from text. The rules:

- **Commands.** Every ``agentspec SUBCOMMAND [--flag ...]`` in a shell code block (no language,
  bash, sh, shell, console, zsh) or in inline code names a subcommand of the real parser
  (``agentspec.cli.build_parser``; nothing runs), and each ``--flag`` after it is an option of
  that subcommand. A command starts a line or follows ``|``, ``&&``, ``;`` or ``(``, after
  optional ``VAR=value`` words and sudo/exec/nohup/time; ``.venv/bin/agentspec`` and ``python -m
  agentspec.cli`` count. ``[--flag X]`` (usage notation) is a flag like any other; values and
  positionals are not checked (they are the user's).
- **make.** ``make TARGET`` in a shell block or inline code names targets of the Makefile.
- **Links.** Every relative link or image (``[t](path)``, ``![a](path)``, ``[ref]: path``, HTML
  ``src``/``href``) resolves to a file or folder inside the repository; ``path#anchor`` to a
  Markdown file (or ``#anchor`` alone) names a heading there (GitHub's slugs). URLs with a scheme
  are not fetched.
- **Config.** A ```toml block is an agentspec.toml when one of its tables is ``[server]``,
  ``[[tenants]]``, ``[[routes]]`` (or ``[routes.when]``) or it has no table at all; any other
  block is another tool's file (an editor's languages.toml) and only has to be valid TOML. An
  agentspec.toml block loads with the real loader (``agentspec.config.load_server_config``);
  each commented-out key (``# key = value`` whose value is a TOML value) is uncommented in place,
  replacing an active line of the same key in that table, and must load too; a commented-out
  table header comes back with the commented keys under it.
- **Paths.** Nothing points outside the repository: no ``../shared`` (the project's build-time
  data; no user command may need it) and no relative link that climbs out of the repository.
  Absolute paths of a particular machine are refused anywhere: ``/work/``, ``/home/``,
  ``/root/``, ``/Users/``, ``/mnt/``, ``/scratch/``, ``/data/``. ``/tmp/...`` is a user's scratch
  path, allowed only inside code (an example command), never in prose. Placeholders such as
  ``/path/to/repo``, ``/models/...`` and ``/workspace`` (the Docker image's mount) are fine.
- **History.** No references to the project's tracker or lab runs: ``issue N`` (``issue15/`` and
  ``..._issue17.json`` included), ``PR #N``, ``(#N)``; no lab-run names: ``run E`` style labels,
  ``..._run2`` result names; no dated lab history: an ISO date (``2026-11-30``) in prose. A date
  inside a file name (results named by the day they were measured), in code (a log sample) or
  right after an upstream commit id (``a6b6b02`` (2026-08-08): provenance) is fine.

Each check is a function from (Markdown text, its path) to a list of problems, run on every
document, and each is shown to fail on a planted mistake in synthetic Markdown (the negative tests
at the end), beside a control that passes.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import tempfile
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from agentspec.cli import build_parser
from agentspec.config import load_server_config
from agentspec.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DOC_GLOBS = ("README.md", "CONTRIBUTING.md", "docs/*.md", "integrations/**/README.md", "benchmarks/**/*.md",
             "examples/**/README.md")
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "zsh"}
AGENTSPEC_TABLES = {"server", "tenants", "routes"}


def documents() -> list[Path]:
    found: set[Path] = set()
    for pattern in DOC_GLOBS:
        found.update(p for p in ROOT.glob(pattern) if p.is_file() and "node_modules" not in p.parts)
    return sorted(found)


DOCS = documents()
DOC_IDS = [str(p.relative_to(ROOT)) for p in DOCS]


# ---------------------------------------------------------------------------------------------
# Reading Markdown


class Block:
    def __init__(self, lang: str, line: int, text: str):
        self.lang, self.line, self.text = lang, line, text   # line: 1-based line of the first content line


_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")


def split_markdown(text: str) -> tuple[list[Block], str]:
    """The fenced code blocks, and the prose with each block's lines blanked (line numbers kept)."""
    lines = text.split("\n")
    blocks: list[Block] = []
    prose = list(lines)
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j].lstrip())
            j += 1
        blocks.append(Block(m["info"].lower(), i + 2, "\n".join(body)))
        for k in range(i, min(j + 1, len(lines))):
            prose[k] = ""
        i = j + 1
    return blocks, "\n".join(prose)


_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)   # within a paragraph


def code_spans(prose: str) -> Iterator[tuple[int, str]]:
    """(line, content) of each inline code span in ``prose``."""
    for m in _CODE_SPAN.finditer(prose):
        yield prose.count("\n", 0, m.start()) + 1, m[2].strip()


def without_code_spans(prose: str) -> str:
    return _CODE_SPAN.sub(lambda m: "code" + "\n" * m[0].count("\n"), prose)


def shell_lines(text: str, first_line: int) -> Iterator[tuple[int, str]]:
    """(line, logical line) of a shell block: ``\\`` continuations joined, ``$ `` prompts dropped."""
    pending, start = "", first_line
    for k, line in enumerate(text.split("\n")):
        if not pending:
            start = first_line + k
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield start, re.sub(r"^\s*[$>]\s+", "", pending + line)
        pending = ""
    if pending:
        yield start, pending


def command_snippets(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every place a command may be written: logical lines of shell blocks, and
    inline code spans of the prose."""
    blocks, prose = split_markdown(text)
    for b in blocks:
        if b.lang in SHELL_LANGS:
            yield from shell_lines(b.text, b.line)
    yield from code_spans(prose)


_OPERATOR = re.compile(r"^[|&;()<>]+$")
_PREFIXES = {"sudo", "exec", "nohup", "time", "env", "command"}


def commands(snippet: str) -> Iterator[list[str]]:
    """The simple commands of a shell snippet, as words (operators split them, comments dropped)."""
    try:
        lexer = shlex.shlex(snippet, posix=True, punctuation_chars="|&;()<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:   # unbalanced quotes in prose-like code: fall back to plain words
        tokens = re.split(r"\s+|(?=[|;])", snippet.split(" #")[0])
    words: list[str] = []
    for tok in [*tokens, ";"]:
        if not tok:
            continue
        if _OPERATOR.match(tok):
            while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0] in _PREFIXES):
                words.pop(0)
            if words:
                yield words
            words = []
        else:
            words.append(tok)


# ---------------------------------------------------------------------------------------------
# Commands: agentspec subcommands and flags


@cache
def cli_options() -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """The top-level options and ``{subcommand: its option strings}`` of the real parser."""
    parser = build_parser()
    subs: dict[str, frozenset[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, p in action.choices.items():
                subs[name] = frozenset(o for a in p._actions for o in a.option_strings)
    top = frozenset(o for a in parser._actions for o in a.option_strings)
    return top, subs


def _agentspec_args(words: list[str]) -> list[str] | None:
    """The arguments after ``agentspec`` if ``words`` runs it, else None."""
    if re.match(r"^(?:[\w.~-]*/)*agentspec$", words[0]):
        return words[1:]
    if len(words) >= 3 and re.match(r"^python[0-9.]*$", Path(words[0]).name) and words[1] == "-m" \
            and words[2] in ("agentspec", "agentspec.cli"):
        return words[3:]
    return None


def _flag(word: str) -> str | None:
    word = word.lstrip("[").split("=", 1)[0].rstrip("],.:;)")
    return word if re.match(r"^--?[A-Za-z][A-Za-z0-9-]*$", word) else None


def check_commands(text: str, path: Path) -> list[str]:
    top, subs = cli_options()
    problems = []
    for line, snippet in command_snippets(text):
        for words in commands(snippet):
            args = _agentspec_args(words)
            if not args:
                continue
            first = args[0].lstrip("[")
            if first.startswith("-"):
                flag = _flag(first)
                if flag and flag not in top:
                    problems.append(f"{path.name}:{line}: `{snippet}`: agentspec has no option {flag}")
                continue
            if not re.match(r"^[a-z][a-z0-9-]*$", first):
                continue   # a placeholder (`agentspec <command>`) or prose
            if first not in subs:
                problems.append(f"{path.name}:{line}: `{snippet}`: agentspec has no subcommand {first!r} "
                                f"(it has {', '.join(sorted(subs))})")
                continue
            for word in args[1:]:
                if word == "--":
                    break
                flag = _flag(word)
                if flag and flag not in subs[first]:
                    problems.append(f"{path.name}:{line}: `{snippet}`: `agentspec {first}` has no option {flag}")
    return problems


@cache
def make_targets() -> frozenset[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.%/-]+(?:\s+[A-Za-z0-9_.%/-]+)*)\s*::?(?!=)", line)
        if m and not line.startswith((" ", "\t")):
            targets.update(t for t in m[1].split() if not t.startswith("."))
    return frozenset(targets)


def check_make_targets(text: str, path: Path) -> list[str]:
    problems = []
    for line, snippet in command_snippets(text):
        for words in commands(snippet):
            if Path(words[0]).name not in ("make", "gmake"):
                continue
            if "-C" in words or "-f" in words:
                continue   # another Makefile
            for word in words[1:]:
                if word.startswith("-") or "=" in word:
                    continue
                if word not in make_targets():
                    problems.append(f"{path.name}:{line}: `{snippet}`: the Makefile has no target {word!r} "
                                    f"(it has {', '.join(sorted(make_targets()))})")
    return problems


# ---------------------------------------------------------------------------------------------
# Links


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_HTML_REF = re.compile(r"<(?:img|a|source)\b[^>]*?\b(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.I)


def link_targets(text: str) -> Iterator[tuple[int, str]]:
    _, prose = split_markdown(text)
    prose = without_code_spans(prose)
    for rx in (_LINK, _REF_DEF, _HTML_REF):
        for m in rx.finditer(prose):
            yield prose.count("\n", 0, m.start()) + 1, m[1]


def heading_slugs(text: str) -> set[str]:
    """GitHub's anchors for the headings of ``text`` (``## Foo `bar`!`` -> ``foo-bar``; repeats
    get ``-1``, ``-2``)."""
    _, prose = split_markdown(text)
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose.split("\n"):
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", m[1])   # a link's text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def check_links(text: str, path: Path) -> list[str]:
    problems = []
    for line, target in link_targets(text):
        if not target or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("//"):
            continue   # a URL (https:, mailto:, vscode:): not fetched
        file_part, _, anchor = target.partition("#")
        if file_part.startswith("/"):
            dest = (ROOT / file_part.lstrip("/")).resolve()   # GitHub: from the repository's root
        else:
            dest = (path.parent / file_part).resolve()
        where = f"{path.name}:{line}: link {target!r}"
        if not file_part:   # this document's own heading
            if anchor.lower() not in heading_slugs(text):
                problems.append(f"{where}: no heading here has the anchor #{anchor}")
            continue
        if not dest.is_relative_to(ROOT):
            problems.append(f"{where} points outside the repository")
            continue
        if not dest.exists():
            problems.append(f"{where}: no such file {str(dest.relative_to(ROOT))!r}")
            continue
        if anchor and dest.suffix.lower() == ".md":
            if anchor.lower() not in heading_slugs(dest.read_text(encoding="utf-8")):
                problems.append(f"{where}: {dest.name} has no heading with the anchor #{anchor}")
    return problems


# ---------------------------------------------------------------------------------------------
# agentspec.toml blocks


_HEADER = re.compile(r"^\s*\[\[?\s*([A-Za-z0-9_.\"-]+?)\s*\]\]?\s*(#.*)?$")
_COMMENTED_HEADER = re.compile(r"^(\s*)#\s*(\[\[?\s*[A-Za-z0-9_.-]+\s*\]\]?\s*(#.*)?)$")
_COMMENTED_KEY = re.compile(r"^(\s*)#\s*([A-Za-z0-9_-]+)\s*=\s*(.+)$")
_ACTIVE_KEY = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*=")


def _commented_key(line: str) -> re.Match | None:
    """A ``# key = value`` line whose value is a TOML value (prose that has an ``=`` is not)."""
    m = _COMMENTED_KEY.match(line)
    if not m:
        return None
    try:
        tomllib.loads(f"k = {m[3]}")
    except tomllib.TOMLDecodeError:
        return None
    return m


def _load(toml_text: str) -> str | None:
    """The real loader's complaint about ``toml_text`` as an agentspec.toml, or None."""
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "agentspec.toml"
        f.write_text(toml_text, encoding="utf-8")
        try:
            load_server_config(f)
        except ConfigError as e:
            return str(e).replace(repr(str(f)), "the block")
    return None


def _uncommented(lines: list[str], i: int) -> list[str]:
    """``lines`` with the commented-out key at ``i`` set: an active line of the same key in its
    table is dropped; under a commented-out header, the header and its commented keys come back."""
    out = list(lines)
    h = next((k for k in range(i - 1, -1, -1) if _HEADER.match(lines[k]) or _COMMENTED_HEADER.match(lines[k])), -1)
    end = next((k for k in range(i + 1, len(lines)) if _HEADER.match(lines[k]) or _COMMENTED_HEADER.match(lines[k])),
               len(lines))
    if h >= 0 and _COMMENTED_HEADER.match(lines[h]):
        m = _COMMENTED_HEADER.match(lines[h])
        out[h] = m[1] + m[2]
        for k in range(h + 1, end):
            mk = _commented_key(lines[k])
            if mk:
                out[k] = f"{mk[1]}{mk[2]} = {mk[3]}"
        return out
    m = _commented_key(lines[i])
    for k in range(h + 1, end):
        a = _ACTIVE_KEY.match(lines[k])
        if a and a[1] == m[2]:
            out[k] = ""
    out[i] = f"{m[1]}{m[2]} = {m[3]}"
    return out


def check_toml(text: str, path: Path) -> list[str]:
    problems = []
    blocks, _ = split_markdown(text)
    for b in blocks:
        if b.lang != "toml":
            continue
        lines = b.text.split("\n")
        where = f"{path.name}:{b.line}: toml block"
        try:
            tomllib.loads(b.text)
        except tomllib.TOMLDecodeError as e:
            problems.append(f"{where} is not valid TOML: {e}")
            continue
        tables = {m[1].strip('"').split(".")[0] for line in lines if (m := _HEADER.match(line))}
        if tables and not tables & AGENTSPEC_TABLES:
            continue   # another tool's file
        err = _load(b.text)
        if err:
            problems.append(f"{where} does not load as agentspec.toml: {err}")
            continue
        for i, line in enumerate(lines):
            if _commented_key(line):
                err = _load("\n".join(_uncommented(lines, i)))
                if err:
                    problems.append(f"{path.name}:{b.line + i}: commented-out `{line.strip()}` does not load "
                                    f"when set: {err}")
    return problems


# ---------------------------------------------------------------------------------------------
# Paths outside the repository, tracker and lab history


_OUTSIDE = [
    (re.compile(r"\.\./shared\b"), "../shared is outside the repository (no user command may need it)"),
    (re.compile(r"(?<![\w.~/-])/(?:work|home|root|Users|mnt|scratch|data)/"),
     "an absolute path of a particular machine"),
]
_TMP = re.compile(r"(?<![\w.~/-])/tmp/")
_HISTORY = [
    (re.compile(r"(?<![A-Za-z])issues?[ _#-]?\d+", re.I), "an issue reference"),
    (re.compile(r"\b(?:PR|pull request)\s*#?\d+", re.I), "a pull-request reference"),
    (re.compile(r"\(#\d+\)"), "a tracker reference"),
    (re.compile(r"\b[Rr]uns?\s+[A-Z]\d?(?:-[A-Z]\d?)?\b"), "a lab-run name"),
    (re.compile(r"[_-]run\d+\b"), "a lab-run name"),
]
# a date in prose; one inside a file name (`e2e_2026-11-30.json`) or code (a log sample) is not
_DATE = re.compile(r"(?<![\w/.-])20\d\d-[01]\d-[0-3]\d(?![\w-]|\.\w)")
_COMMIT_BEFORE = re.compile(r"`[0-9a-f]{7,40}`\s*\($")   # an upstream commit's date: provenance


def check_paths_and_history(text: str, path: Path) -> list[str]:
    problems = []
    _, prose = split_markdown(text)
    prose_only = without_code_spans(prose)
    for n, line in enumerate(text.split("\n"), 1):
        for rx, what in _OUTSIDE + _HISTORY:
            for m in rx.finditer(line):
                problems.append(f"{path.name}:{n}: {what}: {m[0]!r} in {line.strip()[:100]!r}")
    for n, (line, raw) in enumerate(zip(prose_only.split("\n"), prose.split("\n")), 1):
        for m in _DATE.finditer(line):
            if not _COMMIT_BEFORE.search(raw[:raw.find(m[0])]):
                problems.append(f"{path.name}:{n}: a dated lab record: {m[0]!r} in {line.strip()[:100]!r}")
        if _TMP.search(line):
            problems.append(f"{path.name}:{n}: /tmp/ in prose (a scratch path belongs in an example command): "
                            f"{line.strip()[:100]!r}")
    return problems


CHECKS = {"commands": check_commands, "make": check_make_targets, "links": check_links, "toml": check_toml,
          "paths_and_history": check_paths_and_history}


# ---------------------------------------------------------------------------------------------
# The documents


def test_documents_found():
    names = {str(p.relative_to(ROOT)) for p in DOCS}
    assert "README.md" in names and "docs/configuration.md" in names, names


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("doc", DOCS, ids=DOC_IDS)
def test_document(doc: Path, check: str):
    problems = CHECKS[check](doc.read_text(encoding="utf-8"), doc)
    assert not problems, f"{len(problems)} problem(s) in {doc.relative_to(ROOT)}:\n" + "\n".join(problems)


def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_configuration_reference_is_current():
    """docs/configuration.md is what scripts/config_reference.py makes of agentspec/config.py and
    agentspec/cli.py now."""
    gen = _generator()
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == gen.render(), f"docs/configuration.md is out of date: run {gen.COMMAND}"


def test_configuration_reference_check_names_the_command(tmp_path, monkeypatch, capsys):
    """``--check`` on a page that differs exits 1 and says what to run; on the current page, 0."""
    gen = _generator()
    page = tmp_path / "configuration.md"
    monkeypatch.setattr(gen, "OUTPUT", page)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    page.write_text(gen.render().replace("| `max_queue` |", "| `max_queue_size` |"), encoding="utf-8")
    assert gen.main(["--check"]) == 1
    assert f"configuration.md is out of date: run {gen.COMMAND}" in capsys.readouterr().err
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0


def test_configuration_reference_covers_every_key_and_flag():
    """The page names every key of every table and every flag of every subcommand (the rendering
    cannot drop one without this failing, whatever the committed page says)."""
    gen = _generator()
    page = gen.render()
    tables = gen.tables(gen.field_comments((ROOT / "agentspec" / "config.py").read_text(encoding="utf-8")))
    assert {t.header for t in tables} == {"[server]", "[[tenants]]", "[[routes]]", "[routes.when]"}
    example = page.split("```toml\n", 1)[1].split("```", 1)[0]
    for t in tables:
        for f in t.keys:
            assert f"| `{f.name}` |" in page.split(f"### `{t.header}`", 1)[1], (t.header, f.name)
            assert re.search(rf"^(# )?{f.name} = ", example, re.M), (t.header, f.name)
    assert check_toml(f"```toml\n{example}```\n", ROOT / "docs" / "configuration.md") == []
    _, subs = cli_options()
    for name, options in subs.items():
        section = page.split(f"### `agentspec {name}`", 1)[1].split("\n### ", 1)[0]
        for opt in options - {"-h", "--help"}:
            assert f"`{opt}`" in section, (name, opt)


# ---------------------------------------------------------------------------------------------
# Each check fails on a planted mistake (and passes the same text without it)

SYNTHETIC = ROOT / "docs" / "synthetic.md"   # never written: links resolve from docs/

NEGATIVE = [
    # (check, good Markdown, bad Markdown, a word the problem must contain)
    ("commands", "```bash\nagentspec serve --port 8000 --repo .\n```\n",
     "```bash\nagentspec serve --port 8000 --repoo .\n```\n", "--repoo"),
    ("commands", "Run `agentspec stats --by session`.\n", "Run `agentspec stats --by-session`.\n", "--by-session"),
    ("commands", "`agentspec index DIR --snapshot S`\n", "`agentspec indx DIR`\n", "indx"),
    ("commands", "`agentspec generate --no-spec`\n", "`agentspec serve --no-spec`\n", "--no-spec"),   # another subcommand's flag
    ("commands", "```\n$ .venv/bin/agentspec demo \\\n    --file x.py\n```\n",
     "```\n$ .venv/bin/agentspec demo \\\n    --file x.py --port 1\n```\n", "--port"),
    ("commands", "```sh\ncat p.txt | agentspec generate --json\n```\n",
     "```sh\ncat p.txt | agentspec generate --jsn\n```\n", "--jsn"),
    ("commands", "`agentspec serve [--config FILE]`\n", "`agentspec serve [--conf FILE]`\n", "--conf"),
    ("commands", "`python -m agentspec.cli lsp --tcp 9000`\n", "`python -m agentspec.cli lsp --tpc 9000`\n", "--tpc"),
    ("make", "Run `make test-unit`.\n", "Run `make unit-test`.\n", "unit-test"),
    ("make", "```bash\nmake run\n```\n", "```bash\nmake serve\n```\n", "serve"),
    ("links", "See [config](configuration.md).\n", "See [config](configration.md).\n", "configration.md"),
    ("links", "![plot](bench_e2e.png)\n", "![plot](bench_e2e2.png)\n", "bench_e2e2.png"),
    ("links", "[r]: ../README.md\n", "[r]: ../README.mdx\n", "README.mdx"),
    ("links", "[x](configuration.md#agentspec-serve)\n", "[x](configuration.md#agentspec-serv)\n", "#agentspec-serv"),
    ("links", "# Top\n\n[up](#top)\n", "# Top\n\n[up](#bottom)\n", "#bottom"),
    ("links", "[src](../agentspec/config.py)\n", "[data](../../shared/data/README.md)\n", "outside"),
    ("toml", "```toml\n[server]\nmax_queue = 8\n```\n", "```toml\n[server]\nmax_queu = 8\n```\n", "max_queu"),
    ("toml", "```toml\n[server]\n# max_batch = 8\n```\n", "```toml\n[server]\n# max_batsh = 8\n```\n", "max_batsh"),
    ("toml", "```toml\n[server]\nmax_batch = 8\n# max_batch = 4    # fewer\n```\n",
     "```toml\n[server]\nmax_batch = 8\n# max_batch = 0    # fewer\n```\n", "max_batch"),
    ("toml", "```toml\n[[routes]]\nname = \"a\"\ndrafters = [\"suffix\"]\n```\n",
     "```toml\n[[routes]]\nname = \"a\"\ndrafters = [\"sufix\"]\n```\n", "sufix"),
    ("toml", "```toml\n# [[tenants]]\n# name = \"acme\"\n# api_keys = [\"sk-0123456789\"]\n```\n",
     "```toml\n# [[tenants]]\n# name = \"acme\"\n# api_key = [\"sk-0123456789\"]\n```\n", "api_key"),
    ("toml", "```toml\n[[routes]]\nname = \"r\"\n[routes.when]\nendpoint = \"apply\"\n```\n",
     "```toml\n[[routes]]\nname = \"r\"\n[routes.when]\nendpoint = \"aply\"\n```\n", "aply"),
    ("toml", "```toml\n[server]\nlog_dir = \"logs\"\n```\n", "```toml\n[server\nlog_dir = \"logs\"\n```\n", "not valid TOML"),
    ("paths_and_history", "`--data path/to/agent_turns.jsonl`\n", "`--data ../shared/data/agent_turns.jsonl`\n",
     "../shared"),
    ("paths_and_history", "Point `--repo` at `/path/to/repo`.\n", "Point `--repo` at `/work/main`.\n", "particular machine"),
    ("paths_and_history", "```bash\nagentspec stats --plot /tmp/a.png\n```\n", "Plots go to /tmp/a.png.\n", "/tmp/"),
    ("paths_and_history", "Speculation is exact.\n", "Since issue 13 speculation is exact.\n", "issue"),
    ("paths_and_history", "`benchmarks/results/prefix_cache.json`\n", "`benchmarks/results/prefix_cache_issue17.json`\n",
     "issue"),
    ("paths_and_history", "Ratios in this run:\n", "Ratios within run F:\n", "lab-run"),
    ("paths_and_history", "`results/e2e.json`\n", "`results/e2e_torch-attn_run2.json`\n", "lab-run"),
    ("paths_and_history", "Measured with `--repeat 3`.\n", "Measured on 2026-12-01.\n", "dated"),
    ("paths_and_history", "In `results/e2e_2026-12-01.json`, at commit `a6b6b02` (2026-08-08).\n",
     "In `results/e2e.json` (2026-12-01).\n", "dated"),
    ("paths_and_history", "Runs can repeat.\n", "Runs A-E are older.\n", "lab-run"),
    ("commands", "`agentspec --help`\n", "`agentspec --version`\n", "--version"),
    ("commands", "A stray ` here.\n\nThen `agentspec serve --port 1`.\n",
     "A stray ` here.\n\nThen `agentspec serve --prot 1`.\n", "--prot"),
    ("commands", "```\nagentspec/        the package\n```\n", "```\nagentspec package\n```\n", "package"),
]


@pytest.mark.parametrize(("check", "good", "bad", "word"), NEGATIVE,
                         ids=[f"{c}-{i}" for i, (c, *_rest) in enumerate(NEGATIVE)])
def test_check_catches_a_planted_mistake(check: str, good: str, bad: str, word: str):
    assert CHECKS[check](good, SYNTHETIC) == []
    problems = CHECKS[check](bad, SYNTHETIC)
    assert problems and any(word in p for p in problems), problems


def test_foreign_toml_is_only_parsed():
    """An editor's languages.toml is not an agentspec.toml; it still has to be TOML."""
    helix = "```toml\n[language-server.agentspec]\ncommand = \"agentspec\"\n# config = { url = \"x\" }\n```\n"
    assert check_toml(helix, SYNTHETIC) == []
    assert check_toml(helix.replace("]\n", "\n", 1), SYNTHETIC)


def test_configuration_reference_names_what_lacks_a_comment(tmp_path):
    """The generator refuses a config field with no why-comment, naming the field and the command."""
    gen = _generator()
    source = (ROOT / "agentspec" / "config.py").read_text(encoding="utf-8")
    stripped = re.sub(r"\n *# requests waiting for the engine beyond this many[^\n]*", "", source, count=1)
    assert stripped != source
    tables = gen.tables(gen.field_comments(stripped))
    server = next(t for t in tables if t.header == "[server]")
    with pytest.raises(SystemExit, match=r"ServerSection\.max_queue has no comment.*config_reference"):
        server.why("max_queue")
