"""Deprecated alias of ``agentspec.drafting.draft`` (import from there).

Nothing in agentspec, its tests or integrations imports this any more; it stays only while
``benchmarks/replay.py`` and ``benchmarks/bench_index.py`` still do: delete it once they import
from ``agentspec.drafting.draft``.
"""

from __future__ import annotations

from .draft import (EMPTY_DRAFT, AcceptanceTracker, Draft, Drafter, cut_for_cost, drop_unlikely,
                    trie_draft)

__all__ = ["AcceptanceTracker", "Draft", "Drafter", "EMPTY_DRAFT", "cut_for_cost", "drop_unlikely", "trie_draft"]
