"""Grammar-constrained decoding: a request's grammar as token masks, exact with speculation.

Terms. A *grammar* (llguidance: a JSON schema, Lark, a regex) allows a set of tokens at each
position, given the tokens before it; its *mask* is that set. *Plain constrained decoding* takes
at each position the target's token among the allowed ones: the argmax of the masked logits
(greedy), or the seeded draw (``verify.seeded_target``) from the masked logits (sampled: the mask
first, then temperature, top-k and top-p act on what is left, as vLLM applies its bitmask).

Speculation gives the very same tokens (``Decoder.step``):

- every verified row uses the mask plain decoding would apply there: the matcher consumes the
  tokens of the path the verification walk accepts, so the target of node i is computed in the
  grammar state after root..i, and the bonus token is consumed with them;
- greedy shortcut (exact): the row's unmasked argmax, when the grammar allows it, is the masked
  argmax too (masking only removes tokens; the first-index tie rule is kept); the full mask is
  computed only for rows whose argmax the grammar refuses;
- before verification each draft is cut to its grammar-legal nodes (``Constraint.legal``): an
  illegal token can never equal a masked target, so this only saves rows;
- once the grammar is finished only EOS is legal: the request ends there.

``llguidance`` is imported here lazily: only a request with a grammar loads it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..drafting.draft import Draft
from ..errors import InvalidRequestError

__all__ = ["Constraint", "ConstraintFactory"]


class Constraint:
    """One request's grammar state: an ``llguidance.LLMatcher`` that has consumed every token the
    request committed (or, inside a verification walk, the path accepted so far).

    ``vocab``: the logits' width (the model's vocabulary rows; a mask is this long). ``eos``: the
    tokenizer's end-of-sequence ids (consuming one finishes the constraint). ``seconds``: time
    spent in the grammar (masks, checks, consumption, pruning), for the request's stats;
    ``masks``: full masks computed (the greedy shortcut's misses, and every sampled row)."""

    __slots__ = ("_m", "vocab", "eos", "eos_ids", "finished", "seconds", "masks", "_bits", "_ids")

    def __init__(self, matcher: Any, *, vocab: int, eos: Iterable[int]) -> None:
        self._m = matcher
        self.vocab = int(vocab)
        self.eos_ids = sorted(int(t) for t in eos)
        self.eos = frozenset(self.eos_ids)
        self.finished = False      # an EOS token was consumed: nothing follows
        self.seconds = 0.0
        self.masks = 0
        self._bits: np.ndarray | None = None   # [vocab] bool: this state's mask, once computed
        self._ids: np.ndarray | None = None    # its allowed token ids, ascending

    @property
    def matcher(self) -> Any:
        """The ``llguidance.LLMatcher`` (for tests and benchmarks)."""
        return self._m

    @property
    def stopped(self) -> bool:
        """Nothing but EOS may follow: the grammar is complete and allows no more (or EOS came)."""
        return self.finished or self._m.is_stopped()

    @property
    def end_token(self) -> int:
        """The EOS token a finished grammar's position takes (the output ends there, the token
        itself is never part of it)."""
        return self.eos_ids[0]

    def allows(self, token: int) -> bool:
        """Whether the mask allows ``token`` next, computing the mask only where it must.

        Where the grammar forces no bytes, llguidance's mask is exactly the set of tokens its
        parser takes (``validate_tokens``: one token, ~1 us). Where it forces bytes (after ``{``
        a JSON key's ``"name": "``), the mask keeps only the canonical tokenization of them
        (``{"`` but not ``{``), which ``validate_tokens`` does not check: there the mask decides
        (cheap in llguidance then: one token, or the few that start the forced bytes)."""
        t0 = time.perf_counter()
        try:
            if self.stopped:
                return int(token) in self.eos
            if self._bits is None and not self._m.compute_ff_bytes():
                return self._m.validate_tokens([int(token)]) == 1
        finally:
            self.seconds += time.perf_counter() - t0
        return bool(self._mask_bits()[int(token)])

    def _mask_bits(self) -> np.ndarray:   # [vocab] bool
        if self._bits is None:
            t0 = time.perf_counter()
            packed = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)   # one bit per token, LSB first
            bits = np.unpackbits(packed, bitorder="little", count=min(self.vocab, 8 * packed.size)).astype(np.bool_)
            if bits.size < self.vocab:   # (logits wider than the tokenizer: those rows are no tokens)
                bits = np.concatenate([bits, np.zeros(self.vocab - bits.size, np.bool_)])
            self._bits = bits
            self.masks += 1
            self.seconds += time.perf_counter() - t0
        return self._bits

    def _allowed_ids(self) -> np.ndarray:   # [n] int64, ascending
        if self._ids is None:
            self._ids = np.flatnonzero(self._mask_bits())
        return self._ids

    def mask(self) -> torch.Tensor:   # [vocab] bool: True where the grammar allows the token next
        """The full mask in the current state (computed once per state)."""
        return torch.from_numpy(self._mask_bits().copy())

    def masked(self, logits: torch.Tensor) -> torch.Tensor:   # [V] -> [V] float32, refused tokens -inf
        """``logits`` as float32 with every token the grammar refuses at -inf (a new tensor): what
        a sampled row draws from (``verify.seeded_target``)."""
        bits = self._mask_bits()
        t0 = time.perf_counter()
        if logits.device.type == "cpu":
            x = _float_row(logits)
            x[~bits] = -np.inf
            out = torch.from_numpy(x)
        else:
            out = logits.float().masked_fill(~self.mask().to(logits.device), float("-inf"))
        self.seconds += time.perf_counter() - t0
        return out

    def masked_argmax(self, logits: torch.Tensor) -> int:   # logits: [V]
        """``logits.masked_fill(~mask, -inf).argmax()``: the first index of the maximum among the
        allowed tokens. On CPU in numpy (one thread: a row is too small for torch's parallel
        kernels, which cost 0.2 ms and far more on a busy machine), reading only the allowed
        tokens when they are at most half of them."""
        ids = self._allowed_ids()
        t0 = time.perf_counter()
        if ids.size == 0:   # (nothing allowed: llguidance stops the matcher; the output ends)
            best = self.end_token
        elif logits.device.type != "cpu":
            best = int(logits.masked_fill(~self.mask().to(logits.device), float("-inf")).argmax())
        elif ids.size <= self.vocab // 2:
            best = int(ids[int(np.argmax(_float_row(logits, ids)))])
        else:
            x = _float_row(logits)
            x[~self._bits] = -np.inf
            best = int(np.argmax(x))
        self.seconds += time.perf_counter() - t0
        return best

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance past ``tokens`` (committed, or accepted by a verification walk); an EOS token
        finishes the constraint and what follows it is ignored. A token the grammar refuses is a
        bug in the caller (only allowed tokens are ever taken): RuntimeError with llguidance's reason."""
        if self.finished:
            return
        t0 = time.perf_counter()
        try:
            for t in tokens:
                self._bits = self._ids = None
                if t in self.eos:
                    self.finished = True
                    return
                if not self._m.consume_token(int(t)) or self._m.is_error():
                    raise RuntimeError(f"the grammar refused token {t} that decoding took: {self._m.get_error()}")
        finally:
            self.seconds += time.perf_counter() - t0

    def legal_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (a path from the current state) the grammar takes in a row; the
        state is left as it is. An EOS counts when the grammar may end there; nothing after it does."""
        if self.finished:
            return 0
        toks = [int(t) for t in tokens]
        for j, t in enumerate(toks):
            if t in self.eos:
                toks = toks[:j + 1]
                break
        if not toks:
            return 0
        t0 = time.perf_counter()
        n = self._m.validate_tokens(toks)
        self.seconds += time.perf_counter() - t0
        return n

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces next (it admits exactly one continuation: a fixed key, a
        closing brace or tag), at most ``limit``, as llguidance tokenizes them; the state is left
        as it is. A draft, not a commitment: the model may write the same text in other tokens,
        and verification decides (``Decoder.propose_many`` proposes them)."""
        if self.finished or limit <= 0 or self._m.is_stopped():
            return []
        t0 = time.perf_counter()
        try:
            toks = [int(t) for t in self._m.compute_ff_tokens()[:limit]]
        finally:
            self.seconds += time.perf_counter() - t0
        out: list[int] = []
        for t in toks:   # (EOS ends the output: it is never drafted)
            if t >= self.vocab or t in self.eos:
                break
            out.append(t)
        return out

    def legal(self, draft: Draft) -> Draft:
        """``draft`` cut to the nodes whose tokens root..node the grammar takes (a tree still:
        a kept node's parent is kept; probabilities and node sources go with their nodes). One
        ``validate_tokens`` per leaf path: a node is legal iff it lies within some leaf path's
        legal prefix."""
        n = len(draft.token_ids)
        if n == 0:
            return draft
        parents, toks = draft.parents, draft.token_ids
        has_child = [False] * n
        for p in parents:
            if p >= 0:
                has_child[p] = True
        ok = [False] * n
        for leaf in range(n):
            if has_child[leaf] or ok[leaf]:
                continue
            path = []
            i = leaf
            while i >= 0:
                path.append(i)
                i = parents[i]
            path.reverse()
            k = self.legal_prefix([toks[i] for i in path])
            for i in path[:k]:
                ok[i] = True
        if all(ok):
            return draft
        keep = [i for i in range(n) if ok[i]]
        return draft.select(keep) if keep else Draft([], [], [], 0.0, draft.source)


class ConstraintFactory:
    """Compiles grammars into ``Constraint`` s for one model: its tokenizer (``agentspec.backends.
    tokenizer.Tokenizer``, whose ``.backend`` is a ``tokenizers.Tokenizer``) and its logits'
    width ``vocab``. The llguidance tokenizer is built once, on the first grammar (about a
    second for a 150k vocabulary), and shared by every request."""

    def __init__(self, tokenizer: Any, *, vocab: int) -> None:
        self.tokenizer = tokenizer
        self.vocab = int(vocab)
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> Any:
        """The ``llguidance.LLTokenizer`` (built on first use)."""
        if self._ll_tokenizer is None:
            with self._lock:
                if self._ll_tokenizer is None:
                    self._ll_tokenizer = self._build()
        return self._ll_tokenizer

    def _build(self) -> Any:
        llguidance = _llguidance()
        tok = self.tokenizer
        # the mask covers the logits' rows; a tokenizer with more entries than the model has rows
        # (it never happens with the families we load) would need them too
        n_vocab = max(self.vocab, tok.backend.get_vocab_size(with_added_tokens=True))
        return llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=n_vocab, eos_token=sorted(tok.eos_token_ids))

    def compile(self, grammar: str) -> Constraint:
        """A fresh ``Constraint`` for ``grammar`` (an llguidance grammar: ``LLMatcher.grammar_from_
        json_schema`` / ``grammar_from_lark`` output, or Lark text). A grammar llguidance refuses
        raises InvalidRequestError (param "grammar") with its reason."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise InvalidRequestError(f"grammar must be a non-empty string (an llguidance grammar), got "
                                      f"{grammar!r:.80}", param="grammar")
        llguidance = _llguidance()
        ll_tokenizer = self.ll_tokenizer
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"grammar: {matcher.get_error()}", param="grammar")
        c = Constraint(matcher, vocab=self.vocab, eos=self.tokenizer.eos_token_ids)
        c.seconds = time.perf_counter() - t0
        return c


def _float_row(logits: torch.Tensor, ids: np.ndarray | None = None) -> np.ndarray:
    """A CPU row of logits ``[V]`` (or its entries ``ids``) as a new float32 numpy array, the
    same values ``logits.float()`` gives (bfloat16 widened bit for bit)."""
    row = logits.detach()
    if row.dtype == torch.bfloat16:
        a = row.contiguous().view(torch.int16).numpy().view(np.uint16)
        a = a if ids is None else a[ids]
        return (a.astype(np.uint32) << 16).view(np.float32)   # a bfloat16 is a float32's upper half
    a = row.numpy()
    return (a if ids is None else a[ids]).astype(np.float32)   # (a copy either way)


def _llguidance():
    try:
        import llguidance
    except ImportError as e:   # a dependency of agentspec-serve: only a broken install lacks it
        raise RuntimeError("grammar-constrained decoding needs the llguidance package: pip install llguidance "
                           f"({e})") from None
    return llguidance
