"""Self-distilled training data: the target's own responses to prompts.

A draft head is trained to predict what the *target* says next, so its training text is the
target's output, not whatever model wrote the prompts' recorded answers (SpecForge's
``regenerate_train_data.py`` does the same against an SGLang server). Each prompt gets a greedy
response and, optionally, sampled ones (seeded, so a rerun reproduces them), generated with the
embedded engine's continuous batching and speculation (greedy output is exact; sampled output
follows the target's distribution).

Output: JSON lines ``{"key", "id", "temperature", "seed", "prompt_ids", "response_ids"}``, one
line per (prompt, variant), appended and fsynced per chunk: an interrupted run resumes where it
stopped (keys already in the file are skipped).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PromptItem", "distill", "load_prompt_items", "read_distilled"]


@dataclass(frozen=True)
class PromptItem:
    id: str
    ids: list[int]


def _group(record_id: str) -> str:
    """Records of one conversation share the id before ``#`` (``gemini/<run>/<task>#t3``)."""
    return record_id.split("#", 1)[0]


def _messages(rec: dict) -> list[dict]:
    from ..traces import prompt_messages

    if isinstance(rec.get("messages"), list):
        return rec["messages"]
    prompt = rec.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("record has neither 'messages' nor a non-empty 'prompt'")
    if prompt.startswith("<|"):
        return prompt_messages(prompt)
    return [{"role": "user", "content": prompt}]


def _fit(messages: list[dict], tokenizer, max_prompt: int) -> list[int] | None:
    """The chat-template ids of the leading system message plus the latest messages that fit
    ``max_prompt`` tokens (None: not even the last message fits)."""
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(head):]
    tail: list[dict] = []
    ids = None
    for m in reversed(body):
        cand = tokenizer.encode(tokenizer.apply_chat_template(head + [m] + tail))
        if len(cand) > max_prompt:
            break
        tail.insert(0, m)
        ids = cand
    return ids


def load_prompt_items(paths: Sequence[str | os.PathLike], tokenizer, *, max_prompt: int, skip: int = 0,
                      limit: int | None = None) -> list[PromptItem]:
    """Prompts from JSON-lines files (records with a rendered ``prompt`` or ``messages``).

    ``skip``: leave out the first ``skip`` records of each file *and every record of the same
    conversation* (ids sharing the part before ``#``), so that held-out benchmark prompts and
    their conversations never reach training. ``limit``: at most this many prompts per file.
    Histories longer than ``max_prompt`` tokens keep the system message and the latest messages.
    """
    items: list[PromptItem] = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"--data: no such file {str(p)!r}")
        with open(p, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        held = {_group(str(r.get("id", k))) for k, r in enumerate(records[:skip])}
        n = 0
        for k, rec in enumerate(records[skip:], start=skip):
            rid = str(rec.get("id", f"{p.stem}/{k}"))
            if _group(rid) in held:
                continue
            try:
                ids = _fit(_messages(rec), tokenizer, max_prompt)
            except ValueError as e:
                raise ValueError(f"{p}:{k + 1}: {e}") from None
            if ids is None:
                continue
            items.append(PromptItem(rid, ids))
            n += 1
            if limit is not None and n >= limit:
                break
    return items


def read_distilled(path: str | os.PathLike) -> list[dict]:
    """The records of a distilled-data file (a torn last line from a crash is ignored)."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    with open(p, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out


def _variants(samples: int, temperature: float, seed: int) -> list[tuple[str, float, int | None]]:
    out: list[tuple[str, float, int | None]] = [("greedy", 0.0, None)]
    out += [(f"t{temperature:g}s{seed + i}", float(temperature), seed + i) for i in range(samples)]
    return out


def distill(engine, items: Iterable[PromptItem], out: str | os.PathLike, *, max_tokens: int = 256,
            samples: int = 0, temperature: float = 0.8, seed: int = 0, concurrency: int = 8,
            progress: bool = True) -> Path:
    """Generate the target's responses to ``items`` into ``out`` (resumable; see module doc)."""
    from ..drafting import default_drafter
    from ..backends.embedded.batch import BatchEngine

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a torn last line (crash mid-write) is cut off before appending
    done_keys = set()
    good = 0
    if out.exists():
        with open(out, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):   # a torn last line: cut, appended again
                    break
                try:
                    done_keys.add(json.loads(line)["key"])
                    good += len(line)
                except (json.JSONDecodeError, KeyError):
                    break
        with open(out, "r+b") as f:
            f.truncate(good)
    jobs = [(f"{it.id}|{len(it.ids)}|{name}", it, t, s) for it in items for name, t, s in _variants(samples, temperature, seed)]
    todo = [j for j in jobs if j[0] not in done_keys]
    total, t0, made = len(jobs), time.perf_counter(), 0
    bar = _Progress(total, len(jobs) - len(todo), enabled=progress)
    chunk = max(concurrency * 2, 1)
    with BatchEngine(engine, max_batch=concurrency, background=False) as be, open(out, "ab") as f:
        for c in range(0, len(todo), chunk):
            part = todo[c:c + chunk]
            gens = []
            for temp in sorted({j[2] for j in part}):
                sub = [j for j in part if j[2] == temp]
                # one drafter per group: greedy output is the target's whatever the drafts
                res = be.generate_many([j[1].ids for j in sub], per_prompt=[{"seed": j[3]} for j in sub],
                                       max_tokens=max_tokens, temperature=temp, drafter=default_drafter())
                gens += list(zip(sub, res))
            for (key, it, temp, s), g in gens:
                f.write((json.dumps({"key": key, "id": it.id, "temperature": temp, "seed": s,
                                     "prompt_ids": it.ids, "response_ids": g.token_ids}) + "\n").encode())
                made += len(g.token_ids)
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(part), made / max(time.perf_counter() - t0, 1e-9))
    bar.close()
    return out


class _Progress:
    """A progress bar on stderr (tqdm) with the generation rate; none when not ``enabled`` (not
    even tqdm's monitor thread)."""

    def __init__(self, total: int, initial: int, *, enabled: bool, desc: str = "distill") -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, initial=initial, desc=desc, unit="resp", file=sys.stderr) if enabled else None

    def update(self, n: int, rate: float) -> None:
        if self._bar is not None:
            self._bar.update(n)
            self._bar.set_postfix_str(f"{rate:.0f} tok/s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
