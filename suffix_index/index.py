"""``SuffixIndex``: the Python face of the native suffix index (``suffix_index._core``).

This layer owns what the core should not: argument validation (every bad value raises
``ValueError`` naming it), token conversion (lists or numpy integer arrays), a lock so a file
watcher thread can add documents while the engine drafts, and crash-safe snapshots. The
algorithm, and what each option means, is specified in ``suffix_index/reference.py``.

Sources a request drafts from: its own context (prompt + committed tokens), its tenant's
history (outputs of the tenant's finished requests, oldest evicted beyond ``history_tokens``)
and its tenant's documents (``add_document`` / ``remove_document``). Nothing crosses tenants.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import _core
from .atomic import write_atomic

__all__ = ["MAX_TOKEN_ID", "Proposal", "SuffixIndex"]

MAX_TOKEN_ID = 2**31 - 1   # token ids are stored as uint32; 0xFFFFFFFF is the text separator

_INT_OPTIONS = {
    "min_ngram": (1, 16),
    "max_ngram": (1, 16),
    "max_candidates": (0, 4096),
    "min_candidates": (1, 4096),
    "max_agreement": (1, 1 << 20),
    "max_branches": (1, 4096),
    "min_draft": (1, 1 << 16),
    "history_tokens": (0, 1 << 40),
}


class Proposal(NamedTuple):
    """A draft tree from ``SuffixIndex.propose``. ``parents[i]`` is the index of token i's parent
    in ``token_ids`` (always < i), or -1 for the request's last token; ``probs[i]`` estimates
    that token i is accepted given its parent is; ``score`` is the expected number of accepted
    tokens (the sum over nodes of the product of ``probs`` along the node's path)."""

    token_ids: list[int]
    parents: list[int]
    probs: list[float]
    score: float


class SuffixIndex:
    """A suffix index over request contexts, tenant histories and documents.

    Options (defaults measured best on recorded traffic, see benchmarks/replay.py):
      min_ngram, max_ngram: lengths of the context suffix looked up (longest first);
      max_candidates: occurrences examined per source and step, and live candidates kept;
      min_candidates: back off to shorter suffixes until at least this many candidates;
      max_agreement: how far back a candidate's agreement with the context is measured;
      max_branches: candidates merged into a draft tree;
      min_draft: draft depth for the weakest match (depth grows as 2 x agreement);
      min_survival: drop draft tokens whose estimated survival is below this;
      arena_weight: weight of history/document candidates relative to the request's own;
      history_tokens: per-tenant budget of remembered outputs (oldest evicted first);
      keep_outputs: add a finished request's output to its tenant's history;
      vocab_size: if given, token ids must be below it.
    """

    def __init__(
        self,
        *,
        min_ngram: int = 1,
        max_ngram: int = 4,
        max_candidates: int = 16,
        min_candidates: int = 8,
        max_agreement: int = 64,
        max_branches: int = 16,
        min_draft: int = 8,
        min_survival: float = 0.01,
        arena_weight: float = 1.0,
        history_tokens: int = 1 << 20,
        keep_outputs: bool = True,
        vocab_size: int | None = None,
    ) -> None:
        opts: dict[str, Any] = dict(
            min_ngram=min_ngram, max_ngram=max_ngram, max_candidates=max_candidates, min_candidates=min_candidates,
            max_agreement=max_agreement, max_branches=max_branches, min_draft=min_draft,
            history_tokens=history_tokens,
        )
        for name, value in opts.items():
            lo, hi = _INT_OPTIONS[name]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        for name, value in (("min_survival", min_survival), ("arena_weight", arena_weight)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1e6:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or not 1 <= vocab_size <= MAX_TOKEN_ID + 1):
            raise ValueError(f"vocab_size must be an integer in [1, {MAX_TOKEN_ID + 1}], got {vocab_size!r}")
        p = _core.Params()
        for name, value in opts.items():
            setattr(p, name, int(value))
        p.min_survival = float(min_survival)
        p.arena_weight = float(arena_weight)
        p.keep_outputs = bool(keep_outputs)
        self._max_token = (vocab_size - 1) if vocab_size is not None else MAX_TOKEN_ID
        p.max_token = self._max_token
        self.options = dict(opts, min_survival=float(min_survival), arena_weight=float(arena_weight),
                            keep_outputs=bool(keep_outputs), vocab_size=vocab_size)
        self._core = _core.Index(p)
        self._lock = threading.Lock()

    # ---- requests ---------------------------------------------------------------------------

    def start(self, req_id: str, prompt: Sequence[int] | np.ndarray, *, tenant: str = "default") -> None:
        """Open a request: its prompt becomes the start of its own searchable context."""
        _check_name("req_id", req_id)
        _check_name("tenant", tenant)
        toks = self._tokens(prompt, "prompt")
        with self._lock:
            self._call(self._core.start, "prompt", prompt, req_id, toks, tenant)

    def extend(self, req_id: str, tokens: Sequence[int] | np.ndarray) -> None:
        """Append committed tokens (accepted + bonus) to a request's context."""
        toks = self._tokens(tokens, "tokens")
        with self._lock:
            self._call(self._core.extend, "tokens", tokens, req_id, toks)

    def propose(self, req_id: str, budget: int) -> Proposal:
        """A draft tree of at most ``budget`` tokens."""
        if type(budget) is not int and (isinstance(budget, bool) or not isinstance(budget, np.integer)) or budget < 0:
            raise ValueError(f"budget must be an integer >= 0, got {budget!r}")
        with self._lock:
            toks, parents, probs, score = self._core.propose(req_id, int(min(budget, 1 << 20)))
        return Proposal(toks, parents, probs, score)

    def stop(self, req_id: str) -> None:
        """Close a request; its output joins its tenant's history (``keep_outputs``)."""
        with self._lock:
            self._core.stop(req_id)

    def candidates(self, req_id: str) -> list[tuple[int, int, int]]:
        """This step's ranked candidates ``(source, pos, agreement)``; source 0 = the request's
        context, 1 = the tenant's arena. Updates the live set as ``propose`` does."""
        with self._lock:
            return self._core.candidates(req_id)

    # ---- documents --------------------------------------------------------------------------

    def add_document(self, doc_id: str, tokens: Sequence[int] | np.ndarray, *, tenant: str = "default") -> None:
        """Add a document to a tenant, or replace the document with this id."""
        _check_name("doc_id", doc_id)
        _check_name("tenant", tenant)
        toks = self._tokens(tokens, "tokens")
        with self._lock:
            self._call(self._core.add_document, "tokens", tokens, doc_id, toks, tenant)

    def remove_document(self, doc_id: str) -> bool:
        """Remove a document; False if there was none with this id."""
        _check_name("doc_id", doc_id)
        with self._lock:
            return self._core.remove_document(doc_id)

    # ---- state ------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Memory held by the index (token storage, hash chains, bookkeeping)."""
        with self._lock:
            return self._core.nbytes

    @property
    def num_requests(self) -> int:
        return self._core.num_requests

    def history_tokens(self, tenant: str = "default") -> int:
        """Tokens of remembered outputs held for a tenant."""
        return self._core.history_tokens(tenant)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"nbytes": self._core.nbytes, "requests": self._core.num_requests,
                    "request_tokens": self._core.request_tokens, "arena_tokens": self._core.arena_tokens}

    def save(self, path: str | os.PathLike) -> None:
        """Write tenants' histories and documents to ``path`` atomically (temp file, fsync,
        rename): a crash leaves the previous snapshot intact. Active requests are not saved."""
        with self._lock:
            blob = self._core.dump()
        write_atomic(path, blob)

    def load(self, path: str | os.PathLike) -> None:
        """Replace histories and documents with a snapshot written by ``save``. Needs an index
        without active requests; a damaged file raises ValueError and changes nothing."""
        blob = Path(path).read_bytes()
        with self._lock:
            if self._core.num_requests:
                raise ValueError(f"load() needs an index without active requests ({self._core.num_requests} active)")
            try:
                self._core.load(blob)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None

    # ---- helpers ----------------------------------------------------------------------------

    def _call(self, fn, what: str, original, *args):
        """Call the core; a list the core could not convert gets the full check for its message."""
        try:
            return fn(*args)
        except TypeError:
            self._tokens(np.asarray(original) if not isinstance(original, list) else original, what, strict=True)
            raise
        except ValueError as e:
            if str(e).startswith("token id"):
                raise ValueError(f"{what}: {e}") from None
            raise

    def _tokens(self, tokens, what: str, *, strict: bool = False):
        """Tokens as the core takes them: a list (converted and range-checked by the core) or a
        contiguous uint32 array. ``strict`` checks a list element by element (for the message)."""
        if type(tokens) is list and not strict:
            return tokens
        if isinstance(tokens, np.ndarray):
            arr = tokens
        elif isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Sequence):
            raise ValueError(f"{what} must be a list of token ids or a numpy integer array, "
                             f"got {type(tokens).__name__}")
        elif len(tokens) == 0:
            return np.zeros(0, np.uint32)
        else:
            for t in tokens:
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                    raise ValueError(f"{what} must hold integer token ids, got {t!r}")
                if not 0 <= t <= self._max_token:
                    raise ValueError(f"{what}: token id {t} out of range [0, {self._max_token}]")
            arr = np.asarray(tokens, dtype=np.int64)
        if arr.ndim != 1:
            raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{what} must have an integer dtype, got {arr.dtype}")
        if arr.size and (arr.dtype.kind == "i" or arr.dtype.itemsize > 4):
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi > self._max_token:
                bad = lo if lo < 0 else hi
                raise ValueError(f"{what}: token id {bad} out of range [0, {self._max_token}]")
        return np.ascontiguousarray(arr, dtype=np.uint32)


def _check_name(what: str, value: Any) -> None:
    if not isinstance(value, str) or not value or value.startswith("\x00"):
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
