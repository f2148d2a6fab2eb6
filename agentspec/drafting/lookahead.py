"""Lookahead n-gram pool: a drafter from the n-grams a request and its tenant generated.

``LookaheadDrafter`` keeps the n-grams a request has generated (and its tenant's recent
outputs) in a pool keyed by their first ``key`` tokens, like lookahead decoding's n-gram pool
(without the Jacobi iterations, which need the model): when the context ends with a key, the
pool's recent continuations become a draft tree. ``MergedDrafter`` (combine.py) merges its
trees with other drafters'.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from .draft import EMPTY_DRAFT, Draft, trie_draft

__all__ = ["LookaheadDrafter"]


class _Pool:
    """Continuations by key, the most recently added key last (evicted oldest first): at most
    ``cap`` keys and, when ``max_tokens`` is set, at most that many continuation tokens."""

    __slots__ = ("grams", "cap", "max_tokens", "tokens")

    def __init__(self, cap: int, max_tokens: int | None = None):
        self.grams: dict[tuple[int, ...], deque[tuple[int, ...]]] = {}
        self.cap = cap
        self.max_tokens = max_tokens
        self.tokens = 0   # continuation tokens held (sum of len(gram) over every key's grams)

    def add(self, key: tuple[int, ...], gram: tuple[int, ...], per_key: int) -> None:
        q = self.grams.pop(key, None)   # re-inserted below: the most recent key
        if q is None:
            q = deque(maxlen=per_key)
        elif gram in q:
            q.remove(gram)
            self.tokens -= len(gram)
        elif len(q) == q.maxlen:   # appendleft drops the oldest on the right
            self.tokens -= len(q[-1])
        q.appendleft(gram)
        self.tokens += len(gram)
        self.grams[key] = q
        while self.grams and (len(self.grams) > self.cap
                              or (self.max_tokens is not None and self.tokens > self.max_tokens)):
            self.tokens -= sum(len(g) for g in self.grams.pop(next(iter(self.grams))))   # the oldest key


class LookaheadDrafter:
    """Draft from n-grams seen in generated text: the request's own output and its tenant's
    recent outputs, keyed by ``key`` tokens, each continuation up to ``gram`` tokens, the
    ``per_key`` most recent per key. A tenant's pool holds at most ``tenant_tokens``
    continuation tokens and a pool at most ``max_keys`` keys; past either, the keys added to
    least recently go first."""

    def __init__(self, *, key: int = 2, gram: int = 8, per_key: int = 8, tenant_tokens: int = 1 << 16,
                 max_keys: int = 1 << 18) -> None:
        if key < 1 or gram < 1 or per_key < 1:
            raise ValueError(f"key, gram and per_key must be >= 1, got {key}, {gram}, {per_key}")
        if tenant_tokens < 1 or max_keys < 1:
            raise ValueError(f"tenant_tokens and max_keys must be >= 1, got {tenant_tokens}, {max_keys}")
        self.key, self.gram, self.per_key = key, gram, per_key
        self.tenant_tokens, self.max_keys = tenant_tokens, max_keys
        self._reqs: dict[str, tuple[str, list[int], int]] = {}   # req -> (tenant, tokens, prompt length)
        self._tenant_pools: OrderedDict[str, _Pool] = OrderedDict()
        self._req_pools: dict[str, _Pool] = {}

    def start(self, req_id: str, prompt: Sequence[int], *, tenant: str = "default") -> None:
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} already started")
        toks = [int(t) for t in np.asarray(prompt).reshape(-1)[-(self.key + self.gram):]]
        self._reqs[req_id] = (tenant, toks, len(toks))
        self._req_pools[req_id] = _Pool(self.max_keys)

    def extend(self, req_id: str, tokens: Sequence[int]) -> None:
        tenant, toks, plen = self._get(req_id)
        pool = self._req_pools[req_id]
        k, g = self.key, self.gram
        for t in tokens:
            toks.append(int(t))
            # the n-gram that now has its full continuation: key ends g tokens back
            end = len(toks) - g
            if end - k >= 0 and end > plen - 1:
                pool.add(tuple(toks[end - k:end]), tuple(toks[end:end + g]), self.per_key)

    def propose(self, req_id: str, budget: int) -> Draft:
        tenant, toks, _ = self._get(req_id)
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if budget == 0 or len(toks) < self.key:
            return EMPTY_DRAFT
        key = tuple(toks[-self.key:])
        grams: list[tuple[int, ...]] = []
        for pool in (self._req_pools[req_id], self._tenant_pools.get(tenant)):
            if pool is not None:
                grams.extend(pool.grams.get(key, ()))
        if not grams:
            return EMPTY_DRAFT
        # each continuation weighted by its recency rank
        return trie_draft([(1.0 / (1 + rank), gram) for rank, gram in enumerate(grams)],
                          conf=0.6, budget=budget, min_survival=0.01, source="lookahead")

    def stop(self, req_id: str) -> None:
        tenant, toks, plen = self._get(req_id)
        pool = self._req_pools.pop(req_id)
        del self._reqs[req_id]
        shared = self._tenant_pools.get(tenant)
        if shared is None:
            shared = self._tenant_pools[tenant] = _Pool(self.max_keys, self.tenant_tokens)
        for key, grams in pool.grams.items():
            for gram in reversed(grams):
                shared.add(key, gram, self.per_key)

    def _get(self, req_id: str):
        try:
            return self._reqs[req_id]
        except KeyError:
            raise ValueError(f"unknown request id {req_id!r}") from None
