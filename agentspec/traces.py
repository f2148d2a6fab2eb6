"""Recorded agent traffic: ``{"id", "source", "prompt", "response"}`` JSON lines.

Prompts are rendered as ``<|role|>\\n...\\n`` blocks ending in ``<|assistant|>\\n``;
``prompt_messages`` turns them back into chat messages so that each model's own chat template
renders them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

__all__ = ["conversation_turns", "load_records", "prompt_messages"]

_ROLE = re.compile(r"<\|(system|user|assistant|tool)\|>\n")


def prompt_messages(prompt: str) -> list[dict[str, str]]:
    """``[{"role", "content"}, ...]`` from a rendered prompt; the trailing empty assistant turn is dropped."""
    parts = _ROLE.split(prompt)
    if parts[0].strip():
        raise ValueError(f"prompt does not start with a <|role|> block: {parts[0][:40]!r}")
    messages = []
    for i in range(1, len(parts), 2):
        role, content = parts[i], parts[i + 1]
        if content.endswith("\n"):
            content = content[:-1]
        messages.append({"role": role, "content": content})
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return messages


def conversation_turns(messages: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """The prompts of an agent loop's successive turns: ``messages`` up to and including each
    user (or tool) message that an assistant message answers or that ends the list. Each turn's
    prompt extends the one before (what a prefix cache reuses)."""
    turns = []
    for i, m in enumerate(messages):
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else "assistant"
        if m["role"] in ("user", "tool") and nxt == "assistant":
            turns.append(messages[:i + 1])
    return turns


def load_records(path: str | Path, *, limit: int | None = None) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if limit is not None and n >= limit:
                return
            if line.strip():
                yield json.loads(line)
