"""Drafters: everything that proposes draft trees for the verifier.

``draft`` (the ``Draft`` tree, the ``Drafter`` protocol, budget helpers), ``combine``
(``MergedDrafter``, ``FallbackDrafter``), ``protocols`` (optional capabilities for draft models
and batch drafting) and ``registry`` (drafter names -> factories, ``build_drafter``) are light
(stdlib + msgspec) and imported here; the drafters themselves load on first use (PEP 562), so
``import agentspec.drafting`` pulls neither numpy nor the native suffix index.
"""

from __future__ import annotations

from .._lazy import lazy_exports
from typing import TYPE_CHECKING, Any

from .combine import FallbackDrafter, MergedDrafter, merge_drafts
from .draft import EMPTY_DRAFT, AcceptanceTracker, Draft, Drafter, cut_for_cost, drop_unlikely, trie_draft
from .protocols import BatchDrafter, HiddenStateDrafter, propose_all, wants_hidden_states
from .registry import DEFAULT_DRAFTERS, build_drafter, drafter_names, register

if TYPE_CHECKING:
    from .lookahead import LookaheadDrafter
    from .prompt_lookup import PromptLookupDrafter
    from .suffix import SuffixDrafter

__all__ = ["DEFAULT_DRAFTERS", "EMPTY_DRAFT", "AcceptanceTracker", "BatchDrafter", "Draft", "Drafter",
           "FallbackDrafter", "HiddenStateDrafter", "LookaheadDrafter", "MergedDrafter", "PromptLookupDrafter",
           "SuffixDrafter", "build_drafter", "cut_for_cost", "default_drafter", "drafter_names", "drop_unlikely",
           "merge_drafts", "propose_all", "register", "trie_draft", "wants_hidden_states"]

_LAZY = {"LookaheadDrafter": ".lookahead", "PromptLookupDrafter": ".prompt_lookup", "SuffixDrafter": ".suffix"}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)


def default_drafter(*, workspace: Any = None, **overrides: Any) -> Drafter:
    """The drafter the engine uses unless told otherwise: the suffix drafter.

    It measured best on recorded traffic (benchmarks/replay.py): merging a lookahead n-gram
    pool into it (``MergedDrafter(SuffixDrafter(), LookaheadDrafter())``) added under 0.2% to
    the mean accepted length on rewrites and agent turns at ~10x the drafting time, because the
    index already holds the request's generated tokens and the tenant's outputs.

    Each request drafts from its own context, its tenant's earlier outputs and, with
    ``workspace`` (an object with an ``index`` attribute holding a ``SuffixIndex``, as the
    workspace indexer provides), the tenant's workspace documents. Keyword overrides are
    ``SuffixIndex`` options (``max_ngram``, ``max_branches``, ``history_tokens``, ...); they
    cannot be combined with a workspace, whose index is already built.
    """
    from .suffix import SuffixDrafter

    if workspace is not None:
        index = getattr(workspace, "index", None)
        if index is None:
            raise ValueError(f"workspace must have an `index` (a SuffixIndex), got {type(workspace).__name__}")
        return SuffixDrafter(index, **overrides)
    return SuffixDrafter(**overrides)
