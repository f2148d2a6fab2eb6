"""Drafters: everything that proposes draft trees for the verifier."""

from __future__ import annotations

from typing import Any

from .base import EMPTY_DRAFT, Draft, Drafter
from .prompt_lookup import PromptLookupDrafter

__all__ = ["EMPTY_DRAFT", "Draft", "Drafter", "PromptLookupDrafter", "default_drafter"]


def default_drafter(**overrides: Any) -> Drafter:
    """The drafter the engine uses unless told otherwise.

    For now: prompt lookup over the request's own context. Keyword overrides go to its
    constructor (``min_ngram``, ``max_ngram``, ...).
    """
    return PromptLookupDrafter(**overrides)
