"""A recorded tool-call workload: each recorded file rewrite as the turn an agent sends after reading
the file.

``../shared/data/file_rewrites.jsonl`` holds honest before/after pairs (commits authored with the
Aider assistant): a commit message, a file, the file after the commit. Here each becomes the
request a coding agent (Claude Code, opencode, Qwen Code) sends once it has read the file: the
tools ``Read`` / ``Write`` / ``Edit`` offered, the commit message as the user's request, the
agent's ``Read`` call and its result (the file with ``cat -n`` line numbers, as agents show a file
to the model) in the history, and the model's turn to come: an ``Edit`` or a ``Write`` whose
arguments copy the file JSON-escaped. The same turn in the Chat Completions form
(``chat_request``) and the Anthropic Messages form (``messages_request``). ``write_only``: only
``Write`` offered and a call required (``tool_choice: "required"``; llama-server takes only auto /
none / required), so every turn has a call to time.

The data stays where it is (``--data``, default ``../shared/data``): this module generates the
requests from it at run time and copies nothing into the repository.

    python -m benchmarks.tool_turns --data ../shared/data --n 2   # prints the first requests (JSON)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file, not with -m
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import DATA, DATA_HELP, fixture_ids  # noqa: E402

__all__ = ["SYSTEM", "TOOLS", "ToolTurn", "tool_turns"]

SYSTEM = ("You are a coding agent working in the user's repository. Use the tools to read and change files: "
          "to change a file call Edit with an exact old_string from the file and its replacement new_string, "
          "or Write with the file's complete new content. Do not show code in text: call a tool.")

# the tools, as JSON schemas (the agents' own are longer; these keep their names and arguments)
TOOLS = {
    "Read": ("Read a file from the repository. Returns its lines numbered as `cat -n` shows them.",
             {"type": "object", "properties": {"file_path": {"type": "string", "description": "the file's path"}},
              "required": ["file_path"], "additionalProperties": False}),
    "Write": ("Write a file: its complete new content replaces what it holds.",
              {"type": "object", "properties": {"file_path": {"type": "string", "description": "the file's path"},
                                                "content": {"type": "string", "description": "the whole new file"}},
               "required": ["file_path", "content"], "additionalProperties": False}),
    "Edit": ("Replace an exact string in a file with another.",
             {"type": "object", "properties": {"file_path": {"type": "string", "description": "the file's path"},
                                               "old_string": {"type": "string", "description": "the text to replace"},
                                               "new_string": {"type": "string", "description": "its replacement"}},
              "required": ["file_path", "old_string", "new_string"], "additionalProperties": False}),
}

# a recorded rewrite's prompt: the instruction (commit message), the path and the file exactly
_REWRITE = re.compile(r"Apply this change to `([^`\n]+)`:\n\n(.*?)\n\nCurrent contents of `\1`:\n```[^\n]*\n(.*?)```\n\n"
                      r"Reply with", re.S)


def numbered(text: str) -> str:
    """``text`` as ``cat -n`` shows it (Claude Code's Read returns the same gutter with "→")."""
    return "".join(f"{i:6d}\t{line}\n" for i, line in enumerate(text.splitlines(), 1))


@dataclass(frozen=True)
class ToolTurn:
    id: str
    path: str
    instruction: str
    old: str            # the file as read
    new: str            # the recorded file after the change (what an ideal Write writes)

    def _tools(self, write_only: bool) -> list[str]:
        return ["Write"] if write_only else ["Read", "Edit", "Write"]

    def chat_request(self, *, write_only: bool = False) -> dict:
        """The Chat Completions body (``messages``, ``tools``, ``tool_choice``)."""
        call_id = "call_read_0"
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{self.instruction}\n\n(in `{self.path}`)"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "Read", "arguments": json.dumps({"file_path": self.path})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": numbered(self.old)},
        ]
        tools = [{"type": "function", "function": {"name": n, "description": TOOLS[n][0], "parameters": TOOLS[n][1]}}
                 for n in self._tools(write_only)]
        return {"messages": messages, "tools": tools, "tool_choice": "required" if write_only else "auto"}

    def messages_request(self, *, write_only: bool = False) -> dict:
        """The Anthropic Messages body (``system``, ``messages``, ``tools``, ``tool_choice``)."""
        use_id = "toolu_read_0"
        messages = [
            {"role": "user", "content": f"{self.instruction}\n\n(in `{self.path}`)"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": use_id, "name": "Read",
                                               "input": {"file_path": self.path}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use_id, "content": numbered(self.old)}]},
        ]
        tools = [{"name": n, "description": TOOLS[n][0], "input_schema": TOOLS[n][1]} for n in self._tools(write_only)]
        return {"system": SYSTEM, "messages": messages, "tools": tools,
                "tool_choice": {"type": "any"} if write_only else {"type": "auto"}}


def tool_turns(data: Path = DATA, n: int | None = None, *, max_chars: int = 4000, held_out: bool = True
               ) -> Iterator[ToolTurn]:
    """The recorded rewrites as ``ToolTurn`` s, in file order: the first ``n`` (None: all) whose
    file is at most ``max_chars``, those in the tests' fixture skipped (``held_out``). ``data``: the
    folder holding ``file_rewrites.jsonl``, or a file of such records. A rewrite that creates a
    file reads it empty."""
    from agentspec.traces import load_records

    path = Path(data) if str(data).endswith(".jsonl") else Path(data) / "file_rewrites.jsonl"
    if not path.is_file():
        raise SystemExit(f"the tool-call workload needs {path} (the recorded file rewrites; --data DIR)")
    held = fixture_ids() if held_out else set()
    k = 0
    for rec in load_records(path):
        if n is not None and k >= n:
            return
        m = _REWRITE.search(rec["prompt"])
        if rec["id"] in held or m is None or len(m[3]) > max_chars:
            continue
        k += 1
        yield ToolTurn(id=rec["id"], path=m[1], instruction=m[2].strip(), old=m[3], new=rec["response"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help=DATA_HELP)
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--max-chars", type=int, default=4000)
    ap.add_argument("--form", choices=("chat", "messages"), default="chat")
    ap.add_argument("--write-only", action="store_true", help="only Write offered, a call required")
    args = ap.parse_args()
    for t in tool_turns(args.data, args.n, max_chars=args.max_chars):
        body = t.chat_request(write_only=args.write_only) if args.form == "chat" else \
            t.messages_request(write_only=args.write_only)
        print(json.dumps({"id": t.id, **body}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
