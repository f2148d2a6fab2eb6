"""Plain-Python reference of the suffix index: the specification the native core must agree with.

Slow and simple on purpose: no hashing tricks, no caches that could change a result. The native
core (``suffix_index._core``) implements the same algorithm with hash chains and per-request
match state; ``tests/unit/test_suffix_index.py`` checks, on random token streams with edits, that
both give the same candidates (longest match, agreements), the same counts and the same drafts.

Model
-----
Token streams ("texts") live in two kinds of places:

- a **request** holds its own context: the prompt, then every committed token;
- a **tenant** holds an arena of finished texts: the outputs of its earlier requests (history,
  oldest evicted first beyond ``history_tokens``) and documents (added / replaced / removed by
  id). Texts are separated by a sentinel so that no match crosses from one into the next.
  Removing a text overwrites it with sentinels; the arena is compacted when more than half of it
  is dead (positions move, so requests of that tenant forget their arena candidates).

A request only ever sees its own context and its tenant's arena (tenant isolation).

Matching
--------
A *candidate* is a place in a source whose preceding tokens agree with the end of the request's
context: ``(source, pos, agree)`` where ``pos`` is where its continuation starts and ``agree``
how many tokens before it equal the context's last tokens (at most ``max_agreement``).

At ``propose``: the request's *live* candidates (kept from the previous step, each advanced by
one per committed token that matched its continuation, dropped at the first that did not) are
joined by the occurrences of the context's last ``n`` tokens (in the arena: those followed by
at least one token) for ``n`` from ``max_ngram`` down to
``min_ngram``: the ``max_candidates`` most recent in the request, then the ``max_candidates`` most
recent in the tenant arena; the search ends at the first ``n`` after which there are at least
``min_candidates`` candidates (shorter matches add alternatives when long ones are few). A new
candidate's agreement is measured by comparing backwards once; live candidates carry theirs.
Candidates are ranked by agreement, then request before arena, then the more recent; the best
``max_candidates`` stay live for the next step, and the best ``max_branches`` make the draft.

Drafting
--------
The continuations of the chosen candidates (up to ``depth = min(budget, max(min_draft,
2 * best_agree))`` tokens, stopping at the end of a source text) are merged into a trie in which
each candidate carries weight ``agree ** 2`` (arena candidates times ``arena_weight``). A node's
probability given its parent is ``conf * weight(node) / weight(parent)`` with ``conf = 1 - 1 / (2
+ best_agree)``: long, confident matches earn long drafts. Nodes are taken best-first by survival
(the product along the path; ties to the node created first) until ``budget`` nodes or survival
below ``min_survival``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

SEP = -1  # sentinel between texts in an arena (never a valid token id)
REQ, ARENA = 0, 1


@dataclass
class _Text:
    kind: str        # "history" or "doc"
    key: str         # doc id, or a history serial
    start: int       # position of its first token in the arena
    length: int


@dataclass
class _Tenant:
    arena: list[int] = field(default_factory=list)
    texts: dict[str, _Text] = field(default_factory=dict)   # insertion order = age
    dead: int = 0
    history: int = 0      # live history tokens
    serial: int = 0
    epoch: int = 0        # bumped when arena positions move (compaction)


@dataclass
class _Request:
    tenant: str
    tokens: list[int]
    prompt_len: int
    live: list[tuple[int, int, int]] = field(default_factory=list)   # (source, pos, agree)
    epoch: int = 0


@dataclass(frozen=True)
class Params:
    min_ngram: int = 1
    max_ngram: int = 4
    max_candidates: int = 16
    min_candidates: int = 8         # back off to shorter n until this many candidates
    max_agreement: int = 64
    max_branches: int = 16
    min_draft: int = 8
    min_survival: float = 0.01
    arena_weight: float = 1.0
    history_tokens: int = 1 << 20   # per tenant; oldest outputs are evicted beyond it
    keep_outputs: bool = True       # add a finished request's output to its tenant's history


class ReferenceIndex:
    def __init__(self, **params) -> None:
        self.p = Params(**params)
        self.tenants: dict[str, _Tenant] = {}
        self.reqs: dict[str, _Request] = {}
        self.doc_tenant: dict[str, str] = {}

    # ---- requests ---------------------------------------------------------------------------

    def start(self, req_id: str, prompt: list[int], tenant: str) -> None:
        t = self._tenant(tenant)
        self.reqs[req_id] = _Request(tenant, list(prompt), len(prompt), epoch=t.epoch)

    def extend(self, req_id: str, tokens: list[int]) -> None:
        r = self.reqs[req_id]
        t = self.tenants[r.tenant]
        self._sync(r, t)
        for tok in tokens:
            nxt = []
            for src, pos, agree in r.live:
                text = r.tokens if src == REQ else t.arena
                if pos < len(text) and text[pos] == tok:
                    nxt.append((src, pos + 1, min(agree + 1, self.p.max_agreement)))
            r.live = nxt
            r.tokens.append(tok)

    def stop(self, req_id: str) -> None:
        r = self.reqs.pop(req_id)
        if self.p.keep_outputs and len(r.tokens) > r.prompt_len:
            t = self.tenants[r.tenant]
            t.serial += 1
            self._add_text(t, "history", f"\x00h{t.serial}", r.tokens[r.prompt_len:])
            self._evict_history(t)

    def candidates(self, req_id: str) -> list[tuple[int, int, int]]:
        """All candidates of this step, best first (and the live set becomes the best ones)."""
        p = self.p
        r = self.reqs[req_id]
        t = self.tenants[r.tenant]
        self._sync(r, t)
        ctx = r.tokens
        end = len(ctx)
        cands = {(s, pos): agree for s, pos, agree in r.live}
        for n in range(min(p.max_ngram, end), p.min_ngram - 1, -1):
            key = ctx[end - n:]
            for src, text, limit in ((REQ, ctx, end - 1), (ARENA, t.arena, len(t.arena))):
                found = 0
                # occurrences ending at e (continuation at e), most recent first; in the request
                # the suffix itself (e == end) does not count
                for e in range(limit, n - 1, -1):
                    if found == p.max_candidates:
                        break
                    if text[e - n:e] == key and (src == REQ or text[e] != SEP):
                        found += 1
                        if (src, e) not in cands:
                            cands[(src, e)] = self._agreement(ctx, text, e, n)
            if len(cands) >= max(1, p.min_candidates):
                break
        ranked = sorted(((s, pos, a) for (s, pos), a in cands.items()), key=lambda c: (-c[2], c[0], -c[1]))
        r.live = ranked[: p.max_candidates]
        return ranked

    def propose(self, req_id: str, budget: int) -> tuple[list[int], list[int], list[float], float]:
        if budget == 0:
            return [], [], [], 0.0
        ranked = self.candidates(req_id)
        if not ranked:
            return [], [], [], 0.0
        r = self.reqs[req_id]
        return self._tree(r.tokens, self.tenants[r.tenant].arena, ranked[: self.p.max_branches], budget)

    # ---- documents --------------------------------------------------------------------------

    def add_document(self, doc_id: str, tokens: list[int], tenant: str) -> None:
        if doc_id in self.doc_tenant:
            self.remove_document(doc_id)
        t = self._tenant(tenant)
        self._add_text(t, "doc", doc_id, list(tokens))
        self.doc_tenant[doc_id] = tenant

    def remove_document(self, doc_id: str) -> bool:
        tenant = self.doc_tenant.pop(doc_id, None)
        if tenant is None:
            return False
        t = self.tenants[tenant]
        self._kill(t, t.texts.pop(doc_id))
        self._maybe_compact(t)
        return True

    # ---- internals --------------------------------------------------------------------------

    def _tenant(self, name: str) -> _Tenant:
        t = self.tenants.get(name)
        if t is None:
            t = self.tenants[name] = _Tenant()
        return t

    def _sync(self, r: _Request, t: _Tenant) -> None:
        if r.epoch != t.epoch:  # arena positions moved: forget arena candidates
            r.live = [c for c in r.live if c[0] == REQ]
            r.epoch = t.epoch

    def _agreement(self, ctx: list[int], text: list[int], e: int, n: int) -> int:
        a = n
        end = len(ctx)
        while a < self.p.max_agreement and e - a - 1 >= 0 and end - a - 1 >= 0:
            x = text[e - a - 1]
            if x == SEP or x != ctx[end - a - 1]:
                break
            a += 1
        return min(a, self.p.max_agreement)

    def _add_text(self, t: _Tenant, kind: str, key: str, tokens: list[int]) -> None:
        t.texts[key] = _Text(kind, key, len(t.arena), len(tokens))
        t.arena.extend(tokens)
        t.arena.append(SEP)
        if kind == "history":
            t.history += len(tokens)

    def _kill(self, t: _Tenant, text: _Text) -> None:
        for i in range(text.start, text.start + text.length + 1):
            t.arena[i] = SEP
        t.dead += text.length + 1
        if text.kind == "history":
            t.history -= text.length

    def _evict_history(self, t: _Tenant) -> None:
        while t.history > self.p.history_tokens:
            oldest = next(k for k, x in t.texts.items() if x.kind == "history")
            self._kill(t, t.texts.pop(oldest))
        self._maybe_compact(t)

    def _maybe_compact(self, t: _Tenant) -> None:
        if t.dead * 2 <= len(t.arena):
            return
        arena: list[int] = []
        for x in t.texts.values():
            toks = t.arena[x.start:x.start + x.length]
            x.start = len(arena)
            arena.extend(toks)
            arena.append(SEP)
        t.arena, t.dead = arena, 0
        t.epoch += 1

    def _tree(self, ctx, arena, cands, budget):
        p = self.p
        best = cands[0][2]
        conf = 1.0 - 1.0 / (2.0 + best)
        depth = min(budget, max(p.min_draft, 2 * best))
        children: list[dict[int, int]] = [{}]
        weight = [0.0]
        tok_of = [-1]
        parent_of = [-1]
        for src, pos, agree in cands:
            w = float(agree * agree) * (p.arena_weight if src == ARENA else 1.0)
            text = ctx if src == REQ else arena
            node = 0
            weight[0] += w
            for i in range(pos, min(pos + depth, len(text))):
                tok = text[i]
                if tok == SEP:
                    break
                nxt = children[node].get(tok)
                if nxt is None:
                    nxt = len(tok_of)
                    children[node][tok] = nxt
                    children.append({})
                    weight.append(0.0)
                    tok_of.append(tok)
                    parent_of.append(node)
                weight[nxt] += w
                node = nxt
        heap = [(-(conf * (weight[c] / weight[0])), c) for c in children[0].values()]
        heapq.heapify(heap)
        index_of = {0: -1}
        survival = {0: 1.0}
        tokens, parents, probs = [], [], []
        score = 0.0
        while heap and len(tokens) < budget:
            neg, node = heapq.heappop(heap)
            s = -neg
            if s < p.min_survival:
                break
            index_of[node] = len(tokens)
            tokens.append(tok_of[node])
            parents.append(index_of[parent_of[node]])
            probs.append(conf * (weight[node] / weight[parent_of[node]]))
            survival[node] = s
            score += s
            for c in children[node].values():
                heapq.heappush(heap, (-(s * (conf * (weight[c] / weight[node]))), c))
        return tokens, parents, probs, score
