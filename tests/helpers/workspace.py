"""Probes of a suffix index's drafts (what a workspace put in it) and a hang guard for waits."""

from __future__ import annotations

import time

__all__ = ["continues", "draft_for", "drafts_of", "tree_accepts", "until"]


def until(cond, timeout: float = 60.0) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` passes (False): a hang guard for the
    watcher, which applies file events some time after the write; never a time bound."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def draft_for(index, tokenizer, prefix: str, tenant: str = "default", budget: int = 32):
    """The draft tree the index proposes for a request whose context ends with ``prefix``."""
    rid = f"probe-{time.monotonic_ns()}"
    index.start(rid, tokenizer.encode(prefix), tenant=tenant)
    try:
        return index.propose(rid, budget)
    finally:
        index.stop(rid)


def drafts_of(index, tokenizer, prefix: str, tenant: str = "default") -> list[int]:
    """Every token the index drafts for ``prefix``."""
    return draft_for(index, tokenizer, prefix, tenant).token_ids


def tree_accepts(draft, want) -> int:
    """How many tokens of ``want`` the draft tree holds as a root path."""
    node, depth = -1, 0
    while depth < len(want):
        nxt = next((i for i, (t, p) in enumerate(zip(draft.token_ids, draft.parents))
                    if p == node and t == want[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def continues(index, tokenizer, prefix: str, expected: str, tenant: str = "default") -> bool:
    """Is the start of ``expected`` a path of the draft tree? (Prefixes end mid-line: a prefix
    ending in a newline tokenizes differently from the same text followed by an indent.)"""
    want = tokenizer.encode(prefix + expected)[len(tokenizer.encode(prefix)):][:6]
    return tree_accepts(draft_for(index, tokenizer, prefix, tenant), want) == len(want)
