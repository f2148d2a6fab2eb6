"""Lookahead n-gram pool, and a drafter that merges several drafters' trees into one.

``LookaheadDrafter`` keeps the n-grams a request has generated (and its tenant's recent
outputs) in a pool keyed by their first ``key`` tokens, like lookahead decoding's n-gram pool
(without the Jacobi iterations, which need the model): when the context ends with a key, the
pool's recent continuations become a draft tree. ``MergedDrafter`` runs several drafters and
merges their trees (same token under the same parent is one node; a node's probability is the
best any drafter gave it), keeping the likeliest nodes within the budget.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from .base import EMPTY_DRAFT, Draft, Drafter, trie_draft

__all__ = ["LookaheadDrafter", "MergedDrafter"]


class _Pool:
    __slots__ = ("grams", "cap")

    def __init__(self, cap: int):
        self.grams: dict[tuple[int, ...], deque[tuple[int, ...]]] = {}
        self.cap = cap

    def add(self, key: tuple[int, ...], gram: tuple[int, ...], per_key: int) -> None:
        q = self.grams.get(key)
        if q is None:
            if len(self.grams) >= self.cap:  # forget the oldest key
                self.grams.pop(next(iter(self.grams)))
            q = self.grams[key] = deque(maxlen=per_key)
        if gram in q:
            q.remove(gram)
        q.appendleft(gram)


class LookaheadDrafter:
    """Draft from n-grams seen in generated text: the request's own output and its tenant's
    recent outputs (``tenant_tokens`` most recent tokens), keyed by ``key`` tokens, each
    continuation up to ``gram`` tokens, the ``per_key`` most recent per key."""

    def __init__(self, *, key: int = 2, gram: int = 8, per_key: int = 8, tenant_tokens: int = 1 << 16,
                 max_keys: int = 1 << 18) -> None:
        if key < 1 or gram < 1 or per_key < 1:
            raise ValueError(f"key, gram and per_key must be >= 1, got {key}, {gram}, {per_key}")
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
            shared = self._tenant_pools[tenant] = _Pool(self.max_keys)
        for key, grams in pool.grams.items():
            for gram in reversed(grams):
                shared.add(key, gram, self.per_key)

    def _get(self, req_id: str):
        try:
            return self._reqs[req_id]
        except KeyError:
            raise ValueError(f"unknown request id {req_id!r}") from None


class MergedDrafter:
    """Several drafters as one: their trees merged, the likeliest nodes kept within the budget."""

    def __init__(self, *drafters: Drafter) -> None:
        if not drafters:
            raise ValueError("MergedDrafter needs at least one drafter")
        self.drafters = drafters

    def start(self, req_id: str, prompt: Sequence[int], *, tenant: str = "default") -> None:
        for d in self.drafters:
            d.start(req_id, prompt, tenant=tenant)

    def extend(self, req_id: str, tokens: Sequence[int]) -> None:
        for d in self.drafters:
            d.extend(req_id, tokens)

    def stop(self, req_id: str) -> None:
        for d in self.drafters:
            d.stop(req_id)

    def propose(self, req_id: str, budget: int) -> Draft:
        drafts = [d.propose(req_id, budget) for d in self.drafters]
        drafts = [d for d in drafts if d.token_ids]
        if len(drafts) <= 1:
            return drafts[0] if drafts else EMPTY_DRAFT
        # merge: node key = (parent node, token); survival = best over drafters
        key_of: dict[tuple[int, int], int] = {}
        parent_of: list[int] = []
        tok_of: list[int] = []
        surv: list[float] = []
        for d in drafts:
            local: list[int] = []
            s_local: list[float] = []
            for i, (t, p, q) in enumerate(zip(d.token_ids, d.parents, d.probs)):
                par = local[p] if p >= 0 else -1
                s = q * (s_local[p] if p >= 0 else 1.0)
                s_local.append(s)
                node = key_of.get((par, t))
                if node is None:
                    node = key_of[(par, t)] = len(tok_of)
                    parent_of.append(par)
                    tok_of.append(t)
                    surv.append(s)
                else:
                    surv[node] = max(surv[node], s)
                local.append(node)
        # best first by survival, a node only after its parent (children join the heap then)
        kids: dict[int, list[int]] = {}
        for n, par in enumerate(parent_of):
            kids.setdefault(par, []).append(n)
        heap = [(-surv[n], n) for n in kids.get(-1, ())]
        heapq.heapify(heap)
        chosen: dict[int, int] = {}
        tokens, parents, probs = [], [], []
        while heap and len(tokens) < budget:
            _, n = heapq.heappop(heap)
            par = parent_of[n]
            chosen[n] = len(tokens)
            tokens.append(tok_of[n])
            parents.append(chosen[par] if par >= 0 else -1)
            ps = surv[par] if par >= 0 else 1.0
            probs.append(min(1.0, surv[n] / ps) if ps > 0 else 0.0)
            for c in kids.get(n, ()):
                heapq.heappush(heap, (-surv[c], c))
        return Draft(tokens, parents, probs, float(sum(surv[n] for n in chosen)), "merged")
