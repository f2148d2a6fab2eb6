"""Suffix index: drafting source over request contexts, tenant histories and documents.

``SuffixIndex`` (index.py) wraps the native core ``suffix_index._core`` (C++17, nanobind);
``reference.py`` is the plain-Python specification the core is tested against; ``atomic.py``
holds the crash-safe file writes that the index and agentspec share. ``SuffixIndex`` and
``MAX_TOKEN_ID`` load on first use (PEP 562), so ``suffix_index.atomic`` alone loads neither
numpy nor the native core.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .index import MAX_TOKEN_ID, Proposal, SuffixIndex

__all__ = ["MAX_TOKEN_ID", "Proposal", "SuffixIndex"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".index", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
