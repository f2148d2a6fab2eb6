"""The draft shape (a tree) and the drafter protocol, shared by every drafting method.

A leaf module: it imports only the standard library and msgspec, so the config, the budget policy
and anything else can use ``Draft`` without loading numpy, torch or the native kernels.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import msgspec

__all__ = ["AcceptanceTracker", "Draft", "Drafter", "EMPTY_DRAFT", "accepted_in_tree", "common_prefix", "cut_for_cost", "drop_unlikely",
           "trie_draft"]


class Draft(msgspec.Struct, frozen=True):
    """A draft tree. A linear draft has parents ``[-1, 0, 1, ...]``.

    ``parents[i]`` is the index of token i's parent in ``token_ids`` (always < i), or -1 for the
    last committed token. ``probs[i]`` is the drafter's confidence that token i survives given
    its parent survived; a token's survival estimate is the product along its path.

    ``source`` names the drafter of the whole draft. A draft merged from several drafters
    (``merge_drafts``) also names each node's own drafter in ``node_sources``, so the engine
    counts drafted and accepted tokens by the drafter that proposed them; None (one drafter)
    means every node's source is ``source``. ``source_of(i)`` reads either.
    """

    token_ids: list[int]
    parents: list[int]
    probs: list[float]
    score: float = 0.0   # expected accepted tokens (sum of survival estimates)
    source: str = ""     # the drafter: "suffix", "prompt_lookup", "lookahead", "eagle3"; merged: "suffix+eagle3"
    node_sources: list[str] | None = None  # per node, when nodes came from different drafters

    def __len__(self) -> int:
        return len(self.token_ids)

    def source_of(self, i: int) -> str:
        """The drafter that proposed node ``i``."""
        return self.source if self.node_sources is None else self.node_sources[i]

    def select(self, keep: Sequence[int]) -> Draft:
        """The nodes ``keep`` (ascending indices; a kept node's parent is kept too, or is the root)
        as a draft, with their sources; ``score`` recomputed from their survival."""
        surv = self.survival()
        new_index = {i: k for k, i in enumerate(keep)}
        ns = self.node_sources
        return Draft([self.token_ids[i] for i in keep], [new_index.get(self.parents[i], -1) for i in keep],
                     [self.probs[i] for i in keep], float(sum(surv[i] for i in keep)), self.source,
                     None if ns is None else [ns[i] for i in keep])

    def survival(self) -> list[float]:
        """Per-node survival estimate: the product of ``probs`` along the node's path from the root
        (the chance the verifier accepts it, as far as the drafter knows)."""
        surv: list[float] = []
        probs = self.probs
        for i, p in enumerate(self.parents):
            surv.append(probs[i] * (surv[p] if p >= 0 else 1.0))
        return surv

    def expected(self) -> float:
        """Expected accepted tokens: ``score`` when the drafter set one, else the sum of survival."""
        if self.score > 0.0 or not self.token_ids:
            return float(self.score)
        return float(sum(self.survival()))

    def prefix(self, k: int) -> "Draft":
        """The first ``k`` nodes (a tree: parents precede children), ``score`` recomputed from their
        survival. ``k >= len`` returns this draft; ``k <= 0`` returns ``EMPTY_DRAFT``."""
        n = len(self.token_ids)
        if k >= n:
            return self
        if k <= 0:
            return EMPTY_DRAFT
        return Draft(self.token_ids[:k], self.parents[:k], self.probs[:k], float(sum(self.survival()[:k])),
                     self.source, None if self.node_sources is None else self.node_sources[:k])

    def validate(self, budget: int) -> None:
        """Raise ValueError if this is not a well-formed tree of at most ``budget`` tokens."""
        n = len(self.token_ids)
        if len(self.parents) != n or len(self.probs) != n:
            raise ValueError(
                f"draft from {self.source!r}: token_ids, parents and probs differ in length "
                f"({n}, {len(self.parents)}, {len(self.probs)})"
            )
        if self.node_sources is not None and len(self.node_sources) != n:
            raise ValueError(f"draft from {self.source!r} has {len(self.node_sources)} node sources for {n} tokens")
        if n > budget:
            raise ValueError(f"draft from {self.source!r} has {n} tokens, over the budget of {budget}")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft from {self.source!r}: parents[{i}] = {p} must be in [-1, {i})")

    @staticmethod
    def chain(token_ids: Sequence[int], probs: Sequence[float] | float = 1.0, *, source: str = "") -> "Draft":
        """A linear draft; ``probs`` per token or one value for all."""
        n = len(token_ids)
        p = [float(probs)] * n if isinstance(probs, (int, float)) else [float(x) for x in probs]
        survival, score = 1.0, 0.0
        for x in p:
            survival *= x
            score += survival
        return Draft([int(t) for t in token_ids], list(range(-1, n - 1)), p, score, source)


EMPTY_DRAFT = Draft([], [], [], 0.0, "")


def trie_draft(continuations: Sequence[tuple[float, Sequence[int]]], *, conf: float, budget: int,
               min_survival: float, source: str) -> Draft:
    """Merge weighted continuations into a trie and keep its likeliest nodes as a draft.

    A node's probability given its parent is ``conf`` times the share of the parent's weight
    that passes through it; nodes are taken best-first by survival (the product along the
    path; ties to the node created first) until ``budget`` nodes or survival < ``min_survival``.
    (suffix_index/reference.py keeps its own copy: it is the bit-exact spec of the C++ core.)
    """
    children: list[dict[int, int]] = [{}]
    weight, tok_of, parent_of = [0.0], [-1], [-1]
    for w, toks in continuations:
        node = 0
        weight[0] += w
        for t in toks:
            nxt = children[node].get(t)
            if nxt is None:
                nxt = len(tok_of)
                children[node][t] = nxt
                children.append({})
                weight.append(0.0)
                tok_of.append(t)
                parent_of.append(node)
            weight[nxt] += w
            node = nxt
    if weight[0] <= 0:
        return EMPTY_DRAFT
    heap = [(-conf * weight[c] / weight[0], c) for c in children[0].values()]
    heapq.heapify(heap)
    index_of = {0: -1}
    survival_of = {0: 1.0}
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    score = 0.0
    while heap and len(tokens) < budget:
        neg, node = heapq.heappop(heap)
        s = -neg
        if s < min_survival:
            break
        index_of[node] = len(tokens)
        tokens.append(tok_of[node])
        parents.append(index_of[parent_of[node]])
        survival_of[node] = s
        probs.append(s / survival_of[parent_of[node]])
        score += s
        for c in children[node].values():
            heapq.heappush(heap, (-s * conf * weight[c] / weight[node], c))
    return Draft(tokens, parents, probs, score, source)


class AcceptanceTracker:
    """Per-request calibration of a drafter's estimates: recent accepted tokens over recent
    estimated ones (exponentially decayed sums), used as ``trust`` by ``cut_for_cost``. A
    drafter that under-estimates a request (a rewrite copying its file) earns longer drafts;
    one that over-estimates (novel prose) gets shorter ones."""

    __slots__ = ("est", "got", "decay")

    def __init__(self, prior: float = 4.0, decay: float = 0.9) -> None:
        self.est = self.got = float(prior)
        self.decay = float(decay)

    @property
    def trust(self) -> float:
        return self.got / self.est

    def update(self, estimated: float, accepted: int) -> None:
        self.est = self.decay * self.est + float(estimated)
        self.got = self.decay * self.got + float(accepted)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def accepted_in_tree(token_ids: Sequence[int], parents: Sequence[int], committed: Sequence[int]) -> int:
    """How many of a proposed tree's tokens the target accepted: the depth to which a path from the
    root spells ``committed`` (a step's new tokens: the accepted ones, then the bonus, not counted)."""
    acc, node = 0, -1
    for t in committed[:-1]:
        nxt = next((i for i, (x, p) in enumerate(zip(token_ids, parents)) if p == node and x == t), None)
        if nxt is None:
            break
        acc, node = acc + 1, nxt
    return acc


def drop_unlikely(draft: Draft, min_survival: float) -> Draft:
    """``draft`` without the tokens whose survival estimate is below ``min_survival`` (their
    descendants go too: a survival never grows along a path when probs are <= 1)."""
    if min_survival <= 0 or not draft.token_ids:
        return draft
    surv = draft.survival()
    keep: list[int] = []
    kept: set[int] = set()
    for i, p in enumerate(draft.parents):
        if surv[i] >= min_survival and (p < 0 or p in kept):
            kept.add(i)
            keep.append(i)
    if len(keep) == len(draft.token_ids):
        return draft
    return draft.select(keep)


def cut_for_cost(draft: Draft, row_cost: float, trust: float = 1.0) -> Draft:
    """The prefix of ``draft`` that maximises expected tokens per step cost.

    A step that verifies k draft tokens costs about ``1 + row_cost * (k - 1)`` one-token steps
    (the first draft token rides along with the root for free: the engine never runs a single
    row) and yields ``1 + sum(survival)`` tokens in expectation, survival being the product of
    ``probs`` along a token's path. Drafters emit nodes best first, so a prefix keeps the
    likeliest tokens, and parents precede children, so every prefix is a tree.
    ``trust`` scales the drafter's estimates (observed accepted / estimated, per request: see
    ``AcceptanceTracker``). ``row_cost <= 0`` keeps the whole draft.
    """
    n = len(draft.token_ids)
    if row_cost <= 0 or n == 0:
        return draft
    surv = draft.survival()
    total, best, best_k = 0.0, 1.0, 0
    for i, s in enumerate(surv):
        total += s
        value = (1.0 + trust * total) / (1.0 + row_cost * i)
        if value > best:
            best, best_k = value, i + 1
    return draft.prefix(best_k)


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft trees for running requests.

    ``start`` opens a request with its prompt; ``extend`` reports tokens now committed (accepted
    tokens and the bonus token); ``propose`` returns a draft of at most ``budget`` tokens that
    continues the committed sequence; ``stop`` releases the request.
    """

    def start(self, req_id: str, prompt: Sequence[int], *, tenant: str = "default") -> None: ...

    def extend(self, req_id: str, tokens: Sequence[int]) -> None: ...

    def propose(self, req_id: str, budget: int) -> Draft: ...

    def stop(self, req_id: str) -> None: ...
