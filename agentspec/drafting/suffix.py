"""The suffix drafter: drafts from the native suffix index (``suffix_index.SuffixIndex``).

One index serves every request of an engine: each request drafts from its own context (prompt
+ committed tokens), its tenant's earlier outputs and its tenant's documents (a workspace feeds
those); see suffix_index/reference.py for the algorithm. The index knows nothing of agentspec:
it returns a plain ``Proposal`` tuple, which ``propose`` turns into a ``Draft``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .draft import Draft

__all__ = ["SuffixDrafter"]


class SuffixDrafter:
    """A ``Drafter`` on a ``SuffixIndex``. Give it an index to share one (e.g. a workspace's),
    or index options to build its own."""

    def __init__(self, index: Any = None, **index_options: Any) -> None:
        from suffix_index import SuffixIndex

        if index is not None and index_options:
            raise ValueError(f"pass either an index or index options, not both (got {sorted(index_options)})")
        self.index = index if index is not None else SuffixIndex(**index_options)

    def start(self, req_id: str, prompt: Sequence[int], *, tenant: str = "default") -> None:
        self.index.start(req_id, prompt, tenant=tenant)

    def extend(self, req_id: str, tokens: Sequence[int]) -> None:
        self.index.extend(req_id, tokens)

    def propose(self, req_id: str, budget: int) -> Draft:
        token_ids, parents, probs, score = self.index.propose(req_id, budget)
        return Draft(token_ids, parents, probs, score, "suffix")

    def stop(self, req_id: str) -> None:
        self.index.stop(req_id)
