"""Prompt lookup: draft by copying what followed an earlier occurrence of the recent tokens.

The request's own context (prompt + generated tokens) is the only source. Among the earlier
occurrences of the last ``n`` tokens (``max_ngram`` down to ``min_ngram``), the one whose
preceding tokens agree longest with the current context wins; this acts as a copy pointer when
a response is rewriting text from its prompt, and re-synchronises after an edited region as
soon as ``min_ngram`` tokens agree again. Draft length grows with that agreement.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import EMPTY_DRAFT, Draft

__all__ = ["PromptLookupDrafter"]


class _Request:
    __slots__ = ("tokens", "index")

    def __init__(self, max_ngram: int):
        self.tokens: list[int] = []
        # index[n-1][ngram] -> positions just after each occurrence of that n-gram (ascending)
        self.index: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_ngram)]


class PromptLookupDrafter:
    """A linear drafter over the request's own context (the ``Drafter`` protocol)."""

    def __init__(
        self,
        *,
        min_ngram: int = 2,
        max_ngram: int = 4,
        max_candidates: int = 64,
        max_agreement: int = 64,
        min_draft: int = 4,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_candidates = max_candidates  # most recent occurrences compared per step
        self.max_agreement = max_agreement    # how far back agreement is measured
        self.min_draft = min_draft            # draft length for the weakest match
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
            best, best_agree = -1, -1
            checked = 0
            for pos in reversed(positions):
                if pos >= end:  # the occurrence that is the current suffix itself
                    continue
                agree = n
                limit = min(self.max_agreement, pos)
                while agree < limit and toks[pos - agree - 1] == toks[end - agree - 1]:
                    agree += 1
                if agree > best_agree:
                    best, best_agree = pos, agree
                checked += 1
                if checked >= self.max_candidates or agree >= self.max_agreement:
                    break
            if best < 0:
                continue
            length = min(budget, max(self.min_draft, 2 * best_agree), end - best)
            draft = toks[best:best + length]
            # survival estimate: longer agreement, higher confidence per token
            p = 1.0 - 1.0 / (2.0 + best_agree)
            return Draft.chain(draft, p, source="prompt_lookup")
        return EMPTY_DRAFT

    def stop(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def _get(self, req_id: str) -> _Request:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise ValueError(f"unknown request id {req_id!r}") from None
