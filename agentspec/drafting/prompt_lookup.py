"""Prompt lookup: draft by copying what followed earlier occurrences of the recent tokens.

The request's own context (prompt + generated tokens) is the only source. The earlier
occurrences of the last ``n`` tokens (``max_ngram`` down to ``min_ngram``) are ranked by how
far their preceding tokens agree with the current context: the best acts as a copy pointer when
a response rewrites text from its prompt, and drafting re-synchronises after an edited region as
soon as ``min_ngram`` tokens agree again. The best candidates' continuations are merged into a
draft tree; its depth grows with the agreement.
"""

from __future__ import annotations

from collections.abc import Sequence

from .draft import EMPTY_DRAFT, Draft, trie_draft

__all__ = ["PromptLookupDrafter"]


class _Request:
    __slots__ = ("tokens", "index")

    def __init__(self, max_ngram: int):
        self.tokens: list[int] = []
        # index[n-1][ngram] -> positions just after each occurrence of that n-gram (ascending)
        self.index: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_ngram)]


class PromptLookupDrafter:
    """A tree drafter over the request's own context (the ``Drafter`` protocol)."""

    def __init__(
        self,
        *,
        min_ngram: int = 1,
        max_ngram: int = 4,
        max_candidates: int = 64,
        max_agreement: int = 64,
        min_draft: int = 8,
        max_branches: int = 8,
        min_survival: float = 0.05,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_candidates = max_candidates  # most recent occurrences compared per step
        self.max_agreement = max_agreement    # how far back agreement is measured
        self.min_draft = min_draft            # draft depth for the weakest match
        self.max_branches = max_branches      # candidate continuations merged into the tree
        self.min_survival = min_survival      # drop draft tokens less likely than this
        self._reqs: dict[str, _Request] = {}

    def start(self, req_id: str, prompt: Sequence[int], *, tenant: str = "default") -> None:
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} already started")
        self._reqs[req_id] = _Request(self.max_ngram)
        self.extend(req_id, prompt)

    def extend(self, req_id: str, tokens: Sequence[int]) -> None:
        r = self._get(req_id)
        toks = r.tokens
        for t in tokens:
            toks.append(int(t))
            end = len(toks)
            for n in range(1, self.max_ngram + 1):
                if end >= n:
                    # the n-gram ending at `end` is followed by position `end`
                    r.index[n - 1].setdefault(tuple(toks[end - n:end]), []).append(end)

    def propose(self, req_id: str, budget: int) -> Draft:
        r = self._get(req_id)
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        toks = r.tokens
        end = len(toks)
        if budget == 0 or end < self.min_ngram:
            return EMPTY_DRAFT
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            positions = r.index[n - 1].get(tuple(toks[end - n:]))
            if not positions:
                continue
            cands: list[tuple[int, int]] = []  # (agreement, position)
            for pos in reversed(positions):
                if pos >= end:  # the occurrence that is the current suffix itself
                    continue
                agree = n
                limit = min(self.max_agreement, pos)
                while agree < limit and toks[pos - agree - 1] == toks[end - agree - 1]:
                    agree += 1
                cands.append((agree, pos))
                if len(cands) >= self.max_candidates:
                    break
            if cands:
                return self._tree(toks, cands, budget)
        return EMPTY_DRAFT

    def _tree(self, toks: list[int], cands: list[tuple[int, int]], budget: int) -> Draft:
        """Merge the continuations of the best candidates into a trie; keep the likeliest nodes.

        A candidate weighs more the longer its agreement (recency breaks ties, earlier in
        ``cands`` = more recent). A node's probability given its parent is the share of its
        parent's candidate weight that passes through it, times a per-token confidence that
        grows with the best agreement; nodes are taken best-first by survival (the product
        along the path) until the budget or ``min_survival``.
        """
        cands.sort(key=lambda c: -c[0])  # stable: more recent first among equal agreement
        cands = cands[: self.max_branches]
        best_agree = cands[0][0]
        conf = 1.0 - 1.0 / (2.0 + best_agree)
        depth_cap = min(budget, max(self.min_draft, 2 * best_agree))
        end = len(toks)
        return trie_draft([(float(agree * agree), toks[pos:min(pos + depth_cap, end)]) for agree, pos in cands],
                          conf=conf, budget=budget, min_survival=self.min_survival, source="prompt_lookup")

    def stop(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def _get(self, req_id: str) -> _Request:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise ValueError(f"unknown request id {req_id!r}") from None
