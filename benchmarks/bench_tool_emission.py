"""How a model writes a tool call when it is offered tools with ``tool_choice`` auto: inside the
family's tags (Qwen: ``<tool_call>...</tool_call>``), as bare JSON, as JSON in a ``json`` fence, as
JSON after some prose, or not at all (text).

Each prompt is rendered with the model's own chat template and five agent tools (read, write,
edit, bash, list), and decoded greedily with no grammar: what the model emits on its own, which is
what the server's lazy tool-call grammar sees before its trigger. The server's output parser
(``agentspec.chat.parse``) then reads the same text: ``parsed`` is whether it returns a call.

    .venv/bin/python -m benchmarks.bench_tool_emission --model ~/.cache/agentspec/gguf/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter

SYSTEM = ("You are a coding agent working in a git repository. Use the tools to read and change files and to run "
          "commands; do not just describe what to do.")


def _tool(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


_S = {"type": "string"}
TOOLS = [
    _tool("read", "Read a file from the repository.", {"path": _S}, ["path"]),
    _tool("write", "Write a file (create or overwrite) with the given content.", {"path": _S, "content": _S},
          ["path", "content"]),
    _tool("edit", "Replace old_string with new_string in a file.", {"path": _S, "old_string": _S, "new_string": _S},
          ["path", "old_string", "new_string"]),
    _tool("bash", "Run a shell command in the repository and return its output.", {"command": _S}, ["command"]),
    _tool("list", "List the files in a folder.", {"path": _S}, ["path"]),
]
PROMPTS = [
    "Create a file hello.py that prints hello world.",
    "Read README.md and tell me what this project does.",
    "Run the tests with pytest and tell me whether they pass.",
    "In utils.py, rename the function foo to bar.",
    "List the Python files in the src folder.",
]

_JSON_CALL = re.compile(r'\{\s*"name"\s*:')


def classify(text: str) -> str:
    s = text.strip()
    if "<tool_call>" in s:
        return "tagged"
    if s.startswith("```") and _JSON_CALL.search(s.split("\n", 1)[-1][:200]):
        return "fenced"
    if s.startswith(("{", "[")) and _JSON_CALL.search(s[:200]):
        return "bare"
    if _JSON_CALL.search(s):
        return "json after prose"
    return "text"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf file or Hugging Face folder with a tool-call template")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--json", action="store_true", help="print every output as JSON lines too")
    args = ap.parse_args(argv)

    import agentspec
    from agentspec.chat import OutputParser, detect_format

    engine = agentspec.Engine.embedded(model=args.model, quiet=True)
    tok = engine.tokenizer
    fmt = detect_format(getattr(tok, "chat_template", None))
    if fmt is None:
        print(f"{args.model}: the chat template renders no tools", file=sys.stderr)
        return 1
    names = [t["function"]["name"] for t in TOOLS]
    counts: Counter[str] = Counter()
    parsed = 0
    t0 = time.monotonic()
    for prompt in PROMPTS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        ids = tok.encode(tok.apply_chat_template(messages, tools=TOOLS))
        g = engine.generate(ids, max_tokens=args.max_tokens, temperature=0.0)
        kind = classify(g.text)
        p = OutputParser(fmt, names)
        p.push(g.text)
        p.finish()
        counts[kind] += 1
        parsed += bool(p.calls)
        calls = [(c.name, json.loads(c.arguments)) for c in p.calls]
        print(f"{kind:>17}  parsed={bool(p.calls)!s:5}  {prompt!r}: {g.text[:160]!r}")
        if args.json:
            print(json.dumps({"prompt": prompt, "kind": kind, "text": g.text, "calls": calls}))
    total = len(PROMPTS)
    summary = ", ".join(f"{k} {counts[k]}" for k in ("tagged", "bare", "fenced", "json after prose", "text"))
    print(f"{engine.model_name if hasattr(engine, 'model_name') else args.model}: {summary}; the parser returns a call "
          f"for {parsed}/{total} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
