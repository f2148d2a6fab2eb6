"""Drafters made of drafters: ``MergedDrafter`` (trees merged) and ``FallbackDrafter`` (a primary
and a fallback, the fallback's draft used, or merged in, when the primary's is weaker).

``merge_drafts`` is the merging both use: the same token under the same parent is one node, a
node's survival is the best any draft gave it, and the likeliest nodes are kept within the
budget, best first (so every prefix is a tree, as ``cut_for_cost`` needs). Each node keeps the
source of the draft that gave it that survival (``Draft.node_sources``), so acceptance is
counted by the drafter that earned the node.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Literal

from .draft import EMPTY_DRAFT, Draft, Drafter
from .protocols import hidden_wanted, propose_all, tell_output, wants_hidden_states

__all__ = ["FallbackDrafter", "MergedDrafter", "merge_drafts"]


def merge_drafts(drafts: Sequence[Draft], budget: int, *, source: str = "merged") -> Draft:
    """One tree from several drafts (each rooted at the last committed token), at most ``budget``
    nodes, named ``source``. Empty drafts are ignored; a single non-empty draft is returned as it
    is (cut to the budget). A merged node's own source (``Draft.source_of``) is that of the draft
    that gave it its best survival, the earliest such draft on ties (the primary's, in a
    ``FallbackDrafter``)."""
    drafts = [d for d in drafts if d.token_ids]
    if budget <= 0 or not drafts:
        return EMPTY_DRAFT
    if len(drafts) == 1:
        return drafts[0].prefix(budget)
    # merge: node key = (parent node, token); survival = best over drafts
    key_of: dict[tuple[int, int], int] = {}
    parent_of: list[int] = []
    tok_of: list[int] = []
    surv: list[float] = []
    src_of: list[str] = []
    for d in drafts:
        local: list[int] = []
        for i, (t, p, s) in enumerate(zip(d.token_ids, d.parents, d.survival())):
            par = local[p] if p >= 0 else -1
            node = key_of.get((par, t))
            if node is None:
                node = key_of[(par, t)] = len(tok_of)
                parent_of.append(par)
                tok_of.append(t)
                surv.append(s)
                src_of.append(d.source_of(i))
            elif s > surv[node]:
                surv[node] = s
                src_of[node] = d.source_of(i)
            local.append(node)
    # best first by survival, a node only after its parent (children join the heap then)
    kids: dict[int, list[int]] = {}
    for n, par in enumerate(parent_of):
        kids.setdefault(par, []).append(n)
    heap = [(-surv[n], n) for n in kids.get(-1, ())]
    heapq.heapify(heap)
    chosen: dict[int, int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
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
    return Draft(tokens, parents, probs, float(sum(surv[n] for n in chosen)), source, [src_of[n] for n in chosen])


class _Composite:
    """What a drafter made of drafters passes through to its parts: the hidden states a part
    asks for (``HiddenStateDrafter``: ``hidden_layers`` is the union of the parts', each part gets
    its own layers) and batched proposals (``BatchDrafter``: each part drafts the batch with
    ``propose_all``, so a batched draft model keeps one call per step)."""

    drafters: tuple[Drafter, ...]

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(sorted({i for d in self.drafters for i in wants_hidden_states(d)}))

    def wants_hidden_for(self, req_id: str) -> bool:
        return any(hidden_wanted(d, req_id) for d in self.drafters if wants_hidden_states(d))

    def observe_hidden(self, req_id: str, tokens: Sequence[int], hidden) -> None:
        for d in self.drafters:
            layers = wants_hidden_states(d)
            if layers:
                d.observe_hidden(req_id, tokens, {k: hidden[k] for k in layers})

    def output_format(self, req_id: str, output) -> None:
        for d in self.drafters:
            tell_output(d, req_id, output)

    def _stop_all(self, req_id: str) -> None:
        """Stop every part (all of them, even when one raises: the first error is re-raised)."""
        error: BaseException | None = None
        for d in self.drafters:
            try:
                d.stop(req_id)
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            raise error


class MergedDrafter(_Composite):
    """Several drafters as one: their trees merged, the likeliest nodes kept within the budget."""

    def __init__(self, *drafters: Drafter) -> None:
        if not drafters:
            raise ValueError("MergedDrafter needs at least one drafter")
        self.drafters = drafters

    def start(self, req_id: str, prompt: Sequence[int], *, tenant: str = "default") -> None:
        started: list[Drafter] = []
        try:
            for d in self.drafters:
                d.start(req_id, prompt, tenant=tenant)
                started.append(d)
        except BaseException:
            for d in started:   # all or nothing: a failed start leaves no half-open request
                d.stop(req_id)
            raise

    def extend(self, req_id: str, tokens: Sequence[int]) -> None:
        for d in self.drafters:
            d.extend(req_id, tokens)

    def stop(self, req_id: str) -> None:
        self._stop_all(req_id)

    def propose(self, req_id: str, budget: int) -> Draft:
        return merge_drafts([d.propose(req_id, budget) for d in self.drafters], budget)

    def propose_batch(self, req_ids: Sequence[str], budgets: Sequence[int]) -> list[Draft]:
        per_part = [propose_all(d, req_ids, budgets) for d in self.drafters]
        return [merge_drafts([drafts[i] for drafts in per_part], b) for i, b in enumerate(budgets)]


class FallbackDrafter(_Composite):
    """A primary drafter backed by a fallback, e.g. the suffix index backed by a draft model.

    Each step the primary proposes first. The fallback is asked when the primary's draft may not
    be good enough: always when ``min_expected`` is None, else only when the primary's expected
    accepted length (``Draft.expected()``: its ``score``, or the sum of its survival) is below
    ``min_expected`` (the fallback's cost is then paid only when the primary is unsure). Then:

    - ``mode="switch"``: the draft with the larger expected accepted length is returned (the
      primary's on ties), its ``source`` that drafter's own (or "primary" / "fallback" when the
      drafter set none);
    - ``mode="merge"``: both trees merged as siblings under the root within the budget
      (``merge_drafts``), ``source`` "<primary source>+<fallback source>", each node's own source
      the drafter's (or "primary" / "fallback").

    ``start`` / ``extend`` / ``stop`` go to both drafters, so the fallback's state (an n-gram
    pool, a draft model's KV cache) is current whenever it is asked.
    """

    def __init__(self, primary: Drafter, fallback: Drafter, *, mode: Literal["switch", "merge"] = "switch",
                 min_expected: float | None = None) -> None:
        if mode not in ("switch", "merge"):
            raise ValueError(f"FallbackDrafter mode must be 'switch' or 'merge', got {mode!r}")
        if min_expected is not None and (isinstance(min_expected, bool) or not isinstance(min_expected, (int, float))
                                         or min_expected < 0):
            raise ValueError(f"min_expected must be None or a number >= 0, got {min_expected!r}")
        self.primary, self.fallback = primary, fallback
        self.drafters = (primary, fallback)
        self.mode = mode
        self.min_expected = None if min_expected is None else float(min_expected)

    def start(self, req_id: str, prompt: Sequence[int], *, tenant: str = "default") -> None:
        self.primary.start(req_id, prompt, tenant=tenant)
        try:
            self.fallback.start(req_id, prompt, tenant=tenant)
        except BaseException:
            self.primary.stop(req_id)
            raise

    def extend(self, req_id: str, tokens: Sequence[int]) -> None:
        self.primary.extend(req_id, tokens)
        self.fallback.extend(req_id, tokens)

    def stop(self, req_id: str) -> None:
        self._stop_all(req_id)

    def _confident(self, p: Draft) -> bool:
        """The primary's draft is good enough that the fallback is not asked."""
        return self.min_expected is not None and bool(p.token_ids) and p.expected() >= self.min_expected

    def propose(self, req_id: str, budget: int) -> Draft:
        p = self.primary.propose(req_id, budget)
        if self._confident(p):
            return p
        return self._choose(p, self.fallback.propose(req_id, budget), budget)

    def propose_batch(self, req_ids: Sequence[str], budgets: Sequence[int]) -> list[Draft]:
        out = propose_all(self.primary, req_ids, budgets)
        ask = [i for i, p in enumerate(out) if not self._confident(p)]
        if ask:
            fb = propose_all(self.fallback, [req_ids[i] for i in ask], [budgets[i] for i in ask])
            for i, f in zip(ask, fb):
                out[i] = self._choose(out[i], f, budgets[i])
        return out

    def _choose(self, p: Draft, f: Draft, budget: int) -> Draft:
        if not f.token_ids:
            return p
        if not p.token_ids:
            return _labelled(f, "fallback")
        if self.mode == "merge":
            p, f = _labelled(p, "primary"), _labelled(f, "fallback")
            return merge_drafts([p, f], budget, source=f"{p.source}+{f.source}")
        if f.expected() > p.expected():
            return _labelled(f, "fallback")
        return _labelled(p, "primary")


def _labelled(d: Draft, default: str) -> Draft:
    """``d`` named ``default`` when its drafter set no source (its node sources, if any, kept)."""
    if d.source:
        return d
    return Draft(d.token_ids, d.parents, d.probs, d.score, default, d.node_sources)
