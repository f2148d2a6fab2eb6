"""A draft model: a smaller model of the target's family proposing what the target writes next.

Where the text is new (an agent's reasoning, a fresh function), no index holds it and the suffix
drafts come up short; a small model of the same family and tokenizer (Qwen2.5-Coder 0.5B for the
1.5B) predicts most of it. ``DraftModelDrafter`` runs that model on the engine's own kernels
(``EmbeddedEngine``: its GGUF as it is, quantized linears, native attention), with a KV cache of
its own per request:

- ``propose`` first runs the committed tokens the draft model has not seen through it (the prompt
  once, then each step's accepted tokens and bonus), then drafts a chain of its top-1 tokens,
  each from one forward of the small model, with the runner-up as a leaf where its confidence is
  split, its probabilities as ``Draft.probs`` (the verifier's cost cut reads them). The chain stops
  when the survival estimate falls below ``min_survival``.
- ``extend`` keeps the KV of the chain's tokens the target accepted (they were computed on the
  committed prefix) and rolls the rest back.
- The draft model reads the latest ``window`` tokens of a new request (its prompt's tail, at
  positions from 0): what it drafts from is the recent text, and its prefill stays short. The
  window grows with the request up to ``max_window``, then starts again from the tail.
- Finished requests leave their cache for the tenant's next request (``keep`` per tenant, least
  recently used first out): an agent's next turn shares all of its history with the last one, so
  the draft model prefills only what is new, as the target's prefix cache does.

``Eagle3Gate`` decides per request whether drafting pays: from the target's measured step time, its
cost per verified row and the draft model's own seconds per proposal it computes the break-even
accepted length and turns the model off below it (probing now and then). Beside the index
drafters it is their fallback (registered with ``fallback=True``): asked only when their draft
expects few tokens, and both trees verified together. It only proposes: the verifier keeps the
output exactly the target's.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .draft import EMPTY_DRAFT, Draft, accepted_in_tree, common_prefix
from .eagle3_drafter import Eagle3Gate, GateCosts

__all__ = ["SOURCE", "DraftModelDrafter", "for_engine"]

SOURCE = "draft_model"
PREFILL = 256      # the draft model's prompt runs in forwards of this many rows
HEADROOM = 1024    # a request's cache holds its committed tokens and this many more (then grows)


@dataclass
class _Req:
    tokens: list[int]                          # committed tokens (prompt + output)
    tenant: str
    offset: int = 0                            # the draft model's row 0 is tokens[offset]
    cache: Any = None                          # the draft model's KVCache: rows [0, cache.length) valid
    logits: torch.Tensor | None = None         # the draft model's next-token logits after tokens[:cache.length]
    chain: list[int] = field(default_factory=list)   # the last proposal's chain (KV rows after the committed)
    chain_base: int = 0                        # cache.length when the chain started
    tree: tuple[list[int], list[int]] = ([], [])     # the last proposal (tokens, parents), for the gate
    proposed: bool = False
    declined: bool = False
    seconds: float = 0.0
    gate: Eagle3Gate | None = None


class DraftModelDrafter:
    """Drafts with ``model`` (an ``EmbeddedEngine`` of a smaller model sharing the target's
    tokenizer). ``depth``: the chain's longest; ``min_survival``: stop the chain below this
    estimate; ``leaf_below``: add the runner-up as a leaf where the top-1 is below this
    probability (and the runner-up at least ``min_prob``); ``gate``: an ``Eagle3Gate`` template
    (None: always on); ``keep``: finished caches kept per tenant for its next request."""

    name = SOURCE

    def __init__(self, model: Any, *, depth: int = 8, min_survival: float = 0.1, leaf_below: float = 0.6,
                 min_prob: float = 0.1, gate: Eagle3Gate | None = None, keep: int = 2, window: int = 1024,
                 max_window: int = 4096) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if not 1 <= window <= max_window:
            raise ValueError(f"need 1 <= window <= max_window, got {window}, {max_window}")
        self.window, self.max_window = int(window), int(max_window)
        self.model = model
        self.depth = int(depth)
        self.min_survival, self.leaf_below, self.min_prob = float(min_survival), float(leaf_below), float(min_prob)
        self.gate = gate
        self._prior = gate.clone() if gate is not None else None
        self.keep = max(int(keep), 0)
        self._reqs: dict[str, _Req] = {}
        self._done: dict[str, OrderedDict[int, tuple[list[int], Any]]] = {}   # tenant -> finished caches
        self._lock = threading.Lock()

    # ---- the Drafter protocol -----------------------------------------------------------------

    def start(self, req_id: str, prompt: Sequence[int], *, tenant: str = "default") -> None:
        with self._lock:
            gate = self.gate.clone(self._prior) if self.gate is not None else None
            r = _Req(tokens=list(prompt), tenant=tenant, gate=gate, offset=max(len(prompt) - self.window, 0))
            # the tenant's finished cache whose rows continue this prompt furthest: reused
            best, best_n = None, 0
            for key, (toks, off, cache) in self._done.get(tenant, {}).items():
                if off < len(r.tokens) and toks[:off] == r.tokens[:off]:
                    n = common_prefix(toks[off:off + cache.length], r.tokens[off:])
                    if n > best_n:
                        best, best_n = key, n
            if best is not None:
                _, off, cache = self._done[tenant].pop(best)
                cache.length = min(best_n, len(r.tokens) - off - 1)
                r.cache, r.offset = cache, off
            self._reqs[req_id] = r

    def stop(self, req_id: str) -> None:
        with self._lock:
            r = self._reqs.pop(req_id, None)
            if r is None:
                return
            if r.gate is not None and self._prior is not None:
                self._prior.learn(r.gate)
            if r.cache is not None and self.keep:
                r.cache.length = min(r.cache.length, r.chain_base if r.chain else r.cache.length)
                done = self._done.setdefault(r.tenant, OrderedDict())
                done[id(r.cache)] = (r.tokens, r.offset, r.cache)
                while len(done) > self.keep:
                    done.popitem(last=False)

    def extend(self, req_id: str, tokens: Sequence[int]) -> None:
        r = self._reqs.get(req_id)
        if r is None:
            return
        tokens = list(tokens)
        if r.chain:
            # the chain's tokens the target committed keep their KV rows; the rest roll back
            m = 0
            while m < len(r.chain) and m < len(tokens) and r.chain[m] == tokens[m]:
                m += 1
            r.cache.length = r.chain_base + m
            r.logits = None
            r.chain = []
        if r.proposed and r.gate is not None:
            toks, parents = r.tree
            r.gate.observe(accepted_in_tree(toks, parents, tokens), len(toks), r.seconds, len(tokens))
        elif r.declined and r.gate is not None and tokens:
            r.gate.observe_plain(len(tokens))
        r.proposed = r.declined = False
        r.tokens += tokens

    def propose(self, req_id: str, budget: int) -> Draft:
        r = self._reqs.get(req_id)
        if r is None or budget <= 0:
            return EMPTY_DRAFT
        if r.gate is not None and not r.gate.wants():
            r.declined = True
            return EMPTY_DRAFT
        t0 = time.perf_counter()
        rows = self._catch_up(r)
        t1 = time.perf_counter()
        draft = self._draft(r, budget)
        # the gate weighs a step's work: a long catch-up (the prompt) counts as one step's worth
        catch = (t1 - t0) if rows <= 16 else (t1 - t0) * 16 / rows
        r.seconds = catch + time.perf_counter() - t1
        r.proposed = bool(draft.token_ids)
        return draft

    # ---- internals ----------------------------------------------------------------------------

    def _ensure(self, r: _Req, need: int) -> None:
        """A cache with room for ``need`` rows (a new one, or the old one's rows copied into a bigger one)."""
        eng = self.model
        limit = eng.max_context
        if r.cache is None:
            r.cache = eng.new_cache(min(need + HEADROOM, limit))
        elif r.cache.capacity < need:
            new = eng.new_cache(min(max(need + HEADROOM, 2 * r.cache.capacity), limit))
            n = r.cache.length
            if n:
                new.load(0, r.cache.k[:, :, :n], r.cache.v[:, :, :n])
            new.length = n
            r.cache = new

    def _forward(self, r: _Req, tokens: list[int], start: int, *, prefill: bool) -> torch.Tensor:
        m = self.model.model
        dev = self.model.device
        out = m(torch.tensor(tokens, device=dev), torch.arange(start, start + len(tokens), device=dev), r.cache,
                logits_rows=slice(-1, None), prefill=prefill)
        r.cache.commit(list(range(len(tokens))))
        return out[0]

    def _catch_up(self, r: _Req) -> int:
        """Run the committed tokens the draft model has not seen (in its window); the rows run."""
        if len(r.tokens) - r.offset > self.max_window:   # the window is full: start again from the tail
            r.offset = len(r.tokens) - self.window
            if r.cache is not None:
                r.cache.length = 0
            r.logits = None
        toks = r.tokens[r.offset:]
        n, total = (r.cache.length if r.cache is not None else 0), len(toks)
        if n >= total and r.logits is not None:
            return 0
        if n >= total:          # (rows all there, logits not: run the last token again)
            n = total - 1
        self._ensure(r, total + self.depth + 2)
        r.cache.length = n
        with torch.inference_mode():
            if total - n > PREFILL // 2:   # the prompt, or a long observation: prefill forwards
                a = n
                while a < total:
                    b = min((a // PREFILL + 1) * PREFILL, total)
                    r.logits = self._forward(r, toks[a:b], a, prefill=True)
                    a = b
            else:
                r.logits = self._forward(r, toks[n:], n, prefill=False)
        return total - n

    def _draft(self, r: _Req, budget: int) -> Draft:
        """The chain of the draft model's top-1, a runner-up leaf where its confidence is split."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        survival, parent = 1.0, -1
        logits = r.logits
        r.chain, r.chain_base = [], r.cache.length
        with torch.inference_mode():
            for depth in range(self.depth):
                if len(tokens) >= budget or logits is None:
                    break
                p = torch.softmax(logits.float(), dim=-1)
                top_p, top_i = torch.topk(p, 2)
                (p1, p2), (t1, t2) = top_p.tolist(), top_i.tolist()
                if survival * p1 < self.min_survival:
                    break
                tokens.append(t1)
                parents.append(parent)
                probs.append(p1)
                me = len(tokens) - 1
                if p1 < self.leaf_below and p2 >= self.min_prob and len(tokens) < budget \
                        and survival * p2 >= self.min_survival:
                    tokens.append(t2)
                    parents.append(parent)
                    probs.append(p2)
                survival *= p1
                parent = me
                if depth + 1 < self.depth and len(tokens) < budget:
                    logits = self._forward(r, [t1], r.cache.length, prefill=False)
                    r.chain.append(t1)
                else:
                    logits = None
        r.logits = None   # (the chain's rows moved the cache on: recomputed at the next catch-up)
        r.tree = (tokens, parents)
        score = float(sum(Draft(tokens, parents, probs).survival())) if tokens else 0.0
        return Draft(tokens, parents, probs, score, SOURCE) if tokens else EMPTY_DRAFT


def for_engine(engine: Any, *, gate: bool | None = None, **options: Any) -> DraftModelDrafter:
    """A ``DraftModelDrafter`` on the draft model ``engine`` serves beside its target
    (``EmbeddedEngine.draft_engine``: ``agentspec serve --draft-model FILE``), gated by the target's
    measured step time and ``row_cost`` (``gate``: None = on)."""
    draft = getattr(engine, "draft_engine", None) if engine is not None else None
    if draft is None:
        raise ValueError("drafter 'draft_model' needs a draft model: start the server with --draft-model FILE "
                         "(a smaller GGUF of the same family and tokenizer)")
    g = None
    if gate is None or gate:
        dec = engine.decoder
        g = Eagle3Gate(GateCosts(step_seconds=lambda: dec.step_seconds or 0.01, row_cost=float(engine.row_cost)))
    return DraftModelDrafter(draft, gate=g, **options)
