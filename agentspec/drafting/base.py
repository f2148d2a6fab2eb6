"""The drafter role: one protocol, one draft shape (a tree), shared by every drafting method.

Everything lives in the leaf module ``agentspec.drafting.draft`` (stdlib + msgspec only); this
module re-exports it so existing ``from agentspec.drafting.base import ...`` keep working.
"""

from __future__ import annotations

from .draft import (EMPTY_DRAFT, AcceptanceTracker, Draft, Drafter, cut_for_cost, drop_unlikely,
                    trie_draft)

__all__ = ["AcceptanceTracker", "Draft", "Drafter", "EMPTY_DRAFT", "cut_for_cost", "drop_unlikely", "trie_draft"]
