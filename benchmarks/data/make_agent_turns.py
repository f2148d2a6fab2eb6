#!/usr/bin/env python
"""Write ``benchmarks/data/agent_turns.jsonl``: synthetic agent-loop turns over this repository.

Each trajectory is a scripted shell agent renaming one function of ``agentspec/`` everywhere it is
used: it greps for the name, reads the definition and the call sites (``nl -ba FILE | sed -n``),
renames with ``sed -i``, reads ``git diff``, checks that nothing refers to the old name and that the
files compile, and submits. Every tool output is computed here from the repository's own files (the
grep hits, the numbered lines, the unified diff with real blob ids), so the outputs
echo file contents the way a real agent's do; the agent's words are templates. One record per
assistant turn from turn ``FIRST_TURN`` on: ``{"id", "source", "prompt", "response"}``, the prompt
the whole history so far rendered as ``<|role|>\\n...\\n`` blocks ending in ``<|assistant|>\\n`` (as
in the recorded mini-swe-agent traffic), the response that turn's reasoning and one bash command.

Deterministic: the same repository files give the same output, byte for byte (files walked in
sorted order, no clock, no randomness). Regenerate after the source changed with

    python benchmarks/data/make_agent_turns.py [--out benchmarks/data/agent_turns.jsonl]
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "agent_turns.jsonl"
SOURCE = "synthetic: benchmarks/data/make_agent_turns.py (a scripted shell agent renaming functions of this repository)"
TREE = ("agentspec", "kernels", "integrations", "suffix_index", "tests", "benchmarks", "scripts", "examples")
TASKS = 6
FIRST_TURN = 4    # records start where a trajectory has this many turns (a prefix cache has history to reuse)
# a function's leading verb -> the new one
VERBS = {"check": "validate", "parse": "decode", "format": "render", "read": "load", "load": "read",
         "write": "store", "find": "locate", "apply": "run", "new": "create", "make": "build", "get": "fetch"}

SYSTEM = """\
You are a software engineer working in a shell, on a Python repository checked out in the current
directory. You work in turns: each reply of yours runs one command, and the next message shows its
return code and output.

Every reply has two parts:
1. THOUGHT: what you know so far, what you are looking for next and why;
2. exactly one bash code block with exactly one command (join several with && or || if you must).

<example>
THOUGHT: I need to know which files define the parser before I change it.

```bash
git grep -n "def parse" -- '*.py'
```
</example>

A reply without exactly one bash block is rejected and costs a turn."""

GUIDE = """\
<guidelines>
## How the session works
- Each command runs in a new subshell in the repository root: `cd` and exported variables do not
  carry over to the next command. Chain with && when one step needs another.
- Commands must not wait for input: no editors, no pagers, no prompts. Pass -y or -f where a tool asks.
- Output longer than a few hundred lines is cut; narrow it (grep, sed -n, head) instead.

## What to change
- Only the source files that the task is about, and every place that refers to what you change:
  definitions, imports, call sites, tests, comments that name it.
- The behaviour of the code must stay the same. Do not reformat, reorder imports or fix unrelated
  things on the way; the diff should hold the task and nothing else.

## A good order of work
1. Find every place involved: `git grep -n -w NAME -- '*.py'` lists the tracked Python files.
2. Read the definition and each use with line numbers: `nl -ba FILE | sed -n '10,40p'`.
3. Make the change with a command you can repeat and check: `sed -i 's/\\bOLD\\b/NEW/g' FILE...`, or a
   short python script written with a heredoc when the edit spans lines.
4. Read your own diff: `git diff`.
5. Check: no reference to the old name is left, and the changed files still compile
   (`python -m py_compile FILE...`).

## Finishing
When the change is complete and checked, reply with exactly this command, alone:

```bash
echo TASK_COMPLETE && git diff --stat
```

You cannot run anything after it.
</guidelines>"""

WHY = [
    "the other helpers next to it already use the verb `{verb}`, and the odd one out keeps confusing readers",
    "the name `{name}` is wanted for a different function in a follow-up change",
    "`{new}` says what it does at the call sites; `{name}` reads as if it had side effects",
]


def python_files() -> dict[str, str]:
    """Repository-relative path -> text of every Python file under TREE, in sorted order."""
    out = {}
    for top in TREE:
        for p in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in p.parts:
                out[p.relative_to(ROOT).as_posix()] = p.read_text(encoding="utf-8")
    return dict(sorted(out.items()))


def hits(files: dict[str, str], name: str) -> list[tuple[str, int, str]]:
    """``git grep -n -w name``: (path, line number, line) in file order."""
    rx = re.compile(rf"(?<![\w]){re.escape(name)}(?![\w])")
    return [(path, i, line) for path, text in files.items() for i, line in enumerate(text.splitlines(), 1)
            if rx.search(line)]


def candidates(files: dict[str, str]) -> list[dict]:
    """Top-level functions of agentspec/ with a verb to swap, used 3-10 times in 2-4 files, at most 30 lines long."""
    out = []
    for path, text in files.items():
        if not path.startswith("agentspec/"):
            continue
        for node in ast.parse(text).body:
            if not isinstance(node, ast.FunctionDef) or "_" not in node.name:
                continue
            verb, _, rest = node.name.partition("_")
            if verb not in VERBS or node.end_lineno - node.lineno >= 30:
                continue
            h = hits(files, node.name)
            used_in = sorted({p for p, _, _ in h})
            if 3 <= len(h) <= 10 and 2 <= len(used_in) <= 4:
                out.append({"path": path, "name": node.name, "new": f"{VERBS[verb]}_{rest}", "verb": VERBS[verb],
                            "start": node.lineno - len(node.decorator_list), "end": node.end_lineno,
                            "args": ast.unparse(node.args), "hits": h, "files": used_in})
    return [c for c in out if not hits(files, c["new"])]   # the new name must be free


def numbered(text: str, a: int, b: int) -> str:
    """``nl -ba FILE | sed -n 'a,bp'``."""
    lines = text.splitlines()
    return "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(a, min(b, len(lines)) + 1))


def blob_id(text: str) -> str:
    data = text.encode()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()[:7]


def git_diff(old: dict[str, str], new: dict[str, str]) -> str:
    out = []
    for path in sorted(new):
        if old[path] == new[path]:
            continue
        out += [f"diff --git a/{path} b/{path}", f"index {blob_id(old[path])}..{blob_id(new[path])} 100644"]
        out += difflib.unified_diff(old[path].splitlines(), new[path].splitlines(), f"a/{path}", f"b/{path}", lineterm="")
    return "\n".join(out)


def observation(output: str, code: int = 0) -> str:
    return f"<returncode>{code}</returncode>\n<output>\n{output}{chr(10) if output else ''}</output>"


def reply(thought: str, command: str) -> str:
    return f"THOUGHT: {thought}\n\n```bash\n{command}\n```"


def trajectory(files: dict[str, str], c: dict) -> list[tuple[str, str]]:
    """(assistant reply, the output it got) per turn; the last reply (the submission) gets ""."""
    name, new, path = c["name"], c["new"], c["path"]
    others = [p for p in c["files"] if p != path]
    steps = []
    grep = f"git grep -n -w {name} -- '*.py'"
    steps.append((reply(f"I need every place that refers to `{name}` before renaming it: its definition, the "
                        "imports and the call sites. A whole-word grep over the tracked Python files finds them.", grep),
                  observation("\n".join(f"{p}:{i}:{line}" for p, i, line in c["hits"]))))
    a, b = max(1, c["start"] - 3), c["end"] + 2
    steps.append((reply(f"`{name}` is defined in `{path}` at line {c['start']} and used in {len(c['hits'])} lines "
                        f"across {len(c['files'])} files. Let me read the definition first: `def {name}({c['args']})`.",
                        f"nl -ba {path} | sed -n '{a},{b}p'"),
                  observation(numbered(files[path], a, b))))
    lead = ["The definition is a plain function, so only the name changes.",
            "So far every use is a direct call."]
    for j, other in enumerate(others[:2]):
        first = next(i for p, i, _ in c["hits"] if p == other)
        n = sum(p == other for p, _, _ in c["hits"])
        a, b = max(1, first - 5), first + 6
        steps.append((reply(f"{lead[j]} `{other}` refers to `{name}` {'once' if n == 1 else f'{n} times'}; let me "
                            f"look at the first use, line {first}, to be sure it is this function and not an "
                            "attribute of something else.", f"nl -ba {other} | sed -n '{a},{b}p'"),
                      observation(numbered(files[other], a, b))))
    rx = re.compile(rf"(?<![\w]){re.escape(name)}(?![\w])")
    changed = {p: rx.sub(new, files[p]) for p in c["files"]}
    targets = " ".join(c["files"])
    steps.append((reply(f"Every use is the same function. I'll rename `{name}` to `{new}` in all {len(c['files'])} "
                        "files at once, whole words only, so longer names that contain it stay as they are.",
                        f"sed -i 's/\\b{name}\\b/{new}/g' {targets}"),
                  observation("")))
    steps.append((reply("The sed command succeeded. Let me read the diff to check that it changed the definition, "
                        "the imports and the calls, and nothing else.", "git diff"),
                  observation(git_diff(files, changed))))
    steps.append((reply(f"The diff renames exactly the {len(c['hits'])} lines found by grep. Now no reference to "
                        f"`{name}` may be left, and the changed files must still compile.",
                        f"! git grep -n -w {name} -- '*.py' && python -m py_compile {targets} && echo 'no references left, compiles'"),
                  observation("no references left, compiles")))
    steps.append((reply(f"`{name}` is now `{new}` everywhere, the behaviour is unchanged and the files compile. "
                        "The task is done, so I submit.", "echo TASK_COMPLETE && git diff --stat"),
                  ""))   # the session ends: no prompt shows this output
    return steps


def task_text(c: dict, k: int) -> str:
    why = WHY[k % len(WHY)].format(**c)
    return (f"<task>\nRename the function `{c['name']}` (defined in `{c['path']}`) to `{c['new']}`: {why}.\n"
            f"Rename it everywhere this repository uses it (the definition, imports, call sites and tests) "
            f"without changing what the code does.\n</task>\n\n{GUIDE}")


def render(messages: list[tuple[str, str]]) -> str:
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"


def records(files: dict[str, str]) -> list[dict]:
    cands = candidates(files)
    if len(cands) < TASKS:
        raise SystemExit(f"only {len(cands)} functions qualify (need {TASKS}): loosen candidates()")
    # spread over the repository: evenly spaced in path order
    picked = [cands[round(i * (len(cands) - 1) / (TASKS - 1))] for i in range(TASKS)]
    out = []
    for k, c in enumerate(picked):
        history = [("system", SYSTEM), ("user", task_text(c, k))]
        for turn, (said, seen) in enumerate(trajectory(files, c), 1):
            if turn >= FIRST_TURN:
                out.append({"id": f"synthetic/agentspec/rename-{c['name']}#t{turn:03d}", "source": SOURCE,
                            "prompt": render(history), "response": said})
            history += [("assistant", said), ("user", seen)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    recs = records(python_files())
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    print(f"{args.out}: {len(recs)} records, {len({r['id'].split('#')[0] for r in recs})} trajectories")


if __name__ == "__main__":
    main()
