"""Write docs/configuration.md, the configuration and command-line reference, from the code.

    .venv/bin/python scripts/config_reference.py           # rewrite docs/configuration.md
    .venv/bin/python scripts/config_reference.py --check   # exit 1 if the committed page differs

The TOML part comes from the msgspec structs in agentspec/config.py: each table's docstring, each
key's type, constraints and default (``msgspec.inspect``) and the "why" comment written above the
field (read from the source with ``ast``). The command-line part comes from the argparse parser
in agentspec/cli.py (``build_parser``): every subcommand, positional and flag with its help and
default. A field without a comment, or an unset key without an example below, is an error here,
so the page cannot fall silently behind the code. Nothing on the server's import path imports
this script.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import sys
import textwrap
from pathlib import Path

import msgspec
import msgspec.inspect as mi

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "configuration.md"
COMMAND = "python scripts/config_reference.py"

# Values the example file shows for keys that have no default worth showing (required keys, keys
# unset by default), as TOML values, and whether the example sets them (True) or shows them
# commented out (False). Keys with a default are shown set to it.
EXAMPLES: dict[str, tuple[object, bool]] = {
    "server.model": ("models/Qwen2.5-Coder-1.5B-Instruct", False),
    "server.model_name": ("qwen2.5-coder-1.5b", False),
    "server.prefix_cache_bytes": (1 << 30, False),
    "tenants.name": ("acme", True),
    "tenants.api_keys": (["sk-acme-0123456789"], True),
    "tenants.workspace": ("/path/to/acme-repo", False),
    "tenants.max_concurrent": (4, False),
    "tenants.requests_per_minute": (120, False),
    "routes.name": ("apply", True),
    "routes.budget": (64, True),
    "routes.drafters": (["suffix", "lookahead"], True),
    "routes.when.endpoint": ("apply", True),
    "routes.when.tenant": ("acme", False),
    "routes.when.model": (["qwen2.5-coder-1.5b"], False),
    "routes.when.min_temperature": (0.0, False),
    "routes.when.max_temperature": (0.7, False),
}

# argparse `type=` callables of agentspec/cli.py, by qualified name, as the value a user writes
# (a callable with a `describes` attribute says it itself: cli._number)
CLI_TYPES = {
    "int": "integer",
    "float": "number",
    "_port": "port, 1-65535",
    "_draft_tokens": "integer >= 2",
    "_sglang_arg": "KEY=VALUE",
    "_tenant_name": "tenant name",
    "_since": "ISO date/time, or an age: 90s, 15m, 2h, 7d",
    "_tcp_address": "[HOST:]PORT",
}

INTRO = """\
agentspec reads its settings from two places: the command line (`agentspec serve`, `agentspec
generate`, ...) and, for the server, one TOML file (`agentspec serve --config agentspec.toml`).
Every key in the file is optional; with no file the server has one tenant, `default`, needs no API
key and refuses to bind a non-loopback address (unless `--insecure-no-auth`). A key the structs do
not know, a value of the wrong type or out of range, or a reference to something missing (an
unknown drafter, a route naming a tenant that is not configured) stops the start with a message
naming the key; nothing is silently ignored. Flags win over the file where both exist
(`--model` over `[server] model`).
"""


# ---------------------------------------------------------------------------------------------
# TOML: the structs of agentspec/config.py


def field_comments(source: str) -> dict[str, dict[str, str]]:
    """``{class name: {field name: the comment lines written right above it, joined}}`` and the
    class docstring under the key ``""``."""
    lines = source.splitlines()
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = {"": _markdown(" ".join((ast.get_docstring(node) or "").split()))}
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                above: list[str] = []
                i = stmt.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#"):
                    above.insert(0, lines[i].strip().lstrip("#").strip())
                    i -= 1
                docs[stmt.target.id] = _markdown(" ".join(above))
        out[node.name] = docs
    return out


def _markdown(text: str) -> str:
    """A docstring's reStructuredText literals (````x````) as Markdown code (```x```)."""
    return text.replace("``", "`")


def _struct_of(t):
    """The StructType a field holds (itself, or the item type of a list of structs), else None."""
    if isinstance(t, mi.StructType):
        return t
    if isinstance(t, mi.ListType) and isinstance(t.item_type, mi.StructType):
        return t.item_type
    return None


def _bounds(t) -> str:
    parts = [f"{op} {v:g}" if isinstance(v, float) else f"{op} {v}"
             for op, v in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le)) if v is not None]
    return " and ".join(parts)


def type_text(t) -> str:
    """How a key's type reads in the tables: ``integer, >= 1``, ``string or list of strings``."""
    if isinstance(t, mi.UnionType):
        return " or ".join(type_text(x) for x in t.types if not isinstance(x, mi.NoneType))
    if isinstance(t, mi.IntType):
        b = _bounds(t)
        return f"integer {b}" if b else "integer"
    if isinstance(t, mi.FloatType):
        b = _bounds(t)
        return f"number {b}" if b else "number"
    if isinstance(t, mi.BoolType):
        return "boolean"
    if isinstance(t, mi.StrType):
        return f"string matching `{t.pattern}`" if t.pattern else "string"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in t.values)
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        if isinstance(t.item_type, mi.StructType):
            return "array of tables"
        item = type_text(t.item_type)
        return f"list of {item}s" if " " not in item else f"list of ({item})"
    if isinstance(t, mi.StructType):
        return "table"
    raise TypeError(f"config_reference: no wording for the type {t!r}; add one to type_text()")


def toml_value(v: object) -> str:
    """``v`` as a TOML value (the scalars, lists and strings the config uses)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)   # a JSON string is a TOML basic string for the text used here
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"config_reference: cannot write {v!r} as a TOML value")


def default_text(f) -> str:
    if f.required:
        return "required"
    if f.default_factory is not msgspec.NODEFAULT:
        value = f.default_factory()
        if isinstance(value, msgspec.Struct):
            return "(table)"
        return f"`{toml_value(value)}`"
    if f.default is None:
        return "unset"
    text = f"`{toml_value(f.default)}`"
    if f.name.endswith("_bytes") and isinstance(f.default, int) and f.default >= 1 << 20 and f.default % (1 << 20) == 0:
        text += f" ({f.default >> 20} MiB)"
    return text


def _cell(text: str) -> str:
    """Text for a Markdown table cell: ``|`` escaped, and ``<`` / ``>`` outside code spans as
    entities (so ``<tenant>`` is shown, not taken for HTML)."""
    pieces = re.split(r"(`[^`]*`)", text)
    pieces = [p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;") for p in pieces]
    return "".join(pieces).replace("|", "\\|")


class Table:
    """One TOML table: its header, the struct behind it and the keys that are plain values."""

    def __init__(self, header: str, path: str, struct: mi.StructType, docs: dict[str, dict[str, str]], held: str):
        self.header, self.path, self.struct = header, path, struct
        self.docs = docs[struct.cls.__name__]
        self.held = held   # the comment on the field that holds this table
        self.keys = [f for f in struct.fields if _struct_of(f.type) is None]

    def why(self, name: str) -> str:
        text = self.docs.get(name, "")
        if not text:
            raise SystemExit(f"agentspec/config.py: {self.struct.cls.__name__}.{name} has no comment saying why "
                             f"it exists; write one above the field, then run {COMMAND}")
        return text


def tables(docs: dict[str, dict[str, str]]) -> list[Table]:
    """The file's tables, in the order the example shows them."""
    from agentspec.config import ServerConfig

    out = []
    top = mi.type_info(ServerConfig)
    for f in top.fields:
        struct = _struct_of(f.type)
        if struct is None:
            raise SystemExit(f"config_reference: ServerConfig.{f.name} is not a table; document top-level keys here")
        array = isinstance(f.type, mi.ListType)
        out.append(Table(f"[[{f.name}]]" if array else f"[{f.name}]", f.name, struct, docs,
                         docs["ServerConfig"].get(f.name, "")))
        for sub in struct.fields:   # tables inside a table (a route's `when`)
            inner = _struct_of(sub.type)
            if inner is not None:
                out.append(Table(f"[{f.name}.{sub.name}]", f"{f.name}.{sub.name}", inner, docs,
                                 docs[struct.cls.__name__].get(sub.name, "")))
    return out


def _comment(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, width=98 - len(indent), initial_indent=indent + "# ",
                         subsequent_indent=indent + "# ", break_on_hyphens=False, break_long_words=False)


def example_toml(tabs: list[Table]) -> str:
    """A complete agentspec.toml: every key, set to its default or to the example value, or
    commented out with an example where it is unset by default."""
    out = ["# agentspec.toml: every key, with its default or an example value.",
           "# Lines starting with `# key =` are keys that are unset by default.", ""]
    for tab in tabs:
        out += _comment(tab.held or tab.docs[""])
        out.append(tab.header)
        for f in tab.keys:
            key = f"{tab.path}.{f.name}"
            out += _comment(tab.why(f.name))
            if key in EXAMPLES:
                value, active = EXAMPLES[key]
            elif f.required or (f.default is None and f.default_factory is msgspec.NODEFAULT):
                raise SystemExit(f"config_reference: {key} has no default; add an example value to EXAMPLES in "
                                 f"scripts/config_reference.py")
            else:
                value = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
                active = True
            out.append(("" if active else "# ") + f"{f.name} = {toml_value(value)}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def toml_sections(tabs: list[Table]) -> list[str]:
    out = []
    for tab in tabs:
        out += ["", f"### `{tab.header}`", "", _cell(tab.docs[""]), "",
                "| key | type | default | what it is for |", "|---|---|---|---|"]
        for f in tab.keys:
            out.append(f"| `{f.name}` | {_cell(type_text(f.type))} | {_cell(default_text(f))} | "
                       f"{_cell(tab.why(f.name))} |")
    return out


def spec_section(docs: dict[str, dict[str, str]]) -> list[str]:
    from agentspec.config import SpecConfig

    d = docs["SpecConfig"]
    out = ["", "### Python: `SpecConfig`", "",
           _cell(d[""]) + " `agentspec.SpecConfig(...)` is what `Engine.generate(spec=...)` takes; a route's "
           "`budget` and `drafters` fill the same fields, and its unset keys take these defaults.", "",
           "| field | type | default | what it is for |", "|---|---|---|---|"]
    for f in mi.type_info(SpecConfig).fields:
        if not d.get(f.name):
            raise SystemExit(f"agentspec/config.py: SpecConfig.{f.name} has no comment saying why it exists")
        default = "`None`" if f.default is None else f"`{f.default!r}`"
        out.append(f"| `{f.name}` | {_cell(type_text(f.type))} | {default} | {_cell(d[f.name])} |")
    return out


# ---------------------------------------------------------------------------------------------
# The command line: agentspec/cli.py's parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """``{name: (subparser, its one-line help)}`` in the order the parser lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return {name: (p, helps.get(name, "")) for name, p in action.choices.items()}
    return {}


def _value_text(a: argparse.Action) -> str:
    if a.nargs == 0:
        return "switch"
    if a.choices is not None:
        return " \\| ".join(f"`{c}`" for c in a.choices)
    kind = (getattr(a.type, "describes", None) or CLI_TYPES.get(getattr(a.type, "__qualname__", ""), "")
            if a.type is not None else "")
    meta = a.metavar if a.metavar is not None else (a.dest if not a.option_strings else a.dest.upper())
    text = f"`{meta}`"
    if a.nargs in ("+", "*"):
        text += " ..."
    if kind and kind != meta:
        text += f" ({_cell(kind)})"
    if isinstance(a, argparse._AppendAction):
        text += ", repeatable"
    return text


def _default_text(a: argparse.Action) -> str:
    d = a.default
    if d is None or d is False or d == [] or d is argparse.SUPPRESS:
        return "—"
    return f"`{d}`"


def cli_sections() -> list[str]:
    from agentspec.cli import build_parser

    parser = build_parser()
    out = ["", "## Command line", "",
           f"`{parser.prog}`: {_cell(parser.description or '')} Each subcommand's `--help` prints the same "
           "options. A bad value is refused before anything loads, with a message naming the flag.", "",
           "| subcommand | what it does |", "|---|---|"]
    subs = subcommands(parser)
    for name, (_, help_text) in subs.items():
        out.append(f"| [`{parser.prog} {name}`](#{parser.prog}-{name}) | {_cell(help_text)} |")
    for name, (p, help_text) in subs.items():
        out += ["", f"### `{parser.prog} {name}`", ""]
        text = p.description or help_text
        out.append(_cell(text[:1].upper() + text[1:]) + ("" if text.endswith(".") else "."))
        rows = []
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            if not a.help:
                raise SystemExit(f"agentspec/cli.py: `{parser.prog} {name}` {a.option_strings or a.dest} has no help; "
                                 f"add help=..., then run {COMMAND}")
            option = ", ".join(f"`{o}`" for o in a.option_strings) if a.option_strings else f"`{a.dest}` (positional)"
            if a.required and a.option_strings:
                option += " (required)"
            help_text = a.help % {"default": a.default, "prog": p.prog} if "%(" in a.help else a.help
            rows.append(f"| {option} | {_value_text(a)} | {_cell(_default_text(a))} | {_cell(help_text)} |")
        if rows:
            out += ["", "| option | value | default | what it does |", "|---|---|---|---|", *rows]
    return out


# ---------------------------------------------------------------------------------------------


def render() -> str:
    """The whole page, as docs/configuration.md should hold it."""
    import agentspec.config

    source = Path(inspect.getsourcefile(agentspec.config)).read_text(encoding="utf-8")
    docs = field_comments(source)
    tabs = tables(docs)
    lines = ["# Configuration and command-line reference", "",
             f"<!-- Generated by `{COMMAND}` from agentspec/config.py and agentspec/cli.py: edit those, "
             "then run it; a unit test fails while this page differs. -->", "",
             INTRO.rstrip(), "",
             "## The configuration file", "",
             "One file, three parts: `[server]` (how the server runs), `[[tenants]]` (one table per tenant: "
             "API keys, workspace, limits) and `[[routes]]` (per-route speculation rules, each with an optional "
             "`when`). This example sets every key to its default or shows an example value; the keys "
             "commented out are unset by default:", "",
             "```toml", example_toml(tabs).rstrip(), "```", "",
             "## Tables and keys", "",
             "A table per section of the file; the type says what the loader accepts (out of range is refused).",
             ]
    lines += toml_sections(tabs)
    lines += spec_section(docs)
    lines += cli_sections()
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md differs from the code")
    args = ap.parse_args(argv)
    page = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != page:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(page, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
