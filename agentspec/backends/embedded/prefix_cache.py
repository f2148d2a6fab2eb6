"""Prefix cache: prompt KV that later requests with the same prefix reuse instead of prefilling.

Terms. A *chunk* is ``chunk_tokens`` (C) prompt tokens at positions ``[jC, (j+1)C)``; the
prefill of every prompt runs chunk by chunk at these absolute boundaries (``Decoder.prefill``:
the *canonical* prefill). A *hit* of k chunks: the request copies the first kC tokens' keys and
values from the cache and prefills from chunk k on. A *salt* keys one tree: the tenant, or one
salt for everyone in shared mode (vLLM's ``cache_salt``: a tenant cannot time another's prompts).

Structure: per salt, a radix tree over token ids whose edges are whole chunks (a chunk's tokens
are its key), so a node is one chunk's KV and its path from the root is the prefix that KV
depends on. LRU eviction by bytes: only leaves are evicted (a node's descendants depend on it),
least recently used first, never a node that is pinned (a request copying from it).

Exactness: output with a hit equals output without it, token for token (greedy) and for a
seeded sampled request. The argument: (1) a chunk's KV depends only on the tokens up to its end:
the canonical prefill computes chunk j from the same inputs (its tokens, positions and the
prefix's KV) with the same kernels and shapes (C rows, keys ``[0, (j+1)C)``) whether or not the
prefix came from the cache, and float kernels are deterministic for given inputs and shapes (the
GEMMs and ``prefill_attention``'s block matmuls do not depend on the thread count here:
``tests/unit/test_prefix_cache_tree.py`` checks it on this machine). (2) Only whole chunks computed by
prefill are stored, bit for bit (the bfloat16 values a bfloat16 model writes into its float32
cache are stored as bfloat16, an exact round trip), and a hit stops at least one token short of
the prompt's end, so the last chunk, whose last row gives the first token, is always computed.
Tokens computed by decode steps (the previous turn's output) are never reused: decode rows run
other kernels than prefill rows and would round differently. (3) Eviction only removes reuse;
a miss prefills the same chunks the same way. Prefill and decode attention do differ in
rounding, so a cache that reused decode-time KV, or prefilled a remainder in a shape the
uncached run did not use, would not be exact; the canonical chunking is what makes it so. (On
CPUs with AMX the whole prompt layer runs row-invariant kernels, ``Block.forward_amx``: there a
row's bits do not depend on the split at all, and ``Decoder.prefill`` runs several chunks per
forward; the argument above holds a fortiori.)

Reuse to the token. Where the prefill is *split-invariant* -- every prompt row's bits depend
on its own tokens and the keys before it, not on how the prompt was cut into forwards: the
quantized linears (row by row) with the blockwise prefill attention (``model.prefill_attention``
and ``prefill_attention_sdpa``: every block of queries at the whole block's shapes),
``Transformer.prefill_granularity`` 1 -- any prefix of a chunk's KV is the KV a shorter prompt
computes, and (2) above holds for any prefix. There a prompt also stores its partial last chunk
(a leaf with a shorter key), and a lookup goes on past the whole chunks: the child of the last
matched node (a whole chunk, or an earlier prompt's partial one) sharing the longest prefix with
the ids that follow gives that many more tokens (``lookup(max_tokens=)``). An agent's next turn
then reuses its whole previous prompt instead of stopping at the last chunk boundary. The tokens
of the previous answer are prefilled again (decode rows run other kernels, as said).

The structure holds opaque payloads with a byte size; ``Decoder`` stores ``(k, v)`` tensors.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...drafting.draft import common_prefix

__all__ = ["CHUNK_TOKENS", "PrefixCache", "PrefixCacheStats", "PrefixHit"]


CHUNK_TOKENS = 256  # a multiple of PREFILL_BLOCK and more than SMALL_T (model.py)


@dataclass
class PrefixCacheStats:
    """Counters since start (``observe_*``): lookups, hits, tokens served from the cache."""

    lookups: int = 0
    hits: int = 0                # lookups that reused at least one chunk
    cached_tokens: int = 0       # prompt tokens served from the cache
    prefilled_tokens: int = 0    # prompt tokens prefilled (requests that looked up)
    inserted_chunks: int = 0
    evicted_chunks: int = 0

    def observe_lookup(self, cached: int, prefilled: int) -> None:
        self.lookups += 1
        self.hits += cached > 0
        self.cached_tokens += cached
        self.prefilled_tokens += prefilled

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]                 # this chunk's token ids (() for a root)
    parent: "_Node | None"
    payload: Any = None
    nbytes: int = 0
    pins: int = 0
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)


@dataclass
class PrefixHit:
    """The chunks a lookup matched, pinned until ``PrefixCache.release``: their payloads in order."""

    payloads: list[Any]
    nodes: list[_Node]
    tokens: int                          # the tokens served: whole chunks, then ``tail`` of the last payload
    tail: int = 0                        # > 0: the last payload serves only its first ``tail`` tokens


class PrefixCache:
    """Radix tree of chunk payloads per salt, with LRU eviction under ``capacity_bytes``.

    ``shared``: one tree for every tenant (operators who want system prompts shared); else one
    per tenant. Thread-safe: the batch scheduler and single requests may look up at once.
    """

    def __init__(self, capacity_bytes: int, *, chunk_tokens: int = CHUNK_TOKENS, shared: bool = False) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.capacity_bytes = capacity_bytes
        self.chunk_tokens = chunk_tokens
        self.shared = bool(shared)
        self.bytes = 0
        self.stats = PrefixCacheStats()
        self._roots: dict[str, _Node] = {}
        self._lru: OrderedDict[int, _Node] = OrderedDict()   # id(node) -> node, least recently used first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Chunks held."""
        return len(self._lru)

    def salt(self, tenant: str) -> str:
        return "" if self.shared else tenant

    def lookup(self, tenant: str, ids: Sequence[int], *, max_chunks: int | None = None,
               max_tokens: int | None = None) -> PrefixHit:
        """The longest cached chunk prefix of ``ids`` (at most ``max_chunks`` chunks), pinned.
        ``max_tokens`` (a split-invariant prefill only: see "Reuse to the token"): at most that many
        tokens, the last chunk served in part where a child shares only a prefix with ``ids``."""
        C = self.chunk_tokens
        limit = len(ids) if max_tokens is None else min(max_tokens, len(ids))
        n = limit // C if max_chunks is None else min(max_chunks, limit // C)
        nodes: list[_Node] = []
        tail = 0
        with self._lock:
            node = self._roots.get(self.salt(tenant))
            for j in range(n):
                if node is None:
                    break
                nxt = node.children.get(tuple(ids[j * C:(j + 1) * C]))
                if nxt is None:
                    break
                nodes.append(nxt)
                node = nxt
            if max_tokens is not None and node is not None:
                rest = ids[len(nodes) * C:min(len(nodes) * C + C, limit)]
                best, tail = None, 0
                for key, child in node.children.items():
                    m = common_prefix(key, rest)
                    if m > tail:
                        best, tail = child, m
                if best is not None:
                    nodes.append(best)
            for nd in nodes:   # root to leaf: a descendant is always more recent than its ancestors
                nd.pins += 1
                self._lru.move_to_end(id(nd))
        whole = len(nodes) - (1 if tail else 0)
        return PrefixHit(payloads=[nd.payload for nd in nodes], nodes=nodes, tokens=whole * C + tail, tail=tail)

    def release(self, hit: PrefixHit) -> None:
        """Unpin a lookup's chunks (idempotent)."""
        with self._lock:
            for nd in hit.nodes:
                nd.pins -= 1
            hit.nodes = []

    def insert(self, tenant: str, ids: Sequence[int], n_chunks: int,
               payload: Callable[[int], tuple[Any, int]], *, tail: bool = False) -> int:
        """Store chunks ``0..n_chunks-1`` of ``ids``; ``payload(j)`` -> (chunk j's payload, its
        bytes), called only for chunks not cached yet. ``tail`` (a split-invariant prefill): also
        the partial chunk after them (``payload(n_chunks)``: the rest of ``ids``), as a leaf, unless
        a child there already holds it. Evicts least recently used leaves to make room; stops
        (keeping what fits) when nothing more can be evicted. Returns chunks added."""
        C = self.chunk_tokens
        n_chunks = min(n_chunks, len(ids) // C)
        if tail and n_chunks * C >= len(ids):
            tail = False
        added = 0
        with self._lock:
            salt = self.salt(tenant)
            node = self._roots.get(salt)
            if node is None:
                node = self._roots[salt] = _Node(key=(), parent=None)
            root = node
            path: list[_Node] = []
            try:
                for j in range(n_chunks + (1 if tail else 0)):
                    key = tuple(ids[j * C:(j + 1) * C])
                    child = node.children.get(key)
                    if child is None and len(key) < C:
                        # a partial chunk: nothing to add where a child already starts with it
                        holder = next((c for k, c in node.children.items() if k[:len(key)] == key), None)
                        if holder is not None:
                            self._lru.move_to_end(id(holder))
                            break
                    if child is None:
                        self._drop_covered(node, key)
                        data, nbytes = payload(j)
                        if not self._make_room(nbytes):
                            break
                        child = _Node(key=key, parent=node, payload=data, nbytes=nbytes)
                        node.children[key] = child
                        self.bytes += nbytes
                        self.stats.inserted_chunks += 1
                        added += 1
                    child.pins += 1          # the path being extended is not evictable
                    path.append(child)
                    self._lru[id(child)] = child
                    self._lru.move_to_end(id(child))
                    node = child
            finally:
                for nd in path:
                    nd.pins -= 1
                if root.children:   # (room made by evicting the root's last leaf dropped it from _roots)
                    self._roots[salt] = root
        return added

    def _drop_covered(self, node: _Node, key: tuple[int, ...]) -> None:
        """Partial-chunk leaves under ``node`` that ``key`` extends: the new child holds them too."""
        for k, c in list(node.children.items()):
            if len(k) < len(key) and key[:len(k)] == k and not c.children and c.pins == 0:
                self._remove(c)

    def _make_room(self, nbytes: int) -> bool:
        """Evict LRU unpinned leaves until ``nbytes`` more fit (the lock is held)."""
        if nbytes > self.capacity_bytes:
            return False
        while self.bytes + nbytes > self.capacity_bytes:
            victim = next((nd for nd in self._lru.values() if not nd.children and nd.pins == 0), None)
            if victim is None:
                return False
            self._remove(victim)
        return True

    def _remove(self, node: _Node) -> None:
        del self._lru[id(node)]
        del node.parent.children[node.key]
        self.bytes -= node.nbytes
        self.stats.evicted_chunks += 1
        node.payload = None
        parent = node.parent
        if parent.parent is None and not parent.children:   # an empty tree: drop its root
            self._roots = {s: r for s, r in self._roots.items() if r is not parent}

    def clear(self) -> None:
        """Drop every unpinned chunk (pinned ones, being copied, stay until evicted later)."""
        with self._lock:
            while True:
                leaves = [nd for nd in self._lru.values() if not nd.children and nd.pins == 0]
                if not leaves:
                    break
                for nd in leaves:
                    self._remove(nd)
